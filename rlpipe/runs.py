"""`rlpipe runs`: one readable row per experiment.

`dvc exp show` lists every params key and every metric: hundreds of columns, each `…` in a terminal. This
view keeps what a comparison needs: the experiment, its preset, the params it changed against its
baseline commit, held-out pass@1 before and after, pass@k, the rounds and the wall time. The full
tables stay where they were (`dvc exp show --csv`, `runs/metrics/*.json`).

- Params and metrics come from `dvc exp show --json` (the workspace, the baseline commit and its
  experiments; `--all` for every branch's).
- Wall time comes from MLflow: the duration of the experiment's parent run, from its first stage's start
  to its last stage's end. Without a tracking store (tracking off, or `--no-mlflow`) the column says `-`.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rlpipe import paths
from rlpipe.errors import PipelineError
from rlpipe.tracking.client import flatten


@dataclass
class Run:
    name: str
    """The experiment's name; `workspace` or the branch for the rows that are not experiments."""
    baseline: str
    """The commit it started from (short sha)."""
    params: dict
    """params.yaml, flattened to dotted keys."""
    metrics: dict
    """runs/metrics/eval.json without its curve; empty before `evaluate` ran."""
    changed: dict
    """Dotted keys whose value differs from the baseline commit's params.yaml."""
    wall_seconds: float | None = None


def _file_data(state: dict, kind: str, path: str) -> dict:
    entry = ((state.get("data") or {}).get(kind) or {}).get(path) or {}
    return entry.get("data") or {}


def _changed(params: dict, baseline: dict) -> dict:
    return {key: value for key, value in params.items() if baseline.get(key, object()) != value}


def from_exp_show(states: list[dict]) -> list[Run]:
    """The rows of `dvc exp show --json`: the workspace, each baseline commit, and each experiment of it."""
    rows: list[Run] = []
    workspace = None
    for state in states:
        params = flatten(_file_data(state, "params", "params.yaml"))
        metrics = {k: v for k, v in _file_data(state, "metrics", paths.EVAL.as_posix()).items() if k != "curve"}
        if state["rev"] == "workspace":
            workspace = (params, metrics)
            continue
        sha = state["rev"][:7]
        if workspace is not None:  # the workspace's baseline is the first commit listed (HEAD)
            rows.append(Run("workspace", sha, workspace[0], workspace[1], _changed(workspace[0], params)))
            workspace = None
        rows.append(Run(state.get("name") or sha, sha, params, metrics, {}))
        for exp_range in state.get("experiments") or []:
            exp = exp_range["revs"][0]
            exp_params = flatten(_file_data(exp, "params", "params.yaml"))
            exp_metrics = {k: v for k, v in _file_data(exp, "metrics", paths.EVAL.as_posix()).items() if k != "curve"}
            rows.append(Run(exp_range.get("name") or exp.get("name") or exp["rev"][:7], sha, exp_params, exp_metrics,
                            _changed(exp_params, params)))
    return rows


def exp_show(root: Path, all_branches: bool) -> list[dict]:
    command = ["dvc", "exp", "show", "--json", *(["--all-branches"] if all_branches else [])]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise PipelineError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return json.loads(done.stdout)


def add_wall_seconds(rows: list[Run], root: Path) -> None:
    """Each experiment's wall time: its MLflow parent run's duration (the latest parent of that name;
    the workspace's is the latest parent that is no experiment's)."""
    import os

    from rlpipe.tracking.client import tracking_uri

    if "MLFLOW_TRACKING_URI" not in os.environ and not (root / "mlflow.db").is_file():
        return  # tracking was never on here
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri(root))
    experiments = {row.params.get("tracking.experiment") for row in rows} - {None}
    ids = [e.experiment_id for e in (client.get_experiment_by_name(n) for n in experiments) if e is not None]
    if not ids:
        return
    latest: dict[str, float] = {}
    for run in client.search_runs(ids, filter_string="tags.`rlpipe.stage` = 'pipeline'", order_by=["attributes.start_time ASC"],
                                  max_results=5000):
        name = run.data.tags.get("dvc.exp_name") or "workspace"
        if run.info.end_time and run.info.start_time:
            latest[name] = (run.info.end_time - run.info.start_time) / 1000
    for row in rows:
        row.wall_seconds = latest.get(row.name)


def _value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def render(rows: list[Run], wide: bool = False) -> str:
    """A Markdown table, one row per experiment; changed params shortened unless `wide`."""
    header = ["experiment", "base", "preset", "changed params", "pass@1 init", "pass@1", "+/- s.e.", "pass@k",
              "rounds", "wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        m = row.metrics
        changed = ", ".join(f"{k}={_value(v)}" for k, v in sorted(row.changed.items())) or "-"
        if not wide and len(changed) > 60:
            changed = changed[:57] + "..."
        stderr = (m["pass@1"] * (1 - m["pass@1"]) / m["test_prompts"]) ** 0.5 if {"pass@1", "test_prompts"} <= m.keys() else None
        cells = [row.name, row.baseline, str(row.params.get("algorithm.preset", "-")), changed,
                 f"{m['pass@1_init']:.3f}" if "pass@1_init" in m else "-",
                 f"{m['pass@1']:.3f}" if "pass@1" in m else "-",
                 f"{stderr:.3f}" if stderr is not None else "-",
                 f"{m['pass@k']:.3f} (k={m['k']})" if "pass@k" in m else "-",
                 str(row.params.get("rounds", "-")),
                 f"{row.wall_seconds:.0f} s" if row.wall_seconds is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(root: Path, all_branches: bool, mlflow: bool, wide: bool, as_json: bool) -> str:
    rows = from_exp_show(exp_show(root, all_branches))
    if mlflow:
        add_wall_seconds(rows, root)
    if as_json:
        return json.dumps([row.__dict__ for row in rows], indent=2) + "\n"
    return render(rows, wide)
