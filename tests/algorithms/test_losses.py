"""Golden tests of the loss aggregation modes, the clipped surrogate and the clipped value loss."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algorithms.aggregation import count_minibatch, loss_weights
from rlpipe.algorithms.losses import clipped_surrogate, value_loss

F64 = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=F64)


def weights(mode, mask, groups, max_new_tokens=4):
    mask = t(mask)
    groups = torch.tensor(groups)
    return loss_weights(mode, mask, groups, count_minibatch(mask, groups), max_new_tokens)


# case A: two responses, T = 3 and 1, one per group
MASK_A, GROUPS_A = [[1, 1, 1], [1, 0, 0]], [0, 1]
# case B: three responses, T = 3, 1, 2; groups (0, 0, 1)
MASK_B, GROUPS_B = [[1, 1, 1], [1, 0, 0], [1, 1, 0]], [0, 0, 1]


@pytest.mark.parametrize(
    "mode, mask, groups, expected",
    [
        # token-mean: 1 / sum T = 1/4; case B: 1/6
        ("token-mean", MASK_A, GROUPS_A, [[1 / 4] * 3, [1 / 4, 0, 0]]),
        ("token-mean", MASK_B, GROUPS_B, [[1 / 6] * 3, [1 / 6, 0, 0], [1 / 6, 1 / 6, 0]]),
        # seq-mean-token-mean: 1 / (B T_b): A: 1/(2*3), 1/(2*1); B: 1/(3*3), 1/(3*1), 1/(3*2)
        ("seq-mean-token-mean", MASK_A, GROUPS_A, [[1 / 6] * 3, [1 / 2, 0, 0]]),
        ("seq-mean-token-mean", MASK_B, GROUPS_B, [[1 / 9] * 3, [1 / 3, 0, 0], [1 / 6, 1 / 6, 0]]),
        # seq-mean-token-sum: 1 / B
        ("seq-mean-token-sum", MASK_A, GROUPS_A, [[1 / 2] * 3, [1 / 2, 0, 0]]),
        ("seq-mean-token-sum", MASK_B, GROUPS_B, [[1 / 3] * 3, [1 / 3, 0, 0], [1 / 3, 1 / 3, 0]]),
        # seq-mean-token-sum-norm: 1 / (B L_max), L_max = 4 (the configured max, not the padded width 3)
        ("seq-mean-token-sum-norm", MASK_A, GROUPS_A, [[1 / 8] * 3, [1 / 8, 0, 0]]),
        ("seq-mean-token-sum-norm", MASK_B, GROUPS_B, [[1 / 12] * 3, [1 / 12, 0, 0], [1 / 12, 1 / 12, 0]]),
        # group-token-mean: 1 / (N sum_{b in group} T_b): A: groups of 3 and 1 tokens, N = 2
        ("group-token-mean", MASK_A, GROUPS_A, [[1 / 6] * 3, [1 / 2, 0, 0]]),
        # B: group 0 holds 3 + 1 = 4 tokens, group 1 holds 2; N = 2 -> 1/8 and 1/4
        ("group-token-mean", MASK_B, GROUPS_B, [[1 / 8] * 3, [1 / 8, 0, 0], [1 / 4, 1 / 4, 0]]),
    ],
)
def test_aggregation_weights(mode, mask, groups, expected):
    assert torch.allclose(weights(mode, mask, groups), t(expected))


def test_aggregated_loss_values():
    # per-token losses of case B; token-mean = (1 + 2 + 3 + 4 + 5 + 6) / 6 = 3.5
    losses = t([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    assert (weights("token-mean", MASK_B, GROUPS_B) * losses).sum().item() == pytest.approx(3.5)
    # seq-mean-token-mean = (2 + 4 + 5.5) / 3; seq-mean-token-sum = (6 + 4 + 11) / 3
    assert (weights("seq-mean-token-mean", MASK_B, GROUPS_B) * losses).sum().item() == pytest.approx(11.5 / 3)
    assert (weights("seq-mean-token-sum", MASK_B, GROUPS_B) * losses).sum().item() == pytest.approx(7.0)
    # group-token-mean = ((6 + 4) / 4 + 11 / 2) / 2 = (2.5 + 5.5) / 2 = 4
    assert (weights("group-token-mean", MASK_B, GROUPS_B) * losses).sum().item() == pytest.approx(4.0)


def test_clipped_surrogate():
    old = torch.zeros(4, dtype=F64)
    # ratios 1.5, 1.5, 0.5, 0.5 with A = +1, -1, +1, -1 and eps_low 0.2, eps_high 0.28:
    #   A = +1, r = 1.5: -min(1.5, 1.28) = -1.28 (clipped)     A = -1, r = 1.5: -min(-1.5, -1.28) = 1.5
    #   A = +1, r = 0.5: -min(0.5, 0.8) = -0.5                 A = -1, r = 0.5: -min(-0.5, -0.8) = 0.8 (clipped)
    logp = torch.log(t([1.5, 1.5, 0.5, 0.5]))
    adv = t([1.0, -1.0, 1.0, -1.0])
    loss, active = clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.28, clip_ratio_c=0.0)
    assert torch.allclose(loss, t([-1.28, 1.5, -0.5, 0.8]))
    assert active.tolist() == [True, False, False, True]
    # dual clip c = 3: A = -1 with ratio 5 -> min(5, 3) = 3; A = +1 unaffected
    logp = torch.log(t([5.0, 5.0]))
    loss, active = clipped_surrogate(logp, old[:2], t([-1.0, 1.0]), 0.2, 0.2, clip_ratio_c=3.0)
    assert torch.allclose(loss, t([3.0, -1.2]))
    assert active.tolist() == [True, True]


def test_value_loss_clipping():
    # c = 0.2. (V, V_old, G):
    #   (1.0, 0.5, 0.0): unclipped 1.0^2, clipped V 0.7 -> 0.49; max 1.0 -> 0.5
    #   (0.6, 0.5, 1.0): inside the range: 0.4^2 / 2 = 0.08
    #   (1.2, 0.5, 1.0): unclipped 0.2^2 = 0.04, clipped V 0.7 -> 0.3^2 = 0.09 (larger) -> 0.045
    values, old, returns = t([1.0, 0.6, 1.2]), t([0.5, 0.5, 0.5]), t([0.0, 1.0, 1.0])
    loss, clipped = value_loss(values, old, returns, clip_range=0.2)
    assert torch.allclose(loss, t([0.5, 0.08, 0.045]))
    assert clipped.tolist() == [False, False, True]
