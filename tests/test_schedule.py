"""The learning-rate schedule: hand-computed values, its config rules, and the rates a round's update
uses, carried by the global step so that a rerun of a round reproduces them."""

from __future__ import annotations

import math

import pytest

from rlpipe.config import ParamsError, params_from_dict
from rlpipe.train.schedule import Schedule, learning_rate

BASE = Schedule(lr=1e-3, warmup_steps=4, decay_steps=12, min_lr_ratio=0.1)


def test_constant_and_linear_warmup():
    assert [learning_rate("constant", s, Schedule(1e-3, 0, None, 0.0)) for s in (1, 50)] == [1e-3, 1e-3]
    assert [learning_rate("linear_warmup", s, BASE) for s in (1, 2, 4, 5, 100)] == pytest.approx(
        [2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3])


def test_cosine_by_hand():
    # warmup to step 4, then from 1e-3 at step 4 down to 0.1 * 1e-3 at step 12: halfway (step 8) is
    # 1e-3 * (0.1 + 0.9 * (1 + cos(pi / 2)) / 2) = 5.5e-4; flat at 1e-4 from step 12 on
    rates = {s: learning_rate("cosine", s, BASE) for s in (2, 4, 8, 10, 12, 30)}
    assert rates[2] == pytest.approx(5e-4) and rates[4] == pytest.approx(1e-3)
    assert rates[8] == pytest.approx(5.5e-4)
    assert rates[10] == pytest.approx(1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi * 0.75)) / 2))
    assert rates[12] == pytest.approx(1e-4) and rates[30] == pytest.approx(1e-4)


@pytest.mark.parametrize("update, key", [
    ({"lr_schedule": "constant", "warmup_steps": 5}, "update.warmup_steps"),
    ({"lr_schedule": "cosine"}, "update.lr_decay_steps"),
    ({"lr_schedule": "cosine", "warmup_steps": 10, "lr_decay_steps": 10}, "update.lr_decay_steps"),
    ({"lr_schedule": "step"}, "update.lr_schedule"),
    ({"min_lr_ratio": 1.5}, "update.min_lr_ratio"),
])
def test_bad_schedules_name_their_key(update, key):
    with pytest.raises(ParamsError) as err:
        params_from_dict({"update": update})
    assert f"  {key}: " in str(err.value)


def test_cosine_without_a_horizon_says_what_this_run_would_use():
    with pytest.raises(ParamsError) as err:
        params_from_dict({"rounds": 10, "rollout": {"prompts_per_round": 512}, "update": {"lr_schedule": "cosine",
                                                                                          "minibatch_prompts": 64}})
    assert "80 for these 10 rounds of 8 steps" in str(err.value)


def test_a_rounds_update_uses_the_rates_of_its_global_steps(tmp_path, monkeypatch):
    """Round 2's update continues the global step that round 1's checkpoint carries, and uses the rates of
    those steps; rerun, it writes the same trainer state and weights."""
    import json

    import torch

    from rlpipe import paths
    from rlpipe.data.splits import write_splits
    from rlpipe.runner import execute
    from rlpipe.stages.init import init_policy
    from test_rounds import mini_params

    params = mini_params(**{"update.lr_schedule": "cosine", "update.warmup_steps": 1, "update.lr_decay_steps": 3})
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    write_splits(params.data, params.seed, tmp_path / paths.TRAIN, tmp_path / paths.TEST)
    init_policy(params, tmp_path / paths.TRAIN, tmp_path / paths.policy_dir("r0"))
    execute("value_pretrain", params)
    for round_name in ("r1", "r2"):
        for stage in ("rollout", "reward", "advantage", "update"):
            execute(stage, params, round_name)

    def state(name: str) -> dict:
        return json.loads((tmp_path / paths.policy_dir(name) / paths.TRAINER_STATE).read_text())

    first, last = state("r1")["global_step"] + 1, state("r2")["global_step"]
    assert 1 < first <= last
    schedule = Schedule(params.update.lr, 1, 3, 0.0)
    expected = [learning_rate("cosine", step, schedule) for step in range(first, last + 1)]
    assert state("r2")["summary"]["lr_mean"] == pytest.approx(sum(expected) / len(expected))
    weights = (tmp_path / paths.policy_dir("r2") / "model.safetensors").read_bytes()
    saved = (tmp_path / paths.policy_dir("r2") / paths.TRAINER_STATE).read_text()
    execute("update", params, "r2")
    assert (tmp_path / paths.policy_dir("r2") / paths.TRAINER_STATE).read_text() == saved
    assert (tmp_path / paths.policy_dir("r2") / "model.safetensors").read_bytes() == weights
