"""init: the round-0 policy (and reference), as a `save_pretrained` directory with its tokenizer.

`model.path: null` builds the embedded tiny Llama and its character tokenizer locally and warm-starts
it by SFT on the train split; any other path (local directory or hub name) is loaded and saved as is.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlpipe import paths
from rlpipe.dvc_state import stage_output_directory
from rlpipe.config import Params
from rlpipe.data.tasks import target_text, task_alphabet


def init(ctx) -> dict:
    ctx.init_torch()
    return init_policy(ctx.params, paths.TRAIN, paths.policy_dir("r0"), ctx.models)


def step_targets(count: int, fraction: float, seed: int) -> list[bool]:
    """Which of `count` train prompts get a step-by-step warm-start target (`reasoning`): a seeded
    round(fraction * count) of them, one fixed choice per prompt (SFT draws prompts with replacement)."""
    chosen = set(random.Random(f"{seed}:step_targets").sample(range(count), round(fraction * count)))
    return [i in chosen for i in range(count)]


def init_policy(params: Params, train_path: Path, out_dir: Path, models=None) -> dict:
    """Build (and warm-start) or load the round-0 policy and write it to `out_dir`; `models` (a
    ModelStore) then holds it, for the stages that read it next."""
    from rlpipe.models.policy import build_tiny_model, load_policy, save_policy

    metrics: dict[str, float] = {}
    if params.model.path is None:
        from rlpipe.data.splits import read_prompts
        from rlpipe.models.tokenizer import build_char_tokenizer
        from rlpipe.train.sft import warm_start

        tokenizer = build_char_tokenizer(task_alphabet(params.data.task))
        model = build_tiny_model(params.model.tiny, tokenizer, params.seed)
        train = read_prompts(train_path).to_pydict()
        with_steps = step_targets(len(train["prompt"]), params.data.step_target_fraction, params.seed)
        targets = [target_text(a, m, params.data.task, steps)
                   for a, m, steps in zip(train["answer"], train["meta"], with_steps)]
        losses = warm_start(model, tokenizer, train["prompt"], targets, params.model.warm_start, params.seed)
        if losses:
            metrics["init/sft_loss_first"], metrics["init/sft_loss_last"] = losses[0], losses[-1]
    else:
        model, tokenizer = load_policy(params.model.path, params.model.dtype)
    metrics["init/parameters"] = sum(p.numel() for p in model.parameters())
    with stage_output_directory(out_dir) as tmp:
        save_policy(model, tokenizer, tmp)
        (tmp / paths.TRAINER_STATE).write_text(json.dumps({"round": "r0", "global_step": 0}) + "\n")
    if models is not None:
        models.remember_policy(out_dir, model, dtype=params.model.dtype)
    return metrics

