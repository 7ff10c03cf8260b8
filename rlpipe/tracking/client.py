"""Tracking: one MLflow parent run per pipeline execution, one child run per stage execution.

MLflow costs 2-3 s of CPU to import and open its store, and every stage is a process. So stages never
import it: `StageTracker` keeps what a stage logs and sends it, as JSON lines over a Unix socket, to
`rlpipe.tracking.daemon` when the stage ends: one daemon per pipeline execution, started by the
execution's first stage (it imports MLflow while that stage works) and reused by every later one (a stage
that outlives it, idle for IDLE_EXIT_S, starts another when it ends). It
writes with `log_batch`; the stage waits for the daemon's `ok`, so what a finished stage logged is in
the store.

- Store: `MLFLOW_TRACKING_URI`, else sqlite `mlflow.db` at the DVC root (DVC_ROOT points at the real
  repo even inside `dvc exp run --temp`), artifacts in `mlruns/` beside it. MLflow 3 refuses a file store.
- Security: the daemon's socket is a file in a directory only its user can enter, and it serves that user
  only, logs artifacts from inside the project only, and drops an idle connection (`rlpipe.local_service`).
- Execution: the nearest ancestor `dvc` process (pid + start time) identifies one `dvc repro` /
  `dvc exp run`; `RLPIPE_EXECUTION_ID` overrides it; a stage run by hand gets a parent of its own.
- Steps: round metrics use step = round index; optimizer-step metrics use a global step that chains
  across rounds. Round-level metrics are mirrored on the parent, so it holds the learning curve.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpipe import local_service

if TYPE_CHECKING:  # the thin stage client imports this module and must stay free of pydantic
    from rlpipe.config import Params

ACK_TIMEOUT_S = 120
CONNECT_TIMEOUT_S = 30


def tracking_uri(root: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def repo_root() -> Path:
    return Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"rollout": {"top_k": 0}} -> {"rollout.top_k": 0}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def params_hash(params: Params) -> str:
    return hashlib.sha256(json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def _process_start_time(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[19]


def _parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _is_dvc(pid: int) -> bool:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    names = [os.path.basename(a.decode(errors="replace")) for a in argv[:3]]
    return "dvc" in names or any(a == b"dvc" for a in argv[:4])


def execution_id() -> str:
    """Identity of the pipeline execution this stage process belongs to."""
    if os.environ.get("RLPIPE_EXECUTION_ID"):
        return os.environ["RLPIPE_EXECUTION_ID"]
    try:
        pid = os.getppid()
        while pid > 1:
            if _is_dvc(pid):
                return f"dvc:{pid}:{_process_start_time(pid)}"
            pid = _parent_pid(pid)
    except OSError:  # no /proc (macOS): every stage gets its own parent
        pass
    return f"stage:{os.getpid()}:{time.time_ns()}"


def git_commit(root: Path) -> str:
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        return os.environ["DVC_EXP_BASELINE_REV"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def owner_pid(execution: str) -> int | None:
    """The pid of the execution's dvc process, or None for a stage run by hand."""
    kind, _, rest = execution.partition(":")
    return int(rest.split(":")[0]) if kind == "dvc" else None


def spawn(module: str, args: list[str], log_path: Path) -> "subprocess.Popen":
    """Start a local service (`python -m module args`) in its own session, logging to `log_path`. With
    -P (Python >= 3.11) the working directory does not shadow the installed rlpipe, so the service runs
    the same library as the stage process that started it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    with open(log_path, "a") as log:
        return subprocess.Popen([sys.executable, *safe_path, "-m", module, *args], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)


def service_log(root: Path, name: str) -> Path:
    return (root / ".dvc" / "tmp" if (root / ".dvc").is_dir() else Path(tempfile.gettempdir())) / name


class TrackingBuffer:
    """What a stage logs (metrics, artifacts), kept in order until the stage ends. The warm worker gives
    one to the stage's work and ships its messages back to the stage process."""

    def __init__(self, round_name: str | None = None):
        self.round_name = round_name
        self.messages: list[dict] = []

    def _add(self, message: dict) -> None:
        message["time_ms"] = int(time.time() * 1000)
        self.messages.append(message)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, to_parent: bool = False) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self._add({"op": "metrics", "metrics": clean, "step": step, "to_parent": to_parent})

    def log_round_metrics(self, metrics: dict[str, float]) -> None:
        """Round-level metrics: on this stage's run and on the parent, at step = round index."""
        from rlpipe.paths import round_index

        step = round_index(self.round_name) if self.round_name else 0
        self.log_metrics(metrics, step=step)
        self.log_metrics(metrics, step=step, to_parent=True)

    def log_artifact(self, path: Path, artifact_path: str | None = None, to_parent: bool = False) -> None:
        self._add({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path,
                   "to_parent": to_parent})


class StageTracker(TrackingBuffer):
    """One stage execution's MLflow run: the execution's tracking daemon is started (if no stage of the
    execution has yet) when the stage starts, so that MLflow imports while the stage works; what the stage
    logs is sent in one connection when it ends, and the stage waits until the daemon has written it."""

    def __init__(self, params: Params, stage: str, round_name: str | None):
        super().__init__(round_name)
        self.stage = stage
        self.enabled = params.tracking.enabled and os.environ.get("RLPIPE_TRACKING", "1") != "0"
        if not self.enabled:
            return
        root = repo_root()
        execution = execution_id()
        uri = tracking_uri(root)
        self.log_path = service_log(root, "rlpipe-tracking.log")
        self.start = {
            "op": "start",
            "started_ms": int(time.time() * 1000),
            "artifact_root": (root / "mlruns").resolve().as_uri(),
            "experiment": params.tracking.experiment,
            "execution_id": execution,
            "run_name": stage,
            "parent_name": os.environ.get("DVC_EXP_NAME") or f"repro {time.strftime('%Y-%m-%d %H:%M:%S')}",
            "params": {k: json.dumps(v) if not isinstance(v, str) else v
                       for k, v in flatten(params.model_dump(mode="json")).items()},
            "tags": {
                "rlpipe.stage": stage,
                "rlpipe.round": round_name or "",
                "rlpipe.params_hash": params_hash(params),
                "rlpipe.preset": params.algorithm.preset,
                "mlflow.source.git.commit": git_commit(root),
                "dvc.exp_name": os.environ.get("DVC_EXP_NAME", ""),
            },
        }
        self.daemon_args = [uri, str(owner_pid(execution) or "-"), str(root)]
        self.daemon: subprocess.Popen | None = None  # the daemon this stage started, if it started one
        try:
            self.address = local_service.socket_path("tracking", str(os.getuid()), uri, execution)
            if not local_service.can_connect(self.address):
                self._start_daemon()
        except OSError as err:
            self._warn(f"could not start the MLflow tracking daemon ({err})")
            self.enabled = False

    def _start_daemon(self) -> None:
        self.daemon = spawn("rlpipe.tracking.daemon", [str(self.address), *self.daemon_args], self.log_path)

    def _connect(self):
        """A connection to the execution's daemon. The daemon may have gone while this stage worked: it exits
        after IDLE_EXIT_S without a stage, and one stage can work longer (value pretraining's verifier phase,
        an hour); then a new one is started. (No probing connection first: a stage run by hand has a daemon
        that serves one connection and exits.)"""
        try:
            return local_service.connect(self.address)
        except OSError:
            pass
        if self.daemon is not None:  # the one this stage started: still starting, or exiting (idle)
            try:
                return self._wait_for_daemon()
            except OSError:
                pass
        self._start_daemon()
        return self._wait_for_daemon()

    def _wait_for_daemon(self):
        daemon = self.daemon
        return local_service.wait_for(self.address, CONNECT_TIMEOUT_S, alive=lambda: daemon.poll() is None)

    def _warn(self, what: str) -> None:
        print(f"rlpipe: {what}; metrics stay in runs/metrics (log: {self.log_path})", file=sys.stderr)

    def close(self, failed: bool) -> None:
        """Send the stage's run and wait until the daemon has written it."""
        if not self.enabled:
            return
        try:
            sock = self._connect()
        except OSError as err:
            self._warn(f"could not reach the MLflow tracking daemon ({err})")
            return
        with sock:
            try:
                lines = [self.start, *self.messages, {"op": "end", "status": "FAILED" if failed else "FINISHED"}]
                sock.sendall("".join(json.dumps(m) + "\n" for m in lines).encode())
                sock.settimeout(ACK_TIMEOUT_S)
                if not sock.makefile("r").readline().startswith("ok"):
                    self._warn("the MLflow tracking daemon did not confirm this stage's run")
            except OSError as err:
                self._warn(f"no answer from the MLflow tracking daemon ({err})")
