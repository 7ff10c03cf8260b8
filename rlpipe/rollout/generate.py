"""The one generation path: a group of responses per prompt, through whichever backend is configured.

The rollout stage, value pretraining and evaluation all call `generate_groups`. Each prompt's group is
`len(greedy_pattern)` consecutive rows (row k greedy when `greedy_pattern[k]`), sampled with the
per-prompt uniforms and seeds of one named stream (`rollout@r3`, `eval greedy`, `value_pretrain`), so a
response depends only on (seed, stream, prompt id, k), never on batching or on the backend's order.
Verification is `rlpipe.rewards.verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlpipe.config import DataConfig
from rlpipe.data.prompts import encode_prompts
from rlpipe.rollout.base import GenerationOutput, GenerationRows, SamplingSpec
from rlpipe.rollout.sampling import prompt_seed, prompt_uniforms


@dataclass
class Groups:
    """Generated rows, the `per_group` rows of each prompt consecutive."""

    per_group: int
    prompt_ids: list[list[int]]
    """Token ids of each row's prompt."""
    greedy: torch.Tensor
    """(R,) bool: the row was decoded greedily."""
    output: GenerationOutput
    texts: list[str]
    """Each response decoded, special tokens dropped."""

    def per_row(self, values: list) -> list:
        """A per-prompt list repeated for each row of the prompt's group."""
        return [v for v in values for _ in range(self.per_group)]


def generate_groups(backend, prompt_texts: list[str], prompt_ids: list[int], *, greedy_pattern: list[bool],
                    stream: str, seed: int, spec: SamplingSpec, data: DataConfig, desc: str) -> Groups:
    """Generate `len(greedy_pattern)` responses for each prompt with `backend` (see rlpipe.rollout)."""
    encoded = encode_prompts(backend.tokenizer, prompt_texts, data)
    return generate_from_ids(backend, encoded, prompt_ids, greedy_pattern=greedy_pattern, stream=stream, seed=seed,
                             spec=spec, desc=desc)


def generate_from_ids(backend, encoded: list[list[int]], keys: list[int], *, greedy_pattern: list[bool], stream: str,
                      seed: int, spec: SamplingSpec, desc: str) -> Groups:
    """`generate_groups` on prompts given as token ids (e.g. a prompt followed by part of a response, which
    re-encoding its text need not reproduce), each seeded by its distinct integer key."""
    per_group = len(greedy_pattern)
    row_prompt_ids = [ids for ids in encoded for _ in range(per_group)]
    uniforms = prompt_uniforms(seed, stream, keys, per_group, spec.max_new_tokens)
    seeds = [prompt_seed(seed, stream, key) for key in keys for _ in range(per_group)]
    greedy = torch.tensor([flag for _ in keys for flag in greedy_pattern])
    out = backend.generate(GenerationRows(row_prompt_ids, uniforms, greedy, seeds), spec, desc=desc)
    texts = backend.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    return Groups(per_group, row_prompt_ids, greedy, out, texts)
