"""Reward shaping outside the verifier: DAPO's soft overlong punishment. Plain Python, no torch."""

from __future__ import annotations


def overlong_penalty(length: int, max_new_tokens: int, cache_len: int) -> float:
    """DAPO soft punishment: 0 up to L_max - L_cache tokens, then a linear ramp to -1 at L_max, -1 beyond.

    penalty = 0                                  if T <= L_max - L_cache
            = ((L_max - L_cache) - T) / L_cache  if L_max - L_cache < T <= L_max
            = -1                                 if T > L_max
    """
    free = max_new_tokens - cache_len
    if length <= free:
        return 0.0
    if length <= max_new_tokens:
        return (free - length) / cache_len
    return -1.0
