"""The reasoning task through the real pipeline: `dvc repro` of the miniature params switched to
`data.task: reasoning` under ppo, with the critic's ceiling on. Every stage runs; eval.json groups the
test prompts by difficulty; value pretraining and the round's advantage stage report the oracle EV; and
every stage, the oracle's generation and scoring included, reads only the params and code it declares."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO
from scratch import dvc, make_project, ran_stages
from test_dependencies import assert_all_declared, check_every_stage

pytestmark = pytest.mark.slow


def test_reasoning_with_the_oracle_ev_through_dvc_repro(tmp_path):
    params = yaml.safe_load((REPO / "tests/params_mini.yaml").read_text())
    params["data"].update(task="reasoning", min_terms=2, max_terms=3)  # 1-digit operands: "3+5+9=" -> "#17"
    params["rollout"]["max_new_tokens"] = 20  # "9+9=18;18+9=27;#27" and eos
    params["algorithm"]["preset"] = "ppo"
    params["value"]["oracle_ev"] = {"continuations": 2, "max_responses": 4}
    params["rounds"] = 1
    params["tracking"]["enabled"] = False  # the declarations check reruns every stage
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    root = make_project(tmp_path / "project", tmp_path / "params.yaml")
    log = dvc(root, "repro")
    assert "evaluate" in ran_stages(log)
    metrics = json.loads((root / "runs/metrics/eval.json").read_text())
    assert set(metrics["by_difficulty"]) <= {"n2-carry", "n2-nocarry", "n3-carry", "n3-nocarry"}
    assert sum(b["prompts"] for b in metrics["by_difficulty"].values()) == metrics["test_prompts"]
    assert "mean_length_correct" in metrics and "mean_length_incorrect_init" in metrics
    for stage in ("value_pretrain", "advantage_r1"):
        measured = json.loads((root / f"runs/stage_metrics/{stage}.json").read_text())
        assert measured["value/oracle_probed_responses"] == 4
        for key in ("value/oracle_explained_variance", "value/probed_explained_variance",
                    "value/ev_fraction_of_ceiling", "value/ev_fraction_of_ceiling_low",
                    "value/ev_fraction_of_ceiling_high"):
            assert key in measured, (stage, key)
    assert_all_declared(check_every_stage(root))
