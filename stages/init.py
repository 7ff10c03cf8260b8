"""init: the round-0 policy (and reference), as a save_pretrained directory with its tokenizer.

Reads params `seed`, `model`, `data.task` and runs/data/train.parquet (the embedded model's SFT warm
start). Writes runs/policy/r0/ and runs/metrics/init.json.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def init(ctx):
    from rlpipe.policy_init import init_policy

    ctx.init_torch()
    return init_policy(ctx.params, paths.TRAIN, paths.policy_dir("r0"))


if __name__ == "__main__":
    run_stage("init", init)
