"""Run every preset through `dvc exp run --temp` on this repo's params.yaml and print one table.

    python scripts/preset_sweep.py                       # all 16 presets, the embedded default
    python scripts/preset_sweep.py ppo orz vapo          # some of them
    python scripts/preset_sweep.py --out sweep.md -S rollout.prompts_per_round=512

Each preset is one DVC experiment named `sweep-<preset>`, all with the same seed and rounds, so
`dvc exp show` and MLflow list them afterwards. The table (Markdown) has pass@1 of the initial and
final policies, the gain, mean sampled response length on the test split, and wall seconds of the whole
`dvc exp run`. (CPU seconds are not reported: the stages' work runs in the warm worker, which is no
child of this script, so the children's CPU time would miss it; run on a quiet machine for the wall time.)
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
import time

from rlpipe.config import PRESETS


def run_preset(preset: str, overrides: list[str]) -> float:
    args = ["dvc", "exp", "run", "--temp", "-n", f"sweep-{preset}", "-S", f"algorithm.preset={preset}"]
    for override in overrides:
        args += ["-S", override]
    wall0 = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "RLPIPE_PROGRESS": "0"})
    wall = time.monotonic() - wall0
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"preset {preset}: dvc exp run failed (exit {done.returncode})")
    return wall


def experiment_metrics() -> dict[str, dict[str, str]]:
    table = subprocess.run(["dvc", "exp", "show", "--csv"], capture_output=True, text=True, check=True).stdout
    rows = list(csv.DictReader(io.StringIO(table)))

    def column(key: str) -> str:
        return next(c for c in rows[0] if c.split(":")[-1] == key)

    names = {key: column(key) for key in ("pass@1", "pass@1_init", "mean_length")}
    return {row["Experiment"]: {key: row[col] for key, col in names.items()} for row in rows if row.get("Experiment")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("presets", nargs="*", help="presets to run (default: all)")
    parser.add_argument("-S", dest="overrides", action="append", default=[], help="extra `dvc exp run -S` override")
    parser.add_argument("--out", help="also write the Markdown table to this file")
    args = parser.parse_args()
    unknown = [p for p in args.presets if p not in PRESETS]
    if unknown:
        parser.error(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    presets = args.presets or list(PRESETS)

    timings = {}
    for preset in presets:
        print(f"[{time.strftime('%H:%M:%S')}] {preset} ...", flush=True)
        timings[preset] = run_preset(preset, args.overrides)
        print(f"[{time.strftime('%H:%M:%S')}] {preset}: {timings[preset]:.0f} s wall", flush=True)

    metrics = experiment_metrics()
    lines = ["| preset | pass@1 before | pass@1 after | gain (points) | mean length | wall s |",
             "|---|---|---|---|---|---|"]
    for preset in presets:
        m = metrics[f"sweep-{preset}"]
        before, after = float(m["pass@1_init"]), float(m["pass@1"])
        lines.append(f"| {preset} | {before:.3f} | {after:.3f} | {100 * (after - before):+.1f} | "
                     f"{float(m['mean_length']):.2f} | {timings[preset]:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
