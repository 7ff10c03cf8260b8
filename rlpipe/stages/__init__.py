"""Each DVC stage's work, one module per stage, its function named after the stage.

`stages/<name>.py` (the entry point DVC runs) calls `rlpipe.runner.run_stage("<name>")`, which validates
the params and then runs `rlpipe.stages.<name>.<name>(ctx)` (`rlpipe.runner.execute`) in this process, or
in the resident warm worker. A stage function takes a `rlpipe.runner.StageContext` (params, round, tracker) and returns its
metrics; it reads and writes only what `dvc.yaml` declares for it. A stage that uses torch calls
`ctx.init_torch()` first (threads, seed and deterministic kernels), and imports torch-heavy modules only
after deciding it needs them (value_pretrain of a critic-free preset writes a marker without torch).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rlpipe.config import Params
    from rlpipe.models.store import ModelStore
    from rlpipe.tracking.client import StageTracker


@dataclass(frozen=True)
class StageSpec:
    name: str
    per_round: bool
    """One instance per round (rollout@rK ...), run with the round's name as argument."""
    uses_models: bool
    """Gets its models through `ctx.models` (`rlpipe.models.store`), which is then one of its code deps."""
    skips_worker: Callable[["Params"], bool] | None = None
    """True for a configuration in which the stage loads no model and does next to nothing (value_pretrain
    of a critic-free preset writes a marker): it then runs at once in its own process, which imports no
    torch, instead of queueing behind the warm worker's imports on the way to round 1."""

    def loads_models(self, params: "Params") -> bool:
        return self.uses_models and not (self.skips_worker is not None and self.skips_worker(params))

    @property
    def function(self) -> Callable:
        return getattr(importlib.import_module(f"rlpipe.stages.{self.name}"), self.name)


STAGES: dict[str, StageSpec] = {spec.name: spec for spec in (
    StageSpec("prepare", per_round=False, uses_models=False),
    StageSpec("init", per_round=False, uses_models=True),
    StageSpec("value_pretrain", per_round=False, uses_models=True,
              skips_worker=lambda params: not params.algorithm.resolve().needs_critic),
    StageSpec("rollout", per_round=True, uses_models=True),
    StageSpec("reward", per_round=True, uses_models=False),
    StageSpec("advantage", per_round=True, uses_models=True),
    StageSpec("update", per_round=True, uses_models=True),
    StageSpec("evaluate", per_round=False, uses_models=True),
)}


@dataclass
class StageContext:
    name: str
    params: "Params"
    round_name: str | None
    tracker: "StageTracker"
    models: "ModelStore | None"
    """Where the stage gets its models: a store of its own (cold), or the warm worker's; None for the
    stages that load no model (prepare, reward)."""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def dvc_stage(self) -> str:
        return f"{self.name}@{self.round_name}" if self.round_name else self.name

    @property
    def prev_round(self) -> str:
        """The round whose policy this round starts from (r0: the init policy)."""
        from rlpipe.paths import previous_round

        return previous_round(self.round_name)

    def init_torch(self):
        """Import torch and transformers' model classes (timed: the fixed cost of a model stage), with
        the configured threads, the run's seed and `runtime.deterministic`."""
        with self.timed("import_seconds"):
            import torch
            import transformers.models.auto.modeling_auto  # noqa: F401  (what every model load needs)
        freeze_imported_objects()
        from rlpipe.models.device import use_deterministic_algorithms

        torch.set_num_threads(self.params.runtime.torch_threads)
        use_deterministic_algorithms(self.params.runtime.deterministic)
        torch.manual_seed(self.params.seed)
        return torch

    def timed(self, label: str):
        return _Timer(self.timings, label)


def freeze_imported_objects() -> None:
    """Move what the imports created out of the cyclic garbage collector's reach, once per process.

    torch and transformers leave about 440,000 tracked objects, and every full collection walks them all:
    0.19 s each here, and a round's stages trigger one or two (they allocate a list per row). They live as
    long as the process, so scanning them finds nothing; `gc.freeze()` skips them from now on. Frozen only
    once, right after the imports, so that no stage's garbage is ever frozen with them."""
    import gc

    global _FROZEN
    if not _FROZEN:
        gc.freeze()
        _FROZEN = True


_FROZEN = False


class _Timer:
    def __init__(self, sink: dict[str, float], label: str):
        self.sink, self.label = sink, label

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc):
        self.sink[self.label] = self.sink.get(self.label, 0.0) + time.perf_counter() - self.started
