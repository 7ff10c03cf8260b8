"""init: the round-0 policy (and reference), as a save_pretrained directory with its tokenizer.

Reads params `seed`, `model`, `data` (task, step_target_fraction) and runs/data/train.parquet (the embedded
model's SFT warm start). Writes runs/policy/r0/ and runs/metrics/init.json.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("init")
