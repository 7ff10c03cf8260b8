"""Presets x seeds through `dvc exp run --temp` in a scratch project, resumable; a report with 95%
intervals, rounds to a target, lengths of correct and incorrect responses, accuracy by difficulty and the
critic's share of its ceiling. The docstring of rlpipe/sweep.py says how a sweep is laid out.

    # issue 19's sweep: 8 presets x 3 seeds on the reasoning task (about 2 h with --jobs 2 on 2 cores)
    python scripts/preset_sweep.py --params examples/reasoning.yaml --seeds 0 1 2 --jobs 2 \\
        --out sweeps/reasoning -S value.oracle_ev.continuations=8 \\
        grpo dr_grpo dapo rloo reinforce_pp ppo orz vapo
    # every preset once on the embedded default
    python scripts/preset_sweep.py --out sweeps/addition
    # the report alone, from the records so far
    python scripts/preset_sweep.py --out sweeps/reasoning --report-only ...

Run it again with the same arguments to resume: finished runs are kept, the others run.
"""

import sys

from rlpipe.sweep import main

if __name__ == "__main__":
    sys.exit(main())
