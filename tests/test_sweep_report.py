"""The preset sweep's report (rlpipe/sweep_report.py) on hand-made run records: intervals, paired
differences, rounds to target, the tables' figures and the plots."""

import json
import math

import pytest

from rlpipe.sweep_report import Estimate, RunRecord, estimate, load_records, paired_difference, verdict, write_report


def test_estimate_is_the_student_t_interval_of_the_mean():
    e = estimate([1.0, 2.0, 3.0])
    assert e.mean == 2.0 and e.n == 3
    # t(0.975, 2) = 4.3027, sd = 1: 4.3027 / sqrt(3)
    assert e.half_width == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert str(e) == "2.000 ± 2.484"
    one = estimate([0.5, None, float("nan"), float("-inf"), -1.7976931348623157e308])
    assert (one.mean, one.half_width, one.n) == (0.5, None, 1) and str(one) == "0.500"
    assert str(estimate([])) == "-"


def test_paired_difference_takes_the_seeds_both_have():
    a = {0: 0.7, 1: 0.8, 2: 0.9, 3: 0.5}
    b = {0: 0.6, 1: 0.6, 2: 0.6}
    d = paired_difference(a, b)
    assert d.n == 3 and d.mean == pytest.approx(0.2)
    # differences 0.1, 0.2, 0.3: sd 0.1
    assert d.half_width == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)
    assert not d.excludes_zero  # three seeds: t = 4.30 makes the interval wide
    assert paired_difference({0: 0.79, 1: 0.8, 2: 0.81}, b).excludes_zero


def record(preset: str, seed: int, curve: list[float], correct_len: list[float], wrong_len: list[float],
           buckets: dict[str, tuple[float, float]], critic: list[float] | None = None) -> dict:
    stages = [{"stage": f"reward@r{k}", "round": f"r{k}", "metrics": {"reward/length_correct_mean": c,
                                                                 "reward/length_incorrect_mean": w,
                                                                 "reward/accuracy": 0.2 * k, "reward/std": 0.4}}
              for k, (c, w) in enumerate(zip(correct_len, wrong_len), start=1)]
    if critic:
        stages += [{"stage": "update", "round": f"r{k}", "metrics": {"value/explained_variance": ev}}
                   for k, ev in enumerate(critic, start=1)]
        stages += [{"stage": "advantage", "round": f"r{k}", "metrics": {"value/ev_fraction_of_ceiling": ev / 0.8,
                                                                      "value/oracle_explained_variance": 0.8}}
                   for k, ev in enumerate(critic, start=1)]
        stages.append({"stage": "value_pretrain", "round": "", "metrics": {"value/explained_variance": 0.3,
                                                                          "value/oracle_explained_variance": 0.6,
                                                                          "value/ev_fraction_of_ceiling": 0.5}})
    else:  # critic-free presets run the stage too, and log that they have no critic
        stages.append({"stage": "value_pretrain", "round": "", "metrics": {"value/critic": 0.0}})
    return {"preset": preset, "seed": seed, "experiment": f"{preset}-s{seed}", "wall_seconds": 100.0,
            "eval": {"pass@1": curve[-1], "pass@1_init": curve[0], "pass@k": curve[-1] + 0.1,
                     "by_difficulty": {b: {"pass@1": after, "pass@1_init": before, "prompts": 10}
                                       for b, (before, after) in buckets.items()},
                     "curve": [{"round": k, "pass@1": p} for k, p in enumerate(curve)]},
            "stages": stages}


@pytest.fixture
def sweep_dir(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    buckets = {"n3-carry": (0.1, 0.3), "n2-plain": (0.5, 0.9), "n2-carry": (0.3, 0.6)}
    records = [
        record("grpo", 0, [0.3, 0.6, 0.7], [20, 24], [10, 30], buckets),
        record("grpo", 1, [0.3, 0.5, 0.66], [22, 26], [12, 28], buckets),
        record("grpo", 2, [0.3, 0.55, 0.6], [21, 25], [11, 29], buckets),
        record("ppo", 0, [0.3, 0.4, 0.5], [18, 19], [9, 9], buckets, critic=[0.4, 0.6]),
    ]
    for raw in records:
        (runs / f"{raw['experiment']}.json").write_text(json.dumps(raw))
    (tmp_path / "sweep.json").write_text(json.dumps({"params_file": "examples/reasoning.yaml", "overrides": [],
                                                     "presets": ["grpo", "ppo"], "seeds": [0, 1, 2],
                                                     "code_commit": "abc1234"}))
    return tmp_path


def test_rounds_to_target_is_the_first_round_at_or_above_it(sweep_dir):
    records = {(r.preset, r.seed): r for r in load_records(sweep_dir)}
    assert records[("grpo", 0)].rounds_to(0.6) == 1
    assert records[("grpo", 1)].rounds_to(0.6) == 2
    assert records[("ppo", 0)].rounds_to(0.6) is None
    assert records[("grpo", 0)].per_round("reward", "reward/length_correct_mean") == [20, 24]
    assert isinstance(records[("ppo", 0)], RunRecord) and records[("ppo", 0)].rounds == 2


def test_the_report_holds_every_table_and_plot(sweep_dir):
    text = write_report(sweep_dir, target=0.6).read_text()
    assert "4 of 6 runs recorded; code abc1234" in text
    final = estimate([0.7, 0.66, 0.6])
    assert f"| grpo | 3 | 0.300 | {final} | - |" in text
    # ppo's seed 0 against grpo's: 0.5 - 0.7, in points; one seed, so no interval
    assert "| ppo | 1 | 0.300 | 0.500 | -20.0 |" in text
    # rounds to 0.6 per seed, in seed order; ppo never gets there
    assert "| 1, 2, 2 |" in text and "| never |" in text
    # lengths of round 1 and the last round, means over seeds: correct (20+22+21)/3, incorrect 11
    assert "| 21.0 / 11.0 | 25.0 / 29.0 |" in text
    # buckets in operand order, plain before carry; the init row; ppo's single seed has no interval
    header = next(line for line in text.splitlines() if line.startswith("| preset | n2"))
    assert header == "| preset | n2-carry | n2-plain | n3-carry |"
    assert "| (init) | 0.30 | 0.50 | 0.10 |" in text
    assert "| ppo | 0.60 | 0.90 | 0.30 |" in text
    # the training batches: round 1 and the last round; no update metrics in these records
    assert "| grpo | 0.200 / 0.400 | 0.400 / 0.400 | - / - |" in text
    # the critic: pretraining from the seed that ran it, then per round EV / fraction of the ceiling
    assert "| ppo | 0.30 / 0.60 / 0.50 | 0.40 / 0.80 / 0.50 | 0.60 / 0.80 / 0.75 |" in text
    for picture in ("pass_at_1.png", "lengths.png", "difficulty.png"):
        assert (sweep_dir / picture).stat().st_size > 10_000
        assert f"]({picture})" in text


def test_an_empty_sweep_reports_that_nothing_ran(tmp_path):
    (tmp_path / "runs").mkdir()
    text = write_report(tmp_path).read_text()
    assert "0 of ? runs recorded" in text and "| preset |" not in text


def test_verdicts_follow_the_interval_and_the_predicted_sign():
    assert verdict(Estimate(-2.0, 1.0, 3), -1) == "excludes 0, as predicted"
    assert verdict(Estimate(2.0, 1.0, 3), -1) == "excludes 0, opposite"
    assert verdict(Estimate(-2.0, 3.0, 3), -1) == "includes 0"
    assert verdict(Estimate(-2.0, None, 1), -1) == "too few seeds"


def test_the_claims_table_pairs_seeds(sweep_dir):
    buckets = {"n2-carry": (0.3, 0.6)}
    for seed, length in enumerate((30.0, 31.0, 31.0)):  # grpo's last-round correct lengths: 24, 26, 25
        raw = record("dr_grpo", seed, [0.3, 0.5, 0.6], [20, length], [10, 30], buckets)
        (sweep_dir / "runs" / f"dr-grpo-s{seed}.json").write_text(json.dumps(raw))
    text = write_report(sweep_dir).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| GRPO's 1/T prefers short correct answers"))
    # differences -6, -5, -6, seed by seed
    assert f"| 25.000 | 30.667 | {estimate([-6.0, -5.0, -6.0]).signed()} | 3 | excludes 0, as predicted |" in row
    assert estimate([-6.0, -5.0, -6.0]).signed() == "-5.667 ± 1.434"
