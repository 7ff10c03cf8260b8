"""update@rK: PPO-style optimisation of the policy (and the critic) on the round's batch.

One process, or `update.nproc` processes on each of `update.nnodes` nodes under torchrun
(`rlpipe.train.torchrun`), launched from here (a stage process or the warm worker) as node 0. The policy
and the critic are one stage's outputs: a failed critic update removes the new policy as well.
"""

from __future__ import annotations

import shutil

from rlpipe import paths
from rlpipe.models.policy import check_compatible
from rlpipe.train.critic import update_critic
from rlpipe.train.distributed import World
from rlpipe.train.policy import update_policy
from rlpipe.train.torchrun import launch


def update(ctx) -> dict:
    ctx.init_torch()
    params, round_name, prev = ctx.params, ctx.round_name, ctx.prev_round
    check_compatible({"policy": paths.policy_dir(prev), "critic": paths.critic_dir(prev)})
    ctx.models.release_accelerator()  # the warm worker's rollout engine sleeps while the trainer runs
    try:
        if params.update.world_size == 1:  # several nodes go through torchrun even with nproc 1
            world = World(device=ctx.models.device)  # one process, on runtime.device
            metrics = update_policy(params, round_name, paths.batch_path(round_name), paths.policy_dir(prev),
                                    paths.policy_dir(round_name), ctx.tracker, world, models=ctx.models)
            metrics.pop("step_metrics")
            metrics.update(update_critic(params, round_name, paths.batch_path(round_name), paths.critic_dir(prev),
                                         paths.critic_dir(round_name), world, models=ctx.models))
        else:
            ctx.models.offload()  # the ranks' own processes take the GPUs: the worker's models wait on the CPU
            metrics = launch(params, round_name)
    except BaseException:
        shutil.rmtree(paths.policy_dir(round_name), ignore_errors=True)
        raise
    for step in metrics.pop("step_metrics", []):
        values = {f"train/{k}": v for k, v in step.items() if k != "step"}
        ctx.tracker.log_metrics(values, step=step["step"])
        ctx.tracker.log_metrics(values, step=step["step"], to_parent=True)
    return metrics
