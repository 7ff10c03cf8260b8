"""(e) Wall seconds from the same warm start to a greedy pass@1 target on the embedded task, against
TRL's GRPOTrainer end to end (generation, reward, reference and old log-probs, update).

For each seed, both sides start from the same `runs/policy/r0` (that seed's SFT warm start, built by
`dvc repro init` in a scratch project and not timed) and train on the same train split with the
schedule of params.yaml: per "round" `rollout.prompts_per_round` prompts x 8 samples, in optimizer steps
of `update.minibatch_prompts` prompts (TRL's `steps_per_generation`), AdamW at the same lr, the grpo loss
(k3 KL in the loss, beta 0.04, clip 0.2, seq-mean-token-mean), T = 1, at most 6 new tokens, and bf16
autocast in the update and in generation: TRL's default (`bf16=True`, on CPU too), so rlpipe gets
`update.bf16` and `rollout.bf16` (the latter since 2026-12-05, evening). One round
of difference is a large share of the time, so the figure is the ratio of the medians over 3 seeds.

- rlpipe: the real pipeline, one `dvc repro rounds/rN/dvc.yaml:update` in the scratch project (DVC and
  its stage processes, and the warm worker behind them), with value_pretrain's marker counted too; all
  of it is frozen (SIGSTOP) while a round is scored.
- TRL: a script as a TRL user runs it, in its own process (`python -m benchmarks.wall_to_target
  --trl-side ...`): it imports trl, builds `GRPOTrainer` (which loads the policy and the reference model)
  and calls `train()`; `steps_per_generation` gives it the same generations as a round.

Both sides are timed from the launch of their command, interpreter start and imports included, as a user
waits for them: `dvc repro` imports DVC, and its worker torch and transformers; the TRL script imports trl,
datasets, transformers and torch. TRL's time from building its trainer on (its imports left out, the
figure this benchmark gave before 2026-12-05) is reported beside it.

After every round, each side's policy is scored with rlpipe's own evaluator (greedy pass@1 on the first
`eval.max_prompts` test prompts, the figure `dvc repro` reports), TRL's weights in an fp32 copy as rlpipe's
checkpoint is loaded (`WeightsScorer`); the clock is paused meanwhile. The
figure is ours / TRL's wall seconds to the first round at or above the target. Target: <= 0.5x.
Needs the `bench` extra (trl). Takes about 10 minutes on 2 cores; with `--work DIR`, each seed's result is
kept there, and a run cut short resumes at the next seed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import table

def steps_per_round(params) -> int:
    """Optimizer steps per round: the round's prompts in minibatches (TRL's steps_per_generation)."""
    return params.rollout.prompts_per_round // params.update.minibatch_prompts


def scratch_project(root: Path, rounds: int, seed: int) -> Path:
    """The pipeline with the embedded params, `rounds` rounds, this seed, tracking off (TRL's side reports
    nowhere either), and TRL's precision under its default `bf16=True`: bf16 autocast in the update and in
    generation (accelerate wraps the policy's forward, which TRL's `generate` calls)."""
    from rlpipe.scratch_project import CHECKOUT, copy_pipeline

    shutil.rmtree(root, ignore_errors=True)  # a seed cut short starts over
    raw = yaml.safe_load((CHECKOUT / "params.yaml").read_text())
    raw["tracking"]["enabled"] = False
    raw["update"]["bf16"] = True
    raw["rollout"]["bf16"] = True
    raw["rounds"] = rounds
    raw["seed"] = seed
    return copy_pipeline(root, yaml.safe_dump(raw, sort_keys=False), committer="rlpipe-bench")


def dvc_repro(root: Path, target: str) -> None:
    from rlpipe.scratch_project import scratch_env

    out = subprocess.run(["dvc", "repro", target], cwd=root, env=scratch_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"dvc repro {target} failed in {root}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


class Clock:
    """Wall seconds with pauses: evaluation is not part of either side's time. `time.monotonic` is one
    system-wide clock on Linux (CLOCK_MONOTONIC), so a child process can go on timing from its parent's
    launch of it."""

    def __init__(self, start: float | None = None):
        self.start, self.paused = time.monotonic() if start is None else start, 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start - self.paused

    def pause(self, fn):
        began = time.monotonic()
        try:
            return fn()
        finally:
            self.paused += time.monotonic() - began


class WeightsScorer:
    """Greedy pass@1 of a training model's current weights, scored in a copy of the warm start loaded as
    rlpipe loads a checkpoint (`model.dtype`), so that both sides are scored alike: under TRL's `bf16=True`,
    accelerate wraps the training model's forward in bf16 autocast, which scoring it in place would keep
    (greedy decoding in bf16 moved pass@1 by up to 0.006 on the rounds checked)."""

    def __init__(self, evaluator, warm_start: Path):
        from rlpipe.models.policy import load_policy

        self.evaluator = evaluator
        self.model, self.tokenizer = load_policy(warm_start, evaluator.params.model.dtype)

    def __call__(self, model) -> float:
        self.model.load_state_dict(model.state_dict())
        return greedy_pass_at_1(self.evaluator, self.model, self.tokenizer)


def greedy_pass_at_1(evaluator, model, tokenizer) -> float:
    from rlpipe.rollout.hf import HFBackend

    was_training = model.training
    model.eval()
    try:
        return evaluator.greedy_pass_at_1(HFBackend(model, tokenizer, evaluator.params.rollout.batch_size), "checkpoint")
    finally:
        model.train(was_training)


def run_ours(root: Path, params, evaluator, target: float, max_rounds: int) -> list[tuple[int, float, float]]:
    """One `dvc repro update@rN`, as a user runs the pipeline. Round K is done when its update stage has
    written its metrics file (its last act); the pipeline is then frozen (SIGSTOP to its process group)
    while the parent scores the new checkpoint, with the clock paused, and resumed after."""
    from rlpipe import paths
    from rlpipe.models.policy import load_policy
    from rlpipe.scratch_project import scratch_env
    from rlpipe.worker.client import signal_workers

    curve, clock = [], Clock()
    log = open(root / "bench-dvc-repro.log", "w")
    repro = subprocess.Popen(["dvc", "repro", f"rounds/r{max_rounds}/dvc.yaml:update"], cwd=root, env=scratch_env(),
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def pause(sig: int) -> None:
        """The whole pipeline: dvc and its stage processes, and the warm worker (its own session)."""
        os.killpg(repro.pid, sig)
        signal_workers(root, sig)

    def score(k: int) -> float:
        pause(signal.SIGSTOP)
        try:
            return greedy_pass_at_1(evaluator, *load_policy(root / paths.policy_dir(f"r{k}"), params.model.dtype))
        finally:
            pause(signal.SIGCONT)

    try:
        for k in range(1, max_rounds + 1):
            while not (root / paths.stage_metrics_path("update", f"r{k}")).exists():
                if repro.poll() is not None:
                    raise RuntimeError(f"dvc repro stopped (exit {repro.returncode}) before update@r{k}; "
                                       f"see {root / 'bench-dvc-repro.log'}")
                time.sleep(0.05)
            seconds = clock.elapsed()
            curve.append((k, seconds, clock.pause(lambda: score(k))))
            print(f"  rlpipe r{k}: {seconds:.0f} s, pass@1 {curve[-1][2]:.3f}", flush=True)
            if curve[-1][2] >= target:
                break
    finally:
        if repro.poll() is None:  # target reached before the last round: stop the rest of the pipeline
            os.killpg(repro.pid, signal.SIGTERM)
            repro.wait()
        log.close()
    return curve


def run_trl(root: Path, target: float, max_rounds: int) -> dict:
    """TRL's side in its own process, timed from its launch: {"curve": [(round, seconds, pass@1)],
    "imports_seconds": launch to the start of building the trainer}."""
    import json
    import sys

    out = root / "bench-trl.json"
    out.unlink(missing_ok=True)
    launched_at = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "benchmarks.wall_to_target", "--trl-side", str(root),
                           "--launched-at", repr(launched_at), "--target", str(target), "--max-rounds", str(max_rounds)],
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"TRL's side failed (exit {done.returncode}) in {root}")
    return json.loads(out.read_text())


def trl_side(root: Path, launched_at: float, target: float, max_rounds: int) -> None:
    """The TRL user's script, run by `run_trl` as its own process: what it imports and builds is timed from
    the launch; rlpipe's evaluator (built here, scoring each round) is not."""
    clock = Clock(launched_at)
    import json

    # What the script imports, timed (`trl_rounds` then uses it): trl and transformers import lazily, so
    # naming the classes runs the real imports (torch's too), before rlpipe's evaluator is built with the
    # clock paused
    import pyarrow.parquet  # noqa: F401
    from datasets import Dataset  # noqa: F401
    from transformers import AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import GRPOTrainer  # noqa: F401

    from rlpipe import paths

    imports_seconds = clock.elapsed()

    def scoring_tools():
        import torch

        from rlpipe.config import load_params
        from rlpipe.stages.evaluate import Evaluator

        torch.set_num_threads(2)
        params = load_params(root / "params.yaml")
        return params, WeightsScorer(Evaluator(params, root / paths.TEST), root / paths.policy_dir("r0"))

    params, scorer = clock.pause(scoring_tools)
    curve = []

    def score(k: int, model, tokenizer) -> bool:
        seconds = clock.elapsed()
        curve.append((k, seconds, clock.pause(lambda: scorer(model))))
        print(f"  TRL    r{k}: {seconds:.0f} s, pass@1 {curve[-1][2]:.3f}", flush=True)
        return curve[-1][2] >= target

    trl_rounds(root, params, max_rounds, score)
    (root / "bench-trl.json").write_text(json.dumps({"curve": curve, "imports_seconds": imports_seconds}))


def trl_rounds(root: Path, params, max_rounds: int, after_round, **overrides) -> None:
    """TRL's GRPOTrainer from the project's warm start on its train split, `max_rounds` rounds of params.yaml's
    schedule (`trl_config`; `overrides` replace its arguments). After each round, `after_round(k, model,
    tokenizer)` is called; training stops after the round where it returns True."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlpipe import paths

    warm_start = root / paths.policy_dir("r0")
    train = pq.read_table(root / paths.TRAIN).select(["prompt", "answer", "meta"]).to_pydict()
    steps = steps_per_round(params)
    args = trl_config(params, max_steps=steps * max_rounds, logging_steps=steps, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(warm_start)

    class EachRound(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % steps == 0:
                control.should_training_stop = bool(after_round(state.global_step // steps, model, tokenizer))

    trainer = GRPOTrainer(model=str(warm_start), reward_funcs=[trl_reward(params)], args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict(train), callbacks=[EachRound()])
    trainer.train()


def trl_config(params, max_steps: int, **overrides):
    """TRL's `GRPOConfig` for the schedule and loss of params.yaml (a grpo round of `steps_per_round`
    steps per generation batch), with TRL's default `bf16=True`; `overrides` replace any argument.

    grpo's loss is DeepSeekMath's: k3 to the reference in the loss, as is. TRL (1.x) multiplies that KL
    term by the importance ratio pi / pi_old by default (`use_bias_correction_kl`), which changes the
    gradient from a round's second step on (the ratio is 1, with gradient, at the first), so it is
    turned off: with it off, TRL's 8 steps of a round and rlpipe's on TRL's step inputs end within 4e-6
    of each other in weights (`benchmarks.trl_parity`)."""
    from trl import GRPOConfig

    cfg, update = params.rollout, params.update
    steps = steps_per_round(params)
    assert steps * update.minibatch_prompts == cfg.prompts_per_round and params.algorithm.preset == "grpo"
    return GRPOConfig(**{
        "output_dir": tempfile.mkdtemp(prefix="trl-"),
        "per_device_train_batch_size": update.minibatch_prompts * cfg.samples_per_prompt,
        "num_generations": cfg.samples_per_prompt, "steps_per_generation": steps, "max_steps": max_steps,
        "max_completion_length": cfg.max_new_tokens, "temperature": cfg.temperature, "top_k": cfg.top_k,
        "top_p": cfg.top_p, "learning_rate": update.lr, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "weight_decay": update.weight_decay, "adam_beta1": update.adam_beta1, "adam_beta2": update.adam_beta2,
        "max_grad_norm": update.max_grad_norm, "beta": 0.04, "use_bias_correction_kl": False, "epsilon": 0.2,
        "loss_type": "grpo", "use_cpu": True,
        "report_to": [], "save_strategy": "no", "seed": params.seed, "disable_tqdm": True, **overrides,
    })


def trl_reward(params):
    """TRL's reward function: rlpipe's verifier for the task, on TRL's decoded completions."""
    from rlpipe.rewards import VERIFIERS

    verify = VERIFIERS.get(params.resolved_verifier())

    def reward(completions, answer, meta, **_):
        return [v.reward for v in verify(completions, answer, meta)]

    return reward


def time_to(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    return next(((k, s) for k, s, p in curve if p >= target), None)


def one_seed(work: Path, seed: int, target: float, max_rounds: int) -> dict:
    """Both sides from this seed's warm start: each side's curve and its (round, seconds) to the target."""
    from rlpipe import paths
    from rlpipe.config import load_params
    from rlpipe.models.policy import load_policy
    from rlpipe.stages.evaluate import Evaluator

    root = scratch_project(work / f"seed{seed}", max_rounds, seed)
    params = load_params(root / "params.yaml")
    dvc_repro(root, "init")  # the shared warm start: not timed
    evaluator = Evaluator(params, root / paths.TEST)
    start = greedy_pass_at_1(evaluator, *load_policy(root / paths.policy_dir("r0"), params.model.dtype))
    print(f"  seed {seed}: warm start pass@1 {start:.3f}; target {target}", flush=True)
    ours = run_ours(root, params, evaluator, target, max_rounds)
    trl = run_trl(root, target, max_rounds)
    theirs, imports = trl["curve"], trl["imports_seconds"]
    without_imports = [(k, seconds - imports, p) for k, seconds, p in theirs]
    return {"seed": seed, "start": start, "ours": ours, "theirs": theirs, "theirs_imports_seconds": imports,
            "ours_hit": time_to(ours, target), "theirs_hit": time_to(theirs, target),
            "theirs_hit_without_imports": time_to(without_imports, target)}


def seed_result(work: Path, seed: int, target: float, max_rounds: int) -> dict:
    """One seed's result, kept in the work directory: a run cut short resumes at the first seed without one."""
    import json

    saved = work / f"seed{seed}-target{target}-max{max_rounds}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    result = one_seed(work, seed, target, max_rounds)
    saved.write_text(json.dumps(result))
    return result


def run(target: float = 0.6, max_rounds: int = 20, work: Path | None = None, seeds: tuple[int, ...] = (0, 1, 2)) -> str:
    try:
        import trl  # noqa: F401
    except ImportError:
        return "## (e) wall seconds to the pass@1 target against TRL\n\ntrl is not installed: `pip install -e '.[bench]'`\n"
    import torch

    torch.set_num_threads(2)
    keep = work is not None  # a directory the caller named stays, for its stage metrics
    work = Path(work or tempfile.mkdtemp(prefix="rlpipe-wall-"))
    results = [seed_result(work, seed, target, max_rounds) for seed in seeds]
    rows = []
    for r in results:
        for side, curve, hit in (("rlpipe (dvc repro)", r["ours"], r["ours_hit"]),
                                 ("TRL GRPOTrainer script", r["theirs"], r["theirs_hit"])):
            rows.append([r["seed"], f"{r['start']:.3f}", side, *_reached(hit), " ".join(f"{p:.2f}" for _, _, p in curve),
                         f"{curve[0][1]:.1f}", f"{later_round_seconds(curve):.2f}"])
    text = table(f"(e) wall seconds from each seed's warm start to greedy pass@1 >= {target}, from each command's launch",
                 ["seed", "start", "side", "rounds to target", "seconds to target", "pass@1 per round",
                  "seconds to round 1", "seconds per later round (median)"], rows)
    text += "\nTRL's imports (launch to building the trainer), s: " + \
        ", ".join(f"seed {r['seed']} {r['theirs_imports_seconds']:.1f}" for r in results) + "\n"
    for label, theirs_key in (("from launch", "theirs_hit"), ("TRL's imports left out (as before 2026-12-05)",
                                                                "theirs_hit_without_imports")):
        ratios = [r["ours_hit"][1] / r[theirs_key][1] for r in results if r["ours_hit"] and r[theirs_key]]
        ours_median, theirs_median = (censored_median([r[hit] for r in results]) for hit in ("ours_hit", theirs_key))
        if ours_median is not None and theirs_median is not None:
            text += (f"median seconds to target, {label}: rlpipe {ours_median:.1f}, TRL {theirs_median:.1f}: ratio of "
                     f"medians {ours_median / theirs_median:.2f}x (target <= 0.5x); per seed where both reached it " +
                     ", ".join(f"{x:.2f}x" for x in ratios) + "\n")
        else:
            text += f"{label}: more than half the seeds did not reach {target} within {max_rounds} rounds on one side\n"
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return text


def later_round_seconds(curve: list[tuple[int, float, float]]) -> float:
    """The median wall seconds of a round after the first (the first carries the start-up); nan with one round."""
    import statistics

    steps = [b[1] - a[1] for a, b in zip(curve, curve[1:])]
    return statistics.median(steps) if steps else float("nan")


def censored_median(hits: list[tuple[int, float] | None]) -> float | None:
    """The median seconds to target, where a seed that never reached it counts as slower than any seed that
    did (its time is only known to exceed the run's length): None when the middle value is one of those."""
    import math
    import statistics

    middle = statistics.median(hit[1] if hit else math.inf for hit in hits)
    return middle if math.isfinite(middle) else None


def _reached(hit: tuple[int, float] | None) -> list:
    return [hit[0], hit[1]] if hit else ["not reached", "-"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--max-rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, help="scratch directory, kept afterwards (default: a new temporary one, removed after)")
    parser.add_argument("--trl-side", type=Path, metavar="PROJECT",
                        help="(internal) run TRL's side in PROJECT, a seed's scratch project, as its own process")
    parser.add_argument("--launched-at", type=float, help="(with --trl-side) time.monotonic() at the launch")
    ns = parser.parse_args()
    if ns.trl_side:
        trl_side(ns.trl_side, ns.launched_at, ns.target, ns.max_rounds)
    else:
        print(run(ns.target, ns.max_rounds, ns.work, tuple(ns.seeds)))
