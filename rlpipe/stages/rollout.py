"""rollout@rK: M responses per prompt from the policy of round K-1, with behaviour logprobs.

Reads the round's prompts (one slice of the train split's stream of permutations, over-sampled under
dynamic sampling) and runs the configured backend. ReMax presets add one greedy row per group, whose
reward becomes the group's baseline. Writes the `rollouts` table.
"""

from __future__ import annotations

from rlpipe import artifacts, paths
from rlpipe.data.splits import read_prompts, round_prompt_rows
from rlpipe.rollout import prompts_to_generate, rollout_backend
from rlpipe.rollout.base import SamplingSpec
from rlpipe.rollout.generate import generate_groups


def rollout(ctx) -> dict:
    ctx.init_torch()
    params, round_name = ctx.params, ctx.round_name
    cfg, algo = params.rollout, params.algorithm.resolve()
    table = read_prompts(paths.TRAIN)
    rows = round_prompt_rows(table.num_rows, prompts_to_generate(params), params.seed, round_name)
    prompts = table.take(rows).to_pydict()
    backend = rollout_backend(ctx.models, paths.policy_dir(ctx.prev_round), cfg, params.model.dtype)
    pattern = [False] * cfg.samples_per_prompt + [True] * int(algo.greedy_baseline)
    groups = generate_groups(backend, prompts["prompt"], prompts["prompt_id"], greedy_pattern=pattern,
                             stream=f"rollout@{round_name}", seed=params.seed,
                             spec=SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p),
                             data=params.data, desc=f"rollout {round_name}")
    out = groups.output
    columns = {
        "prompt_id": groups.per_row(prompts["prompt_id"]),
        "group": groups.per_row(list(range(len(rows)))),
        "sample": [k for _ in rows for k in range(groups.per_group)],
        "is_greedy": groups.greedy.tolist(),
        "prompt": groups.per_row(prompts["prompt"]),
        "answer": groups.per_row(prompts["answer"]),
        "meta": groups.per_row(prompts["meta"]),
        "prompt_ids": groups.prompt_ids,
        "response_ids": out.response_ids,
        "response_text": groups.texts,
        "behaviour_logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
    }
    artifacts.write_table(paths.rollouts_path(round_name), columns, artifacts.ROLLOUTS)
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
