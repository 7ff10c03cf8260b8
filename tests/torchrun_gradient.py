"""Run by tests/test_torchrun.py, under torchrun or alone: one micro-batched update step of the tiny
policy, and one of a tiny critic, on a fixed ragged minibatch; writes the summed gradients (rank 0) to
the path in argv[1]."""

from __future__ import annotations

import random
import sys

import torch


def minibatch_columns(groups: int = 6, samples: int = 3, seed: int = 0):
    from rlpipe import artifacts

    rng = random.Random(seed)
    cols = {k: [] for k in ("group", "prompt_ids", "response_ids", "old_logprobs", "ref_logprobs", "advantages",
                            "correct", "finish_reason", "returns", "values")}
    for g in range(groups):
        prompt = [1] + [rng.randrange(4, 14) for _ in range(rng.randrange(3, 7))]
        for _ in range(samples):
            n = rng.randrange(1, 7)  # ragged responses
            cols["group"].append(g)
            cols["prompt_ids"].append(prompt)
            cols["response_ids"].append([rng.randrange(4, 16) for _ in range(n)])
            cols["old_logprobs"].append([-rng.uniform(0.5, 3.0) for _ in range(n)])
            cols["ref_logprobs"].append([-rng.uniform(0.5, 3.0) for _ in range(n)])
            cols["advantages"].append([rng.uniform(-1, 1)] * n)
            cols["correct"].append(rng.random() < 0.5)
            cols["finish_reason"].append("stop" if rng.random() < 0.7 else "length")
            cols["returns"].append([rng.uniform(0, 1) for _ in range(n)])
            cols["values"].append([rng.uniform(0, 1) for _ in range(n)])
    cols["behaviour_logprobs"] = cols["old_logprobs"]  # the HF engine's: the trainer's pi_old, no drift
    return artifacts.Columns(cols)


def gradient(loss_agg: str, world, strategy: str = "ddp", budget: int = 24) -> torch.Tensor:
    from rlpipe.config import TinyModelConfig, params_from_dict
    from rlpipe.train.distributed import unwrap, wrap_model
    from rlpipe.models.policy import build_tiny_model
    from rlpipe.models.tokenizer import build_char_tokenizer
    from rlpipe.train.policy import Minibatch, train_step

    # the default budget gives many micro-batches per rank, some with a shared prompt and some without
    params = params_from_dict({"algorithm": {"preset": "grpo", "loss_agg": loss_agg},
                               "update": {"micro_batch_tokens": budget, "max_grad_norm": 1e9, "strategy": strategy},
                               "rollout": {"max_new_tokens": 6}})
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(layers=2, hidden=32, heads=2, intermediate=64), tokenizer, seed=0)
    model = wrap_model(model, strategy, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    columns = minibatch_columns()
    groups = sorted(set(columns["group"]))
    mine = [i for i, g in enumerate(columns["group"]) if g in set(world.shard(groups))]
    train_step(model, optimizer, Minibatch.of(columns, mine), params, tokenizer.pad_token_id, "test", world)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in unwrap(model).parameters()]
    return torch.cat([g.flatten() for g in grads])


def critic_gradient(world, tmp: str) -> torch.Tensor:
    from rlpipe.config import TinyModelConfig, params_from_dict
    from rlpipe.train.critic import batch_targets, value_step
    from rlpipe.train.distributed import unwrap, wrap_model
    from rlpipe.models.policy import build_tiny_model
    from rlpipe.models.tokenizer import build_char_tokenizer
    from rlpipe.models.critic import load_critic

    params = params_from_dict({"algorithm": {"preset": "ppo"}, "update": {"micro_batch_tokens": 24, "max_grad_norm": 1e9},
                               "value": {"clip_range": 0.2}})
    tokenizer = build_char_tokenizer()
    if world.is_main:
        build_tiny_model(TinyModelConfig(layers=2, hidden=32, heads=2, intermediate=64), tokenizer, seed=0
                         ).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    world.barrier()
    torch.manual_seed(0)
    critic = wrap_model(load_critic(tmp, from_policy=True)[0], "ddp", world)
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.0)
    columns = minibatch_columns()
    groups = sorted(set(columns["group"]))
    mine = [i for i, g in enumerate(columns["group"]) if g in set(world.shard(groups))]
    value_step(critic, optimizer, batch_targets(columns, mine), params, tokenizer.pad_token_id, "test", world)
    return torch.cat([p.grad.flatten() for p in unwrap(critic).parameters()])


def main() -> int:
    from rlpipe.train.distributed import init_world
    from rlpipe.errors import PipelineError

    torch.set_num_threads(1)
    world = init_world()
    grads = {mode: gradient(mode, world) for mode in ("token-mean", "seq-mean-token-mean")}
    grads["critic"] = critic_gradient(world, sys.argv[2])
    grads["fsdp2"] = gradient("token-mean", world, "fsdp2", budget=10**6)  # one micro-batch per rank
    try:  # unequal micro-batch counts under FSDP2 would hang: both ranks must stop with the key instead
        gradient("token-mean", world, "fsdp2")
        grads["fsdp2_uneven"] = "no error" if world.distributed else "single process"
    except PipelineError as err:
        grads["fsdp2_uneven"] = str(err)
    if world.is_main:
        torch.save(grads, sys.argv[1])
    if world.distributed:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
