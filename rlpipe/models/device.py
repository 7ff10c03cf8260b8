"""Where a one-process stage's models run (`runtime.device`), and moving a model's optimizer state.

The stages hand their tensors to the model's own device (`model_device`) and take results back to the
CPU, so that one code path serves both. On a GPU shared with the vLLM engine (its sleep mode), the warm
worker's model store moves what it holds to the CPU while the engine is awake (`rlpipe.models.store`).
"""

from __future__ import annotations

import os

import torch

from rlpipe.errors import PipelineError


def resolve_device(setting: str) -> str:
    """"cpu" or "cuda" for `runtime.device`: auto takes the GPU when torch sees one."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"runtime.device: 'cuda', but this torch ({torch.__version__}) sees no GPU; set "
                            f"it to auto or cpu")
    return setting


def use_deterministic_algorithms(on: bool) -> None:
    """`runtime.deterministic`, for this process. cuBLAS reads its workspace setting when the process
    first uses it, so this runs before any model work (`StageContext.init_torch`, the torchrun ranks); a
    value the user exported is kept."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def reset_gpu_peak(device: str) -> None:
    """Start a stage's count of the GPU memory it peaks at (`gpu_memory_metrics`); nothing on the CPU."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def gpu_memory_metrics(device: str) -> dict[str, float]:
    """On a GPU, the stage's `stage/gpu_peak_gib` (the most memory torch's allocator held for it at once,
    since `reset_gpu_peak`) and `stage/gpu_held_gib` (what stays allocated after it: in the warm worker,
    the models it keeps for the next stage). Empty on the CPU."""
    if device != "cuda":
        return {}
    return {"stage/gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "stage/gpu_held_gib": torch.cuda.memory_allocated() / 2**30}


def model_device(model) -> torch.device:
    """The device of the model's first parameter (a one-process stage keeps all of them on one)."""
    return next(model.parameters()).device


def move_model(model, device, optimizer=None) -> None:
    """The model, and the optimizer state kept for its parameters, to `device`, in place.

    Between the CPU and a GPU, `Module.to` swaps each parameter's data and keeps the parameter objects,
    which key the optimizer's state and fill its param groups (and tie a model's shared weights). Where
    it made new ones instead, the optimizer would go on training parameters the model no longer has:
    that stops here."""
    before = [id(p) for p in model.parameters()]
    model.to(device)
    if optimizer is None:
        return
    if [id(p) for p in model.parameters()] != before:
        raise RuntimeError(f"moving the model to {device} made new parameter objects, which its optimizer does "
                           f"not hold: it would train the old ones")
    move_optimizer_state(optimizer, device)


def move_optimizer_state(optimizer, device) -> None:
    """Every tensor of the optimizer's per-parameter state (AdamW: exp_avg, exp_avg_sq) to `device`, in
    place; torch keeps AdamW's step counter on the CPU unless the optimizer is fused or capturable, and
    there it stays."""
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and not (name == "step" and value.device.type == "cpu"):
                state[name] = value.to(device)
