"""Supervised warm start of the embedded tiny model: a short SFT phase on (prompt, target) pairs.

RL needs a policy that is sometimes right (here 10-50% pass@1) to have any signal; a random tiny
model never is. Token-mean NLL over the target + eos tokens, AdamW, gradient clipping, one batch per
step through the shared `optimizer_step`.
"""

from __future__ import annotations

import random

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


def warm_start(model, tokenizer, prompts: list[str], targets: list[str], cfg: WarmStartConfig, seed: int) -> list[float]:
    """Train `model` in place for cfg.steps steps; returns the loss of each step."""
    prompt_ids, target_ids = encode_prompts(tokenizer, prompts), encode_targets(tokenizer, targets)
    rng = random.Random(seed)
    optimizer = make_adamw(model.parameters(), cfg.lr)

    def nll(batch):
        logp, _ = response_logprobs(model, batch)
        loss = -logp.sum() / batch.response_mask.sum()
        return loss, {"loss": loss.item()}

    model.train()
    losses: list[float] = []
    with progress(total=cfg.steps, desc="warm start (SFT)", unit="step") as bar:
        for step in range(cfg.steps):
            rows = [rng.randrange(len(prompt_ids)) for _ in range(cfg.batch_size)]
            batch = pack([prompt_ids[i] for i in rows], [target_ids[i] for i in rows], tokenizer.pad_token_id)
            metrics, _ = optimizer_step(model, optimizer, [batch], nll, max_grad_norm=MAX_GRAD_NORM,
                                        label=f"warm start step {step}")
            losses.append(metrics["loss"])
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
