"""The critic's ceiling: the oracle explained variance from known success rates, and the Monte-Carlo
prefix values it is computed from."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rlpipe.config import params_from_dict
from rlpipe.config.params import ParamsError
from rlpipe.models.critic import bootstrap_fractions, explained_variance, oracle_explained_variance, percentile_interval
from rlpipe.rollout.base import GenerationOutput, SamplingSpec
from rlpipe.rollout.oracle import prefix_values, probed_rows

# Two responses, lambda = gamma = 1: G_t is the outcome at every token. A (3 tokens) is right, B (2) wrong.
RETURNS = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
# success rates of each prefix under the policy: A's rise to 1, B's fall
SUCCESS = torch.tensor([[0.5, 0.75, 1.0], [0.5, 0.25, 9.0]])  # 9: past B's end, must be ignored


def test_oracle_ev_of_known_success_rates():
    # G = [1, 1, 1, 0, 0]: Var = 0.24. G - V* = [.5, .25, 0, -.5, -.25]: mean 0, Var = 0.625 / 5 = 0.125
    assert oracle_explained_variance(RETURNS, MASK, SUCCESS) == pytest.approx(1 - 0.125 / 0.24)  # 23/48
    # an estimated V* with noise variance 0.01 per state: 0.01 of the residual is the estimate's own
    noise = torch.full_like(SUCCESS, 0.01)
    assert oracle_explained_variance(RETURNS, MASK, SUCCESS, noise) == pytest.approx(1 - 0.115 / 0.24)  # 25/48
    # it is the critic's EV with V* as the critic, and no critic of the prefix beats it here
    assert oracle_explained_variance(RETURNS, MASK, SUCCESS) == pytest.approx(explained_variance(SUCCESS, RETURNS, MASK))
    assert explained_variance(torch.full_like(SUCCESS, 0.6), RETURNS, MASK) == pytest.approx(0.0)
    assert oracle_explained_variance(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2)) != \
        oracle_explained_variance(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2))  # NaN


def test_the_fractions_interval_comes_from_draws_of_the_responses():
    # 200 responses of the hand-made pair: the oracle as critic is the ceiling on every draw
    returns, mask, success = RETURNS.repeat(100, 1), MASK.repeat(100, 1), SUCCESS.repeat(100, 1)
    noisy = success + 0.3 * torch.randn(success.shape, generator=torch.Generator().manual_seed(0))
    draws = bootstrap_fractions(returns, mask, success, None, {"oracle": success, "noisy": noisy}, resamples=400)
    assert percentile_interval(draws["oracle"]) == pytest.approx((1.0, 1.0))
    low, high = percentile_interval(draws["noisy"])
    point = explained_variance(noisy, returns, mask) / oracle_explained_variance(returns, mask, success)
    assert low < point < high < 1.0 and high - low < 0.5
    # the same draws again from the same seed; draws with no ceiling (NaN, inf) leave no interval
    assert bootstrap_fractions(returns, mask, success, None, {"noisy": noisy}, resamples=400)["noisy"] == draws["noisy"]
    assert all(math.isnan(bound) for bound in percentile_interval([float("nan"), float("inf")]))
    # one response: every draw's returns are constant, so no ceiling and no interval (the stage's 4 probed
    # responses of the smoke run can draw that)
    lone = bootstrap_fractions(RETURNS[:1], MASK[:1], SUCCESS[:1], None, {"c": SUCCESS[:1]}, resamples=10)["c"]
    assert all(math.isnan(bound) for bound in percentile_interval(lone))


class ToyTokenizer:
    eos_token_id = 2

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(t) for t in row if t != self.eos_token_id) for row in ids]


class ToyBackend:
    """Continuations alternate between [7, 7, 7, eos] and [8, eos] (rows of one prefix are consecutive)."""

    tokenizer = ToyTokenizer()

    def __init__(self):
        self.prompts = []

    def generate(self, rows, spec, desc=""):
        self.prompts, self.seeds, self.uniforms = rows.prompt_ids, rows.prompt_seeds, rows.uniforms
        out = GenerationOutput()
        for k in range(len(rows.prompt_ids)):
            ids = [7, 7, 7, 2] if k % 2 == 0 else [8, 2]
            out.response_ids.append(ids[: spec.max_new_tokens])
        return out


def test_prefix_values_average_the_continuations_and_cut_them_at_the_room_left():
    backend = ToyBackend()
    scored = []

    def score(rows, responses):  # right when the response ends in 7 (eos aside)
        scored.extend(responses)
        return [float([t for t in r if t != 2][-1:] == [7]) for r in responses]

    values, noise = prefix_values(backend, [[1, 5], [1, 6]], [[7, 2], [8, 8, 2]], score, continuations=2,
                                  stream="oracle@test", seed=0, spec=SamplingSpec(4, 1.0, 0, 1.0))
    # every state: one continuation right, one wrong -> V = 0.5, noise = var([1, 0], ddof 1) / 2 = 0.25
    assert values.tolist() == [[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]]
    assert noise.tolist() == [[0.25, 0.25, 0.0], [0.25, 0.25, 0.25]]
    # the states: the prompt, then the prompt and the first t tokens of the response
    assert backend.prompts[::2] == [[1, 5], [1, 5, 7], [1, 6], [1, 6, 8], [1, 6, 8, 8]]
    # the prefix of 2 tokens leaves room for 2 more (max_new_tokens 4): [7, 7, 7, eos] is cut to [7, 7]
    assert [8, 8, 7, 7] in scored and [8, 8, 8, 2] in scored


def test_equal_states_share_the_continuations_their_first_occurrence_draws():
    """Two responses to one prompt, [7, 2] and [7, 8, 2]: their first two states are the same (the prompt,
    then the prompt and 7), so with `tasks` the same they are drawn once, with the seeds the first
    occurrence has when nothing is shared, and both rows get the same values; a row of another task (its
    score reads another answer) shares nothing."""
    def score(rows, responses):
        return [float(len(r) % 2) for r in responses]

    def run(tasks):
        backend = ToyBackend()
        values, noise = prefix_values(backend, [[1, 5], [1, 5]], [[7, 2], [7, 8, 2]], score, continuations=2,
                                      stream="oracle@test", seed=0, spec=SamplingSpec(4, 1.0, 0, 1.0), tasks=tasks)
        return backend, values, noise

    alone, values_alone, _ = run(None)
    assert len(alone.prompts) == 5 * 2  # every state of every row
    shared, values, noise = run(["a", "a"])
    assert shared.prompts[::2] == [[1, 5], [1, 5, 7], [1, 5, 7, 8]]  # states 0, 1 of row 0, state 2 of row 1
    assert shared.seeds == alone.seeds[:4] + alone.seeds[8:]
    assert torch.equal(shared.uniforms, torch.cat([alone.uniforms[:4], alone.uniforms[8:]]))
    assert values[1, :2].tolist() == values[0, :2].tolist() and noise[1, :2].tolist() == noise[0, :2].tolist()
    assert values[1, 2] == values_alone[1, 2]
    apart = run(["a", "b"])[0]
    assert apart.prompts == alone.prompts and apart.seeds == alone.seeds


def test_probed_rows_are_a_seeded_capped_sample():
    assert probed_rows(10, 4, 0, "s") == probed_rows(10, 4, 0, "s") and len(probed_rows(10, 4, 0, "s")) == 4
    assert probed_rows(3, 64, 0, "s") == [0, 1, 2]


def test_oracle_settings_name_the_key():
    assert params_from_dict({}).value.oracle_ev.continuations == 0  # off by default: it costs generation
    for raw, message in (({"continuations": 1}, "value.oracle_ev.continuations: must be 0 .off. or >= 2"),
                         ({"continuations": -2}, "value.oracle_ev.continuations"),
                         ({"max_responses": 0}, "value.oracle_ev.max_responses")):
        with pytest.raises(ParamsError, match=message):
            params_from_dict({"value": {"oracle_ev": raw}})


def test_continuations_that_run_past_the_context_are_cut_without_a_warning(tiny_model, tokenizer,
                                                                            transformers_warnings):
    """Every continuation is generated with room for the longest, so the late prefixes of a long response
    run past the model's context (the policy's 64 positions here), and transformers warned once per process
    that generation "exceeded the model's predefined maximum length", about tokens that are cut. The
    stage's log stays quiet, and what is kept still fits the response's budget."""
    from rlpipe.rollout.hf import HFBackend

    prompt = tokenizer("12+34=")["input_ids"]
    response = tokenizer("1+2=3;3+4=7;7+5=12;12+6=18;#18")["input_ids"]
    spec = SamplingSpec(len(response) + 8, 1.0, 0, 1.0)
    assert len(prompt) + len(response) - 1 + spec.max_new_tokens > tiny_model.config.max_position_embeddings
    kept = []

    def score(rows, responses):
        kept.extend(responses)
        return [0.0] * len(responses)

    backend = HFBackend(tiny_model, tokenizer, batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a Python warning: one continuation has no variance to estimate
        values, noise = prefix_values(backend, [prompt], [response], score, continuations=1, stream="oracle@test",
                                      seed=0, spec=spec)
    assert transformers_warnings == []
    assert noise.isnan().all()
    assert values.shape == (1, len(response))
    assert len(kept) == len(response) and all(len(r) <= spec.max_new_tokens for r in kept)
