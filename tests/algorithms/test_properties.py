"""Properties of the math: masked values never matter, permutations commute, micro-batching is exact."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlpipe.algorithms.aggregation import LOSS_AGGREGATIONS
from rlpipe.algorithms.build import compute_round_advantages, minibatch_loss_setup, policy_loss
from rlpipe.algorithms.presets import PRESETS
from rlpipe.config import AlgorithmConfig

from test_token_coefficient import L_MAX, random_batch

TENSOR_KEYS = ("old_logp", "ref_logp", "values")


def advantages(preset, b):
    spec = AlgorithmConfig(preset=preset).resolve()
    inputs = {k: v for k, v in b.items() if k != "correct"}
    return compute_round_advantages(spec, **inputs)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_masked_positions_never_change_a_result(preset):
    b = random_batch(7)
    mask = b["response_mask"]
    noisy = dict(b)
    g = torch.Generator().manual_seed(1)
    for key in TENSOR_KEYS:
        garbage = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 50
        noisy[key] = torch.where(mask, b[key], garbage)
    clean, dirty = advantages(preset, b), advantages(preset, noisy)
    assert torch.allclose(clean.advantages, dirty.advantages, atol=1e-12)
    assert torch.all(dirty.advantages[~mask] == 0)
    if clean.returns is not None:
        assert torch.allclose(clean.returns, dirty.returns, atol=1e-12)


def permute(b, perm):
    out = {}
    for key, value in b.items():
        out[key] = value[perm] if isinstance(value, torch.Tensor) and value.shape[:1] == perm.shape else value
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_permuting_the_batch_permutes_the_outputs(preset):
    b = random_batch(8)
    perm = torch.randperm(len(b["rewards"]), generator=torch.Generator().manual_seed(2))
    base, shuffled = advantages(preset, b), advantages(preset, permute(b, perm))
    assert torch.allclose(base.advantages[perm], shuffled.advantages, atol=1e-10)
    if base.returns is not None:
        assert torch.allclose(base.returns[perm], shuffled.returns, atol=1e-10)


def test_every_estimator_is_exercised_by_some_preset():
    used = {AlgorithmConfig(preset=p).resolve().estimator for p in PRESETS}
    assert used == set(ADVANTAGE_ESTIMATORS.names())


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("preset", ["grpo", "vapo", "dapo"])
def test_micro_batched_gradient_equals_the_full_batch_gradient(mode, preset):
    """A shared parameter drives every token's logp; accumulating micro-batch gradients (weights from
    the whole minibatch) gives the full-batch gradient."""
    b = random_batch(9)
    spec = AlgorithmConfig(preset=preset, loss_agg=mode).resolve()
    mask = b["response_mask"]
    adv = compute_round_advantages(spec, **{k: v for k, v in b.items() if k != "correct"}).advantages
    g = torch.Generator().manual_seed(3)
    features = torch.randn((*mask.shape, 5), generator=g, dtype=torch.float64)
    truncated = torch.zeros(len(mask), dtype=torch.bool)
    truncated[2] = True
    setup = minibatch_loss_setup(spec, response_mask=mask, group_index=b["group_index"], correct=b["correct"],
                                 truncated=truncated, max_new_tokens=L_MAX)

    def grad_of(row_slices):
        theta = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        for rows in row_slices:
            logp = b["old_logp"][rows] + features[rows] @ theta * mask[rows]
            entropy = (features[rows, :, 0] * theta[0]).abs() * mask[rows]
            loss, _ = policy_loss(spec, logp=logp, old_logp=b["old_logp"][rows], advantages=adv[rows],
                                  setup=setup.rows(rows), ref_logp=b["ref_logp"][rows], entropy=entropy)
            loss.backward()
        return theta.grad.clone()

    full = grad_of([slice(0, len(mask))])
    micro = grad_of([slice(0, 3), slice(3, 4), slice(4, 11), slice(11, len(mask))])
    assert full.abs().sum() > 0
    assert torch.allclose(full, micro, atol=1e-6, rtol=0)


def test_micro_batching_is_exact_away_from_ratio_one():
    b = random_batch(10)
    spec = AlgorithmConfig(preset="dapo", clip_ratio_c=3.0, entropy_coef=0.01).resolve()
    mask = b["response_mask"]
    adv = compute_round_advantages(spec, **{k: v for k, v in b.items() if k != "correct"}).advantages
    shift = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.5
    setup = minibatch_loss_setup(spec, response_mask=mask, group_index=b["group_index"], correct=b["correct"],
                                 truncated=torch.zeros(len(mask), dtype=torch.bool), max_new_tokens=L_MAX)

    def loss_and_grad(row_slices):
        scale = torch.ones((), dtype=torch.float64, requires_grad=True)
        total = 0.0
        for rows in row_slices:
            logp = b["old_logp"][rows] + scale * shift[rows] * mask[rows]
            loss, _ = policy_loss(spec, logp=logp, old_logp=b["old_logp"][rows], advantages=adv[rows],
                                  setup=setup.rows(rows), ref_logp=b["ref_logp"][rows])
            loss.backward()
            total += loss.item()
        return total, scale.grad.item()

    full = loss_and_grad([slice(0, len(mask))])
    micro = loss_and_grad([slice(i, i + 3) for i in range(0, len(mask), 3)])
    assert full == pytest.approx(micro, abs=1e-9)
