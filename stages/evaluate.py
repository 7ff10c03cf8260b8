"""evaluate: greedy pass@1, unbiased pass@k and maj@k of the initial and final policies; the curve.

Reads params `seed`, `eval`, `rollout`, `reward`, `data.task`, every runs/policy/rK and
runs/data/test.parquet. Writes runs/metrics/eval.json, runs/metrics/rounds.json and
runs/metrics/evaluate.json (timings) and the PNG plots in runs/plots/; logs pass@1 and friends on the MLflow parent run.
"""

from rlpipe import paths
from rlpipe.stage import run_stage


def evaluate(ctx):
    from rlpipe.evaluation import evaluate

    ctx.init_torch()
    metrics = evaluate(ctx.params, paths.TEST, tracker=ctx.tracker)
    ctx.tracker.log_metrics(metrics)
    ctx.tracker.log_metrics(metrics, to_parent=True)
    # the results live in eval.json; evaluate.json keeps only this stage's timings, so that
    # `dvc exp show` lists each result once
    return {}


if __name__ == "__main__":
    run_stage("evaluate", evaluate)
