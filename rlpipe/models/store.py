"""Where a stage gets its models: from memory when it holds exactly what the artifact on disk holds, else
from disk.

A `ModelStore` keys each model it holds by the checkpoint directory it was loaded from or written to,
and by that directory's *identity*: (relative path, size, mtime, inode) of every file in it, recorded
when the store loaded or wrote it. A lookup recomputes the identity from disk, so a checkpoint edited by
hand, checked out by DVC or written by another experiment (any of which changes a file's mtime or inode)
is loaded again; a match means no file was rewritten since.

The store loads models onto its `device` (`runtime.device`). On a GPU that the vLLM engine shares (the
rollout stage), `offload` moves every model and optimizer state it holds to the CPU before the engine
takes the GPU back, and a lookup moves what it hands out back onto the device: the trainer and the
engine take turns on one GPU, as verl's colocated mode does. Written for CUDA; the development machine
has no GPU, so only the CPU path (where both are no-ops) has run.

A stage process (cold) uses a store of its own, which lives for that stage only. The warm worker keeps
one store across the stages of a pipeline execution: the update leaves the trained policy, its
optimizer and the critic in memory, keyed by the checkpoints it wrote, and the next rollout, advantage
and update find them there. A model handed out for training leaves the store (the caller changes it in
place); it comes back with `remember_*` once its new checkpoint is written.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_MODELS = 3
"""Models kept at once (policy, reference, critic); the least recently used goes first."""

Identity = tuple[tuple[str, int, int, int], ...]


def identity(directory: Path) -> Identity | None:
    """(relative path, size, mtime_ns, inode) of every file under `directory`, or None if it is missing."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    out = []
    for dirpath, _, files in os.walk(directory):
        for name in files:
            path = Path(dirpath) / name
            info = path.stat()
            out.append((path.relative_to(directory).as_posix(), info.st_size, info.st_mtime_ns, info.st_ino))
    return tuple(sorted(out))


def checkpoint_identity(directory: Path) -> Identity | None:
    """`identity` of a checkpoint directory and, for a LoRA adapter checkpoint, of its base as well: an
    adapter means nothing without the weights it applies to."""
    from rlpipe.models.lora import adapter_base

    own = identity(directory)
    base = adapter_base(directory) if own is not None else None
    if base is None:
        return own
    base_identity = identity(base)
    return None if base_identity is None else own + tuple((f"base:{base.as_posix()}/{entry[0]}", *entry[1:]) for entry in base_identity)


@dataclass
class Held:
    identity: Identity
    objects: tuple  # (model, tokenizer, optimizer or None)


@dataclass
class ModelStore:
    """Policies, critics and the rollout engine of one stage (cold) or of one pipeline execution (warm)."""

    held: "OrderedDict[tuple[str, str], Held]" = field(default_factory=OrderedDict)
    engine: Any = None
    """The rollout engine that lives across checkpoints (vLLM), kept by `rlpipe.rollout.rollout_backend`."""
    device: str = "cpu"
    """Where loaded models go, and where handed-out models are: the stage's resolved `runtime.device`."""
    loads: int = 0
    """Checkpoints loaded from disk (the figure the warm worker exists to bring down)."""
    reused: int = 0

    # --- lookups -----------------------------------------------------------------------------------
    def _key(self, kind: str, path: Path, dtype: str) -> tuple[str, str, str, str]:
        return kind, str(Path(path).resolve()), dtype, self.device

    def _find(self, kind: str, path: Path, dtype: str, take: bool) -> tuple | None:
        key = self._key(kind, path, dtype)
        held = self.held.get(key)
        if held is None:
            return None
        if held.identity != checkpoint_identity(Path(path)):
            del self.held[key]  # the checkpoint changed on disk since: never serve the old one
            return None
        self.reused += 1
        if take:
            del self.held[key]
        else:
            self.held.move_to_end(key)
        self._onto_device(held.objects)
        return held.objects

    def _onto_device(self, objects: tuple) -> None:
        """A held model (and its optimizer state) back on the store's device, after `offload`."""
        from rlpipe.models.device import model_device, move_model

        model, _, optimizer = objects
        self._models_take_the_gpu()
        if model_device(model).type != self.device:
            move_model(model, self.device, optimizer)

    def _models_take_the_gpu(self) -> None:
        """Before a model is handed out on the GPU: the rollout engine gives its memory back (vLLM sleep
        mode; the next rollout wakes it with that round's weights). A no-op on the CPU, without an
        engine, or with sleep mode off (the engine then keeps `gpu_memory_utilization` of the GPU)."""
        if self.device != "cpu" and self.engine is not None:
            self.engine.release_memory()

    def offload(self) -> None:
        """Every held model and optimizer state to the CPU (a no-op on the CPU): the GPU is the rollout
        engine's while it generates."""
        if self.device == "cpu":
            return
        import torch

        from rlpipe.models.device import move_model

        for held in self.held.values():
            model, _, optimizer = held.objects
            move_model(model, "cpu", optimizer)
        torch.cuda.empty_cache()  # give the freed blocks back to the driver, where vLLM can take them

    def _keep(self, kind: str, path: Path, dtype: str, objects: tuple, known: Identity | None) -> None:
        """Hold `objects` as what `path` holds, its identity taken before it was read (a file rewritten
        while it was read then fails the next lookup) or right after it was written."""
        if known is None:
            return
        self.held[self._key(kind, path, dtype)] = Held(known, objects)
        while len(self.held) > MAX_MODELS:
            self.held.popitem(last=False)

    def _load_policy(self, path: Path, dtype: str):
        from rlpipe.models.policy import load_policy

        self.loads += 1
        model, tokenizer = load_policy(path, dtype)
        self._models_take_the_gpu()
        return model.to(self.device), tokenizer

    def _load_critic(self, path: Path, dtype: str):
        from rlpipe.models.critic import load_critic

        self.loads += 1
        critic, tokenizer = load_critic(path, dtype)
        self._models_take_the_gpu()
        return critic.to(self.device), tokenizer

    # --- the policy and the critic ----------------------------------------------------------------
    def _for_inference(self, kind: str, path: Path, dtype: str, load):
        found = self._find(kind, path, dtype, take=False)
        if found is not None:
            return found[0], found[1]
        before = checkpoint_identity(Path(path))
        model, tokenizer = load(path, dtype)
        self._keep(kind, path, dtype, (model, tokenizer, None), before)
        return model, tokenizer

    def _for_training(self, kind: str, path: Path, dtype: str, load):
        found = self._find(kind, path, dtype, take=True)
        return found if found is not None else (*load(path, dtype), None)

    def _remember(self, kind: str, path: Path, model, optimizer, dtype: str) -> None:
        from transformers import AutoTokenizer

        from rlpipe.models.policy import torch_dtype

        if next(model.parameters()).dtype != torch_dtype(dtype):
            return  # not what loading `path` in `dtype` gives (a float32 build saved for a bfloat16 run)
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        for parameter in model.parameters():
            parameter.grad = None
        model.eval()
        written = checkpoint_identity(Path(path))
        # the tokenizer as loading the checkpoint gives it: a tokenizer built in memory saves another
        # tokenizer_config.json than the same tokenizer loaded back (cheap: no weights)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._keep(kind, path, dtype, (model, tokenizer, optimizer), written)

    def policy(self, path: Path, dtype: str):
        """(model, tokenizer) of a policy checkpoint, for inference: eval mode; do not change it."""
        return self._for_inference("policy", path, dtype, self._load_policy)

    def policy_for_training(self, path: Path, dtype: str):
        """(model, tokenizer, optimizer or None): the caller owns them and changes them in place. The
        optimizer is the one that wrote `path`'s optimizer state, when the store holds it; None means
        build it from the file."""
        return self._for_training("policy", path, dtype, self._load_policy)

    def remember_policy(self, path: Path, model, optimizer=None, dtype: str = "float32") -> None:
        """Hold a policy just written to `path` (with the optimizer whose state is in it), as a fresh load
        gives it: eval mode, no gradients, no gradient checkpointing. The caller has set back the
        attention kernel it trained with (`rlpipe.train.policy.update_policy`)."""
        self._remember("policy", path, model, optimizer, dtype)

    def critic(self, path: Path, dtype: str):
        return self._for_inference("critic", path, dtype, self._load_critic)

    def critic_for_training(self, path: Path, dtype: str):
        return self._for_training("critic", path, dtype, self._load_critic)

    def remember_critic(self, path: Path, critic, optimizer=None, dtype: str = "float32") -> None:
        self._remember("critic", path, critic, optimizer, dtype)

    def release_accelerator(self) -> None:
        """Before training: the rollout engine gives back its accelerator memory (vLLM sleep mode on a
        GPU), so that the trainer can use it; it takes the next round's weights when it wakes."""
        if self.engine is not None:
            self.engine.release_memory()

    def forget_all(self) -> None:
        """Drop every model (after a failed stage, which may have left one half-trained); the engine stays,
        its weights marked unknown, so that the next use loads them again."""
        self.held.clear()
        if self.engine is not None:
            self.engine.loaded_identity = None
