"""Per-token policy and critic losses (docs/algorithms.md, "Policy loss"). Shapes (B, T) in and out."""

from __future__ import annotations

import torch


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                      eps_high: float, clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman 2017) with asymmetric clip (DAPO's clip-higher) and dual clip
    (Ye 2020): l = -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A); for A < 0 and
    clip_ratio_c > 0, l = min(l, -clip_ratio_c A). Returns (l, mask of tokens where a clip is active)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if clip_ratio_c > 0:
        dual = -clip_ratio_c * advantages
        use_dual = (advantages < 0) & (dual < loss)
        loss = torch.where(use_dual, dual, loss)
        active = active | use_dual
    return loss, active


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2). Returns (loss, mask where the clipped
    term is the larger)."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq
