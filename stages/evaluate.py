"""evaluate: greedy pass@1, unbiased pass@k and maj@k of the initial and final policies; the curve.

Reads params `seed`, `eval`, `rollout`, `reward`, `data.task`, every runs/policy/rK and
runs/data/test.parquet. Writes runs/metrics/eval.json, runs/metrics/rounds.json and
runs/metrics/evaluate.json (timings) and the PNG plots in runs/plots/; logs pass@1 and friends on the MLflow parent run.
"""

from rlpipe.runner import run_stage

if __name__ == "__main__":
    run_stage("evaluate")
