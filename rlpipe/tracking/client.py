"""Tracking: one MLflow parent run per pipeline execution, one child run per stage execution.

MLflow costs 2-3 s of CPU to import and open its store, and every stage is a process. So stages never
import it: `StageTracker` streams JSON lines over a Unix socket to `rlpipe.tracking.daemon`, one daemon
per pipeline execution, started by the execution's first stage (it imports MLflow while that stage
works) and reused by every later one. Metrics are buffered and written with `log_batch` when the stage
ends; the stage waits for the daemon's `ok`, so what a finished stage logged is in the store.

- Store: `MLFLOW_TRACKING_URI`, else sqlite `mlflow.db` at the DVC root (DVC_ROOT points at the real
  repo even inside `dvc exp run --temp`), artifacts in `mlruns/` beside it. MLflow 3 refuses a file store.
- Execution: the nearest ancestor `dvc` process (pid + start time) identifies one `dvc repro` /
  `dvc exp run`; `RLPIPE_EXECUTION_ID` overrides it; a stage run by hand gets a parent of its own.
- Steps: round metrics use step = round index; optimizer-step metrics use a global step that chains
  across rounds. Round-level metrics are mirrored on the parent, so it holds the learning curve.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def daemon_address(uri: str, execution: str) -> str:
    """A Linux abstract socket name (no file, no path-length limit) per store and execution."""
    digest = hashlib.sha256(f"{uri}|{execution}".encode()).hexdigest()[:24]
    if sys.platform.startswith("linux"):
        return f"@rlpipe-tracking-{digest}"
    return str(Path(tempfile.gettempdir()) / f"rlpipe-tracking-{digest}.sock")


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + address[1:] if address.startswith("@") else address)
    return sock


def connect_daemon(address: str, uri: str, owner: int | None, log_path: Path) -> socket.socket:
    """Connect to the execution's daemon, starting it first if none listens yet."""
    try:
        return _connect(address)
    except OSError:
        pass
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        subprocess.Popen([sys.executable, "-m", "rlpipe.tracking.daemon", address, uri, str(owner or "-")],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return _connect(address)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class StageTracker:
    """Streams one stage execution's metrics and artifacts to the execution's tracking daemon."""

    def __init__(self, params: Params, stage: str, round_name: str | None):
        self.stage, self.round_name = stage, round_name
        self.enabled = params.tracking.enabled and os.environ.get("RLPIPE_TRACKING", "1") != "0"
        self._sock: socket.socket | None = None
        if not self.enabled:
            return
        root = repo_root()
        execution = execution_id()
        uri = tracking_uri(root)
        self.log_path = (root / ".dvc" / "tmp" if (root / ".dvc").is_dir() else Path(tempfile.gettempdir())) \
            / "rlpipe-tracking.log"
        start = {
            "op": "start",
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
        try:
            self._sock = connect_daemon(daemon_address(uri, execution), uri, owner_pid(execution), self.log_path)
        except OSError as err:
            self._warn(f"could not reach the MLflow tracking daemon ({err})")
            return
        self._send(start)

    def _warn(self, what: str) -> None:
        print(f"rlpipe: {what}; metrics stay in runs/metrics (log: {self.log_path})", file=sys.stderr)

    def _send(self, message: dict) -> None:
        if self._sock is None:
            return
        message["time_ms"] = int(time.time() * 1000)
        try:
            self._sock.sendall((json.dumps(message) + "\n").encode())
        except OSError as err:
            self._warn(f"the MLflow tracking daemon went away ({err})")
            self._sock = None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, to_parent: bool = False) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self._send({"op": "metrics", "metrics": clean, "step": step, "to_parent": to_parent})

    def log_round_metrics(self, metrics: dict[str, float]) -> None:
        """Round-level metrics: on this stage's run and on the parent, at step = round index."""
        from rlpipe.paths import round_index

        step = round_index(self.round_name) if self.round_name else 0
        self.log_metrics(metrics, step=step)
        self.log_metrics(metrics, step=step, to_parent=True)

    def log_artifact(self, path: Path, artifact_path: str | None = None, to_parent: bool = False) -> None:
        self._send({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path,
                    "to_parent": to_parent})

    def close(self, failed: bool) -> None:
        """Send `end` and wait until the daemon has written this stage's run."""
        if self._sock is None:
            return
        self._send({"op": "end", "status": "FAILED" if failed else "FINISHED"})
        if self._sock is None:
            return
        try:
            self._sock.settimeout(ACK_TIMEOUT_S)
            reply = self._sock.makefile("r").readline()
            if not reply.startswith("ok"):
                self._warn("the MLflow tracking daemon did not confirm this stage's run")
        except OSError as err:
            self._warn(f"no answer from the MLflow tracking daemon ({err})")
        finally:
            self._sock.close()
            self._sock = None
