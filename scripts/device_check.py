"""The prepared GPU check (`scripts/device_check.sh`): one command, one JSON of figures.

On a GPU (a session lent the device machine runs it once, under 10 minutes on one H200):
- model: random-initialised with the shape of Qwen2.5-0.5B, built from a config (no download);
- the update in bf16 (rlpipe's `update.bf16`: fp32 weights and AdamW, bf16 autocast), a few optimizer
  steps through `rlpipe.train.policy.train_step`, once under DDP and once under FSDP2 (`fully_shard`),
  each in a one-process group on the one GPU: seconds per step, tokens/s, peak GPU memory per step;
- logprob agreement between the advantage stage's pass (`batched_response_logprobs`, no grad) and the
  update's (`response_logprobs` on the packed batch), in fp32 and under the update's bf16 autocast;
- the HF rollout backend's tokens/s (`rlpipe.rollout.hf.HFBackend`), with the peak memory;
- the model store's offload while vLLM generates: policy and AdamW state to the CPU and back, bit for
  bit, with the memory freed and the seconds each way (`offload_round_trip`).

Without a GPU it runs the same steps on the CPU with `--shape tiny` in seconds: that is how it is tested
(tests/test_device_check.py). Nothing here is a benchmark with a baseline; the figures are recorded in
BENCHMARKS.md by the session that runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

SHAPES = {
    # Qwen2.5-0.5B's config.json (494M parameters with tied embeddings)
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True),
}
PAD, EOS, BOS = 0, 1, 2


def build_model(shape: str, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    return Qwen2ForCausalLM(config).to(device=device, dtype=torch.float32).eval()


def synthetic_round(prompts: int, samples: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A round's batch columns: random token ids (no EOS inside), group-constant advantages."""
    from rlpipe import artifacts

    rng = random.Random(seed)
    cols = {k: [] for k in ("group", "prompt_ids", "response_ids", "advantages", "correct", "finish_reason")}
    for g in range(prompts):
        prompt = [BOS] + [rng.randrange(3, vocab) for _ in range(prompt_len - 1)]
        for _ in range(samples):
            n = rng.randrange(response_len // 2, response_len + 1)
            cols["group"].append(g)
            cols["prompt_ids"].append(prompt)
            cols["response_ids"].append([rng.randrange(3, vocab) for _ in range(n)])
            advantage = rng.uniform(-1, 1)
            cols["advantages"].append([advantage] * n)
            cols["correct"].append(advantage > 0)
            cols["finish_reason"].append("length")
    return artifacts.Columns(cols)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def logprob_agreement(model, columns, params, device: str) -> dict:
    """Max |advantage-stage logp - update logp| over the batch's tokens, fp32 and under bf16 autocast."""
    from rlpipe.models.sequences import batched_response_logprobs, pack, response_logprobs
    from rlpipe.train.policy import update_autocast

    prompts, responses = columns["prompt_ids"], columns["response_ids"]
    width = max(len(r) for r in responses)
    result = {}
    for name, autocast in (("fp32", contextlib.nullcontext), ("bf16_autocast", lambda: update_autocast(params, device))):
        with torch.no_grad(), autocast():
            stage = batched_response_logprobs(model, prompts, responses, PAD, 1.0, 1 << 15, width).float()
            batch = pack(prompts, responses, PAD, response_width=width).to(device)
            update, _ = response_logprobs(model, batch, 1.0)
        mask = batch.response_mask.to(device).bool()
        result[name] = float((stage.to(device) - update.float())[mask].abs().max())
    return result


def update_steps(model, columns, params, strategy: str, steps: int, device: str) -> dict:
    """`steps` optimizer steps of the update on a copy of the model, wrapped for `strategy` in a one-process
    group: seconds per step (median after the first), tokens/s, peak GPU memory per step, losses."""
    from rlpipe.train.distributed import World
    from rlpipe.train.policy import Minibatch, make_optimizer, train_step

    model = copy.deepcopy(model).train()
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device.startswith("cuda") else None)
    optimizer = make_optimizer(wrapped, params.update)
    rows = list(range(len(columns["group"])))
    minibatch = Minibatch.of(columns, rows)
    seconds, peaks, losses, tokens = [], [], [], 0
    for step in range(steps):
        reset_peak(device)
        synchronize(device)
        began = time.perf_counter()
        metrics = train_step(wrapped, optimizer, minibatch, params, PAD, f"device check {strategy} step {step + 1}",
                             World(device=device))
        synchronize(device)
        seconds.append(time.perf_counter() - began)
        peaks.append(peak_gib(device))
        losses.append(metrics["loss"])
        tokens = metrics["tokens"]
    steady = statistics.median(seconds[1:] or seconds)
    return {"step_seconds": [round(s, 4) for s in seconds], "step_seconds_median": steady,
            "train_tokens_per_s": tokens / steady, "peak_gib_per_step": peaks, "losses": losses}


def offload_round_trip(model, columns, params, device: str) -> dict:
    """What the warm worker's model store does on a GPU that the vLLM engine shares: the policy and its
    AdamW state (after one optimizer step) to the CPU and back (`rlpipe.models.device.move_model`). The
    GPU memory it frees, the seconds each way, whether every parameter and state tensor comes back bit
    for bit, and whether the optimizer still trains the model afterwards (one more step)."""
    from rlpipe.models.device import move_model
    from rlpipe.train.distributed import World
    from rlpipe.train.policy import Minibatch, make_optimizer, train_step

    model = copy.deepcopy(model).train()
    optimizer = make_optimizer(model, params.update)
    minibatch = Minibatch.of(columns, list(range(len(columns["group"]))))
    train_step(model, optimizer, minibatch, params, PAD, "device check offload step 1", World(device=device))
    before = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    states = {name: {k: v.cpu().clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    synchronize(device)
    allocated = torch.cuda.memory_allocated() if device.startswith("cuda") else None
    began = time.perf_counter()
    move_model(model, "cpu", optimizer)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    to_cpu = time.perf_counter() - began
    freed = None if allocated is None else (allocated - torch.cuda.memory_allocated()) / 2**30
    began = time.perf_counter()
    move_model(model, device, optimizer)
    synchronize(device)
    back = time.perf_counter() - began
    exact = all(torch.equal(p.detach().cpu(), before[name]) and
                all(torch.equal(v.cpu(), states[name][k]) for k, v in optimizer.state[p].items())
                for name, p in model.named_parameters())
    metrics = train_step(model, optimizer, minibatch, params, PAD, "device check offload step 2", World(device=device))
    moved = any(not torch.equal(p.detach().cpu(), before[name]) for name, p in model.named_parameters())
    return {"to_cpu_seconds": to_cpu, "back_seconds": back, "gib_freed": freed, "bitwise_equal": exact,
            "trains_after": bool(moved and math.isfinite(metrics["loss"]))}


def rollout_speed(model, prompts: int, samples: int, prompt_len: int, response_len: int, vocab: int, device: str) -> dict:
    from rlpipe.rollout.base import GenerationRows, SamplingSpec
    from rlpipe.rollout.hf import HFBackend

    rng = random.Random(1)
    prompt_ids = [[BOS] + [rng.randrange(3, vocab) for _ in range(prompt_len - 1)] for _ in range(prompts)]
    rows = [p for p in prompt_ids for _ in range(samples)]
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand((len(rows), response_len), generator=generator, dtype=torch.float64)
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    backend = HFBackend(model, tokenizer, batch_size=len(rows))
    reset_peak(device)
    synchronize(device)
    began = time.perf_counter()
    out = backend.generate(GenerationRows(rows, uniforms, torch.zeros(len(rows), dtype=torch.bool)),
                           SamplingSpec(response_len, 1.0, 0, 1.0), desc="device check rollout")
    synchronize(device)
    seconds = time.perf_counter() - began
    return {"responses": len(rows), "generated_tokens": out.generated_tokens, "seconds": seconds,
            "tokens_per_s": out.generated_tokens / seconds, "peak_gib": peak_gib(device)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per strategy (default 4)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("runs/device_check/device_check.json"))
    args = parser.parse_args()

    import transformers

    from rlpipe.config import params_from_dict

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    if not torch.distributed.is_initialized():  # one process, one device: DDP and FSDP2 need a group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    started = time.perf_counter()
    model = build_model(args.shape, device)
    params = params_from_dict({
        "algorithm": {"preset": "grpo"},
        "rollout": {"samples_per_prompt": args.samples, "max_new_tokens": args.response_len},
        # the params describe the update only; the model is the shape's, whose context holds these rows
        "model": {"tiny": {"max_positions": args.prompt_len + args.response_len}},
        "update": {"bf16": True, "minibatch_prompts": args.prompts, "micro_batch_tokens": 1 << 15},
    })
    vocab = SHAPES[args.shape]["vocab_size"]
    columns = synthetic_round(args.prompts, args.samples, args.prompt_len, args.response_len, vocab)
    from rlpipe.models.sequences import batched_response_logprobs

    width = max(len(r) for r in columns["response_ids"])
    with torch.no_grad():  # old and reference logprobs, as the advantage stage writes them
        old = batched_response_logprobs(model, columns["prompt_ids"], columns["response_ids"], PAD, 1.0, 1 << 15, width)
    columns.data["old_logprobs"] = [row[: len(r)] for row, r in zip(old.cpu().tolist(), columns["response_ids"])]
    columns.data["behaviour_logprobs"] = columns.data["old_logprobs"]
    columns.data["ref_logprobs"] = columns.data["old_logprobs"]
    figures = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "shape": args.shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "batch": {"prompts": args.prompts, "samples": args.samples, "prompt_len": args.prompt_len,
                  "response_len_max": args.response_len, "steps": args.steps},
        "logprob_max_abs_diff": logprob_agreement(model, columns, params, device),
        "update": {strategy: update_steps(model, columns, params, strategy, args.steps, device)
                   for strategy in ("ddp", "fsdp2")},
        "rollout_hf": rollout_speed(model, args.prompts, args.samples, args.prompt_len, args.response_len, vocab, device),
        "offload_round_trip": offload_round_trip(model, columns, params, device),
    }
    figures["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
