"""Registries: duplicates raise, unknown names list the valid ones, keys equal the config's Literals."""

from __future__ import annotations

import typing

import pytest

from rlpipe.config import components as config
from rlpipe.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlpipe.algorithms.aggregation import LOSS_AGGREGATIONS
from rlpipe.algorithms.kl import KL_ESTIMATORS
from rlpipe.algorithms.losses import POLICY_LOSSES
from rlpipe.algorithms.rollout_correction import CORRECTIONS
from rlpipe.train.schedule import LR_SCHEDULES
from rlpipe.config import PRESETS
from rlpipe.config import AlgorithmConfig, ParamsError, params_from_dict
from rlpipe.registry import Registry
from rlpipe.rewards import VERIFIERS
from rlpipe.rollout import ROLLOUT_BACKENDS


@pytest.mark.parametrize(
    "registry, literal",
    [
        (ADVANTAGE_ESTIMATORS, config.EstimatorName),
        (KL_ESTIMATORS, config.KLEstimatorName),
        (LOSS_AGGREGATIONS, config.LossAggName),
        (POLICY_LOSSES, config.PolicyLossName),
        (LR_SCHEDULES, config.LRScheduleName),
        (CORRECTIONS, config.RolloutCorrectionName),
        (ROLLOUT_BACKENDS, config.RolloutBackendName),
        (VERIFIERS, config.VerifierName),
    ],
)
def test_registry_keys_equal_the_config_literals(registry, literal):
    assert sorted(registry.names()) == sorted(typing.get_args(literal))


def test_presets_equal_the_config_literal_and_resolve():
    assert sorted(PRESETS) == sorted(typing.get_args(config.PresetName))
    for name in PRESETS:
        spec = AlgorithmConfig(preset=name).resolve()
        assert spec.estimator in ADVANTAGE_ESTIMATORS
        assert spec.loss_agg in LOSS_AGGREGATIONS
        assert spec.kl_estimator in KL_ESTIMATORS


def test_duplicate_name_raises():
    registry = Registry("thing")
    registry.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.register("a")(lambda: 2)


@pytest.mark.parametrize("registry", [ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS])
def test_unknown_name_lists_the_valid_ones_sorted(registry):
    with pytest.raises(KeyError) as err:
        registry.get("gea")
    assert f"unknown {registry.family} 'gea'; valid: {', '.join(sorted(registry.names()))}" in str(err.value)


# docs/algorithms.md "Presets": (estimator, kl_placement, kl_estimator, kl_beta, loss_agg) and the extras
PRESET_TABLE = {
    "reinforce": ("reinforce", "reward", "k1", 0.01, "seq-mean-token-sum", {}),
    "reinforce_kl_trick": ("reinforce_kl_to_go", "reward", "k1", 0.01, "seq-mean-token-sum", {}),
    "reinforce_pp": ("reinforce_pp", "reward", "k1", 0.01, "token-mean", {}),
    "rloo": ("rloo", "reward", "k1", 0.01, "seq-mean-token-sum", {}),
    "remax": ("remax", "reward", "k1", 0.01, "seq-mean-token-sum", {}),
    "ppo": ("gae", "reward", "k1", 0.01, "token-mean", {"gamma": 1.0, "lam": 0.95, "whiten_advantages": True}),
    "orz": ("gae", "none", None, 0.0, "token-mean", {"gamma": 1.0, "lam": 1.0, "lambda_critic": 1.0,
                                                     "whiten_advantages": False}),
    "grpo": ("group_norm", "loss", "k3", 0.04, "seq-mean-token-mean", {}),
    "grpo_r1": ("group_norm", "loss", "k3", 0.001, "seq-mean-token-sum", {}),
    "dapo": ("group_norm", "none", None, 0.0, "group-token-mean",
             {"eps_low": 0.2, "eps_high": 0.28, "dynamic_sampling": True, "overlong_shaping": True}),
    "dr_grpo": ("group_mean", "none", None, 0.0, "seq-mean-token-sum-norm", {}),
    "vapo": ("gae", "none", None, 0.0, "token-mean",
             {"gamma": 1.0, "lam": "adaptive", "adaptive_lambda_alpha": 0.05, "lambda_critic": 1.0, "eps_high": 0.28,
              "nll_coef": 0.1, "dynamic_sampling": True, "whiten_advantages": False}),
    "grpo_process": ("group_process", "loss", "k3", 0.04, "seq-mean-token-mean", {}),
}


@pytest.mark.parametrize("preset", sorted(PRESET_TABLE))
def test_each_preset_matches_the_spec_table(preset):
    estimator, placement, kl_estimator, beta, loss_agg, extras = PRESET_TABLE[preset]
    spec = AlgorithmConfig(preset=preset).resolve()
    assert (spec.estimator, spec.kl_placement, spec.kl_beta, spec.loss_agg) == (estimator, placement, beta, loss_agg)
    if kl_estimator is not None:
        assert spec.kl_estimator == kl_estimator
    assert {k: getattr(spec, k) for k in extras} == extras
    # the defaults every preset keeps: population std, eps 1e-6, no dual clip, no entropy bonus
    assert (spec.std_ddof, spec.std_eps, spec.clip_ratio_c, spec.entropy_coef) == (0, 1e-6, 0.0, 0.0)
    assert spec.needs_critic == (estimator == "gae") and spec.greedy_baseline == (estimator == "remax")


def test_every_component_is_overridable():
    spec = AlgorithmConfig(preset="grpo", loss_agg="token-mean", kl_estimator="k1", eps_high=0.28, std_ddof=1).resolve()
    assert (spec.estimator, spec.loss_agg, spec.kl_estimator, spec.eps_high, spec.std_ddof) == \
        ("group_norm", "token-mean", "k1", 0.28, 1)
    assert AlgorithmConfig(preset="vapo", lam=0.9).resolve().lam == 0.9


def test_preset_defaults_follow_the_spec():
    grpo = AlgorithmConfig(preset="grpo").resolve()
    assert (grpo.kl_placement, grpo.kl_estimator, grpo.kl_beta, grpo.std_ddof, grpo.std_eps) == \
        ("loss", "k3", 0.04, 0, 1e-6)
    dapo = AlgorithmConfig(preset="dapo").resolve()
    assert (dapo.eps_low, dapo.eps_high, dapo.dynamic_sampling, dapo.overlong_shaping) == (0.2, 0.28, True, True)
    vapo = AlgorithmConfig(preset="vapo").resolve()
    assert (vapo.lam, vapo.adaptive_lambda_alpha, vapo.lambda_critic, vapo.nll_coef) == ("adaptive", 0.05, 1.0, 0.1)
    assert AlgorithmConfig(preset="ppo").resolve().whiten_advantages
    assert not AlgorithmConfig(preset="orz").resolve().whiten_advantages


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"algorithm": {"preset": "rloo"}, "rollout": {"samples_per_prompt": 1}}, "rollout.samples_per_prompt"),
        ({"algorithm": {"preset": "grpo", "estimator": "group_norm"}, "rollout": {"samples_per_prompt": 1}},
         "rollout.samples_per_prompt"),
        ({"algorithm": {"preset": "ppo", "estimator": "rloo"}, "rollout": {"samples_per_prompt": 1}},
         "rollout.samples_per_prompt"),
        ({"algorithm": {"eps_high": -0.01}}, "algorithm.eps_high"),
        ({"algorithm": {"preset": "dapo", "eps_high": -0.28}}, "algorithm.eps_high"),
        ({"algorithm": {"preset": "grpo_plus"}}, "algorithm.preset"),
        ({"algorithm": {"loss_agg": "token_mean"}}, "algorithm.loss_agg"),
        ({"algorithm": {"clip_ratio_c": 0.5}}, "algorithm.clip_ratio_c"),
    ],
)
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    assert f"  {key}: " in str(err.value)
