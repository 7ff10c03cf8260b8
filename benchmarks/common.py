"""Side-by-side timing: A and B alternate, the ratio is taken pair by pair and the median reported."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def paired(a: Callable[[], object], b: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict:
    """Median seconds of A and B and the median of the per-pair ratios A/B."""
    for _ in range(warmup):
        a(), b()
    times_a, times_b, ratios = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        a()
        ta = time.perf_counter() - start
        start = time.perf_counter()
        b()
        tb = time.perf_counter() - start
        times_a.append(ta), times_b.append(tb), ratios.append(ta / tb)
    return {"a_s": statistics.median(times_a), "b_s": statistics.median(times_b), "ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"
