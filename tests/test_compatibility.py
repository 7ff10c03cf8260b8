"""Policy, reference and critic must share vocabulary and tokenizer; a mismatch fails at load naming both paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlpipe import paths
from rlpipe.models.policy import IncompatibleCheckpointsError, build_tiny_model, check_compatible, save_policy
from rlpipe.config import TinyModelConfig
from rlpipe.models.tokenizer import build_char_tokenizer


def test_same_checkpoint_twice_is_compatible(tiny_model_dir: Path, tmp_path: Path):
    copy = tmp_path / "reference"
    shutil.copytree(tiny_model_dir, copy)
    check_compatible({"policy": tiny_model_dir, "reference": copy})


def test_vocab_size_mismatch_names_both_paths(tiny_model_dir: Path, tmp_path: Path):
    other = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 7
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompatibleCheckpointsError) as err:
        check_compatible({"policy": tiny_model_dir, "critic": other})
    message = str(err.value)
    assert str(tiny_model_dir) in message and str(other) in message and "vocab size" in message


def test_tokenizer_mismatch_names_both_paths(tiny_model_dir: Path, tmp_path: Path):
    tokenizer = build_char_tokenizer("0123456789+=xyz")
    other = tmp_path / "reference"
    model = build_tiny_model(TinyModelConfig(layers=1, hidden=16, heads=2, intermediate=32, max_positions=32),
                             tokenizer, seed=0)
    model.config.vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    model.resize_token_embeddings(model.config.vocab_size)
    other.mkdir()
    save_policy(model, tokenizer, other)
    with pytest.raises(IncompatibleCheckpointsError) as err:
        check_compatible({"policy": tiny_model_dir, "reference": other})
    message = str(err.value)
    assert "tokenizers differ" in message and str(tiny_model_dir) in message and str(other) in message


def test_critic_free_marker_is_skipped(tiny_model_dir: Path, tmp_path: Path):
    marker_dir = tmp_path / "critic"
    marker_dir.mkdir()
    (marker_dir / paths.NO_CRITIC_MARKER).write_text("{}")
    check_compatible({"policy": tiny_model_dir, "critic": marker_dir})
