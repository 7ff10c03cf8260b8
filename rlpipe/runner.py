"""What every stage entry point shares: validate params, track, time, write metrics, fail clearly.

A stage script is `run_stage("rollout")`: the whole params file is validated before any work (a bad
key fails here, before a model loads), the MLflow tracking daemon starts, the stage's function
(`rlpipe.stages.rollout.rollout`) does the work and returns its metrics, which go to
`runs/stage_metrics/<stage>[_<round>].json` and to MLflow. A `PipelineError` prints as one message naming
the bad key, file or column, and exits 1 without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rlpipe import paths
from rlpipe.atomic import atomic_write_text
from rlpipe.config import Params, load_params
from rlpipe.errors import PipelineError
from rlpipe.fingerprints import check_fingerprint
from rlpipe.pipeline import check_stage
from rlpipe.retention import check_inputs
from rlpipe.progress import bars_enabled
from rlpipe.stages import STAGES, StageContext
from rlpipe.tracking.client import StageTracker, execution_id

STARTED = time.perf_counter()


def trim_imports() -> None:
    """transformers imports scikit-learn whenever it is installed (MLflow installs it), only for assisted
    decoding's roc_curve, which no stage uses: 1.3 s of every torch stage's start. A None entry makes
    importlib report it absent. Stage processes and the warm worker only; MLflow runs in its own daemon."""
    sys.modules.setdefault("sklearn", None)


trim_imports()
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


def execute(name: str, params: Params, round_name: str | None = None, tracker: StageTracker | None = None,
            models=None) -> dict:
    """Run stage `name`'s function in this process; returns its metrics and its timings (`stage/...`).
    `models`: the warm worker's store (None: a store for this stage only, if it uses models)."""
    label = f"{name}@{round_name}" if round_name else name
    if models is None and STAGES[name].uses_models:
        from rlpipe.models.store import ModelStore

        models = ModelStore()
    ctx = StageContext(name, params, round_name, tracker or StageTracker(params, label, round_name), models)
    with ctx.timed("work_seconds"):
        with ctx.timed("import_seconds"):
            work = STAGES[name].function
        metrics = work(ctx) or {}
    return {**metrics, **{f"stage/{k}": v for k, v in ctx.timings.items()}}


def run_stage(name: str) -> None:
    spec = STAGES[name]
    parser = argparse.ArgumentParser(prog=f"stages/{name}.py", description=(sys.modules["__main__"].__doc__ or "").strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if spec.per_round:
        parser.add_argument("round", help="round name, e.g. r1")
    args = parser.parse_args()
    round_name = getattr(args, "round", None)
    label = f"{name}@{round_name}" if round_name else name
    try:
        params = load_params()
    except PipelineError as err:
        sys.exit(f"{label}: {err}")
    if round_name is not None and round_name not in params.round_names:
        sys.exit(f"{label}: round {round_name!r} is beyond `rounds: {params.rounds}` in params.yaml")
    try:
        check_stage(name, round_name, params.rounds, Path.cwd())
        # Under DVC only: DVC records the run against the fingerprint file, so a stale one would let a later
        # `dvc repro` serve these outputs for the old params. A run by hand is recorded nowhere; DVC sees
        # its outputs as modified and reruns the stage.
        if spec.per_round and not execution_id().startswith("stage:"):
            check_fingerprint(name, params, Path.cwd())
        check_inputs(name, round_name, params.rounds, Path.cwd())
    except PipelineError as err:
        sys.exit(f"{label}: {err}")

    tracker = StageTracker(params, label, round_name)
    failed = True
    try:
        metrics = run_warm(name, round_name, tracker) if params.runtime.warm_worker else None
        if metrics is None:
            metrics = execute(name, params, round_name, tracker)
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
    atomic_write_text(paths.stage_metrics_path(name, round_name), json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if "torch" in sys.modules:
        exit_without_teardown()


def run_warm(name: str, round_name: str | None, tracker: StageTracker) -> dict | None:
    """Run the stage in the execution's warm worker; its metrics, or None to run it here, cold (a stage
    run by hand, or no worker could start)."""
    from rlpipe.worker.client import WorkerUnavailable, connect, run_in_worker

    project = Path.cwd().resolve()
    try:
        conn = connect(project)
    except WorkerUnavailable as err:
        print(f"rlpipe: {err}; running this stage in its own process", file=sys.stderr)
        return None
    if conn is None:
        return None
    answer = run_in_worker(conn, name, round_name, project)
    if not answer["ok"]:
        if answer["kind"] == "crash":
            print(answer["error"], file=sys.stderr, end="")
            raise PipelineError(f"the stage failed in the warm worker ({answer['error'].strip().splitlines()[-1]})")
        raise PipelineError(answer["error"])
    tracker.messages.extend(answer["tracking"])
    return answer["metrics"]


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
