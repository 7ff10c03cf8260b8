"""advantage@rK: shaping, dynamic sampling, old/ref logprobs, critic values, advantages.

Reads params `seed`, `algorithm`, `rollout`, `update.micro_batch_tokens`, `model.dtype`,
runs/rounds/rK/rewards.parquet, runs/policy/r(K-1) (old), runs/policy/r0 (reference) and
runs/critic/r(K-1). Writes runs/rounds/rK/batch.parquet and runs/metrics/advantage_rK.json.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def advantage(ctx):
    from rlpipe.advantage import build_batch

    ctx.init_torch()
    name, prev = ctx.round_name, ctx.params.rounds[ctx.round_name].prev
    return build_batch(ctx.params, name, paths.rewards_path(name), paths.policy_dir(prev), paths.policy_dir("r0"),
                       paths.critic_dir(prev), paths.batch_path(name))


if __name__ == "__main__":
    run_stage("advantage", advantage, with_round=True)
