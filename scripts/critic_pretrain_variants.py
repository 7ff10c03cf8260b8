"""Value pretraining variants on one set of samples: which knob makes the critic learn? (issue 19, part 3)

    dvc repro init                                     # in a project whose params.yaml has a critic preset
    python scripts/critic_pretrain_variants.py OUT '{}'
    python scripts/critic_pretrain_variants.py OUT '{"head": "mean", "head_lr": 0.01}'
    python scripts/critic_pretrain_variants.py OUT '{"lr": 0.001, "steps": 1000, "prompts": 2048}'

Draws the samples the `value_pretrain` stage draws from `runs/policy/r0` (kept in OUT/samples-P.pkl, so
every variant of one prompt count fits the same responses), then runs `pretrain_critic` with the
variant's changes and prints the held-out explained variance every `eval_every` steps and, at the end,
the EV on its own training responses (underfitting or not generalising?). Variant keys: `lr` (backbone
and head), `head_lr` (the head alone), `head: mean` (the head zeroed, its bias at the mean return), `steps`,
`prompts`, `schedule` (`value.pretrain.lr_schedule`), `average_from` (`value.pretrain.average_from`),
`target_continuations` (`value.pretrain.target_continuations`; the continuations' means are kept in
OUT/continuations-K-P.pt, the stage's draws), `backbone` (the critic's starting model, as
`value.model.path`; default the init policy), `freeze_layers` (N: the embeddings and the first N decoder
layers stay as the backbone has them; docs/critic.md measured it), `train_fraction` (f: a
seeded share f of the training prompts, the held-out ones unchanged), `draw` (n: the n-th other draw of
value pretraining's minibatches, the same samples, split and start; 0 is the stage's), `eval_every` (steps
between held-out evaluations, default the stage's `value.pretrain.eval_every`; more prompts hold
out more rows to evaluate).
Early stopping is off. The critic is written to OUT/critic-<n>; nothing under runs/ changes.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import torch

from rlpipe import paths
from rlpipe.config import load_params


def cached_samples(params, cache: Path):
    """(prompt_ids, response_ids, rewards, group of each row): the value_pretrain stage's samples."""
    if cache.is_file():
        return pickle.loads(cache.read_bytes())
    from rlpipe.models.store import ModelStore
    from rlpipe.rollout import rollout_backend
    from rlpipe.stages.value_pretrain import pretraining_samples

    samples = pretraining_samples(params, rollout_backend(ModelStore(), paths.policy_dir("r0"), params.rollout,
                                                          params.model.dtype))
    rows = (samples.prompt_ids, samples.response_ids, samples.rewards, samples.groups)
    cache.write_bytes(pickle.dumps(rows))
    return rows


def cached_continuation_means(params, samples, cache: Path):
    """`continuation_means(rows)` for `pretrain_critic`, as the value_pretrain stage builds it (the same
    stream, so the same draws), its result kept in `cache` for the next variant of these samples."""
    def means(rows):
        if cache.is_file():
            return torch.load(cache)
        from rlpipe.models.store import ModelStore
        from rlpipe.rollout import rollout_backend
        from rlpipe.rollout.oracle import continuation_means
        from rlpipe.stages.value_pretrain import MC_TARGETS_STREAM, pretraining_prompts

        prompt_ids, response_ids, _, groups = samples
        prompts = pretraining_prompts(params, params.value.pretrain.prompts)
        backend = rollout_backend(ModelStore(), paths.policy_dir("r0"), params.rollout, params.model.dtype)
        values = continuation_means(params, backend, [prompt_ids[i] for i in rows], [response_ids[i] for i in rows],
                                    [prompts["answer"][groups[i]] for i in rows],
                                    [prompts["meta"][groups[i]] for i in rows],
                                    params.value.pretrain.target_continuations, MC_TARGETS_STREAM)[0]
        torch.save(values, cache)
        return values

    return means


def training_subset(seed: int, samples, fraction: float):
    """`samples` without a seeded share (1 - fraction) of the training groups, and per kept row its index in
    `samples`. The held-out groups and the group numbering stay (the last group is never dropped), so
    value pretraining holds out the same responses and its held-out EV is measured on them as before."""
    import random

    from rlpipe.train.critic import held_out_groups

    groups = samples[3]
    n_groups = max(groups) + 1
    droppable = sorted(set(groups) - held_out_groups(seed, n_groups) - {n_groups - 1})
    dropped = set(random.Random(f"{seed}:train_fraction").sample(droppable, round((1 - fraction) * len(droppable))))
    keep = [i for i, g in enumerate(groups) if g not in dropped]
    return tuple([column[i] for i in keep] for column in samples), keep


def subset_means(means_of_all, all_samples, seed: int, keep: list[int]):
    """`continuation_means` for the rows of a training subset, read from those of all the training rows
    (the cache holds the stage's draws for them), each trimmed to the subset's longest response."""
    from rlpipe.train.critic import split_rows

    all_train = split_rows(seed, all_samples[3])[0]
    position = {row: k for k, row in enumerate(all_train)}

    def means(rows):
        full = means_of_all(all_train)
        width = max(len(all_samples[1][keep[r]]) for r in rows)
        return full[[position[keep[r]] for r in rows], :width]

    return means


def frozen_parameters(critic, layers: int) -> list:
    """The embeddings and the first `layers` decoder layers, left out of the optimizer: what a verifier
    learned there stays as it was (0: nothing frozen)."""
    if not layers:
        return []
    backbone = critic.model
    return [*backbone.embed_tokens.parameters(), *(p for layer in backbone.layers[:layers] for p in layer.parameters())]


def drawn_random(draw: int):
    """`random` as `rlpipe.train.critic` sees it, with value pretraining's minibatch stream drawn again
    (`draw` > 0); every other stream (the held-out split, the verifier's rows) stays the stage's."""
    import random
    import types

    class Random(random.Random):
        def __init__(self, key):
            super().__init__(f"{key}:draw{draw}" if draw and str(key).endswith(":value_pretrain") else key)

    return types.SimpleNamespace(Random=Random)


def main(out: Path, variant: dict) -> None:
    import rlpipe.train.critic as critic_training
    from rlpipe.models.sequences import pad_ragged

    params = load_params()
    pretrain = params.value.pretrain.model_copy(update={"max_steps": variant.get("steps", params.value.pretrain.max_steps),
                                                        "prompts": variant.get("prompts", params.value.pretrain.prompts),
                                                        "min_explained_variance": 1.0,
                                                        "lr_schedule": variant.get("schedule", params.value.pretrain.lr_schedule),
                                                        "average_from": variant.get("average_from", params.value.pretrain.average_from),
                                                        "target_continuations": variant.get("target_continuations", 0)})
    params = params.model_copy(update={"value": params.value.model_copy(update={
        "lr": variant.get("lr", params.value.lr), "pretrain": pretrain})})
    out.mkdir(parents=True, exist_ok=True)
    all_samples = cached_samples(params, out / f"samples-{pretrain.prompts}.pkl")
    means = cached_continuation_means(params, all_samples,
                                      out / f"continuations-{pretrain.target_continuations}-{pretrain.prompts}.pt")
    samples = all_samples
    if variant.get("train_fraction", 1) < 1:
        samples, keep = training_subset(params.seed, all_samples, variant["train_fraction"])
        means = subset_means(means, all_samples, params.seed, keep)
    prompt_ids, response_ids, rewards, groups = samples
    print(f"{len(response_ids)} responses, mean reward {sum(rewards) / len(rewards):.3f}", flush=True)

    load_critic, explained_variance = critic_training.load_critic, critic_training.explained_variance

    def load_with_head(path, dtype, from_policy=False):
        critic, tokenizer = load_critic(path, dtype, from_policy)
        if variant.get("head") == "mean":  # V starts at the mean return everywhere
            torch.nn.init.zeros_(critic.score.weight)
            torch.nn.init.constant_(critic.score.bias, sum(rewards) / len(rewards))
        return critic, tokenizer

    def two_rates(critic, params, state_path):
        head = {id(p) for p in critic.score.parameters()}
        frozen = {id(p) for p in frozen_parameters(critic, variant.get("freeze_layers", 0))}
        return torch.optim.AdamW([
            {"params": [p for p in critic.parameters() if id(p) not in head | frozen], "lr": params.value.lr},
            {"params": list(critic.score.parameters()), "lr": variant.get("head_lr", params.value.lr)}],
            # torch's default, with which every figure in docs/critic.md was made; the stage's optimizer
            # (`make_critic_optimizer`) has none. At lr 3e-4 it shrinks the weights by 0.2% over 600 steps.
            weight_decay=0.01)

    curve: list[float] = []

    def recorded(*args):
        curve.append(round(explained_variance(*args), 3))
        return curve[-1]

    critic_training.load_critic, critic_training.make_critic_optimizer = load_with_head, two_rates
    critic_training.explained_variance = recorded
    critic_training.random = drawn_random(variant.get("draw", 0))
    torch.manual_seed(params.seed)
    critic_dir = out / f"critic-{len(list(out.glob('critic-*')))}"
    eval_every = variant.get("eval_every", params.value.pretrain.eval_every)
    started = time.perf_counter()
    metrics = critic_training.pretrain_critic(params, prompt_ids, response_ids, torch.tensor(rewards), groups,
                                              Path(variant.get("backbone", paths.policy_dir("r0"))), critic_dir,
                                              continuation_means=means, eval_every=eval_every)
    print(f"{json.dumps(variant)}: held-out EV {metrics['value/explained_variance']:.4f} after {metrics['value/pretrain_steps']} "
          f"steps ({time.perf_counter() - started:.0f} s); every {eval_every} steps {curve}", flush=True)
    if "value/averaged_steps" in metrics:
        print(f"that is the mean of its last {metrics['value/averaged_steps']} steps' weights; the last step's own: "
              f"{metrics['value/explained_variance_last_step']:.4f}", flush=True)

    critic, tokenizer = load_critic(critic_dir)
    mask = pad_ragged(response_ids, 0, torch.long)[1]
    returns = critic_training.monte_carlo_returns(torch.tensor(rewards), mask, params.algorithm.resolve().gamma)
    targets = critic_training.ValueTargets(prompt_ids, response_ids, returns, None, mask)
    train = targets.rows(critic_training.split_rows(params.seed, groups)[0])
    values = critic_training.predict(critic, train, params, tokenizer.pad_token_id)
    print(f"EV on its own training responses {explained_variance(values, train.returns, train.mask):.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
