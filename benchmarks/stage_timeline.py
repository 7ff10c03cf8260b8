"""The timeline of a finished `dvc repro`, from the stage metrics every stage process writes.

Each `runs/stage_metrics/<stage>[_rK].json` is written last by its stage process, so its mtime is the
process's end, and `stage/process_seconds` its whole life: start = mtime - process_seconds. What lies
between one stage's end and the next one's start is DVC's own time (lock rewrite, hashing outputs,
checking the next stage's deps and params).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROUND_ORDER = {"rollout": 0, "reward": 1, "advantage": 2, "update": 3}


@dataclass
class Span:
    stage: str
    round_index: int | None
    start: float
    end: float
    metrics: dict

    @property
    def seconds(self) -> float:
        return self.end - self.start


def timeline(root: Path) -> list[Span]:
    """Every stage execution of the project's last run, in order. (Before runs/stage_metrics existed,
    these files were in runs/metrics: an older checkout's run is read there.)"""
    spans = []
    for path in [*(root / "runs/stage_metrics").glob("*.json"), *(root / "runs/metrics").glob("*_r*.json"),
                 *(root / "runs/metrics").glob("[a-z]*[a-z].json")]:
        metrics = json.loads(path.read_text())
        if "stage/process_seconds" not in metrics:
            continue
        stage, _, round_name = path.stem.partition("_r")
        end = path.stat().st_mtime
        spans.append(Span(stage if round_name else path.stem, int(round_name) if round_name else None,
                          end - metrics["stage/process_seconds"], end, metrics))
    return sorted(spans, key=lambda s: s.start)


def gaps(spans: list[Span]) -> list[tuple[Span, float]]:
    """(stage, DVC's time before it) for every stage after the first."""
    return [(b, b.start - a.end) for a, b in zip(spans, spans[1:])]


def round_walls(spans: list[Span]) -> dict[int, float]:
    """Round K's wall seconds: from the end of the stage before its rollout to the end of its update
    (its four stages and DVC's time before each)."""
    starts, walls = {}, {}
    for before, span in zip(spans, spans[1:]):
        if span.stage == "rollout":
            starts[span.round_index] = before.end
        elif span.stage == "update" and span.round_index in starts:
            walls[span.round_index] = span.end - starts[span.round_index]
    return walls


def round_dvc_seconds(spans: list[Span]) -> dict[int, float]:
    """Round K's seconds in DVC: the gaps before each of its four stages (hashing the outputs and deps
    it records, the lock rewrite, the checks)."""
    seconds: dict[int, float] = {}
    for span, gap in gaps(spans):
        if span.round_index is not None:
            seconds[span.round_index] = seconds.get(span.round_index, 0.0) + gap
    return seconds


def round_work_seconds(spans: list[Span]) -> dict[int, float]:
    """Round K's own work, measured inside its four stages: each stage's library call
    (`stage/work_seconds`) less what it waited on the md5s handed to DVC (`stage/hash_wait_seconds`,
    which is the tool's, not the work's). Compute and the write of the artifacts, in the same run."""
    seconds: dict[int, float] = {}
    for span in spans:
        if span.round_index is not None and span.stage in ROUND_ORDER:
            work = span.metrics.get("stage/work_seconds", 0.0) - span.metrics.get("stage/hash_wait_seconds", 0.0)
            seconds[span.round_index] = seconds.get(span.round_index, 0.0) + work
    return seconds
