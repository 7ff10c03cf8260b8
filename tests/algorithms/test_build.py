"""Golden tests of the glue the stages call: in-reward KL, adaptive lambda, whitening, dynamic sampling."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algorithms.build import compute_round_advantages, dynamic_sampling_keep, zero_variance_groups
from rlpipe.config import AlgorithmConfig

F64 = torch.float64
EPS = 1e-6
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)  # T = 4 and 2
GROUPS = torch.tensor([0, 0])


def t(rows):
    return torch.tensor(rows, dtype=F64)


def spec(preset, **overrides):
    return AlgorithmConfig(preset=preset, **overrides).resolve()


# old - ref = d per token; the 5.0 / -7.0 sit on padding and must not count
OLD = t([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, 5.0, -7.0]])
REF = t([[-1.1, -0.8, -1.0, -1.5], [-0.5, -1.0, 0.0, 0.0]])  # d = 0.1, -0.2, 0, 0.5 | -0.5, 0


def test_kl_in_the_reward_uses_the_configured_estimator_on_old_vs_ref():
    # reinforce, k1, beta 0.5: row 0: 1 - 0.5 * (0.1 - 0.2 + 0 + 0.5) = 0.8; row 1: 0 - 0.5 * (-0.5) = 0.25
    out = compute_round_advantages(spec("reinforce", kl_beta=0.5), rewards=t([1.0, 0.0]), response_mask=MASK,
                                   group_index=GROUPS, old_logp=OLD, ref_logp=REF).advantages
    assert torch.allclose(out, t([[0.8] * 4, [0.25, 0.25, 0, 0]]))
    # k2 = d^2/2: row 0 sum = (0.01 + 0.04 + 0 + 0.25)/2 = 0.15 -> 1 - 0.075; row 1: 0.125 -> -0.0625
    out = compute_round_advantages(spec("reinforce", kl_beta=0.5, kl_estimator="k2"), rewards=t([1.0, 0.0]),
                                   response_mask=MASK, group_index=GROUPS, old_logp=OLD, ref_logp=REF).advantages
    assert torch.allclose(out, t([[0.925] * 4, [-0.0625, -0.0625, 0, 0]]))


def test_kl_in_the_loss_or_nowhere_leaves_the_advantages_alone():
    # grpo puts the KL in the loss: the advantages are the group_norm ones, +-0.5/(0.5 + eps)
    a = 0.5 / (0.5 + EPS)
    out = compute_round_advantages(spec("grpo"), rewards=t([1.0, 0.0]), response_mask=MASK, group_index=GROUPS,
                                   old_logp=OLD, ref_logp=REF).advantages
    assert torch.allclose(out, t([[a] * 4, [-a, -a, 0, 0]]))
    with pytest.raises(ValueError, match="needs ref_logp"):
        compute_round_advantages(spec("rloo"), rewards=t([1.0, 0.0]), response_mask=MASK, group_index=GROUPS,
                                 old_logp=OLD)


def test_adaptive_lambda_comes_from_the_response_lengths():
    # vapo with alpha 0.5: lambda = 1 - 1/(0.5 T): T = 4 -> 0.5, T = 2 -> 0. gamma 1, V below, r = (1, 0).
    # row 0 deltas: V1 - V0 = 0.2, V2 - V1 = 0.2, V3 - V2 = 0.2, 1 - V3 = 0.2
    #   A3 = 0.2, A2 = 0.2 + 0.5 * 0.2 = 0.3, A1 = 0.2 + 0.15 = 0.35, A0 = 0.2 + 0.175 = 0.375
    # row 1 (lambda 0): A = deltas = 0.4 - 0.5 = -0.1, 0 - 0.4 = -0.4
    # returns use lambda_critic = 1: G = r on every token
    values = t([[0.2, 0.4, 0.6, 0.8], [0.5, 0.4, 3.0, 3.0]])
    out = compute_round_advantages(spec("vapo", adaptive_lambda_alpha=0.5), rewards=t([1.0, 0.0]),
                                   response_mask=MASK, group_index=GROUPS, old_logp=OLD, values=values)
    assert torch.allclose(out.advantages, t([[0.375, 0.35, 0.3, 0.2], [-0.1, -0.4, 0, 0]]))
    assert torch.allclose(out.returns, t([[1.0] * 4, [0, 0, 0, 0]]))
    # the preset's alpha 0.05 gives lambda 0 below T = 20: A = the one-step deltas
    out = compute_round_advantages(spec("vapo"), rewards=t([1.0, 0.0]), response_mask=MASK, group_index=GROUPS,
                                   old_logp=OLD, values=values)
    assert torch.allclose(out.advantages, t([[0.2] * 4, [-0.1, -0.4, 0, 0]]))


def test_ppo_whitens_the_advantages_but_not_the_returns():
    # ppo without KL (beta 0), lambda 0.95, V = 0: deltas are r on the last token only
    #   row 0: A = 0.95^3, 0.95^2, 0.95, 1; row 1 (r = 0): 0, 0. Returns = A (V = 0), raw.
    raw = t([[0.95**3, 0.95**2, 0.95, 1.0], [0.0, 0.0, 0, 0]])
    valid = raw[MASK]
    mean, std = valid.mean(), valid.var(correction=0).sqrt()  # over the 6 valid tokens, ddof 0
    out = compute_round_advantages(spec("ppo", kl_beta=0.0), rewards=t([1.0, 0.0]), response_mask=MASK,
                                   group_index=GROUPS, old_logp=OLD, values=torch.zeros_like(OLD))
    assert torch.allclose(out.advantages, (raw - mean) / (std + EPS) * MASK)
    assert torch.allclose(out.returns, raw)
    assert torch.allclose(out.advantages[MASK].mean(), torch.zeros((), dtype=F64), atol=1e-12)


def test_zero_variance_groups():
    # groups 0: (1, 1) equal; 1: (0, 1) not; 2: a single row, trivially equal; 3: (0.5, 0.5, 0.5)
    values = t([1, 1, 0, 1, 0.3, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    assert zero_variance_groups(values, groups).tolist() == [True, True, False, False, True, True, True, True]
    # bool outcomes, ids not sorted: group 1 = rows 0, 2 (True, True); group 0 = rows 1, 3 (False, True)
    flags = torch.tensor([True, False, True, True])
    assert zero_variance_groups(flags, torch.tensor([1, 0, 1, 0])).tolist() == [True, False, True, False]


def test_dynamic_sampling_signal_is_correct_or_the_shaped_reward():
    # group 0: all correct but shaped rewards differ (an overlong penalty); group 1: mixed outcomes
    correct = torch.tensor([True, True, False, True])
    rewards = t([1.0, 0.5, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    on_correct = spec("dapo")
    assert dynamic_sampling_keep(on_correct, rewards=rewards, correct=correct, group_index=groups).tolist() == \
        [False, False, True, True]
    on_reward = spec("dapo", dynamic_sampling_metric="reward")
    assert dynamic_sampling_keep(on_reward, rewards=rewards, correct=correct, group_index=groups).all()
    assert dynamic_sampling_keep(spec("grpo"), rewards=rewards, correct=None, group_index=groups).all()
    with pytest.raises(ValueError, match="'correct'"):
        dynamic_sampling_keep(on_correct, rewards=rewards, correct=None, group_index=groups)


def test_float32_inputs_stay_float32():
    # the advantage stage passes float32 tensors; lambda from adaptive_lambda (float64) must not upcast
    out = compute_round_advantages(spec("vapo"), rewards=torch.tensor([1.0, 0.0]), response_mask=MASK,
                                   group_index=GROUPS, old_logp=OLD.float(), values=torch.zeros((2, 4)))
    assert out.advantages.dtype == torch.float32 and out.returns.dtype == torch.float32
    assert math.isclose(out.advantages[0, 3].item(), 1.0)
