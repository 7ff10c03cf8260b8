"""(a) Advantage math, every estimator, B = 16,384 responses x T = 512 tokens.

Against (1) a straightforward per-group (or per-response) Python loop computing the same numbers, and
(2) `torch.clone` of the estimator's inputs, which is memcpy-bound: the floor of any pass over them.
Targets: >= 20x faster than the loop, <= 3x the clone.
"""

from __future__ import annotations

import torch

from benchmarks.common import paired, table
from rlpipe.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageBatch, AdvantageParams, compute_advantages

B, T, M = 16384, 512, 8


def make_batch(seed: int = 0) -> AdvantageBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    steps = 4
    ends = torch.sort(torch.randint(0, T // 4, (B, steps), generator=g), dim=1).values
    return AdvantageBatch(
        rewards=torch.randint(0, 2, (B,), generator=g).float(), response_mask=mask,
        group_index=torch.arange(B // M).repeat_interleave(M), kl=torch.rand((B, T), generator=g) * 0.01,
        values=torch.rand((B, T), generator=g), baseline_rewards=torch.randint(0, 2, (B,), generator=g).float(),
        step_ends=ends, step_rewards=torch.rand((B, steps), generator=g), step_mask=torch.ones((B, steps), dtype=torch.bool),
    )


HP = AdvantageParams(kl_beta=0.01, gamma=1.0, lam=0.95, lambda_critic=1.0, whiten=False, std_ddof=0, eps=1e-6)


def loop_baseline(name: str, batch: AdvantageBatch) -> torch.Tensor:
    """The same estimator written the obvious way: a Python loop over groups (group estimators) or
    over responses (per-response estimators); GAE loops over time within each response."""
    mask = batch.mask
    out = torch.zeros_like(mask)
    kl = batch.kl * mask
    groups = batch.group_index
    n_groups = int(groups.max()) + 1
    if name in ("group_norm", "group_mean", "rloo"):
        for g in range(n_groups):
            rows = (groups == g).nonzero().squeeze(1)
            r = batch.rewards[rows] - (HP.kl_beta * kl[rows].sum(1) if name == "rloo" else 0)
            if name == "group_norm":
                a = (r - r.mean()) / (r.std(correction=0) + HP.eps)
            elif name == "group_mean":
                a = r - r.mean()
            else:
                a = r - (r.sum() - r) / (len(r) - 1)
            out[rows] = a.unsqueeze(1) * mask[rows]
    elif name == "group_process":
        for g in range(n_groups):
            rows = (groups == g).nonzero().squeeze(1)
            rho = batch.step_rewards[rows]
            z = (rho - rho.mean()) / (rho.std(correction=0) + HP.eps)
            for i, row in enumerate(rows.tolist()):
                for k in range(rho.shape[1]):
                    out[row, : int(batch.step_ends[row, k]) + 1] += z[i, k]
            out[rows] *= mask[rows]
    elif name == "gae":
        values = batch.values * mask
        for b in range(B):
            n = int(mask[b].sum())
            running = torch.zeros(())
            for t in range(n - 1, -1, -1):
                nxt = values[b, t + 1] if t + 1 < n else 0.0
                delta = (batch.rewards[b] if t == n - 1 else 0.0) - HP.kl_beta * kl[b, t] + nxt - values[b, t]
                running = delta + HP.gamma * HP.lam * running
                out[b, t] = running
            if b >= 64:  # the full loop takes minutes: time 64 responses and scale
                return out
    else:  # reinforce-family: per response
        for b in range(B):
            to_go = kl[b].flip(0).cumsum(0).flip(0)
            if name == "reinforce":
                out[b] = (batch.rewards[b] - HP.kl_beta * kl[b].sum()) * mask[b]
            elif name == "remax":
                out[b] = (batch.rewards[b] - batch.baseline_rewards[b] - HP.kl_beta * to_go) * mask[b]
            else:
                out[b] = (batch.rewards[b] - HP.kl_beta * to_go) * mask[b]
        if name == "reinforce_pp":
            v = out[batch.response_mask]
            out = (out - v.mean()) / (v.std(correction=0) + HP.eps) * mask
    return out


def clone_inputs(batch: AdvantageBatch) -> None:
    for t in (batch.rewards, batch.response_mask, batch.kl, batch.values):
        t.clone()


def run() -> str:
    torch.set_num_threads(1)
    batch = make_batch()
    rows = []
    for name in ADVANTAGE_ESTIMATORS.names():
        # 9 pairs: a clone of these sizes takes either ~5 ms or ~45 ms, depending on whether the allocator
        # hands back pages already touched, so a few pairs can land all in one mode
        vs_clone = paired(lambda: compute_advantages(name, batch, HP), lambda: clone_inputs(batch), repeats=9)
        scale = B / 65 if name == "gae" else 1.0  # the GAE loop ran 65 of B responses
        vs_loop = paired(lambda: compute_advantages(name, batch, HP), lambda: loop_baseline(name, batch), repeats=1, warmup=0)
        loop_s, ours_s = vs_loop["b_s"] * scale, vs_clone["a_s"]  # ours: the median of its 9 runs
        rows.append([name, ours_s * 1e3, loop_s * 1e3, loop_s / ours_s, vs_clone["ratio"],
                     "yes" if loop_s / ours_s >= 20 and vs_clone["ratio"] <= 3 else "no"])
    return table("(a) advantage math, B = 16,384 x T = 512, 1 thread",
                 ["estimator", "ours ms", "loop ms", "speed-up vs loop (>= 20)", "ours / clone (<= 3)", "targets met"], rows)


if __name__ == "__main__":
    print(run())
