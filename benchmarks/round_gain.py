"""Benchmark e's companion on learning, not time: from the same warm start, is an rlpipe round worth as much
pass@1 as a TRL round? Over several batch draws, so that one draw's luck is not read as a difference.

Benchmark e gives each side one run per seed. From a warm start 2-3 rounds from its target, which side
gets there a round sooner is then mostly which batches it happened to draw: one round's gain in greedy
pass@1 varies by about 0.03 between draws from the same policy. Here each side trains from one warm start
(`dvc repro init` of benchmark e's scratch project for `--seed`) `--draws` times, each draw with its own
batches, for at most `--rounds` rounds, stopping at `--target`:
- rlpipe: the round stages (rollout, reward, advantage, update) run in this process by `rlpipe.runner.execute`,
  the functions the warm worker runs, with one `ModelStore` across the draw's rounds, and `seed` set to
  the draw (it picks the round's prompts, its sampling uniforms and the minibatch order). DVC is left out:
  what is measured is what a round learns, and benchmark e times the pipeline;
- TRL: `GRPOTrainer` as benchmark e runs it (`trl_rounds`), with `seed` set to the draw; its weights are
  scored in an fp32 copy, as benchmark e scores them (`WeightsScorer`).

Both are scored after each round by rlpipe's evaluator (greedy pass@1 on the test prompts). The report per
side: pass@1 after each round, mean and standard error over all draws (a draw that stopped at the target
counts with its last value); the draws' rounds to the target; and the difference of the round-1 means
with its standard error.

`python -m benchmarks.round_gain --work DIR [--seed 0] [--draws 6] [--rounds 4] [--target 0.6] [--set
SECTION.KEY=VALUE ...]` (`--set`: rlpipe's side only, e.g. `update.minibatch_mix=rows`); each
draw's curve is kept in the seed's project, DIR/seedS, so a run cut short resumes at the next draw. Needs the `bench` extra (trl).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

from benchmarks.common import table


def with_settings(params, settings: dict[str, object]):
    """params with `{"section.key": value}` set, validated again (a bad key or value names itself)."""
    raw = params.model_dump()
    for dotted, value in settings.items():
        *sections, key = dotted.split(".")
        node = raw
        for section in sections:
            node = node[section]
        node[key] = value
    return type(params).model_validate(raw)


def ours_curve(root: Path, params, evaluator, draw: int, rounds: int, target: float) -> list[float]:
    """pass@1 after each of rlpipe's rounds for one draw (`seed` = draw; params as given, `--set` applied),
    the stages run in this process."""
    from benchmarks.wall_to_target import greedy_pass_at_1
    from rlpipe import paths
    from rlpipe.models.policy import load_policy
    from rlpipe.models.store import ModelStore
    from rlpipe.runner import execute

    drawn = with_settings(params, {"seed": draw})
    store, curve = ModelStore(), []
    here = os.getcwd()
    os.chdir(root)  # the stages' paths are relative to the project
    try:
        execute("value_pretrain", drawn, models=store)  # grpo: the no-critic marker the update reads
        for k in range(1, rounds + 1):
            for stage in ("rollout", "reward", "advantage", "update"):
                execute(stage, drawn, f"r{k}", models=store)
            curve.append(greedy_pass_at_1(evaluator, *load_policy(root / paths.policy_dir(f"r{k}"), params.model.dtype)))
            if curve[-1] >= target:
                break
    finally:
        os.chdir(here)
    return curve


def trl_curve(root: Path, params, evaluator, draw: int, rounds: int, target: float) -> list[float]:
    """pass@1 after each of TRL's rounds for one draw (`seed` = draw)."""
    from benchmarks.wall_to_target import WeightsScorer, trl_rounds
    from rlpipe import paths

    scorer, curve = WeightsScorer(evaluator, root / paths.policy_dir("r0")), []

    def score(k: int, model, tokenizer) -> bool:
        curve.append(scorer(model))
        return curve[-1] >= target

    trl_rounds(root, params, rounds, score, seed=draw)
    return curve


SIDES = {"rlpipe": ours_curve, "TRL": trl_curve}


def draw_curve(root: Path, params, evaluator, side: str, draw: int, rounds: int, target: float,
               label: str = "") -> list[float]:
    """One draw's curve, kept in the seed's project (`label` names rlpipe's settings): a run cut short
    resumes at the first draw without one."""
    saved = root / f"round-gain-{side}{label.replace(' ', '+')}-draw{draw}-rounds{rounds}-target{target}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    curve = SIDES[side](root, params, evaluator, draw, rounds, target)
    saved.write_text(json.dumps(curve))
    print(f"  {side}{label} draw {draw}: " + " ".join(f"{p:.3f}" for p in curve), flush=True)
    return curve


def mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def report(curves: dict[str, list[list[float]]], start: float, rounds: int, target: float, seed: int) -> str:
    rows = []
    for side, side_curves in curves.items():
        cells = []
        for k in range(rounds):
            # a draw that stopped at the target before round k+1 counts with its last pass@1 (it is done)
            values = [c[min(k, len(c) - 1)] for c in side_curves]
            mean, se = mean_se(values)
            cells.append(f"{mean:.3f} +- {se:.3f}")
        hits = [next((k + 1 for k, p in enumerate(c) if p >= target), None) for c in side_curves]
        reached = [h for h in hits if h is not None]
        rows.append([side, len(side_curves), *cells, " ".join(str(h) if h else "-" for h in hits),
                     f"{statistics.fmean(reached):.2f} ({len(reached)} of {len(hits)})" if reached else "-"])
    text = table(f"round gain: pass@1 after each round from seed {seed}'s warm start ({start:.3f}), mean +- "
                 f"standard error over draws (a draw stopped at {target} keeps its last value)",
                 ["side", "draws", *[f"r{k + 1}" for k in range(rounds)], f"rounds to {target} per draw",
                  "mean rounds (draws that reached it)"], rows)
    (m1, s1), (m2, s2) = (mean_se([c[0] for c in curves[side]]) for side in ("rlpipe", "TRL"))
    text += (f"\nround 1, rlpipe minus TRL: {m1 - m2:+.3f} +- {math.hypot(s1, s2):.3f} (standard error of the "
             f"difference; gains from the warm start {m1 - start:+.3f} and {m2 - start:+.3f})\n")
    return text


def run(work: Path, seed: int = 0, draws: int = 6, rounds: int = 4, target: float = 0.6,
        settings: dict[str, object] | None = None) -> str:
    import torch

    from benchmarks.wall_to_target import dvc_repro, greedy_pass_at_1, scratch_project
    from rlpipe import paths
    from rlpipe.config import load_params
    from rlpipe.models.policy import load_policy
    from rlpipe.stages.evaluate import Evaluator

    torch.set_num_threads(2)
    work.mkdir(parents=True, exist_ok=True)
    root = work / f"seed{seed}"
    if not (root / paths.policy_dir("r0")).is_dir():
        root = scratch_project(root, rounds, seed)
        dvc_repro(root, "init")  # the warm start both sides train from
    params = load_params(root / "params.yaml")
    evaluator = Evaluator(params, root / paths.TEST)
    settings = settings or {}
    ours = with_settings(params, settings)  # rlpipe's side only: TRL's runs benchmark e's configuration
    label = "".join(f" {k}={v}" for k, v in sorted(settings.items()))
    start = greedy_pass_at_1(evaluator, *load_policy(root / paths.policy_dir("r0"), params.model.dtype))
    print(f"  seed {seed}: warm start pass@1 {start:.3f}", flush=True)
    curves = {side: [draw_curve(root, ours if side == "rlpipe" else params, evaluator, side, d, rounds, target,
                                label if side == "rlpipe" else "") for d in range(draws)]
              for side in SIDES}
    return report(curves, start, rounds, target, seed) + (f"rlpipe's side ran with{label}\n" if label else "")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory, kept (each draw's curve)")
    parser.add_argument("--seed", type=int, default=0, help="the warm start: benchmark e's project for this seed")
    parser.add_argument("--draws", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4, help="the most rounds a draw runs")
    parser.add_argument("--target", type=float, default=0.6, help="a draw stops at the first round at or above it")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a params.yaml key for rlpipe's side only (a YAML value), e.g. update.minibatch_mix=rows")
    ns = parser.parse_args()
    import yaml

    pairs = [item.partition("=") for item in ns.set]
    if any(not eq for _, eq, _ in pairs):
        parser.error("--set takes SECTION.KEY=VALUE")
    print(run(ns.work, ns.seed, ns.draws, ns.rounds, ns.target, {k: yaml.safe_load(v) for k, _, v in pairs}))
