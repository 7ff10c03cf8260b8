"""value_pretrain: the round-0 critic, fitted to Monte-Carlo returns of the initial policy.

Critic-free presets get a small marker file and no model load. Reads params `seed`, `value`,
`algorithm`, `rollout`, `reward`, runs/policy/r0 and runs/data/train.parquet. Writes runs/critic/r0/
and runs/metrics/value_pretrain.json.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("value_pretrain")
