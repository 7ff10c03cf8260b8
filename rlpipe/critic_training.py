"""Training the critic: the per-round clipped value update, and the shared value-fitting step.

The per-round update (`train_critic`) fits V to the batch's returns with the clipped value loss
0.5 max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2), token-mean over the kept tokens, with its
own lr, epochs and clip range; its optimizer state is saved beside the critic and carried across rounds.
Under torchrun it runs on every rank like the policy update: each minibatch's groups are dealt to the
ranks, the token count is all-reduced so the token-mean is over the whole minibatch, and each rank's loss
is scaled by the world size against DDP's gradient mean; rank 0 writes the critic.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe import artifacts, paths
from rlpipe.config import Params
from rlpipe.distributed import World, check_fsdp2_micro_batches, no_sync, unwrap, wrap_model
from rlpipe.errors import PipelineError
from rlpipe.sequences import pack, pad_ragged, token_budget_chunks
from rlpipe.value_model import CRITIC_OPTIMIZER_FILE, critic_forward, explained_variance, load_critic


@dataclass
class ValueTargets:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    returns: torch.Tensor  # (B, T)
    old_values: torch.Tensor | None  # (B, T), for value clipping
    mask: torch.Tensor  # (B, T) bool

    def rows(self, idx: list[int]) -> "ValueTargets":
        return ValueTargets([self.prompt_ids[i] for i in idx], [self.response_ids[i] for i in idx],
                            self.returns[idx], None if self.old_values is None else self.old_values[idx], self.mask[idx])


def make_critic_optimizer(critic, params: Params, state_path: Path | None):
    optimizer = torch.optim.AdamW(critic.parameters(), lr=params.value.lr, weight_decay=0.0)
    if state_path is not None and state_path.is_file():
        optimizer.load_state_dict(torch.load(state_path, weights_only=True))
        for group in optimizer.param_groups:
            group["lr"] = params.value.lr
    return optimizer


def value_step(critic, optimizer, targets: ValueTargets | None, params: Params, pad_id: int, label: str,
               world: World = World()) -> dict[str, float]:
    """One optimizer step of the (clipped, when old values are given) value loss, token-mean over the
    whole minibatch (all ranks' shares). `targets` is None on a rank with no share of this minibatch."""
    from rlpipe.algorithms.losses import value_loss

    local_tokens = targets.mask.sum() if targets is not None else torch.tensor(0)
    total_tokens = local_tokens.to(torch.float64)
    if world.distributed:
        total_tokens = total_tokens.to(world.device)
        torch.distributed.all_reduce(total_tokens)
        total_tokens = total_tokens.cpu()
    total_tokens = total_tokens.clamp(min=1).float()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, clipped = 0.0, 0.0
    if targets is None:  # join DDP's gradient all-reduce with zeros
        check_fsdp2_micro_batches(params.update, world, 0, label)
        (sum(p.sum() for p in critic.parameters()) * 0.0).backward()
        chunks = []
    else:
        width = targets.mask.shape[1]
        chunks = token_budget_chunks([len(p) + width for p in targets.prompt_ids], params.update.micro_batch_tokens)
        check_fsdp2_micro_batches(params.update, world, len(chunks), label)
    for k, rows in enumerate(chunks):
        batch = pack(targets.prompt_ids[rows], targets.response_ids[rows], pad_id, response_width=width).to(world.device)
        with no_sync(critic, last=k == len(chunks) - 1):
            values = critic_forward(critic, batch)
            old = targets.old_values[rows].to(world.device) if targets.old_values is not None else values.detach()
            per_token, clip_mask = value_loss(values, old, targets.returns[rows].to(world.device),
                                              params.value.clip_range)
            mask = targets.mask[rows].to(world.device)
            loss = (per_token * mask).sum() / total_tokens.to(world.device)
            if not torch.isfinite(loss):
                raise PipelineError(f"{label}, rank {world.rank}: critic loss is {loss.item()}")
            (loss * world.size).backward()  # DDP averages over ranks; the weights already use the global count
        loss_sum += loss.item()
        clipped += float((clip_mask & mask).sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), params.update.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not torch.isfinite(torch.tensor(grad_norm)):
        raise PipelineError(f"{label}: critic gradient norm is {grad_norm}")
    optimizer.step()
    sums = world.sum_metrics({"value_loss": loss_sum, "value_clipped_tokens": clipped})
    return {"value_loss": sums["value_loss"], "value_clip_fraction": sums["value_clipped_tokens"] / float(total_tokens),
            "value_grad_norm": grad_norm}


@torch.no_grad()
def predict(critic, targets: ValueTargets, params: Params, pad_id: int) -> torch.Tensor:
    width = targets.mask.shape[1]
    out = torch.zeros_like(targets.returns)
    for rows in token_budget_chunks([len(p) + width for p in targets.prompt_ids], params.update.micro_batch_tokens):
        out[rows] = critic_forward(critic, pack(targets.prompt_ids[rows], targets.response_ids[rows], pad_id,
                                                response_width=width))
    return out


def save_critic(critic, tokenizer, optimizer, out_dir: Path, state: dict) -> None:
    with artifacts.atomic_directory(out_dir) as tmp:
        critic.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / CRITIC_OPTIMIZER_FILE)
        (tmp / paths.TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")


def batch_targets(columns: artifacts.Columns, rows: list[int]) -> ValueTargets:
    response_ids = [columns["response_ids"][i] for i in rows]
    width = max(len(r) for r in response_ids)

    def padded(name: str) -> torch.Tensor:
        return pad_ragged([columns[name][i] for i in rows], 0.0, torch.float32, width=width)[0]

    return ValueTargets([columns["prompt_ids"][i] for i in rows], response_ids, padded("returns"),
                        padded("values"), pad_ragged(response_ids, 0, torch.long, width=width)[1])


def train_critic(params: Params, round_name: str, batch_path: Path, critic_prev: Path, out_dir: Path,
                 world: World = World()) -> dict:
    columns = artifacts.Columns.of(artifacts.read_table(batch_path, artifacts.BATCH))
    rows = [i for i, kept in enumerate(columns["kept"]) if kept]
    critic, tokenizer = load_critic(critic_prev, params.model.dtype)
    critic = wrap_model(critic.to(world.device), params.update.strategy, world)
    optimizer = make_critic_optimizer(critic, params, critic_prev / CRITIC_OPTIMIZER_FILE)
    metrics: dict[str, float] = {}
    if rows:
        targets = batch_targets(columns, rows)
        metrics["value/explained_variance"] = explained_variance(targets.old_values, targets.returns, targets.mask)
        groups: dict[int, list[int]] = {}
        for k, i in enumerate(rows):
            groups.setdefault(columns["group"][i], []).append(k)
        rng, steps = random.Random(f"{params.seed}:critic:{round_name}"), []
        critic.train()
        for epoch in range(params.value.epochs):
            order = list(groups)
            rng.shuffle(order)
            for start in range(0, len(order), params.update.minibatch_prompts):
                idx = [k for g in world.shard(order[start : start + params.update.minibatch_prompts]) for k in groups[g]]
                steps.append(value_step(critic, optimizer, targets.rows(idx) if idx else None, params,
                                        tokenizer.pad_token_id, f"update@{round_name} critic epoch {epoch}", world))
        critic.eval()
        for name in steps[0]:
            metrics[f"value/{name}_mean"] = sum(s[name] for s in steps) / len(steps)
    if world.is_main:
        save_critic(unwrap(critic), tokenizer, optimizer, out_dir, {"round": round_name, **metrics})
    world.barrier()
    return metrics
