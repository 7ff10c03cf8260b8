"""`math` verifier: equivalences, bounded time on pathological completions, GSM8K's own references."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest

from conftest import REPO, SHARED_DATA
from rlpipe.rewards.math import (
    DEFAULT_TIMEOUT_S,
    MAX_COMPLETION_CHARS,
    MathVerifyPool,
    completion_tail,
    final_answer_span,
    gold_latex,
    math_verify_batch,
    plain_boxed,
)

GSM8K = SHARED_DATA / "gsm8k"
FAST_TIMEOUT_S = 2.0
"""The bound for the batch of pathological cases: all score 0 either way, and a shorter bound keeps
the test short; `test_default_bound_kills_and_the_pool_recovers` checks DEFAULT_TIMEOUT_S itself."""
BOUND_S = 10.0
"""Every sample, however pathological, must be answered within this."""


@pytest.fixture(scope="module")
def pool():
    with MathVerifyPool() as shared:
        yield shared


EQUIVALENCES = [
    # (completion, gold, correct)
    ("The final answer is \\boxed{72}.", "72", True),
    ("so she sold 48+24=72 clips. The answer is 72.", "72", True),
    ("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72", True),
    ("$72$", "72", True),
    ("\\boxed{72.0}", "72", True),
    ("\\boxed{72}", "72.0", True),
    ("The answer is 0.5", "1/2", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac12}", "1/2", True),
    ("\\boxed{1/2}", "\\frac{1}{2}", True),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", True),
    ("The answer is 1,000.", "1000", True),
    ("#### 1,000", "1,000", True),
    ("The answer is 1000.", "1,000", True),
    ("\\boxed{2,520,000}", "2520000", True),
    ("He paid $1,080 in total.\n#### 1080", "1,080", True),
    ("The answer is -3.", "-3", True),
    # GSM8K's marker wins over an earlier "answer" (math-verify alone would take "8" here)
    ("Jerry answered 25-8=<<25-8=17>>17 questions correctly.\n#### 17", "17", True),
    # answers as real models write them: a Markdown heading that begins with #### is not the marker
    ("#### Step 2: Money\nShe sells 9 eggs at $2: 9*2 = 18 dollars.\nThe answer is \\boxed{18}", "18", True),
    ("#### Step 2: Money\nShe earns 18 dollars.", "18", True),
    ("#### Step 1: Eggs\n16-3-4 = 9\n#### Step 2: Money\n9*2 = 18\n#### 18", "18", True),
    ("#### Step 18: Done\nSo the total is 21.", "18", False),  # the heading's number is not the answer
    # a percent sign, a unit or spaced digit groups inside \boxed{} are the plain number
    ("\\boxed{18\\%}", "18", True),
    ("\\boxed{18%}", "18", True),
    ("\\boxed{18.5\\%}", "18.5", True),
    ("\\boxed{18 eggs}", "18", True),
    ("\\boxed{18 eggs}", "19", False),
    ("\\boxed{1 080}", "1080", True),
    ("\\boxed{1\\,080}", "1080", True),
    ("\\boxed{1 080 eggs}", "1,080", True),
    ("\\boxed{2 3}", "23", False),  # not a digit group of three: left alone, not read as 23
    ("\\boxed{3 \\pi}", "3", False),  # mathematics, not a unit
    ("The answer is 73.", "72", False),
    ("\\boxed{0.51}", "1/2", False),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", False),
    ("#### 1,001", "1,000", False),
    ("", "72", False),
    ("   \n", "72", False),
    ("I don't know.", "72", False),
    ("\\boxed{72}", "", False),
]


@pytest.mark.parametrize("completion, gold, correct", EQUIVALENCES)
def test_equivalences(completion, gold, correct):
    (verdict,) = math_verify_batch([completion], [gold], [""])
    assert (verdict.correct, verdict.reward) == (correct, float(correct))
    assert verdict.step_char_ends == [] and verdict.step_rewards == []


def test_batch_keeps_order():
    completions = [c for c, _, _ in EQUIVALENCES]
    golds = [g for _, g, _ in EQUIVALENCES]
    verdicts = math_verify_batch(completions, golds, [""] * len(completions))
    assert [v.correct for v in verdicts] == [ok for _, _, ok in EQUIVALENCES]


def test_gold_and_completion_preparation():
    assert gold_latex(" 1,000 ") == "\\boxed{1000}"
    assert gold_latex("-2,520,000.5") == "\\boxed{-2520000.5}"
    assert gold_latex("1,2") == "\\boxed{1,2}"  # not a thousands-separated number: left alone
    assert gold_latex("$\\frac{1}{2}$") == "$\\frac{1}{2}$"
    assert final_answer_span("a\n#### 17\n") == "17"
    assert final_answer_span("#### 3\n#### 4 apples\nthanks") == "4 apples"
    assert final_answer_span("no marker 5") == "no marker 5"
    assert final_answer_span("#### Step 2: Money\n18 dollars") == "#### Step 2: Money\n18 dollars"  # a heading
    assert final_answer_span("#### Step 1\nx\n#### $18\n") == "$18"
    assert plain_boxed("so \\boxed{18\\%} and \\boxed{1 080 eggs}") == "so \\boxed{18} and \\boxed{1080}"
    for unchanged in ("\\boxed{2 3}", "\\boxed{2x}", "\\boxed{3 pi}", "\\boxed{x+1}", "\\boxed{\\frac{1}{2}}",
                      "\\boxed{12 dollars and 5 cents}"):
        assert plain_boxed(unchanged) == unchanged
    long = "x" * (3 * MAX_COMPLETION_CHARS) + "\\boxed{72}"
    assert completion_tail(long).endswith("\\boxed{72}") and len(completion_tail(long)) == MAX_COMPLETION_CHARS


def _pathological(marker: str) -> dict[str, str]:
    """Completions that hang, blow up or look like code; none may score, none may run."""
    touch = f"__import__('os').system('touch {marker}')"
    return {
        "nested parens": "(" * 5000 + "1" + ")" * 5000,
        "boxed nested parens": "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
        "nested frac": "$" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "$",
        "boxed nested frac": "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}",
        "nested braces": "\\boxed{" + "{" * 10000 + "1" + "}" * 10000 + "}",
        "nested sqrt": "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
        "power tower": "The answer is 9^9^9^9^9^9",
        "boxed power tower": "\\boxed{9^{9^{9^{9^{9^{9}}}}}}",
        "python power tower": "The answer is 10**10**10",
        "huge factorial": "\\boxed{100000000!}",
        "factorial of a power": "\\boxed{(10^{10})!}",
        "huge binomial": "\\boxed{\\binom{10^{12}}{10^{6}}}",
        "huge sum": "\\boxed{\\sum_{n=1}^{10^{100}} n^{n}}",
        "100k letters": "a" * 100_000,
        "100k digits": "1" * 100_000,
        "100k digit-space": "1 " * 50_000,
        "100k sum": "1+" * 50_000 + "1",
        "100k dollars": "$" * 100_000,
        "many boxes": "\\boxed{1} " * 20_000,
        "latex macro bomb": "\\def\\a{\\a\\a}\\boxed{\\a}",
        "wide matrix": "\\boxed{\\begin{pmatrix}" + "&".join(["1"] * 2000) + "\\end{pmatrix}}",
        "import os": touch,
        "boxed import os": "\\boxed{" + touch + "}",
        "eval": f'The answer is eval("{touch}")',
        "lambda": f"The answer is (lambda: {touch})()",
        "exec in markers": f"#### exec(\"{touch}\")",
        "infinite loop": "while True: pass",
        "huge exponent float": "The answer is 1e999999999",
    }


def test_pathological_completions_are_bounded_and_score_zero(pool, tmp_path):
    marker = tmp_path / "pwned"
    cases = _pathological(str(marker))
    assert len(cases) >= 20
    # A correct answer after each case: the pool must keep scoring after killing a worker.
    completions, golds = [], []
    for text in cases.values():
        completions += [text, "\\boxed{72}"]
        golds += ["72", "72"]
    scored = pool.score(completions, golds, timeout_s=FAST_TIMEOUT_S)
    timings = {name: scored[2 * k] for k, name in enumerate(cases)}
    slow = {name: round(s.seconds, 2) for name, s in timings.items() if s.seconds >= BOUND_S}
    assert not slow, f"past {BOUND_S} s: {slow}"
    scoring = [name for name, s in timings.items() if s.correct]
    assert not scoring, f"pathological cases scored: {scoring}"
    assert all(s.correct for s in scored[1::2]), "a correct answer after a killed worker was not scored 1"
    assert any(s.outcome == "timeout" for s in timings.values())  # the kill path did run
    assert not marker.exists(), "a completion was executed"


def test_default_bound_kills_and_the_pool_recovers(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="rlpipe.rewards.math"):
        tower, after = pool.score(["\\boxed{9^{9^{9^{9^{9}}}}} " + "x" * 500, "#### 72"], ["72", "72"])
    assert (tower.correct, tower.outcome) == (False, "timeout")
    assert DEFAULT_TIMEOUT_S <= tower.seconds < BOUND_S
    assert after.correct
    (line,) = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert line.startswith("math reward: sample 0 timed out") and len(line) < 200


def test_a_worker_killed_mid_sample_or_while_idle_is_replaced():
    with MathVerifyPool(workers=1) as single:
        pid = single.workers[0].process.pid
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        (crashed,) = single.score(["\\boxed{9^{9^{9^{9^{9}}}}}"], ["72"], timeout_s=30.0)
        assert (crashed.correct, crashed.outcome) == (False, "crashed") and crashed.seconds < BOUND_S
        idle = single.workers[0].process
        assert idle.pid != pid
        idle.kill()
        idle.join()
        assert [s.correct for s in single.score(["\\boxed{72}", "\\boxed{7}"], ["72", "72"])] == [True, False]


def test_parent_imports_neither_math_verify_nor_sympy():
    script = (
        "import sys\n"
        "from rlpipe.rewards import VERIFIERS\n"
        "heavy = lambda: sorted(m for m in ('math_verify', 'sympy', 'torch') if m in sys.modules)\n"
        "assert heavy() == [], heavy()\n"
        "verdicts = VERIFIERS.get('math')(['\\\\boxed{1/2}', 'The answer is 3.'], ['0.5', '4'], ['', ''])\n"
        "assert [v.reward for v in verdicts] == [1.0, 0.0], verdicts\n"
        "assert heavy() == [], heavy()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _gsm8k_references(path):
    """(full reference solution, the text after its last '####', thousands separators kept)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row["answer"] for row in rows], [row["answer"].rsplit("####", 1)[1].strip() for row in rows]


@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_references_score_one(pool, split):
    # The whole file: ~7.5k train rows take about 3 s on 2 cores, so no sample is needed.
    path = GSM8K / f"{split}.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    completions, golds = _gsm8k_references(path)
    assert any("," in gold for gold in golds) or split == "test"  # train has "#### 1,080"-style answers
    scored = pool.score(completions, golds)
    failed = [(i, golds[i]) for i, s in enumerate(scored) if not s.correct]
    assert len(failed) <= 0.005 * len(scored), f"{len(failed)}/{len(scored)} failed, e.g. {failed[:10]}"
