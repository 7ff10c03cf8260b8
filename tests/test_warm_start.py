"""The SFT warm start: a fixed number of steps, or until a check on held-out train prompts reaches
`model.warm_start.target_pass_at_1`."""

from __future__ import annotations

import pytest

from rlpipe.config import ParamsError, params_from_dict
from rlpipe.data.tasks import generate_split, target_text
from rlpipe.models.policy import build_tiny_model
from rlpipe.stages.init import warm_start_check
from rlpipe.train.sft import warm_start

TINY = {"layers": 1, "hidden": 32, "heads": 2, "intermediate": 64, "max_positions": 32}


def addition_rows(count: int) -> dict[str, list]:
    examples = generate_split("addition", 0, count, 2, 3)
    return {"prompt_id": list(range(count)), "prompt": [e.prompt for e in examples],
            "answer": [e.answer for e in examples], "meta": [e.meta for e in examples]}


def params(**warm_start) -> object:
    return params_from_dict({"model": {"tiny": TINY, "warm_start": {"steps": 40, "batch_size": 8, **warm_start}},
                             "rollout": {"max_new_tokens": 4}})


def sft(p, tokenizer, check):
    """The warm start of a fresh tiny model on 64 addition prompts, with `check` as its check."""
    rows = addition_rows(64)
    return warm_start(build_tiny_model(p.model.tiny, tokenizer, 0), tokenizer, rows["prompt"],
                      [target_text(a, m, "addition", False) for a, m in zip(rows["answer"], rows["meta"])],
                      p.model.warm_start, 0, check=check)


def test_without_a_target_sft_runs_every_step_and_never_checks(tokenizer):
    calls = []
    log = sft(params(check_every=5), tokenizer, check=lambda: calls.append(1) or 1.0)
    assert len(log.losses) == 40 and log.checks == [] and calls == []


def test_sft_stops_at_the_first_check_that_reaches_the_target(tokenizer):
    p = params(target_pass_at_1=0.3, check_every=5)
    readings = iter([0.1, 0.29, 0.3, 0.9])
    log = sft(p, tokenizer, check=lambda: next(readings))
    assert log.checks == [(5, 0.1), (10, 0.29), (15, 0.3)] and len(log.losses) == 15
    # never reached: `steps` is the most it runs
    log = sft(p, tokenizer, check=lambda: 0.0)
    assert len(log.losses) == 40 and [s for s, _ in log.checks] == [5, 10, 15, 20, 25, 30, 35, 40]


def test_the_check_holds_its_prompts_out_of_sft_and_scores_them_greedily(tokenizer):
    p, rows = params(target_pass_at_1=0.3, check_prompts=16), addition_rows(64)
    model = build_tiny_model(p.model.tiny, tokenizer, 0)
    sft_rows, check = warm_start_check(p, model, tokenizer, rows)
    assert len(sft_rows) == 48 and sft_rows == warm_start_check(p, model, tokenizer, rows)[0]  # seeded
    other_seed = params_from_dict({**p.model_dump(), "seed": 1})
    assert sft_rows != warm_start_check(other_seed, model, tokenizer, rows)[0]
    # decoded and verified: a random model writes no right sum
    assert check() == 0.0


def test_the_target_is_a_fraction():
    for bad in (0, 1.5):
        with pytest.raises(ParamsError, match="model.warm_start.target_pass_at_1"):
            params(target_pass_at_1=bad)
