"""Where the critic's ceiling lies on addition: the exact V*(prefix), state by state (issue 19, part 3).

    python scripts/critic_pretrain_variants.py OUT '{}'     # draws the value_pretrain samples (OUT/samples-P.pkl)
    python scripts/addition_value_ceiling.py OUT/samples-512.pkl [POLICY_DIR]

On addition the exact-match verifier accepts one response, the sum's digits and eos, so the best value
of a prefix needs no sampling: V*(prefix) = 0 once a digit differs from the sum's, and otherwise the
policy's probability of writing the remaining digits and eos, one forward pass over the right answer.
(A response the verifier would also accept with surrounding whitespace counts as wrong here, so V* is
a slight underestimate.) The script prints the EV of V* over every response state of the samples, as
value pretraining measures it (token-mean, Monte-Carlo outcome returns), and each state position's
share of the squared error around the mean return and of what V* leaves, positions counted from the
response's end (1 = the state before its last token, where the whole answer is written and only eos
follows): the positions whose share V* removes are where a critic has to look. POLICY_DIR defaults to
runs/policy/r0, the policy that wrote the samples.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch


def exact_values(model, tokenizer, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """V*(s_t) for every state t of one response (before each of its tokens)."""
    a, b = tokenizer.decode(prompt_ids, skip_special_tokens=True).rstrip("=").split("+")
    right = tokenizer.encode(str(int(a) + int(b)), add_special_tokens=False) + [tokenizer.eos_token_id]
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt_ids + right])).logits[0].log_softmax(-1)
    start = len(prompt_ids) - 1  # the position that predicts the first response token
    step = torch.tensor([logprobs[start + k, token].item() for k, token in enumerate(right)])
    return [float(step[t:].sum().exp()) if response_ids[:t] == right[:t] else 0.0 for t in range(len(response_ids))]


def main(samples_file: Path, policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt_ids, response_ids, rewards, _ = pickle.loads(samples_file.read_bytes())
    tokenizer, model = AutoTokenizer.from_pretrained(policy_dir), AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    returns, values, positions = [], [], []
    for prompt, response, reward in zip(prompt_ids, response_ids, rewards):
        for t, value in enumerate(exact_values(model, tokenizer, prompt, response)):
            returns.append(reward), values.append(value), positions.append(len(response) - t)
    returns, values, positions = map(torch.tensor, (returns, values, positions))
    var = returns.var(unbiased=False)
    print(f"{len(rewards)} responses, {len(returns)} states, mean reward {sum(rewards) / len(rewards):.3f}")
    print(f"exact oracle EV over all states: {1 - (returns - values).var(unbiased=False) / var:.3f}")
    print("tokens left | states | share of Var(G) | share V* leaves | share V* explains | mean V*")
    for t in range(1, int(positions.max()) + 1):
        at = positions == t
        total = ((returns[at] - returns.mean()) ** 2).sum() / len(returns) / var
        left = ((returns[at] - values[at]) ** 2).sum() / len(returns) / var
        print(f"{t} | {int(at.sum())} | {total:.3f} | {left:.3f} | {total - left:.3f} | {values[at].mean():.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) > 2 else "runs/policy/r0"))
