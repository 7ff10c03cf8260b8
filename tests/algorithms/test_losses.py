"""Golden tests of the loss aggregation modes and counts, the clipped surrogate, the clipped value loss
and the policy objective (KL, entropy and NLL terms, metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algorithms.aggregation import LossCounts, count_minibatch, loss_weights
from rlpipe.algorithms.build import minibatch_loss_setup, policy_loss
from rlpipe.algorithms.losses import POLICY_LOSSES, clipped_surrogate, value_loss
from rlpipe.config import AlgorithmConfig

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


def test_gspo_clips_one_length_normalised_ratio_per_response():
    # response 1: 2 tokens, ratios 1.2 and 1.5 -> s = sqrt(1.8) = 1.3416; A = +1, eps 0.2/0.2: clipped at 1.2,
    #   l = -1.2 on both tokens, no gradient. response 2: 1 token (one pad), ratio 0.9 -> s = 0.9, A = -1:
    #   -min(-0.9, -0.9) = 0.9 (inside the band), gradient d l / d logp = s * 1 = 0.9.
    log_ratio = torch.log(t([[1.2, 1.5], [0.9, 1.0]])).requires_grad_()
    mask = torch.tensor([[True, True], [True, False]])
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    loss, active = POLICY_LOSSES.get("gspo")(log_ratio * mask, adv, mask, 0.2, 0.2, 0.0)
    assert torch.allclose(loss[0], t([-1.2, -1.2])) and loss[1, 0].item() == pytest.approx(0.9)
    assert active.tolist() == [[True, True], [False, False]]
    (loss[0, 0] + loss[1, 0]).backward()  # one token each: the per-response losses
    # response 2's s = exp(log r_1 / 1): d s / d log r_1 = s; response 1 clipped: 0
    assert torch.allclose(log_ratio.grad, t([[0.0, 0.0], [0.9, 0.0]]))


def test_gspo_gradient_spreads_the_ratio_over_the_response():
    # unclipped, A = 1, 2 tokens with ratios r1, r2: l = -sqrt(r1 r2); d l / d log r_t = -s / 2 on each token
    log_ratio = torch.log(t([[1.01, 0.99]])).requires_grad_()
    loss, _ = POLICY_LOSSES.get("gspo")(log_ratio, t([[1.0, 1.0]]), torch.tensor([[True, True]]), 0.2, 0.2, 0.0)
    loss[0, 0].backward()
    s = math.sqrt(1.01 * 0.99)
    assert torch.allclose(log_ratio.grad, t([[-s / 2, -s / 2]]))


def test_cispo_keeps_a_stopped_clipped_weight_on_every_token():
    # ratios 1.5 (A = +1, above 1 + 0.28: weight 1.28), 0.5 (A = -1, inside eps_low 0.99: weight 0.5), 1.0
    # (A = +1: weight 1). l = -w A log r; gradient -w A, even where the ratio is clipped (PPO's would be 0).
    log_ratio = torch.log(t([1.5, 0.5, 1.0])).requires_grad_()
    adv = t([1.0, -1.0, 1.0])
    loss, active = POLICY_LOSSES.get("cispo")(log_ratio, adv, torch.ones(3, dtype=torch.bool), 0.99, 0.28, 0.0)
    assert torch.allclose(loss, t([-1.28 * math.log(1.5), 0.5 * math.log(0.5), 0.0]))
    assert active.tolist() == [True, False, False]
    loss.sum().backward()
    assert torch.allclose(log_ratio.grad, t([-1.28, 0.5, -1.0]))


def test_dual_clip_belongs_to_ppo_clip():
    from rlpipe.config import ParamsError, params_from_dict

    with pytest.raises(ParamsError) as err:
        params_from_dict({"algorithm": {"preset": "gspo", "clip_ratio_c": 3.0}})
    assert "algorithm.clip_ratio_c" in str(err.value) or "algorithm.policy_loss" in str(err.value)


def test_value_loss_clipping():
    # c = 0.2. (V, V_old, G):
    #   (1.0, 0.5, 0.0): unclipped 1.0^2, clipped V 0.7 -> 0.49; max 1.0 -> 0.5
    #   (0.6, 0.5, 1.0): inside the range: 0.4^2 / 2 = 0.08
    #   (1.2, 0.5, 1.0): unclipped 0.2^2 = 0.04, clipped V 0.7 -> 0.3^2 = 0.09 (larger) -> 0.045
    values, old, returns = t([1.0, 0.6, 1.2]), t([0.5, 0.5, 0.5]), t([0.0, 1.0, 1.0])
    loss, clipped = value_loss(values, old, returns, clip_range=0.2)
    assert torch.allclose(loss, t([0.5, 0.08, 0.045]))
    assert clipped.tolist() == [False, False, True]


def test_count_minibatch_and_counts_tensor_round_trip():
    # case B with row 1 correct: tokens 3 + 1 + 2 = 6, 3 sequences, 2 groups, correct tokens 1
    mask = t(MASK_B)
    counts = count_minibatch(mask, torch.tensor(GROUPS_B), torch.tensor([False, True, False]))
    assert counts == LossCounts(tokens=6.0, sequences=3.0, groups=2.0, correct_tokens=1.0)
    assert LossCounts.from_tensor(counts.to_tensor()) == counts
    # a response with no valid token (filtered) counts neither as a sequence nor, alone, as a group
    mask[2] = 0
    assert count_minibatch(mask, torch.tensor(GROUPS_B)) == LossCounts(4.0, 2.0, 1.0, 0.0)


def spec(**overrides):
    return AlgorithmConfig(preset="grpo", **overrides).resolve()


def test_loss_setup_filters_truncated_responses_and_weights_the_nll():
    # case B, row 0 truncated, rows 0 and 2 correct. With overlong filtering row 0 leaves the loss:
    # tokens 1 + 2 = 3, sequences 2; seq-mean-token-sum weights 1/2; NLL weights 1/2 on row 2 (2 correct tokens)
    s = spec(loss_agg="seq-mean-token-sum", overlong_filtering=True)
    setup = minibatch_loss_setup(s, response_mask=t(MASK_B).bool(), group_index=torch.tensor(GROUPS_B),
                                 correct=torch.tensor([True, False, True]),
                                 truncated=torch.tensor([True, False, False]), max_new_tokens=4, dtype=F64)
    assert setup.counts == LossCounts(3.0, 2.0, 2.0, 2.0)
    assert torch.equal(setup.weights, t([[0, 0, 0], [0.5, 0, 0], [0.5, 0.5, 0]]))
    assert torch.equal(setup.nll_weights, t([[0, 0, 0], [0, 0, 0], [0.5, 0.5, 0]]))
    assert torch.equal(setup.rows(slice(1, 3)).weights, setup.weights[1:])
    # without filtering: tokens 6, sequences 3, correct tokens 3 + 2 = 5
    setup = minibatch_loss_setup(spec(loss_agg="seq-mean-token-sum"), response_mask=t(MASK_B).bool(),
                                 group_index=torch.tensor(GROUPS_B), correct=torch.tensor([True, False, True]),
                                 truncated=torch.tensor([True, False, False]), max_new_tokens=4, dtype=F64)
    assert setup.counts == LossCounts(6.0, 3.0, 2.0, 5.0)
    assert torch.allclose(setup.nll_weights, t([[0.2] * 3, [0, 0, 0], [0.2, 0.2, 0]]))


def test_objective_terms_and_metrics():
    # two tokens of one response, token-mean (w = 1/2 each), ratio 1 (logp = old), A = (1, -2):
    #   pg_loss = -(1/2)(1) - (1/2)(-2) = 0.5
    #   KL in the loss, k3 with d = logp - ref = (0.5, -0.5), beta 0.1:
    #     k3 = (e^-0.5 - 0.5, e^0.5 - 1.5) = (0.106531, 0.148721); mean 0.127626 -> + 0.0127626
    #   entropy (1.0, 3.0), coef 0.01: - 0.01 * 2.0 = -0.02
    #   NLL (mu 0.5): the response is correct, -logp mean = (1 + 2)/2 = 1.5 -> + 0.75
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = logp.detach().clone()
    ref = t([[-1.5, -1.5]])
    s = spec(loss_agg="token-mean", kl_beta=0.1, entropy_coef=0.01, nll_coef=0.5)
    setup = minibatch_loss_setup(s, response_mask=torch.ones((1, 2), dtype=torch.bool), group_index=torch.tensor([0]),
                                 correct=torch.tensor([True]), truncated=None, max_new_tokens=4, dtype=F64)
    loss, metrics = policy_loss(s, logp=logp, old_logp=old, advantages=t([[1.0, -2.0]]), setup=setup,
                                ref_logp=ref, entropy=t([[1.0, 3.0]]))
    k3 = (math.exp(-0.5) - 0.5 + math.exp(0.5) - 1.5) / 2
    assert loss.item() == pytest.approx(0.5 + 0.1 * k3 - 0.02 + 0.75, abs=1e-12)
    assert metrics["pg_loss"].item() == pytest.approx(0.5)
    assert metrics["kl_loss"].item() == pytest.approx(k3) and metrics["kl_ref"].item() == pytest.approx(k3)
    assert metrics["entropy"].item() == pytest.approx(2.0) and metrics["nll"].item() == pytest.approx(1.5)
    assert metrics["clip_fraction"].item() == 0 and metrics["approx_kl"].item() == 0
    # gradient: -d loss/d logp = w A - beta w (1 - ref/pi) + mu w_nll, w = w_nll = 1/2 (the NLL pushes logp up;
    # entropy is an input here, not a function of logp)
    loss.backward()
    c = -logp.grad
    want = 0.5 * t([1.0, -2.0]) - 0.1 * 0.5 * (1 - torch.exp(ref[0] - old[0])) + 0.5 * 0.5
    assert torch.allclose(c[0], want)


def test_objective_metrics_away_from_ratio_one():
    # ratios (1.5, 0.5) with A = (1, -1), eps 0.2: both tokens clipped (see test_clipped_surrogate) ->
    # clip_fraction 1; approx_kl = mean(r - 1 - ln r) = ((0.5 - ln 1.5) + (-0.5 - ln 0.5)) / 2
    s = spec(loss_agg="token-mean", kl_beta=0.0)
    setup = minibatch_loss_setup(s, response_mask=torch.ones((1, 2), dtype=torch.bool), group_index=torch.tensor([0]),
                                 correct=None, truncated=None, max_new_tokens=4, dtype=F64)
    old = t([[-1.0, -1.0]])
    loss, metrics = policy_loss(s, logp=old + torch.log(t([[1.5, 0.5]])), old_logp=old, advantages=t([[1.0, -1.0]]),
                                setup=setup)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)
    assert metrics["approx_kl"].item() == pytest.approx(((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2)
    assert "kl_ref" not in metrics and "entropy" not in metrics and "nll" not in metrics


def test_policy_loss_refuses_missing_inputs():
    setup = minibatch_loss_setup(spec(), response_mask=torch.ones((1, 2), dtype=torch.bool),
                                 group_index=torch.tensor([0]), correct=None, truncated=None, max_new_tokens=4)
    x = torch.zeros((1, 2))
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(spec(), logp=x, old_logp=x, advantages=x, setup=setup)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss(spec(entropy_coef=0.01), logp=x, old_logp=x, advantages=x, setup=setup, ref_logp=x)
