"""The `hf` rollout backend: transformers `generate` with KV cache, batched, left padding.

Sampling is done by `SeededSampler` (per-prompt seeds, batch-independent); `generate` runs greedily
over its one-hot scores. Behaviour logprobs come from the raw logits the sampler sees at each step
(`SeededSampler.token_logprobs`): the `scores` that generate reports come after the logits processors
and differ.
"""

from __future__ import annotations

import contextlib
import time

import torch

from rlpipe.progress import progress
from rlpipe.rollout.base import GenerationOutput, GenerationRows, SamplingSpec
from rlpipe.rollout.sampling import SeededSampler
from rlpipe.models.sequences import pad_ragged, repeated_prefix_cache


class HFBackend:
    name = "hf"
    startup_seconds = 0.0  # the model is loaded before; no engine to start

    def __init__(self, model, tokenizer, batch_size: int, bf16: bool = False):
        from transformers import GenerationConfig, LogitsProcessorList

        self.model, self.tokenizer, self.batch_size, self.bf16 = model, tokenizer, batch_size, bf16
        self._processors = LogitsProcessorList
        self.generation_config = GenerationConfig(
            do_sample=False,
            num_beams=1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            return_dict_in_generate=True,
        )

    @torch.no_grad()
    def generate(self, rows: GenerationRows, spec: SamplingSpec, desc: str = "generate") -> GenerationOutput:
        # Rows of similar prompt length share a batch (less padding); results return in input order.
        order = sorted(range(len(rows.prompt_ids)), key=lambda i: len(rows.prompt_ids[i]))
        out_by_row: dict[int, tuple[list[int], list[float], str]] = {}
        total = GenerationOutput()
        precision = torch.autocast(self.model.device.type, torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with progress(total=len(order), desc=desc, unit="seq") as bar, precision:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                part = self._generate_chunk(rows, chunk, spec)
                for i, row in enumerate(chunk):
                    out_by_row[row] = (part.response_ids[i], part.logprobs[i], part.finish_reason[i])
                total.generated_tokens += part.generated_tokens
                total.seconds += part.seconds
                bar.update(len(chunk))
        for row in range(len(order)):
            ids, logps, reason = out_by_row[row]
            total.response_ids.append(ids)
            total.logprobs.append(logps)
            total.finish_reason.append(reason)
        return total

    def _generate_chunk(self, rows: GenerationRows, chunk: list[int], spec: SamplingSpec) -> GenerationOutput:
        pad_id, eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompts = [rows.prompt_ids[i] for i in chunk]
        # The M samples of a prompt are consecutive rows: prefill each distinct prompt once and share its
        # KV cache, instead of computing the same prompt M times (prefill dominated the cost).
        starts = [0] + [k for k in range(1, len(prompts)) if prompts[k] != prompts[k - 1]]
        counts = torch.tensor([b - a for a, b in zip(starts, starts[1:] + [len(prompts)])])
        device = self.model.device  # ids, masks and the sampler's uniforms go where the model is
        unique_ids, unique_mask = (t.to(device) for t in pad_ragged([prompts[k] for k in starts], pad_id, torch.long,
                                                                    left=True))
        counts = counts.to(device)
        started = time.perf_counter()
        cache = self._shared_prefix_cache(unique_ids, unique_mask, counts)
        input_ids = unique_ids.repeat_interleave(counts, dim=0)
        sampler = SeededSampler(
            uniforms=rows.uniforms[chunk].to(device), greedy=rows.greedy[chunk].to(device),
            prompt_width=input_ids.shape[1], temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
        )
        self.generation_config.max_new_tokens = spec.max_new_tokens
        result = self.model.generate(
            input_ids=input_ids,
            attention_mask=unique_mask.repeat_interleave(counts, dim=0).long(),
            past_key_values=cache,
            generation_config=self.generation_config,
            logits_processor=self._processors([sampler]),
        )
        seconds = time.perf_counter() - started
        generated = result.sequences[:, input_ids.shape[1] :]
        return _trim(generated.cpu(), sampler.token_logprobs().cpu(), eos_id, pad_id, seconds)

    def _shared_prefix_cache(self, unique_ids: torch.Tensor, unique_mask: torch.Tensor, counts: torch.Tensor):
        """KV cache of all but the last prompt token of each distinct prompt, repeated per sample row
        (generate then runs the last prompt token itself, which yields the first token's logits)."""
        if unique_ids.shape[1] < 2 or int(counts.max()) == 1:
            return None
        positions = (unique_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        return repeated_prefix_cache(self.model, unique_ids[:, :-1], unique_mask[:, :-1].long(), positions[:, :-1],
                                     counts)


def _trim(generated: torch.Tensor, token_logprobs: torch.Tensor, eos_id: int, pad_id: int, seconds: float):
    """Cut each row after its first eos (kept); rows without eos are truncated at max_new_tokens."""
    out = GenerationOutput(seconds=seconds)
    is_eos = generated == eos_id
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), generated.shape[1] - 1)
    lengths = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, generated.shape[1]))
    ids, logps = generated.tolist(), token_logprobs.tolist()
    for i, n in enumerate(lengths.tolist()):
        out.response_ids.append(ids[i][:n])
        out.logprobs.append(logps[i][:n])
        out.finish_reason.append("stop" if has_eos[i] else "length")
    out.generated_tokens = int(lengths.sum())
    return out
