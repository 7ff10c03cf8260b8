"""prepare: the train/test prompt splits, from the synthetic generator, local files or a hub dataset."""

from __future__ import annotations

from rlpipe.data.splits import write_splits


def prepare(ctx) -> dict:
    return write_splits(ctx.params.data, ctx.params.seed)
