"""Rewards: the verifier registry, and `verify`, which every stage that checks answers calls.

Verifiers are plain functions (completions, answers, metas) -> verdicts. `steps` places multi-step
rewards on token indices, `shaping` holds DAPO's overlong penalty, `process_model` a model-based step
scorer. Torch- and transformers-free: the reward stage loads only pyarrow and, for multi-step
verifiers, the Rust `tokenizers` library.
"""

from __future__ import annotations

from rlpipe.progress import progress
from rlpipe.registry import Registry
from rlpipe.rewards import verifiers

VERIFIERS = Registry("verifier")
VERIFIERS.register("exact_match")(verifiers.exact_match)
VERIFIERS.register("chain_steps")(verifiers.chain_steps)
VERIFIERS.register("marked_answer")(verifiers.marked_answer)


@VERIFIERS.register("math")
def _math(completions, answers, metas):
    from rlpipe.rewards.math import math_verify_batch

    return math_verify_batch(completions, answers, metas)


# Verdicts are computed in chunks, so that the progress bar moves on large rounds
SCORING_CHUNK = 4096


def verify(verifier: str, completions: list[str], answers: list[str], metas: list[str],
           desc: str | None = None) -> list[verifiers.Verdict]:
    """The verdict of each completion against its reference answer, by the named verifier."""
    check = VERIFIERS.get(verifier)
    verdicts: list[verifiers.Verdict] = []
    with progress(total=len(completions), desc=desc or f"score ({verifier})", unit="resp") as bar:
        for start in range(0, len(completions), SCORING_CHUNK):
            chunk = slice(start, start + SCORING_CHUNK)
            verdicts += check(completions[chunk], answers[chunk], metas[chunk])
            bar.update(len(completions[chunk]))
    return verdicts
