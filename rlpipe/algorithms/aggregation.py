"""Loss aggregation (docs/algorithms.md, "Loss aggregation"), exact under micro-batching.

Each mode turns a whole minibatch's mask into per-token weights w (B, T) so that the minibatch loss is
sum(w * l). The normalisers come from `LossCounts` of the WHOLE minibatch (all micro-batches, all
ranks), never from a micro-batch, so that summing sum(w[rows] * l[rows]) over any split of the rows
gives the same loss and gradient as the whole minibatch (verl bug class #5625 / #7321: normalising per
micro-batch weighs a token by the size of the micro-batch it happened to land in).

Shapes: mask (B, T) float (1 = the token counts in the loss), group_index (B,) long in [0, N).
A "sequence" or "group" is counted only if it keeps at least one valid token, so responses removed by
overlong filtering (mask all 0) do not dilute the 1/B of the seq-mean modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.registry import Registry


@dataclass(frozen=True)
class LossCounts:
    """Counts over a whole minibatch (summed over ranks): valid tokens, sequences and groups with at
    least one valid token, and the valid tokens of correct responses (VAPO's NLL normaliser). Every
    field is a sum over rows, so the counts of disjoint shards add up (`+`, or all-reduce `to_tensor()`)."""

    tokens: float
    sequences: float
    groups: float
    correct_tokens: float

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(4,) float64, in field order, for `torch.distributed.all_reduce` (SUM)."""
        values = [self.tokens, self.sequences, self.groups, self.correct_tokens]
        return torch.tensor(values, dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "LossCounts":
        tokens, sequences, groups, correct_tokens = (float(x) for x in t.detach().cpu().tolist())
        return cls(tokens, sequences, groups, correct_tokens)

    def __add__(self, other: "LossCounts") -> "LossCounts":
        return LossCounts.from_tensor(self.to_tensor() + other.to_tensor())


def count_minibatch(mask: torch.Tensor, group_index: torch.Tensor, correct: torch.Tensor | None = None) -> LossCounts:
    """LossCounts of (B, T) `mask` with (B,) group ids and (B,) correct flags (None = none correct).

    Groups are counted by distinct id, so `groups` is right only where a group lies whole in the rows
    given: deal groups to ranks whole and the per-rank counts add up to the minibatch's (`group-token-mean`,
    its one user, is refused with `update.minibatch_mix: rows`)."""
    lengths = mask.sum(dim=1)
    present = lengths > 0
    correct_tokens = float(lengths[correct.bool()].sum()) if correct is not None else 0.0
    return LossCounts(
        tokens=float(lengths.sum()),
        sequences=float(present.sum()),
        groups=float(torch.unique(group_index[present]).numel()),
        correct_tokens=correct_tokens,
    )


LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")


def _per_sequence(mask: torch.Tensor, denominators: torch.Tensor) -> torch.Tensor:
    """mask / denominator row by row; rows with no valid token have a 0 denominator and stay 0."""
    return mask / denominators.clamp(min=1e-30).unsqueeze(1)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(mask, group_index, counts: LossCounts, max_new_tokens: int) -> torch.Tensor:
    """sum_b sum_t l / sum_b T_b."""
    return mask / max(counts.tokens, 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(mask, group_index, counts: LossCounts, max_new_tokens: int) -> torch.Tensor:
    """(1/B) sum_b (1/T_b) sum_t l. T_b is a row's own length, so it needs no global count."""
    return _per_sequence(mask, mask.sum(dim=1) * max(counts.sequences, 1.0))


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(mask, group_index, counts: LossCounts, max_new_tokens: int) -> torch.Tensor:
    """(1/B) sum_b sum_t l."""
    return mask / max(counts.sequences, 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(mask, group_index, counts: LossCounts, max_new_tokens: int) -> torch.Tensor:
    """(1/(B L_max)) sum_b sum_t l: Dr. GRPO's constant normaliser (Liu 2025), L_max = the configured
    max_new_tokens (not the padded width). The 1/B is kept as TRL and oat do (verl omits it): a
    batch-wide constant either way, but with it the loss scale does not grow with the batch."""
    return mask / (max(counts.sequences, 1.0) * max_new_tokens)


@LOSS_AGGREGATIONS.register("group-token-mean")
def group_token_mean(mask, group_index, counts: LossCounts, max_new_tokens: int) -> torch.Tensor:
    """(1/N) sum_i (1 / sum_{b in i} T_b) sum_{b in i} sum_t l (DAPO paper, Yu 2025, eq. 8 read per
    prompt). The group totals come from the rows given, so a group must never be split across ranks
    (micro-batches are fine: weights are computed once per minibatch)."""
    lengths = mask.sum(dim=1)
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    group_tokens = lengths.new_zeros(num_groups).index_add_(0, group_index, lengths)[group_index]
    return _per_sequence(mask, group_tokens * max(counts.groups, 1.0))


def loss_weights(mode: str, mask: torch.Tensor, group_index: torch.Tensor, counts: LossCounts,
                 max_new_tokens: int) -> torch.Tensor:
    """(B, T) per-token weights of the named aggregation mode; 0 at masked positions."""
    return LOSS_AGGREGATIONS.get(mode)(mask, group_index, counts, max_new_tokens)
