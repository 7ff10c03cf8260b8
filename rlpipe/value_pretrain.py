"""Value pretraining (VAPO / PPO / ORZ): fit the round-0 critic before round 1.

Samples `value.pretrain.prompts` prompts x M responses from the initial policy, scores them, and fits a
fresh value head on the policy's backbone (or `value.model.path`) to the Monte-Carlo returns
(lambda = 1): G_t = gamma^(T_b - 1 - t) r_b. A quarter of the prompts is held out; training stops
when the held-out explained variance reaches `value.pretrain.min_explained_variance`, or after
`value.pretrain.max_steps` steps. Value loss and explained variance are logged per step.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rlpipe.config import Params
from rlpipe.critic_training import ValueTargets, make_critic_optimizer, predict, save_critic, value_step
from rlpipe.progress import progress
from rlpipe.sequences import pad_ragged
from rlpipe.value_model import explained_variance, load_critic

EVAL_EVERY = 5


def monte_carlo_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, T) G_t = gamma^(T_b - 1 - t) r_b on valid tokens, 0 elsewhere (lambda = 1, V_T = 0)."""
    lengths = mask.sum(dim=1, keepdim=True)
    t = torch.arange(mask.shape[1]).unsqueeze(0)
    return (gamma ** (lengths - 1 - t).clamp(min=0).float()) * rewards.unsqueeze(1) * mask


def sample_for_pretraining(params: Params, policy_path: Path, train_path: Path):
    """(prompt_ids, response_ids, rewards, group of each row) sampled from the initial policy."""
    from rlpipe.data import read_prompts, round_prompt_rows
    from rlpipe.models import load_policy
    from rlpipe.rewards import VERIFIERS
    from rlpipe.rewards.shaping import overlong_penalty
    from rlpipe.rollout.base import GenerationRows, SamplingSpec
    from rlpipe.rollout.hf import HFBackend
    from rlpipe.rollout.sampling import prompt_uniforms
    from rlpipe.prompts import encode_prompts

    cfg, spec, m = params.rollout, params.algorithm.resolve(), params.rollout.samples_per_prompt
    table = read_prompts(train_path)
    prompts = table.take(round_prompt_rows(table.num_rows, params.value.pretrain.prompts, params.seed,
                                           "value_pretrain")).to_pydict()
    model, tokenizer = load_policy(policy_path, params.model.dtype)
    prompt_ids = encode_prompts(tokenizer, prompts["prompt"], params.data)
    rows = [ids for ids in prompt_ids for _ in range(m)]
    uniforms = prompt_uniforms(params.seed, "value_pretrain", prompts["prompt_id"], m, cfg.max_new_tokens)
    out = HFBackend(model, tokenizer, cfg.batch_size).generate(
        GenerationRows(rows, uniforms, torch.zeros(len(rows), dtype=torch.bool)),
        SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p), desc="value pretrain: sample")
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    verdicts = VERIFIERS.get(params.resolved_verifier())(
        texts, [a for a in prompts["answer"] for _ in range(m)], [x for x in prompts["meta"] for _ in range(m)])
    rewards = [v.reward + (overlong_penalty(len(r), cfg.max_new_tokens, params.reward.overlong_cache_len)
                           if spec.overlong_shaping else 0.0) for v, r in zip(verdicts, out.response_ids)]
    groups = [g for g in range(len(prompt_ids)) for _ in range(m)]
    return rows, out.response_ids, torch.tensor(rewards), groups


def pretrain_critic(params: Params, policy_path: Path, train_path: Path, out_dir: Path, tracker=None) -> dict:
    cfg = params.value.pretrain
    prompt_ids, response_ids, rewards, groups = sample_for_pretraining(params, policy_path, train_path)
    mask = pad_ragged(response_ids, 0, torch.long)[1]
    returns = monte_carlo_returns(rewards, mask, params.algorithm.resolve().gamma)
    targets = ValueTargets(prompt_ids, response_ids, returns, None, mask)
    n_groups = max(groups) + 1
    held_out = set(random.Random(f"{params.seed}:value_holdout").sample(range(n_groups), max(1, n_groups // 4)))
    train_idx = [i for i, g in enumerate(groups) if g not in held_out]
    eval_targets = targets.rows([i for i, g in enumerate(groups) if g in held_out])

    source = params.value.model.path or policy_path
    critic, tokenizer = load_critic(source, params.model.dtype, from_policy=True)
    optimizer = make_critic_optimizer(critic, params, None)
    rng = random.Random(f"{params.seed}:value_pretrain")
    batch_rows = params.update.minibatch_prompts * params.rollout.samples_per_prompt
    ev, step, history = float("-inf"), 0, []
    with progress(total=cfg.max_steps, desc="value pretrain", unit="step") as bar:
        while step < cfg.max_steps:
            critic.train()
            stats = value_step(critic, optimizer, targets.rows(rng.sample(train_idx, min(batch_rows, len(train_idx)))),
                               params, tokenizer.pad_token_id, f"value_pretrain step {step}")
            step += 1
            if step % EVAL_EVERY == 0 or step == cfg.max_steps:
                critic.eval()
                ev = explained_variance(predict(critic, eval_targets, params, tokenizer.pad_token_id),
                                        eval_targets.returns, eval_targets.mask)
                stats["explained_variance"] = ev
            history.append(stats)
            if tracker is not None:
                tracker.log_metrics({f"value_pretrain/{k}": v for k, v in stats.items()}, step=step)
            bar.update(1)
            bar.set_postfix(loss=f"{stats['value_loss']:.4f}", ev=f"{ev:.3f}")
            if ev >= cfg.min_explained_variance:
                break
    critic.eval()
    metrics = {"value/explained_variance": ev, "value/pretrain_steps": step,
               "value/pretrain_loss_last": history[-1]["value_loss"] if history else float("nan"),
               "value/pretrain_responses": len(response_ids), "value/critic": 1}
    save_critic(critic, tokenizer, optimizer, out_dir, {"round": "r0", **metrics})
    return metrics
