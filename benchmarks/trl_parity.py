"""Does rlpipe's grpo round compute what TRL's GRPOTrainer computes, given the same samples? Benchmark e's
companion: where the two sides need different numbers of rounds to its target, this rules the round's
math in or out as the cause.

From one seed's warm start (a scratch project as benchmark e builds it, `dvc repro init`), TRL runs one
optimizer step of a round exactly as benchmark e runs it, with gradient clipping off so that the raw
gradient can be read. Its generation batch (prompts, completions, advantages, reference and old
logprobs), its first step's rows and that step's gradient are captured, and rlpipe's own code is run on
the same rows:
- rewards: rlpipe's verifier on the decoded completions, through rlpipe's grpo estimator, against TRL's
  advantages (with rlpipe's defaults, population std, and with TRL's sample std and eps 1e-4);
- the reference logprobs, rlpipe's forward under the update's bf16 autocast, against TRL's;
- the step's gradient, rlpipe's policy loss on TRL's first-step rows (TRL's old and reference logprobs and
  advantages), against TRL's: norm ratio and cosine, for each attention kernel rlpipe may use;
- the sampler: rlpipe's `hf` backend and `model.generate` (TRL's generation), both under bf16 autocast,
  over the round's prompts x `--samples` samples: mean reward and mean length with standard errors;
- the whole round: TRL trains one round (its `steps_per_round` steps, clipping on) and each step's inputs,
  clipped gradient and the weights after it are captured; rlpipe's `train_step` then takes the same steps
  from the same warm start, and the two are compared step by step (gradient cosine, weight distance).
  In fp32 and under bf16 autocast, as benchmark e configures TRL, and once with TRL's own default
  `use_bias_correction_kl=True`, which benchmark e turns off: the KL term is then weighted by pi / pi_old,
  a gradient that differs from the round's second step on.

`python -m benchmarks.trl_parity --work DIR [--seed 0] [--samples 32]` (needs the `bench` extra).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.common import table


def trl_round_capture(root: Path, params) -> dict:
    """One TRL step of benchmark e's configuration (clipping off): its generation batch, the first step's
    inputs and that step's raw gradient."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from benchmarks.wall_to_target import trl_config, trl_reward
    from rlpipe import paths

    warm_start = root / paths.policy_dir("r0")
    train = pq.read_table(root / paths.TRAIN).select(["prompt", "answer", "meta"]).to_pydict()
    args = trl_config(params, max_steps=1, max_grad_norm=1e9)  # no clipping: the raw gradient
    captured: dict = {}

    def detached(batch: dict) -> dict:
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}

    class Capturing(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured["round"] = detached(out)
            captured["answers"], captured["meta"] = [x["answer"] for x in inputs], [x["meta"] for x in inputs]
            return out

        def compute_loss(self, model, inputs, *args, **kwargs):
            captured.setdefault("step", detached(inputs))
            return super().compute_loss(model, inputs, *args, **kwargs)

    class Gradient(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):
            captured.setdefault("grad", {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                         if p.grad is not None})

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    Capturing(model=str(warm_start), reward_funcs=[trl_reward(params)], args=args, processing_class=tokenizer,
              train_dataset=Dataset.from_dict(train), callbacks=[Gradient()]).train()
    return captured


def unpadded(batch: dict) -> tuple[list[list[int]], list[list[int]]]:
    """TRL's left-padded prompts and right-padded completions (eos included) as token lists."""
    prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    completions = [c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], batch["completion_mask"])]
    return prompts, completions


def compare(root: Path, params, captured: dict, samples: int) -> list[list]:
    import torch

    from rlpipe import paths
    from rlpipe.algorithms.build import compute_round_advantages, minibatch_loss_setup, policy_loss
    from rlpipe.models.policy import load_policy
    from rlpipe.models.sequences import batched_response_logprobs, pack, pad_ragged, response_logprobs
    from rlpipe.rewards import VERIFIERS
    from rlpipe.train.policy import update_autocast

    spec, cfg = params.algorithm.resolve(), params.rollout
    model, tokenizer = load_policy(root / paths.policy_dir("r0"), params.model.dtype)
    verify = VERIFIERS.get(params.resolved_verifier())
    rows: list[list] = []

    # rewards and advantages of the whole generation batch (prompts repeated in consecutive rows)
    batch = captured["round"]
    prompts, completions = unpadded(batch)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = torch.tensor([v.reward for v in verify(texts, captured["answers"], captured["meta"])])
    group = torch.arange(len(completions)) // cfg.samples_per_prompt
    width = max(map(len, completions))
    mask = pad_ragged(completions, 0, torch.long, width=width)[1]
    for label, overrides in (("rlpipe's default (population std, eps 1e-6)", {}),
                             ("std_ddof 1, std_eps 1e-4 (TRL's)", {"std_ddof": 1, "std_eps": 1e-4})):
        result = compute_round_advantages(spec.model_copy(update=overrides), rewards=rewards, response_mask=mask,
                                          group_index=group, old_logp=torch.zeros(mask.shape))
        diff = (result.advantages[:, 0] - batch["advantages"]).abs()
        rows.append([f"advantages, {label}", f"max abs difference {diff.max().item():.2e}",
                     f"{len(completions)} completions"])

    # reference logprobs, as rlpipe's advantage stage computes them under update.bf16
    with torch.no_grad(), update_autocast(params, "cpu"):
        ref = batched_response_logprobs(model, prompts, completions, tokenizer.pad_token_id, cfg.temperature,
                                        params.update.micro_batch_tokens, width)
    diff = (ref - batch["ref_per_token_logps"][:, :width])[mask.bool()].abs()
    rows.append(["reference logprobs (bf16 autocast)", f"mean abs difference {diff.mean().item():.1e} nats",
                 f"max {diff.max().item():.1e}"])

    # the first step's gradient on TRL's rows, with TRL's advantages, old and reference logprobs
    step = captured["step"]
    step_prompts, step_completions = unpadded(step)
    width = max(map(len, step_completions))
    step_mask = pad_ragged(step_completions, 0, torch.long, width=width)[1]
    setup = minibatch_loss_setup(spec, response_mask=step_mask, group_index=torch.arange(len(step_completions)),
                                 correct=None, truncated=None, max_new_tokens=cfg.max_new_tokens)
    theirs = torch.cat([g.flatten() for g in captured["grad"].values()]).double()  # float64: a cosine over 1M terms
    for attention in ("eager", "sdpa"):
        model.set_attn_implementation(attention)
        model.train()
        model.zero_grad(set_to_none=True)
        with update_autocast(params, "cpu"):
            logp, entropy = response_logprobs(model, pack(step_prompts, step_completions, tokenizer.pad_token_id,
                                                          response_width=width), cfg.temperature, with_entropy=True)
            loss, _ = policy_loss(spec, logp=logp, old_logp=step["old_per_token_logps"][:, :width],
                                  advantages=step["advantages"].unsqueeze(1) * step_mask,
                                  setup=setup, ref_logp=step["ref_per_token_logps"][:, :width], entropy=entropy)
        loss.backward()
        named = dict(model.named_parameters())
        ours = torch.cat([named[name].grad.flatten() for name in captured["grad"]]).double()
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
        rows.append([f"step 1 gradient, {attention} attention", f"cosine {cosine:.5f}",
                     f"norm ours / TRL's {ours.norm().item() / theirs.norm().item():.4f} (TRL's {theirs.norm().item():.3f})"])
    model.eval()

    rows += sampler_rows(model, tokenizer, prompts[::cfg.samples_per_prompt], captured, samples, params, verify)
    return rows


def sampler_rows(model, tokenizer, prompts, captured, samples: int, params, verify) -> list[list]:
    """rlpipe's `hf` backend against `model.generate` (do_sample, as TRL calls it), both under bf16 autocast,
    on the same prompts: mean reward and length, with the standard error of the mean over prompts."""
    import torch
    from transformers import GenerationConfig

    from rlpipe.models.sequences import pad_ragged
    from rlpipe.rollout.base import GenerationRows, SamplingSpec
    from rlpipe.rollout.hf import HFBackend
    from rlpipe.rollout.sampling import prompt_uniforms

    cfg, per_group = params.rollout, params.rollout.samples_per_prompt
    answers, meta = captured["answers"][::per_group], captured["meta"][::per_group]

    def summary(responses: list[list[int]]) -> str:
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        reward = torch.tensor([v.reward for v in verify(texts, [a for a in answers for _ in range(samples)],
                                                           [m for m in meta for _ in range(samples)])])
        per_prompt = reward.view(len(prompts), samples).mean(dim=1)
        length = sum(map(len, responses)) / len(responses)
        return (f"reward {per_prompt.mean().item():.4f} +- {per_prompt.std().item() / math.sqrt(len(prompts)):.4f}, "
                f"length {length:.3f}")

    rows = [p for p in prompts for _ in range(samples)]
    uniforms = prompt_uniforms(params.seed, "trl-parity", list(range(len(prompts))), samples, cfg.max_new_tokens)
    ours = HFBackend(model, tokenizer, cfg.batch_size, bf16=True).generate(
        GenerationRows(rows, uniforms, torch.zeros(len(rows), dtype=torch.bool)),
        SamplingSpec(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p))
    generation = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=True, temperature=cfg.temperature,
                                  top_k=cfg.top_k, top_p=cfg.top_p, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(params.seed)
    theirs = []
    for start in range(0, len(prompts), 64):
        ids = pad_ragged(prompts[start:start + 64], tokenizer.pad_token_id, torch.long, left=True)[0]
        ids = ids.repeat_interleave(samples, dim=0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.generate(ids, attention_mask=(ids != tokenizer.pad_token_id).long(), generation_config=generation)
        for row in out[:, ids.shape[1]:].tolist():
            theirs.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return [["sampling, rlpipe's hf backend (bf16)", summary(ours.response_ids), f"{len(rows)} samples"],
            ["sampling, model.generate (bf16)", summary(theirs), f"{len(rows)} samples"]]


def trl_round_steps(root: Path, params, bf16: bool, use_bias_correction_kl: bool) -> dict:
    """One whole TRL round of benchmark e's configuration (clipping on): each step's inputs, its clipped
    gradient and the weights after it."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from benchmarks.wall_to_target import steps_per_round, trl_config, trl_reward
    from rlpipe import paths

    warm_start = root / paths.policy_dir("r0")
    train = pq.read_table(root / paths.TRAIN).select(["prompt", "answer", "meta"]).to_pydict()
    args = trl_config(params, max_steps=steps_per_round(params), bf16=bf16, use_bias_correction_kl=use_bias_correction_kl)
    captured: dict = {"steps": [], "grads": [], "weights": []}

    class Capturing(GRPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            captured["steps"].append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
            return super().compute_loss(model, inputs, *args, **kwargs)

    class Steps(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **_):  # after clipping
            captured["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

        def on_optimizer_step(self, args, state, control, model=None, **_):
            captured["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    Capturing(model=str(warm_start), reward_funcs=[trl_reward(params)], args=args, processing_class=tokenizer,
              train_dataset=Dataset.from_dict(train), callbacks=[Steps()]).train()
    return captured


def whole_round_row(root: Path, params, bf16: bool, trl_default_kl: bool) -> list:
    """rlpipe's `train_step` on each of TRL's captured step inputs in turn, from the same warm start and a
    fresh AdamW, with TRL's attention kernel (sdpa): the lowest gradient cosine over the round's steps and
    the weight distance after the last, against how far the weights moved."""
    import torch

    from rlpipe import artifacts, paths
    from rlpipe.models.policy import load_policy
    from rlpipe.train.policy import Minibatch, make_optimizer, train_step

    captured = trl_round_steps(root, params, bf16, use_bias_correction_kl=trl_default_kl)
    ours_params = params.model_copy(update={"update": params.update.model_copy(update={"bf16": bf16, "attention": "sdpa"})})
    model, tokenizer = load_policy(root / paths.policy_dir("r0"), params.model.dtype)
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    model.set_attn_implementation("sdpa")
    model.train()
    optimizer = make_optimizer(model, ours_params.update)
    names = [n for n, _ in model.named_parameters()]
    cosines = []
    for k, step in enumerate(captured["steps"]):
        prompts, completions = unpadded(step)

        def per_token(values):
            return [row[:len(c)].tolist() for row, c in zip(values, completions)]

        n = len(completions)
        columns = artifacts.Columns({
            "group": list(range(n)), "prompt_ids": prompts, "response_ids": completions,
            "old_logprobs": per_token(step["old_per_token_logps"]), "behaviour_logprobs": per_token(step["old_per_token_logps"]),
            "ref_logprobs": per_token(step["ref_per_token_logps"]), "correct": [bool(a > 0) for a in step["advantages"]],
            "advantages": [[float(a)] * len(c) for a, c in zip(step["advantages"], completions)],
            "finish_reason": ["stop"] * n})
        train_step(model, optimizer, Minibatch.of(columns, list(range(n))), ours_params, tokenizer.pad_token_id,
                   f"parity step {k + 1}")
        named = dict(model.named_parameters())
        ours = torch.cat([named[name].grad.flatten() for name in names]).double()
        theirs = torch.cat([captured["grads"][k][name].flatten() for name in names]).double()
        cosines.append(torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item())
    ours = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    theirs = torch.cat([captured["weights"][-1][name].flatten() for name in names]).double()
    label = (f"a whole round ({len(cosines)} steps, clipping on) on TRL's step inputs, "
             f"{'bf16 autocast' if bf16 else 'fp32'}{', TRL with its default use_bias_correction_kl' if trl_default_kl else ''}")
    return [label, f"weights after the round differ by {(ours - theirs).norm().item():.1e} (they moved "
                   f"{(theirs - start).norm().item():.3f})",
            "gradient cosine per step " + " ".join(f"{c:.5f}" for c in cosines)]


def run(work: Path, seed: int = 0, samples: int = 32) -> str:
    import torch

    from benchmarks.wall_to_target import dvc_repro, scratch_project
    from rlpipe import paths
    from rlpipe.config import load_params

    torch.set_num_threads(2)
    root = work / f"seed{seed}"
    if not (root / paths.policy_dir("r0")).is_dir():
        root = scratch_project(root, 1, seed)
        dvc_repro(root, "init")
    params = load_params(root / "params.yaml")
    rows = compare(root, params, trl_round_capture(root, params), samples)
    for bf16, trl_default_kl in ((False, False), (True, False), (False, True)):
        rows.append(whole_round_row(root, params, bf16, trl_default_kl))
    return table(f"TRL parity: one grpo round of benchmark e's configuration from seed {seed}'s warm start, "
                 f"rlpipe's code on TRL's samples", ["what", "rlpipe against TRL", "detail"], rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (the seed's project is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=32, help="samples per prompt in the sampler comparison")
    ns = parser.parse_args()
    print(run(ns.work, ns.seed, ns.samples))
