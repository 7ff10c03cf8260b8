"""Verifiers, step placement on tokens, and DAPO's overlong penalty (hand-computed)."""

from __future__ import annotations

import pytest

from rlpipe.rewards.steps import place_steps, token_char_ends
from rlpipe.stages.reward import reward_metrics
from rlpipe.rewards.shaping import overlong_penalty
from rlpipe.rewards.verifiers import Verdict, chain_steps, exact_match


def test_exact_match():
    verdicts = exact_match(["82", " 82 ", "83", ""], ["82"] * 4, [""] * 4)
    assert [v.correct for v in verdicts] == [True, True, False, False]
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0, 0.0]
    assert all(v.step_char_ends == [] for v in verdicts)


def test_chain_steps_scores_each_partial_sum():
    # "12+34+5=" expects partial sums 46, 51
    right, first_wrong, extra, empty = chain_steps(["46,51", "45,51", "46,51,9", ""], ["51"] * 4, ["46,51"] * 4)
    assert (right.correct, right.step_char_ends, right.step_rewards) == (True, [1, 4], [1.0, 1.0])
    assert (first_wrong.correct, first_wrong.step_rewards) == (False, [0.0, 1.0])
    assert (extra.correct, extra.step_char_ends, extra.step_rewards) == (False, [1, 4, 6], [1.0, 1.0, 0.0])
    assert (empty.correct, empty.step_char_ends) == (False, [])


@pytest.mark.parametrize(
    "length, expected",
    [
        (4, 0.0),  # T <= L_max - L_cache = 8 - 3 = 5: no penalty
        (5, 0.0),
        (6, -1 / 3),  # ((8 - 3) - 6) / 3
        (8, -1.0),  # ((8 - 3) - 8) / 3 = -1 at L_max
        (9, -1.0),  # beyond L_max
    ],
)
def test_overlong_penalty_regimes(length, expected):
    assert overlong_penalty(length, max_new_tokens=8, cache_len=3) == pytest.approx(expected)


def test_steps_land_on_tokens(tokenizer):
    text = "46,51"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    from tokenizers import Tokenizer

    core = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    assert token_char_ends(core, ids) == [1, 2, 3, 4, 5, 5]  # eos decodes to nothing
    ends, rewards = place_steps(Verdict(1.0, True, [1, 4], [1.0, 0.5]), ids, core)
    assert ends == [1, 5]  # the last step absorbs eos (token 5)
    assert rewards == [1.0, 0.5]
    # no steps: one step holding the outcome, at the last token
    assert place_steps(Verdict(0.0, False), ids, None) == ([5], [0.0])


def test_reward_metrics_exclude_greedy_rows():
    columns = {"is_greedy": [False, False, True], "reward": [1.0, 0.0, 1.0], "correct": [True, False, True],
               "overlong_penalty": [0.0, -0.5, 0.0], "step_ends": [[1], [1], [1]],
               "response_ids": [[5, 2], [5, 6, 7, 2], [5, 6, 2]]}
    m = reward_metrics(columns)
    assert m["reward/mean"] == 0.5 and m["reward/accuracy"] == 0.5
    assert m["reward/overlong_penalty_mean"] == -0.25 and m["reward/greedy_accuracy"] == 1.0
    assert m["reward/length_correct_mean"] == 2 and m["reward/length_incorrect_mean"] == 4


def test_model_based_process_scorer(tmp_path, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForTokenClassification

    from rlpipe.rewards.process_model import ModelStepScorer

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    prm = LlamaForTokenClassification(config).eval()
    prm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [tokenizer("1+2+3=")["input_ids"], tokenizer("10+5=")["input_ids"]]
    responses = [tokenizer("3,6", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                 tokenizer("15", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    scores = ModelStepScorer(tmp_path).score(prompts, responses, [[0, 3], [2]])
    assert [len(s) for s in scores] == [2, 1] and all(0 < x < 1 for s in scores for x in s)
    # the same as a direct forward of the unpadded sequence, read at the step-end tokens
    with torch.no_grad():
        direct = torch.sigmoid(prm(input_ids=torch.tensor([prompts[0] + responses[0]])).logits[0, :, 0])
    assert scores[0] == pytest.approx([float(direct[len(prompts[0]) + 0]), float(direct[len(prompts[0]) + 3])], abs=1e-5)


def test_scorer_rejects_a_non_model_directory(tmp_path):
    from rlpipe.rewards.process_model import ModelStepScorer

    with pytest.raises(FileNotFoundError, match="reward.process_model"):
        ModelStepScorer(tmp_path)
