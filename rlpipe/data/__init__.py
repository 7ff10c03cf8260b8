"""Prompt data: the synthetic tasks, building the splits, choosing round prompts, tokenizing prompts."""
