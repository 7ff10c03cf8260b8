"""Rollout: sample M responses per prompt from the round's starting policy, with behaviour logprobs.

`ROLLOUT_BACKENDS` maps `rollout.backend` to a factory; `vllm` is imported only when chosen.
"""

from __future__ import annotations

import math
from pathlib import Path

from rlpipe import artifacts
from rlpipe.registry import Registry
from rlpipe.config import Params, RolloutConfig
from rlpipe.data import read_prompts, round_prompt_rows

ROLLOUT_BACKENDS = Registry("rollout backend")


# A factory takes (policy_path, rollout config, dtype) and returns a backend with `.tokenizer`, a
# `generate` (see base.py) and `.startup_seconds`: the HF backend loads the transformers model, vLLM its
# own engine on the directory.
@ROLLOUT_BACKENDS.register("hf")
def _hf_backend(policy_path: Path, cfg: RolloutConfig, dtype: str):
    from rlpipe.models import load_policy
    from rlpipe.rollout.hf import HFBackend

    model, tokenizer = load_policy(policy_path, dtype)
    return HFBackend(model, tokenizer, batch_size=cfg.batch_size)


@ROLLOUT_BACKENDS.register("vllm")
def _vllm_backend(policy_path: Path, cfg: RolloutConfig, dtype: str):
    from transformers import AutoTokenizer

    from rlpipe.rollout.vllm import VLLMBackend

    return VLLMBackend(str(policy_path), AutoTokenizer.from_pretrained(str(policy_path)), cfg, dtype=dtype)


def prompts_to_generate(params: Params) -> int:
    """The round's prompts, over-sampled when dynamic sampling will drop groups."""
    n = params.rollout.prompts_per_round
    if params.algorithm.resolve().dynamic_sampling:
        n = math.ceil(n * params.rollout.oversample)
    return n


def rollout_round(params: Params, round_name: str, policy_path: Path, train_path: Path, out_path: Path) -> dict:
    """Generate the round's rollouts artifact; returns its metrics."""
    import torch

    from rlpipe.rollout.base import GenerationRows, SamplingSpec
    from rlpipe.rollout.sampling import prompt_seed, prompt_uniforms
    from rlpipe.prompts import encode_prompts

    cfg, algo = params.rollout, params.algorithm.resolve()
    table = read_prompts(train_path)
    rows = round_prompt_rows(table.num_rows, prompts_to_generate(params), params.seed, round_name)
    prompts = table.take(rows).to_pydict()
    backend = ROLLOUT_BACKENDS.get(cfg.backend)(policy_path, cfg, params.model.dtype)
    tokenizer = backend.tokenizer

    per_group = cfg.samples_per_prompt + int(algo.greedy_baseline)
    prompt_ids = encode_prompts(tokenizer, prompts["prompt"], params.data)
    row_prompt_ids = [ids for ids in prompt_ids for _ in range(per_group)]
    stream = f"rollout@{round_name}"
    uniforms = prompt_uniforms(params.seed, stream, prompts["prompt_id"], per_group, cfg.max_new_tokens)
    seeds = [prompt_seed(params.seed, stream, pid) for pid in prompts["prompt_id"] for _ in range(per_group)]
    greedy = torch.tensor([algo.greedy_baseline and k == cfg.samples_per_prompt
                           for _ in prompts["prompt_id"] for k in range(per_group)])
    spec = SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    out = backend.generate(GenerationRows(row_prompt_ids, uniforms, greedy, seeds), spec, desc=f"rollout {round_name}")

    def per_row(values: list) -> list:
        return [v for v in values for _ in range(per_group)]

    columns = {
        "prompt_id": per_row(prompts["prompt_id"]),
        "group": per_row(list(range(len(rows)))),
        "sample": [k for _ in rows for k in range(per_group)],
        "is_greedy": greedy.tolist(),
        "prompt": per_row(prompts["prompt"]),
        "answer": per_row(prompts["answer"]),
        "meta": per_row(prompts["meta"]),
        "prompt_ids": row_prompt_ids,
        "response_ids": out.response_ids,
        "response_text": tokenizer.batch_decode(out.response_ids, skip_special_tokens=True),
        "behaviour_logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
    }
    artifacts.write_table(out_path, columns, artifacts.ROLLOUTS)
    sampled = [i for i, g in enumerate(columns["is_greedy"]) if not g]
    lengths = [len(out.response_ids[i]) for i in sampled]
    return {
        "rollout/prompts": len(rows),
        "rollout/responses": len(sampled),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": max(lengths),
        "rollout/truncation_rate": sum(out.finish_reason[i] == "length" for i in sampled) / len(sampled),
        "rollout/generated_tokens": out.generated_tokens,
        "rollout/tokens_per_s": out.generated_tokens / max(out.seconds, 1e-9),
        "rollout/generate_seconds": out.seconds,
        "rollout/engine_startup_seconds": backend.startup_seconds,
    }
