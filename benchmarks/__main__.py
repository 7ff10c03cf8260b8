"""`python -m benchmarks` (or `make bench`): the benchmark suite, printed as Markdown tables.

Each figure is a ratio against a baseline measured in the same run; see BENCHMARKS.md for results.
"""

from __future__ import annotations

import importlib.util
import sys


def main() -> int:
    from benchmarks import advantage_math, rollout_speed, stage_overhead, update_speed

    modules = [advantage_math, rollout_speed, update_speed, stage_overhead]
    if importlib.util.find_spec("vllm") is not None:  # in .venv-vllm only (see `make test-vllm`)
        from benchmarks import vllm_speed

        modules.append(vllm_speed)
    for module in modules:
        print(module.run(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
