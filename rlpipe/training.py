"""The `update` stage's work: PPO-style policy optimisation over the round's batch.

The kept groups are shuffled into minibatches of `update.minibatch_prompts` groups (one optimizer step
each, verl's ppo_mini_batch), for `update.epochs` passes. A minibatch's loss weights come from the whole
minibatch's counts, then it is split into micro-batches by token budget, and gradients accumulate
exactly. AdamW, gradient clipping, and the optimizer state saved beside the checkpoint, so that the next
round continues it. A non-finite loss or gradient stops the stage, naming the micro-batch, before any
checkpoint is written.
"""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe import artifacts, paths
from rlpipe.algorithms.aggregation import LossCounts
from rlpipe.config import Params, UpdateConfig
from rlpipe.distributed import World, check_fsdp2_micro_batches, no_sync, unwrap, wrap_model
from rlpipe.errors import PipelineError
from rlpipe.progress import progress
from rlpipe.sequences import pack, pad_ragged, response_logprobs, token_budget_chunks


class NonFiniteError(PipelineError):
    """A NaN or Inf loss or gradient; nothing is written."""


@dataclass
class Minibatch:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: torch.Tensor  # (B, T) bool
    group_index: torch.Tensor  # (B,) dense within the minibatch
    old_logp: torch.Tensor  # (B, T)
    ref_logp: torch.Tensor | None  # (B, T)
    advantages: torch.Tensor  # (B, T)
    correct: torch.Tensor  # (B,) bool
    truncated: torch.Tensor  # (B,) bool

    @classmethod
    def of(cls, columns: artifacts.Columns, rows: list[int]) -> "Minibatch":
        response_ids = [columns["response_ids"][i] for i in rows]
        width = max(len(r) for r in response_ids)

        def padded(name: str) -> torch.Tensor:
            return pad_ragged([columns[name][i] for i in rows], 0.0, torch.float32, width=width)[0]

        groups = [columns["group"][i] for i in rows]
        dense = {g: k for k, g in enumerate(dict.fromkeys(groups))}
        has_ref = all(len(columns["ref_logprobs"][i]) for i in rows)
        return cls(
            prompt_ids=[columns["prompt_ids"][i] for i in rows],
            response_ids=response_ids,
            response_mask=pad_ragged(response_ids, 0, torch.long, width=width)[1],
            group_index=torch.tensor([dense[g] for g in groups]),
            old_logp=padded("old_logprobs"),
            ref_logp=padded("ref_logprobs") if has_ref else None,
            advantages=padded("advantages"),
            correct=torch.tensor([columns["correct"][i] for i in rows]),
            truncated=torch.tensor([columns["finish_reason"][i] == "length" for i in rows]),
        )


def make_optimizer(model, cfg: UpdateConfig, state_path: Path | None = None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    if state_path is not None and state_path.is_file():
        optimizer.load_state_dict(torch.load(state_path, weights_only=True))
        for group in optimizer.param_groups:  # params.yaml may change the lr between rounds
            group["lr"] = cfg.lr
    return optimizer


def minibatches(groups: list[int], cfg: UpdateConfig, seed: int, round_name: str):
    """Per epoch, the groups (shuffled when configured, the same order on every rank) in chunks of
    `minibatch_prompts`."""
    rng = random.Random(f"{seed}:update:{round_name}")
    for _ in range(cfg.epochs):
        order = list(groups)
        if cfg.shuffle:
            rng.shuffle(order)
        for start in range(0, len(order), cfg.minibatch_prompts):
            yield order[start : start + cfg.minibatch_prompts]


def update_autocast(params: Params, device: str):
    import contextlib

    if params.update.bf16:
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# At and below this many tokens per sequence, eager attention beats SDPA for an update step on CPU
EAGER_ATTENTION_MAX_TOKENS = 128


def update_attention(cfg: UpdateConfig, device: str, longest_sequence: int) -> str:
    """The attn_implementation the update runs with (see `UpdateConfig.attention`)."""
    if cfg.attention != "auto":
        return cfg.attention
    on_cpu = torch.device(device).type == "cpu"
    return "eager" if on_cpu and longest_sequence <= EAGER_ATTENTION_MAX_TOKENS else "sdpa"


def train_step(model, optimizer, mb: Minibatch | None, params: Params, pad_id: int, step_label: str,
               world: World = World()) -> dict[str, float]:
    """One optimizer step over this rank's share of one minibatch, micro-batched; returns the step's
    metrics (summed over ranks: they are normalised by the whole minibatch's counts)."""
    from rlpipe.algorithms.build import minibatch_loss_setup, policy_loss

    spec, cfg = params.algorithm.resolve(), params.update
    totals: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    if mb is None:  # more ranks than groups at the tail of an epoch: join the all-reduce with zeros
        chunks, setup = [], None
        world.all_reduce_counts(LossCounts(0, 0, 0, 0))
        check_fsdp2_micro_batches(cfg, world, 0, step_label)
        with no_sync(model, last=True):
            (sum(p.sum() for p in model.parameters()) * 0.0).backward()
    else:
        setup = minibatch_loss_setup(spec, response_mask=mb.response_mask, group_index=mb.group_index,
                                     correct=mb.correct, truncated=mb.truncated,
                                     max_new_tokens=params.rollout.max_new_tokens, reduce_counts=world.all_reduce_counts)
        width = mb.response_mask.shape[1]
        chunks = token_budget_chunks([len(p) + width for p in mb.prompt_ids], cfg.micro_batch_tokens)
        check_fsdp2_micro_batches(cfg, world, len(chunks), step_label)
        for k, rows in enumerate(chunks):
            batch = pack(mb.prompt_ids[rows], mb.response_ids[rows], pad_id, response_width=width).to(world.device)
            with no_sync(model, last=k == len(chunks) - 1), update_autocast(params, world.device):
                logp, entropy = response_logprobs(model, batch, params.rollout.temperature, with_entropy=True)
                loss, metrics = policy_loss(
                    spec, logp=logp, old_logp=mb.old_logp[rows].to(world.device),
                    advantages=mb.advantages[rows].to(world.device), setup=setup.rows(rows).to(world.device),
                    ref_logp=None if mb.ref_logp is None else mb.ref_logp[rows].to(world.device), entropy=entropy,
                )
                if not torch.isfinite(loss):
                    raise NonFiniteError(f"{step_label}, rank {world.rank}, micro-batch {k} "
                                         f"(rows {rows.start}-{rows.stop - 1}): loss is {loss.item()}")
                # DDP averages gradients over ranks; the weights already use global counts, so scale back
                (loss * world.size).backward()
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value)
            totals["loss"] = totals.get("loss", 0.0) + loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise NonFiniteError(f"{step_label}: gradient norm is {grad_norm} after {len(chunks)} micro-batches "
                             f"(rank {world.rank})")
    optimizer.step()
    totals = world.sum_metrics(totals)
    totals.update({"grad_norm": grad_norm, "micro_batches": len(chunks),
                   "tokens": int(setup.counts.tokens) if setup is not None else 0})
    return totals


def round_summary(columns: artifacts.Columns) -> dict[str, float]:
    """Rollout-side figures of the round (sampled responses only), kept with the checkpoint."""
    sampled = [i for i, greedy in enumerate(columns["is_greedy"]) if not greedy]
    lengths = [len(columns["response_ids"][i]) for i in sampled]
    return {
        "accuracy": sum(columns["correct"][i] for i in sampled) / len(sampled),
        "reward_mean": sum(columns["shaped_reward"][i] for i in sampled) / len(sampled),
        "response_length_mean": sum(lengths) / len(lengths),
        "truncation_rate": sum(columns["finish_reason"][i] == "length" for i in sampled) / len(sampled),
    }


def update_policy(params: Params, round_name: str, batch_path: Path, policy_path: Path, out_dir: Path,
                  tracker=None, world: World = World()) -> dict:
    """Train on the round's kept groups; rank 0 writes the checkpoint. Returns the round's metrics and,
    under `step_metrics`, each optimizer step's (for a caller that logs them, e.g. the torchrun parent)."""
    from rlpipe.models import OPTIMIZER_FILE, load_policy, save_policy

    columns = artifacts.Columns.of(artifacts.read_round_table(
        batch_path, artifacts.BATCH, params.rollout.samples_per_prompt, int(params.algorithm.resolve().greedy_baseline)))
    rows = [i for i, kept in enumerate(columns["kept"]) if kept]
    model, tokenizer = load_policy(policy_path, params.model.dtype)
    longest = max((len(columns["prompt_ids"][i]) + len(columns["response_ids"][i]) for i in rows), default=0)
    # the kernel is not part of the saved config: the checkpoint is the same whichever runs here
    model.set_attn_implementation(update_attention(params.update, world.device, longest))
    if params.update.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = wrap_model(model.to(world.device), params.update.strategy, world)
    optimizer = make_optimizer(model, params.update, policy_path / OPTIMIZER_FILE)
    state = json.loads((policy_path / paths.TRAINER_STATE).read_text())
    global_step, steps = state["global_step"], []
    rows_of: dict[int, list[int]] = {}
    for i in rows:
        rows_of.setdefault(columns["group"][i], []).append(i)
    if not rows:
        warnings.warn(f"update@{round_name}: no kept groups in {batch_path}; the policy is carried over unchanged")
    model.train()
    n_steps = params.update.epochs * -(-len(rows_of) // params.update.minibatch_prompts)
    started, trained_tokens = time.perf_counter(), 0
    with progress(total=n_steps, desc=f"update {round_name}", unit="step") as bar:
        for mb_groups in minibatches(list(rows_of), params.update, params.seed, round_name):
            global_step += 1
            mine = [row for g in world.shard(mb_groups) for row in rows_of[g]]
            metrics = train_step(model, optimizer, Minibatch.of(columns, mine) if mine else None, params,
                                 tokenizer.pad_token_id, f"update@{round_name} step {global_step}", world)
            trained_tokens += metrics["tokens"]
            steps.append({"step": global_step, **metrics})
            if tracker is not None:
                tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=global_step)
                tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=global_step, to_parent=True)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
    model.eval()
    seconds = time.perf_counter() - started
    summary = {**round_summary(columns), "optimizer_steps": len(steps), "skipped": int(not rows)}
    for name in steps[0] if steps else ():
        if name != "step":
            summary[f"{name}_mean"] = sum(s[name] for s in steps) / len(steps)
    model = unwrap(model)
    if world.is_main:
        with artifacts.atomic_directory(out_dir) as tmp:
            save_policy(model, tokenizer, tmp, optimizer)
            (tmp / paths.TRAINER_STATE).write_text(json.dumps(
                {"round": round_name, "global_step": global_step, "summary": summary}, indent=2) + "\n")
    world.barrier()
    # the speed goes to the metrics only: the checkpoint (trainer_state.json included) stays byte-identical
    # across runs of the same params and seed
    speed = {"train_tokens_per_s": trained_tokens / max(seconds, 1e-9)}
    return {**{f"update/{k}": v for k, v in {**summary, **speed}.items()}, "step_metrics": steps}
