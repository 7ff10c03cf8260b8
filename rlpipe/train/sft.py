"""Supervised warm start of the embedded tiny model: a short SFT phase on (prompt, target) pairs.

RL needs a policy that is sometimes right (here 10-50% pass@1) to have any signal; a random tiny
model never is. Token-mean NLL over the target + eos tokens, AdamW, gradient clipping, one batch per
step through the shared `optimizer_step`. With `target_pass_at_1`, a check (greedy pass@1 on prompts SFT
never sees) runs every `check_every` steps, and SFT stops at the first that reaches the target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from rlpipe.config import WarmStartConfig
from rlpipe.data.prompts import encode_prompts
from rlpipe.models.sequences import pack, response_logprobs
from rlpipe.progress import progress
from rlpipe.train.loop import make_adamw, optimizer_step

MAX_GRAD_NORM = 1.0


def encode_targets(tokenizer, targets: list[str]) -> list[list[int]]:
    """Response token ids of each target text, eos appended."""
    encoded = tokenizer(targets, add_special_tokens=False)["input_ids"]
    return [ids + [tokenizer.eos_token_id] for ids in encoded]


@dataclass
class WarmStartLog:
    losses: list[float] = field(default_factory=list)
    """The loss of each step."""
    checks: list[tuple[int, float]] = field(default_factory=list)
    """(steps so far, greedy pass@1) of each check (`target_pass_at_1` only)."""


def warm_start(model, tokenizer, prompts: list[str], targets: list[str], cfg: WarmStartConfig, seed: int,
               check: Callable[[], float] | None = None) -> WarmStartLog:
    """Train `model` in place for cfg.steps steps, or, given `check` (greedy pass@1 of the model as it
    stands) and `cfg.target_pass_at_1`, until a check every `cfg.check_every` steps reaches the target."""
    prompt_ids, target_ids = encode_prompts(tokenizer, prompts), encode_targets(tokenizer, targets)
    rng = random.Random(seed)
    optimizer = make_adamw(model.parameters(), cfg.lr)
    stop_at = cfg.target_pass_at_1 if check is not None else None

    def nll(batch):
        logp, _ = response_logprobs(model, batch)
        loss = -logp.sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    def reached_target(step: int) -> bool:
        model.eval()
        log.checks.append((step, check()))
        model.train()
        return log.checks[-1][1] >= stop_at

    model.train()
    log = WarmStartLog()
    with progress(total=cfg.steps, desc="warm start (SFT)", unit="step") as bar:
        for step in range(cfg.steps):
            rows = [rng.randrange(len(prompt_ids)) for _ in range(cfg.batch_size)]
            batch = pack([prompt_ids[i] for i in rows], [target_ids[i] for i in rows], tokenizer.pad_token_id)
            metrics, _ = optimizer_step(model, optimizer, [batch], nll, max_grad_norm=MAX_GRAD_NORM,
                                        label=f"warm start step {step}")
            log.losses.append(metrics["loss"])
            bar.update(1)
            checked = {"pass@1": f"{log.checks[-1][1]:.3f}"} if log.checks else {}
            bar.set_postfix(loss=f"{log.losses[-1]:.3f}", **checked)
            if stop_at is not None and (step + 1) % cfg.check_every == 0 and reached_target(step + 1):
                break
    model.eval()
    return log
