"""The update stage under torchrun: `update.nproc` processes train the policy together.

The stage process stays the one DVC and MLflow see: it launches
`torchrun --standalone --nproc_per_node N -m rlpipe.distributed_update ROUND RESULT`, every rank runs
`update_policy` and then the critic update with its share of each minibatch's groups, rank 0 writes both
checkpoints and the metrics to RESULT, which the stage then logs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlpipe import paths
from rlpipe.errors import PipelineError


def run_update(params, round_name: str, tracker=None) -> dict:
    """Policy (and critic) update of one round: in process, or under torchrun when update.nproc > 1."""
    from rlpipe.models import check_compatible
    from rlpipe.training import update_policy
    from rlpipe.value_model import update_critic

    prev = params.rounds[round_name].prev
    check_compatible({"policy": paths.policy_dir(prev), "critic": paths.critic_dir(prev)})
    try:
        if params.update.nproc == 1:
            metrics = update_policy(params, round_name, paths.batch_path(round_name), paths.policy_dir(prev),
                                    paths.policy_dir(round_name), tracker)
            metrics.pop("step_metrics")
            metrics.update(update_critic(params, round_name, paths.batch_path(round_name), paths.critic_dir(prev),
                                         paths.critic_dir(round_name)))
        else:
            metrics = launch(params, round_name)
    except BaseException:
        # policy and critic are one stage's outputs: a failed critic update takes the new policy with it
        shutil.rmtree(paths.policy_dir(round_name), ignore_errors=True)
        raise
    for step in metrics.pop("step_metrics", []):
        if tracker is not None:
            values = {f"train/{k}": v for k, v in step.items() if k != "step"}
            tracker.log_metrics(values, step=step["step"])
            tracker.log_metrics(values, step=step["step"], to_parent=True)
    return metrics


def launch(params, round_name: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlpipe-torchrun-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={params.update.nproc}", "-m", "rlpipe.distributed_update", round_name, str(result)]
        threads = max(1, params.runtime.torch_threads // params.update.nproc)
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if done.returncode != 0 or not result.is_file():
            raise PipelineError(f"update@{round_name}: torchrun with {params.update.nproc} processes failed "
                                f"(exit {done.returncode}); see the ranks' messages above")
        return json.loads(result.read_text())


def main() -> int:
    import torch

    from rlpipe.config import load_params
    from rlpipe.distributed import init_world
    from rlpipe.training import update_policy
    from rlpipe.value_model import update_critic

    round_name, result = sys.argv[1], Path(sys.argv[2])
    params = load_params()
    torch.manual_seed(params.seed)
    world = init_world()
    prev = params.rounds[round_name].prev
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
