"""The `evaluate` stage's work: greedy pass@1, unbiased pass@k and maj@k on the test split.

Both the initial (r0) and the final policy are scored on the same prompts with the same per-prompt
seeds, so the two are a paired comparison. With `eval.curve`, every round's checkpoint is also scored
greedily, which gives the learning curve (alongside the rollout accuracy each round trained on).
"""

from __future__ import annotations

import json
from collections import Counter
from math import comb
from pathlib import Path

from rlpipe import paths
from rlpipe.config import Params


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), for c correct of n samples."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


class Evaluator:
    def __init__(self, params: Params, test_path: Path):
        import pyarrow as pa  # noqa: F401  (read_prompts returns a table)

        from rlpipe.data import read_prompts
        from rlpipe.rewards import VERIFIERS

        self.params = params
        table = read_prompts(test_path)
        self.prompts = table.slice(0, params.eval.max_prompts).to_pydict()
        self.verify = VERIFIERS.get(params.resolved_verifier())

    def _generate(self, model, tokenizer, samples: int, greedy: bool, stream: str):
        import torch

        from rlpipe.rollout.base import GenerationRows, SamplingSpec
        from rlpipe.rollout.hf import HFBackend
        from rlpipe.rollout.sampling import prompt_uniforms
        from rlpipe.prompts import encode_prompts

        cfg = self.params.rollout
        prompt_ids = encode_prompts(tokenizer, self.prompts["prompt"], self.params.data)
        rows = [ids for ids in prompt_ids for _ in range(samples)]
        uniforms = prompt_uniforms(self.params.seed, stream, self.prompts["prompt_id"], samples, cfg.max_new_tokens)
        backend = HFBackend(model, tokenizer, cfg.batch_size)
        spec = SamplingSpec(cfg.max_new_tokens, self.params.eval.temperature, cfg.top_k, cfg.top_p)
        out = backend.generate(GenerationRows(rows, uniforms, torch.full((len(rows),), greedy)), spec, desc=stream)
        texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
        answers = [a for a in self.prompts["answer"] for _ in range(samples)]
        metas = [m for m in self.prompts["meta"] for _ in range(samples)]
        verdicts = self.verify(texts, answers, metas)
        return texts, [v.correct for v in verdicts], [len(r) for r in out.response_ids]

    def greedy_pass_at_1(self, model, tokenizer) -> float:
        _, correct, _ = self._generate(model, tokenizer, 1, True, "eval greedy")
        return sum(correct) / len(correct)

    def sampled(self, model, tokenizer) -> dict[str, float]:
        n = self.params.eval.samples
        texts, correct, lengths = self._generate(model, tokenizer, n, False, "eval sampled")
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
        return out


def evaluate(params: Params, test_path: Path, out_path: Path = paths.EVAL, curve_path: Path = paths.ROUND_CURVE,
             plots_dir: Path = paths.PLOTS, tracker=None) -> dict:
    from rlpipe.artifacts import atomic_write_text
    from rlpipe.models import load_policy

    evaluator = Evaluator(params, test_path)
    rounds = ["r0", *params.round_names]
    results: dict[str, dict[str, float]] = {}
    curve = []
    for name in rounds:
        is_endpoint = name in ("r0", params.final_round)
        if not (is_endpoint or params.eval.curve):
            continue
        model, tokenizer = load_policy(paths.policy_dir(name), params.model.dtype)
        point: dict[str, float] = {"round": paths.round_index(name), "pass@1": evaluator.greedy_pass_at_1(model, tokenizer)}
        if is_endpoint:
            results[name] = {"pass@1": point["pass@1"], **evaluator.sampled(model, tokenizer)}
        state = json.loads((paths.policy_dir(name) / paths.TRAINER_STATE).read_text())
        point.update({f"train_{k}": v for k, v in state.get("summary", {}).items() if isinstance(v, (int, float))})
        curve.append(point)
    final, init = results[params.final_round], results["r0"]
    k_max = max(params.eval.k)
    k_name = "pass@1_sampled" if k_max == 1 else f"pass@{k_max}"
    metrics = {**final, **{f"{k}_init": v for k, v in init.items()},
               "pass@k": final[k_name], "pass@k_init": init[k_name], "k": k_max,
               "pass@1_gain": final["pass@1"] - init["pass@1"], "test_prompts": len(evaluator.prompts["prompt"])}
    atomic_write_text(out_path, json.dumps({**metrics, "curve": curve}, indent=2) + "\n")
    atomic_write_text(curve_path, json.dumps(curve, indent=2) + "\n")
    from rlpipe.plots import plot_rounds

    for picture in plot_rounds(curve, plots_dir):
        if tracker is not None:
            tracker.log_artifact(picture, "plots", to_parent=True)
    return metrics
