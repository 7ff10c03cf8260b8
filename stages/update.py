"""update@rK: PPO-style optimisation of the policy (and the critic) on the round's batch.

Reads params `seed`, `update`, `algorithm`, `value`, `rollout`, `model.dtype`,
runs/rounds/rK/batch.parquet, runs/policy/r(K-1) (weights + optimizer state) and runs/critic/r(K-1).
Writes runs/policy/rK/, runs/critic/rK/ and runs/metrics/update_rK.json. With update.nproc > 1 or
update.nnodes > 1 the policy update runs under torchrun (rlpipe/train/torchrun.py), this machine being
node 0; each other node runs `rlpipe update-node --round rK --node-rank K`.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("update")
