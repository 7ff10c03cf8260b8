"""The warm worker process: `python -m rlpipe.worker.server SOCKET OWNER_PID PROJECT`.

It listens on its Unix socket at once, imports torch and transformers (a stage that connects meanwhile
waits), then serves one stage at a time:

1. a request arrives: `{"stage", "round", "cwd", "env"}` and, passed with it, the client's stdout and
   stderr (SCM_RIGHTS): what the stage prints (progress bars, warnings) is forwarded there
   (`rlpipe.worker.output`), so that it appears in the stage's own output;
2. the worker checks the peer is its own user and the directory is its project, takes the client's
   environment and directory, validates params.yaml and checks the stage (`rlpipe.runner.checked_params`),
   and runs the stage's function (`execute`) with its `ModelStore`, which persists across the execution's
   stages, and its MLflow run (`tracked`);
3. it answers one JSON line: the stage's metrics, or its error.

Failure rules:
- the client goes away before the answer (its process was killed): the worker exits at once. The
  stage's outputs are written atomically, so nothing half-written is left; a model half-way through
  training is never served afterwards.
- the stage raises: the worker answers with the error and forgets every model it holds (a model may be
  half-trained); torch stays imported.
- it exits once the execution's dvc process is gone, or after IDLE_EXIT_S without a request.
- its imports fail: it answers the stages waiting "unavailable" (they run in their own process) and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from rlpipe import local_service
from rlpipe.worker.output import OutputRouter

IDLE_EXIT_S = 600
"""A worker nobody called for this long goes away by itself."""
POLL_S = 0.5
REQUEST_TIMEOUT_S = 10
"""A client sends its request at once; a connection silent this long is dropped."""
MAX_REQUEST_BYTES = 1 << 20


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request line and the two file descriptors sent with it."""
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, 2)
    while not data.endswith(b"\n"):
        more = conn.recv(MAX_REQUEST_BYTES)
        if not more:
            raise ConnectionError("the client closed the connection before its request ended")
        data += more
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return json.loads(data), list(fds)


@contextlib.contextmanager
def client_context(router: OutputRouter, fds: list[int], env: dict[str, str], cwd: str):
    """The stage runs with the client's environment and directory, its output forwarded to the client's
    stdout and stderr; all restored afterwards."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with router.to(*fds):
            yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def exit_if_client_leaves(conn: socket.socket, finished: threading.Event) -> threading.Thread:
    """Watch the connection while the stage runs: EOF before the answer means the client (the stage
    process DVC started) is gone, and with it the reason to finish; the worker exits without writing
    anything more."""

    def watch():
        try:
            gone = conn.recv(1) == b""
        except OSError:
            gone = True
        if gone and not finished.is_set():
            os._exit(3)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_request(request: dict, store) -> dict:
    """Run one stage as the request asks, checked and tracked as a stage process would (`rlpipe.runner`);
    the answer to send back. Nothing loads before params.yaml and the stage's inputs pass their checks."""
    from rlpipe.errors import PipelineError
    from rlpipe.runner import checked_params, execute, tracked

    stage, round_name = request["stage"], request.get("round")
    loads, reused = store.loads, store.reused

    def work(tracker) -> dict:
        metrics = execute(stage, params, round_name, tracker, models=store)
        return {**metrics, "stage/worker_loads": store.loads - loads, "stage/worker_reused": store.reused - reused}

    try:
        params = checked_params(stage, round_name)
    except PipelineError as err:  # nothing ran: the models held stay as valid as they were
        return {"ok": False, "error": str(err), "kind": "pipeline"}
    if not params.runtime.warm_worker:  # params.yaml changed under a running execution
        return {"ok": False, "kind": "cold", "error": "runtime.warm_worker is false"}
    try:
        metrics = tracked(stage, params, round_name, work)
    except PipelineError as err:
        store.forget_all()
        return {"ok": False, "error": str(err), "kind": "pipeline"}
    except BaseException:  # noqa: BLE001 (any failure goes back to the stage, which exits 1 with it)
        store.forget_all()
        return {"ok": False, "error": traceback.format_exc(), "kind": "crash"}
    return {"ok": True, "metrics": metrics}


def serve(conn: socket.socket, project: Path, store, router: OutputRouter) -> None:
    if not local_service.peer_is_owner(conn):
        print("rlpipe worker: dropped a connection from another user", file=sys.stderr, flush=True)
        return
    conn.settimeout(REQUEST_TIMEOUT_S)
    try:
        request, fds = read_request(conn)
    except (OSError, ValueError) as err:
        print(f"rlpipe worker: dropped a connection: {err}", file=sys.stderr, flush=True)
        return
    conn.settimeout(None)
    if len(fds) != 2 or not local_service.inside(request["cwd"], project) or \
            Path(request["cwd"]).resolve() != project.resolve():
        for fd in fds:
            os.close(fd)
        conn.sendall((json.dumps({"ok": False, "kind": "refused", "error":
                                  f"this worker serves {project}, not {request.get('cwd')}"}) + "\n").encode())
        return
    label = f"{request['stage']}@{request['round']}" if request.get("round") else request["stage"]
    print(f"rlpipe worker: {label} started", file=sys.stderr, flush=True)
    finished = threading.Event()
    exit_if_client_leaves(conn, finished)
    with client_context(router, fds, request["env"], request["cwd"]):
        answer = run_request(request, store)
    finished.set()
    print(f"rlpipe worker: {label} {'done' if answer['ok'] else 'failed'}", file=sys.stderr, flush=True)
    try:
        conn.sendall((json.dumps(answer) + "\n").encode())
    except OSError as err:  # the client went away as the stage ended; its outputs are complete
        print(f"rlpipe worker: could not answer {request['stage']}: {err}", file=sys.stderr, flush=True)


def import_stage_libraries():
    """What every stage would import, paid once, before the first request is accepted; the empty
    `ModelStore` the stages share."""
    from rlpipe.codedeps import running_code
    from rlpipe.runner import trim_imports

    running_code()  # the code as loaded: an edit during the execution then stops the stages it touches
    trim_imports()
    import torch  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401

    from rlpipe.models.store import ModelStore
    from rlpipe.stages import freeze_imported_objects

    freeze_imported_objects()
    return ModelStore()


def refuse_waiting(listener: socket.socket, address: Path, reason: str) -> None:
    """Answer every connection already waiting with "unavailable" (its stage then runs in its own
    process), after removing the socket so that no new one arrives."""
    address.unlink(missing_ok=True)
    listener.setblocking(False)
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # none left
            return
        with conn, contextlib.suppress(OSError):
            conn.sendall((json.dumps({"ok": False, "kind": "unavailable", "error": reason}) + "\n").encode())


def main() -> int:
    address, project = Path(sys.argv[1]), Path(sys.argv[3])
    owner = int(sys.argv[2]) if sys.argv[2] != "-" else None
    # Listen before the imports: a stage that connects meanwhile waits in the backlog, and a second start
    # (the fingerprint stage starts the worker early, the first model stage may try too) ends here.
    listener = local_service.listen(address)
    if listener is None:
        return 0  # another worker serves this execution already
    print(f"rlpipe worker {os.getpid()}: serving {project} for dvc pid {owner}", file=sys.stderr, flush=True)
    try:
        store = import_stage_libraries()
    except BaseException:  # noqa: BLE001 (the stages waiting run cold; the log keeps why)
        print(f"rlpipe worker: could not start:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        refuse_waiting(listener, address, "the warm worker could not import its libraries (see its log)")
        return 1
    listener.settimeout(POLL_S)
    router = OutputRouter(os.dup(2))  # fd 2 is the worker's log, as its starter opened it
    idle_since = time.monotonic()
    try:
        while local_service.process_alive(owner) and time.monotonic() - idle_since < IDLE_EXIT_S:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            with conn:
                serve(conn, project, store, router)
            idle_since = time.monotonic()
    finally:
        address.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
