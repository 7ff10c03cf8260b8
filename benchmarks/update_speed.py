"""(d) Update tokens/s of rlpipe's training loop against TRL's GRPOTrainer on the same model and batch.

The tiny embedded model (4 x 128), one minibatch of 64 prompts x 8 responses (ragged, <= 6 tokens),
grpo's loss in both (TRL: loss_type "grpo", beta 0.04 with a reference model; rlpipe: the grpo preset).
Each side does forward + backward + AdamW step on the identical batch; TRL's side goes through
`GRPOTrainer.compute_loss`, its own loss path. Needs the `bench` extra (trl). Target: >= 1.0x.

Precision and attention kernel change both sides' speed more than either loop does, so each row gives
both sides the same ones: fp32 or bf16 autocast (TRL's default, `bf16=True`, which autocasts on CPU too),
and SDPA (transformers' default) or eager attention. The last row is each side's defaults.
"""

from __future__ import annotations

import random
import tempfile

import torch

from benchmarks.common import table

PROMPTS, M, MAX_NEW = 64, 8, 6


def batch(tokenizer, seed: int = 0):
    from rlpipe.data.prompts import encode_prompts
    from rlpipe.data.tasks import generate_split

    rng = random.Random(seed)
    prompts = encode_prompts(tokenizer, [e.prompt for e in generate_split("addition", seed, PROMPTS, 2, 3)])
    rows = [p for p in prompts for _ in range(M)]
    responses = [[rng.randrange(4, 14) for _ in range(rng.randrange(1, MAX_NEW))] + [tokenizer.eos_token_id] for _ in rows]
    advantages = [rng.uniform(-1, 1) for _ in rows]
    old = [[-rng.uniform(0.5, 3) for _ in r] for r in responses]
    return rows, responses, advantages, old


def ours(model, tokenizer, rows, responses, advantages, old, bf16: bool = False, attention: str = "auto"):
    from rlpipe import artifacts
    from rlpipe.config import params_from_dict
    from rlpipe.train.policy import Minibatch, make_optimizer, train_step, update_attention

    params = params_from_dict({"algorithm": {"preset": "grpo"}, "rollout": {"max_new_tokens": MAX_NEW},
                               "update": {"bf16": bf16, "attention": attention}})
    longest = max(len(p) + len(r) for p, r in zip(rows, responses))
    model.set_attn_implementation(update_attention(params.update, "cpu", longest))  # as update_policy does
    columns = artifacts.Columns({
        "group": [i // M for i in range(len(rows))], "prompt_ids": rows, "response_ids": responses,
        "old_logprobs": old, "behaviour_logprobs": old, "ref_logprobs": old, "advantages": [[a] * len(r) for a, r in zip(advantages, responses)],
        "correct": [a > 0 for a in advantages], "finish_reason": ["stop"] * len(rows),
    })
    mb = Minibatch.of(columns, list(range(len(rows))))
    optimizer = make_optimizer(model, params.update)

    def step():
        train_step(model, optimizer, mb, params, tokenizer.pad_token_id, "bench")
    return step, int(mb.response_mask.sum())


def trl_step(model, tokenizer, rows, responses, advantages, old, bf16: bool = True, attention: str | None = None):
    from pathlib import Path

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlpipe.models.sequences import pad_ragged

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=len(rows), num_generations=M,
                      max_completion_length=MAX_NEW, beta=0.04, loss_type="grpo", use_cpu=True, report_to=[],
                      logging_steps=10**9, save_strategy="no", learning_rate=1e-4, bf16=bf16,
                      model_init_kwargs={"attn_implementation": attention} if attention else None)
    # TRL builds its reference model from a path; give it the same weights on disk
    path = Path(tempfile.mkdtemp()) / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer = GRPOTrainer(model=str(path), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["1+1="] * 8}),
                          processing_class=tokenizer)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we drive the loss directly
    prompt_ids, prompt_mask = pad_ragged(rows, tokenizer.pad_token_id, torch.long, left=True)
    completion_ids, completion_mask = pad_ragged(responses, tokenizer.pad_token_id, torch.long)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.long(), "completion_ids": completion_ids,
              "completion_mask": completion_mask.long(), "advantages": torch.tensor(advantages),
              "old_per_token_logps": pad_ragged(old, 0.0, torch.float32)[0],
              "ref_per_token_logps": pad_ragged(old, 0.0, torch.float32)[0],
              "num_items_in_batch": completion_mask.sum()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step, int(completion_mask.sum())


# (row label, rlpipe's update.bf16 and update.attention, TRL's bf16 and attn_implementation)
SETTINGS = [
    ("fp32, sdpa", (False, "sdpa"), (False, "sdpa")),
    ("fp32, eager", (False, "eager"), (False, "eager")),
    ("bf16, sdpa", (True, "sdpa"), (True, "sdpa")),
    ("bf16, eager", (True, "eager"), (True, "eager")),
    ("defaults: rlpipe fp32, auto (eager here); TRL bf16, sdpa", (False, "auto"), (True, None)),
]


def run(repeats: int = 7) -> str:
    try:
        import trl  # noqa: F401
    except ImportError:
        return "## (d) update tokens/s against TRL\n\ntrl is not installed: `pip install -e '.[bench]'`\n"
    from benchmarks.common import paired
    from rlpipe.config import TinyModelConfig
    from rlpipe.models.policy import build_tiny_model
    from rlpipe.models.tokenizer import build_char_tokenizer

    torch.set_num_threads(2)
    tokenizer = build_char_tokenizer()
    data = batch(tokenizer)
    rows = []
    for label, (our_bf16, our_attention), (trl_bf16, trl_attention) in SETTINGS:
        step_a, tokens = ours(build_tiny_model(TinyModelConfig(), tokenizer, seed=0).train(), tokenizer, *data,
                              bf16=our_bf16, attention=our_attention)
        step_b, tokens_b = trl_step(build_tiny_model(TinyModelConfig(), tokenizer, seed=0).train(), tokenizer, *data,
                                    bf16=trl_bf16, attention=trl_attention)
        assert tokens == tokens_b
        timed = paired(step_b, step_a, repeats=repeats, warmup=2)  # TRL's seconds / ours = our speed-up
        rows.append([label, tokens / timed["b_s"], tokens / timed["a_s"], timed["ratio"], timed["ratio_min"],
                     timed["ratio_max"]])
    return table("(d) update tokens/s: rlpipe train_step against TRL GRPOTrainer.compute_loss (+ backward, AdamW)",
                 ["precision, attention", "ours tok/s", "TRL tok/s", "ratio (>= 1.0)", "min", "max"], rows)


if __name__ == "__main__":
    print(run())
