"""update@rK: PPO-style optimisation of the policy (and the critic) on the round's batch.

Reads params `seed`, `update`, `algorithm`, `value`, `rollout`, `model.dtype`,
runs/rounds/rK/batch.parquet, runs/policy/r(K-1) (weights + optimizer state) and runs/critic/r(K-1).
Writes runs/policy/rK/, runs/critic/rK/ and runs/metrics/update_rK.json.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def update(ctx):
    from rlpipe.training import update_policy
    from rlpipe.value_model import update_critic

    ctx.init_torch()
    name, prev = ctx.round_name, ctx.params.rounds[ctx.round_name].prev
    metrics = update_policy(ctx.params, name, paths.batch_path(name), paths.policy_dir(prev),
                            paths.policy_dir(name), ctx.tracker)
    metrics.update(update_critic(ctx.params, name, paths.batch_path(name), paths.critic_dir(prev),
                                 paths.critic_dir(name)))
    return metrics


if __name__ == "__main__":
    run_stage("update", update, with_round=True)
