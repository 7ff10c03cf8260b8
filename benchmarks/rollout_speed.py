"""(c) HF rollout backend tokens/s against `model.generate` called directly on the same inputs.

The embedded tiny model (4 x 128) on 256 prompts x 8 samples of the addition task, max_new_tokens 6,
batches of 2048 sequences, 2 threads. The baseline is plain sampling `generate` over the same rows
and batches. Target: >= 0.9x the baseline's tokens/s.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import table
from rlpipe.config import TinyModelConfig
from rlpipe.models.policy import build_tiny_model
from rlpipe.data.prompts import encode_prompts
from rlpipe.rollout.base import GenerationRows, SamplingSpec
from rlpipe.rollout.hf import HFBackend
from rlpipe.rollout.sampling import prompt_uniforms
from rlpipe.models.sequences import pad_ragged
from rlpipe.data.tasks import generate_split
from rlpipe.models.tokenizer import build_char_tokenizer

PROMPTS, SAMPLES, MAX_NEW, BATCH = 256, 8, 6, 2048


def direct_generate(model, tokenizer, rows: list[list[int]]) -> tuple[int, float]:
    generated, started = 0, time.perf_counter()
    for start in range(0, len(rows), BATCH):
        ids, mask = pad_ragged(rows[start : start + BATCH], tokenizer.pad_token_id, torch.long, left=True)
        out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, max_new_tokens=MAX_NEW,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        new = out[:, ids.shape[1]:]
        is_eos = new == tokenizer.eos_token_id
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((len(new),), new.shape[1]))
        generated += int(lengths.sum())
    return generated, time.perf_counter() - started


def run(repeats: int = 5) -> str:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tokenizer, seed=0).eval()
    examples = generate_split("addition", 0, PROMPTS, 2, 3)
    prompt_ids = encode_prompts(tokenizer, [e.prompt for e in examples])
    rows = [p for p in prompt_ids for _ in range(SAMPLES)]
    uniforms = prompt_uniforms(0, "bench", list(range(PROMPTS)), SAMPLES, MAX_NEW)
    backend = HFBackend(model, tokenizer, BATCH)
    spec = SamplingSpec(MAX_NEW, 1.0, 0, 1.0)
    ratios, ours_tps, base_tps = [], [], []
    with torch.no_grad():
        for k in range(repeats + 1):
            out = backend.generate(GenerationRows(rows, uniforms, torch.zeros(len(rows), dtype=torch.bool)), spec)
            tokens, seconds = direct_generate(model, tokenizer, rows)
            if k:  # the first pair warms up
                ours_tps.append(out.generated_tokens / out.seconds), base_tps.append(tokens / seconds)
                ratios.append(ours_tps[-1] / base_tps[-1])
    median = sorted(ratios)[len(ratios) // 2]
    return table("(c) HF rollout backend against model.generate on the same rows",
                 ["ours tok/s", "generate tok/s", "ratio (>= 0.9)", "min", "max"],
                 [[sorted(ours_tps)[len(ours_tps) // 2], sorted(base_tps)[len(base_tps) // 2], median,
                   min(ratios), max(ratios)]])


if __name__ == "__main__":
    print(run())
