"""advantage@rK: shaping, dynamic sampling, old/ref logprobs, critic values, advantages.

Reads params `seed`, `algorithm`, `rollout`, `update.micro_batch_tokens`, `model.dtype`,
runs/rounds/rK/rewards.parquet, runs/policy/r(K-1) (old), runs/policy/r0 (reference) and
runs/critic/r(K-1). Writes runs/rounds/rK/batch.parquet and runs/metrics/advantage_rK.json.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("advantage")
