"""The glue between a resolved algorithm spec and the pure math: the functions the stages call.

This is the one module that reads `ResolvedAlgorithm`; it turns it into the plain numbers the math
takes. Nothing here branches on an algorithm's name: estimators, KL estimators and aggregation modes
come from their registries.

- `compute_round_advantages` (advantage stage): in-reward KL, adaptive lambda, estimator, whitening.
- `minibatch_loss_setup` + `policy_loss` (update stage): weights from whole-minibatch counts, then
  the loss of each micro-batch (with the rollout correction's weights when it is on);
  `round_rollout_weights`: their distribution over the round.
- `token_coefficient` (diagnostics, tests): the per-token coefficient of grad log pi, by autograd
  through `policy_loss` itself.
- `zero_variance_groups`, `dynamic_sampling_keep` (dynamic sampling).

Shapes: B responses, T padded response length, S padded step count; (B, T) masks are bool (or 0/1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from rlpipe.algorithms.aggregation import LossCounts, count_minibatch, loss_weights
from rlpipe.algorithms.advantages import (AdvantageBatch, AdvantageParams, AdvantageResult, adaptive_lambda,
                                          compute_advantages, masked)
from rlpipe.algorithms.kl import KL_ESTIMATORS
from rlpipe.algorithms.objective import PolicyLossCoefs, policy_objective
from rlpipe.algorithms.rollout_correction import CorrectionParams, rollout_weights, weight_summary

if TYPE_CHECKING:  # the math reads a resolved algorithm's fields; it imports no config
    from rlpipe.config import ResolvedAlgorithm


def compute_round_advantages(spec: ResolvedAlgorithm, *, rewards, response_mask, group_index, old_logp,
                             ref_logp=None, values=None, baseline_rewards=None, step_ends=None,
                             step_rewards=None, step_mask=None) -> AdvantageResult:
    """Advantages (B, T) (and returns (B, T) for GAE) of the kept rows of a round.

    rewards (B,) shaped rewards; response_mask (B, T); group_index (B,); old_logp / ref_logp / values
    (B, T); baseline_rewards (B,) (remax); step_ends (B, S) long, step_rewards (B, S), step_mask (B, S)
    (group_process). With the KL in the reward, kl_t = KL_estimator(old_t, ref_t) (the rollout policy's
    KL to the reference) enters the estimator times kl_beta."""
    mask = response_mask.bool()
    kl, kl_beta = None, 0.0
    if spec.kl_placement == "reward" and spec.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("the KL in the reward (kl_placement 'reward', kl_beta > 0) needs ref_logp")
        kl, kl_beta = masked(KL_ESTIMATORS.get(spec.kl_estimator)(old_logp, ref_logp), mask), spec.kl_beta
    lam = spec.lam
    if lam == "adaptive":
        lam = adaptive_lambda(mask.sum(dim=1), spec.adaptive_lambda_alpha).to(rewards.dtype)
    hp = AdvantageParams(kl_beta=kl_beta, gamma=spec.gamma, lam=lam, lambda_critic=spec.lambda_critic,
                         whiten=spec.whiten_advantages, std_ddof=spec.std_ddof, eps=spec.std_eps)
    batch = AdvantageBatch(rewards=rewards, response_mask=mask, group_index=group_index, kl=kl, values=values,
                           baseline_rewards=baseline_rewards, step_ends=step_ends, step_rewards=step_rewards,
                           step_mask=step_mask)
    return compute_advantages(spec.estimator, batch, hp)


@dataclass
class LossSetup:
    """Per-token weights of one minibatch, computed once from its whole counts; slice rows per micro-batch."""

    mask: torch.Tensor  # (B, T) float 0/1: the effective loss mask
    weights: torch.Tensor  # (B, T) aggregation weights
    token_weights: torch.Tensor  # (B, T) mask / tokens, for token-mean metrics
    nll_weights: torch.Tensor  # (B, T) 1 / correct_tokens on correct responses' tokens
    counts: LossCounts  # of the whole minibatch (all ranks)

    def rows(self, index) -> "LossSetup":
        """The micro-batch of rows `index` (a slice, index tensor or bool mask); counts stay global."""
        return LossSetup(self.mask[index], self.weights[index], self.token_weights[index],
                         self.nll_weights[index], self.counts)

    def to(self, device) -> "LossSetup":
        return LossSetup(self.mask.to(device), self.weights.to(device), self.token_weights.to(device),
                         self.nll_weights.to(device), self.counts)


def minibatch_loss_setup(spec: ResolvedAlgorithm, *, response_mask, group_index, correct, truncated,
                         max_new_tokens: int, counts: LossCounts | None = None,
                         reduce_counts: Callable[[LossCounts], LossCounts] | None = None,
                         dtype: torch.dtype = torch.float32) -> LossSetup:
    """Effective mask (truncated responses dropped under overlong filtering), counts and weights.

    response_mask (B, T); group_index (B,); correct, truncated (B,) bool (None = all False).
    `counts`: the whole minibatch's counts when this call sees one rank's share; alternatively
    `reduce_counts` all-reduces this rank's counts into the global ones. Either way every rank
    normalises by the whole minibatch."""
    rows = response_mask.shape[0]
    correct = _flags(correct, rows, response_mask.device)
    truncated = _flags(truncated, rows, response_mask.device)
    mask = response_mask.bool()
    if spec.overlong_filtering:
        mask = mask & ~truncated.unsqueeze(1)
    mask = mask.to(dtype)
    if counts is None:
        counts = count_minibatch(mask, group_index, correct)
        counts = reduce_counts(counts) if reduce_counts is not None else counts
    weights = loss_weights(spec.loss_agg, mask, group_index, counts, max_new_tokens)
    nll = mask * correct.unsqueeze(1) / max(counts.correct_tokens, 1.0)
    return LossSetup(mask, weights, mask / max(counts.tokens, 1.0), nll, counts)


def _flags(flags, rows: int, device) -> torch.Tensor:
    return torch.zeros(rows, dtype=torch.bool, device=device) if flags is None else flags.bool()


def loss_coefs(spec: ResolvedAlgorithm) -> PolicyLossCoefs:
    return PolicyLossCoefs(
        policy_loss=spec.policy_loss, eps_low=spec.eps_low, eps_high=spec.eps_high, clip_ratio_c=spec.clip_ratio_c,
        kl_loss_beta=spec.kl_beta if spec.kl_placement == "loss" else 0.0, kl_loss_estimator=spec.kl_estimator,
        entropy_coef=spec.entropy_coef, nll_coef=spec.nll_coef,
    )


def correction_params(spec: ResolvedAlgorithm) -> CorrectionParams:
    return CorrectionParams(mode=spec.rollout_correction, level=spec.rollout_correction_level,
                            sequence_ratio=spec.rollout_correction_sequence_ratio, cap=spec.rollout_correction_cap,
                            lower=spec.rollout_correction_lower, upper=spec.rollout_correction_upper)


def round_rollout_weights(spec: ResolvedAlgorithm, *, old_logp, rollout_logp, response_mask) -> dict[str, float]:
    """The distribution of the rollout correction's weights over a round's kept tokens (empty when it is off)."""
    if spec.rollout_correction == "none":
        return {}
    weights, affected = rollout_weights(old_logp, rollout_logp, response_mask, correction_params(spec))
    return weight_summary(weights, affected, response_mask)


def policy_loss(spec: ResolvedAlgorithm, *, logp, old_logp, advantages, setup: LossSetup, ref_logp=None,
                entropy=None, rollout_logp=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, additive metrics) of one micro-batch; `setup` is that micro-batch's slice.

    logp (b, T) with grad; old_logp, advantages, optional ref_logp (needed when the KL is in the loss;
    otherwise only logged as kl_ref), entropy (b, T) (needed when entropy_coef > 0) and rollout_logp
    (b, T), the rollout engine's logprobs (needed when the rollout correction is on)."""
    if spec.kl_placement == "loss" and spec.kl_beta > 0 and ref_logp is None:
        raise ValueError("the KL in the loss (kl_placement 'loss', kl_beta > 0) needs ref_logp")
    if spec.entropy_coef > 0 and entropy is None:
        raise ValueError("the entropy bonus (entropy_coef > 0) needs the per-token entropy")
    correction = None
    if spec.rollout_correction != "none":
        if rollout_logp is None:
            raise ValueError(f"the rollout correction {spec.rollout_correction!r} needs the rollout engine's logprobs")
        correction = rollout_weights(old_logp, rollout_logp, setup.mask, correction_params(spec))[0]
    return policy_objective(logp, old_logp, advantages, setup.mask.bool(), setup.weights, setup.token_weights,
                            loss_coefs(spec), ref_logp=ref_logp, entropy=entropy, nll_weights=setup.nll_weights,
                            rollout_weights=correction)


# --- dynamic sampling ------------------------------------------------------------------------------
def zero_variance_groups(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """(B,) True for rows of groups whose (B,) values are all equal (no signal; DAPO dynamic sampling)."""
    values = values.to(torch.float64)
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    low = values.new_full((num_groups,), float("inf")).scatter_reduce(0, group_index, values, "amin")
    high = values.new_full((num_groups,), float("-inf")).scatter_reduce(0, group_index, values, "amax")
    return (low == high)[group_index]


def dynamic_sampling_keep(spec: ResolvedAlgorithm, *, rewards, correct, group_index) -> torch.Tensor:
    """(B,) bool: the rows that dynamic sampling keeps (every row when it is off). The signal is
    `correct` (as DAPO and verl) or the shaped `rewards`, per spec.dynamic_sampling_metric."""
    if not spec.dynamic_sampling:
        return torch.ones(group_index.shape[0], dtype=torch.bool, device=group_index.device)
    signal = {"correct": correct, "reward": rewards}[spec.dynamic_sampling_metric]
    if signal is None:
        raise ValueError(f"dynamic sampling on {spec.dynamic_sampling_metric!r} needs it for every row")
    return ~zero_variance_groups(signal, group_index)


# --- token coefficient -----------------------------------------------------------------------------
@dataclass
class TokenCoefficient:
    policy: torch.Tensor  # (B, T): the policy-gradient part of c, KL-in-loss included
    nll: torch.Tensor  # (B, T): the positive-example NLL part (VAPO)

    @property
    def total(self) -> torch.Tensor:
        return self.policy + self.nll


def _coefficient(spec: ResolvedAlgorithm, old_logp: torch.Tensor, **loss_inputs) -> torch.Tensor:
    """-d loss / d logp at logp = old (ratio 1), through `policy_loss` itself."""
    logp = old_logp.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(spec, logp=logp, old_logp=old_logp, **loss_inputs)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return torch.zeros_like(old_logp) if grad is None else -grad


def _kept_coefficient(spec: ResolvedAlgorithm, rows: dict, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy, nll) coefficients of the kept rows, as the advantage and update stages see them."""
    correct, truncated = rows.pop("correct"), rows.pop("truncated")
    result = compute_round_advantages(spec, **rows)
    setup = minibatch_loss_setup(spec, response_mask=rows["response_mask"], group_index=rows["group_index"],
                                 correct=correct, truncated=truncated, max_new_tokens=max_new_tokens,
                                 dtype=rows["old_logp"].dtype)
    no_entropy = spec.model_copy(update={"entropy_coef": 0.0})  # the entropy bonus is not part of c
    inputs = dict(advantages=result.advantages.detach(), setup=setup, ref_logp=rows["ref_logp"])
    policy = _coefficient(no_entropy.model_copy(update={"nll_coef": 0.0}), rows["old_logp"], **inputs)
    total = _coefficient(no_entropy, rows["old_logp"], **inputs)
    return policy, total - policy


def token_coefficient(spec: ResolvedAlgorithm, *, rewards, response_mask, group_index, old_logp, ref_logp=None,
                      values=None, baseline_rewards=None, step_ends=None, step_rewards=None, step_mask=None,
                      correct=None, truncated=None, max_new_tokens: int) -> TokenCoefficient:
    """c (B, T) with policy-loss gradient = -sum c grad logp at the first step of a round (logp = old),
    computed by autograd through the update's own loss (docs/algorithms.md "Token coefficient").

    Takes the whole round (same tensors as `compute_round_advantages`, plus correct / truncated (B,)
    bool) and applies what the pipeline applies: dynamic sampling drops zero-variance groups and
    overlong filtering truncated responses (their c is 0); the rest form one minibatch. The entropy
    bonus is excluded; the NLL term's part is reported separately (`nll`; `total` = policy + nll)."""
    if spec.nll_coef > 0 and correct is None:
        raise ValueError("the positive-example NLL (nll_coef > 0) needs correct")
    keep = dynamic_sampling_keep(spec, rewards=rewards, correct=correct, group_index=group_index)
    every_row = dict(rewards=rewards, response_mask=response_mask, group_index=group_index, old_logp=old_logp,
                     ref_logp=ref_logp, values=values, baseline_rewards=baseline_rewards, step_ends=step_ends,
                     step_rewards=step_rewards, step_mask=step_mask, correct=correct, truncated=truncated)
    kept_rows = {name: None if value is None else value[keep] for name, value in every_row.items()}
    policy, nll = torch.zeros_like(old_logp), torch.zeros_like(old_logp)
    if bool(keep.any()):
        policy[keep], nll[keep] = _kept_coefficient(spec, kept_rows, max_new_tokens)
    return TokenCoefficient(policy=policy, nll=nll)
