"""Random ragged round batches shared by the algorithm tests (float64, nonzero KL to the reference).

Group 0 always carries signal (correct 1, 0, 1, 0); the last group is all correct, so presets with
dynamic sampling drop it; everything else is drawn from the seed.
"""

from __future__ import annotations

import torch

N, M, T_MAX, L_MAX, S_MAX = 5, 4, 7, 9, 3
ROW_KEYS = ("rewards", "response_mask", "group_index", "old_logp", "ref_logp", "values", "baseline_rewards",
            "step_ends", "step_rewards", "step_mask", "correct", "truncated")


def random_batch(seed: int, groups: int = N, samples: int = M) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = groups * samples
    lengths = torch.randint(1, T_MAX + 1, (B,), generator=g)
    lengths[0] = T_MAX
    mask = torch.arange(T_MAX).unsqueeze(0) < lengths.unsqueeze(1)
    correct = torch.randint(0, 2, (B,), generator=g).bool()
    correct[:samples] = torch.tensor([True, False, True, False])[:samples]
    correct[-samples:] = True
    old = -torch.rand((B, T_MAX), generator=g, dtype=torch.float64) * 2 - 0.05
    ref = old + 0.3 * torch.randn((B, T_MAX), generator=g, dtype=torch.float64)  # nonzero KL
    values = torch.rand((B, T_MAX), generator=g, dtype=torch.float64)
    step_ends, step_mask = random_steps(lengths, g)
    return dict(
        rewards=correct.double(), response_mask=mask, group_index=torch.arange(groups).repeat_interleave(samples),
        old_logp=old * mask, ref_logp=ref * mask, values=values * mask,
        baseline_rewards=torch.randint(0, 2, (groups,), generator=g).double().repeat_interleave(samples),
        step_ends=step_ends, step_rewards=torch.randint(0, 2, (B, S_MAX), generator=g).double() * step_mask,
        step_mask=step_mask, correct=correct, truncated=lengths == T_MAX,
    )


def random_steps(lengths: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """1 to S_MAX steps per response (never more than its tokens), the last ending on its last token."""
    B = len(lengths)
    steps = torch.randint(1, S_MAX + 1, (B,), generator=g)
    step_ends = torch.zeros((B, S_MAX), dtype=torch.long)
    step_mask = torch.zeros((B, S_MAX), dtype=torch.bool)
    for b in range(B):
        k = min(int(steps[b]), int(lengths[b]))
        ends = sorted(torch.randperm(int(lengths[b]), generator=g)[:k].tolist())
        ends[-1] = int(lengths[b]) - 1
        step_ends[b, :k] = torch.tensor(ends)
        step_mask[b, :k] = True
    return step_ends, step_mask


def advantage_inputs(b: dict) -> dict:
    """The keyword arguments of compute_round_advantages."""
    return {k: v for k, v in b.items() if k not in ("correct", "truncated")}
