"""(b) Stage overhead on the embedded default: each stage process's wall time against the time inside
its main library call, from the `stage/*` figures every stage writes into runs/stage_metrics/.

Run after `dvc repro` (e.g. `make repro`); pass the `dvc repro` wall seconds with --repro-seconds to
also count DVC's own time between stages. Target: total overhead <= 15% of the `dvc repro` wall time.
`work` is the library call including its imports of torch/transformers (the part a stage cannot
avoid); `import` is reported separately where measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import table


def run(metrics_dir: Path = Path("runs/stage_metrics"), repro_seconds: float | None = None) -> str:
    rows, process_total, work_total = [], 0.0, 0.0
    for path in sorted(metrics_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if "stage/process_seconds" not in data:
            continue
        process, work = data["stage/process_seconds"], data["stage/work_seconds"]
        process_total += process
        work_total += work
        rows.append([path.stem, process, work, data.get("stage/import_seconds", float("nan")), process - work])
    if not rows:
        return "## (b) stage overhead\n\nno stage metrics found in runs/stage_metrics: run `dvc repro` first\n"
    wall = repro_seconds if repro_seconds else process_total
    rows.append(["TOTAL", process_total, work_total, float("nan"), process_total - work_total])
    text = table("(b) stage overhead (seconds)", ["stage", "process", "work", "imports", "overhead"], rows)
    text += (f"\nstage-process overhead: {process_total - work_total:.1f} s = "
             f"{(process_total - work_total) / wall:.1%} of {'dvc repro' if repro_seconds else 'summed stage'} wall time")
    if repro_seconds:
        text += f"; DVC's own time between stages: {repro_seconds - process_total:.1f} s = " \
                f"{(repro_seconds - process_total) / repro_seconds:.1%}; all overhead " \
                f"{(repro_seconds - work_total) / repro_seconds:.1%} (target <= 15%)"
    return text + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--metrics", type=Path, default=Path("runs/stage_metrics"))
    parser.add_argument("--repro-seconds", type=float)
    args = parser.parse_args()
    print(run(args.metrics, args.repro_seconds))
