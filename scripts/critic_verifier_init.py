"""A critic that starts as a verifier: does it reach the addition ceiling? (issue 19, part 3)

    dvc repro init                          # in an addition project whose params.yaml has a critic preset
    python scripts/critic_verifier_init.py OUT '{"prompts": 8192, "steps": 600, "lr": 0.001}'
    python scripts/critic_pretrain_variants.py OUT2 '{"backbone": "OUT/verifier"}'

Three quarters of the critic's ceiling on addition lie in one check (README, "The critic's ceiling"):
is the sum written so far right? The policy's own samples teach it badly: 14% of them are right, and
4,096 rows leave the check unlearnt. This script trains that check first, on data it makes itself: for
`prompts` train prompts (at most the split's), the right sum and a near miss (one digit changed), each
followed by eos, reward 1 for the right one. They go through value pretraining's own loop
(`pretrain_critic`: Monte-Carlo returns, a quarter of the prompts held out), starting from the init
policy, so that OUT/verifier is a critic checkpoint whose head already answers "is this sum right" at
the state before eos. `critic_pretrain_variants.py` with that directory as `backbone` then runs the
usual value pretraining from it (the head is kept: the checkpoint's config already has one output) and
prints the held-out EV to set against the ceiling. Nothing under runs/ changes.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from rlpipe import paths
from rlpipe.config import load_params


def near_miss(answer: str, rng: random.Random) -> str:
    """The answer with one digit replaced by another (a leading zero is avoided)."""
    position = rng.randrange(len(answer))
    choices = [d for d in "0123456789" if d != answer[position] and not (position == 0 and d == "0" and len(answer) > 1)]
    return answer[:position] + rng.choice(choices) + answer[position + 1:]


def verifier_rows(params, prompts: int, tokenizer, seed: int):
    """(prompt_ids, response_ids, rewards, groups): each prompt twice, with its sum and with a near miss."""
    from rlpipe.data.prompts import encode_prompts

    table = pq.read_table(paths.TRAIN).select(["prompt", "answer"]).to_pydict()
    rng = random.Random(f"{seed}:verifier")
    picked = rng.sample(range(len(table["prompt"])), min(prompts, len(table["prompt"])))
    encoded = encode_prompts(tokenizer, [table["prompt"][i] for i in picked], params.data)
    prompt_ids, response_ids, rewards, groups = [], [], [], []
    for group, (i, ids) in enumerate(zip(picked, encoded)):
        answer = table["answer"][i]
        for text, reward in ((answer, 1.0), (near_miss(answer, rng), 0.0)):
            prompt_ids.append(ids)
            response_ids.append(tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id])
            rewards.append(reward)
            groups.append(group)
    return prompt_ids, response_ids, rewards, groups


def main(out: Path, variant: dict) -> None:
    from transformers import AutoTokenizer

    import rlpipe.train.critic as critic_training

    params = load_params()
    pretrain = params.value.pretrain.model_copy(update={"max_steps": variant.get("steps", 600), "min_explained_variance": 1.0})
    params = params.model_copy(update={"value": params.value.model_copy(update={
        "lr": variant.get("lr", params.value.lr), "pretrain": pretrain})})
    tokenizer = AutoTokenizer.from_pretrained(paths.policy_dir("r0"))
    prompt_ids, response_ids, rewards, groups = verifier_rows(params, variant.get("prompts", 8192), tokenizer, params.seed)
    print(f"{len(response_ids)} verifier rows from {max(groups) + 1} prompts, e.g. "
          f"{tokenizer.decode(prompt_ids[1] + response_ids[1])!r} -> {rewards[1]}", flush=True)
    torch.manual_seed(params.seed)
    started = time.perf_counter()
    metrics = critic_training.pretrain_critic(params, prompt_ids, response_ids, torch.tensor(rewards), groups,
                                              paths.policy_dir("r0"), out / "verifier")
    print(f"{json.dumps(variant)}: held-out EV on the verifier rows {metrics['value/explained_variance']:.4f} after "
          f"{metrics['value/pretrain_steps']} steps ({time.perf_counter() - started:.0f} s); written to {out / 'verifier'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
