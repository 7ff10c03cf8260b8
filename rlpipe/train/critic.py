"""Training the critic: value pretraining, the per-round clipped value update, and the step they share.

Value pretraining (`pretrain_critic`) fits a fresh value head on the policy's backbone (or
`value.model.path`) to Monte-Carlo returns (lambda = 1) of responses sampled from the init policy: G_t =
gamma^(T_b - 1 - t) r_b, or with `value.pretrain.target_continuations` to their mean with continuations sampled
from each state. A quarter of the prompts is held out; training stops when the held-out
explained variance reaches `value.pretrain.min_explained_variance`, or after `value.pretrain.max_steps`
steps, at `value.lr` or down a cosine over those steps (`value.pretrain.lr_schedule`; the verifier phase
has its own, `verifier_lr_schedule`); with `value.pretrain.average_from` it writes the mean of the critic's
weights over its last steps. The per-round update (`update_critic`) fits V to the batch's
returns with the clipped value loss 0.5 max((V - G)^2, (clip(V, V_old - c, V_old + c) - G)^2),
token-mean over the kept tokens, with its own lr, epochs and clip range; its optimizer state is saved
beside the critic and carried across rounds. Under torchrun it runs on every rank like the policy
update: each minibatch's groups are dealt to the ranks, the token count is all-reduced so the token-mean
is over the whole minibatch, and each rank's loss is scaled by the world size against DDP's gradient
mean; rank 0 writes the critic.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlpipe import artifacts, paths
from rlpipe.dvc_state import stage_output_directory
from rlpipe.config import Params
from rlpipe.models.critic import (CRITIC_OPTIMIZER_FILE, critic_forward, critic_values, explained_variance,
                                  load_critic, write_no_critic_marker)
from rlpipe.models.policy import save_optimizer
from rlpipe.models.sequences import pack, pad_ragged, token_budget_chunks
from rlpipe.progress import progress
from rlpipe.train.distributed import World, unwrap, wrap_model
from rlpipe.train.loop import (WeightAverage, make_adamw, minibatches, optimizer_step, saved_optimizer, set_lr,
                               step_means)
from rlpipe.train.schedule import Schedule, learning_rate


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
    return make_adamw(critic.parameters(), params.value.lr, state_path=state_path)


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
    chunks = [] if targets is None else \
        token_budget_chunks([len(p) + targets.mask.shape[1] for p in targets.prompt_ids], params.update.micro_batch_tokens)

    def micro_batch_loss(rows: slice):
        batch = pack(targets.prompt_ids[rows], targets.response_ids[rows], pad_id,
                     response_width=targets.mask.shape[1]).to(world.device)
        values = critic_forward(critic, batch)
        old = targets.old_values[rows].to(world.device) if targets.old_values is not None else values.detach()
        per_token, clip_mask = value_loss(values, old, targets.returns[rows].to(world.device), params.value.clip_range)
        mask = targets.mask[rows].to(world.device)
        loss = (per_token * mask).sum() / total_tokens.to(world.device)
        return loss, {"value_loss": loss.item(), "value_clipped_tokens": float((clip_mask & mask).sum())}

    sums, grad_norm = optimizer_step(critic, optimizer, chunks, micro_batch_loss, max_grad_norm=params.update.max_grad_norm,
                                     label=f"{label} (critic)", world=world, update=params.update)
    return {"value_loss": sums.get("value_loss", 0.0),
            "value_clip_fraction": sums.get("value_clipped_tokens", 0.0) / float(total_tokens),
            "value_grad_norm": grad_norm}


def predict(critic, targets: ValueTargets, params: Params, pad_id: int) -> torch.Tensor:
    """The critic's (B, T) values of the targets' states (`critic_values`, in the update's micro-batches)."""
    return critic_values(critic, pad_id, targets.prompt_ids, targets.response_ids, targets.mask.shape[1],
                         params.update.micro_batch_tokens)


def save_critic(critic, tokenizer, optimizer, out_dir: Path, state: dict) -> None:
    with stage_output_directory(out_dir) as tmp:
        critic.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        save_optimizer(optimizer, tmp / CRITIC_OPTIMIZER_FILE, written_before=tmp)
        (tmp / paths.TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")


def batch_targets(columns: artifacts.Columns, rows: list[int]) -> ValueTargets:
    response_ids = [columns["response_ids"][i] for i in rows]
    width = max(len(r) for r in response_ids)

    def padded(name: str) -> torch.Tensor:
        return pad_ragged([columns[name][i] for i in rows], 0.0, torch.float32, width=width)[0]

    return ValueTargets([columns["prompt_ids"][i] for i in rows], response_ids, padded("returns"),
                        padded("values"), pad_ragged(response_ids, 0, torch.long, width=width)[1])


def update_critic(params: Params, round_name: str, batch_path: Path, critic_prev: Path, out_dir: Path,
                  world: World = World(), models=None) -> dict:
    """Fit the critic to the batch's returns with the clipped value loss; critic-free presets get the
    marker. Under torchrun every rank takes part and rank 0 writes."""
    if not params.algorithm.resolve().needs_critic:
        return write_no_critic_marker(out_dir, params.algorithm.preset) if world.is_main else {"value/critic": 0}
    return train_critic(params, round_name, batch_path, critic_prev, out_dir, world, models)


def train_critic(params: Params, round_name: str, batch_path: Path, critic_prev: Path, out_dir: Path,
                 world: World = World(), models=None) -> dict:
    from rlpipe.models.store import ModelStore

    models = models or ModelStore()
    columns = artifacts.Columns.of(artifacts.read_table(batch_path, artifacts.BATCH))
    rows = [i for i, kept in enumerate(columns["kept"]) if kept]
    critic, tokenizer, optimizer = models.critic_for_training(critic_prev, params.model.dtype)
    critic = wrap_model(critic.to(world.device), params.update.strategy, world)
    if optimizer is None:  # value pretraining writes the critic's optimizer state, even after 0 steps
        optimizer = make_critic_optimizer(critic, params, saved_optimizer(critic_prev, CRITIC_OPTIMIZER_FILE, trained=True))
    set_lr(optimizer, params.value.lr)
    metrics: dict[str, float] = {}
    if rows:
        targets = batch_targets(columns, rows)
        metrics["value/explained_variance"] = explained_variance(targets.old_values, targets.returns, targets.mask)
        groups: dict[int, list[int]] = {}
        for k, i in enumerate(rows):
            groups.setdefault(columns["group"][i], []).append(k)
        rng, steps = random.Random(f"{params.seed}:critic:{round_name}"), []
        critic.train()
        for mb_groups in minibatches(list(groups), params.update.minibatch_prompts, params.value.epochs,
                                     params.update.shuffle, rng):
            idx = [k for g in world.shard(mb_groups) for k in groups[g]]
            steps.append(value_step(critic, optimizer, targets.rows(idx) if idx else None, params,
                                    tokenizer.pad_token_id, f"update@{round_name} critic step {len(steps) + 1}", world))
        critic.eval()
        metrics.update({f"value/{name}": value for name, value in step_means(steps).items()})
    if world.is_main:
        save_critic(unwrap(critic), tokenizer, optimizer, out_dir, {"round": round_name, **metrics})
        models.remember_critic(out_dir, unwrap(critic), optimizer, params.model.dtype)
    world.barrier()
    return metrics


# --- value pretraining ----------------------------------------------------------------------------------
def monte_carlo_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) G_t = gamma^(T_b - 1 - t) r_b on valid tokens, 0 elsewhere (lambda = 1, V_T = 0)."""
    lengths = mask.sum(dim=1, keepdim=True)
    t = torch.arange(mask.shape[1]).unsqueeze(0)
    return (gamma ** (lengths - 1 - t).clamp(min=0).float()) * rewards.unsqueeze(1) * mask


def blend_continuations(returns: torch.Tensor, mask: torch.Tensor, rows: list[int], means: torch.Tensor,
                        continuations: int) -> torch.Tensor:
    """`returns` with each state of `rows` valued (G_t + K m_t) / (K + 1): the response's own return and
    the mean reward m_t of K continuations sampled from that state, K + 1 samples of V(s_t) in all.
    `means` is (len(rows), W), W up to the longest of those rows; other rows keep their returns."""
    blended, width = returns.clone(), means.shape[1]
    own = returns[rows, :width]
    blended[rows, :width] = (own + continuations * means) / (continuations + 1) * mask[rows, :width]
    return blended


def held_out_groups(seed: int, n_groups: int) -> set[int]:
    """The groups (prompts) value pretraining holds out to measure explained variance on: a seeded quarter."""
    return set(random.Random(f"{seed}:value_holdout").sample(range(n_groups), max(1, n_groups // 4)))


def split_rows(seed: int, groups: list[int]) -> tuple[list[int], list[int]]:
    """(training rows, held-out rows) of value pretraining, for rows whose groups are numbered from 0: the
    held-out rows are those of `held_out_groups(seed, max(groups) + 1)`."""
    held_out = held_out_groups(seed, max(groups) + 1)
    return [i for i, g in enumerate(groups) if g not in held_out], [i for i, g in enumerate(groups) if g in held_out]


def pretrain_critic(params: Params, prompt_ids: list[list[int]], response_ids: list[list[int]], rewards: torch.Tensor,
                    groups: list[int], backbone: Path, out_dir: Path, tracker=None, models=None, oracle=None,
                    continuation_means=None, eval_every: int | None = None, state_targets=None,
                    desc: str = "value pretrain", device: str = "cpu") -> dict:
    """Fit a fresh value head on `backbone` to the Monte-Carlo returns of the given responses (rows of
    `groups`, one group per prompt) and write the round-0 critic to `out_dir`. `oracle(rows, returns,
    values, mask)`, when given, measures the critic's ceiling on the held-out rows its EV is taken on.
    `continuation_means(rows)`, needed with `value.pretrain.target_continuations`, gives the (len(rows), W)
    mean reward of that many continuations from each state of the training rows (`blend_continuations`).
    The held-out EV is taken every `eval_every` steps (default `value.pretrain.eval_every`) and after the
    last; evaluating changes no weight.
    `state_targets` (B, T), when given, are fit in place of the returns of `rewards` (the process phase).
    `desc` names the phase in the progress bar; the critic trains on `device`."""
    cfg = params.value.pretrain
    eval_every = eval_every or cfg.eval_every
    mask = pad_ragged(response_ids, 0, torch.long)[1]
    returns = (monte_carlo_returns(rewards, mask, params.algorithm.resolve().gamma) if state_targets is None
               else state_targets)
    train_idx, eval_rows = split_rows(params.seed, groups)
    eval_targets = ValueTargets(prompt_ids, response_ids, returns, None, mask).rows(eval_rows)
    sampled = {}
    if cfg.target_continuations:  # the training rows' targets only: the held-out EV stays against the returns
        started = time.perf_counter()
        returns = blend_continuations(returns, mask, train_idx, continuation_means(train_idx), cfg.target_continuations)
        sampled = {"value/target_continuations": cfg.target_continuations,
                   "value/target_continuation_seconds": time.perf_counter() - started}
    targets = ValueTargets(prompt_ids, response_ids, returns, None, mask)

    critic, tokenizer = load_critic(backbone, params.model.dtype, from_policy=True)
    critic, world = critic.to(device), World(device=device)
    optimizer = make_critic_optimizer(critic, params, None)
    rng = random.Random(f"{params.seed}:value_pretrain")
    batch_rows = params.update.minibatch_prompts * params.rollout.samples_per_prompt
    def held_out_values() -> torch.Tensor:
        critic.eval()
        return predict(critic, eval_targets, params, tokenizer.pad_token_id)

    # the loop stops only right after an evaluation (ev changes nowhere else), so `values` are the final
    # critic's held-out predictions, for the metrics and the oracle alike; None if no step ran
    ev, step, history, values = float("-inf"), 0, [], None
    peak_lrs = [group["lr"] for group in optimizer.param_groups]  # the schedule scales each group's own rate
    average = WeightAverage() if cfg.average_from is not None else None
    with progress(total=cfg.max_steps, desc=desc, unit="step") as bar:
        while step < cfg.max_steps:
            decay = learning_rate(cfg.lr_schedule, step, Schedule(1.0, 0, cfg.max_steps, 0.0))
            for group, peak in zip(optimizer.param_groups, peak_lrs):
                group["lr"] = peak * decay
            critic.train()
            stats = value_step(critic, optimizer, targets.rows(rng.sample(train_idx, min(batch_rows, len(train_idx)))),
                               params, tokenizer.pad_token_id, f"value_pretrain step {step}", world)
            step += 1
            if average is not None and step > cfg.average_from * cfg.max_steps:
                average.add(critic)
            if step % eval_every == 0 or step == cfg.max_steps:
                values = held_out_values()
                ev = explained_variance(values, eval_targets.returns, eval_targets.mask)
                stats["explained_variance"] = ev
            history.append(stats)
            if tracker is not None:
                tracker.log_metrics({f"value_pretrain/{k}": v for k, v in stats.items()}, step=step)
            bar.update(1)
            # before the first evaluation there is no held-out EV to show (ev is the loop's -inf)
            bar.set_postfix(loss=f"{stats['value_loss']:.4f}", **({"ev": f"{ev:.3f}"} if values is not None else {}))
            if ev >= cfg.min_explained_variance:
                break
    averaged = {}
    if average is not None and average.count:  # the averaged critic is the one written, measured and probed
        averaged = {"value/explained_variance_last_step": ev, "value/averaged_steps": average.count}
        average.apply(critic)
    # max_steps 0: the fresh head's held-out EV, not the loop's -inf starting value; averaged: the mean's
    if values is None or averaged:
        values = held_out_values()
        ev = explained_variance(values, eval_targets.returns, eval_targets.mask)
    metrics = {"value/explained_variance": ev, **averaged, **sampled, "value/pretrain_steps": step,
               "value/pretrain_loss_last": history[-1]["value_loss"] if history else float("nan"),
               "value/pretrain_responses": len(response_ids), "value/critic": 1}
    if oracle is not None:
        metrics.update(oracle(eval_rows, eval_targets.returns, values, eval_targets.mask))
    save_critic(critic, tokenizer, optimizer, out_dir, {"round": "r0", **metrics})
    if models is not None:
        models.remember_critic(out_dir, critic, optimizer, params.model.dtype)
    return metrics


# --- the verifier phase (value.pretrain.verifier_steps) ---------------------------------------------------
def near_miss(answer: str, rng: random.Random) -> str:
    """The answer with one digit replaced by another (never a leading zero)."""
    position = rng.randrange(len(answer))
    choices = [d for d in "0123456789" if d != answer[position] and not (position == 0 and d == "0" and len(answer) > 1)]
    return answer[:position] + rng.choice(choices) + answer[position + 1:]


def wrong_steps(numbers: list[int], rng: random.Random) -> str:
    """A step-by-step solution (`rlpipe.data.tasks.reasoning_solution`'s format) whose running sum goes
    wrong at one step, a one-digit near miss; every later step adds correctly to the wrong sum, so the
    marked answer is wrong too: what a policy writes when it slips once."""
    from rlpipe.data.tasks import ANSWER_MARKER, REASONING_STEP_SEPARATOR

    slip = rng.randrange(len(numbers) - 1)
    steps, total = [], numbers[0]
    for step, n in enumerate(numbers[1:]):
        result = total + n if step != slip else int(near_miss(str(total + n), rng))
        steps.append(f"{total}+{n}={result}")
        total = result
    return REASONING_STEP_SEPARATOR.join([*steps, f"{ANSWER_MARKER}{total}"])


def verifier_texts(task: str, prompt: str, answer: str, rng: random.Random) -> list[tuple[str, float]]:
    """(response, reward) pairs for one train prompt, right then wrong. `addition`: its sum, and a near
    miss. `reasoning`: the running sums and the marked answer, and the same with one slip propagated;
    then the marked answer alone, and a near miss of it (the two ways its policy answers)."""
    from rlpipe.data.tasks import ANSWER_MARKER, prompt_operands, reasoning_solution

    if task == "addition":
        return [(answer, 1.0), (near_miss(answer, rng), 0.0)]
    numbers = prompt_operands(prompt)
    return [(reasoning_solution(numbers), 1.0), (wrong_steps(numbers, rng), 0.0),
            (f"{ANSWER_MARKER}{answer}", 1.0), (f"{ANSWER_MARKER}{near_miss(answer, rng)}", 0.0)]


def phase_params(params: Params, lr: float, steps: int, schedule: str) -> Params:
    """`params` for a phase before value pretraining that runs its loop: `steps` steps at `lr` on
    `schedule`, without early stopping, weight averaging or continuation targets (a phase's labels are
    exact, and its last step is what the next phase starts from)."""
    cfg = params.value.pretrain
    return params.model_copy(update={"value": params.value.model_copy(update={
        "lr": lr, "pretrain": cfg.model_copy(update={"max_steps": steps, "min_explained_variance": 1.0,
                                                     "lr_schedule": schedule, "average_from": None,
                                                     "target_continuations": 0})})})


def verifier_rows(params: Params, tokenizer, train_path: Path):
    """(prompt_ids, response_ids, rewards, groups, rights): `value.pretrain.verifier_prompts` train prompts (a
    seeded sample), each with its `verifier_texts` then eos; `rights` holds, for each row, its prompt's right
    texts among them (what `on_track_labels` reads)."""
    from rlpipe.data.prompts import encode_prompts

    table = artifacts.read_parquet(train_path, columns=["prompt", "answer"]).to_pydict()
    rng = random.Random(f"{params.seed}:verifier")
    picked = rng.sample(range(len(table["prompt"])), min(params.value.pretrain.verifier_prompts, len(table["prompt"])))
    encoded = encode_prompts(tokenizer, [table["prompt"][i] for i in picked], params.data)
    prompt_ids, response_ids, rewards, groups, rights = [], [], [], [], []
    for group, (i, ids) in enumerate(zip(picked, encoded)):
        texts = verifier_texts(params.data.task, table["prompt"][i], table["answer"][i], rng)
        right = [text for text, reward in texts if reward == 1.0]
        for text, reward in texts:
            prompt_ids.append(ids)
            response_ids.append(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
            rewards.append(reward)
            groups.append(group)
            rights.append(right)
    return prompt_ids, response_ids, rewards, groups, rights


def pretrain_verifier(params: Params, backbone: Path, train_path: Path, out_dir: Path, device: str = "cpu") -> dict:
    """The verifier phase: value pretraining's own loop (`pretrain_critic`, a quarter of the prompts held
    out) on `verifier_rows`, at `verifier_lr` for `verifier_steps` steps without early stopping, from
    `backbone`; the critic written to `out_dir` already answers "is this sum right" before eos, and value
    pretraining starts from it with its head; each state's target is the row's reward, or with
    `verifier_targets: on_track` its `on_track_labels`. Returns its held-out explained variance and steps."""
    from transformers import AutoTokenizer

    cfg = params.value.pretrain
    phase = phase_params(params, cfg.verifier_lr, cfg.verifier_steps, cfg.verifier_lr_schedule)
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    prompt_ids, response_ids, rewards, groups, rights = verifier_rows(params, tokenizer, train_path)
    labels = None
    if cfg.verifier_targets == "on_track":
        labels = pad_ragged([on_track_labels(right, response, tokenizer) for right, response in zip(rights, response_ids)],
                            0.0, torch.float32)[0]
    # no early stopping here, so the held-out EV is only reported: 20 evaluations in all, not one every
    # `eval_every` steps (on reasoning's 7,000 held-out rows those took two thirds of the phase's time)
    metrics = pretrain_critic(phase, prompt_ids, response_ids, torch.tensor(rewards), groups, backbone, out_dir,
                              eval_every=max(cfg.eval_every, cfg.verifier_steps // 20), state_targets=labels,
                              desc="verifier phase", device=device)
    return {"value/verifier_explained_variance": metrics["value/explained_variance"],
            "value/verifier_steps": metrics["value/pretrain_steps"], "value/verifier_rows": len(response_ids)}


# --- the process phase (value.pretrain.process_steps) -----------------------------------------------------
def on_track_labels(right: list[str], response_ids: list[int], tokenizer) -> list[float]:
    """One label per state of a response (the state before each of its tokens, eos included): 1 while the
    text written so far is the start of one of the `right` responses, 0 from the first token that leaves
    them all (a longer text cannot return to them)."""
    labels: list[float] = []
    for written in range(len(response_ids)):
        if labels and labels[-1] == 0.0:  # off track for good: skip the decoding
            labels.append(0.0)
            continue
        text = tokenizer.decode(response_ids[:written], skip_special_tokens=True)
        labels.append(float(any(r.startswith(text) for r in right)))
    return labels


def pretrain_process(params: Params, prompt_ids: list[list[int]], response_ids: list[list[int]],
                     labels: list[list[float]], groups: list[int], backbone: Path, out_dir: Path,
                     device: str = "cpu") -> dict:
    """The process phase: value pretraining's loop (`pretrain_critic`, a quarter of the groups held out) on
    the responses' state labels (`on_track_labels`, one list per response; the stage's `process_rows`),
    at `process_lr` for `process_steps` steps without early stopping, from `backbone`; value pretraining
    then starts from the critic written to `out_dir`. Returns its held-out explained variance (of the
    labels), steps, rows and the share of states on track."""
    cfg = params.value.pretrain
    phase = phase_params(params, cfg.process_lr, cfg.process_steps, "constant")
    targets = pad_ragged(labels, 0.0, torch.float32)[0]
    metrics = pretrain_critic(phase, prompt_ids, response_ids, None, groups, backbone, out_dir,
                              eval_every=max(cfg.eval_every, cfg.process_steps // 20), state_targets=targets,
                              desc="process phase", device=device)
    states = sum(len(row) for row in labels)
    return {"value/process_explained_variance": metrics["value/explained_variance"],
            "value/process_steps": metrics["value/pretrain_steps"], "value/process_rows": len(response_ids),
            "value/process_on_track_share": sum(sum(row) for row in labels) / states}
