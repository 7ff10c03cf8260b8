"""rollout@rK: M responses per prompt from the policy of round K-1, with behaviour logprobs.

Reads params `seed`, `rollout`, `model.dtype`, the algorithm keys that change sampling (greedy
baseline, dynamic sampling), runs/policy/r(K-1) and runs/data/train.parquet. Writes
runs/rounds/rK/rollouts.parquet and runs/metrics/rollout_rK.json.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def rollout(ctx):
    from rlpipe.rollout import rollout_round

    ctx.init_torch()
    prev = ctx.params.rounds[ctx.round_name].prev
    return rollout_round(ctx.params, ctx.round_name, paths.policy_dir(prev), paths.TRAIN,
                         paths.rollouts_path(ctx.round_name))


if __name__ == "__main__":
    run_stage("rollout", rollout, with_round=True)
