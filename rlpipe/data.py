"""Prompt data: building the train/test splits (`prepare`) and choosing each round's prompts.

Torch-free. Each split is a `PROMPTS` table: prompt_id, prompt (text given to the policy), answer
(the reference the verifier checks), meta (task detail, e.g. the expected steps of `chain`).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa

from rlpipe import artifacts, paths
from rlpipe.config import DataConfig
from rlpipe.tasks import Example, generate_split


def synthetic_splits(cfg: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, test): seeded, disjoint prompts of the configured synthetic task."""
    test = generate_split(cfg.task, seed * 2 + 1, cfg.num_test, cfg.digits, cfg.chain_terms)
    train = generate_split(cfg.task, seed * 2, cfg.num_train, cfg.digits, cfg.chain_terms,
                           exclude=frozenset(e.prompt for e in test))
    return train, test


def _columns(examples: list[Example]) -> dict[str, list]:
    return {
        "prompt_id": list(range(len(examples))),
        "prompt": [e.prompt for e in examples],
        "answer": [e.answer for e in examples],
        "meta": [e.meta for e in examples],
    }


def prepare(cfg: DataConfig, seed: int, train_path: Path = paths.TRAIN, test_path: Path = paths.TEST) -> dict:
    train, test = synthetic_splits(cfg, seed)
    artifacts.write_table(train_path, _columns(train), artifacts.PROMPTS)
    artifacts.write_table(test_path, _columns(test), artifacts.PROMPTS)
    return {"train_prompts": len(train), "test_prompts": len(test)}


def read_prompts(path: Path) -> pa.Table:
    table = artifacts.read_table(path, artifacts.PROMPTS)
    if table.num_rows == 0:
        raise artifacts.ArtifactError(f"{path}: no prompts (0 rows)")
    return table


def round_prompt_rows(num_prompts: int, count: int, seed: int, round_name: str) -> list[int]:
    """Row indices of the `count` prompts of a round: a seeded permutation per round, without
    replacement while the split lasts (several permutations back to back when count exceeds it)."""
    rng = random.Random(f"{seed}:prompts:{round_name}")
    rows: list[int] = []
    while len(rows) < count:
        perm = list(range(num_prompts))
        rng.shuffle(perm)
        rows += perm[: count - len(rows)]
    return rows
