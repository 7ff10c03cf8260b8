"""The policy update: PPO-style optimisation over one round's batch.

The kept groups are shuffled into minibatches of `update.minibatch_prompts` groups (one optimizer step
each, verl's ppo_mini_batch), for `update.epochs` passes; under `update.minibatch_mix: rows` the round's
rows are dealt across as many steps instead (TRL's, OpenRLHF's; `step_units`). A minibatch's loss
weights come from the whole minibatch's counts, then it is split into micro-batches by token budget, and
gradients accumulate exactly (the step itself is `rlpipe.train.loop.optimizer_step`). AdamW, gradient
clipping, and the optimizer state saved beside the checkpoint, so that the next round continues it. A
non-finite loss or gradient stops the stage, naming the micro-batch, before any checkpoint is written.
"""

from __future__ import annotations

import json
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from rlpipe import artifacts, paths
from rlpipe.algorithms.aggregation import LossCounts
from rlpipe.dvc_state import stage_output_directory
from rlpipe.config import Params, UpdateConfig
from rlpipe.models.sequences import pack, pad_ragged, response_logprobs, token_budget_chunks
from rlpipe.progress import progress
from rlpipe.train.distributed import World, unwrap, wrap_model
from rlpipe.train.loop import make_adamw, minibatches, optimizer_step, saved_optimizer, set_lr, step_means
from rlpipe.train.schedule import Schedule, learning_rate


@dataclass
class Minibatch:
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: torch.Tensor  # (B, T) bool
    group_index: torch.Tensor  # (B,) dense within the minibatch
    old_logp: torch.Tensor  # (B, T)
    rollout_logp: torch.Tensor  # (B, T): the rollout engine's (behaviour) logprobs
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
            rollout_logp=padded("behaviour_logprobs"),
            ref_logp=padded("ref_logprobs") if has_ref else None,
            advantages=padded("advantages"),
            correct=torch.tensor([columns["correct"][i] for i in rows]),
            truncated=torch.tensor([columns["finish_reason"][i] == "length" for i in rows]),
        )


def make_optimizer(model, cfg: UpdateConfig, state_path: Path | None = None):
    from rlpipe.models.lora import trainable_parameters

    return make_adamw(trainable_parameters(model), cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                      weight_decay=cfg.weight_decay, state_path=state_path)


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
    if mb is None:  # no share of this minibatch on this rank: count nothing, join the collectives
        setup, chunks = None, []
        world.all_reduce_counts(LossCounts(0, 0, 0, 0))
    else:
        setup = minibatch_loss_setup(spec, response_mask=mb.response_mask, group_index=mb.group_index,
                                     correct=mb.correct, truncated=mb.truncated,
                                     max_new_tokens=params.rollout.max_new_tokens, reduce_counts=world.all_reduce_counts)
        width = mb.response_mask.shape[1]
        chunks = token_budget_chunks([len(p) + width for p in mb.prompt_ids], cfg.micro_batch_tokens)

    def micro_batch_loss(rows: slice):
        batch = pack(mb.prompt_ids[rows], mb.response_ids[rows], pad_id, response_width=width).to(world.device)
        logp, entropy = response_logprobs(model, batch, params.rollout.temperature, with_entropy=True)
        loss, metrics = policy_loss(
            spec, logp=logp, old_logp=mb.old_logp[rows].to(world.device),
            advantages=mb.advantages[rows].to(world.device), setup=setup.rows(rows).to(world.device),
            ref_logp=None if mb.ref_logp is None else mb.ref_logp[rows].to(world.device), entropy=entropy,
            rollout_logp=mb.rollout_logp[rows].to(world.device),
        )
        return loss, {**metrics, "loss": loss.item()}

    totals, grad_norm = optimizer_step(model, optimizer, chunks, micro_batch_loss, max_grad_norm=cfg.max_grad_norm,
                                       label=step_label, world=world, update=cfg,
                                       autocast=lambda: update_autocast(params, world.device))
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
                  tracker=None, world: World = World(), models=None) -> dict:
    """Train on the round's kept groups; rank 0 writes the checkpoint. Returns the round's metrics and,
    under `step_metrics`, each optimizer step's (for a caller that logs them, e.g. the torchrun parent).
    `models` (a ModelStore) gives the policy and its optimizer, and holds the trained ones afterwards."""
    from rlpipe.models import lora
    from rlpipe.models.policy import OPTIMIZER_FILE, save_policy
    from rlpipe.models.store import ModelStore

    models = models or ModelStore()
    columns = artifacts.Columns.of(artifacts.read_round_table(
        batch_path, artifacts.BATCH, params.rollout.samples_per_prompt, int(params.algorithm.resolve().greedy_baseline)))
    rows = [i for i, kept in enumerate(columns["kept"]) if kept]
    state = json.loads((policy_path / paths.TRAINER_STATE).read_text())
    model, tokenizer, optimizer = models.policy_for_training(policy_path, params.model.dtype)
    model = lora.for_training(model, params.model.lora, policy_path, params.seed)
    longest = max((len(columns["prompt_ids"][i]) + len(columns["response_ids"][i]) for i in rows), default=0)
    # the kernel is not part of the saved config: the checkpoint is the same whichever runs here; the
    # model gets its own back after training, for whoever uses it next (the warm worker's rollout)
    inference_attention = model.config._attn_implementation
    model.set_attn_implementation(update_attention(params.update, world.device, longest))
    if params.update.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if lora.is_peft_model(model):  # frozen embeddings: checkpointed blocks still need an input with grad
            model.enable_input_require_grads()
    model = wrap_model(model.to(world.device), params.update.strategy, world)
    if optimizer is None:
        optimizer = make_optimizer(model, params.update, saved_optimizer(policy_path, OPTIMIZER_FILE, trained=state["global_step"] > 0))
    set_lr(optimizer, params.update.lr)
    if not rows:
        warnings.warn(f"update@{round_name}: no kept groups in {batch_path}; the policy is carried over unchanged")
    started = time.perf_counter()
    steps = train_policy(model, optimizer, tokenizer.pad_token_id, columns, rows, params, round_name,
                         state["global_step"], tracker, world)
    seconds = time.perf_counter() - started
    global_step = steps[-1]["step"] if steps else state["global_step"]
    summary = {**round_summary(columns), "optimizer_steps": len(steps), "skipped": int(not rows), **step_means(steps),
               **rollout_correction_summary(params, columns, rows)}
    model = unwrap(model)
    model.set_attn_implementation(inference_attention)
    if world.is_main:
        with stage_output_directory(out_dir) as tmp:
            save_policy(model, tokenizer, tmp, optimizer)
            (tmp / paths.TRAINER_STATE).write_text(json.dumps(
                {"round": round_name, "global_step": global_step, "summary": summary}, indent=2) + "\n")
        models.remember_policy(out_dir, model, optimizer, params.model.dtype)
    world.barrier()
    # the speed goes to the metrics only: the checkpoint (trainer_state.json included) stays byte-identical
    # across runs of the same params and seed
    speed = {"train_tokens_per_s": sum(s["tokens"] for s in steps) / max(seconds, 1e-9)}
    return {**{f"update/{k}": v for k, v in {**summary, **speed}.items()}, "step_metrics": steps}


def rollout_correction_summary(params: Params, columns: artifacts.Columns, rows: list[int]) -> dict[str, float]:
    """The rollout correction's weights over the round's kept tokens (`rollout_correction_*`: the fraction
    truncated or masked, mean, min, max, percentiles); nothing when it is off."""
    from rlpipe.algorithms.build import round_rollout_weights

    spec = params.algorithm.resolve()
    if spec.rollout_correction == "none" or not rows:
        return {}
    batch = Minibatch.of(columns, rows)
    stats = round_rollout_weights(spec, old_logp=batch.old_logp, rollout_logp=batch.rollout_logp,
                                  response_mask=batch.response_mask)
    return {f"rollout_correction_{k}": v for k, v in stats.items()}


def steps_per_epoch(groups: int, cfg: UpdateConfig) -> int:
    """Optimizer steps per pass over a round of `groups` kept prompts, whichever `minibatch_mix`."""
    return -(-groups // cfg.minibatch_prompts)


def step_units(rows_of: dict[int, list[int]], cfg: UpdateConfig, rng: random.Random) -> Iterator[list[list[int]]]:
    """Each optimizer step's rows, in the units that are dealt to ranks: whole groups, or under
    `minibatch_mix: rows` single rows. Rows: per epoch the round's rows are shuffled and cut into as many
    steps as groups would make, each step's rows then put back in table order, so that a prompt's rows in
    the step sit together (the update computes a shared prompt once, `repeated_prefix_cache`)."""
    if cfg.minibatch_mix == "groups":
        for groups in minibatches(list(rows_of), cfg.minibatch_prompts, cfg.epochs, cfg.shuffle, rng):
            yield [rows_of[g] for g in groups]
        return
    steps = steps_per_epoch(len(rows_of), cfg)
    for _ in range(cfg.epochs):
        order = [row for group_rows in rows_of.values() for row in group_rows]
        if cfg.shuffle:
            rng.shuffle(order)
        for k in range(steps):
            yield [[row] for row in sorted(order[k * len(order) // steps : (k + 1) * len(order) // steps])]


def train_policy(model, optimizer, pad_id: int, columns: artifacts.Columns, rows: list[int], params: Params,
                 round_name: str, global_step: int, tracker=None, world: World = World()) -> list[dict]:
    """The round's optimizer steps over its kept rows (`step_units`, this rank's share of each); returns
    each step's metrics, numbered on from `global_step`."""
    rows_of: dict[int, list[int]] = {}
    for i in rows:
        rows_of.setdefault(columns["group"][i], []).append(i)
    cfg, steps = params.update, []
    schedule = Schedule(cfg.lr, cfg.warmup_steps, cfg.lr_decay_steps, cfg.min_lr_ratio)
    n_steps = cfg.epochs * steps_per_epoch(len(rows_of), cfg)
    model.train()
    with progress(total=n_steps, desc=f"update {round_name}", unit="step") as bar:
        rng = random.Random(f"{params.seed}:update:{round_name}")
        for units in step_units(rows_of, cfg, rng):
            global_step += 1
            lr = learning_rate(cfg.lr_schedule, global_step, schedule)
            set_lr(optimizer, lr)
            mine = [row for unit in world.shard(units) for row in unit]
            metrics = {"lr": lr, **train_step(model, optimizer, Minibatch.of(columns, mine) if mine else None, params,
                                              pad_id, f"update@{round_name} step {global_step}", world)}
            steps.append({"step": global_step, **metrics})
            if tracker is not None:
                tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=global_step)
                tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=global_step, to_parent=True)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}")
    model.eval()
    return steps
