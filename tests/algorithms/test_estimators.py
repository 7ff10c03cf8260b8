"""Golden tests of every advantage estimator: hand-computed cases, arithmetic in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algorithms.advantages import AdvantageBatch, AdvantageParams, adaptive_lambda, compute_advantages

EPS = 1e-6
F64 = torch.float64


def params(kl_beta=0.0, gamma=1.0, lam=1.0, lambda_critic=None, whiten=False, std_ddof=0):
    """The test's shorthand: the critic's lambda is the policy's unless given."""
    lambda_critic = lam if lambda_critic is None else lambda_critic
    return AdvantageParams(kl_beta=kl_beta, gamma=gamma, lam=lam, lambda_critic=lambda_critic, whiten=whiten,
                           std_ddof=std_ddof, eps=EPS)


def t(rows):
    return torch.tensor(rows, dtype=F64)


MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)  # ragged: T = 3 and 2
KL = t([[0.1, 0.2, 0.3], [0.5, -0.1, 9.0]])  # 9.0 sits on a padded position and must be ignored


def run(name, hp, **batch):
    defaults = dict(response_mask=MASK, group_index=torch.tensor([0, 0]))
    return compute_advantages(name, AdvantageBatch(**{**defaults, **batch}), hp)


def test_reinforce():
    # beta 0.5: row 0: 1 - 0.5 * (0.1 + 0.2 + 0.3) = 0.7; row 1: 0 - 0.5 * (0.5 - 0.1) = -0.2
    out = run("reinforce", params(kl_beta=0.5), rewards=t([1.0, 0.0]), kl=KL).advantages
    assert torch.allclose(out, t([[0.7, 0.7, 0.7], [-0.2, -0.2, 0.0]]))
    # beta 0: the reward on every valid token
    out = run("reinforce", params(), rewards=t([1.0, 0.0]), kl=KL).advantages
    assert torch.allclose(out, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_reinforce_kl_to_go():
    # row 0 KL to go: 0.6, 0.5, 0.3 -> 1 - 0.5 * that = 0.7, 0.75, 0.85
    # row 1 KL to go: 0.4, -0.1 -> -0.2, 0.05
    out = run("reinforce_kl_to_go", params(kl_beta=0.5), rewards=t([1.0, 0.0]), kl=KL).advantages
    assert torch.allclose(out, t([[0.7, 0.75, 0.85], [-0.2, 0.05, 0.0]]))
    # beta 1 with rewards 2, 1: row 0: 2 - (0.6, 0.5, 0.3); row 1: 1 - (0.4, -0.1)
    out = run("reinforce_kl_to_go", params(kl_beta=1.0), rewards=t([2.0, 1.0]), kl=KL).advantages
    assert torch.allclose(out, t([[1.4, 1.5, 1.7], [0.6, 1.1, 0.0]]))


def test_reinforce_pp_whitens_over_all_valid_tokens():
    # KL-to-go values (beta 0.5): 0.7, 0.75, 0.85, -0.2, 0.05; mean = 2.15 / 5 = 0.43
    # deviations 0.27, 0.32, 0.42, -0.63, -0.38; population var = 0.893 / 5 = 0.1786
    std = math.sqrt(0.1786)
    out = run("reinforce_pp", params(kl_beta=0.5), rewards=t([1.0, 0.0]), kl=KL).advantages
    expected = t([[0.27, 0.32, 0.42], [-0.63, -0.38, 0.0]]) / (std + EPS)
    assert torch.allclose(out * MASK, expected)
    # ddof = 1: var = 0.893 / 4
    out = run("reinforce_pp", params(kl_beta=0.5, std_ddof=1), rewards=t([1.0, 0.0]), kl=KL).advantages
    assert torch.allclose(out, t([[0.27, 0.32, 0.42], [-0.63, -0.38, 0.0]]) / (math.sqrt(0.893 / 4) + EPS))


def test_rloo():
    mask = torch.ones((5, 2), dtype=torch.bool)
    mask[1, 1] = False  # ragged
    groups = torch.tensor([0, 0, 0, 1, 1])
    # beta 0, group 0 rewards 1, 0, 1: 1 - (0 + 1)/2 = 0.5; 0 - (1 + 1)/2 = -1; 0.5. Group 1 (1, 1): 0.
    out = compute_advantages("rloo", AdvantageBatch(t([1, 0, 1, 1, 1]), mask, groups), params()).advantages
    assert torch.allclose(out[:, 0], t([0.5, -1.0, 0.5, 0.0, 0.0]))
    assert out[1, 1] == 0
    # beta 0.5, KL sums 0.2, 0.0, 0.4 -> S = 0.9, 0.0, 0.8; A = 0.9 - 0.4, 0 - 0.85, 0.8 - 0.45
    kl = t([[0.1, 0.1], [0.0, 5.0], [0.3, 0.1], [0.0, 0.0], [0.0, 0.0]])
    out = compute_advantages("rloo", AdvantageBatch(t([1, 0, 1, 1, 1]), mask, groups, kl=kl),
                             params(kl_beta=0.5)).advantages
    assert torch.allclose(out[:3, 0], t([0.5, -0.85, 0.35]))


def test_remax():
    # greedy baseline 1 for both prompts: A = r - 1 (beta 0)
    out = run("remax", params(), rewards=t([1.0, 0.0]), baseline_rewards=t([1.0, 1.0]), kl=KL).advantages
    assert torch.allclose(out, t([[0.0, 0.0, 0.0], [-1.0, -1.0, 0.0]]))
    # baseline 0, 1 and beta 0.5 with the KL to go of test_reinforce_kl_to_go: row 0: 1 - 0 - 0.5 * (0.6, 0.5, 0.3)
    # row 1: 0 - 1 - 0.5 * (0.4, -0.1)
    out = run("remax", params(kl_beta=0.5), rewards=t([1.0, 0.0]), baseline_rewards=t([0.0, 1.0]), kl=KL).advantages
    assert torch.allclose(out, t([[0.7, 0.75, 0.85], [-1.2, -0.95, 0.0]]))


VALUES = t([[0.2, 0.5, 0.8], [0.4, 0.6, 7.0]])  # 7.0 is padding


def test_gae_gamma_lambda_zero():
    # gamma = lambda = 0: A_t = delta_t = 1[t = T-1] r - V_t
    # row 0 (r = 1): -0.2, -0.5, 1 - 0.8 = 0.2; row 1 (r = 0): -0.4, -0.6
    out = run("gae", params(gamma=0.0, lam=0.0), rewards=t([1.0, 0.0]), values=VALUES)
    assert torch.allclose(out.advantages, t([[-0.2, -0.5, 0.2], [-0.4, -0.6, 0.0]]))
    assert torch.allclose(out.returns, t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))  # A + V


def test_gae_monte_carlo_and_orz():
    # gamma = lambda = 1, no KL: A_t = r - V_t (ORZ), returns = r on every valid token
    out = run("gae", params(), rewards=t([1.0, 0.0]), values=VALUES)
    assert torch.allclose(out.advantages, t([[0.8, 0.5, 0.2], [-0.4, -0.6, 0.0]]))
    assert torch.allclose(out.returns, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    # with KL in the reward (beta 0.5): A_t = r - V_t - beta * KL to go; row 0: 0.8 - 0.3, 0.5 - 0.25, 0.2 - 0.15
    out = run("gae", params(kl_beta=0.5), rewards=t([1.0, 0.0]), values=VALUES, kl=KL)
    assert torch.allclose(out.advantages[0], t([0.5, 0.25, 0.05]))


def test_gae_per_response_lambda_and_decoupled_critic():
    # row 0: deltas (gamma 1) = 0.5 - 0.2, 0.8 - 0.5, 1 - 0.8 = 0.3, 0.3, 0.2
    #   lambda 0.5: A2 = 0.2, A1 = 0.3 + 0.5 * 0.2 = 0.4, A0 = 0.3 + 0.5 * 0.4 = 0.5
    # row 1: deltas = 0.6 - 0.4, 0 - 0.6 = 0.2, -0.6; lambda 1: A1 = -0.6, A0 = -0.4
    hp = params(lam=t([0.5, 1.0]), lambda_critic=1.0)
    out = run("gae", hp, rewards=t([1.0, 0.0]), values=VALUES)
    assert torch.allclose(out.advantages, t([[0.5, 0.4, 0.2], [-0.4, -0.6, 0.0]]))
    # returns from lambda_critic = 1: A(1) + V = r on every token (row 0: 0.8 + 0.2, 0.5 + 0.5, 0.2 + 0.8)
    assert torch.allclose(out.returns, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    # the same lambda for both: returns = A(0.5) + V = 0.7, 0.9, 1.0
    out = run("gae", params(lam=0.5), rewards=t([1.0, 0.0]), values=VALUES)
    assert torch.allclose(out.returns[0], t([0.7, 0.9, 1.0]))


def test_adaptive_lambda():
    # 1 - 1/(alpha T): alpha 0.05, T = 100 -> 0.8; T = 10 -> 1 - 2 = -1 -> clamped 0; alpha 1, T = 4 -> 0.75
    assert torch.allclose(adaptive_lambda(torch.tensor([100, 10]), 0.05), t([0.8, 0.0]))
    assert torch.allclose(adaptive_lambda(torch.tensor([4, 1]), 1.0), t([0.75, 0.0]))


def test_group_norm():
    mask = torch.ones((7, 2), dtype=torch.bool)
    mask[0, 1] = False
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    rewards = t([1, 0, 0, 1, 1, 1, 1])
    # group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps); group 1 has zero std -> 0; group 2 has one -> 0
    out = compute_advantages("group_norm", AdvantageBatch(rewards, mask, groups), params()).advantages
    a = 0.5 / (0.5 + EPS)
    assert torch.allclose(out[:, 0], t([a, -a, -a, a, 0, 0, 0]))
    assert out[0, 1] == 0
    # ddof 1: std of (1, 0, 0, 1) = sqrt(1/3)
    out = compute_advantages("group_norm", AdvantageBatch(rewards, mask, groups), params(std_ddof=1)).advantages
    b = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert torch.allclose(out[:4, 0], t([b, -b, -b, b]))


def test_group_mean():
    mask = torch.ones((5, 3), dtype=torch.bool)
    mask[2, 2] = False
    groups = torch.tensor([0, 0, 0, 1, 1])
    # group 0: mean 1/3 -> 2/3, -1/3, -1/3; group 1: rewards 0.5, 0.2, mean 0.35 -> 0.15, -0.15
    out = compute_advantages("group_mean", AdvantageBatch(t([1, 0, 0, 0.5, 0.2]), mask, groups), params()).advantages
    assert torch.allclose(out[:, 0], t([2 / 3, -1 / 3, -1 / 3, 0.15, -0.15]))
    assert out[2, 2] == 0
    # all equal (zero std) -> all 0
    out = compute_advantages("group_mean", AdvantageBatch(t([1, 1, 1, 0, 0]), mask, groups), params()).advantages
    assert torch.all(out == 0)


def test_group_process_with_different_step_counts():
    # one group, two responses. Response 0 (T = 4): steps end at 1 and 3 with rewards 1, 0.
    # Response 1 (T = 3): one step ending at 2 with reward 1. Pooled step rewards (1, 0, 1): mean 2/3,
    # population std sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 3) = sqrt(2/9); normalised: 1 -> (1/3)/s, 0 -> (-2/3)/s
    s = math.sqrt(2 / 9) + EPS
    hi, lo = (1 / 3) / s, (-2 / 3) / s
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    batch = AdvantageBatch(rewards=t([0.0, 1.0]), response_mask=mask, group_index=torch.tensor([0, 0]),
                           step_ends=torch.tensor([[1, 3], [2, 0]]), step_rewards=t([[1.0, 0.0], [1.0, 0.0]]),
                           step_mask=torch.tensor([[True, True], [True, False]]))
    out = compute_advantages("group_process", batch, params()).advantages
    # response 0: t = 0, 1 see both steps (hi + lo); t = 2, 3 only the second (lo). Response 1: hi on t = 0..2
    assert torch.allclose(out, t([[hi + lo, hi + lo, lo, lo], [hi, hi, hi, 0.0]]))
    # two groups: the second group's single step of reward 0.5 normalises to 0
    batch = AdvantageBatch(rewards=t([0.0, 1.0, 0.0]), response_mask=torch.cat([mask, mask[:1]]),
                           group_index=torch.tensor([0, 0, 1]),
                           step_ends=torch.tensor([[1, 3], [2, 0], [3, 0]]),
                           step_rewards=t([[1.0, 0.0], [1.0, 0.0], [0.5, 0.0]]),
                           step_mask=torch.tensor([[True, True], [True, False], [True, False]]))
    out = compute_advantages("group_process", batch, params()).advantages
    assert torch.allclose(out[:2], t([[hi + lo, hi + lo, lo, lo], [hi, hi, hi, 0.0]]))
    assert torch.all(out[2] == 0)


def test_whitening_keeps_returns_raw():
    # ppo-style: GAE (lambda 1) A = 0.8, 0.5, 0.2, -0.4, -0.6: mean 0.1, deviations 0.7, 0.4, 0.1, -0.5, -0.7
    # population var = (0.49 + 0.16 + 0.01 + 0.25 + 0.49) / 5 = 0.28
    out = run("gae", params(whiten=True), rewards=t([1.0, 0.0]), values=VALUES)
    assert torch.allclose(out.advantages, t([[0.7, 0.4, 0.1], [-0.5, -0.7, 0.0]]) / (math.sqrt(0.28) + EPS))
    assert torch.allclose(out.returns, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("name", ["remax", "gae", "group_process"])
def test_missing_inputs_fail_clearly(name):
    with pytest.raises(ValueError, match=name):
        run(name, params(), rewards=t([1.0, 0.0]))
