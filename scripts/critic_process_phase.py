"""The process phase on its own: the check learnt on the init policy's own responses (issue 19, part 3)

    dvc repro init                          # in a project of examples/reasoning.yaml with a critic preset
    python scripts/critic_verifier_init.py OUT '{"prompts": 8192, "steps": 4000, "lr": 0.001}'
    python scripts/critic_process_phase.py OUT2 OUT/verifier '{"steps": 1000, "lr": 0.0003}'
    python scripts/critic_pretrain_variants.py OUT3 '{"backbone": "OUT2/process", ...}'

The verifier phase teaches the critic to check sums on rows it makes up: a right solution against one
slip. The policy slips otherwise: it copies an operand wrong, misses a carry, slips twice, or writes
wrong running sums under a right answer. This runs what `value.pretrain.process_steps` runs in the
pipeline: `process_rows` (rlpipe/stages/value_pretrain.py) has the init policy (runs/policy/r0) answer
the train prompts, `samples` responses each (value pretraining's held-out prompts left out), every state
labelled 1 while the text so far is the start of a right response and 0 after; then
`rlpipe.train.critic.pretrain_process` fits the critic to those labels from BACKBONE (a verifier, or the
init policy) for `steps` steps at `lr`. OUT/process is then a critic checkpoint for
`critic_pretrain_variants.py`'s `backbone`. Nothing under runs/ changes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from rlpipe import paths
from rlpipe.config import load_params


def main(out: Path, backbone: Path, variant: dict) -> None:
    from rlpipe.models.store import ModelStore
    from rlpipe.rollout import rollout_backend
    from rlpipe.stages.value_pretrain import process_rows
    from rlpipe.train.critic import pretrain_process

    params = load_params()
    given = {f"process_{key}": variant[key] for key in ("samples", "lr") if key in variant}
    pretrain = params.value.pretrain.model_copy(update={"process_steps": variant.get("steps", 1000), **given})
    params = params.model_copy(update={"value": params.value.model_copy(update={"pretrain": pretrain})})
    backend = rollout_backend(ModelStore(), paths.policy_dir("r0"), params.rollout, params.model.dtype)
    torch.manual_seed(params.seed)
    started = time.perf_counter()
    metrics = pretrain_process(params, *process_rows(params, backend), backbone, out / "process")
    print(f"{json.dumps(variant)} from {backbone}: held-out EV on the labels "
          f"{metrics['value/process_explained_variance']:.4f} after {metrics['value/process_steps']} steps, "
          f"{metrics['value/process_rows']} rows, {metrics['value/process_on_track_share']:.3f} of the states on "
          f"track ({time.perf_counter() - started:.0f} s); written to {out / 'process'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
