"""The `reasoning` task: graded difficulty, the step format, and its verifier (marked_answer)."""

from __future__ import annotations

import collections

import pytest

from rlpipe.config import params_from_dict
from rlpipe.config.params import ParamsError
from rlpipe.data.tasks import (final_answer, generate_split, has_carry, longest_answer_chars, longest_prompt_chars,
                               prompt_operands, reasoning_solution, target_text, task_alphabet)
from rlpipe.rewards import verify
from rlpipe.stages.init import step_targets


def split(count=2000, digits=2, terms=(2, 5), seed=0):
    return generate_split("reasoning", seed, count, digits, 3, terms=terms)


def numbers_of(prompt: str) -> list[int]:
    return [int(n) for n in prompt.rstrip("=").split("+")]


def test_answers_are_exact_and_the_solution_writes_the_running_sums():
    assert reasoning_solution([12, 35, 8]) == "12+35=47;47+8=55;#55"
    assert prompt_operands("12+35+8=") == [12, 35, 8]
    for ex in split(500):
        numbers = numbers_of(ex.prompt)
        assert ex.answer == str(sum(numbers))
        steps, marked = ex.meta.rsplit(";", 1)
        assert marked == f"#{ex.answer}"
        total = numbers[0]
        for k, step in enumerate(steps.split(";")):
            left, result = step.split("=")
            a, b = map(int, left.split("+"))
            assert (a, b, int(result)) == (total, numbers[k + 1], total + numbers[k + 1])
            total += numbers[k + 1]


def test_difficulty_buckets_are_graded_balanced_and_true():
    examples = split(4000)
    counts = collections.Counter(ex.difficulty for ex in examples)
    assert set(counts) == {f"n{n}-{c}" for n in range(2, 6) for c in ("carry", "nocarry")}
    assert min(counts.values()) > 0.6 * 4000 / 8  # about even: 8 buckets
    for ex in examples:
        numbers = numbers_of(ex.prompt)
        assert ex.difficulty == f"n{len(numbers)}-{'carry' if has_carry(numbers) else 'nocarry'}"
        assert all(10 <= n <= 99 for n in numbers)  # 2-digit operands, no leading zero
    assert has_carry([15, 7]) and has_carry([50, 60]) and not has_carry([12, 30, 41]) and not has_carry([5, 4])


def test_splits_are_seeded_distinct_and_bounded():
    assert split(300) == split(300)
    assert len({ex.prompt for ex in split(3000)}) == 3000
    # 1-digit operands, 2 terms: 100 prompts exist; asking for more fails instead of looping forever
    with pytest.raises(ValueError, match="distinct reasoning prompts"):
        split(200, digits=1, terms=(2, 2))
    assert longest_answer_chars("reasoning", 2, 3, 5) == len("99+99=198;198+99=297;297+99=396;396+99=495;#495")


@pytest.mark.parametrize("task, digits", [("addition", 1), ("addition", 3), ("chain", 2), ("reasoning", 2),
                                          ("reasoning", 3)])
def test_the_longest_prompt_is_the_longest_a_split_holds(task, digits):
    """`longest_prompt_chars` (what the params check holds the embedded model's context to) is reached by
    a split and never passed."""
    prompts = [ex.prompt for ex in generate_split(task, 0, 60, digits, 3, terms=(2, 5))]
    assert max(map(len, prompts)) == longest_prompt_chars(task, digits, 3, 5)


def test_with_steps_and_direct_answers_are_both_verified():
    meta = reasoning_solution([12, 35, 8])
    completions = ["12+35=47;47+8=55;#55", "#55", " #55 ", "12+35=47;47+8=56;#55", "12+35=47;47+8=55;#56",
                   "55", "#055", "12+35=47;47+8=55", "#5;#55", "#55;3", ""]
    verdicts = verify("marked_answer", completions, ["55"] * len(completions), [meta] * len(completions))
    assert [v.correct for v in verdicts] == [True, True, True, True, False, False, False, False, True, False, False]
    assert [v.reward for v in verdicts] == [float(v.correct) for v in verdicts]
    # the steps: each running sum checked against the reference's, the marked answer carries the outcome
    assert verdicts[0].step_char_ends == [7, 15, 19] and verdicts[0].step_rewards == [1.0, 1.0, 1.0]
    assert verdicts[1].step_char_ends == [2] and verdicts[1].step_rewards == [1.0]
    assert verdicts[3].step_rewards == [1.0, 0.0, 1.0]
    assert verdicts[4].step_rewards == [1.0, 1.0, 0.0]
    assert final_answer("1+2=3;#3") == "3" and final_answer("3") is None


def test_warm_start_mixes_step_and_direct_targets():
    with_steps = step_targets(1000, 0.3, seed=0)
    assert sum(with_steps) == 300 and with_steps == step_targets(1000, 0.3, seed=0)
    ex = split(1)[0]
    assert target_text(ex.answer, ex.meta, "reasoning", True) == ex.meta
    assert target_text(ex.answer, ex.meta, "reasoning", False) == f"#{ex.answer}"
    assert target_text("82", "", "addition", False) == "82"  # other tasks ignore the flag
    # only the reasoning tokenizer has the two extra characters, appended: the other tasks' ids are unchanged
    assert task_alphabet("reasoning").startswith(task_alphabet("addition")) and "#" not in task_alphabet("addition")


def test_config_names_the_bad_key():
    params = params_from_dict({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 48}})
    assert params.resolved_verifier() == "marked_answer"
    cases = [({"data": {"task": "reasoning", "min_terms": 4, "max_terms": 3}}, "data.min_terms: must be <="),
             ({"data": {"task": "reasoning", "step_target_fraction": 1.5}}, "data.step_target_fraction"),
             ({"data": {"task": "reasoning", "max_terms": 9}}, "data.max_terms"),
             ({"data": {"task": "reasoning"}, "reward": {"verifier": "exact_match"}}, "reward.verifier: 'exact_match'")]
    for raw, message in cases:
        with pytest.raises(ParamsError, match=message):
            params_from_dict(raw)
    with pytest.warns(UserWarning, match="max_new_tokens = 8 is shorter than the longest 'reasoning' answer"):
        params_from_dict({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 8}})
