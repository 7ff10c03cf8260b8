"""A critic that starts as a verifier: does it reach the addition ceiling? (issue 19, part 3)

    dvc repro init                          # in an addition project whose params.yaml has a critic preset
    python scripts/critic_verifier_init.py OUT '{"prompts": 8192, "steps": 600, "lr": 0.001}'
    python scripts/critic_pretrain_variants.py OUT2 '{"backbone": "OUT/verifier"}'

Three quarters of the critic's ceiling on addition lie in one check (docs/critic.md):
is the sum written so far right? The policy's own samples teach it badly: 14% of them are right, and
4,096 rows leave the check unlearnt. This script trains that check first, on data it makes itself: for
`prompts` train prompts (at most the split's), the right sum and a near miss (one digit changed), each
followed by eos, reward 1 for the right one. They go through value pretraining's own loop
(`pretrain_critic`: Monte-Carlo returns, a quarter of the prompts held out), starting from the init
policy, so that OUT/verifier is a critic checkpoint whose head already answers "is this sum right" at
the state before eos (`"schedule": "cosine"` runs it with `value.pretrain.verifier_lr_schedule: cosine`).
`critic_pretrain_variants.py` with that directory as `backbone` then runs the usual value pretraining
from it (the head is kept: the checkpoint's config already has one output) and prints the held-out EV to
set against the ceiling. Nothing under runs/ changes. The phase is the
library's `rlpipe.train.critic.pretrain_verifier`, which `value.pretrain.verifier_steps` runs in the
pipeline.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from rlpipe import paths
from rlpipe.config import load_params


def main(out: Path, variant: dict) -> None:
    from rlpipe.train.critic import pretrain_verifier

    params = load_params()
    # the phase's defaults are value.pretrain's own; only its step count (0 there: off) needs one here
    given = {f"verifier_{key}": variant[key] for key in ("prompts", "lr") if key in variant}
    if "schedule" in variant:
        given["verifier_lr_schedule"] = variant["schedule"]
    pretrain = params.value.pretrain.model_copy(update={"verifier_steps": variant.get("steps", 600), **given})
    params = params.model_copy(update={"value": params.value.model_copy(update={"pretrain": pretrain})})
    torch.manual_seed(params.seed)
    started = time.perf_counter()
    metrics = pretrain_verifier(params, paths.policy_dir("r0"), paths.TRAIN, out / "verifier")
    print(f"{json.dumps(variant)}: held-out EV on the verifier rows {metrics['value/verifier_explained_variance']:.4f} "
          f"after {metrics['value/verifier_steps']} steps, {metrics['value/verifier_rows']} rows "
          f"({time.perf_counter() - started:.0f} s); written to {out / 'verifier'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
