"""Registries: duplicates raise, unknown names list the valid ones, keys equal the config's Literals."""

from __future__ import annotations

import typing

import pytest

from rlpipe import config
from rlpipe.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlpipe.algorithms.aggregation import LOSS_AGGREGATIONS
from rlpipe.algorithms.kl import KL_ESTIMATORS
from rlpipe.algorithms.presets import PRESETS
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


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(KeyError, match="unknown advantage estimator 'gea'; valid: gae, group_mean, group_norm"):
        ADVANTAGE_ESTIMATORS.get("gea")


def test_every_component_is_overridable():
    spec = AlgorithmConfig(preset="grpo", loss_agg="token-mean", kl_estimator="k1", eps_high=0.28, std_ddof=1).resolve()
    assert (spec.estimator, spec.loss_agg, spec.kl_estimator, spec.eps_high, spec.std_ddof) == \
        ("group_norm", "token-mean", "k1", 0.28, 1)
    assert AlgorithmConfig(preset="vapo", lam=0.9).resolve().lam == 0.9


def test_preset_defaults_follow_the_spec():
    grpo = AlgorithmConfig(preset="grpo").resolve()
    assert (grpo.kl_placement, grpo.kl_estimator, grpo.kl_beta, grpo.std_ddof, grpo.std_eps) == ("loss", "k3", 0.04, 0, 1e-6)
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
        ({"algorithm": {"eps_high": -0.01}}, "algorithm.eps_high"),
        ({"algorithm": {"preset": "grpo_plus"}}, "algorithm.preset"),
    ],
)
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    assert f"  {key}: " in str(err.value)
