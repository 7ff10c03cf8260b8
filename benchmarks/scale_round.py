"""(g) The scale round: what a round costs around its work, with a 113M-parameter policy.

The embedded model grown to 12 layers x 768 (113M parameters, fp32), 5 rounds of minimal work: 8 prompts
x 2 samples and one optimizer step a round, so that a round is mostly what the tool adds around its work:
imports, model loads, writing the checkpoint (weights and AdamW state, 1.36 GB), DVC.

- pipeline: one `dvc repro`, as a user runs it; a round's wall time is its four stages and DVC's time
  before each (benchmarks/stage_timeline.py), warm worker on (the default) and off (cold processes);
- reference, in the same run: the same rounds' work in one process, the stage functions called one
  after the other with one model store, no DVC: the round's compute plus one write of what it stores.
  The disk's speed drifts between runs minutes apart (page cache, writeback) by more than the sides
  differ, so `--repeat N` alternates pipeline and reference, and the table also gives the ratio with the
  reference taken inside the pipeline's own run: each round's wall over its four stages' own work
  (`stage/work_seconds` less `stage/hash_wait_seconds`, benchmarks/stage_timeline.py);
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
from benchmarks.stage_timeline import round_dvc_seconds, round_walls, round_work_seconds, timeline

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
    from rlpipe.runner import execute, trim_imports

    trim_imports()  # as a stage process and the worker do
    copy = work / "reference"
    shutil.rmtree(copy, ignore_errors=True)
    for part in ("runs/data", "runs/policy/r0", "runs/critic/r0"):
        shutil.copytree(root / part, copy / part)
    shutil.copy(root / "params.yaml", copy / "params.yaml")
    settle()
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


def settle() -> None:
    """Write back what the last side left dirty in the page cache, so that no side's fsyncs pay for the
    writes of the one before it (measured: the same rounds' work took 2.4 s or 5-6 s a round depending on
    what ran just before)."""
    os.sync()
    time.sleep(2)


def pipeline_run(work: Path, name: str, raw: dict, checkout: Path | None = None) -> dict:
    """One `dvc repro` of the scale params in a fresh project: round walls and disk."""
    from rlpipe.scratch_project import copy_pipeline

    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    settle()
    if checkout is None:
        copy_pipeline(root, yaml.safe_dump(raw, sort_keys=False), committer="rlpipe-bench")
    else:  # an older checkout: its own pipeline files, and its rounds format (a mapping, then)
        old = yaml.safe_load((checkout / "params.yaml").read_text())
        if isinstance(old.get("rounds"), dict):
            raw = {**raw, "rounds": {f"r{k}": {"prev": f"r{k - 1}"} for k in range(1, ROUNDS + 1)}}
            raw["runtime"] = {"torch_threads": raw["runtime"]["torch_threads"]}
        copy_older(checkout, root, raw)
    seconds = repro(root, checkout and root)
    spans = timeline(root)
    stored, once = disk(root)
    return {"root": root, "repro": seconds, "walls": round_walls(spans), "dvc": round_dvc_seconds(spans),
            "work": round_work_seconds(spans), "stored": stored, "once": once}


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


def run(work: Path | None = None, before: str | None = None, repeat: int = 1, cold: bool = True) -> str:
    """The sides, then the reference, `repeat` times over: each repeat's ratio is taken against the
    reference run minutes after it, since the disk's speed (page cache, writeback) drifts between runs
    more than the sides differ."""
    from rlpipe.scratch_project import CHECKOUT

    work = Path(work or tempfile.mkdtemp(prefix="rlpipe-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    references: list[float] = []
    checkout = None
    if before:
        checkout = work / "before-checkout"
        if not checkout.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(checkout), before], cwd=CHECKOUT, check=True,
                           capture_output=True)
        # an older checkout with a warm worker is measured warm: the change since is what is compared
        before_warm = "warm_worker" in (checkout / "rlpipe/config/sections.py").read_text() \
            if (checkout / "rlpipe/config/sections.py").exists() else False
    for index in range(repeat):
        sides = []
        if before:
            sides.append((f"before ({before}, {'warm' if before_warm else 'cold'})", "before",
                          scale_params(before_warm), checkout))
        if cold and index == 0:  # minutes a run, and far from the target: once is enough
            sides.append(("cold (runtime.warm_worker: false)", "cold", scale_params(False), None))
        sides.append(("warm (the default)", "warm", scale_params(True), None))
        for label, name, raw, source in sides:
            results.setdefault(label, []).append(pipeline_run(work, name, raw, source) | {"repeat": index})
        ref = reference(results["warm (the default)"][-1]["root"], work)
        references.append(statistics.median(ref[k] for k in range(2, ROUNDS + 1)))
    rows = [["reference: the rounds' work in one process", statistics.median(references), 1.0,
             ", ".join(f"{r:.2f}" for r in references), "", "", "", ""]]
    later = range(2, ROUNDS + 1)
    for label, runs in results.items():
        walls = [statistics.median(r["walls"][k] for k in later) for r in runs]
        ratios = [wall / references[r["repeat"]] for wall, r in zip(walls, runs)]
        # the same ratio with the reference taken inside the run: each round's wall over its own stages' work
        in_run = [statistics.median(r["walls"][k] / r["work"][k] for k in later) for r in runs]
        dvc_seconds = [statistics.median(r["dvc"][k] for k in later) for r in runs]
        rows.append([label, statistics.median(walls), statistics.median(ratios), ", ".join(f"{x:.2f}" for x in ratios),
                     statistics.median(in_run), ", ".join(f"{x:.2f}" for x in in_run), statistics.median(dvc_seconds),
                     f"{runs[-1]['stored'] / 1e9:.2f} GB, {runs[-1]['stored'] / runs[-1]['once']:.2f}x"])
    text = table(f"(g) one round of a {SCALE['layers']} x {SCALE['hidden']} policy (113M, fp32), rounds 2-{ROUNDS}, "
                 f"{repeat} repeat(s)",
                 ["side", "round wall s (median)", "x reference (median of repeats)",
                  "per repeat (reference: its s)", "x its own work in the same run (median)", "per repeat",
                  "s in DVC a round", "runs/ + cache, x the outputs once"], rows)
    return text + f"\ntargets: warm <= 1.5x the reference; disk <= 1.1x the outputs once. work dir: {work}\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory (kept)")
    parser.add_argument("--before", help="a git revision to measure the same params on, e.g. 215bc71 (warm where "
                        "that revision has the warm worker)")
    parser.add_argument("--repeat", type=int, default=1, help="run the sides and the reference this many times, "
                        "alternating (each ratio against its own repeat's reference)")
    parser.add_argument("--no-cold", dest="cold", action="store_false", help="leave out the cold side")
    ns = parser.parse_args()
    print(run(ns.work, ns.before, ns.repeat, ns.cold))
