"""(f) DVC at hundreds of rounds: DVC's own time per stage late in a 200-round run against early in the
same run, and a no-op `dvc repro` and `dvc status` at 200 rounds.

The miniature pipeline (tests/params_mini.yaml, tracking off) with `rounds: 200`, one `dvc repro`, warm
worker. DVC's gap before a stage is that stage's start minus the previous stage's end, from the stage
metrics (benchmarks/stage_timeline.py). Targets: gap at rounds 195-200 <= 1.5x the gap at rounds 2-5;
no-op `dvc repro` and `dvc status` <= 10 s each.

The in-run ratio compares minutes 1-2 of a 5-minute run with its last minute, so machine drift moves it
(the stage clients' own time, which does not depend on the rounds, drifts with it). So the same gap is
also measured with early and late rounds forced to rerun in `dvc repro`s of their own, alternating, in a
copy of the finished project.

Resumable: with `--work DIR` the project stays; run again and `dvc repro` carries on where it stopped.
Takes 15-25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import table
from benchmarks.stage_timeline import gaps, timeline

ROUNDS = 200


def project(work: Path, rounds: int) -> Path:
    from rlpipe.scratch_project import CHECKOUT, copy_pipeline

    root = work / "project"
    if (root / "params.yaml").is_file():
        return root  # resume
    raw = yaml.safe_load((CHECKOUT / "tests/params_mini.yaml").read_text())
    raw["tracking"]["enabled"] = False
    raw["rounds"] = rounds
    return copy_pipeline(root, yaml.safe_dump(raw, sort_keys=False), committer="rlpipe-bench")


def timed(root: Path, *args: str) -> tuple[float, str]:
    from rlpipe.scratch_project import scratch_env

    started = time.perf_counter()
    done = subprocess.run(["dvc", *args], cwd=root, env=scratch_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dvc {' '.join(args)} failed in {root}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - started, done.stdout


def batch_gap(root: Path, rounds: range) -> float:
    """DVC's mean gap per stage in one `dvc repro -s -f` of these rounds' stages (the first stage's gap,
    which holds DVC's start-up, left out)."""
    timed(root, "repro", "-s", "-f", *(f"rounds/r{k}/dvc.yaml" for k in rounds))
    spans = [span for span in timeline(root) if span.round_index in rounds]
    return statistics.mean(gap for _, gap in gaps(spans)[1:])


def alternating(root: Path, rounds: int, pairs: int = 3) -> tuple[list[float], list[float]]:
    """DVC's gap per stage in rounds 2-7 and in the last 6 rounds, each forced to rerun in a `dvc repro`
    of its own, early and late alternating, in a copy of the finished project: machine drift over a long
    run moves both sides alike. (The stages are deterministic: the reruns write the same bytes.)"""
    copy = root.parent / "alternating"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy, symlinks=True)
    early, late = [], []
    for _ in range(pairs):
        early.append(batch_gap(copy, range(2, 8)))
        late.append(batch_gap(copy, range(rounds - 5, rounds + 1)))
    return early, late


def run(work: Path | None = None, rounds: int = ROUNDS) -> str:
    work = Path(work or tempfile.mkdtemp(prefix="rlpipe-dvc-scale-"))
    root = project(work, rounds)
    repro_seconds, _ = timed(root, "repro")
    spans = timeline(root)
    by_round: dict[int, list[float]] = {}
    for span, gap in gaps(spans):
        if span.round_index is not None:
            by_round.setdefault(span.round_index, []).append(gap)
    early = [g for k in range(2, 6) for g in by_round.get(k, [])]
    late = [g for k in range(rounds - 5, rounds + 1) for g in by_round.get(k, [])]
    noop = [timed(root, "repro")[0] for _ in range(3)]
    status = [timed(root, "status")[0] for _ in range(3)]
    alt_early, alt_late = alternating(root, rounds)
    alt_ratio = statistics.median(b / a for a, b in zip(alt_early, alt_late))
    rows = [
        ["DVC's gap per stage, rounds 2-5 (s)", statistics.mean(early), len(early)],
        [f"DVC's gap per stage, rounds {rounds - 5}-{rounds} (s)", statistics.mean(late), len(late)],
        ["late / early", statistics.mean(late) / statistics.mean(early), "target <= 1.5"],
        ["gap per stage, rounds 2-7 rerun alone (s, median of 3, alternating)", statistics.median(alt_early), 3],
        [f"gap per stage, rounds {rounds - 5}-{rounds} rerun alone (s, median of 3, alternating)",
         statistics.median(alt_late), 3],
        ["late / early, alternating (median of the pairs' ratios)", alt_ratio, "target <= 1.5"],
        [f"no-op dvc repro at {rounds} rounds (s, median of 3)", statistics.median(noop), "target <= 10"],
        [f"dvc status at {rounds} rounds (s, median of 3)", statistics.median(status), "target <= 10"],
        ["last dvc repro (s; the whole run if it ran from scratch)", repro_seconds, ""],
    ]
    deciles = [statistics.mean(g for k in range(lo, lo + rounds // 10) for g in by_round.get(k, []))
               for lo in range(1, rounds + 1, rounds // 10)]
    text = table(f"(f) DVC's time between stages, {rounds}-round miniature pipeline", ["figure", "value", "n / target"],
                 rows)
    return text + "\nmean gap per tenth of the rounds (s): " + " ".join(f"{d:.3f}" for d in deciles) + f"\nproject: {root}\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory, kept (and resumed) across calls")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    ns = parser.parse_args()
    print(run(ns.work, ns.rounds))
