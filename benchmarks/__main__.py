"""`python -m benchmarks` (or `make bench`): the benchmark suite, printed as Markdown tables.

Each figure is a ratio against a baseline measured in the same run; see BENCHMARKS.md for results.
"""

from __future__ import annotations

import sys


def main() -> int:
    from benchmarks import advantage_math, rollout_speed, stage_overhead, update_speed

    for module in (advantage_math, rollout_speed, update_speed, stage_overhead):
        print(module.run(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
