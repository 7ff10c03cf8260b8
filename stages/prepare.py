"""prepare: the train/test prompt splits.

Reads params `seed`, `data`. Writes runs/data/train.parquet and runs/data/test.parquet
(prompt_id, prompt, answer, meta), and runs/metrics/prepare.json.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("prepare")
