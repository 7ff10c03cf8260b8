"""The critic's ceiling: Monte-Carlo values of every response prefix under the current policy.

For each probed response and each of its states s_t (the prompt and the first t response tokens, t = 0 ..
T-1: the states the critic values), K continuations are sampled from the policy through the configured
backend (`generate_from_ids`, the one generation path) and scored as the responses of the round are (the
verifier's reward, plus the overlong penalty where the algorithm shapes with it). Their mean estimates
V*(s_t); `rlpipe.models.critic.oracle_explained_variance` turns it into the EV no critic can beat.
Enabled by `value.oracle_ev.continuations` (docs/params.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable

import torch

from rlpipe.config import Params
from rlpipe.models import transformers_warnings_off
from rlpipe.rewards import verify
from rlpipe.rewards.shaping import overlong_penalty
from rlpipe.rollout.base import SamplingSpec
from rlpipe.rollout.generate import generate_from_ids


def prefix_values(backend, prompt_ids: list[list[int]], response_ids: list[list[int]], score, *, continuations: int,
                  stream: str, seed: int, spec: SamplingSpec,
                  tasks: list[Hashable] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, noise), each (B, W) with W the longest response: the mean score of `continuations`
    continuations of every prefix, and that mean's estimated variance (sample variance / K; NaN for K = 1);
    0 past each response's end. `score(rows, full_response_ids)` scores whole responses of the given rows.

    A continuation of prefix t may take spec.max_new_tokens - t tokens, as the rest of the response did:
    all are generated with room for the longest and cut there, which draws the same tokens (sampling is
    one token at a time, each row with its own seeded uniforms).

    `tasks` holds, per row, what its score depends on besides the response (its answer and meta). States
    of rows with the same prompt ids and task and the same prefix are one state, V* of one state is one
    number, so they share one set of continuations: those their first occurrence draws, seeded as if it
    were alone. The responses to one prompt mostly start alike (on reasoning, 44% of the states of 8
    responses a prompt are distinct), so this saves more than half the generation. None: no sharing."""
    width = max(len(r) for r in response_ids)
    states = [(b, t) for b, response in enumerate(response_ids) for t in range(len(response))]
    drawn_by = list(range(len(states)))  # per state, the index in `states` of the state that draws for it
    if tasks is not None:
        first: dict[tuple, int] = {}  # a distinct state -> its first occurrence
        drawn_by = [first.setdefault((tuple(prompt_ids[b]), tasks[b], tuple(response_ids[b][:t])), k)
                    for k, (b, t) in enumerate(states)]
    distinct = sorted(set(drawn_by))
    prefixes = [prompt_ids[b] + response_ids[b][:t] for b, t in (states[k] for k in distinct)]
    # Every continuation gets room for the longest, so late prefixes run past the model's context;
    # transformers then warns that generation "exceeded the model's predefined maximum length". Those
    # tokens are cut below (each state keeps max_new_tokens - t), and no kept token depends on them.
    with transformers_warnings_off("transformers.generation.stopping_criteria"):
        groups = generate_from_ids(backend, prefixes, distinct, greedy_pattern=[False] * continuations,
                                   stream=stream, seed=seed, spec=spec, desc=f"{stream}: sample")
    full, rows = [], []
    for j, ids in enumerate(groups.output.response_ids):
        b, t = states[distinct[j // continuations]]
        # cut at the room left (no eos then: one would have ended the continuation before)
        full.append(response_ids[b][:t] + ids[: spec.max_new_tokens - t])
        rows.append(b)
    scores = torch.tensor(score(rows, full), dtype=torch.float64).view(len(distinct), continuations)
    position = {k: j for j, k in enumerate(distinct)}
    scores = scores[[position[k] for k in drawn_by]]  # each state gets the draws of the one drawing for it
    values, noise = torch.zeros((len(response_ids), width)), torch.zeros((len(response_ids), width))
    index = torch.tensor(states).T if states else torch.zeros((2, 0), dtype=torch.long)
    values[index[0], index[1]] = scores.mean(dim=1).float()
    if continuations > 1:
        noise[index[0], index[1]] = (scores.var(dim=1, unbiased=True) / continuations).float()
    else:  # one draw has no spread to estimate it from (value pretraining's targets may take K = 1)
        noise[index[0], index[1]] = float("nan")
    return values, noise


def outcome_scorer(params: Params, tokenizer, answers: list[str], metas: list[str]):
    """`score(rows, response_ids)` as the round scores responses: the verifier's reward of each decoded
    response (against its row's answer), plus DAPO's overlong penalty when the algorithm adds it."""
    shaping = params.algorithm.resolve().overlong_shaping
    max_new, cache = params.rollout.max_new_tokens, params.reward.overlong_cache_len

    def score(rows: list[int], response_ids: list[list[int]]) -> list[float]:
        texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        verdicts = verify(params.resolved_verifier(), texts, [answers[b] for b in rows], [metas[b] for b in rows],
                          desc="oracle: score")
        return [v.reward + (overlong_penalty(len(ids), max_new, cache) if shaping else 0.0)
                for v, ids in zip(verdicts, response_ids)]

    return score


def continuation_means(params: Params, backend, prompt_ids: list[list[int]], response_ids: list[list[int]],
                       answers: list[str], metas: list[str], continuations: int,
                       stream: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefix_values` of these responses under the policy `backend` generates from, sampled with the
    rollout's settings and scored as the round scores (`outcome_scorer`)."""
    rollout = params.rollout
    return prefix_values(backend, prompt_ids, response_ids, outcome_scorer(params, backend.tokenizer, answers, metas),
                         continuations=continuations, stream=stream, seed=params.seed,
                         spec=SamplingSpec(rollout.max_new_tokens, rollout.temperature, rollout.top_k, rollout.top_p),
                         tasks=list(zip(answers, metas)))


def probed_rows(count: int, cap: int, seed: int, stream: str) -> list[int]:
    """A seeded sample of at most `cap` of `count` rows, in order."""
    return sorted(random.Random(f"{seed}:{stream}").sample(range(count), min(cap, count)))


def oracle_metrics(params: Params, backend, prompt_ids: list[list[int]], response_ids: list[list[int]],
                   answers: list[str], metas: list[str], returns: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor, stream: str) -> dict[str, float]:
    """The oracle EV of a batch (rows of (B, T) `returns`, `values`, `mask`, as the critic's EV reads
    them) on a seeded sample of `value.oracle_ev.max_responses` responses, with the critic's EV on the
    same sample and their ratio."""
    from rlpipe.models.critic import (bootstrap_fractions, explained_variance, fraction_of_ceiling,
                                      oracle_explained_variance, percentile_interval)

    cfg = params.value.oracle_ev
    started = time.perf_counter()
    rows = probed_rows(len(response_ids), cfg.max_responses, params.seed, stream)
    oracle, noise = continuation_means(params, backend, [prompt_ids[i] for i in rows], [response_ids[i] for i in rows],
                                       [answers[i] for i in rows], [metas[i] for i in rows], cfg.continuations, stream)
    width = oracle.shape[1]
    probed = [t[rows][:, :width] for t in (returns, values, mask)]
    ceiling = oracle_explained_variance(probed[0], probed[2], oracle, noise)
    critic = explained_variance(probed[1], probed[0], probed[2])
    low, high = percentile_interval(bootstrap_fractions(probed[0], probed[2], oracle, noise, {"critic": probed[1]},
                                                        seed=params.seed)["critic"])
    return {"value/oracle_explained_variance": ceiling,
            "value/oracle_explained_variance_uncorrected": oracle_explained_variance(probed[0], probed[2], oracle),
            "value/probed_explained_variance": critic,
            "value/ev_fraction_of_ceiling": fraction_of_ceiling(critic, ceiling),
            # how far the probed responses pin the fraction down (docs/critic.md: 64 of them pin it loosely)
            "value/ev_fraction_of_ceiling_low": low, "value/ev_fraction_of_ceiling_high": high,
            "value/oracle_probed_responses": len(rows), "value/oracle_probed_states": int(probed[2].sum()),
            "value/oracle_seconds": time.perf_counter() - started}
