"""The prepared GPU check runs here on the CPU, through the same shell command a session lent the device
machine runs, and writes its figures: device_check.py with a tiny shape, and device_pipeline.py (slow) on
the miniature params."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO


def test_device_check_runs_on_cpu_with_a_tiny_shape(tmp_path):
    done = subprocess.run(
        ["bash", str(REPO / "scripts/device_check.sh"), "--shape", "tiny", "--steps", "2", "--prompts", "4",
         "--samples", "2", "--prompt-len", "8", "--response-len", "8"],
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "DEVICE_PIPELINE": "off"},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "device_check.json").read_text())
    assert figures["device"] == "cpu" and figures["shape"] == "tiny" and figures["parameters"] > 0
    # the advantage stage's pass and the update's agree on the same weights
    assert figures["logprob_max_abs_diff"]["fp32"] < 1e-5
    assert figures["logprob_max_abs_diff"]["bf16_autocast"] < 0.1
    for strategy in ("ddp", "fsdp2"):
        update = figures["update"][strategy]
        assert len(update["step_seconds"]) == 2 and update["train_tokens_per_s"] > 0
        assert all(math.isfinite(loss) for loss in update["losses"])
    # one-process DDP and FSDP2 take the same first step from the same weights
    assert math.isclose(figures["update"]["ddp"]["losses"][0], figures["update"]["fsdp2"]["losses"][0], rel_tol=1e-2)
    # the store's offload round trip returns every tensor as it was, and the optimizer still trains the model
    trip = figures["offload_round_trip"]
    assert trip["bitwise_equal"] and trip["trains_after"] and trip["gib_freed"] is None  # no GPU memory here
    rollout = figures["rollout_hf"]
    assert rollout["responses"] == 8 and 0 < rollout["generated_tokens"] <= 64 and rollout["tokens_per_s"] > 0


@pytest.mark.slow
def test_device_pipeline_runs_every_stage_cold_and_warm_and_compares_their_bytes(tmp_path):
    """On the CPU every kernel repeats, so all four variants write the same bytes: what the GPU run is
    measured against. Through device_check.sh, which runs both parts."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts/device_check.sh"), "--shape", "tiny", "--steps", "1", "--prompts", "2",
         "--samples", "2", "--prompt-len", "8", "--response-len", "8"],
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
             "DEVICE_PIPELINE_ARGS": "--params tests/params_mini.yaml --set algorithm.preset=ppo --rounds 2"},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "device_check.json").is_file()
    figures = json.loads((tmp_path / "device_pipeline.json").read_text())
    assert figures["device"] == "cpu" and figures["skipped"] == []
    stages = figures["stages"]
    assert [r["stage"] for r in stages["before_rounds"]] == ["fingerprint", "prepare", "init", "value_pretrain"]
    for variant in ("cold_deterministic", "warm_deterministic", "cold", "warm"):
        runs = stages[variant]
        assert [r["stage"] for r in runs] == ["fingerprint", *(f"{s}@r{k}" for k in (1, 2) for s in
                                              ("rollout", "reward", "advantage", "update")), "evaluate"]
        assert all(r["ok"] for r in runs)
        # the warm variants ran in the worker (it reports its loads), the cold ones in their own processes
        assert ("stage/worker_loads" in runs[1]["metrics"]) == variant.startswith("warm")
        assert figures["pass_at_1"][variant]["last_round"] is not None
    assert figures["artifacts_compared"] > 30  # data, both checkpoints of r0-r2, the round tables
    assert figures["differing_files"] == {"warm_deterministic vs cold_deterministic": [], "warm vs cold": [],
                                          "cold vs cold_deterministic": []}
