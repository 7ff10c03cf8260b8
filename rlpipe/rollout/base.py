"""The rollout interface: every backend turns prompt token ids into responses + behaviour logprobs.

A backend receives rows (one per response to generate, the M rows of a prompt consecutive), each
with its per-(row, step) uniforms and a greedy flag, and returns per row: the response token ids
(eos included when emitted, no padding), the behaviour logprob of each token under
softmax(raw logits / temperature), and the finish reason ("stop" at eos, "length" at max_new_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingSpec:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float


@dataclass
class GenerationRows:
    prompt_ids: list[list[int]]
    uniforms: torch.Tensor  # (R, max_new_tokens) float64 in [0, 1)
    greedy: torch.Tensor  # (R,) bool
    prompt_seeds: list[int] | None = None
    """Per row, the seed of its prompt (rows of one prompt share it): for engines with their own
    sampler (vLLM), which seed one request per prompt instead of using `uniforms`."""


@dataclass
class GenerationOutput:
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: list[str] = field(default_factory=list)
    generated_tokens: int = 0
    seconds: float = 0.0

    def extend(self, other: "GenerationOutput") -> None:
        self.response_ids += other.response_ids
        self.logprobs += other.logprobs
        self.finish_reason += other.finish_reason
        self.generated_tokens += other.generated_tokens
        self.seconds += other.seconds
