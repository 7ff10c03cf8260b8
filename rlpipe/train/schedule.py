"""The policy's learning-rate schedule over the whole run (`update.lr_schedule`): pure arithmetic on the
global optimizer step, which the checkpoint's trainer state carries from round to round. A round's
learning rates therefore depend only on params.yaml and the step count it starts from: a rerun of round
K reproduces them exactly.

    constant        lr
    linear_warmup   lr * s / W for s <= W, then lr                     (W = update.warmup_steps)
    cosine          the warmup, then lr * (m + (1 - m) (1 + cos(pi u)) / 2), u = (s - W) / (H - W) in [0, 1]
                    (H = update.lr_decay_steps, m = update.min_lr_ratio): lr * m from step H on

s counts optimizer steps from 1 over the whole run (`trainer_state.json`'s global_step + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from rlpipe.registry import Registry


@dataclass(frozen=True)
class Schedule:
    lr: float
    warmup_steps: int
    decay_steps: int | None  # cosine's horizon H
    min_lr_ratio: float


LR_SCHEDULES: Registry[Callable[[int, Schedule], float]] = Registry("learning-rate schedule")


def _warmup(step: int, s: Schedule) -> float:
    return s.lr * min(1.0, step / s.warmup_steps) if s.warmup_steps > 0 else s.lr


@LR_SCHEDULES.register("constant")
def constant(step: int, s: Schedule) -> float:
    return s.lr


@LR_SCHEDULES.register("linear_warmup")
def linear_warmup(step: int, s: Schedule) -> float:
    return _warmup(step, s)


@LR_SCHEDULES.register("cosine")
def cosine(step: int, s: Schedule) -> float:
    if step <= s.warmup_steps:
        return _warmup(step, s)
    progress = min(1.0, (step - s.warmup_steps) / (s.decay_steps - s.warmup_steps))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def learning_rate(name: str, step: int, schedule: Schedule) -> float:
    """The learning rate of global optimizer step `step` (from 1)."""
    return LR_SCHEDULES.get(name)(step, schedule)
