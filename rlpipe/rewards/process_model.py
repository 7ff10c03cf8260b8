"""A model-based process reward scorer: a HF model directory that scores the step ends.

The model is a token-classification model with one label (`AutoModelForTokenClassification`, as the
critic), run over prompt + response; the step reward of step k is sigmoid(score) at the step's last
token e_{b,k}. The rule-based verifier still decides where steps end and the outcome; with
`reward.process_model` set, the reward stage replaces the verifier's step rewards by the model's.
Only then does the reward stage load torch and transformers.
"""

from __future__ import annotations

from pathlib import Path


class ModelStepScorer:
    def __init__(self, path: str | Path, token_budget: int = 16384):
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{path}: reward.process_model is not a model directory (no config.json)")
        self.model = AutoModelForTokenClassification.from_pretrained(str(path)).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path}: a process reward model needs one output label, it has {self.model.config.num_labels}")
        self.pad_id = AutoTokenizer.from_pretrained(str(path)).pad_token_id or 0
        self.token_budget = token_budget

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
              step_ends: list[list[int]]) -> list[list[float]]:
        """Per response, sigmoid(score) at each step end (0-based response token index)."""
        import torch

        from rlpipe.models.sequences import pack, token_budget_chunks

        width = max(len(r) for r in response_ids)
        out: list[list[float]] = []
        with torch.no_grad():
            for rows in token_budget_chunks([len(p) + width for p in prompt_ids], self.token_budget):
                batch = pack(prompt_ids[rows], response_ids[rows], self.pad_id, response_width=width)
                logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                    position_ids=batch.position_ids).logits[..., 0]
                at_response = torch.sigmoid(logits[:, batch.prompt_width:].float())
                for row, ends in zip(at_response, step_ends[rows]):
                    out.append([float(row[e]) for e in ends])
        return out
