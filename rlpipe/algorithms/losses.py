"""Per-token policy and critic losses (docs/algorithms.md, "Policy loss"). Shapes (B, T) in and out.

`POLICY_LOSSES` is the registry `algorithm.policy_loss` names. Each takes the log-ratio log(pi / pi_old)
(0 on padding), the advantages, the response mask and the clip settings, and returns (per-token loss,
tokens where a clip is active). Each token's loss is then weighted by the loss aggregation.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlpipe.registry import Registry

PolicyLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


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


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float,
             clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on each token's own ratio (`clipped_surrogate`)."""
    return clipped_surrogate(log_ratio, torch.zeros_like(log_ratio), advantages, eps_low, eps_high, clip_ratio_c)


@POLICY_LOSSES.register("gspo")
def gspo(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float,
         clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng 2025): response i's ratio s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log ratio),
    and l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) on each of its tokens (with a
    seq-mean-token-mean aggregation, the mean over responses of l_i). The advantage is the response's
    (its first token's: outcome advantages are constant along a response)."""
    mask = mask.bool()
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    seq_log_ratio = log_ratio.sum(dim=1, keepdim=True) / lengths
    seq_advantage = advantages[:, :1]
    loss, active = clipped_surrogate(seq_log_ratio, torch.zeros_like(seq_log_ratio), seq_advantage, eps_low,
                                     eps_high, 0.0)
    return loss.expand_as(log_ratio), active.expand_as(log_ratio) & mask


@POLICY_LOSSES.register("cispo")
def cispo(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float,
          clip_ratio_c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t), written
    with log(pi / pi_old) instead of log pi (they differ by a constant, so the gradient is the same and the
    loss is 0 at r = 1): every token keeps a gradient, clipped ones with the clipped weight."""
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -weight * advantages * log_ratio, (ratio < 1 - eps_low) | (ratio > 1 + eps_high)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2). Returns (loss, mask where the clipped
    term is the larger)."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq
