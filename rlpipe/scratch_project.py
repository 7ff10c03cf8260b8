"""A copy of this checkout's pipeline as a fresh git + DVC project, for the tests and benchmarks that
run `dvc repro` the way a user does without touching the checkout's own runs/ and params.yaml. Its
pipeline files are written for the given params' rounds (`rlpipe pipeline`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from rlpipe.config import load_params
from rlpipe.pipeline import write_pipeline

CHECKOUT = Path(__file__).resolve().parents[1]
PIPELINE_FILES = ("stages", "rlpipe", ".dvc/config", ".dvc/plots_page.html", ".dvcignore", ".gitignore")


def copy_pipeline(root: Path, params_text: str, committer: str = "rlpipe") -> Path:
    """Copy the pipeline into `root`, write `params_text` as its params.yaml, and commit it all (DVC
    experiments need a commit to start from). Returns `root`."""
    write_project(root, params_text)
    git = ["git", "-c", f"user.name={committer}", "-c", f"user.email={committer}@rlpipe.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "scratch"], cwd=root, check=True)
    return root


def write_project(root: Path, params_text: str) -> Path:
    """The pipeline's files in `root` with `params_text` as its params.yaml, and its dvc.yaml and round
    files written for those params: enough to run the stages by hand, without git or DVC. Returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for name in PIPELINE_FILES:
        src, dst = CHECKOUT / name, root / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    (root / "params.yaml").write_text(params_text)
    write_pipeline(load_params(root / "params.yaml"), root)  # dvc.yaml and the params' round files
    return root


def scratch_env() -> dict[str, str]:
    """The environment to run `dvc` or a stage in a scratch project: no progress bars, its own pipeline
    execution (not one the caller is inside), and the project-local MLflow store rather than a server
    the caller's shell may point at."""
    env = {**os.environ, "RLPIPE_PROGRESS": "0", "RLPIPE_EXECUTION_ID": ""}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def artifact_hashes(root: Path) -> dict[str, str]:
    """sha256 of every artifact under runs/: data, checkpoints, round tables. The reports
    (`rlpipe.paths.REPORTS`: metrics, stage metrics, plots) are left out, because they hold wall times."""
    from rlpipe.paths import REPORTS

    reports = tuple(f"{folder.as_posix()}/" for folder in REPORTS)
    out = {}
    for path in sorted((root / "runs").rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(reports):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def differing_artifacts(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The artifacts of two `artifact_hashes` that differ, or that only one of them has, sorted."""
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
