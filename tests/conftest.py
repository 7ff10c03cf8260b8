"""Shared fixtures: a tiny Llama and the embedded char tokenizer, built from config (no download)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RLPIPE_PROGRESS", "0")
# The local services the tests start (tracking daemons, warm workers, and those of the stages they run)
# put their sockets in a private directory of this session, removed at its end, not in the user's own
# (`rlpipe.local_service.service_dir`): a worker that a kill test SIGKILLs leaves its socket file behind.
TEST_SERVICE_ROOT = tempfile.mkdtemp(prefix="rlpipe-test-services-")  # mode 0700, as service_dir requires
os.environ["XDG_RUNTIME_DIR"] = TEST_SERVICE_ROOT
atexit.register(shutil.rmtree, TEST_SERVICE_ROOT, True)


@pytest.fixture(scope="session")
def tokenizer():
    from rlpipe.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    import torch

    from rlpipe.config import TinyModelConfig
    from rlpipe.models.policy import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(TinyModelConfig(layers=2, hidden=32, heads=2, intermediate=64, max_positions=64), tokenizer, seed=0)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tokenizer) -> Path:
    from rlpipe.models.policy import save_policy

    path = tmp_path_factory.mktemp("tiny_policy")
    save_policy(tiny_model, tokenizer, path)
    return path


@pytest.fixture
def transformers_warnings():
    """The messages of every record of WARNING or above that a "transformers" logger emits during the
    test, taken by a handler on that logger itself (what a user's terminal would show). transformers'
    `warning_once` messages are forgotten first, so that one an earlier test printed can show again."""
    import logging

    from transformers.utils import logging as transformers_logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    transformers_logging.warning_once.cache_clear()
    records = Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        yield records.messages
    finally:
        logging.getLogger("transformers").removeHandler(records)


@pytest.fixture(scope="session")
def mini_run(tmp_path_factory):
    """One real `dvc repro` of tests/params_mini.yaml in a scratch project: (root, dvc's output). Tests
    that change the project work on a copy, or through `dvc exp run --temp`."""
    from scratch import dvc, make_project

    root = make_project(tmp_path_factory.mktemp("pipeline") / "project")
    log = dvc(root, "repro")
    return root, log
