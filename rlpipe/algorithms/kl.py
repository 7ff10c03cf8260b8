"""KL estimators of log(pi_theta / pi_ref) per token, with d = logp - ref_logp (Schulman, "Approximating
KL divergence", 2020; docs/algorithms.md Notation). Shapes: (B, T) in, (B, T) out."""

from __future__ import annotations

import torch

from rlpipe.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """d: unbiased, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """d^2 / 2: biased, low variance."""
    d = logp - ref_logp
    return 0.5 * d * d


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(-d) - 1 + d: unbiased and always >= 0; its gradient is (1 - pi_ref/pi) grad logp."""
    d = logp - ref_logp
    return torch.exp(-d) - 1 + d
