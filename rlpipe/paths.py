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
STAGE_METRICS = RUNS / "stage_metrics"
PLOTS = RUNS / "plots"
# Reports about a run, not its artifacts: they hold wall times, so two runs of the same params differ
# here and only here (the byte-identity tests and the disk benchmark leave these folders out).
REPORTS = (METRICS, STAGE_METRICS, PLOTS)
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


def fingerprint_path(stage: str) -> Path:
    """The params values and code hashes round stage `stage` depends on (`rlpipe.fingerprints`)."""
    return RUNS / "fingerprints" / f"{stage}.json"


def stage_metrics_path(stage: str, round_name: str | None = None) -> Path:
    """What one stage execution measured (its metrics and timings): a log of the last execution, written
    by the stage process and not a DVC output (one DVC output of the kind per stage and round would make
    `dvc exp show` a table of hundreds of columns, and a stage with an uncached output never enters DVC's
    run cache). The results `dvc exp show` lists are eval.json's."""
    return STAGE_METRICS / (f"{stage}_{round_name}.json" if round_name else f"{stage}.json")


def previous_round(round_name: str) -> str:
    return f"r{int(round_name[1:]) - 1}"


def round_index(round_name: str) -> int:
    return int(round_name[1:])
