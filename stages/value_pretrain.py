"""value_pretrain: the round-0 critic, fitted to Monte-Carlo returns of the initial policy.

Critic-free presets get a small marker file and no model load. Reads params `seed`, `value`,
`algorithm`, `rollout`, `reward`, runs/policy/r0 and runs/data/train.parquet. Writes runs/critic/r0/
and runs/metrics/value_pretrain.json.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def value_pretrain(ctx):
    from rlpipe.value_model import write_no_critic_marker

    if not ctx.params.algorithm.resolve().needs_critic:
        return write_no_critic_marker(paths.critic_dir("r0"), ctx.params.algorithm.preset)
    from rlpipe.value_pretrain import pretrain_critic

    ctx.init_torch()
    return pretrain_critic(ctx.params, paths.policy_dir("r0"), paths.TRAIN, paths.critic_dir("r0"), ctx.tracker)


if __name__ == "__main__":
    run_stage("value_pretrain", value_pretrain)
