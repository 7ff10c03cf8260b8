"""The MLflow side process of `rlpipe.tracking.StageTracker`; reads JSON lines on stdin.

It imports MLflow and opens the store first (the slow part, overlapped with the stage's own work),
then finds or creates the execution's parent run, creates the stage's child run, buffers metrics and
writes them with `log_batch` when the stage ends (or when stdin closes without an end: a killed stage
is marked KILLED).
"""

from __future__ import annotations

import json
import sys
import time

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

BATCH_METRICS = 1000
BATCH_PARAMS = 100


def experiment_id(client: MlflowClient, name: str, artifact_root: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=f"{artifact_root}/{name}")
    except Exception:  # created meanwhile by another process
        return client.get_experiment_by_name(name).experiment_id


def parent_run_id(client: MlflowClient, exp_id: str, start: dict) -> str:
    found = client.search_runs(
        [exp_id],
        filter_string=f"tags.`rlpipe.execution` = '{start['execution_id']}' and tags.`rlpipe.stage` = 'pipeline'",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    tags = {**start["tags"], "rlpipe.execution": start["execution_id"], "rlpipe.stage": "pipeline"}
    tags.pop("rlpipe.round", None)
    run = client.create_run(exp_id, run_name=start["parent_name"], tags=tags)
    params = [Param(k, str(v)[:6000]) for k, v in start["params"].items()]
    for i in range(0, len(params), BATCH_PARAMS):
        client.log_batch(run.info.run_id, params=params[i : i + BATCH_PARAMS])
    return run.info.run_id


def metric_name(name: str) -> str:
    """MLflow names allow only letters, digits, _ - . / : and space: pass@1 is logged as pass_at_1."""
    return name.replace("@", "_at_")


def flush(client: MlflowClient, run_id: str, metrics: list[Metric]) -> None:
    for i in range(0, len(metrics), BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[i : i + BATCH_METRICS])


def main() -> int:
    first = sys.stdin.readline()
    if not first:
        return 0
    start = json.loads(first)
    client = MlflowClient(tracking_uri=start["tracking_uri"])
    exp_id = experiment_id(client, start["experiment"], start["artifact_root"])
    parent = parent_run_id(client, exp_id, start)
    child = client.create_run(
        exp_id,
        run_name=start["run_name"],
        tags={**start["tags"], MLFLOW_PARENT_RUN_ID: parent, MLFLOW_RUN_NAME: start["run_name"],
              "rlpipe.execution": start["execution_id"]},
    ).info.run_id
    client.update_run(parent, status="RUNNING")
    pending: dict[str, list[Metric]] = {child: [], parent: []}
    status = "KILLED"
    for line in sys.stdin:
        message = json.loads(line)
        target = parent if message.get("to_parent") else child
        if message["op"] == "metrics":
            step = message["step"] or 0
            pending[target] += [Metric(metric_name(k), v, message["time_ms"], step)
                                for k, v in message["metrics"].items()]
        elif message["op"] == "artifact":
            client.log_artifact(target, message["path"], message.get("artifact_path"))
        elif message["op"] == "end":
            status = message["status"]
    for run_id, metrics in pending.items():
        flush(client, run_id, metrics)
    now = int(time.time() * 1000)
    client.set_terminated(child, status=status, end_time=now)
    # The parent reads FINISHED between stages; a failed stage marks it FAILED until a later one succeeds.
    client.set_terminated(parent, status="FINISHED" if status == "FINISHED" else "FAILED", end_time=now)
    return 0 if RunStatus.from_string(status) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
