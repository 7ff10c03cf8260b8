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


def warm_start_check(params: Params, model, tokenizer, train: dict[str, list]):
    """(the train rows SFT may draw, the check): `model.warm_start.check_prompts` rows (a seeded sample)
    are left out of SFT, and the check is the model's greedy pass@1 on them, decoded and verified as
    evaluation decodes and verifies the test split."""
    from rlpipe.rollout.hf import HFBackend
    from rlpipe.stages.evaluate import Evaluator

    count, wanted = len(train["prompt"]), params.model.warm_start.check_prompts
    held = sorted(random.Random(f"{params.seed}:warm_start_check").sample(range(count), min(wanted, count - 1)))
    evaluator = Evaluator.of_prompts(params, {name: [column[i] for i in held] for name, column in train.items()})
    backend = HFBackend(model, tokenizer, params.rollout.batch_size)
    held_out = set(held)
    sft_rows = [i for i in range(count) if i not in held_out]
    return sft_rows, lambda: evaluator.greedy_pass_at_1(backend, "warm start check")


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
        sft_rows, check = list(range(len(targets))), None
        if params.model.warm_start.target_pass_at_1 is not None:
            sft_rows, check = warm_start_check(params, model, tokenizer, train)
        log = warm_start(model, tokenizer, [train["prompt"][i] for i in sft_rows], [targets[i] for i in sft_rows],
                         params.model.warm_start, params.seed, check)
        if log.losses:
            metrics["init/sft_loss_first"], metrics["init/sft_loss_last"] = log.losses[0], log.losses[-1]
        metrics["init/sft_steps"] = len(log.losses)
        if log.checks:
            metrics["init/sft_check_pass_at_1"] = log.checks[-1][1]
    else:
        model, tokenizer = load_policy(params.model.path, params.model.dtype)
    metrics["init/parameters"] = sum(p.numel() for p in model.parameters())
    with stage_output_directory(out_dir) as tmp:
        save_policy(model, tokenizer, tmp)
        (tmp / paths.TRAINER_STATE).write_text(json.dumps({"round": "r0", "global_step": 0}) + "\n")
    if models is not None:
        models.remember_policy(out_dir, model, dtype=params.model.dtype)
    return metrics

