"""Synthetic verifiable tasks of the embedded default: seeded, exact, no download.

- `addition`: "37+45=" -> "82".
- `chain`: "12+34+5=" -> "46,51": the response writes each partial sum as one step, so a
  rule-based step verifier can score every step (process rewards).
- `reasoning`: "12+35+8=" with 2 to `max_terms` operands, with or without carries. A response may
  write the running sums as steps and then mark its answer, "12+35=47;47+8=55;#55", or jump to the
  answer, "#55"; only the number after the last ANSWER_MARKER counts. Each example records its
  difficulty bucket ("n3-carry"): a tiny model adds many operands far more often right when it writes
  the steps, so accuracy depends on both the bucket and the response's length.

Torch-free: `prepare` and `reward` use it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Characters the embedded tokenizer knows: what the tasks write, plus a little slack for real prompts.
TASK_ALPHABET = "0123456789+=,-*() "
# `reasoning` writes two more. Only its tokenizer has them (appended, so every other id is unchanged):
# a larger vocabulary would draw the embedded model's initial weights differently for the other tasks.
REASONING_ALPHABET = TASK_ALPHABET + "#;"
STEP_SEPARATOR = ","
REASONING_STEP_SEPARATOR = ";"
ANSWER_MARKER = "#"


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    meta: str = ""
    """Task-specific detail; for `chain`, the expected steps joined by STEP_SEPARATOR; for `reasoning`,
    the whole step-by-step solution (steps, then the marked answer)."""
    difficulty: str = ""
    """The example's difficulty bucket (`reasoning`: operand count and carries, "n4-nocarry"), for
    grouping results; empty for tasks without buckets."""


def task_alphabet(task: str) -> str:
    return REASONING_ALPHABET if task == "reasoning" else TASK_ALPHABET


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


# --- reasoning --------------------------------------------------------------------------------------
def has_carry(numbers: list[int]) -> bool:
    """Whether adding the numbers in order carries in any column: some column's digits sum past 9 (then
    some running sum carries; if none does, no step of the running sums carries either)."""
    column = 1
    while column <= max(numbers):
        if sum(n // column % 10 for n in numbers) > 9:
            return True
        column *= 10
    return False


def _no_carry_operands(rng: random.Random, count: int, digits: int) -> list[int]:
    """`count` operands of `digits` digits whose column sums all stay <= 9, uniform over such tuples
    column by column (stars and bars: `count` bars among slack + count slots)."""
    numbers = [0] * count
    for column in range(digits):
        low = 1 if column == digits - 1 and digits > 1 else 0  # no leading zero
        slack = 9 - low * count
        bars = sorted(rng.sample(range(slack + count), count))
        parts = [bars[0]] + [b - a - 1 for a, b in zip(bars, bars[1:])]
        numbers = [n + (low + p) * 10**column for n, p in zip(numbers, parts)]
    return numbers


def prompt_operands(prompt: str) -> list[int]:
    """The numbers of a synthetic prompt "a+b+...=" (addition's or reasoning's), in order."""
    return [int(n) for n in prompt.rstrip("=").split("+")]


def reasoning_steps(numbers: list[int]) -> list[str]:
    """The running-sum steps of a sum: "12+35=47", "47+8=55", ..."""
    steps, total = [], numbers[0]
    for n in numbers[1:]:
        steps.append(f"{total}+{n}={total + n}")
        total += n
    return steps


def reasoning_solution(numbers: list[int]) -> str:
    """The step-by-step response: "12+35=47;47+8=55;#55"."""
    steps = reasoning_steps(numbers)
    return REASONING_STEP_SEPARATOR.join([*steps, f"{ANSWER_MARKER}{sum(numbers)}"])


def reasoning_example(rng: random.Random, digits: int, min_terms: int, max_terms: int) -> Example:
    """Operand count uniform in [min_terms, max_terms], carries or none with probability 1/2 each."""
    terms, carry = rng.randint(min_terms, max_terms), rng.random() < 0.5
    if carry:
        numbers = _operands(rng, terms, digits)
        while not has_carry(numbers):
            numbers = _operands(rng, terms, digits)
    else:
        numbers = _no_carry_operands(rng, terms, digits)
    return Example(prompt="+".join(map(str, numbers)) + "=", answer=str(sum(numbers)),
                   meta=reasoning_solution(numbers), difficulty=difficulty_bucket(terms, carry))


def difficulty_bucket(terms: int, carry: bool) -> str:
    return f"n{terms}-{'carry' if carry else 'nocarry'}"


def final_answer(completion: str) -> str | None:
    """The text after the last ANSWER_MARKER, stripped; None when the completion marks no answer."""
    if ANSWER_MARKER not in completion:
        return None
    return completion.rsplit(ANSWER_MARKER, 1)[1].strip()


def longest_answer_chars(task: str, digits: int, chain_terms: int, max_terms: int = 2) -> int:
    """Characters of the longest correct response the synthetic task can ask for (eos not counted);
    for `reasoning`, the step-by-step one."""
    top = 10**digits - 1
    if task == "addition":
        return len(str(2 * top))
    if task == "reasoning":
        return len(reasoning_solution([top] * max_terms))
    sums = [k * top for k in range(2, chain_terms + 1)]
    return sum(len(str(v)) for v in sums) + len(STEP_SEPARATOR) * (len(sums) - 1)


def longest_prompt_chars(task: str, digits: int, chain_terms: int, max_terms: int = 2) -> int:
    """Characters of the synthetic task's longest prompt ("99+99=" for 2-digit addition)."""
    terms = {"addition": 2, "chain": chain_terms, "reasoning": max_terms}[task]
    return terms * digits + terms  # the operands, the `+` between them and the `=`


def generate_split(task: str, seed: int, count: int, digits: int, chain_terms: int,
                   exclude: frozenset[str] = frozenset(), terms: tuple[int, int] = (2, 2)) -> list[Example]:
    """`count` distinct examples whose prompts are not in `exclude` (the other split), seeded. `terms`:
    the operand counts of `reasoning` (min, max)."""
    rng = random.Random(seed)
    seen: set[str] = set(exclude)
    examples: list[Example] = []
    if task != "reasoning":
        space = (10**digits - (10 ** (digits - 1) if digits > 1 else 0)) ** (2 if task == "addition" else chain_terms)
        if count + len(exclude) > space:
            raise ValueError(f"data: {task} with {digits} digits has only {space} distinct prompts; "
                             f"asked for {count} beyond {len(exclude)} held out")
    # reasoning's buckets have spaces of very different sizes (n2-nocarry with 1 digit: 55 prompts):
    # a full bucket only slows the draw, but a request beyond the whole space must not loop forever
    attempts, max_attempts = 0, 100 * count + 10_000
    while len(examples) < count:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(f"data: found only {len(examples)} distinct {task} prompts of {count} asked "
                             f"(beyond {len(exclude)} held out) in {max_attempts} draws; lower data.num_train or "
                             f"data.num_test, or raise data.digits")
        if task == "addition":
            ex = addition_example(rng, digits)
        elif task == "chain":
            ex = chain_example(rng, digits, chain_terms)
        else:
            ex = reasoning_example(rng, digits, *terms)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            examples.append(ex)
    return examples


def target_text(answer: str, meta: str, task: str, with_steps: bool = True) -> str:
    """The response a perfect policy writes (used by the SFT warm start): the steps for `chain`; for
    `reasoning`, the step-by-step solution or, without steps, the marked answer alone."""
    if task == "chain":
        return meta
    if task == "reasoning":
        return meta if with_steps else f"{ANSWER_MARKER}{answer}"
    return answer


def right_responses(answer: str, meta: str, task: str) -> list[str]:
    """Every response a perfect policy may write to one prompt: `target_text` with and without steps (on
    `reasoning` the running sums and the marked answer alone; one response on the other tasks)."""
    return sorted({target_text(answer, meta, task, with_steps) for with_steps in (True, False)})
