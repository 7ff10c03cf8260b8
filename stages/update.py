"""update@rK: PPO-style optimisation of the policy (and the critic) on the round's batch.

Reads params `seed`, `update`, `algorithm`, `value`, `rollout`, `model.dtype`,
runs/rounds/rK/batch.parquet, runs/policy/r(K-1) (weights + optimizer state) and runs/critic/r(K-1).
Writes runs/policy/rK/, runs/critic/rK/ and runs/metrics/update_rK.json. With update.nproc > 1 the
policy update runs under torchrun (rlpipe/distributed_update.py).
"""

from rlpipe.stage import run_stage


def update(ctx):
    from rlpipe.distributed_update import run_update

    ctx.init_torch()
    return run_update(ctx.params, ctx.round_name, ctx.tracker)


if __name__ == "__main__":
    run_stage("update", update, with_round=True)
