"""What each optimizer step of a round holds: whole groups, or the round's rows dealt across steps."""

from __future__ import annotations

import random

import pytest

from rlpipe.config import params_from_dict
from rlpipe.train.policy import step_units


def round_rows(groups: int, samples: int) -> dict[int, list[int]]:
    """A round's kept rows by group, as the batch table orders them (a group's rows consecutive); group
    ids are sparse, as after dynamic sampling drops some."""
    return {3 * g: list(range(g * samples, (g + 1) * samples)) for g in range(groups)}


def steps_of(mix: str, rows_of: dict[int, list[int]], epochs: int = 1, seed: str = "r1") -> list[list[list[int]]]:
    cfg = params_from_dict({"update": {"minibatch_mix": mix, "minibatch_prompts": 4, "epochs": epochs}}).update
    return list(step_units(rows_of, cfg, random.Random(seed)))


@pytest.mark.parametrize("epochs", [1, 2])
def test_groups_hold_whole_groups_and_rows_deal_every_row_once_per_epoch(epochs):
    rows_of = round_rows(groups=10, samples=8)
    by_groups, by_rows = steps_of("groups", rows_of, epochs), steps_of("rows", rows_of, epochs)
    # the same number of steps either way: ceil(10 / 4) per epoch
    assert len(by_groups) == len(by_rows) == 3 * epochs
    assert all(unit in rows_of.values() for step in by_groups for unit in step)
    for epoch in range(epochs):
        dealt = [row for step in by_rows[3 * epoch : 3 * (epoch + 1)] for unit in step for row in unit]
        assert sorted(dealt) == list(range(80))  # every row once in each epoch
    sizes = [sum(len(unit) for unit in step) for step in by_rows]
    assert max(sizes) - min(sizes) <= 1  # 80 rows in 3 steps: 26 or 27 each
    for step in by_rows:
        rows = [unit[0] for unit in step]
        assert all(len(unit) == 1 for unit in step) and rows == sorted(rows)  # a prompt's rows sit together
        # a step sees most prompts, where a step of groups sees 4 of 10
        assert len({row // 8 for row in rows}) >= 8


def test_rows_are_shuffled_by_the_seeded_stream():
    rows_of = round_rows(groups=10, samples=8)
    assert steps_of("rows", rows_of) == steps_of("rows", rows_of)
    assert steps_of("rows", rows_of) != steps_of("rows", rows_of, seed="r2")
    unshuffled = list(step_units(rows_of, params_from_dict({"update": {"minibatch_mix": "rows", "minibatch_prompts": 4,
                                                                       "shuffle": False}}).update, random.Random(0)))
    assert [unit[0] for unit in unshuffled[0]] == list(range(26))
