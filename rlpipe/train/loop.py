"""The one training-loop skeleton: the policy update, the critic update, value pretraining and the SFT
warm start all step through it.

- `make_adamw`: AdamW, its state restored from a file when one is given (the lr is re-applied, so that
  params.yaml may change it between rounds);
- `minibatches`: groups, shuffled per epoch with a seeded stream (the same order on every rank), in
  chunks of whole groups;
- `optimizer_step`: one step over this rank's micro-batches: zero the gradients, backward each
  micro-batch's loss (DDP synchronises on the last only), join with a zero gradient when this rank has
  no share, check the loss and the gradient norm are finite, clip, step; the additive metrics are
  summed over micro-batches and ranks;
- `step_means`: the mean of each per-step metric over a run of steps;
- `WeightAverage`: the uniform running mean of a model's weights over the steps it is given.
"""

from __future__ import annotations

import contextlib
import math
import random
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from rlpipe.config import UpdateConfig
from rlpipe.errors import PipelineError
from rlpipe.train.distributed import World, check_fsdp2_micro_batches, no_sync

MicroBatchLoss = Callable[[Any], tuple[torch.Tensor, dict[str, float]]]
"""Runs one micro-batch's forward: (the loss to backpropagate, its additive metrics)."""


class NonFiniteError(PipelineError):
    """A NaN or Inf loss or gradient; nothing is written."""


class MissingOptimizerError(PipelineError):
    """A checkpoint that has been trained but whose optimizer state is gone (pruned, deleted)."""


def make_adamw(parameters, lr: float, *, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
               state_path: Path | None = None) -> torch.optim.AdamW:
    """AdamW, with its state (and hyperparameters but the lr) restored from `state_path` when given."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, betas=betas, weight_decay=weight_decay)
    if state_path is not None:
        # read onto the CPU (a file written on a GPU loads anywhere); load_state_dict moves the state onto
        # the parameters' device
        optimizer.load_state_dict(torch.load(state_path, map_location="cpu", weights_only=True))
        set_lr(optimizer, lr)
    return optimizer


def set_lr(optimizer, lr: float) -> None:
    """params.yaml may change the lr between rounds; every other hyperparameter stays the saved one."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def saved_optimizer(checkpoint: Path, name: str, trained: bool) -> Path | None:
    """The optimizer state to continue from: None for a checkpoint never trained (a fresh optimizer is
    right), else its file, which must exist: training silently restarting from a fresh optimizer would
    change the run without a word."""
    path = Path(checkpoint) / name
    if path.is_file():
        return path
    if not trained:
        return None
    raise MissingOptimizerError(
        f"{path}: the optimizer state of this trained checkpoint is missing, so the next "
        f"update cannot continue it. Restore it with `dvc checkout {checkpoint}` (or `dvc pull {checkpoint}` "
        f"if it was pruned to a remote: `rlpipe prune` says which), then rerun")


def minibatches(groups: list[int], size: int, epochs: int, shuffle: bool, rng: random.Random) -> Iterator[list[int]]:
    """Per epoch, the groups (shuffled with `rng` when asked, the same order on every rank) in chunks of
    `size`."""
    for _ in range(epochs):
        order = list(groups)
        if shuffle:
            rng.shuffle(order)
        for start in range(0, len(order), size):
            yield order[start : start + size]


def optimizer_step(model, optimizer, micro_batches: Sequence, micro_batch_loss: MicroBatchLoss, *,
                   max_grad_norm: float, label: str, world: World = World(), update: UpdateConfig | None = None,
                   autocast: Callable[[], Any] = contextlib.nullcontext) -> tuple[dict[str, float], float]:
    """One optimizer step over this rank's `micro_batches`; returns (the metrics summed over micro-batches
    and ranks, the gradient norm before clipping). Each loss is scaled by the world size because DDP
    averages gradients over ranks while the losses are already normalised by whole-minibatch counts.
    `update` holds the parallelism settings (None: a single process)."""
    optimizer.zero_grad(set_to_none=True)
    if update is not None:
        check_fsdp2_micro_batches(update, world, len(micro_batches), label)
    if not micro_batches:  # more ranks than groups at the tail of an epoch: join the all-reduce with zeros
        (sum(p.sum() for p in model.parameters()) * 0.0).backward()
    totals: dict[str, float] = {}
    for k, micro_batch in enumerate(micro_batches):
        with no_sync(model, last=k == len(micro_batches) - 1), autocast():
            loss, metrics = micro_batch_loss(micro_batch)
            if not torch.isfinite(loss):
                raise NonFiniteError(f"{label}, rank {world.rank}, micro-batch {k} ({describe(micro_batch)}): "
                                     f"loss is {loss.item()}")
            (loss * world.size).backward()
        for name, value in metrics.items():
            totals[name] = totals.get(name, 0.0) + float(value)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise NonFiniteError(f"{label}: gradient norm is {grad_norm} after {len(micro_batches)} micro-batches "
                             f"(rank {world.rank})")
    optimizer.step()
    return world.sum_metrics(totals), grad_norm


def describe(micro_batch: Any) -> str:
    """How an error names a micro-batch: its rows when it is a slice of the minibatch."""
    if isinstance(micro_batch, slice):
        return f"rows {micro_batch.start}-{micro_batch.stop - 1}"
    return type(micro_batch).__name__


def step_means(steps: list[dict[str, float]], skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """{name_mean: mean over the steps} for every metric of the first step but `skip`."""
    return {f"{name}_mean": sum(s[name] for s in steps) / len(steps) for name in (steps[0] if steps else ())
            if name not in skip}


class WeightAverage:
    """The uniform mean of a model's parameters over the steps `add` is called after (kept in float32,
    whatever the model's dtype), and `apply`, which writes it into the model's parameters.

    Not `torch.optim.swa_utils.AveragedModel`: that keeps a whole second module and averages in the
    model's own dtype, so a bf16 critic would be averaged in bf16."""

    def __init__(self) -> None:
        self.count = 0
        self._mean: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, model: torch.nn.Module) -> None:
        self.count += 1
        for name, param in model.named_parameters():
            if self.count == 1:
                self._mean[name] = param.detach().float().clone()
            else:  # the running mean m_k = m_{k-1} + (x_k - m_{k-1}) / k
                self._mean[name] += (param.detach().float() - self._mean[name]) / self.count

    @torch.no_grad()
    def apply(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            param.copy_(self._mean[name])
