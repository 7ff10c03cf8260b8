"""Where every artifact lives, relative to the repo root (the stages' working directory).

One place, so that `dvc.yaml`, the stages and the tests agree; `dvc.yaml` spells the same paths.
"""

from __future__ import annotations

from pathlib import Path

RUNS = Path("runs")
DATA = RUNS / "data"
TRAIN = DATA / "train.parquet"
TEST = DATA / "test.parquet"
METRICS = RUNS / "metrics"
PLOTS = RUNS / "plots"
EVAL = METRICS / "eval.json"
ROUND_CURVE = METRICS / "rounds.json"
TRAINER_STATE = "trainer_state.json"
NO_CRITIC_MARKER = "NO_CRITIC.json"


def policy_dir(round_name: str) -> Path:
    return RUNS / "policy" / round_name


def critic_dir(round_name: str) -> Path:
    return RUNS / "critic" / round_name


def round_dir(round_name: str) -> Path:
    return RUNS / "rounds" / round_name


def rollouts_path(round_name: str) -> Path:
    return round_dir(round_name) / "rollouts.parquet"


def rewards_path(round_name: str) -> Path:
    return round_dir(round_name) / "rewards.parquet"


def batch_path(round_name: str) -> Path:
    return round_dir(round_name) / "batch.parquet"


def update_metrics_path(round_name: str) -> Path:
    return METRICS / f"update_{round_name}.json"


def round_metrics_path(round_name: str, stage: str) -> Path:
    return METRICS / f"{stage}_{round_name}.json"


def previous_round(round_name: str) -> str:
    return f"r{int(round_name[1:]) - 1}"


def round_index(round_name: str) -> int:
    return int(round_name[1:])
