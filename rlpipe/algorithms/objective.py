"""The policy objective of one micro-batch: clipped surrogate + KL in the loss + entropy bonus + NLL.

loss = sum(w * (l_clip + beta_loss * KL(logp, ref))) - entropy_coef * sum(w * H) + nll_coef * sum(w_nll * -logp)

with w the aggregation weights and w_nll = 1 / (tokens of the minibatch's correct responses) on those
tokens (VAPO's positive-example NLL, a token mean). Every returned metric is additive over the
micro-batches of a minibatch (normalised by whole-minibatch counts), so summing them gives the
minibatch's value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.algorithms.kl import KL_ESTIMATORS, k3
from rlpipe.algorithms.losses import clipped_surrogate


@dataclass(frozen=True)
class PolicyLossCoefs:
    eps_low: float
    eps_high: float
    clip_ratio_c: float  # 0 = no dual clip
    kl_loss_beta: float  # 0 = no KL term in the loss
    kl_loss_estimator: str
    entropy_coef: float
    nll_coef: float


def policy_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                     token_weights: torch.Tensor, coefs: PolicyLossCoefs, ref_logp: torch.Tensor | None = None,
                     entropy: torch.Tensor | None = None, nll_weights: torch.Tensor | None = None):
    """(scalar loss, metrics). All tensors (b, T); `token_weights` = mask / minibatch tokens (metrics)."""
    surrogate, clipped = clipped_surrogate(logp, old_logp, advantages, coefs.eps_low, coefs.eps_high,
                                           coefs.clip_ratio_c)
    pg_loss = (weights * surrogate).sum()
    loss = pg_loss
    with torch.no_grad():
        # approx KL(pi_old || pi) from samples of pi_old: r - 1 - log r, r = pi / pi_old
        log_ratio = logp.detach() - old_logp
        metrics = {
            "pg_loss": pg_loss.detach(),
            "clip_fraction": (token_weights * clipped).sum(),
            "approx_kl": (token_weights * (torch.exp(log_ratio) - 1 - log_ratio)).sum(),
        }
    if ref_logp is not None:
        kl = KL_ESTIMATORS.get(coefs.kl_loss_estimator)(logp, ref_logp)
        if coefs.kl_loss_beta > 0:
            loss = loss + coefs.kl_loss_beta * (weights * kl).sum()
        metrics["kl_ref"] = (token_weights * k3(logp.detach(), ref_logp)).sum()
    if entropy is not None:
        if coefs.entropy_coef > 0:
            loss = loss - coefs.entropy_coef * (weights * entropy).sum()
        metrics["entropy"] = (token_weights * entropy.detach()).sum()
    if nll_weights is not None and coefs.nll_coef > 0:
        nll = (nll_weights * -logp).sum()
        loss = loss + coefs.nll_coef * nll
        metrics["nll"] = nll.detach()
    return loss, metrics
