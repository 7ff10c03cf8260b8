"""Smoke test of the real pipeline: `dvc repro` on a miniature params file, in a scratch git repo.

It checks what a user relies on: every stage runs and writes its artifacts, eval.json has the
headline metrics, MLflow holds one parent run with one child per stage, a second `dvc repro` runs
nothing, and an advantage-only change reruns from `advantage@r1` on (after the `fingerprint` stage) while
`rollout@r1` and `reward@r1` come from the cache.
"""

from __future__ import annotations

import json

import yaml

from scratch import dvc, ran_stages, tracked_stages


def stage_names(params: dict) -> list[str]:
    rounds = [f"r{k}" for k in range(1, params["rounds"] + 1)]
    per_round = [f"{s}@{r}" for r in rounds for s in ("rollout", "reward", "advantage", "update")]
    return ["fingerprint", "prepare", "init", "value_pretrain", *per_round, "evaluate"]


def test_repro_runs_every_stage(mini_run):
    root, log = mini_run
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert sorted(ran_stages(log)) == sorted(stage_names(params))
    metrics = json.loads((root / "runs/metrics/eval.json").read_text())
    for key in ("pass@1", "pass@1_init", "pass@k", "curve"):
        assert key in metrics, key
    assert [p["round"] for p in metrics["curve"]] == list(range(params["rounds"] + 1))
    for r in (f"r{k}" for k in range(1, params["rounds"] + 1)):
        assert (root / f"runs/policy/{r}/optimizer.pt").is_file()
        assert (root / f"runs/rounds/{r}/batch.parquet").is_file()


def test_checkpoints_reload_from_their_directory(mini_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = mini_run
    model = AutoModelForCausalLM.from_pretrained(root / "runs/policy/r1")
    tokenizer = AutoTokenizer.from_pretrained(root / "runs/policy/r1")
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.decode(tokenizer("37+45=")["input_ids"], skip_special_tokens=True) == "37+45="


def test_mlflow_has_one_parent_with_a_child_per_stage(mini_run):
    from mlflow.tracking import MlflowClient

    root, log = mini_run
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlpipe-test")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("rlpipe.stage") == "pipeline"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert sorted(r.info.run_name for r in children) == sorted(tracked_stages(log))
    assert all(r.info.status == "FINISHED" for r in children)
    assert "pass_at_1" in parents[0].data.metrics  # MLflow names cannot hold "@"
    history = client.get_metric_history(parents[0].info.run_id, "reward/accuracy")
    assert sorted(m.step for m in history) == [1, 2]
    # the held-out curve, one point a round, on the parent (what MLflow's Compare overlays across runs)
    curve = json.loads((root / "runs/metrics/rounds.json").read_text())
    history = client.get_metric_history(parents[0].info.run_id, "curve/pass_at_1")
    assert sorted((m.step, m.value) for m in history) == [(row["round"], row["pass@1"]) for row in curve]


def test_second_repro_runs_nothing(mini_run):
    root, _ = mini_run
    log = dvc(root, "repro")
    assert ran_stages(log) == []


def test_advantage_knob_reuses_rollouts(mini_run):
    root, _ = mini_run
    log = dvc(root, "exp", "run", "--temp", "-S", "algorithm.std_ddof=1")
    ran = ran_stages(log)
    assert "rollout@r1" not in ran and "reward@r1" not in ran
    assert ran[:2] == ["fingerprint", "advantage@r1"]  # the fingerprint stage reran; only advantage's changed
    assert {"update@r1", "rollout@r2", "evaluate"} <= set(ran)
    params = yaml.safe_load((root / "params.yaml").read_text())
    assert params["algorithm"]["std_ddof"] is None  # --temp leaves the workspace params alone


def test_dvc_plots_render_every_declared_plot_with_data(mini_run):
    """`dvc plots show` renders each plot dvc.yaml declares: no error, and a Vega spec holding every round
    (rounds.json rows share their keys; DVC's renderer drops a file whose rows differ)."""
    root, _ = mini_run
    shown = json.loads(dvc(root, "plots", "show", "--json"))
    assert not shown.get("errors"), shown.get("errors")
    params = yaml.safe_load((root / "params.yaml").read_text())
    declared = [next(iter(p)) for stage in yaml.safe_load((root / "dvc.yaml").read_text())["stages"].values()
                for p in stage.get("plots", [])]
    assert declared and sorted(shown["data"]) == sorted(declared)
    for name in declared:
        values = shown["data"][name][0]["content"]["data"]["values"]
        assert [v["round"] for v in values] == list(range(params["rounds"] + 1))
        assert all(0 <= v["pass@1"] <= 1 and v["pass@1_stderr"] >= 0 for v in values)
