"""The update under torchrun: `update.nproc` processes train the policy (and the critic) together.

The stage process stays the one DVC and MLflow see: it launches
`torchrun --standalone --nproc_per_node N -m rlpipe.train.torchrun ROUND RESULT`, every rank runs
`update_policy` and then the critic update with its share of each minibatch's groups, rank 0 writes both
checkpoints and the metrics to RESULT, which the stage then logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rlpipe import paths
from rlpipe.errors import PipelineError


def launch(params, round_name: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlpipe-torchrun-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={params.update.nproc}", "-m", "rlpipe.train.torchrun", round_name, str(result)]
        threads = max(1, params.runtime.torch_threads // params.update.nproc)
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if done.returncode != 0 or not result.is_file():
            raise PipelineError(f"update@{round_name}: torchrun with {params.update.nproc} processes failed "
                                f"(exit {done.returncode}); see the ranks' messages above")
        return json.loads(result.read_text())


def main() -> int:
    import torch

    from rlpipe.config import load_params
    from rlpipe.train.critic import update_critic
    from rlpipe.train.distributed import init_world
    from rlpipe.train.policy import update_policy

    round_name, result = sys.argv[1], Path(sys.argv[2])
    params = load_params()
    torch.manual_seed(params.seed)
    world = init_world()
    prev = paths.previous_round(round_name)
    metrics = update_policy(params, round_name, paths.batch_path(round_name), paths.policy_dir(prev),
                            paths.policy_dir(round_name), world=world)
    metrics.update(update_critic(params, round_name, paths.batch_path(round_name), paths.critic_dir(prev),
                                 paths.critic_dir(round_name), world))
    if world.is_main:
        result.write_text(json.dumps(metrics))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
