"""Reward scoring: verify every rollout, place step rewards on token indices, compute shaping terms.

Torch- and transformers-free: the reward stage loads only pyarrow and, for multi-step verifiers, the
Rust `tokenizers` library to map the steps' character offsets onto response tokens.
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

from rlpipe import artifacts
from rlpipe.registry import Registry
from rlpipe.config import Params
from rlpipe.progress import progress
from rlpipe.rewards import verifiers
from rlpipe.rewards.shaping import overlong_penalty

VERIFIERS = Registry("verifier")
VERIFIERS.register("exact_match")(verifiers.exact_match)
VERIFIERS.register("chain_steps")(verifiers.chain_steps)


@VERIFIERS.register("math")
def _math(completions, answers, metas):
    from rlpipe.rewards.math import math_verify_batch

    return math_verify_batch(completions, answers, metas)


SCORING_CHUNK = 4096


def token_char_ends(tokenizer, response_ids: list[int]) -> list[int]:
    """For each response token, the index one past its last character in the decoded text."""
    pieces = [tokenizer.decode([token], skip_special_tokens=True) for token in response_ids]
    return list(accumulate(len(p) for p in pieces))


def char_to_token(char_ends: list[int], char_index: int) -> int:
    """The token that holds character `char_index` (the last token if the text is shorter)."""
    for t, end in enumerate(char_ends):
        if char_index < end:
            return t
    return len(char_ends) - 1


def place_steps(verdict: verifiers.Verdict, response_ids: list[int], tokenizer) -> tuple[list[int], list[float]]:
    """(step_ends, step_rewards) on token indices. The last step always ends at the last token, so
    that eos belongs to it; a verdict without steps is one step holding the outcome reward."""
    last = len(response_ids) - 1
    if not verdict.step_char_ends or last < 0:
        return [max(last, 0)], [verdict.reward]
    char_ends = token_char_ends(tokenizer, response_ids)
    ends = [char_to_token(char_ends, c) for c in verdict.step_char_ends]
    ends[-1] = last
    return ends, list(verdict.step_rewards)


def _load_step_tokenizer(tokenizer_path: Path):
    from tokenizers import Tokenizer

    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"{tokenizer_path}: the step verifier needs the policy's tokenizer.json to map steps onto tokens")
    return Tokenizer.from_file(str(tokenizer_path))


def score_rollouts(params: Params, rollouts_path: Path, tokenizer_path: Path, out_path: Path) -> dict:
    table = artifacts.read_round_table(rollouts_path, artifacts.ROLLOUTS, params.rollout.samples_per_prompt,
                                       int(params.algorithm.resolve().greedy_baseline))
    columns = artifacts.Columns.of(table)
    name = params.resolved_verifier()
    verify = VERIFIERS.get(name)
    completions, answers, metas = columns["response_text"], columns["answer"], columns["meta"]
    verdicts: list[verifiers.Verdict] = []
    with progress(total=len(completions), desc=f"score ({name})", unit="resp") as bar:
        for start in range(0, len(completions), SCORING_CHUNK):
            chunk = slice(start, start + SCORING_CHUNK)
            verdicts += verify(completions[chunk], answers[chunk], metas[chunk])
            bar.update(len(completions[chunk]))
    step_tokenizer = _load_step_tokenizer(tokenizer_path) if any(v.step_char_ends for v in verdicts) else None
    steps = [place_steps(v, ids, step_tokenizer) for v, ids in zip(verdicts, columns["response_ids"])]
    if params.reward.process_model is not None:
        from rlpipe.rewards.process_model import ModelStepScorer

        scored = ModelStepScorer(params.reward.process_model).score(
            columns["prompt_ids"], columns["response_ids"], [ends for ends, _ in steps])
        steps = [(ends, rewards) for (ends, _), rewards in zip(steps, scored)]
    max_new, cache = params.rollout.max_new_tokens, params.reward.overlong_cache_len
    out = {
        **columns.data,
        "reward": [v.reward for v in verdicts],
        "correct": [v.correct for v in verdicts],
        "overlong_penalty": [overlong_penalty(len(ids), max_new, cache) for ids in columns["response_ids"]],
        "step_ends": [s[0] for s in steps],
        "step_rewards": [s[1] for s in steps],
    }
    artifacts.write_table(out_path, out, artifacts.REWARDS)
    return reward_metrics(out)


def reward_metrics(columns: dict) -> dict:
    """Metrics of the sampled responses (ReMax's greedy baselines excluded)."""
    sampled = [i for i, greedy in enumerate(columns["is_greedy"]) if not greedy]
    rewards = [columns["reward"][i] for i in sampled]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    metrics = {
        "reward/mean": mean,
        "reward/std": std,
        "reward/accuracy": sum(columns["correct"][i] for i in sampled) / len(sampled),
        "reward/overlong_penalty_mean": sum(columns["overlong_penalty"][i] for i in sampled) / len(sampled),
        "reward/steps_mean": sum(len(columns["step_ends"][i]) for i in sampled) / len(sampled),
    }
    greedy = [i for i, g in enumerate(columns["is_greedy"]) if g]
    if greedy:
        metrics["reward/greedy_accuracy"] = sum(columns["correct"][i] for i in greedy) / len(greedy)
    return metrics
