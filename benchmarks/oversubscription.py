"""Runs at once against torch threads a run: why `preset_sweep.py` warns when --jobs x threads > cores.

Each run is the embedded default's data and warm start (`dvc repro init`, a real SFT loop of the
embedded model) in a scratch project of its own, with `runtime.torch_threads` set. Settings, one after
the other: one run alone, then `--jobs` runs started together, for each thread count. The figure is each
run's wall seconds against one run alone with the same threads.

    python -m benchmarks.oversubscription --jobs 2 --threads 1 2      # about 5 minutes on 2 cores
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


def make_project(root: Path, threads: int) -> Path:
    from rlpipe.scratch_project import CHECKOUT, copy_pipeline

    raw = yaml.safe_load((CHECKOUT / "params.yaml").read_text())
    raw.setdefault("runtime", {})["torch_threads"] = threads
    raw.setdefault("tracking", {})["enabled"] = False
    shutil.rmtree(root, ignore_errors=True)
    return copy_pipeline(root, yaml.safe_dump(raw, sort_keys=False), committer="rlpipe-bench")


def run_together(roots: list[Path]) -> list[float]:
    """`dvc repro init` in every project at once; each one's wall seconds."""
    from rlpipe.scratch_project import scratch_env

    started = time.perf_counter()
    procs = [subprocess.Popen(["dvc", "repro", "init"], cwd=root, env=scratch_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for root in roots]
    seconds = []
    for root, proc in zip(roots, procs):
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"dvc repro init failed in {root}:\n{out[-3000:]}")
        seconds.append(time.perf_counter() - started)
    return seconds


def run(work: Path | None = None, jobs: int = 2, threads: tuple[int, ...] = (1, 2)) -> str:
    work = Path(work or tempfile.mkdtemp(prefix="rlpipe-oversub-"))
    rows = []
    for count in threads:
        alone = run_together([make_project(work / f"t{count}-alone", count)])[0]
        together = run_together([make_project(work / f"t{count}-job{j}", count) for j in range(jobs)])
        rows.append([count, count * jobs, os.cpu_count(), alone, statistics.median(together),
                     statistics.median(together) / alone])
    return table(f"{jobs} warm starts at once against one alone (`dvc repro init` of the default params)",
                 ["torch threads a run", "threads in all", "cores", "alone s", f"{jobs} at once s (median)",
                  "x alone"], rows) + f"\nwork dir: {work}\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory (kept)")
    parser.add_argument("--jobs", type=int, default=2, help="runs started together")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="runtime.torch_threads values")
    ns = parser.parse_args()
    print(run(ns.work, ns.jobs, tuple(ns.threads)))
