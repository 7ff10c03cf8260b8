"""What every stage entry point shares: validate params, track, time, write metrics, fail clearly.

A stage script is `run_stage("rollout", body)`: the whole params file is validated before any work
(a bad key fails here, before a model loads), the MLflow worker starts, `body(ctx)` does the stage's
one library call and returns its metrics, which go to `runs/metrics/<stage>[_<round>].json` (a DVC
metrics file) and to MLflow. A `PipelineError` prints as one message naming the bad key, file or
column, and exits 1 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from rlpipe import paths
from rlpipe.artifacts import atomic_write_text
from rlpipe.config import Params, load_params
from rlpipe.errors import PipelineError
from rlpipe.progress import bars_enabled
from rlpipe.tracking import StageTracker

STARTED = time.perf_counter()
# transformers imports scikit-learn whenever it is installed (MLflow installs it), only for assisted
# decoding's roc_curve, which no stage uses: 1.3 s of every torch stage's start. A None entry makes
# importlib report it absent. Stage processes only; MLflow runs in its own worker process.
sys.modules.setdefault("sklearn", None)
if not bars_enabled():  # transformers' own bars (loading, saving shards) follow ours
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@dataclass
class StageContext:
    name: str
    params: Params
    round_name: str | None
    tracker: StageTracker
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def dvc_stage(self) -> str:
        return f"{self.name}@{self.round_name}" if self.round_name else self.name

    def init_torch(self):
        """Import torch and transformers' model classes (timed: the fixed cost of a model stage), with
        the configured threads and the run's seed."""
        with self.timed("import_seconds"):
            import torch
            import transformers.models.auto.modeling_auto  # noqa: F401  (what every model load needs)

        torch.set_num_threads(self.params.runtime.torch_threads)
        torch.manual_seed(self.params.seed)
        return torch

    def timed(self, label: str):
        return _Timer(self.timings, label)


class _Timer:
    def __init__(self, sink: dict[str, float], label: str):
        self.sink, self.label = sink, label

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        self.sink[self.label] = self.sink.get(self.label, 0.0) + time.perf_counter() - self.started


def process_age() -> float:
    """Seconds since this process started (interpreter start-up included), from /proc."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - STARTED


def metrics_file(name: str, round_name: str | None):
    return paths.round_metrics_path(round_name, name) if round_name else paths.METRICS / f"{name}.json"


def run_stage(name: str, body: Callable[[StageContext], dict], with_round: bool = False) -> None:
    parser = argparse.ArgumentParser(prog=f"stages/{name}.py", description=(body.__doc__ or "").strip())
    if with_round:
        parser.add_argument("round", help="round name, e.g. r1")
    args = parser.parse_args()
    round_name = getattr(args, "round", None)
    label = f"{name}@{round_name}" if round_name else name
    try:
        params = load_params()
    except PipelineError as err:
        sys.exit(f"{label}: {err}")
    if round_name is not None and round_name not in params.rounds:
        sys.exit(f"{label}: round {round_name!r} is not in params.yaml rounds ({', '.join(params.rounds)})")

    tracker = StageTracker(params, label, round_name)
    ctx = StageContext(name, params, round_name, tracker)
    failed = True
    try:
        with ctx.timed("work_seconds"):
            metrics = body(ctx) or {}
        metrics = {**metrics, **{f"stage/{k}": v for k, v in ctx.timings.items()}}
        tracker.log_round_metrics(metrics) if round_name else tracker.log_metrics(metrics)
        failed = False
    except PipelineError as err:
        sys.exit(f"{label}: {err}")
    finally:
        waited = time.perf_counter()
        tracker.close(failed)
        waited = time.perf_counter() - waited
    # Written last, so that it holds the whole process time: start-up, work, and the wait for MLflow.
    metrics.update({"stage/tracking_wait_seconds": waited, "stage/process_seconds": process_age()})
    atomic_write_text(metrics_file(name, round_name), json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "torch" in sys.modules:
        exit_without_teardown()


def exit_without_teardown() -> None:
    """End a finished stage process without the interpreter's teardown of torch and transformers:
    1.1-1.5 s a model stage, three times a round (measured: a load-and-forward script exits in 0.78x
    the wall time). The atexit handlers still run (the math-verify pool closes); every artifact is
    already written and closed."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
