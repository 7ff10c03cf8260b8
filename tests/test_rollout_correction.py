"""The rollout correction (truncated / masked importance sampling): hand-computed weights and masks at
token and sequence level, a no-op at zero drift, the loss and gradient it gives, and its config keys."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algorithms.build import LossSetup, correction_params, minibatch_loss_setup, policy_loss
from rlpipe.algorithms.rollout_correction import CorrectionParams, rollout_weights, weight_summary
from rlpipe.config import AlgorithmConfig, ParamsError, params_from_dict

LN = math.log

# two responses: 3 tokens and 2 tokens (one pad); ratios rho = pi_old / pi_rollout chosen per token
RHO = [[1.0, 3.0, 0.25], [1.5, 0.8, 1.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -9.0]], dtype=torch.float64)
OLD = ROLLOUT + torch.tensor([[LN(r) for r in row] for row in RHO], dtype=torch.float64)


def params(mode: str, level: str = "token", sequence_ratio: str = "geometric", cap: float = 2.0, lower: float = 0.5,
           upper: float = 2.0) -> CorrectionParams:
    return CorrectionParams(mode, level, sequence_ratio, cap, lower, upper)


def test_token_tis_truncates_at_the_cap():
    weights, affected = rollout_weights(OLD, ROLLOUT, MASK, params("tis"))
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.25], [1.5, 0.8, 0.0]], dtype=torch.float64))
    assert affected.tolist() == [[False, True, False], [False, False, False]]


def test_token_mis_drops_tokens_outside_the_band():
    weights, affected = rollout_weights(OLD, ROLLOUT, MASK, params("mis", lower=0.5, upper=2.0))
    assert torch.allclose(weights, torch.tensor([[1.0, 0.0, 0.0], [1.5, 0.8, 0.0]], dtype=torch.float64))
    assert affected.tolist() == [[False, True, True], [False, False, False]]


def test_sequence_level_ratios_geometric_and_product():
    # response 1: product 1 * 3 * 0.25 = 0.75, geometric 0.75^(1/3); response 2: 1.5 * 0.8 = 1.2, 1.2^(1/2)
    product, _ = rollout_weights(OLD, ROLLOUT, MASK, params("tis", "sequence", "product", cap=10))
    assert torch.allclose(product, torch.tensor([[0.75] * 3, [1.2, 1.2, 0.0]], dtype=torch.float64))
    geometric, _ = rollout_weights(OLD, ROLLOUT, MASK, params("tis", "sequence", "geometric", cap=10))
    g1, g2 = 0.75 ** (1 / 3), 1.2 ** 0.5
    assert torch.allclose(geometric, torch.tensor([[g1] * 3, [g2, g2, 0.0]], dtype=torch.float64))
    # masked at sequence level: a response whose ratio leaves [0.8, 1.1] leaves the loss whole
    weights, affected = rollout_weights(OLD, ROLLOUT, MASK, params("mis", "sequence", "product", lower=0.8, upper=1.1))
    assert torch.allclose(weights, torch.zeros_like(weights))  # 0.75 < 0.8, 1.2 > 1.1
    assert affected.tolist() == [[True, True, True], [True, True, False]]


def test_weight_summary_counts_only_response_tokens():
    weights, affected = rollout_weights(OLD, ROLLOUT, MASK, params("tis"))
    summary = weight_summary(weights, affected, MASK)
    assert summary["affected_fraction"] == pytest.approx(1 / 5)
    assert summary["weight_max"] == pytest.approx(2.0) and summary["weight_min"] == pytest.approx(0.25)
    assert summary["weight_mean"] == pytest.approx((1 + 2 + 0.25 + 1.5 + 0.8) / 5)


def spec_with(**overrides):
    return AlgorithmConfig(preset="grpo", **overrides).resolve()


def setup_for(spec, mask: torch.Tensor) -> LossSetup:
    return minibatch_loss_setup(spec, response_mask=mask, group_index=torch.tensor([0, 0]),
                                correct=torch.tensor([True, False]), truncated=torch.tensor([False, False]),
                                max_new_tokens=3)


def loss_and_grad(spec, old: torch.Tensor, rollout: torch.Tensor) -> tuple[float, torch.Tensor]:
    logp = (old + 0.1 * torch.tensor([[1.0, -1.0, 0.5], [0.3, -0.2, 0.0]], dtype=torch.float64)).requires_grad_()
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    ref = old - 0.05
    loss, _ = policy_loss(spec, logp=logp, old_logp=old, advantages=advantages, setup=setup_for(spec, MASK),
                          ref_logp=ref, rollout_logp=rollout)
    loss.backward()
    return loss.item(), logp.grad


@pytest.mark.parametrize("overrides", [
    {"rollout_correction": "tis"},
    {"rollout_correction": "mis"},
    {"rollout_correction": "tis", "rollout_correction_level": "sequence", "rollout_correction_sequence_ratio": "product"},
    {"rollout_correction": "mis", "rollout_correction_level": "sequence"},
])
def test_zero_drift_leaves_loss_and_gradient_unchanged(overrides):
    off = loss_and_grad(spec_with(), OLD, OLD)
    on = loss_and_grad(spec_with(**overrides), OLD, OLD)
    assert on[0] == off[0]
    assert torch.equal(on[1], off[1])


def test_the_correction_weights_each_tokens_policy_gradient():
    """With drift, the surrogate's gradient on each token is scaled by its weight (no gradient through the
    weight itself): a masked token's policy-gradient part vanishes. The KL-in-loss part is not weighted."""
    spec_off, spec_mis = spec_with(kl_beta=0.0), spec_with(kl_beta=0.0, rollout_correction="mis")
    _, grad_off = loss_and_grad(spec_off, OLD, ROLLOUT)
    _, grad_mis = loss_and_grad(spec_mis, OLD, ROLLOUT)
    weights, _ = rollout_weights(OLD, ROLLOUT, MASK, correction_params(spec_mis))
    assert torch.allclose(grad_mis, weights * grad_off)
    assert grad_mis[0, 1] == 0 and grad_mis[0, 2] == 0 and grad_off[0, 1] != 0


def test_the_correction_needs_the_rollout_logprobs():
    spec = spec_with(rollout_correction="tis")
    with pytest.raises(ValueError, match="rollout engine's logprobs"):
        policy_loss(spec, logp=OLD.clone().requires_grad_(), old_logp=OLD, advantages=torch.zeros_like(OLD),
                    setup=setup_for(spec, MASK), ref_logp=OLD)


@pytest.mark.parametrize("key, value", [
    ("rollout_correction", "clip"),
    ("rollout_correction_cap", 0.5),
    ("rollout_correction_lower", 1.5),
    ("rollout_correction_level", "batch"),
])
def test_bad_correction_settings_name_their_key(key, value):
    with pytest.raises(ParamsError) as err:
        params_from_dict({"algorithm": {key: value}})
    assert f"  algorithm.{key}: " in str(err.value)
