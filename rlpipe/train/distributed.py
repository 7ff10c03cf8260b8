"""Multi-process updates under `torchrun`: gloo on CPU, nccl on GPU; DDP or FSDP2.

A minibatch's groups (or its rows, under `update.minibatch_mix: rows`) are dealt to the ranks whole
(group-token-mean needs each group on one rank, and refuses `rows`), the
loss counts are all-reduced so that every rank weighs its tokens by the GLOBAL token, sequence and
group counts, and each rank's loss is scaled by the world size because DDP averages gradients across
ranks: the summed gradient is then exactly the single-process gradient of the whole minibatch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlpipe.algorithms.aggregation import LossCounts
from rlpipe.config import UpdateConfig
from rlpipe.errors import PipelineError


@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_reduce_counts(self, counts: LossCounts) -> LossCounts:
        if not self.distributed:
            return counts
        tensor = counts.to_tensor().to(self.device)
        torch.distributed.all_reduce(tensor)
        return LossCounts.from_tensor(tensor.cpu())

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum additive metrics over ranks (every rank passes the same keys, or none)."""
        if not self.distributed:
            return metrics
        names = sorted(metrics)
        gathered: list = [None] * self.size
        torch.distributed.all_gather_object(gathered, names)
        names = sorted(set().union(*gathered))
        values = torch.tensor([metrics.get(n, 0.0) for n in names], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(values)
        return dict(zip(names, values.tolist()))

    def spread(self, value: int) -> tuple[int, int]:
        """(min, max) of an integer over the ranks."""
        if not self.distributed:
            return value, value
        both = torch.tensor([-value, value], dtype=torch.long, device=self.device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
        return -int(both[0]), int(both[1])

    def shard(self, items: list) -> list:
        """This rank's share of a step's units, whole groups or rows (round-robin)."""
        return items[self.rank :: self.size]

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()


def init_world() -> World:
    """The world of this process: torchrun's environment when present, else a single process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    rank = int(os.environ["RANK"])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="nccl" if use_cuda else "gloo")
    return World(rank=rank, size=size, device=f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")


def wrap_model(model, strategy: str, world: World):
    """DDP or FSDP2 (`fully_shard`) around the model for a multi-process world; as is otherwise."""
    if not world.distributed:
        return model
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in getattr(getattr(model, "model", model), "layers", []):
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=None if world.device == "cpu" else [torch.cuda.current_device()])


def check_fsdp2_micro_batches(cfg: UpdateConfig, world: World, count: int, step_label: str) -> None:
    """Every FSDP2 forward and backward is a collective, so ranks with unequal micro-batch counts would
    wait on each other forever: stop with the key to change instead."""
    if not world.distributed or cfg.strategy != "fsdp2":  # one process: the strategy does not apply
        return
    fewest, most = world.spread(count)
    if fewest != most:
        raise PipelineError(f"{step_label}: update.micro_batch_tokens = {cfg.micro_batch_tokens} splits the "
                            f"ranks' shares into {fewest} to {most} micro-batches, and FSDP2 needs the same "
                            f"count on every rank: raise update.micro_batch_tokens, or use update.strategy ddp")


def unwrap(model):
    return getattr(model, "module", model)


def no_sync(model, last: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last (gradient accumulation)."""
    import contextlib

    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
