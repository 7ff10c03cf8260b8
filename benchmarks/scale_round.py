"""(g) The scale round: what a round costs around its work, with a 113M-parameter policy.

The embedded model grown to 12 layers x 768 (113M parameters, fp32), 5 rounds of minimal work: 8 prompts
x 2 samples and one optimizer step a round, so that a round is mostly what the tool adds around its work:
imports, model loads, writing the checkpoint (weights and AdamW state, 1.36 GB), DVC.

- pipeline: one `dvc repro`, as a user runs it; a round's wall time is its four stages and DVC's time
  before each (benchmarks/stage_timeline.py), warm worker on (the default) and off (cold processes);
- reference, in the same run: the same rounds' work in one process, the stage functions called one
  after the other with one model store, no DVC: the round's compute plus one write of what it stores;
- before (with `--before REV`): the same params on the pipeline as it was at git revision REV.

Also the disk: the bytes under runs/ plus .dvc/cache (each inode once) against the bytes the outputs
hold once. Targets: warm round <= 1.5x the reference; disk <= 1.1x. Needs about 10 GB of disk for each
pipeline run; takes 10-20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import table
from benchmarks.stage_timeline import round_walls, timeline

ROUNDS = 5
SCALE = {"layers": 12, "hidden": 768, "heads": 12, "intermediate": 3072, "max_positions": 64}


def scale_params(warm: bool) -> dict:
    from rlpipe.scratch_project import CHECKOUT

    raw = yaml.safe_load((CHECKOUT / "tests/params_mini.yaml").read_text())
    raw["runtime"] = {"torch_threads": 2, "warm_worker": warm}
    raw["model"]["tiny"] = dict(SCALE)
    raw["model"]["warm_start"] = {"steps": 10, "lr": 1e-4, "batch_size": 8}
    raw["rollout"].update({"prompts_per_round": 8, "samples_per_prompt": 2, "batch_size": 64})
    raw["update"].update({"minibatch_prompts": 8, "lr": 1e-5})
    raw["eval"] = {"max_prompts": 8, "samples": 2, "k": [1], "temperature": 1.0, "curve": False}
    raw["tracking"]["enabled"] = False
    raw["rounds"] = ROUNDS
    return raw


def env(extra_path: Path | None = None) -> dict:
    from rlpipe.scratch_project import scratch_env

    out = scratch_env()
    if extra_path is not None:  # run an older checkout's library, not the installed one
        out["PYTHONPATH"] = str(extra_path)
    return out


def repro(root: Path, extra_path: Path | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(["dvc", "repro"], cwd=root, env=env(extra_path), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dvc repro failed in {root}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def unique_bytes(*dirs: Path) -> int:
    seen, total = set(), 0
    for d in dirs:
        for path in d.rglob("*") if d.exists() else ():
            info = path.lstat()
            if path.is_file() and info.st_ino not in seen:
                seen.add(info.st_ino)
                total += info.st_size
    return total


def disk(root: Path) -> tuple[int, int]:
    """(unique bytes of runs/ and .dvc/cache, bytes the stored outputs hold once)."""
    from rlpipe.paths import REPORTS

    outputs = unique_bytes(*(p for p in (root / "runs").iterdir() if p.relative_to(root) not in REPORTS))
    return unique_bytes(root / "runs", root / ".dvc/cache"), outputs


def reference(root: Path, work: Path) -> dict[int, float]:
    """The rounds' work in this process, from the warm run's init and warm start: round -> seconds."""
    from rlpipe.config import load_params
    from rlpipe.models.store import ModelStore
    from rlpipe.runner import execute

    copy = work / "reference"
    shutil.rmtree(copy, ignore_errors=True)
    for part in ("runs/data", "runs/policy/r0", "runs/critic/r0"):
        shutil.copytree(root / part, copy / part)
    shutil.copy(root / "params.yaml", copy / "params.yaml")
    old = os.getcwd()
    os.chdir(copy)
    try:
        params, store, seconds = load_params(), ModelStore(), {}
        import torch  # noqa: F401  (imported before the clock, as the worker does)

        for k in range(1, ROUNDS + 1):
            started = time.perf_counter()
            for stage in ("rollout", "reward", "advantage", "update"):
                execute(stage, params, f"r{k}", models=store)
            seconds[k] = time.perf_counter() - started
        return seconds
    finally:
        os.chdir(old)
        shutil.rmtree(copy, ignore_errors=True)


def pipeline_run(work: Path, name: str, raw: dict, checkout: Path | None = None) -> dict:
    """One `dvc repro` of the scale params in a fresh project: round walls and disk."""
    from rlpipe.scratch_project import copy_pipeline

    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    if checkout is None:
        copy_pipeline(root, yaml.safe_dump(raw, sort_keys=False), committer="rlpipe-bench")
    else:  # an older checkout: its own pipeline files, and its rounds format (a mapping, then)
        old = yaml.safe_load((checkout / "params.yaml").read_text())
        if isinstance(old.get("rounds"), dict):
            raw = {**raw, "rounds": {f"r{k}": {"prev": f"r{k - 1}"} for k in range(1, ROUNDS + 1)}}
            raw["runtime"] = {"torch_threads": raw["runtime"]["torch_threads"]}
        copy_older(checkout, root, raw)
    seconds = repro(root, checkout and root)
    walls = round_walls(timeline(root))
    stored, once = disk(root)
    return {"root": root, "repro": seconds, "walls": walls, "stored": stored, "once": once}


def copy_older(checkout: Path, root: Path, raw: dict) -> None:
    root.mkdir(parents=True)
    for name in ("dvc.yaml", "stages", "rlpipe", "rounds", ".dvc/config", ".dvcignore", ".gitignore"):
        src = checkout / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, root / name)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@rlpipe.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "before"], cwd=root, check=True)


def run(work: Path | None = None, before: str | None = None) -> str:
    from rlpipe.scratch_project import CHECKOUT

    work = Path(work or tempfile.mkdtemp(prefix="rlpipe-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = {}
    if before:
        checkout = work / "before-checkout"
        if not checkout.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(checkout), before], cwd=CHECKOUT, check=True,
                           capture_output=True)
        runs[f"before ({before}, cold)"] = pipeline_run(work, "before", scale_params(False), checkout)
    runs["cold (runtime.warm_worker: false)"] = pipeline_run(work, "cold", scale_params(False))
    runs["warm (the default)"] = pipeline_run(work, "warm", scale_params(True))
    ref = reference(runs["warm (the default)"]["root"], work)
    ref_median = statistics.median(ref[k] for k in range(2, ROUNDS + 1))
    rows = [["reference: the rounds' work in one process", ref_median, 1.0, "", ""]]
    for name, result in runs.items():
        wall = statistics.median(result["walls"][k] for k in range(2, ROUNDS + 1))
        rows.append([name, wall, wall / ref_median, result["stored"] / 1e9, result["stored"] / result["once"]])
    text = table(f"(g) one round of a {SCALE['layers']} x {SCALE['hidden']} policy (113M, fp32), rounds 2-{ROUNDS}",
                 ["side", "round wall s (median)", "x reference", "GB under runs/ + cache", "x outputs once"], rows)
    return text + f"\ntargets: warm <= 1.5x the reference; disk <= 1.1x the outputs once. work dir: {work}\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory (kept)")
    parser.add_argument("--before", help="a git revision to measure the same params on, e.g. 215bc71")
    ns = parser.parse_args()
    print(run(ns.work, ns.before))
