"""The seed's first table: each preset's token coefficient c (by autograd through the update's loss)
equals the docs/algorithms.md expression up to one positive batch-wide constant, on random ragged batches
with nonzero KL. Expected advantages are recomputed here by plain per-row loops, independently, on the
rows that dynamic sampling keeps (dapo, vapo); dropped rows must have c = 0."""

from __future__ import annotations

import math

import pytest
import torch

from rlpipe.algorithms.build import token_coefficient
from rlpipe.config import PRESETS
from rlpipe.config import AlgorithmConfig

from batches import L_MAX, M, N, random_batch

EPS = 1e-6


# --- independent references (plain loops) -----------------------------------------------------------
def group_stats(x, groups, ddof=0):
    mean, std = torch.zeros_like(x), torch.zeros_like(x)
    for g in groups.unique():
        idx = groups == g
        mean[idx] = x[idx].mean()
        std[idx] = x[idx].var(correction=ddof).sqrt()
    return mean, std


def kl1(b):
    return (b["old_logp"] - b["ref_logp"]) * b["response_mask"]


def to_go(x):
    return x.flip(-1).cumsum(-1).flip(-1)


def gae_loop(b, gamma, lam_per_row, beta):
    mask = b["response_mask"]
    out = torch.zeros_like(b["values"])
    for i in range(mask.shape[0]):
        T = int(mask[i].sum())
        running = 0.0
        for step in range(T - 1, -1, -1):
            v_next = b["values"][i, step + 1].item() if step + 1 < T else 0.0
            r = b["rewards"][i].item() if step == T - 1 else 0.0
            delta = r - beta * kl1(b)[i, step].item() + gamma * v_next - b["values"][i, step].item()
            running = delta + gamma * float(lam_per_row[i]) * running
            out[i, step] = running
    return out


def whiten(a, mask):
    v = a[mask]
    return (a - v.mean()) / (v.var(correction=0).sqrt() + EPS) * mask


def lengths(b):
    return b["response_mask"].sum(1, keepdim=True).double()


def kl_loss_term(b, beta):
    return beta * (torch.exp(b["ref_logp"] - b["old_logp"]) - 1) * b["response_mask"]


def expected(preset: str, b) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the seed table's c up to a constant, the NLL part or None)."""
    mask, r, groups = b["response_mask"], b["rewards"], b["group_index"]
    bc = lambda x: x.unsqueeze(1) * mask  # noqa: E731
    mean, std = group_stats(r, groups)
    z = bc((r - mean) / (std + EPS))
    if preset == "reinforce":
        return bc(r - 0.01 * kl1(b).sum(1)), None
    if preset == "reinforce_kl_trick":
        return (r.unsqueeze(1) - 0.01 * to_go(kl1(b))) * mask, None
    if preset == "reinforce_pp":
        return whiten((r.unsqueeze(1) - 0.01 * to_go(kl1(b))) * mask, mask), None
    if preset == "rloo":
        s = r - 0.01 * kl1(b).sum(1)
        loo = torch.stack([s[b2] - s[(groups == groups[b2]) & (torch.arange(len(s)) != b2)].mean()
                           for b2 in range(len(s))])
        return bc(loo), None
    if preset == "remax":
        return ((r - b["baseline_rewards"]).unsqueeze(1) - 0.01 * to_go(kl1(b))) * mask, None
    if preset == "ppo":
        return whiten(gae_loop(b, 1.0, [0.95] * len(r), 0.01), mask), None
    if preset == "orz":
        return (r.unsqueeze(1) - b["values"]) * mask, None
    if preset == "grpo":
        return (z + kl_loss_term(b, 0.04)) / lengths(b), None
    if preset == "grpo_r1":
        return z + kl_loss_term(b, 0.001), None
    if preset == "dapo":
        that = torch.stack([lengths(b)[groups == groups[i]].mean() for i in range(len(r))]).unsqueeze(1)
        return z / that, None
    if preset == "dr_grpo":
        return bc(r - mean), None
    if preset == "vapo":
        lam = [min(max(1 - 1 / (0.05 * float(t_b)), 0.0), 1.0) for t_b in lengths(b).squeeze(1)]
        total_t = float(mask.sum())
        correct_tokens = float(mask[b["correct"]].sum())
        return gae_loop(b, 1.0, lam, 0.0) / total_t, 0.1 * bc(b["correct"].double()) / correct_tokens
    if preset == "reinforce_pp_baseline":
        # whitened group-centred rewards; k2 in the loss: d/dlogp of beta (logp - ref)^2 / 2 at logp = old
        return whiten(bc(r - mean), mask) - 0.001 * (b["old_logp"] - b["ref_logp"]) * mask, None
    if preset == "gspo":
        # at ratio 1 every response's s_i = 1 is inside the clip: d(-s_i A_i)/d logp_t = -A_i / T_i, and the
        # seq-mean-token-mean of a loss constant along the response is its value
        return z / lengths(b), None
    if preset == "cispo":
        return z, None  # weight clip(1) = 1 on every token, token-mean
    if preset == "grpo_process":
        return (process_advantages(b) + kl_loss_term(b, 0.04)) / lengths(b), None
    raise KeyError(preset)


def process_advantages(b):
    out = torch.zeros_like(b["values"])
    sm = b["step_mask"]
    for g in b["group_index"].unique():
        rows = (b["group_index"] == g).nonzero().squeeze(1)
        pooled = torch.cat([b["step_rewards"][i][sm[i]] for i in rows])
        mu, sd = pooled.mean(), pooled.var(correction=0).sqrt()
        for i in rows:
            for k in range(int(sm[i].sum())):
                rho = (b["step_rewards"][i, k] - mu) / (sd + EPS)
                out[i, : int(b["step_ends"][i, k]) + 1] += rho
    return out * b["response_mask"]


def kept_by_dynamic_sampling(preset: str, b) -> torch.Tensor:
    """(B,) bool, by a loop: groups whose `correct` are all equal are dropped when the preset samples
    dynamically (dapo, vapo)."""
    keep = torch.ones(len(b["rewards"]), dtype=torch.bool)
    if PRESETS[preset].get("dynamic_sampling"):
        for g in b["group_index"].unique():
            rows = b["group_index"] == g
            keep[rows] = bool(b["correct"][rows].any() and not b["correct"][rows].all())
    return keep


def expected_on_kept(preset: str, b) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(c, NLL part or None, keep): the seed table evaluated on the kept rows, 0 on dropped rows."""
    keep = kept_by_dynamic_sampling(preset, b)
    policy, nll = expected(preset, {k: v[keep] for k, v in b.items()})
    full_policy = torch.zeros_like(b["old_logp"])
    full_policy[keep] = policy
    if nll is None:
        return full_policy, None, keep
    full_nll = torch.zeros_like(b["old_logp"])
    full_nll[keep] = nll
    return full_policy, full_nll, keep


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("seed", [0, 1])
def test_token_coefficient_matches_the_seed_table(preset, seed):
    b = random_batch(seed)
    spec = AlgorithmConfig(preset=preset).resolve()
    c = token_coefficient(spec, max_new_tokens=L_MAX, **b)
    want_policy, want_nll, keep = expected_on_kept(preset, b)
    mask = b["response_mask"]
    assert torch.all(c.policy[~mask] == 0) and torch.all(c.nll[~mask] == 0)
    assert torch.all(c.total[~keep] == 0)
    significant = want_policy.abs() > 1e-9
    ratio = c.policy[significant] / want_policy[significant]
    constant = ratio.mean()
    assert constant > 0
    assert torch.allclose(ratio, constant.expand_as(ratio), rtol=1e-6, atol=0)
    assert torch.allclose(c.policy[~significant & mask], torch.zeros(1, dtype=torch.float64), atol=1e-9)
    if want_nll is None:
        assert torch.all(c.nll == 0)
    else:
        # the NLL part shares the same batch-wide constant
        assert torch.allclose(c.nll, constant * want_nll, rtol=1e-6, atol=1e-12)
        assert (c.nll > 0).sum() == (b["correct"].unsqueeze(1) & mask & keep.unsqueeze(1)).sum()


def test_dynamic_sampling_drops_rows_that_would_otherwise_count():
    # vapo's GAE advantage r - V is nonzero on the all-correct last group; dynamic sampling zeroes it
    b = random_batch(0)
    on = token_coefficient(AlgorithmConfig(preset="vapo").resolve(), max_new_tokens=L_MAX, **b)
    off = token_coefficient(AlgorithmConfig(preset="vapo", dynamic_sampling=False).resolve(), max_new_tokens=L_MAX, **b)
    last = slice(-M, None)
    assert torch.all(on.total[last] == 0) and off.policy[last].abs().sum() > 0
    # the kept rows' normaliser 1 / sum T shrinks to the kept tokens: c grows by sum T / sum T_kept
    keep = kept_by_dynamic_sampling("vapo", b)
    factor = b["response_mask"].sum() / b["response_mask"][keep].sum()
    rows = keep.unsqueeze(1) & b["response_mask"]
    assert torch.allclose(on.policy[rows], off.policy[rows] * factor, rtol=1e-6)


def test_constants_are_the_aggregation_normalisers():
    b = random_batch(3)
    B = N * M
    kept_groups = int(kept_by_dynamic_sampling("dapo", b).sum()) // M
    assert kept_groups < N  # the all-correct group is dropped
    for preset, constant in [("grpo", 1 / B), ("grpo_r1", 1 / B), ("dr_grpo", 1 / (B * L_MAX)),
                             ("dapo", 1 / (kept_groups * M)), ("orz", 1 / float(b["response_mask"].sum()))]:
        spec = AlgorithmConfig(preset=preset).resolve()
        c = token_coefficient(spec, max_new_tokens=L_MAX, **b).policy
        want, _, _ = expected_on_kept(preset, b)
        sig = want.abs() > 1e-9
        assert torch.allclose(c[sig] / want[sig], torch.tensor(constant, dtype=torch.float64)), preset


def test_filtered_responses_have_zero_coefficient():
    b = random_batch(4)
    truncated = torch.zeros(N * M, dtype=torch.bool)
    truncated[[1, 5]] = True
    spec = AlgorithmConfig(preset="dapo", overlong_filtering=True).resolve()
    c = token_coefficient(spec, max_new_tokens=L_MAX, **{**b, "truncated": truncated})
    assert torch.all(c.total[truncated] == 0)
    assert c.total[~truncated].abs().sum() > 0
    assert math.isfinite(float(c.total.sum()))
    # the kept responses of a filtered group share its remaining tokens: group 0 loses row 1's tokens
    unfiltered = token_coefficient(AlgorithmConfig(preset="dapo").resolve(), max_new_tokens=L_MAX, **b)
    lengths = b["response_mask"].sum(1).double()
    group0 = lengths[:M].sum() / (lengths[:M].sum() - lengths[1])
    assert torch.allclose(c.policy[0], unfiltered.policy[0] * group0, rtol=1e-6)


def test_missing_inputs_fail_clearly():
    b = random_batch(0)
    vapo = AlgorithmConfig(preset="vapo").resolve()
    with pytest.raises(ValueError, match="needs correct"):
        token_coefficient(vapo, max_new_tokens=L_MAX, **{**b, "correct": None})
    with pytest.raises(ValueError, match="needs ref_logp"):
        token_coefficient(AlgorithmConfig(preset="grpo").resolve(), max_new_tokens=L_MAX, **{**b, "ref_logp": None})
    with pytest.raises(ValueError, match="needs ref_logp"):
        token_coefficient(AlgorithmConfig(preset="rloo").resolve(), max_new_tokens=L_MAX, **{**b, "ref_logp": None})
