"""Diagnostics: the seed's expected-value claims on the exact environment, and `rlpipe compare`."""

from __future__ import annotations

import csv

import pytest
import torch

from rlpipe.config import PRESETS
from rlpipe.diagnostics.expectations import (TabularEnv, asymptotic_grpo_r1_weight, check_expectations,
                                             exact_group_norm_weight)


@pytest.fixture(scope="module")
def rows():
    return {r.preset: r for r in check_expectations(m=4, groups_per_prompt=20000, seed=0)}


@pytest.mark.parametrize("preset", ["reinforce", "rloo", "remax", "orz"])
def test_unbiased_presets(rows, preset):
    # tolerance: 5% on the scale, cosine within 0.01 of 1 (Monte-Carlo error here is about 1%)
    assert abs(rows[preset].scale - 1) < 0.05 and rows[preset].cosine > 0.99
    assert rows[preset].holds


def test_dr_grpo_is_scaled_by_m_minus_one_over_m(rows):
    assert rows["dr_grpo"].scale == pytest.approx(3 / 4, abs=0.05) and rows["dr_grpo"].holds


def test_reinforce_pp_is_scaled_by_one_over_sigma(rows):
    assert rows["reinforce_pp"].holds and rows["reinforce_pp"].scale > 1.5


def test_reinforce_pp_baseline_is_scaled_by_the_centred_std(rows):
    row = rows["reinforce_pp_baseline"]
    assert row.holds and row.cosine > 0.99
    assert row.scale > 3 / 4  # the whitening scales up: sigma_c < 1 with binary rewards


def test_reinforce_pp_baseline_advantages_by_hand():
    """Two groups of 2 with binary rewards, one-token and two-token responses: A = r - group mean on every
    token, then whitened over the batch's 6 tokens (population std, eps 1e-6)."""
    from rlpipe.algorithms.build import compute_round_advantages
    from rlpipe.config import AlgorithmConfig

    spec = AlgorithmConfig(preset="reinforce_pp_baseline").resolve()
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])
    result = compute_round_advantages(spec, rewards=rewards, response_mask=mask, group_index=torch.tensor([0, 0, 1, 1]),
                                      old_logp=torch.zeros(4, 2, dtype=torch.float64),
                                      ref_logp=torch.zeros(4, 2, dtype=torch.float64))
    # centred: group 0 -> +0.5 (2 tokens), -0.5 (1 token); group 1 -> 0 (3 tokens). Token mean 0.5/6,
    # values [.5, .5, -.5, 0, 0, 0] minus 1/12, population std over 6 tokens
    tokens = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    whitened = (tokens - tokens.mean()) / (tokens.std(correction=0) + 1e-6)
    expected = torch.tensor([[whitened[0], whitened[1]], [whitened[2], 0.0], [whitened[3], whitened[4]], [whitened[5], 0.0]],
                            dtype=torch.float64)
    assert torch.allclose(result.advantages.double(), expected, atol=1e-6)


def test_grpo_r1_weights_prompts_by_the_exact_w(rows):
    detail = rows["grpo_r1"].detail
    for mc, exact in zip(detail["w_mc"], detail["w_exact"]):
        assert mc == pytest.approx(exact, rel=0.05)
    assert max(detail["w_exact"]) / min(detail["w_exact"]) > 1.03  # not proportional to grad J
    assert rows["grpo_r1"].holds


def test_per_prompt_weights_are_one_for_unbiased_presets(rows):
    assert all(w == pytest.approx(1.0, abs=0.05) for w in rows["rloo"].per_prompt)
    assert rows["grpo_r1"].per_prompt == pytest.approx(rows["grpo_r1"].detail["w_mc"], abs=1e-3)


def test_cli_writes_table_and_plot(tmp_path, monkeypatch):
    from rlpipe import cli
    from rlpipe.diagnostics import expectations

    fast = expectations.check_expectations
    monkeypatch.setattr(expectations, "check_expectations", lambda **kw: fast(**{**kw, "groups_per_prompt": 2000}))
    out = tmp_path / "expect"
    cli.main(["check-expectations", "--out", str(out)])
    assert (out / "expectations.md").read_text().startswith("| preset | bias | scale | cosine |")
    assert (out / "expectations.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exact_weight_matches_the_spec_and_the_asymptote():
    # docs/algorithms.md: "at small M the exact weight is flatter, e.g. 1.62-1.69 at M=4"
    weights = [exact_group_norm_weight(p, 4) for p in (0.2, 0.3, 0.5, 0.7)]
    assert all(1.6 < w < 1.72 for w in weights)
    # large M: the expansion ((M-1)/M)/sigma [1 + (1/2 - (1-2p)^2/(8 sigma^2))/M] takes over
    for p in (0.3, 0.5):
        assert exact_group_norm_weight(p, 200) == pytest.approx(asymptotic_grpo_r1_weight(p, 200), rel=0.01)


def test_environment_gradient_is_exact():
    env = TabularEnv.default()
    logits = env.logits.clone().requires_grad_(True)
    j = (torch.softmax(logits, -1) * env.correct).sum(-1).mean()
    j.backward()
    assert torch.allclose(logits.grad, env.grad_j())
    assert len(set(round(float(p), 2) for p in env.p)) == len(env.p)  # prompts differ in p(x)


def test_compare_on_a_round(tmp_path, monkeypatch):
    from rlpipe import paths
    from rlpipe.diagnostics.compare import coefficients, compare_round, load_round
    from test_rounds import mini_params, run_round

    from rlpipe.data.splits import write_splits as prepare
    from rlpipe.stages.init import init_policy

    params = mini_params()
    prepare(params.data, params.seed, tmp_path / paths.TRAIN, tmp_path / paths.TEST)
    init_policy(params, tmp_path / paths.TRAIN, tmp_path / paths.policy_dir("r0"))
    work = run_round(tmp_path, params, monkeypatch)
    batch = work / paths.batch_path("r1")
    rows, files = compare_round(batch, tmp_path / "report", params.rollout.max_new_tokens)
    assert all(f.is_file() for f in files) and {f.suffix for f in files} == {".md", ".csv", ".png"}
    with open(tmp_path / "report" / "compare.csv") as handle:
        table = list(csv.DictReader(handle))
    assert {"preset", "mean_abs_c", "sign_agreement", "variance", "length_corr"} <= set(table[0])
    assert sorted(row["preset"] for row in table) == sorted(PRESETS)
    # round 1: reference = old policy, so the KL terms vanish at ratio 1 and grpo = grpo_r1 up to 1/T_b
    data = load_round(batch)
    coefs = coefficients(data, params.rollout.max_new_tokens)
    scaled = coefs["grpo"] * data.lengths.unsqueeze(1)
    significant = coefs["grpo_r1"].abs() > 1e-9
    ratio = scaled[significant] / coefs["grpo_r1"][significant]
    assert torch.allclose(ratio, ratio.mean().expand_as(ratio), rtol=1e-5)
