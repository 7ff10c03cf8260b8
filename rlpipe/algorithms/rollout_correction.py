"""Correcting the mismatch between the rollout engine and the trainer: truncated and masked importance
sampling of the policy-gradient term.

The engine that sampled a response (vLLM: bf16 kernels, its own attention, on MoE models its own expert
routing) and the trainer that recomputes pi_old give the same tokens slightly different probabilities.
The samples then come from pi_rollout, not pi_old, and the surrogate's expectation is off by

    rho_t = pi_old(y_t) / pi_rollout(y_t)      (token level)
    rho   = prod_t rho_t, or its geometric mean (prod_t rho_t)^(1/|y|)      (sequence level, one per response)

Each token's surrogate term is multiplied by a weight w that carries no gradient:
- `none`: w = 1 (the default: the correction is off);
- `tis`, truncated IS (as in verl's and TRL's vLLM importance-sampling correction): w = min(rho, cap);
- `mis`, masked IS (icepop style): w = rho where lower <= rho <= upper, else 0, so that a token (or, at
  sequence level, a whole response) whose ratio leaves the band leaves the loss.

At zero drift rho = 1, so `tis` (cap >= 1) and `mis` (lower <= 1 <= upper) give w = 1 exactly: the loss is
unchanged. Pure tensor code; `CORRECTIONS` is the registry the config's `algorithm.rollout_correction`
names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlpipe.registry import Registry


@dataclass(frozen=True)
class CorrectionParams:
    mode: str  # a CORRECTIONS name
    level: str  # "token" | "sequence"
    sequence_ratio: str  # "geometric" | "product" (sequence level only)
    cap: float  # tis: the largest weight
    lower: float  # mis: the band [lower, upper] of ratios kept
    upper: float


# (rho (B, T), params) -> (weights (B, T), affected (B, T) bool: truncated or masked)
Correction = Callable[[torch.Tensor, CorrectionParams], tuple[torch.Tensor, torch.Tensor]]
CORRECTIONS: Registry[Correction] = Registry("rollout correction")


@CORRECTIONS.register("none")
def no_correction(rho: torch.Tensor, p: CorrectionParams) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)


@CORRECTIONS.register("tis")
def truncated(rho: torch.Tensor, p: CorrectionParams) -> tuple[torch.Tensor, torch.Tensor]:
    return rho.clamp(max=p.cap), rho > p.cap


@CORRECTIONS.register("mis")
def masked(rho: torch.Tensor, p: CorrectionParams) -> tuple[torch.Tensor, torch.Tensor]:
    outside = (rho < p.lower) | (rho > p.upper)
    return torch.where(outside, torch.zeros_like(rho), rho), outside


def log_ratios(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, p: CorrectionParams) -> torch.Tensor:
    """log rho (B, T): per token, or the response's (summed or token-averaged) log ratio on each of its
    tokens; 0 on padding."""
    mask = mask.bool()
    log_rho = torch.where(mask, old_logp.double() - rollout_logp.double(), torch.zeros((), dtype=torch.float64))
    if p.level == "token":
        return log_rho
    total = log_rho.sum(dim=1, keepdim=True)
    if p.sequence_ratio == "geometric":
        total = total / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(mask, total.expand_as(log_rho), torch.zeros((), dtype=torch.float64))


def rollout_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                    p: CorrectionParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (B, T) in old_logp's dtype, affected (B, T) bool), both 0 / False on padding, no gradient."""
    mask = mask.bool()
    with torch.no_grad():
        rho = torch.exp(log_ratios(old_logp, rollout_logp, mask, p))
        weights, affected = CORRECTIONS.get(p.mode)(rho, p)
        zero = torch.zeros((), dtype=weights.dtype)
        return torch.where(mask, weights, zero).to(old_logp.dtype), affected & mask


def weight_summary(weights: torch.Tensor, affected: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The distribution of a round's weights over its response tokens: the fraction truncated or masked,
    mean, min, max and the 1st, 50th and 99th percentiles."""
    mask = mask.bool()
    valid = weights[mask].double()
    if valid.numel() == 0:
        return {}
    q = torch.quantile(valid, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
    return {"affected_fraction": affected[mask].double().mean().item(), "weight_mean": valid.mean().item(),
            "weight_min": valid.min().item(), "weight_max": valid.max().item(), "weight_p01": q[0].item(),
            "weight_p50": q[1].item(), "weight_p99": q[2].item()}
