"""LoRA on the policy (`model.lora`, through peft): adapters attached, loaded, saved and merged.

Round 0's checkpoint is the base, stored once. With `model.lora.rank > 0` the first update attaches
adapters to it (B = 0, so round 1 starts exactly at the base) and trains only them; every round's
checkpoint from then on is an adapter directory: `adapter_config.json` and `adapter_model.safetensors`
(peft's format), the tokenizer, the adapters' optimizer state and `trainer_state.json`. Its
`base_model_name_or_path` is `runs/policy/r0`, relative to the project root as every rlpipe path is, so
that the checkpoint's bytes do not depend on where the project lives, and
`AutoModelForCausalLM.from_pretrained("runs/policy/rK")` run from the project root opens it (transformers
loads the base, then the adapters). `rlpipe merge-lora` writes the merged weights, base + (alpha/r) B A,
as a plain checkpoint that needs neither peft nor the base.

Every stage computes with the unmerged model (base and adapters apart), as the update trains it, so
that the rollout's, the advantage's and the update's logprobs are the same computation.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from rlpipe.config import LoRAConfig
from rlpipe.errors import PipelineError

ADAPTER_CONFIG = "adapter_config.json"
# peft writes a model card template beside the adapters; it says nothing the config does not
PEFT_MODEL_CARD = "README.md"


class LoRAMismatchError(PipelineError, ValueError):
    """An adapter checkpoint does not match `model.lora`, or `model.lora` does not match the policy."""


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> Path | None:
    """The base checkpoint an adapter directory applies to; None for a full checkpoint."""
    if not is_adapter(path):
        return None
    return Path(json.loads((Path(path) / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


def weights_dir(path: str | Path) -> Path:
    """The directory holding the model's config.json: the base's for an adapter checkpoint."""
    return adapter_base(path) or Path(path)


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config")


def _peft_config(cfg: LoRAConfig, base_path: Path):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), base_model_name_or_path=base_path.as_posix())


def attach(model, cfg: LoRAConfig, base_path: Path, seed: int):
    """The full policy `model` (loaded from `base_path`) with fresh adapters: A seeded, B zero (peft's
    default), so that the wrapped model computes what the base does. Only the adapters train."""
    import torch
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # seeded adapters (peft initialises them on the CPU), and the caller's random streams untouched:
        # torch.manual_seed would reseed every GPU's generator too, which fork_rng(devices=[]) leaves as is
        torch.default_generator.manual_seed(seed)
        # peft warns that it renames the base to the model object's name, which is set right below
        warnings.filterwarnings("ignore", message=".*base_model_name_or_path.*renamed")
        try:
            wrapped = get_peft_model(model, _peft_config(cfg, base_path))
        except ValueError as error:  # peft: "Target modules {...} not found in the base model"
            raise LoRAMismatchError(f"model.lora.target_modules = {list(cfg.target_modules)}: {error}") from None
    # peft takes the base's name from the model object, which a model built or held in memory lacks
    wrapped.peft_config["default"].base_model_name_or_path = base_path.as_posix()
    return wrapped


def for_training(model, cfg: LoRAConfig, policy_path: Path, seed: int):
    """The policy an update trains, from the checkpoint at `policy_path`: as it is without LoRA; with
    LoRA, a full checkpoint (round 0, the base) gets fresh adapters and an adapter checkpoint must hold
    the adapters `model.lora` asks for."""
    if is_peft_model(model):
        check_matches(policy_path, cfg)
        return model
    return model if cfg.rank == 0 else attach(model, cfg, Path(policy_path), seed)


def trainable_parameters(model) -> list:
    """What the optimizer steps: every parameter of a full policy, the adapters of a LoRA one."""
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def check_matches(path: Path, cfg: LoRAConfig) -> None:
    """Refuse an adapter checkpoint whose adapters are not those `model.lora` asks for (a run that changed
    model.lora reruns from the first update; this catches a stage run by hand on old checkpoints)."""
    if cfg.rank == 0:
        raise LoRAMismatchError(f"{path} holds LoRA adapters, but model.lora.rank is 0 (full fine-tuning); "
                                f"rerun from the first update (`dvc repro`)")
    saved = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    wanted = {"r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
              "target_modules": sorted(cfg.target_modules)}
    have = {"r": saved["r"], "lora_alpha": saved["lora_alpha"], "lora_dropout": saved["lora_dropout"],
            "target_modules": sorted(saved["target_modules"])}
    if have != wanted:
        raise LoRAMismatchError(f"{path} holds adapters {have}, but model.lora asks for {wanted}; "
                                f"rerun from the first update (`dvc repro`)")


def load(path: str | Path, dtype):
    """The policy an adapter checkpoint holds: its base with the adapters applied (not merged); the
    adapters keep requires_grad so that the update can train the same object."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = adapter_base(path)
    if not (base_path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: its LoRA base {base_path} is not a model directory (no config.json); "
                                f"restore it with `dvc checkout {base_path}`")
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=dtype)
    # onto the CPU with the base (peft would put the adapters on any GPU it sees, whatever runtime.device
    # says, and while the vLLM engine may still hold it); the model store moves the model afterwards
    return PeftModel.from_pretrained(base, str(path), is_trainable=True, torch_device="cpu")


def save(model, path: Path) -> None:
    """The adapters only (peft's `save_pretrained`), without peft's model-card template."""
    model.save_pretrained(path)
    (path / PEFT_MODEL_CARD).unlink(missing_ok=True)


def merged_weights(adapter_path: str | Path):
    """(name, tensor) of every weight of an adapter checkpoint merged into its base, in the base's
    safetensors naming: W + (alpha / r) B A for each adapted layer, computed in float32 and stored in the
    base's dtype. Torch and safetensors only, so that vLLM's worker process can load a LoRA round in
    place (`rlpipe.rollout.vllm_worker`)."""
    import torch
    from safetensors.torch import load_file

    config = json.loads((Path(adapter_path) / ADAPTER_CONFIG).read_text())
    if config.get("use_rslora") or config.get("use_dora"):
        raise LoRAMismatchError(f"{adapter_path}: rsLoRA/DoRA adapters are not merged here")
    scale = config["lora_alpha"] / config["r"]
    adapters = load_file(str(Path(adapter_path) / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapters.items():
        # peft: base_model.model.<module>.lora_A.weight -> the base's <module>.weight
        module, _, which = key.removeprefix("base_model.model.").rpartition(".lora_")
        pairs.setdefault(f"{module}.weight", {})[which.removesuffix(".weight")] = tensor
    base_dir = adapter_base(adapter_path)
    for shard in sorted(base_dir.glob("*.safetensors")):
        for name, weight in load_file(str(shard)).items():
            if name in pairs:
                delta = pairs.pop(name)
                weight = (weight.float() + scale * (delta["B"].float() @ delta["A"].float())).to(weight.dtype)
            yield name, weight
    if pairs:
        raise LoRAMismatchError(f"{adapter_path}: adapters for weights its base {base_dir} does not have: "
                                f"{sorted(pairs)[:3]}")


def merge_checkpoint(adapter_path: Path, out_dir: Path) -> None:
    """Write base + (alpha / r) B A of an adapter checkpoint as a plain `save_pretrained` checkpoint with
    its tokenizer: what `AutoModelForCausalLM` and vLLM load without peft."""
    from transformers import AutoTokenizer

    from rlpipe.dvc_state import stage_output_directory
    from rlpipe.models.policy import torch_dtype

    if not is_adapter(adapter_path):
        raise LoRAMismatchError(f"{adapter_path}: not a LoRA adapter checkpoint (no {ADAPTER_CONFIG})")
    base_config = json.loads((adapter_base(adapter_path) / "config.json").read_text())
    dtype = torch_dtype(base_config.get("dtype") or base_config.get("torch_dtype") or "float32")
    merged = load(adapter_path, dtype).merge_and_unload()
    merged.config.name_or_path = ""
    with stage_output_directory(Path(out_dir)) as tmp:
        merged.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(str(adapter_path)).save_pretrained(tmp)
