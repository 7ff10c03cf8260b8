"""The models: the policy (and reference), the critic, the embedded tokenizer, and how token ids become
model inputs and per-token logprobs (`sequences`)."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def transformers_warnings_off(*logger_names: str):
    """Some transformers loggers held at ERROR for the block (for warnings that do not apply to the
    call; each caller says why)."""
    loggers = [logging.getLogger(name) for name in logger_names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
