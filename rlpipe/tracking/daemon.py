"""The MLflow side of `rlpipe.tracking`: one daemon per pipeline execution, serving every stage.

MLflow costs 2-3 s of CPU to import and open its store. A daemon started by the execution's first stage
pays that once: it listens on a Unix socket named after the execution, imports MLflow, and then serves
the stages one connection at a time. Each stage sends its JSON lines (start, metrics, artifacts, end)
when it ends; at `end` the daemon writes the stage's child run with `log_batch`, terminates it, and
answers `ok`, so a finished stage's metrics are in the store before the stage exits. A connection that
closes without `end` leaves its child run KILLED. The daemon exits once the execution's `dvc` process
is gone (or after IDLE_EXIT_S without a stage), having written everything it was sent.

It serves its owner only (`rlpipe.local_service`): the socket lives in a directory only the owner can
enter, a peer of another uid is dropped, an artifact path outside the project is refused (a stage only
logs its own plots), and a connection silent for CONNECTION_IDLE_S is dropped.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlpipe.local_service import inside, listen, peer_is_owner, process_alive

IDLE_EXIT_S = float(os.environ.get("RLPIPE_TRACKING_IDLE_EXIT_S", 1800))
"""A daemon no stage has called for this long exits (RLPIPE_TRACKING_IDLE_EXIT_S overrides it); a stage
that works longer starts a new one when it ends (`StageTracker.close`)."""
POLL_S = 0.5
CONNECTION_IDLE_S = float(os.environ.get("RLPIPE_CONNECTION_IDLE_S", 30))
"""A stage sends its whole run at once when it ends: a connection silent this long is not a stage
(RLPIPE_CONNECTION_IDLE_S overrides it)."""
BATCH_METRICS = 1000
BATCH_PARAMS = 100


def metric_name(name: str) -> str:
    """MLflow names allow only letters, digits, _ - . / : and space: pass@1 is logged as pass_at_1."""
    return name.replace("@", "_at_")


@contextmanager
def first_use_lock(tracking_uri: str) -> Iterator[None]:
    """Held while a daemon opens a sqlite store. MLflow creates a new store's tables (alembic migrations)
    on first use, and two daemons doing it at once on one new file fail ("table _alembic_tmp_tags already
    exists"): parallel experiments, or a sweep's slots, sharing one mlflow.db. An exclusive lock on a file
    beside the database makes them take turns (a separate file: closing any descriptor of the database
    itself would drop sqlite's own locks in this process). Other stores need none."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    database = Path(tracking_uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class Store:
    """The MLflow client, with the experiment and parent run of this execution cached."""

    def __init__(self, tracking_uri: str):
        from mlflow.tracking import MlflowClient

        with first_use_lock(tracking_uri):
            self.client = MlflowClient(tracking_uri=tracking_uri)
            self.client.search_experiments(max_results=1)  # a new sqlite store creates its tables here
        self.parents: dict[str, str] = {}
        self.experiments: dict[str, str] = {}

    def experiment_id(self, name: str, artifact_root: str) -> str:
        if name not in self.experiments:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                try:
                    self.client.create_experiment(name, artifact_location=f"{artifact_root}/{name}")
                except Exception:  # created meanwhile by another execution's daemon
                    pass
                found = self.client.get_experiment_by_name(name)
            self.experiments[name] = found.experiment_id
        return self.experiments[name]

    def parent_run_id(self, exp_id: str, start: dict) -> str:
        key = start["execution_id"]
        if key in self.parents:
            return self.parents[key]
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`rlpipe.execution` = '{key}' and tags.`rlpipe.stage` = 'pipeline'",
            max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {**start["tags"], "rlpipe.execution": key, "rlpipe.stage": "pipeline"}
            tags.pop("rlpipe.round", None)
            # it starts when the execution's first stage started, so that its duration is the run's wall time
            run_id = self.client.create_run(exp_id, run_name=start["parent_name"], start_time=start.get("started_ms"),
                                            tags=tags).info.run_id
            self.log_params(run_id, start["params"])
        self.parents[key] = run_id
        return run_id

    def log_params(self, run_id: str, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), BATCH_PARAMS):
            self.client.log_batch(run_id, params=items[i : i + BATCH_PARAMS])

    def log_metrics(self, run_id: str, messages: list[dict]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(metric_name(k), v, m["time_ms"], m["step"] or 0)
                   for m in messages for k, v in m["metrics"].items()]
        for i in range(0, len(metrics), BATCH_METRICS):
            self.client.log_batch(run_id, metrics=metrics[i : i + BATCH_METRICS])


def serve_stage(store: Store, conn: socket.socket, project: Path) -> None:
    """One stage execution: its child run, metrics and artifacts; answers `ok` after `end`."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    reader = conn.makefile("r", encoding="utf-8")
    first = reader.readline()
    if not first:
        return
    start = json.loads(first)
    exp_id = store.experiment_id(start["experiment"], start["artifact_root"])
    parent = store.parent_run_id(exp_id, start)
    child = store.client.create_run(exp_id, run_name=start["run_name"], start_time=start.get("started_ms"), tags={
        **start["tags"], MLFLOW_PARENT_RUN_ID: parent, MLFLOW_RUN_NAME: start["run_name"],
        "rlpipe.execution": start["execution_id"]}).info.run_id
    store.client.update_run(parent, status="RUNNING")
    pending: dict[str, list[dict]] = {child: [], parent: []}
    artifacts: list[tuple[str, str, str | None]] = []
    status = "KILLED"
    try:
        for line in reader:
            message = json.loads(line)
            target = parent if message.get("to_parent") else child
            if message["op"] == "metrics":
                pending[target].append(message)
            elif message["op"] == "artifact":
                if not inside(message["path"], project):
                    print(f"rlpipe tracking daemon: refused artifact {message['path']!r}: not inside {project}",
                          file=sys.stderr, flush=True)
                    continue
                artifacts.append((target, message["path"], message.get("artifact_path")))
            elif message["op"] == "end":
                status = message["status"]
                break
    except socket.timeout:  # silent for CONNECTION_IDLE_S: write what came, as KILLED
        print("rlpipe tracking daemon: dropped an idle connection", file=sys.stderr, flush=True)
    for run_id, messages in pending.items():
        store.log_metrics(run_id, messages)
    for run_id, path, artifact_path in artifacts:
        store.client.log_artifact(run_id, path, artifact_path)
    now = int(time.time() * 1000)
    store.client.set_terminated(child, status=status, end_time=now)
    # Between stages the parent reads FINISHED; a failed or killed stage marks it FAILED until a later
    # stage of the same execution succeeds.
    store.client.set_terminated(parent, status="FINISHED" if status == "FINISHED" else "FAILED", end_time=now)
    if status != "KILLED":
        conn.sendall(f"ok {child}\n".encode())


def main() -> int:
    address, tracking_uri, project = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[4])
    owner = int(sys.argv[3]) if sys.argv[3] != "-" else None
    listener = listen(address)
    if listener is None:
        return 0  # another daemon serves this execution already
    listener.settimeout(POLL_S)
    store = Store(tracking_uri)  # the slow part, while the first stage already works
    idle_since = time.monotonic()
    try:
        while process_alive(owner) and time.monotonic() - idle_since < IDLE_EXIT_S:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            with conn:
                if not peer_is_owner(conn):
                    print("rlpipe tracking daemon: dropped a connection from another user", file=sys.stderr, flush=True)
                    continue
                conn.settimeout(CONNECTION_IDLE_S)
                try:
                    serve_stage(store, conn, project)
                except socket.timeout:
                    print("rlpipe tracking daemon: dropped an idle connection", file=sys.stderr, flush=True)
                except Exception as err:  # keep serving the next stages; the stage sees no `ok` and warns
                    print(f"rlpipe tracking daemon: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            idle_since = time.monotonic()
            if owner is None:
                break  # a stage run by hand: its one connection, then exit
    finally:
        address.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
