"""Scratch projects for the end-to-end tests: a git + DVC repo holding the project's pipeline and a
params file, and `dvc` run in it the way a user runs it (no progress bars, its own MLflow execution)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from conftest import REPO
from rlpipe.scratch_project import artifact_hashes, differing_artifacts  # noqa: F401  (the tests import them from here)

MINI_PARAMS = REPO / "tests" / "params_mini.yaml"


def make_project(root: Path, params_file: Path = MINI_PARAMS) -> Path:
    """A scratch git + DVC repo with the project's pipeline and the given params."""
    from rlpipe.scratch_project import copy_pipeline

    return copy_pipeline(root, params_file.read_text(), committer="rlpipe-test")


def dvc(root: Path, *args: str, timeout: int = 600) -> str:
    from rlpipe.scratch_project import scratch_env

    out = subprocess.run(["dvc", *args], cwd=root, capture_output=True, text=True, timeout=timeout, env=scratch_env())
    assert out.returncode == 0, f"dvc {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def start_queue(root: Path, jobs: int, log: Path) -> None:
    """`dvc queue start -j jobs`, its output into `log`. Not through pipes: the queue's workers inherit
    the starting process's stdout and stderr, and the primary one can stay up long after its queue is
    empty (its monitor asks it to shut down, and it sometimes never does), so reading a pipe to its end
    waits on that worker, not on `dvc queue start`."""
    from rlpipe.scratch_project import scratch_env

    with open(log, "w") as out:
        code = subprocess.run(["dvc", "queue", "start", "-j", str(jobs)], cwd=root, stdout=out,
                              stderr=subprocess.STDOUT, timeout=120, env=scratch_env()).returncode
    assert code == 0, f"dvc queue start -j {jobs} failed:\n{log.read_text()}"


def stop_queue_workers(root: Path) -> None:
    """End the queue workers a test started. `dvc queue stop` only asks them, and a worker that missed
    its own shutdown misses that too; SIGTERM gives it celery's warm shutdown. The pids are in the
    records DVC keeps of its workers (.dvc/tmp/exps/celery/<worker>.json)."""
    for record in (root / ".dvc" / "tmp" / "exps" / "celery").glob("dvc-exp-worker-*.json"):
        worker = json.loads(record.read_text())
        if worker.get("returncode") is None and worker.get("pid"):
            try:
                os.kill(worker["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass


def stage_label(dvc_name: str) -> str:
    """`rounds/r2/dvc.yaml:advantage` (DVC's name of a round stage) as `advantage@r2`; others unchanged."""
    if dvc_name.startswith("rounds/") and ":" in dvc_name:
        path, stage = dvc_name.split(":")
        return f"{stage}@{path.split('/')[1]}"
    return dvc_name


def dvc_target(label: str) -> str:
    """The DVC address of a stage: `advantage@r2` is `rounds/r2/dvc.yaml:advantage`."""
    stage, _, round_name = label.partition("@")
    return f"rounds/{round_name}/dvc.yaml:{stage}" if round_name else label


def ran_stages(log: str) -> list[str]:
    """The stages a dvc log ran, as `advantage@r2` labels."""
    return [stage_label(line.split("'")[1]) for line in log.splitlines() if line.startswith("Running stage '")]


def tracked_stages(log: str) -> list[str]:
    """The stages a dvc log ran that did work, each an MLflow child run: all but the `fingerprint`
    bookkeeping stage (rlpipe/fingerprints.py)."""
    return [stage for stage in ran_stages(log) if stage != "fingerprint"]


