"""rollout@rK: M responses per prompt from the policy of round K-1, with behaviour logprobs.

Reads params `seed`, `rollout`, `model.dtype`, the algorithm keys that change sampling (greedy
baseline, dynamic sampling), runs/policy/r(K-1) and runs/data/train.parquet. Writes
runs/rounds/rK/rollouts.parquet and runs/metrics/rollout_rK.json.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("rollout")
