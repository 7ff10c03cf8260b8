"""The policy objective of one micro-batch: clipped surrogate + KL in the loss + entropy bonus + NLL.

loss = sum(w * (l_clip + beta_loss * KL(logp, ref))) - entropy_coef * sum(w * H) + nll_coef * sum(w_nll * -logp)

with w the aggregation weights (docs/algorithms.md "Policy loss") and w_nll = 1 / (tokens of the
minibatch's correct responses) on those tokens (VAPO's positive-example NLL, Yue 2025, a token mean).
Every returned metric is additive over the micro-batches of a minibatch (normalised by whole-minibatch
counts), so summing them over micro-batches (and ranks) gives the minibatch's value.

Padding never reaches the arithmetic: every per-token input is replaced by a neutral value (log-ratio
0, advantage 0, ...) outside `mask` before any exp, so garbage, -inf or NaN in padded positions changes
neither the loss nor its gradient (a masked product 0 * inf would be NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.algorithms.kl import KL_ESTIMATORS, k3
from rlpipe.algorithms.losses import POLICY_LOSSES


@dataclass(frozen=True)
class PolicyLossCoefs:
    """Plain-number coefficients of the policy objective; every field is required."""

    policy_loss: str  # a POLICY_LOSSES name
    eps_low: float
    eps_high: float
    clip_ratio_c: float  # 0 = no dual clip
    kl_loss_beta: float  # 0 = no KL term in the loss
    kl_loss_estimator: str  # a KL_ESTIMATORS name
    entropy_coef: float  # 0 = no entropy bonus
    nll_coef: float  # 0 = no positive-example NLL


def _valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def policy_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     weights: torch.Tensor, token_weights: torch.Tensor, coefs: PolicyLossCoefs,
                     ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                     nll_weights: torch.Tensor | None = None,
                     rollout_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, metrics) of one micro-batch.

    All tensors (b, T): logp (with grad), old_logp, advantages, mask (bool: tokens in the loss),
    weights (aggregation weights), token_weights (mask / minibatch tokens, for token-mean metrics),
    optional ref_logp, entropy, nll_weights, and rollout_weights (no gradient: the rollout correction's
    per-token weight of the surrogate, `rlpipe.algorithms.rollout_correction`). Metrics (0-dim, detached): pg_loss, clip_fraction,
    approx_kl (k3 of pi_old vs pi_theta: KL(pi_old || pi_theta)), and when given kl_ref (k3 to the
    reference, whatever estimator the loss uses), kl_loss, entropy, nll.
    """
    mask = mask.bool()
    log_ratio = _valid(logp - old_logp, mask)
    advantages = _valid(advantages.to(log_ratio.dtype), mask)
    surrogate, clipped = POLICY_LOSSES.get(coefs.policy_loss)(log_ratio, advantages, mask, coefs.eps_low,
                                                              coefs.eps_high, coefs.clip_ratio_c)
    if rollout_weights is not None:
        surrogate = _valid(rollout_weights.to(surrogate.dtype), mask) * surrogate
    pg_loss = (weights * surrogate).sum()
    loss = pg_loss
    with torch.no_grad():
        # k3 of d = log(pi_old / pi) over samples of pi_old: r - 1 - log r with r = pi / pi_old
        detached = log_ratio.detach()
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clip_fraction": (token_weights * (clipped & mask).to(detached.dtype)).sum(),
            "approx_kl": (token_weights * (torch.exp(detached) - 1 - detached)).sum(),
        }
    if ref_logp is not None:
        ref_log_ratio = _valid(logp - ref_logp, mask)
        zeros = torch.zeros_like(ref_log_ratio)
        if coefs.kl_loss_beta > 0:
            kl_loss = (weights * KL_ESTIMATORS.get(coefs.kl_loss_estimator)(ref_log_ratio, zeros)).sum()
            loss = loss + coefs.kl_loss_beta * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        metrics["kl_ref"] = (token_weights * k3(ref_log_ratio.detach(), zeros)).sum()
    if entropy is not None:
        entropy = _valid(entropy, mask)
        if coefs.entropy_coef > 0:
            loss = loss - coefs.entropy_coef * (weights * entropy).sum()
        metrics["entropy"] = (token_weights * entropy.detach()).sum()
    if nll_weights is not None and coefs.nll_coef > 0:
        nll = (nll_weights * -_valid(logp, mask)).sum()
        loss = loss + coefs.nll_coef * nll
        metrics["nll"] = nll.detach()
    return loss, metrics
