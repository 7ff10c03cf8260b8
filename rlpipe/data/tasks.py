"""Synthetic verifiable tasks of the embedded default: seeded, exact, no download.

- `addition`: "37+45=" -> "82".
- `chain`: "12+34+5=" -> "46,51": the response writes each partial sum as one step, so a
  rule-based step verifier can score every step (process rewards).

Torch-free: `prepare` and `reward` use it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Characters the embedded tokenizer knows: what the tasks write, plus a little slack for real prompts.
TASK_ALPHABET = "0123456789+=,-*() "
STEP_SEPARATOR = ","


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    meta: str = ""
    """Task-specific detail; for `chain`, the expected steps joined by STEP_SEPARATOR."""


def _operands(rng: random.Random, count: int, digits: int) -> list[int]:
    low = 10 ** (digits - 1) if digits > 1 else 0
    return [rng.randint(low, 10**digits - 1) for _ in range(count)]


def addition_example(rng: random.Random, digits: int) -> Example:
    a, b = _operands(rng, 2, digits)
    return Example(prompt=f"{a}+{b}=", answer=str(a + b))


def chain_example(rng: random.Random, digits: int, terms: int) -> Example:
    numbers = _operands(rng, terms, digits)
    partial_sums = [sum(numbers[: i + 1]) for i in range(1, terms)]
    steps = STEP_SEPARATOR.join(map(str, partial_sums))
    return Example(prompt="+".join(map(str, numbers)) + "=", answer=str(partial_sums[-1]), meta=steps)


def longest_answer_chars(task: str, digits: int, chain_terms: int) -> int:
    """Characters of the longest correct response the synthetic task can ask for (eos not counted)."""
    top = 10**digits - 1
    if task == "addition":
        return len(str(2 * top))
    sums = [k * top for k in range(2, chain_terms + 1)]
    return sum(len(str(v)) for v in sums) + len(STEP_SEPARATOR) * (len(sums) - 1)


def generate_split(task: str, seed: int, count: int, digits: int, chain_terms: int,
                   exclude: frozenset[str] = frozenset()) -> list[Example]:
    """`count` distinct examples whose prompts are not in `exclude` (the other split), seeded."""
    rng = random.Random(seed)
    seen: set[str] = set(exclude)
    examples: list[Example] = []
    space = (10**digits - (10 ** (digits - 1) if digits > 1 else 0)) ** (2 if task == "addition" else chain_terms)
    if count + len(exclude) > space:
        raise ValueError(f"data: {task} with {digits} digits has only {space} distinct prompts; "
                         f"asked for {count} beyond {len(exclude)} held out")
    while len(examples) < count:
        ex = addition_example(rng, digits) if task == "addition" else chain_example(rng, digits, chain_terms)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            examples.append(ex)
    return examples


def target_text(answer: str, meta: str, task: str) -> str:
    """The response a perfect policy writes (used by the SFT warm start): the steps for `chain`."""
    return meta if task == "chain" else answer
