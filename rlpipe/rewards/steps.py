"""Multi-step rewards on token indices: a verifier reports each step's end as a character offset of
the response text; the advantage estimators need the index of the step's last token."""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

from rlpipe.rewards.verifiers import Verdict


def token_char_ends(tokenizer, response_ids: list[int]) -> list[int]:
    """For each response token, the index one past its last character in the decoded text."""
    pieces = [tokenizer.decode([token], skip_special_tokens=True) for token in response_ids]
    return list(accumulate(len(p) for p in pieces))


def char_to_token(char_ends: list[int], char_index: int) -> int:
    """The token that holds character `char_index` (the last token if the text is shorter)."""
    for t, end in enumerate(char_ends):
        if char_index < end:
            return t
    return len(char_ends) - 1


def place_steps(verdict: Verdict, response_ids: list[int], tokenizer) -> tuple[list[int], list[float]]:
    """(step_ends, step_rewards) on token indices. The last step always ends at the last token, so
    that eos belongs to it; a verdict without steps is one step holding the outcome reward."""
    last = len(response_ids) - 1
    if not verdict.step_char_ends or last < 0:
        return [max(last, 0)], [verdict.reward]
    char_ends = token_char_ends(tokenizer, response_ids)
    ends = [char_to_token(char_ends, c) for c in verdict.step_char_ends]
    ends[-1] = last
    return ends, list(verdict.step_rewards)


def load_step_tokenizer(tokenizer_path: Path):
    from tokenizers import Tokenizer

    if not tokenizer_path.is_file():
        raise FileNotFoundError(f"{tokenizer_path}: the step verifier needs the policy's tokenizer.json to map steps onto tokens")
    return Tokenizer.from_file(str(tokenizer_path))
