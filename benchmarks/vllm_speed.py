"""(e) vLLM rollout backend against the HF backend: engine start-up, tokens/s side by side, logprob drift.

The embedded default model (params.yaml's model.tiny: 4 layers x 128, 4 heads, float32, seeded init, no
warm start) on PROMPTS addition prompts x 8 samples, temperature 1, at max_new_tokens 6 (the pipeline's)
and 48 (decode-heavy). Both backends get the same rows; they alternate, and tokens/s are medians over
`repeats` runs after one warm-up each. Drift: max |vLLM behaviour logprob - transformers recompute|.
Needs vllm (`.venv-vllm`, see `make test-vllm`); vLLM spawns processes, so run it as a script:
`.venv-vllm/bin/python -m benchmarks.vllm_speed [--prompts N] [--repeats R] [--max-num-seqs S] [--eager]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import table
from rlpipe.config import RolloutConfig, RolloutVLLMConfig, TinyModelConfig
from rlpipe.models.policy import build_tiny_model, save_policy
from rlpipe.data.prompts import encode_prompts
from rlpipe.rollout.base import GenerationRows, SamplingSpec
from rlpipe.rollout.hf import HFBackend
from rlpipe.rollout.sampling import prompt_seed, prompt_uniforms
from rlpipe.models.sequences import batched_response_logprobs
from rlpipe.data.tasks import generate_split
from rlpipe.models.tokenizer import build_char_tokenizer

SAMPLES, BATCH = 8, 2048


def run(prompts: int = 256, repeats: int = 3, settings: RolloutVLLMConfig | None = None) -> str:
    from rlpipe.rollout.vllm import VLLMBackend

    torch.set_num_threads(2)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tokenizer, seed=0).eval()
    examples = generate_split("addition", 0, prompts, 2, 3)
    prompt_ids = encode_prompts(tokenizer, [e.prompt for e in examples])
    ids = list(range(prompts))
    rows_ids = [p for p in prompt_ids for _ in range(SAMPLES)]
    seeds = [prompt_seed(0, "bench", i) for i in ids for _ in range(SAMPLES)]
    greedy = torch.zeros(len(rows_ids), dtype=torch.bool)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        save_policy(model, tokenizer, Path(tmp))
        cfg = RolloutConfig(backend="vllm", batch_size=BATCH, temperature=1.0, vllm=settings or RolloutVLLMConfig())
        engine = VLLMBackend(tmp, tokenizer, cfg, dtype="float32")
        hf = HFBackend(model, tokenizer, BATCH)
        for max_new in (6, 48):
            rows = GenerationRows(rows_ids, prompt_uniforms(0, "bench", ids, SAMPLES, max_new), greedy, seeds)
            spec = SamplingSpec(max_new, 1.0, 0, 1.0)
            tps = {"vllm": [], "hf": []}
            for k in range(repeats + 1):
                with torch.no_grad():
                    for name, backend in (("vllm", engine), ("hf", hf)):
                        out = backend.generate(rows, spec)
                        if k:  # the first round warms up
                            tps[name].append(out.generated_tokens / out.seconds)
                        if name == "vllm":
                            vllm_out = out
            width = max(len(r) for r in vllm_out.response_ids)
            recomputed = batched_response_logprobs(model, rows_ids, vllm_out.response_ids, tokenizer.pad_token_id,
                                                   1.0, 1 << 16, width)
            drift = max(abs(a - b) for lp, rec in zip(vllm_out.logprobs, recomputed.tolist()) for a, b in zip(lp, rec))
            v, h = statistics.median(tps["vllm"]), statistics.median(tps["hf"])
            lines.append([max_new, len(rows_ids), v, h, v / h, f"{drift:.1e}"])
    title = (f"(e) vLLM (CPU) against the HF backend, tiny model 4x128 fp32; LLM() start-up "
             f"{engine.startup_seconds:.1f} s")
    return table(title, ["max_new_tokens", "sequences", "vLLM tok/s", "HF tok/s", "vLLM / HF", "max drift"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM max_num_seqs (CPU default 256)")
    parser.add_argument("--eager", action="store_true", help="vLLM enforce_eager (no torch.compile)")
    args = parser.parse_args()
    settings = {}
    if args.max_num_seqs:
        settings.update(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(4096, args.max_num_seqs))
    print(run(args.prompts, args.repeats, RolloutVLLMConfig(enforce_eager=args.eager, **settings)), flush=True)


if __name__ == "__main__":
    main()
