"""`python -m benchmarks [a b c d e]` (or `make bench`): the benchmark suite, printed as Markdown tables.

Each figure is a ratio against a baseline measured in the same run; see BENCHMARKS.md for results.
Letters pick benchmarks (default: all; `e`, wall time to a pass@1 target against TRL, takes about 10
minutes on 2 cores, `f` and `g` 15-25 each). vLLM's runs only where vllm is installed (`.venv-vllm`, see `make test-vllm`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

BENCHMARKS = {"a": "advantage_math", "b": "stage_overhead", "c": "rollout_speed", "d": "update_speed",
              "e": "wall_to_target", "f": "dvc_scale", "g": "scale_round"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", nargs="*", help=f"benchmarks to run, of {' '.join(BENCHMARKS)} (default: all)")
    letters = parser.parse_args().which or list(BENCHMARKS)
    unknown = [letter for letter in letters if letter not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {' '.join(unknown)}; choose from {' '.join(BENCHMARKS)}")
    modules = [BENCHMARKS[letter] for letter in letters]
    if "c" in letters and importlib.util.find_spec("vllm") is not None:
        modules.append("vllm_speed")
    for name in modules:
        print(importlib.import_module(f"benchmarks.{name}").run(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
