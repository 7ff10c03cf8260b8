"""The policy (and the reference, the same kind of model): building, loading, saving, compatibility.

The policy is any causal LM that `AutoModelForCausalLM.from_pretrained(dir)` loads; the embedded one is
a tiny Llama built from config. Compatibility between policy, reference and critic (same vocab and
tokenizer) is checked at load, naming both paths. The critic is in `rlpipe.models.critic`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlpipe import paths
from rlpipe.config import ModelConfig, TinyModelConfig
from rlpipe.errors import PipelineError
from rlpipe.file_md5 import files_written, open_for_writing

OPTIMIZER_FILE = "optimizer.pt"


def build_tiny_model(cfg: TinyModelConfig, tokenizer, seed: int):
    """A small Llama sized by `cfg`, vocab and special ids from the tokenizer, seeded init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_policy(path: str | Path, dtype: str = "float32"):
    """(model, tokenizer) from a `save_pretrained` directory or hub name; eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpipe.models import lora

    path = str(path)
    if lora.is_adapter(path):
        model = lora.load(path, torch_dtype(dtype))
    elif Path(path).exists() and not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a model directory (no config.json); did its stage finish?")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()
    return model, tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and special ids: two models may share a batch only if these agree."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


class IncompatibleCheckpointsError(PipelineError, ValueError):
    """Two checkpoints that must score the same token ids disagree on vocabulary or tokenizer."""


def checkpoint_signature(path: str | Path) -> tuple[int, str]:
    """(config vocab_size, tokenizer fingerprint) of a `save_pretrained` directory, without its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from rlpipe.models.lora import weights_dir

    config = AutoConfig.from_pretrained(str(weights_dir(path)))
    return config.vocab_size, tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(path)))


def check_compatible(checkpoints: dict[str, str | Path]) -> None:
    """Raise naming both paths when two of the given checkpoints (role -> directory) cannot share a
    batch of token ids: different embedding vocab size, or a different tokenizer (vocabulary or
    special ids). Directories that hold no model (the critic-free marker) are skipped."""
    present = {role: Path(p) for role, p in checkpoints.items()
               if not (Path(p) / paths.NO_CRITIC_MARKER).is_file()}
    if len(present) < 2:
        return
    signatures = {role: checkpoint_signature(p) for role, p in present.items()}
    (first, (vocab0, tok0)), *rest = signatures.items()
    for role, (vocab, tok) in rest:
        if vocab != vocab0:
            raise IncompatibleCheckpointsError(
                f"vocab size differs: {first} {present[first]} has {vocab0}, {role} {present[role]} has {vocab}; "
                f"policy, reference and critic must share one vocabulary")
        if tok != tok0:
            raise IncompatibleCheckpointsError(
                f"tokenizers differ (vocabulary or pad/bos/eos ids): {first} {present[first]} and "
                f"{role} {present[role]}; policy, reference and critic must share one tokenizer")


def save_policy(model, tokenizer, path: Path, optimizer=None) -> None:
    """`save_pretrained` of model and tokenizer (of a LoRA policy, its adapters only), plus the optimizer
    state when given."""
    from rlpipe.models import lora

    if lora.is_peft_model(model):
        lora.save(model, path)
    else:
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if optimizer is not None:
        save_optimizer(optimizer, path / OPTIMIZER_FILE, written_before=path)


def save_optimizer(optimizer, file: Path, written_before: Path) -> None:
    """torch.save of the optimizer's state (the policy's or the critic's), through a file object so that
    its md5 is taken as it is written (rlpipe/file_md5.py), once the files already under
    `written_before` have started hashing."""
    import torch

    files_written(written_before)
    with open_for_writing(file) as handle:
        torch.save(optimizer.state_dict(), handle)


def policy_source(model_cfg: ModelConfig) -> str:
    return model_cfg.path or "embedded tiny model"
