"""The stage process's side of the warm worker: find (or start) the execution's worker and run a stage in it.

One worker per pipeline execution (the `dvc repro` / `dvc exp run` process, as for tracking) and project
directory: parallel experiments (`dvc queue start -j 2`) each get their own. A stage run by hand, outside
DVC, runs cold in its own process, unless RLPIPE_EXECUTION_ID names an execution (tests do).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from rlpipe import local_service
from rlpipe.errors import PipelineError
from rlpipe.tracking.client import execution_id, owner_pid, service_log, spawn

START_TIMEOUT_S = 180
"""How long a new worker may take to listen on its socket (it does so before its imports)."""


class WorkerUnavailable(OSError):
    """No worker could be started; the stage runs cold instead."""


class WorkerDied(PipelineError):
    """The worker went away in the middle of the stage."""


def worker_socket(execution: str, project: Path) -> Path:
    return local_service.socket_path("worker", str(os.getuid()), execution, str(project))


def connect_running(project: Path) -> socket.socket | None:
    """A connection to this execution's worker if one is serving; None otherwise, or for a stage run by hand."""
    execution = execution_id()
    if execution.startswith("stage:"):
        return None
    try:
        return local_service.connect(worker_socket(execution, project))
    except OSError:
        return None


def connect(project: Path) -> socket.socket | None:
    """A connection to this execution's worker, started if need be; None for a stage run by hand. The
    worker listens before it imports, so this returns at once; the stage's request waits for the imports."""
    execution = execution_id()
    if execution.startswith("stage:"):
        return None
    path = worker_socket(execution, project)
    try:
        return local_service.connect(path)
    except OSError:
        pass
    process = start_worker(execution, path, project)
    try:
        return local_service.wait_for(path, START_TIMEOUT_S, alive=lambda: process.poll() is None)
    except OSError as err:
        raise WorkerUnavailable(f"the warm worker did not start ({err}; log: "
                                f"{service_log(project, 'rlpipe-worker.log')})") from None


def start_early(project: Path) -> None:
    """Start this execution's worker without waiting for it (none for a stage run by hand, or if one
    serves already). The `fingerprint` stage, first of a run whose params or code changed, calls it once
    params.yaml is valid: the worker's 3 s of imports then overlap DVC's work up to the first model stage."""
    execution = execution_id()
    if execution.startswith("stage:"):
        return
    path = worker_socket(execution, project)
    if not local_service.can_connect(path):
        start_worker(execution, path, project)


def start_worker(execution: str, path: Path, project: Path):
    """A new worker process for this execution (it exits at once if another one listens on `path`)."""
    log = service_log(project, "rlpipe-worker.log")
    return spawn("rlpipe.worker.server", [str(path), str(owner_pid(execution) or "-"), str(project)], log)


def run_in_worker(conn: socket.socket, stage: str, round_name: str | None, project: Path) -> dict:
    """Send the stage to the worker with this process's stdout and stderr; wait for its answer."""
    # The worker's own ancestry leads nowhere (it outlives the stage that started it): it learns which
    # execution the stage belongs to from the stage, for tracking and the fingerprint check.
    env = {**os.environ, "RLPIPE_EXECUTION_ID": execution_id()}
    if "RLPIPE_PROGRESS" not in env and sys.stderr.isatty():  # the worker's stderr is a pipe, not this terminal
        env["RLPIPE_PROGRESS"] = "1"
    request = {"stage": stage, "round": round_name, "cwd": str(project), "env": env}
    with conn:
        try:
            socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [1, 2])
            sent = True
        except (BrokenPipeError, ConnectionResetError):
            # A worker whose imports failed answers the stages waiting in its backlog and closes, and
            # can do so before this request is sent: its answer is read below all the same.
            sent = False
        answer = conn.makefile("r", encoding="utf-8").readline()
    if not answer and not sent:
        return {"ok": False, "kind": "unavailable", "error": "the warm worker closed the connection before taking the stage"}
    if not answer:
        log = service_log(project, "rlpipe-worker.log")
        raise WorkerDied(f"the warm worker stopped in the middle of the stage (killed, or out of memory; log: "
                         f"{log}). Its outputs are written atomically, so nothing half-written is left; rerun "
                         f"`dvc repro` (a new worker starts), or set runtime.warm_worker: false")
    return json.loads(answer)


def worker_pids(project: Path) -> list[int]:
    """The pids of the workers started for `project`, oldest first, from their log (each writes
    `rlpipe worker PID: serving ...` when it starts); for benchmarks and tests that pause or kill them."""
    log = service_log(project, "rlpipe-worker.log")
    lines = log.read_text().splitlines() if log.is_file() else []
    return [int(line.split()[2].rstrip(":")) for line in lines if line.startswith("rlpipe worker ") and ": serving " in line]


def signal_workers(project: Path, sig: int) -> None:
    """Send `sig` to every worker started for `project` that is still running (SIGKILL to stop them,
    SIGSTOP/SIGCONT to pause them with their pipeline)."""
    for pid in worker_pids(project):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
