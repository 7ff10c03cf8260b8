"""Turning prompt text into token ids: plain, or wrapped in the tokenizer's chat template.

`prepare` stores the user message (after `data.prompt_template`); the chat template, which belongs to
the policy's tokenizer, is applied here, at tokenization time, by every stage that generates.
"""

from __future__ import annotations

from rlpipe.config import DataConfig


def encode_prompts(tokenizer, prompts: list[str], data: DataConfig | None = None) -> list[list[int]]:
    if data is None or not data.chat_template:
        return tokenizer(prompts)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("data.chat_template is true but the policy's tokenizer has no chat template")
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return [
        list(tokenizer.apply_chat_template([*system, {"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for p in prompts
    ]
