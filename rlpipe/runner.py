"""What every stage entry point shares: validate params, track, time, write metrics, fail clearly.

A stage script is `run_stage("rollout")`. The whole params file is validated and the stage's
declarations, fingerprint and inputs are checked before any work (`checked_params`: a bad key fails
here, before a model loads). The MLflow tracking daemon starts, the stage's function
(`rlpipe.stages.rollout.rollout`) does the work and returns its metrics (`tracked`), which go to
`runs/stage_metrics/<stage>[_<round>].json` and to MLflow. A `PipelineError` prints as one message naming
the bad key, file or column, and exits 1 without a traceback.

With the warm worker, the stage process is a thin client. The first stage of an execution validates
params.yaml itself (so a bad file fails before a worker starts), starts the worker and hands it the
stage. Every later stage only imports the standard library and this package's light modules (no
pydantic, no torch: 0.05 s instead of 0.25 s): it hands its stage to the running worker, which does the
checks, the work and the tracking, and answers with the metrics or the error. A stage that the params
leave with nothing to load (`StageSpec.skips_worker`: value_pretrain of a critic-free preset) runs in its
own process instead, at once, rather than wait for the worker's imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlpipe import paths
from rlpipe.atomic import atomic_write_text
from rlpipe.errors import PipelineError
from rlpipe.progress import bars_enabled
from rlpipe.stages import STAGES, StageContext

if TYPE_CHECKING:
    from rlpipe.config import Params
    from rlpipe.tracking.client import StageTracker

STARTED = time.perf_counter()


def trim_imports() -> None:
    """Two optional packages that transformers imports whenever they are installed (MLflow installs both)
    and that no stage uses: scikit-learn, only for assisted decoding's roc_curve (1.3 s of every torch
    stage's start), and scipy, only for the object-detection losses (0.2-0.3 s of the first model load).
    A None entry makes importlib report a package absent. Called by the stage processes (`run_stage`) and
    the warm worker before they import transformers, never at import: a process that imports this module
    for its functions (the tests, a sweep's report, which uses scipy) keeps both."""
    sys.modules.setdefault("sklearn", None)
    sys.modules.setdefault("scipy", None)


if not bars_enabled():  # transformers' own bars (loading, saving shards) follow ours
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def process_age() -> float:
    """Seconds since this process started (interpreter start-up included), from /proc."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - STARTED


def checked_params(name: str, round_name: str | None) -> Params:
    """params.yaml validated, and the stage checked against it: the round exists, the stage's declarations
    in dvc.yaml are current, the library code it runs is the project's (`check_running_code`), its
    fingerprint (under DVC) and its inputs (not pruned). Raises a `PipelineError` naming the bad key or
    file."""
    from rlpipe.codedeps import check_running_code
    from rlpipe.config import load_params
    from rlpipe.fingerprints import check_fingerprint
    from rlpipe.pipeline import check_stage
    from rlpipe.retention import check_inputs
    from rlpipe.tracking.client import execution_id

    params = load_params()
    if round_name is not None and round_name not in params.round_names:
        raise PipelineError(f"round {round_name!r} is beyond `rounds: {params.rounds}` in params.yaml")
    check_stage(name, round_name, params, Path.cwd())
    check_running_code(name, Path.cwd())
    # Under DVC only: DVC records the run against the fingerprint file, so a stale one would let a later
    # `dvc repro` serve these outputs for the old params. A run by hand is recorded nowhere; DVC sees
    # its outputs as modified and reruns the stage.
    if STAGES[name].per_round and not execution_id().startswith("stage:"):
        check_fingerprint(name, params, Path.cwd())
    check_inputs(name, round_name, params.rounds, Path.cwd())
    return params


def tracked(name: str, params: Params, round_name: str | None, work: Callable[[StageTracker], dict]) -> dict:
    """Run `work` with the stage's MLflow run open; its metrics, logged, plus the wait for MLflow."""
    from rlpipe.tracking.client import StageTracker

    tracker = StageTracker(params, f"{name}@{round_name}" if round_name else name, round_name)
    failed = True
    try:
        metrics = work(tracker)
        tracker.log_round_metrics(metrics) if round_name else tracker.log_metrics(metrics)
        failed = False
    finally:
        waited = time.perf_counter()
        tracker.close(failed)
        waited = time.perf_counter() - waited
    return {**metrics, "stage/tracking_wait_seconds": waited}


def execute(name: str, params: Params, round_name: str | None = None, tracker: StageTracker | None = None,
            models=None) -> dict:
    """Run stage `name`'s function in this process; returns its metrics and its timings (`stage/...`).
    `tracker`: the stage's MLflow run (None: a new one). `models`: the warm worker's store (None: a store
    for this stage only, if it uses models)."""
    if tracker is None:
        from rlpipe.tracking.client import StageTracker

        tracker = StageTracker(params, f"{name}@{round_name}" if round_name else name, round_name)
    if models is None and STAGES[name].loads_models(params):
        from rlpipe.models.store import ModelStore

        models = ModelStore()
    if models is not None:
        from rlpipe.models.device import gpu_memory_metrics, reset_gpu_peak, resolve_device

        models.device = resolve_device(params.runtime.device)
        reset_gpu_peak(models.device)
    from rlpipe.file_md5 import hash_wait_seconds  # here, not at the top: the thin client never hashes

    ctx = StageContext(name, params, round_name, tracker, models)
    hash_wait_before = hash_wait_seconds()
    with ctx.timed("work_seconds"):
        with ctx.timed("import_seconds"):
            work = STAGES[name].function
        metrics = work(ctx) or {}
    # of the work, the time its writers waited on the md5s handed to DVC (rlpipe/file_md5.py)
    ctx.timings["hash_wait_seconds"] = hash_wait_seconds() - hash_wait_before
    gpu = gpu_memory_metrics(models.device) if models is not None else {}  # peak and held, on a GPU
    return {**metrics, **{f"stage/{k}": v for k, v in ctx.timings.items()}, **gpu}


def run_stage(name: str) -> None:
    trim_imports()
    spec = STAGES[name]
    parser = argparse.ArgumentParser(prog=f"stages/{name}.py", description=(sys.modules["__main__"].__doc__ or "").strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if spec.per_round:
        parser.add_argument("round", help="round name, e.g. r1")
    args = parser.parse_args()
    round_name = getattr(args, "round", None)
    label = f"{name}@{round_name}" if round_name else name
    try:
        metrics = here_without_worker(name, round_name)
        if metrics is None:
            metrics = in_running_worker(name, round_name)
        if metrics is None:
            metrics = here_or_in_new_worker(name, round_name)
    except PipelineError as err:
        sys.exit(f"{label}: {err}")
    # Written last, so that it holds the whole process time: start-up, work, and the wait for MLflow.
    metrics["stage/process_seconds"] = process_age()
    atomic_write_text(paths.stage_metrics_path(name, round_name), json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "torch" in sys.modules:
        exit_without_teardown()


def here_without_worker(name: str, round_name: str | None) -> dict | None:
    """A stage that this configuration leaves with no model to load (`StageSpec.skips_worker`) runs here at
    once, while the warm worker may still be importing torch; its metrics, or None for every other stage."""
    if STAGES[name].skips_worker is None:
        return None
    params = checked_params(name, round_name)
    if not STAGES[name].skips_worker(params):
        return None
    return tracked(name, params, round_name, lambda tracker: execute(name, params, round_name, tracker))


def in_running_worker(name: str, round_name: str | None) -> dict | None:
    """The stage run by the execution's running warm worker, which checks it first; its metrics, or None
    when no worker serves this execution (or params.yaml turned the worker off)."""
    from rlpipe.worker.client import connect_running

    conn = connect_running(Path.cwd().resolve())
    return None if conn is None else worker_answer(conn, name, round_name)


def here_or_in_new_worker(name: str, round_name: str | None) -> dict:
    """The first stage of an execution, or a stage run cold: params.yaml is validated here, before a worker
    starts, then the stage runs in a new warm worker or in this process."""
    params = checked_params(name, round_name)
    if params.runtime.warm_worker:
        from rlpipe.worker.client import WorkerUnavailable, connect

        try:
            conn = connect(Path.cwd().resolve())
        except WorkerUnavailable as err:
            print(f"rlpipe: {err}; running this stage in its own process", file=sys.stderr)
            conn = None
        if conn is not None:
            metrics = worker_answer(conn, name, round_name)
            if metrics is not None:
                return metrics
    return tracked(name, params, round_name, lambda tracker: execute(name, params, round_name, tracker))


def worker_answer(conn, name: str, round_name: str | None) -> dict | None:
    """Hand the stage to the worker on `conn`; its metrics, None when params.yaml says to run it cold."""
    from rlpipe.worker.client import run_in_worker

    answer = run_in_worker(conn, name, round_name, Path.cwd().resolve())
    if answer["ok"]:
        return answer["metrics"]
    if answer["kind"] == "cold":
        return None
    if answer["kind"] == "unavailable":
        print(f"rlpipe: {answer['error']}; running this stage in its own process", file=sys.stderr)
        return None
    if answer["kind"] == "crash":
        print(answer["error"], file=sys.stderr, end="")
        raise PipelineError(f"the stage failed in the warm worker ({answer['error'].strip().splitlines()[-1]})")
    raise PipelineError(answer["error"])


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
