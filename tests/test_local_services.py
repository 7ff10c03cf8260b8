"""The local services (the MLflow tracking daemon and the warm worker) serve their owner only.

Run as root, a client of another user (uid 65534, through `setpriv`) is refused at both layers: it cannot
enter the private socket directory, and where a socket is reachable (a world-writable directory, on
purpose), the service drops it on its peer credentials. The daemon logs artifacts from inside the project
only and drops a connection that stays silent. Elsewhere (not root, or no setpriv) the cross-user tests
skip, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe import local_service

NOBODY = 65534
can_switch_user = os.getuid() == 0 and shutil.which("setpriv") is not None
cross_user = pytest.mark.skipif(not can_switch_user, reason="needs root and setpriv to run a client as another user")

CLIENT = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(sys.argv[1])
except OSError as err:
    print(json.dumps({"connected": False, "error": type(err).__name__})); sys.exit(0)
sock.settimeout(20)
try:  # the service may drop the connection before the line is sent
    sock.sendall(sys.argv[2].encode() + b"\\n")
    reply = sock.recv(4096)
except OSError as err:
    reply = b""
print(json.dumps({"connected": True, "reply": reply.decode()}))
"""


def as_nobody(path: Path, line: str) -> dict:
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                           "-c", CLIENT, str(path), line], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def open_dir():
    """A directory every user can enter and write (pytest's own tmp is private to root): the second layer
    must hold on its own there."""
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="rlpipe-open-", dir="/tmp"))
    shared.chmod(0o777)
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def wait_for_socket(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not local_service.can_connect(path):
        assert process.poll() is None and time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)


def start(module: str, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-P", "-m", module, *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def test_the_socket_directory_is_private_to_its_user():
    path = local_service.service_dir()
    info = path.stat()
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700


def test_a_directory_others_can_enter_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "rlpipe").mkdir(mode=0o777)
    (tmp_path / "rlpipe").chmod(0o777)
    with pytest.raises(local_service.ServiceError, match="not a private directory"):
        local_service.service_dir()


@cross_user
def test_another_user_cannot_reach_a_service_socket():
    path = local_service.socket_path("test", str(os.getpid()))
    listener = local_service.listen(path)
    try:
        assert as_nobody(path, "{}") == {"connected": False, "error": "PermissionError"}
    finally:
        listener.close()
        path.unlink(missing_ok=True)


@cross_user
def test_the_tracking_daemon_drops_another_user_and_outside_paths(tmp_path, open_dir):
    project = tmp_path / "project"
    project.mkdir()
    (project / "plot.png").write_bytes(b"png")
    secret = tmp_path / "secret.txt"
    secret.write_text("root only")
    secret.chmod(0o600)
    path, uri = open_dir / "tracking.sock", f"sqlite:///{project / 'mlflow.db'}"
    log = tmp_path / "daemon.log"
    daemon = start("rlpipe.tracking.daemon", [str(path), uri, str(os.getpid()), str(project)], log,
                   {"RLPIPE_CONNECTION_IDLE_S": "2"})
    try:
        wait_for_socket(path, daemon)
        path.chmod(0o777)
        start_line = {"op": "start", "started_ms": 0, "artifact_root": (project / "mlruns").as_uri(),
                      "experiment": "security", "execution_id": "x", "run_name": "intruder", "parent_name": "p",
                      "params": {}, "tags": {}}
        assert as_nobody(path, json.dumps(start_line)) == {"connected": True, "reply": ""}
        # the owner: an idle connection is dropped, and the next one is served
        idle = local_service.connect(path)
        time.sleep(3)
        stage = local_service.connect(path)
        lines = [{**start_line, "run_name": "stage"},
                 {"op": "artifact", "path": str(secret), "artifact_path": None, "to_parent": False},
                 {"op": "artifact", "path": str(project / "plot.png"), "artifact_path": None, "to_parent": False},
                 {"op": "end", "status": "FINISHED"}]
        stage.sendall("".join(json.dumps(m) + "\n" for m in lines).encode())
        stage.settimeout(120)
        assert stage.makefile("r").readline().startswith("ok")
        idle.close(), stage.close()
    finally:
        daemon.kill()
        daemon.wait()
    text = log.read_text()
    assert "dropped a connection from another user" in text, text
    assert "dropped an idle connection" in text, text
    assert f"refused artifact '{secret}'" in text
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("security").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["p", "stage"]  # no run of the intruder's
    stage_run = next(r for r in runs if r.info.run_name == "stage")
    assert [a.path for a in client.list_artifacts(stage_run.info.run_id)] == ["plot.png"]


@cross_user
def test_the_worker_drops_another_user_and_other_projects(tmp_path, open_dir):
    project = tmp_path / "project"
    project.mkdir()
    path, log = open_dir / "worker.sock", tmp_path / "worker.log"
    worker = start("rlpipe.worker.server", [str(path), str(os.getpid()), str(project)], log)
    try:
        wait_for_socket(path, worker)
        path.chmod(0o777)
        request = {"stage": "prepare", "round": None, "cwd": str(project), "env": {}}
        assert as_nobody(path, json.dumps(request)) == {"connected": True, "reply": ""}
        # the owner, asking for another directory: refused with a reason, nothing run
        conn = local_service.connect(path)
        elsewhere = {**request, "cwd": str(tmp_path)}
        socket.send_fds(conn, [(json.dumps(elsewhere) + "\n").encode()], [1, 2])
        conn.settimeout(60)
        answer = json.loads(conn.makefile("r").readline())
        conn.close()
    finally:
        worker.kill()
        worker.wait()
    assert answer["ok"] is False and f"this worker serves {project}" in answer["error"]
    assert "dropped a connection from another user" in log.read_text()
    assert not (project / "runs").exists()


def test_daemons_opening_one_new_sqlite_store_at_once_all_succeed(tmp_path):
    """Parallel experiments (or a sweep's slots) share one new mlflow.db: their daemons create its tables
    in turn (`first_use_lock`), where MLflow alone fails all but one with "table _alembic_tmp_tags already
    exists" (seen in CI's sweep test; three at once failed two in a trial without the lock)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    start_at = time.time() + 10  # after the three have imported MLflow
    code = ("import sys, time; from rlpipe.tracking.daemon import Store; import mlflow.tracking\n"
            "while time.time() < float(sys.argv[2]): time.sleep(0.001)\n"
            "Store(sys.argv[1]).experiment_id('rlpipe', sys.argv[3]); print('opened')")
    workers = [subprocess.Popen([sys.executable, "-c", code, uri, str(start_at), str(tmp_path / "artifacts")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [worker.communicate(timeout=300) for worker in workers]
    assert [w.returncode for w in workers] == [0, 0, 0], [err[-500:] for _, err in results]
    assert all(out.strip() == "opened" for out, _ in results)


@pytest.mark.parametrize("daemon", ["serving", "gone idle"])
def test_a_stage_reaches_its_tracking_daemon_or_starts_another(tmp_path, monkeypatch, capsys, daemon):
    """The daemon exits after IDLE_EXIT_S without a stage, and a stage can work longer than that (value
    pretraining's verifier phase, an hour): such a stage's run reaches MLflow only if it starts a new
    daemon when it ends. Before it did, a 2-hour value_pretrain warned "could not reach the MLflow
    tracking daemon" and its metrics stayed in runs/metrics only. With the daemon serving, nothing but the
    stage's one connection may reach it: a stage run by hand (as here: no dvc owner) has a daemon that
    serves one connection and exits."""
    from mlflow.tracking import MlflowClient

    from rlpipe.config import params_from_dict
    from rlpipe.tracking.client import StageTracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for name, value in {"DVC_ROOT": str(tmp_path), "MLFLOW_TRACKING_URI": uri, "RLPIPE_TRACKING": "1",
                        "RLPIPE_EXECUTION_ID": f"test:{os.getpid()}:{time.time_ns()}",
                        "RLPIPE_TRACKING_IDLE_EXIT_S": "1" if daemon == "gone idle" else "600"}.items():
        monkeypatch.setenv(name, value)
    tracker = StageTracker(params_from_dict({}, "test"), "reward", "r1")
    deadline = time.monotonic() + 120
    while not tracker.address.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if daemon == "gone idle":
        while tracker.address.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tracker.address.exists(), "the daemon did not exit when idle"
    tracker.log_round_metrics({"reward/mean": 0.25})
    tracker.close(failed=False)
    assert "rlpipe:" not in capsys.readouterr().err  # no warning: not reached, not confirmed
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("rlpipe").experiment_id])
    stage = next(r for r in runs if r.info.run_name == "reward")
    assert stage.data.metrics == {"reward/mean": 0.25} and stage.info.status == "FINISHED"
