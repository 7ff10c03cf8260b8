"""reward@rK: verify every rollout; step rewards on token indices; the overlong penalty.

Needs neither torch nor transformers. Multi-step verdicts are placed on tokens with the policy's
tokenizer.json; a process reward model, when configured, rescores each step. Writes the `rewards` table.
"""

from __future__ import annotations

from rlpipe import artifacts, paths
from rlpipe.rewards import verify
from rlpipe.rewards.shaping import overlong_penalty
from rlpipe.rewards.steps import load_step_tokenizer, place_steps


def reward(ctx) -> dict:
    params, round_name = ctx.params, ctx.round_name
    table = artifacts.read_round_table(paths.rollouts_path(round_name), artifacts.ROLLOUTS,
                                       params.rollout.samples_per_prompt, int(params.algorithm.resolve().greedy_baseline))
    columns = artifacts.Columns.of(table)
    verdicts = verify(params.resolved_verifier(), columns["response_text"], columns["answer"], columns["meta"])
    tokenizer_path = paths.policy_dir("r0") / "tokenizer.json"
    step_tokenizer = load_step_tokenizer(tokenizer_path) if any(v.step_char_ends for v in verdicts) else None
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
    artifacts.write_table(paths.rewards_path(round_name), out, artifacts.REWARDS)
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
    for name, right in (("correct", True), ("incorrect", False)):  # does reasoning at length pay?
        lengths = [len(columns["response_ids"][i]) for i in sampled if columns["correct"][i] == right]
        if lengths:
            metrics[f"reward/length_{name}_mean"] = sum(lengths) / len(lengths)
    greedy = [i for i, g in enumerate(columns["is_greedy"]) if g]
    if greedy:
        metrics["reward/greedy_accuracy"] = sum(columns["correct"][i] for i in greedy) / len(greedy)
    return metrics
