"""evaluate: greedy pass@1, unbiased pass@k and maj@k on the test split, and the learning curve.

Both the initial (r0) and the final policy are scored on the same prompts with the same per-prompt
seeds, so the two are a paired comparison. With `eval.curve`, every round's checkpoint is also scored
greedily, which gives the learning curve (alongside the rollout accuracy each round trained on).
Generation goes through the configured rollout backend (`rollout.backend`, with `rollout.vllm` for vLLM),
as in the rollout stage, at `eval.temperature`.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

from rlpipe import paths
from rlpipe.atomic import atomic_write_text
from rlpipe.config import Params, RolloutConfig
from rlpipe.data.splits import read_prompts
from rlpipe.rewards import verify
from rlpipe.rollout import rollout_backend
from rlpipe.rollout.base import SamplingSpec
from rlpipe.rollout.generate import generate_groups


def evaluate(ctx) -> dict:
    ctx.init_torch()
    metrics = evaluate_policies(ctx.params, paths.TEST, tracker=ctx.tracker, models=ctx.models)
    ctx.tracker.log_metrics(metrics)
    ctx.tracker.log_metrics(metrics, to_parent=True)
    # the results live in eval.json; evaluate.json keeps only this stage's timings, so that
    # `dvc exp show` lists each result once
    return {}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), for c correct of n samples."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_rollout_config(params: Params) -> RolloutConfig:
    """The rollout settings evaluation generates with: the backend's, at eval.temperature, without the
    rollout's bf16 autocast (pass@1 measures the weights as stored). A vLLM engine's logprobs mode follows
    its temperature (raw at 1, processed otherwise), so an eval at a temperature on the other side of 1
    from the rollout's needs an engine of its own, which this asks for."""
    return params.rollout.model_copy(update={"temperature": params.eval.temperature, "bf16": False})


class Evaluator:
    def __init__(self, params: Params, test_path: Path):
        self.params = params
        self.prompts = read_prompts(test_path).slice(0, params.eval.max_prompts).to_pydict()

    @classmethod
    def of_prompts(cls, params: Params, prompts: dict[str, list]) -> "Evaluator":
        """An evaluator of other prompts than the test split's (the columns `read_prompts` gives)."""
        evaluator = cls.__new__(cls)
        evaluator.params, evaluator.prompts = params, prompts
        return evaluator

    def _generate(self, backend, samples: int, greedy: bool, stream: str, desc: str):
        cfg = self.params.rollout
        groups = generate_groups(backend, self.prompts["prompt"], self.prompts["prompt_id"],
                                 greedy_pattern=[greedy] * samples, stream=stream, seed=self.params.seed,
                                 spec=SamplingSpec(cfg.max_new_tokens, self.params.eval.temperature, cfg.top_k, cfg.top_p),
                                 data=self.params.data, desc=desc)
        verdicts = verify(self.params.resolved_verifier(), groups.texts, groups.per_row(self.prompts["answer"]),
                          groups.per_row(self.prompts["meta"]), desc=f"{desc}: score")
        return groups.texts, [v.correct for v in verdicts], [len(r) for r in groups.output.response_ids]

    def greedy(self, backend, policy: str) -> list[bool]:
        """Whether each test prompt's greedy response is right, under the policy `backend` generates from
        (`policy` names it in progress bars)."""
        return self._generate(backend, 1, True, "eval greedy", f"eval {policy} greedy")[1]

    def greedy_pass_at_1(self, backend, policy: str) -> float:
        correct = self.greedy(backend, policy)
        return sum(correct) / len(correct)

    def by_difficulty(self, correct: list[bool]) -> dict[str, dict[str, float]]:
        """Greedy pass@1 and prompt count per difficulty bucket of the test split (empty when the task
        has no buckets)."""
        buckets: dict[str, list[bool]] = {}
        for bucket, right in zip(self.prompts["difficulty"], correct):
            if bucket:
                buckets.setdefault(bucket, []).append(right)
        return {b: {"pass@1": sum(c) / len(c), "prompts": len(c)} for b, c in sorted(buckets.items())}

    def sampled(self, backend, policy: str) -> dict[str, float]:
        n = self.params.eval.samples
        texts, correct, lengths = self._generate(backend, n, False, "eval sampled", f"eval {policy} sampled")
        out: dict[str, float] = {}
        groups = [range(i * n, (i + 1) * n) for i in range(len(self.prompts["prompt"]))]
        for k in self.params.eval.k:
            # pass@1 is the greedy figure; the sampled estimate of k = 1 keeps its own name
            name = "pass@1_sampled" if k == 1 else f"pass@{k}"
            out[name] = sum(pass_at_k(n, sum(correct[j] for j in g), k) for g in groups) / len(groups)
        majority_right = 0
        for g in groups:
            votes = Counter(texts[j].strip() for j in g)
            top, _ = votes.most_common(1)[0]
            majority_right += any(correct[j] for j in g if texts[j].strip() == top)
        out[f"maj@{n}"] = majority_right / len(groups)
        out["sampled_accuracy"] = sum(correct) / len(correct)
        out["mean_length"] = sum(lengths) / len(lengths)
        # where responses may reason before answering, whether the right ones are the long ones
        for name, right in (("mean_length_correct", True), ("mean_length_incorrect", False)):
            chosen = [n for n, c in zip(lengths, correct) if c == right]
            out[name] = sum(chosen) / len(chosen) if chosen else None
        return out


def with_stderr(curve: list[dict], test_prompts: int) -> list[dict]:
    """Each point with `pass@1_stderr`, the binomial standard error of its greedy pass@1 over the test
    prompts (about 0.02 at 0.5 on 500 prompts): what two runs' pass@1 must differ by to mean anything."""
    return [{**point, "pass@1_stderr": math.sqrt(point["pass@1"] * (1 - point["pass@1"]) / test_prompts)}
            for point in curve]


def curve_rows(curve: list[dict]) -> list[dict]:
    """The rows of rounds.json, the curve `dvc plots` draws: every row with the same keys (DVC's renderer
    drops a file whose rows differ, and r0 has no training summary). The training summaries stay in
    eval.json's `curve`."""
    return [{key: point[key] for key in ("round", "pass@1", "pass@1_stderr")} for point in curve]


def run_label(params: Params) -> str:
    """What names the run in its pictures: the DVC experiment (or the workspace) and the preset."""
    return f"{os.environ.get('DVC_EXP_NAME') or 'workspace'}: preset {params.algorithm.preset}, {params.rounds} rounds"


def evaluate_policies(params: Params, test_path: Path, out_path: Path = paths.EVAL,
                      curve_path: Path = paths.ROUND_CURVE, plots_dir: Path = paths.PLOTS, tracker=None,
                      models=None) -> dict:
    from rlpipe.models.store import ModelStore

    models = models or ModelStore()
    evaluator = Evaluator(params, test_path)
    results: dict[str, dict[str, float]] = {}
    by_difficulty: dict[str, dict] = {}
    curve = []
    for name in ["r0", *params.round_names]:
        is_endpoint = name in ("r0", params.final_round)
        if not (is_endpoint or params.eval.curve):
            continue
        backend = rollout_backend(models, paths.policy_dir(name), eval_rollout_config(params), params.model.dtype)
        greedy = evaluator.greedy(backend, name)
        point: dict[str, float] = {"round": paths.round_index(name), "pass@1": sum(greedy) / len(greedy)}
        if is_endpoint:
            results[name] = {"pass@1": point["pass@1"], **evaluator.sampled(backend, name)}
            by_difficulty[name] = evaluator.by_difficulty(greedy)
        state = json.loads((paths.policy_dir(name) / paths.TRAINER_STATE).read_text())
        point.update({f"train_{k}": v for k, v in state.get("summary", {}).items() if isinstance(v, (int, float))})
        curve.append(point)
    final, init = results[params.final_round], results["r0"]
    k_max = max(params.eval.k)
    k_name = "pass@1_sampled" if k_max == 1 else f"pass@{k_max}"
    metrics = {**final, **{f"{k}_init": v for k, v in init.items()},
               "pass@k": final[k_name], "pass@k_init": init[k_name], "k": k_max,
               "pass@1_gain": final["pass@1"] - init["pass@1"], "test_prompts": len(evaluator.prompts["prompt"])}
    buckets = {bucket: {"pass@1": by_difficulty[params.final_round][bucket]["pass@1"], "pass@1_init": init_bucket["pass@1"],
                        "prompts": init_bucket["prompts"]} for bucket, init_bucket in by_difficulty["r0"].items()}
    atomic_write_text(out_path, json.dumps({**metrics, **({"by_difficulty": buckets} if buckets else {}), "curve": curve},
                                           indent=2) + "\n")
    curve = with_stderr(curve, metrics["test_prompts"])
    rows = curve_rows(curve)
    atomic_write_text(curve_path, json.dumps(rows, indent=2) + "\n")
    if tracker is not None:  # the held-out curve on the parent run, one step a round: MLflow's Compare overlays it
        for row in rows:
            tracker.log_metrics({f"curve/{k}": v for k, v in row.items() if k != "round"}, step=row["round"],
                                to_parent=True)
    from rlpipe.plots import plot_rounds

    for picture in plot_rounds(curve, plots_dir, run_label(params)):
        if tracker is not None:
            tracker.log_artifact(picture, "plots", to_parent=True)
    return metrics
