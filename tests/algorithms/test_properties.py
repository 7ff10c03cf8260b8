"""Properties of the math: masked values never matter, permutations commute, micro-batching and
sharding over ranks are exact."""

from __future__ import annotations

import pytest
import torch

from rlpipe.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlpipe.algorithms.aggregation import LOSS_AGGREGATIONS, LossCounts, count_minibatch
from rlpipe.algorithms.build import compute_round_advantages, minibatch_loss_setup, policy_loss, token_coefficient
from rlpipe.config import PRESETS
from rlpipe.config import AlgorithmConfig

from batches import L_MAX, M, advantage_inputs, random_batch

PER_TOKEN_KEYS = ("old_logp", "ref_logp", "values")


def advantages(preset, b):
    return compute_round_advantages(AlgorithmConfig(preset=preset).resolve(), **advantage_inputs(b))


def with_garbage(b: dict, seed: int) -> dict:
    """b with random values, some huge (exp overflows), at every masked token and padded step."""
    g = torch.Generator().manual_seed(seed)
    mask, steps = b["response_mask"], b["step_mask"]
    noisy = dict(b)
    for key in PER_TOKEN_KEYS:
        garbage = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 50
        garbage[:, -1] = 1e3 * (-1) ** torch.arange(len(mask))
        noisy[key] = torch.where(mask, b[key], garbage)
    noisy["step_rewards"] = torch.where(steps, b["step_rewards"], torch.randn(steps.shape, generator=g) * 9)
    noisy["step_ends"] = torch.where(steps, b["step_ends"], torch.randint(0, 40, steps.shape, generator=g))
    return noisy


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_masked_positions_never_change_the_advantages(preset):
    b = random_batch(7)
    mask = b["response_mask"]
    clean, dirty = advantages(preset, b), advantages(preset, with_garbage(b, 1))
    assert torch.equal(clean.advantages, dirty.advantages)
    assert torch.all(dirty.advantages[~mask] == 0)
    if clean.returns is not None:
        assert torch.equal(clean.returns, dirty.returns)
        assert torch.all(dirty.returns[~mask] == 0)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_masked_positions_never_change_the_token_coefficient(preset):
    b = random_batch(8)
    spec = AlgorithmConfig(preset=preset).resolve()
    clean = token_coefficient(spec, max_new_tokens=L_MAX, **b)
    dirty = token_coefficient(spec, max_new_tokens=L_MAX, **with_garbage(b, 2))
    assert torch.equal(clean.policy, dirty.policy) and torch.equal(clean.nll, dirty.nll)


def loss_inputs(b: dict, shift: torch.Tensor, garbage: float | None = None) -> dict:
    """logp away from old (ratios up to ~e^0.5, so clips are active), entropy, the batch's advantages."""
    mask = b["response_mask"]
    logp = (b["old_logp"] + shift).requires_grad_(True)
    entropy = (b["old_logp"].abs() + shift.abs()) * mask
    inputs = dict(logp=logp, old_logp=b["old_logp"], ref_logp=b["ref_logp"], entropy=entropy,
                  advantages=advantages("grpo", b).advantages)
    if garbage is not None:
        padding = torch.full_like(mask, garbage, dtype=torch.float64)
        inputs = {k: torch.where(mask, v, padding) if k != "logp" else v for k, v in inputs.items()}
        inputs["logp"] = torch.where(mask, logp, torch.full_like(padding, -float("inf")))
    return {**inputs, "leaf": logp}


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_masked_positions_never_change_the_loss_metrics_or_gradient(mode):
    b = random_batch(9)
    spec = AlgorithmConfig(preset="vapo", loss_agg=mode, kl_placement="loss", kl_beta=0.05, kl_estimator="k3",
                           entropy_coef=0.01, clip_ratio_c=3.0).resolve()
    setup = minibatch_loss_setup(spec, response_mask=b["response_mask"], group_index=b["group_index"],
                                 correct=b["correct"], truncated=b["truncated"], max_new_tokens=L_MAX)
    shift = 0.5 * torch.randn(b["old_logp"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    results = []
    for garbage in (None, 1e4, -1e4, 0.37):
        inputs = loss_inputs(b, shift, garbage)
        leaf = inputs.pop("leaf")
        loss, metrics = policy_loss(spec, setup=setup, **inputs)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss.detach(), {k: v.item() for k, v in metrics.items()}, grad))
    for loss, metrics, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and metrics == results[0][1]
        assert torch.equal(grad, results[0][2])
    assert torch.isfinite(results[0][2]).all() and torch.all(results[0][2][~b["response_mask"]] == 0)


def permute(b, perm):
    return {k: v[perm] if isinstance(v, torch.Tensor) and v.shape[:1] == perm.shape else v for k, v in b.items()}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_permuting_the_batch_permutes_the_outputs(preset):
    b = random_batch(10)
    perm = torch.randperm(len(b["rewards"]), generator=torch.Generator().manual_seed(2))
    base, shuffled = advantages(preset, b), advantages(preset, permute(b, perm))
    assert torch.allclose(base.advantages[perm], shuffled.advantages, atol=1e-10)
    if base.returns is not None:
        assert torch.allclose(base.returns[perm], shuffled.returns, atol=1e-10)
    spec = AlgorithmConfig(preset=preset).resolve()
    c = token_coefficient(spec, max_new_tokens=L_MAX, **b)
    c_shuffled = token_coefficient(spec, max_new_tokens=L_MAX, **permute(b, perm))
    assert torch.allclose(c.total[perm], c_shuffled.total, atol=1e-12, rtol=1e-10)


def test_every_estimator_is_exercised_by_some_preset():
    used = {AlgorithmConfig(preset=p).resolve().estimator for p in PRESETS}
    assert used == set(ADVANTAGE_ESTIMATORS.names())


# --- micro-batching and sharding ----------------------------------------------------------------
def spec_for(preset, mode):
    """The preset with its loss_agg replaced, and every loss term on: dual clip, entropy, KL in the loss."""
    return AlgorithmConfig(preset=preset, loss_agg=mode, clip_ratio_c=3.0, entropy_coef=0.01, kl_placement="loss",
                           kl_beta=0.02, overlong_filtering=True).resolve()


def accumulate(spec, b, adv, features, parts):
    """Sum of loss, metrics and gradient of a 5-parameter model over `parts`: (rows, setup) pairs, one
    optimizer step's worth of micro-batches (possibly from several ranks). logp depends on theta and is
    away from old (theta != 0), so clipping is active on some tokens."""
    theta = (0.3 * torch.arange(1.0, 6.0, dtype=torch.float64) / 5).requires_grad_(True)
    mask = b["response_mask"]
    total_loss, totals = 0.0, {}
    for rows, setup in parts:
        logp = b["old_logp"][rows] + torch.tanh(features[rows] @ theta) * mask[rows]
        entropy = (features[rows, :, 0] * theta[0]).abs() * mask[rows]
        loss, metrics = policy_loss(spec, logp=logp, old_logp=b["old_logp"][rows], advantages=adv[rows],
                                    setup=setup, ref_logp=b["ref_logp"][rows], entropy=entropy)
        loss.backward()
        total_loss += loss.item()
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + value.item()
    return total_loss, totals, theta.grad.clone()


def assert_same(full, split):
    assert full[0] == pytest.approx(split[0], abs=1e-9)
    assert full[1].keys() == split[1].keys()
    for name in full[1]:
        assert full[1][name] == pytest.approx(split[1][name], abs=1e-9), name
    assert full[2].abs().sum() > 0
    assert torch.allclose(full[2], split[2], atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("preset", ["grpo", "vapo", "dapo", "rloo"])
def test_micro_batched_loss_and_gradient_equal_the_full_batch(mode, preset):
    b = random_batch(11)
    spec = spec_for(preset, mode)
    adv = compute_round_advantages(spec, **advantage_inputs(b)).advantages
    features = torch.randn((*b["response_mask"].shape, 5), generator=torch.Generator().manual_seed(3),
                           dtype=torch.float64)
    setup = minibatch_loss_setup(spec, response_mask=b["response_mask"], group_index=b["group_index"],
                                 correct=b["correct"], truncated=b["truncated"], max_new_tokens=L_MAX)
    B = len(b["rewards"])
    full = accumulate(spec, b, adv, features, [(slice(0, B), setup)])
    # uneven slices that cut groups apart, and a shuffled index split (micro-batches by token budget)
    slices = [slice(0, 3), slice(3, 4), slice(4, 11), slice(11, B)]
    assert_same(full, accumulate(spec, b, adv, features, [(s, setup.rows(s)) for s in slices]))
    order = torch.randperm(B, generator=torch.Generator().manual_seed(5))
    chunks = [order[i : i + 6] for i in range(0, B, 6)]
    assert_same(full, accumulate(spec, b, adv, features, [(c, setup.rows(c)) for c in chunks]))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_ranks_with_all_reduced_counts_equal_one_process(mode):
    """Groups dealt whole to two ranks; each rank counts its share, the counts are summed (what the
    all-reduce of `to_tensor()` does) and each rank builds its weights from the global counts."""
    b = random_batch(12)
    spec = spec_for("dapo", mode)
    adv = compute_round_advantages(spec, **advantage_inputs(b)).advantages
    features = torch.randn((*b["response_mask"].shape, 5), generator=torch.Generator().manual_seed(4),
                           dtype=torch.float64)

    def setup_of(rows, counts=None):
        return minibatch_loss_setup(spec, response_mask=b["response_mask"][rows], group_index=b["group_index"][rows],
                                    correct=b["correct"][rows], truncated=b["truncated"][rows],
                                    max_new_tokens=L_MAX, counts=counts)

    B = len(b["rewards"])
    full = accumulate(spec, b, adv, features, [(slice(0, B), setup_of(slice(0, B)))])
    ranks = [(b["group_index"] % 2) == r for r in (0, 1)]  # groups 0, 2, 4 | 1, 3
    local = [setup_of(rows).counts for rows in ranks]
    global_counts = LossCounts.from_tensor(local[0].to_tensor() + local[1].to_tensor())
    assert global_counts == local[0] + local[1] == setup_of(slice(0, B)).counts
    parts = []
    for rows in ranks:  # each rank also splits its share into two micro-batches
        index = rows.nonzero().squeeze(1)
        shard_setup = setup_of(index, global_counts)
        half = len(index) // 2
        parts += [(index[:half], shard_setup.rows(slice(0, half))), (index[half:], shard_setup.rows(slice(half, None)))]
    assert_same(full, accumulate(spec, b, adv, features, parts))


def test_counts_of_disjoint_groups_add_up():
    b = random_batch(13)
    mask = b["response_mask"].double()
    first, second = slice(0, 2 * M), slice(2 * M, None)
    whole = count_minibatch(mask, b["group_index"], b["correct"])
    parts = count_minibatch(mask[first], b["group_index"][first], b["correct"][first]) + \
        count_minibatch(mask[second], b["group_index"][second], b["correct"][second])
    assert whole == parts
