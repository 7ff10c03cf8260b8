"""Per-prompt seeded sampling that does not depend on how prompts are batched.

Each prompt gets its own generator, seeded from (run seed, stream, prompt id), which draws one uniform
per (sample, step) up front. A token is then drawn by inverse CDF: the first token whose cumulative
probability exceeds the uniform. So a prompt's samples are the same whatever else shares its batch,
whatever the batch order, and across backends that expose the distribution.
"""

from __future__ import annotations

import hashlib

import torch


def prompt_seed(seed: int, stream: str, prompt_id: int) -> int:
    """A 63-bit seed for one prompt of one stream (e.g. "rollout@r2", "eval")."""
    digest = hashlib.sha256(f"{seed}:{stream}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def prompt_uniforms(seed: int, stream: str, prompt_ids: list[int], samples: int, steps: int) -> torch.Tensor:
    """(len(prompt_ids) * samples, steps) uniforms in [0, 1); rows of one prompt are consecutive."""
    out = torch.empty((len(prompt_ids) * samples, steps), dtype=torch.float64)
    generator = torch.Generator()
    for i, pid in enumerate(prompt_ids):
        generator.manual_seed(prompt_seed(seed, stream, pid))
        out[i * samples : (i + 1) * samples] = torch.rand((samples, steps), generator=generator, dtype=torch.float64)
    return out


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits / temperature with everything outside top-k and the top-p nucleus set to -inf. (B, V)."""
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def inverse_cdf_sample(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(B,) token ids drawn from softmax(logits) with the given (B,) uniforms in [0, 1)."""
    probs = torch.softmax(logits.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=logits.shape[-1] - 1)


class SeededSampler:
    """A transformers logits processor that samples each row with its own uniforms.

    It returns scores that are 0 at the chosen token and -inf elsewhere, so `generate` run greedily
    emits exactly that token. Greedy rows (ReMax's baseline, evaluation) take the argmax. It keeps each
    chosen token's log-probability under the raw logits at the sampling temperature (the behaviour
    logprob; `token_logprobs`), so that `generate` need not keep every step's logits: at a real vocabulary
    those are (rows, steps, V) floats, GBs per batch on a GPU.
    """

    def __init__(self, uniforms: torch.Tensor, greedy: torch.Tensor, prompt_width: int,
                 temperature: float, top_k: int, top_p: float):
        self.uniforms, self.greedy, self.prompt_width = uniforms, greedy, prompt_width
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self._logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        logits = filter_logits(scores, self.temperature, self.top_k, self.top_p)
        sampled = inverse_cdf_sample(logits, self.uniforms[:, step])
        tokens = torch.where(self.greedy, scores.argmax(dim=-1), sampled)
        self._logprobs.append(torch.log_softmax(scores.float() / self.temperature, dim=-1)
                              .gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, tokens.unsqueeze(-1), 0.0)
        return out

    def token_logprobs(self) -> torch.Tensor:
        """(rows, steps): each step's chosen token's logprob. A row that has ended still gets a token
        each step (generate then writes padding in its place); those steps are cut with the row."""
        return torch.stack(self._logprobs, dim=1)
