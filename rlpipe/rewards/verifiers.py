"""Rule-based verifiers of the synthetic tasks: plain functions over completions and dataset columns.

Each takes the batch's completions (decoded response text) with the `answer` and `meta` columns and
returns one `Verdict` per completion: the outcome reward, whether it is correct, and its steps (the
character offset where each step ends, and that step's reward). A verifier with no notion of steps
returns none; the response is then one step ending at its last token (ORM = PRM with one step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpipe.data.tasks import ANSWER_MARKER, REASONING_STEP_SEPARATOR, STEP_SEPARATOR, final_answer


@dataclass(frozen=True)
class Verdict:
    reward: float
    correct: bool
    step_char_ends: list[int] = field(default_factory=list)
    """0-based index of the last character of each step in the completion text."""
    step_rewards: list[float] = field(default_factory=list)


def exact_match(completions: list[str], answers: list[str], metas: list[str]) -> list[Verdict]:
    """1 when the stripped completion equals the reference answer, else 0."""
    verdicts = []
    for completion, answer in zip(completions, answers):
        correct = completion.strip() == answer.strip()
        verdicts.append(Verdict(reward=float(correct), correct=correct))
    return verdicts


def chain_steps(completions: list[str], answers: list[str], metas: list[str]) -> list[Verdict]:
    """`chain` task: the completion lists the partial sums, one step each, separated by commas.

    Step k earns 1 when its number equals the k-th expected partial sum, else 0; steps beyond the
    expected count earn 0. The outcome is correct when the whole list matches exactly.
    """
    verdicts = []
    for completion, meta in zip(completions, metas):
        expected = meta.split(STEP_SEPARATOR)
        steps = completion.split(STEP_SEPARATOR)
        ends, rewards, offset = [], [], 0
        for k, step in enumerate(steps):
            offset += len(step)
            if step.strip():
                ends.append(offset - 1)
                rewards.append(float(k < len(expected) and step.strip() == expected[k]))
            offset += len(STEP_SEPARATOR)
        correct = [s.strip() for s in steps] == expected
        verdicts.append(Verdict(reward=float(correct), correct=correct, step_char_ends=ends, step_rewards=rewards))
    return verdicts


def marked_answer(completions: list[str], answers: list[str], metas: list[str]) -> list[Verdict]:
    """`reasoning` task: correct when the text after the last ANSWER_MARKER equals the answer exactly
    ("12+35=47;47+8=55;#55" and "#55" both are, for 55; no marker, no answer).

    The completion's pieces between REASONING_STEP_SEPARATORs are its steps: a running-sum step earns 1
    when it equals the expected step at its place (the reference solution in `meta`), the piece holding
    the answer marker earns the outcome. A direct answer is one step.
    """
    verdicts = []
    for completion, answer, meta in zip(completions, answers, metas):
        given = final_answer(completion)
        correct = given is not None and given == answer.strip()
        expected = meta.split(REASONING_STEP_SEPARATOR)[:-1]  # the reference's steps, its answer left out
        ends, rewards, offset = [], [], 0
        for k, piece in enumerate(completion.split(REASONING_STEP_SEPARATOR)):
            offset += len(piece)
            if piece.strip():
                ends.append(offset - 1)
                is_step = ANSWER_MARKER not in piece
                rewards.append(float(k < len(expected) and piece.strip() == expected[k]) if is_step else float(correct))
            offset += len(REASONING_STEP_SEPARATOR)
        verdicts.append(Verdict(reward=float(correct), correct=correct, step_char_ends=ends, step_rewards=rewards))
    return verdicts
