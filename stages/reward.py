"""reward@rK: verify every rollout; step rewards on token indices; the overlong penalty.

Needs neither torch nor transformers. Reads params `reward`, `data.task`, `rollout.max_new_tokens`,
runs/rounds/rK/rollouts.parquet and the policy's tokenizer.json (to place multi-step rewards).
Writes runs/rounds/rK/rewards.parquet and runs/metrics/reward_rK.json.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("reward")
