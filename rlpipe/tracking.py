"""Tracking: one MLflow parent run per pipeline execution, one child run per stage execution.

MLflow costs about 2-4 s to import and open its store, in every stage process. So the stage never
imports it: `StageTracker` starts `rlpipe.tracking_worker` as a side process at stage start, which
imports MLflow and opens the runs on the other core while the stage imports torch and works, and
streams it JSON lines (metrics are batched and sent with `log_batch` at the end). The stage waits for
the worker before it exits, so what a finished stage logged is in the store.

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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlpipe.config import Params

WORKER_TIMEOUT_S = 120


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


class StageTracker:
    """Streams one stage execution's params, metrics and artifacts to the MLflow worker."""

    def __init__(self, params: Params, stage: str, round_name: str | None):
        self.stage, self.round_name = stage, round_name
        self.enabled = params.tracking.enabled and os.environ.get("RLPIPE_TRACKING", "1") != "0"
        self._worker: subprocess.Popen | None = None
        if not self.enabled:
            return
        root = repo_root()
        start = {
            "op": "start",
            "tracking_uri": tracking_uri(root),
            "artifact_root": (root / "mlruns").resolve().as_uri(),
            "experiment": params.tracking.experiment,
            "execution_id": execution_id(),
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
        self._worker = subprocess.Popen(
            [sys.executable, "-m", "rlpipe.tracking_worker"], stdin=subprocess.PIPE, text=True, cwd=root
        )
        self._send(start)

    def _send(self, message: dict) -> None:
        if self._worker is None or self._worker.stdin is None:
            return
        message["time_ms"] = int(time.time() * 1000)
        try:
            self._worker.stdin.write(json.dumps(message) + "\n")
        except BrokenPipeError:
            print("rlpipe: the MLflow tracking worker exited early; metrics stay in runs/metrics", file=sys.stderr)
            self._worker = None

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
        if self._worker is None:
            return
        self._send({"op": "end", "status": "FAILED" if failed else "FINISHED"})
        try:
            self._worker.stdin.close()
            self._worker.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._worker.kill()
            print(f"rlpipe: the MLflow worker did not finish in {WORKER_TIMEOUT_S} s; killed it", file=sys.stderr)
        if self._worker.returncode not in (0, None):
            print(f"rlpipe: the MLflow worker failed (exit {self._worker.returncode}); see its message above",
                  file=sys.stderr)
        self._worker = None
