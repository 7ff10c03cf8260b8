"""The glue between a resolved algorithm spec and the pure math: the functions the stages call.

This is the one module that reads `ResolvedAlgorithm`; it turns it into the plain numbers the math
takes. Nothing here branches on an algorithm's name: estimators, KL estimators and aggregation modes
come from their registries.

- `compute_round_advantages` (advantage stage): in-reward KL, adaptive lambda, estimator, whitening.
- `minibatch_loss_setup` + `policy_loss` (update stage): weights from whole-minibatch counts, then
  the loss of each micro-batch.
- `token_coefficient` (diagnostics, tests): the per-token coefficient of grad log pi, by autograd
  through `policy_loss` itself.
- `zero_variance_groups` (dynamic sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.algorithms.aggregation import LossCounts, count_minibatch, loss_weights
from rlpipe.algorithms.advantages import (AdvantageBatch, AdvantageParams, AdvantageResult, adaptive_lambda,
                                          compute_advantages)
from rlpipe.algorithms.kl import KL_ESTIMATORS
from rlpipe.algorithms.objective import PolicyLossCoefs, policy_objective
from rlpipe.config import ResolvedAlgorithm


def compute_round_advantages(spec: ResolvedAlgorithm, *, rewards, response_mask, group_index, old_logp,
                             ref_logp=None, values=None, baseline_rewards=None, step_ends=None,
                             step_rewards=None, step_mask=None) -> AdvantageResult:
    """Advantages (B, T) (and returns for GAE) of the kept rows of a round."""
    mask = response_mask.bool()
    kl, kl_beta = None, 0.0
    if spec.kl_placement == "reward" and spec.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("the KL in the reward needs ref_logp")
        kl, kl_beta = KL_ESTIMATORS.get(spec.kl_estimator)(old_logp, ref_logp) * mask, spec.kl_beta
    lengths = mask.sum(dim=1)
    lam = adaptive_lambda(lengths, spec.adaptive_lambda_alpha).to(rewards.dtype) if spec.lam == "adaptive" else spec.lam
    hp = AdvantageParams(kl_beta=kl_beta, gamma=spec.gamma, lam=lam, lambda_critic=spec.lambda_critic,
                         whiten=spec.whiten_advantages, std_ddof=spec.std_ddof, eps=spec.std_eps)
    batch = AdvantageBatch(rewards=rewards, response_mask=mask, group_index=group_index, kl=kl, values=values,
                           baseline_rewards=baseline_rewards, step_ends=step_ends, step_rewards=step_rewards,
                           step_mask=step_mask)
    return compute_advantages(spec.estimator, batch, hp)


@dataclass
class LossSetup:
    """Per-token weights of one minibatch, computed once from its whole counts; slice rows per micro-batch."""

    mask: torch.Tensor  # (B, T) effective loss mask
    weights: torch.Tensor  # (B, T) aggregation weights
    token_weights: torch.Tensor  # (B, T) mask / tokens, for token-mean metrics
    nll_weights: torch.Tensor  # (B, T) 1 / correct_tokens on correct responses' tokens
    counts: LossCounts

    def rows(self, index) -> "LossSetup":
        return LossSetup(self.mask[index], self.weights[index], self.token_weights[index],
                         self.nll_weights[index], self.counts)


def minibatch_loss_setup(spec: ResolvedAlgorithm, *, response_mask, group_index, correct, truncated,
                         max_new_tokens: int, counts: LossCounts | None = None) -> LossSetup:
    """Effective mask (truncated responses dropped under overlong filtering), counts (pass all-reduced
    counts when the minibatch spans ranks) and weights."""
    mask = response_mask.bool()
    if spec.overlong_filtering:
        mask = mask & ~truncated.bool().unsqueeze(1)
    mask = mask.to(torch.float32)
    counts = count_minibatch(mask, group_index, correct) if counts is None else counts
    weights = loss_weights(spec.loss_agg, mask, group_index, counts, max_new_tokens)
    nll = mask * correct.bool().unsqueeze(1) / max(counts.correct_tokens, 1.0)
    return LossSetup(mask, weights, mask / max(counts.tokens, 1.0), nll, counts)


def loss_coefs(spec: ResolvedAlgorithm) -> PolicyLossCoefs:
    return PolicyLossCoefs(
        eps_low=spec.eps_low, eps_high=spec.eps_high, clip_ratio_c=spec.clip_ratio_c,
        kl_loss_beta=spec.kl_beta if spec.kl_placement == "loss" else 0.0, kl_loss_estimator=spec.kl_estimator,
        entropy_coef=spec.entropy_coef, nll_coef=spec.nll_coef,
    )


def policy_loss(spec: ResolvedAlgorithm, *, logp, old_logp, advantages, setup: LossSetup, ref_logp=None,
                entropy=None):
    """(scalar loss, additive metrics) of one micro-batch; `setup` is that micro-batch's slice."""
    return policy_objective(logp, old_logp, advantages, setup.weights, setup.token_weights, loss_coefs(spec),
                            ref_logp=ref_logp, entropy=entropy, nll_weights=setup.nll_weights)


@dataclass
class TokenCoefficient:
    policy: torch.Tensor  # (B, T): the policy-gradient part of c, KL-in-loss included
    nll: torch.Tensor  # (B, T): the positive-example NLL part (VAPO)

    @property
    def total(self) -> torch.Tensor:
        return self.policy + self.nll


def _coefficient(spec, logp_value, **loss_inputs) -> torch.Tensor:
    logp = logp_value.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(spec, logp=logp, **loss_inputs)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return torch.zeros_like(logp_value) if grad is None else -grad


def token_coefficient(spec: ResolvedAlgorithm, *, rewards, response_mask, group_index, old_logp, ref_logp=None,
                      values=None, baseline_rewards=None, step_ends=None, step_rewards=None, step_mask=None,
                      correct=None, truncated=None, max_new_tokens: int) -> TokenCoefficient:
    """c with loss gradient = -sum c grad logp at logp = old (ratio 1), through the update's own loss."""
    result = compute_round_advantages(spec, rewards=rewards, response_mask=response_mask, group_index=group_index,
                                      old_logp=old_logp, ref_logp=ref_logp, values=values,
                                      baseline_rewards=baseline_rewards, step_ends=step_ends,
                                      step_rewards=step_rewards, step_mask=step_mask)
    correct = torch.zeros_like(rewards, dtype=torch.bool) if correct is None else correct
    truncated = torch.zeros_like(rewards, dtype=torch.bool) if truncated is None else truncated
    setup = minibatch_loss_setup(spec, response_mask=response_mask, group_index=group_index, correct=correct,
                                 truncated=truncated, max_new_tokens=max_new_tokens)
    ref = ref_logp if spec.kl_placement == "loss" else None
    inputs = dict(old_logp=old_logp, advantages=result.advantages.detach(), setup=setup, ref_logp=ref)
    policy = _coefficient(replace_nll(spec, 0.0), old_logp, **inputs)
    total = _coefficient(spec, old_logp, **inputs)
    return TokenCoefficient(policy=policy, nll=total - policy)


def replace_nll(spec: ResolvedAlgorithm, nll_coef: float) -> ResolvedAlgorithm:
    return spec.model_copy(update={"nll_coef": nll_coef})


def zero_variance_groups(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """(B,) True for rows of groups whose values are all equal (no signal; DAPO dynamic sampling)."""
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    low = torch.full((num_groups,), float("inf"), dtype=values.dtype).scatter_reduce(0, group_index, values, "amin")
    high = torch.full((num_groups,), float("-inf"), dtype=values.dtype).scatter_reduce(0, group_index, values, "amax")
    return (low == high)[group_index]
