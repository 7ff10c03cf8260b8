"""Value pretraining on a reward the responses show: the critic learns it, and only from what a state sees.

The reward is 1 when a response's first token is "7" and 0 when it is "3". Every response has the same
prompt, so the state before the first token cannot tell them apart (any causal critic gives all of them
one value) and every later state shows the outcome. The best critic's explained variance on the held-out
responses is therefore known exactly; value pretraining must come close to it and can never pass it. A
critic read at the wrong position (one token late) would see the first token from the first state and
pass it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import yaml

from rlpipe.config.params import params_from_dict
from rlpipe.models.critic import explained_variance, load_critic
from rlpipe.models.sequences import pad_ragged
from rlpipe.train.critic import ValueTargets, monte_carlo_returns, predict, pretrain_critic, split_rows

REPO = Path(__file__).resolve().parents[1]


def mini_params(**value):
    raw = yaml.safe_load((REPO / "tests" / "params_mini.yaml").read_text())
    raw["algorithm"]["preset"] = "ppo"
    raw["value"]["lr"] = 1e-3
    raw["value"]["pretrain"].update(value)
    return params_from_dict(raw, "tests/params_mini.yaml")


def first_token_samples(tokenizer, first_tokens: str, per_group: int):
    """One prompt; each response is one digit of `first_tokens` then eos, reward 1 where it is "7";
    `per_group` rows a group: (prompt, response_ids, rewards, groups)."""
    digit = {d: tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    response_ids = [[digit[d], tokenizer.eos_token_id] for d in first_tokens]
    rewards = torch.tensor([float(r[0] == digit["7"]) for r in response_ids])
    return (tokenizer.encode("12+34=", add_special_tokens=True), response_ids, rewards,
            [i // per_group for i in range(len(response_ids))])


def held_out_targets(params, prompt, response_ids, rewards, groups) -> ValueTargets:
    """The rows of the groups value pretraining holds out, with their Monte-Carlo returns."""
    rows = split_rows(params.seed, groups)[1]
    mask = pad_ragged([response_ids[i] for i in rows], 0, torch.long)[1]
    returns = monte_carlo_returns(rewards[rows], mask, params.algorithm.resolve().gamma)
    return ValueTargets([prompt] * len(rows), [response_ids[i] for i in rows], returns, None, mask)


def test_value_pretraining_learns_what_the_state_shows_and_no_more(tokenizer, tiny_model_dir, tmp_path):
    params = mini_params(max_steps=60, min_explained_variance=1.0)
    rng = random.Random(0)
    digit = {d: tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    prompt = tokenizer.encode("12+34=", add_special_tokens=True)
    n_groups, per_group = 64, params.rollout.samples_per_prompt
    response_ids = [[digit[rng.choice("73")], digit[rng.choice("0123456789")], tokenizer.eos_token_id]
                    for _ in range(n_groups * per_group)]
    rewards = torch.tensor([float(r[0] == digit["7"]) for r in response_ids])
    groups = [i // per_group for i in range(len(response_ids))]

    metrics = pretrain_critic(params, [prompt] * len(response_ids), response_ids, rewards, groups, tiny_model_dir,
                              tmp_path / "critic")

    targets = held_out_targets(params, prompt, response_ids, rewards, groups)
    returns, mask = targets.returns, targets.mask
    best = returns.clone()  # later states: the outcome itself; the first state: the best one value for all
    best[:, 0] = returns[:, 0].mean()
    ceiling = explained_variance(best, returns, mask)
    assert 0.6 < ceiling < 0.7  # a third of the states cannot know (sanity of the construction)
    assert metrics["value/explained_variance"] <= ceiling + 1e-6
    assert metrics["value/explained_variance"] > 0.8 * ceiling

    # the written critic reloads to the same held-out predictions, and the first state's are all one value
    critic, _ = load_critic(tmp_path / "critic")
    values = predict(critic, targets, params, tokenizer.pad_token_id)
    assert explained_variance(values, returns, mask) == metrics["value/explained_variance"]
    assert torch.allclose(values[:, 0], values[0, 0].expand(len(values)))


def test_cosine_value_pretraining_walks_its_rate_down_to_near_zero(tokenizer, tiny_model_dir, tmp_path, monkeypatch):
    """`value.pretrain.lr_schedule: cosine`: step k runs at value.lr (1 + cos(pi k / max_steps)) / 2, so the
    first step has the whole rate and the last one a sliver of it; `constant` keeps value.lr."""
    import math

    import rlpipe.train.critic as critic_training

    prompt, response_ids, rewards, groups = first_token_samples(tokenizer, "73" * 16, per_group=4)
    real_step = critic_training.value_step
    for schedule in ("constant", "cosine"):
        params = mini_params(max_steps=4, min_explained_variance=1.0, lr_schedule=schedule)
        seen: list[float] = []

        def recording_step(critic, optimizer, *args, **kwargs):
            seen.append(optimizer.param_groups[0]["lr"])
            return real_step(critic, optimizer, *args, **kwargs)

        monkeypatch.setattr(critic_training, "value_step", recording_step)
        pretrain_critic(params, [prompt] * len(response_ids), response_ids, rewards, groups, tiny_model_dir,
                        tmp_path / schedule)
        expected = [1e-3] * 4 if schedule == "constant" else [1e-3 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]
        assert seen == pytest.approx(expected, rel=1e-12), schedule


@pytest.mark.parametrize("targets", ["outcome", "on_track"])
def test_the_verifier_phase_runs_on_its_own_rate_and_schedule(tiny_model_dir, tmp_path, monkeypatch, targets):
    """The phase is value pretraining's loop with `verifier_lr`, `verifier_steps` and `verifier_lr_schedule`
    in place of value pretraining's own; early stopping off. Its targets are the rows' rewards, or with
    `verifier_targets: on_track` each state's on-track label."""
    from transformers import AutoTokenizer

    import rlpipe.train.critic as critic_training

    seen = {}

    def capture(phase, *args, **kwargs):
        seen["value"], seen["state_targets"] = phase.value, kwargs["state_targets"]
        return {"value/explained_variance": 0.0, "value/pretrain_steps": phase.value.pretrain.max_steps}

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    right, near_miss = (tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
                        for text in ("123", "13"))
    monkeypatch.setattr(critic_training, "pretrain_critic", capture)
    monkeypatch.setattr(critic_training, "verifier_rows",
                        lambda *args: ([[1], [1]], [right, near_miss], [1.0, 0.0], [0, 0], [["123"], ["123"]]))
    params = mini_params(max_steps=5, lr_schedule="constant", verifier_steps=7, verifier_lr=0.01,
                         verifier_lr_schedule="cosine", target_continuations=2, verifier_targets=targets)
    critic_training.pretrain_verifier(params, tiny_model_dir, tmp_path / "train.parquet", tmp_path / "verifier")
    if targets == "outcome":  # pretrain_critic then takes the rows' returns from their rewards
        assert seen["state_targets"] is None
    else:  # the state after "1" is still on track, the one after "13" is not; padded with 0 after eos
        assert seen["state_targets"].tolist() == [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    assert (seen["value"].lr, seen["value"].pretrain.max_steps) == (0.01, 7)
    assert (seen["value"].pretrain.lr_schedule, seen["value"].pretrain.min_explained_variance) == ("cosine", 1.0)
    assert seen["value"].pretrain.average_from is None  # the phase writes its last step's weights
    assert seen["value"].pretrain.target_continuations == 0  # its rows' rewards are exact, nothing to sample


def test_weight_average_is_the_mean_of_the_states_it_was_given():
    from rlpipe.train.loop import WeightAverage

    model, states = torch.nn.Linear(3, 2), []
    average = WeightAverage()
    for k in range(3):
        with torch.no_grad():
            model.weight.copy_(torch.randn(2, 3) * (k + 1))
            model.bias.copy_(torch.randn(2))
        states.append({name: p.detach().clone() for name, p in model.named_parameters()})
        average.add(model)
    average.apply(model)
    assert average.count == 3
    for name, param in model.named_parameters():
        assert torch.allclose(param, torch.stack([state[name] for state in states]).mean(0), atol=1e-6)


def test_value_pretraining_writes_the_average_of_its_last_steps(tokenizer, tiny_model_dir, tmp_path, monkeypatch):
    """`value.pretrain.average_from: 0.5` over 6 steps: the critic written is the mean of the weights after
    steps 4, 5 and 6, and the held-out EV reported is that critic's (the last step's is kept beside it)."""
    import rlpipe.train.critic as critic_training

    prompt, response_ids, rewards, groups = first_token_samples(tokenizer, "73" * 32, per_group=4)
    real_step, after_step = critic_training.value_step, []

    def recording_step(critic, *args, **kwargs):
        stats = real_step(critic, *args, **kwargs)
        after_step.append({name: p.detach().clone() for name, p in critic.named_parameters()})
        return stats

    monkeypatch.setattr(critic_training, "value_step", recording_step)
    params = mini_params(max_steps=6, min_explained_variance=1.0, average_from=0.5)
    metrics = pretrain_critic(params, [prompt] * len(response_ids), response_ids, rewards, groups, tiny_model_dir,
                              tmp_path / "critic")
    assert metrics["value/averaged_steps"] == 3 and len(after_step) == 6
    critic, _ = load_critic(tmp_path / "critic")
    for name, param in critic.named_parameters():
        assert torch.allclose(param, torch.stack([state[name] for state in after_step[3:]]).mean(0), atol=1e-6), name
    assert not torch.equal(critic.score.weight, after_step[-1]["score.weight"])

    targets = held_out_targets(params, prompt, response_ids, rewards, groups)
    values = predict(critic, targets, params, tokenizer.pad_token_id)
    assert explained_variance(values, targets.returns, targets.mask) == metrics["value/explained_variance"]
    assert metrics["value/explained_variance_last_step"] != metrics["value/explained_variance"]


class StepRecorder:
    """A tracker that keeps the metrics of each step, as `pretrain_critic` logs them."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.steps[step] = metrics


def test_value_pretraining_evaluates_every_eval_every_steps_and_stops_only_there(tokenizer, tiny_model_dir, tmp_path):
    """`value.pretrain.eval_every: 3` over 7 steps: the held-out EV is taken after steps 3, 6 and 7 (the
    last) and at no other; early stopping is checked only there, so a threshold any critic meets stops at
    step 3, not at step 1."""
    prompt, response_ids, rewards, groups = first_token_samples(tokenizer, "73" * 16, per_group=4)
    for threshold, evaluated in ((1.0, [3, 6, 7]), (-1e9, [3])):
        recorder = StepRecorder()
        params = mini_params(max_steps=7, min_explained_variance=threshold, eval_every=3)
        metrics = pretrain_critic(params, [prompt] * len(response_ids), response_ids, rewards, groups,
                                  tiny_model_dir, tmp_path / f"critic-{len(evaluated)}", tracker=recorder)
        assert [step for step, logged in sorted(recorder.steps.items())
                if "value_pretrain/explained_variance" in logged] == evaluated
        assert metrics["value/pretrain_steps"] == evaluated[-1]


def test_continuation_targets_blend_the_return_with_the_continuations_mean():
    """(G_t + K m_t) / (K + 1) on the named rows' valid states, up to the width of `means`; padding stays 0
    and other rows keep their returns."""
    from rlpipe.train.critic import blend_continuations

    returns = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    means = torch.tensor([[0.5, 0.25], [0.75, 0.0]])  # rows 1 and 2, as wide as the longer of them
    blended = blend_continuations(returns, mask[:, :3], [1, 2], means, continuations=3)
    assert blended[0].tolist() == [1.0, 1.0, 1.0]
    assert blended[1].tolist() == pytest.approx([1.5 / 4, 0.75 / 4, 0.0])  # the third state: no mean given
    assert blended[2].tolist() == pytest.approx([3.25 / 4, 1.0 / 4, 0.0])
    assert returns[1].tolist() == [0.0, 0.0, 0.0]  # the input is not changed


def test_value_pretraining_fits_the_continuations_on_its_training_rows_only(tokenizer, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    """`value.pretrain.target_continuations: 2`: the continuations are asked for the training rows and no
    held-out one; every step fits (G_t + 2 m_t) / 3; the held-out EV is still against the returns."""
    import rlpipe.train.critic as critic_training

    prompt, response_ids, rewards, groups = first_token_samples(tokenizer, "73" * 32, per_group=4)
    asked, fitted = [], []

    def means(rows):  # every state's continuations score 1 half of the time
        asked.extend(rows)
        return torch.full((len(rows), 2), 0.5)

    real_step = critic_training.value_step

    def recording_step(critic, optimizer, targets, *args, **kwargs):
        fitted.append(targets.returns[targets.mask])
        return real_step(critic, optimizer, targets, *args, **kwargs)

    monkeypatch.setattr(critic_training, "value_step", recording_step)
    params = mini_params(max_steps=3, min_explained_variance=1.0, target_continuations=2)
    metrics = pretrain_critic(params, [prompt] * len(response_ids), response_ids, rewards, groups, tiny_model_dir,
                              tmp_path / "critic", continuation_means=means)
    assert asked == split_rows(params.seed, groups)[0]
    assert metrics["value/target_continuations"] == 2
    seen = torch.cat(fitted)
    assert sorted(set(seen.tolist())) == pytest.approx([1 / 3, 2 / 3])  # (0 + 1) / 3, (1 + 1) / 3; never 0 or 1

    critic, _ = load_critic(tmp_path / "critic")
    targets = held_out_targets(params, prompt, response_ids, rewards, groups)
    values = predict(critic, targets, params, tokenizer.pad_token_id)
    assert explained_variance(values, targets.returns, targets.mask) == metrics["value/explained_variance"]


def test_continuation_targets_need_undiscounted_returns():
    from rlpipe.config.params import ParamsError

    with pytest.raises(ParamsError, match="value.pretrain.target_continuations.*algorithm.gamma 1"):
        params_from_dict({"algorithm": {"preset": "ppo", "gamma": 0.99}, "value": {"pretrain": {"target_continuations": 2}}})
    assert params_from_dict({"algorithm": {"preset": "ppo"}}).value.pretrain.target_continuations == 0


def test_the_process_labels_hold_while_the_text_is_the_start_of_a_right_response():
    """One label per state (the state before each token, eos included): 1 while the text written so far
    begins a right response, 0 from the first token that leaves them all, and 0 after it for good. Special
    tokens count as the verifier reads them: not at all."""
    from rlpipe.data.tasks import right_responses, task_alphabet
    from rlpipe.models.tokenizer import build_char_tokenizer
    from rlpipe.train.critic import on_track_labels

    tokenizer = build_char_tokenizer(task_alphabet("reasoning"))

    right = right_responses("88", "26+40=66;66+22=88;#88", "reasoning")
    assert right == ["#88", "26+40=66;66+22=88;#88"]
    assert right_responses("57", "", "addition") == ["57"]

    def labels(text: str, extra: list[int] = ()) -> list[float]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return on_track_labels(right, [*ids[:2], *extra, *ids[2:], tokenizer.eos_token_id], tokenizer)

    assert labels("26+40=66;66+22=88;#88") == [1.0] * 22
    slip = "26+40=66;66+22=78;#78"  # the state before the "7" is still on track, the one after it is not
    assert labels(slip) == [1.0] * 16 + [0.0] * 6
    assert labels("#88") == [1.0] * 4 and labels("#87") == [1.0] * 3 + [0.0]
    assert labels("#8") == [1.0] * 3  # a right start stopped early: its outcome is the eos token's to decide
    assert labels("56+40") == [1.0] + [0.0] * 5  # an operand copied wrong
    assert labels("26+40=66;#88") == [1.0] * 10 + [0.0] * 3  # leaves the steps for a bare answer midway
    assert labels("#88", extra=[tokenizer.pad_token_id]) == [1.0] * 5


def test_the_process_phase_fits_its_labels_at_its_own_rate(tokenizer, tiny_model_dir, tmp_path, monkeypatch):
    """`pretrain_process`: value pretraining's loop fits each state's label (not the return of the row's
    reward) at `process_lr` for `process_steps` steps, without early stopping or averaging."""
    import rlpipe.train.critic as critic_training

    prompt, response_ids, _, groups = first_token_samples(tokenizer, "73" * 16, per_group=4)
    labels = {"7": [1.0, 1.0], "3": [1.0, 0.0]}
    row_labels = [labels[tokenizer.decode(r[:1])] for r in response_ids]
    fitted, rates = [], []
    real_step = critic_training.value_step

    def recording_step(critic, optimizer, targets, *args, **kwargs):
        fitted.extend((tokenizer.decode(r[:1]), t[:2].tolist()) for r, t in zip(targets.response_ids, targets.returns))
        rates.append(optimizer.param_groups[0]["lr"])
        return real_step(critic, optimizer, targets, *args, **kwargs)

    monkeypatch.setattr(critic_training, "value_step", recording_step)
    params = mini_params(max_steps=9, average_from=0.5, process_steps=3, process_lr=0.002)
    metrics = critic_training.pretrain_process(params, [prompt] * len(response_ids), response_ids, row_labels, groups,
                                               tiny_model_dir, tmp_path / "process")
    assert rates == [0.002] * 3 and metrics["value/process_steps"] == 3
    assert fitted and all(target == labels[first] for first, target in fitted)
    assert metrics["value/process_rows"] == 32 and metrics["value/process_on_track_share"] == 0.75
    assert (tmp_path / "process" / "model.safetensors").is_file()


def test_a_critic_from_the_policy_gets_a_fresh_head_quietly_and_a_partial_checkpoint_is_refused(
        tiny_model_dir, tmp_path, transformers_warnings):
    """Loading from a policy logs no warning at all: the check listens on the "transformers" logger itself
    and takes every record of WARNING or above (the earlier check looked for "LOAD REPORT" only, and let
    another warning through)."""
    import shutil

    from safetensors.torch import load_file, save_file

    critic, _ = load_critic(tiny_model_dir, from_policy=True)
    # the new value head is expected, not reported; and nothing is printed instead (holding the loading
    # logger at ERROR made transformers 5.19 list the layers its tensor-parallel plan leaves alone)
    assert transformers_warnings == []
    assert critic.score.weight.shape[0] == 1
    shutil.copytree(tiny_model_dir, tmp_path / "critic")  # the tokenizer beside the critic's weights
    critic.save_pretrained(tmp_path / "critic")
    reloaded, _ = load_critic(tmp_path / "critic")
    assert torch.equal(reloaded.score.weight, critic.score.weight)

    with pytest.raises(ValueError, match="score"):  # a trained critic must bring its head
        load_critic(tiny_model_dir)
    partial = tmp_path / "partial"
    shutil.copytree(tmp_path / "critic", partial)
    weights = load_file(partial / "model.safetensors")
    dropped = next(key for key in weights if key.startswith("model.layers.1."))
    save_file({k: v for k, v in weights.items() if k != dropped}, partial / "model.safetensors", metadata={"format": "pt"})
    for from_policy in (False, True):  # a backbone weight missing is never filled in at random
        with pytest.raises(ValueError, match=f"{partial}: not a complete critic checkpoint: missing {dropped}"):
            load_critic(partial, from_policy=from_policy)
