"""reward@rK: verify every rollout; step rewards on token indices; the overlong penalty.

Needs neither torch nor transformers. Reads params `reward`, `data.task`, `rollout.max_new_tokens`,
runs/rounds/rK/rollouts.parquet and the policy's tokenizer.json (to place multi-step rewards).
Writes runs/rounds/rK/rewards.parquet and runs/metrics/reward_rK.json.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def reward(ctx):
    from rlpipe.rewards import score_rollouts

    return score_rollouts(ctx.params, paths.rollouts_path(ctx.round_name),
                          paths.policy_dir("r0") / "tokenizer.json", paths.rewards_path(ctx.round_name))


if __name__ == "__main__":
    run_stage("reward", reward, with_round=True)
