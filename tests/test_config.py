"""params.yaml validates; bad params fail before any model loads, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlpipe.config import ParamsError, load_params, params_from_dict

REPO = Path(__file__).resolve().parents[1]


def test_shipped_params_validate():
    params = load_params(REPO / "params.yaml")
    assert params.algorithm.resolve().estimator == "group_norm"
    assert params.round_names == [f"r{i}" for i in range(1, params.rounds + 1)]


def test_every_shipped_params_file_validates():
    files = [REPO / "params.yaml", *sorted((REPO / "examples").glob("*.yaml")), *sorted((REPO / "tests").glob("**/params*.yaml"))]
    for path in files:
        load_params(path)


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"rollout": {"samples_per_prompt": 8, "bogus": 1}}, "rollout.bogus"),
        ({"nonsense": 1}, "nonsense"),
        ({"update": {"lr": "fast"}}, "update.lr"),
        ({"update": {"lr": -1.0}}, "update.lr"),
        ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens"),
        ({"algorithm": {"preset": "grpo++"}}, "algorithm.preset"),
        ({"algorithm": {"eps_high": -0.1}}, "algorithm.eps_high"),
        ({"algorithm": {"loss_agg": "mean"}}, "algorithm.loss_agg"),
        ({"algorithm": {"preset": "rloo"}, "rollout": {"samples_per_prompt": 1}}, "rollout.samples_per_prompt"),
        ({"rounds": {"r1": {"prev": "r0"}, "r2": {"prev": "r1"}}}, "rounds"),
        ({"rounds": 0}, "rounds"),
        ({"eval": {"samples": 4, "k": [8]}}, "eval.k"),
        ({"model": {"tiny": {"hidden": 30, "heads": 4}}}, "model.tiny.hidden"),
        ({"update": {"nnodes": 2}}, "update.rdzv_endpoint"),
        ({"update": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1"}}, "update.rdzv_endpoint"),
        ({"update": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:0"}}, "update.rdzv_endpoint"),
        ({"update": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:65536"}}, "update.rdzv_endpoint"),
        ({"update": {"nnodes": 2, "rdzv_endpoint": "node 0:29500"}}, "update.rdzv_endpoint"),
        ({"update": {"rdzv_endpoint": "::1:29500"}}, "update.rdzv_endpoint"),
        ({"update": {"nnodes": 0}}, "update.nnodes"),
        ({"update": {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29500", "rdzv_timeout": 0}}, "update.rdzv_timeout"),
        ({"rollout": {"vllm": {"tensor_parallel_size": 0}}}, "rollout.vllm.tensor_parallel_size"),
        ({"rollout": {"vllm": {"gpu_memory_utilization": 0}}}, "rollout.vllm.gpu_memory_utilization"),
        ({"rollout": {"vllm": {"gpu_memory_utilization": 1.5}}}, "rollout.vllm.gpu_memory_utilization"),
        ({"rollout": {"vllm": {"max_num_seqs": 0}}}, "rollout.vllm.max_num_seqs"),
        ({"rollout": {"vllm": {"cpu_offload_gb": -1}}}, "rollout.vllm.cpu_offload_gb"),
        ({"rollout": {"vllm": {"enforce_eager": "sometimes"}}}, "rollout.vllm.enforce_eager"),
        ({"rollout": {"vllm": {"swap_space": 4}}}, "rollout.vllm.swap_space"),  # gone from vLLM 0.32
        ({"rollout": {"max_new_tokens": 64, "vllm": {"max_model_len": 64}}}, "rollout.vllm.max_model_len"),
        ({"rollout": {"backend": "vllm", "bf16": True}}, "rollout.bf16"),
        ({"algorithm": {"preset": "dapo"}, "update": {"minibatch_mix": "rows"}}, "update.minibatch_mix"),
        ({"update": {"minibatch_mix": "prompts"}}, "update.minibatch_mix"),
        # 16 prompt tokens ("99+99+99+99+99=" after <bos>) and 49 new ones do not fit the 64 positions
        ({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 49}}, "model.tiny.max_positions"),
        ({"data": {"digits": 3}, "rollout": {"max_new_tokens": 56}}, "model.tiny.max_positions"),
    ],
)
def test_bad_params_name_the_key(patch, key):
    with pytest.raises(ParamsError) as err:
        params_from_dict(patch)
    assert f"  {key}: " in str(err.value)


def test_the_embedded_model_must_hold_the_longest_prompt_and_response():
    """At the limit it is accepted; a model given by path, or a real dataset, is not the embedded one's
    affair (its context is the model's own)."""
    params_from_dict({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 48}})  # 16 + 48 = 64
    params_from_dict({"data": {"digits": 3}, "rollout": {"max_new_tokens": 55}})  # "999+999=" after <bos>: 9
    params_from_dict({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 49},
                      "model": {"tiny": {"max_positions": 65}}})
    params_from_dict({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 49}, "model": {"path": "any/model"}})
    with pytest.raises(ParamsError, match=r"model.tiny.max_positions: 64 is shorter than the longest 'reasoning' "
                                          r"prompt \(16 tokens with <bos>\) plus rollout.max_new_tokens = 49: set "
                                          r"it to at least 65"):
        params_from_dict({"data": {"task": "reasoning"}, "rollout": {"max_new_tokens": 49}})


def test_evaluation_generates_without_the_rollouts_bf16():
    from rlpipe.stages.evaluate import eval_rollout_config

    params = params_from_dict({"rollout": {"bf16": True, "temperature": 0.7}, "eval": {"temperature": 1.0}})
    assert params.rollout.bf16 and not eval_rollout_config(params).bf16
    assert eval_rollout_config(params).temperature == 1.0


@pytest.mark.parametrize("endpoint", ["10.0.0.1:29500", "node-0.cluster:29500", "[::1]:29500", "localhost:1"])
def test_a_multi_node_update_takes_host_port(endpoint):
    update = params_from_dict({"update": {"nnodes": 3, "nproc": 2, "rdzv_endpoint": endpoint}}).update
    assert update.world_size == 6 and update.rdzv_endpoint == endpoint
def test_vllm_engine_settings_default_to_vllm_and_pass_with_either_backend():
    from rlpipe.config import RolloutVLLMConfig

    params = load_params(REPO / "params.yaml")
    assert params.rollout.vllm == RolloutVLLMConfig()  # every setting vLLM's own default
    assert params.rollout.vllm.tensor_parallel_size == 1 and params.rollout.vllm.max_model_len is None
    settings = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_model_len": 7, "enforce_eager": True,
                "enable_prefix_caching": False, "max_num_seqs": 64, "max_num_batched_tokens": 4096,
                "cpu_offload_gb": 0, "enable_sleep_mode": False}
    for backend in ("vllm", "hf"):  # kept under hf, so that switching backend is one edit
        params = params_from_dict({"rollout": {"backend": backend, "max_new_tokens": 6, "vllm": settings}})
        assert params.rollout.vllm.model_dump() == settings


def test_truncating_max_new_tokens_warns_with_the_key():
    import warnings

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        params_from_dict(raw)  # the embedded default fits its answers
    raw["data"]["task"] = "chain"  # "99+99+99=" -> "198,297": 7 characters + eos
    with pytest.warns(UserWarning, match=r"rollout.max_new_tokens = 6 .* set rollout.max_new_tokens >= 8"):
        params_from_dict(raw)


def all_models():
    from pydantic import BaseModel

    from rlpipe.config import Params

    seen, todo = [], [Params]
    while todo:
        model = todo.pop()
        seen.append(model)
        for field in model.model_fields.values():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) and field.annotation not in seen:
                todo.append(field.annotation)
    return seen


def test_every_params_field_has_a_docstring():
    from rlpipe.config import ResolvedAlgorithm

    missing = [f"{model.__name__}.{name}" for model in [*all_models(), ResolvedAlgorithm]
               for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not missing, missing


def test_the_params_reference_is_current():
    from rlpipe.config.reference import render_reference

    assert (REPO / "docs" / "params.md").read_text() == render_reference(), "run `rlpipe params-reference`"


@pytest.mark.parametrize("patch, message", [
    ({"rollout": {"temprature": 1.0}}, "rollout.temprature: unknown key; did you mean rollout.temperature?"),
    ({"algorithm": {"kl_bta": 0.1}}, "algorithm.kl_bta: unknown key; did you mean algorithm.kl_beta?"),
    ({"evl": {}}, "evl: unknown key; did you mean eval?"),
    ({"rollout": {"zzz": 1}}, "rollout.zzz: unknown key\n"),
    ({"rollout": {"vllm": {"max_model_length": 64}}},
     "rollout.vllm.max_model_length: unknown key; did you mean rollout.vllm.max_model_len?"),
])
def test_an_unknown_key_names_the_nearest_valid_one(patch, message):
    with pytest.raises(ParamsError) as err:
        params_from_dict(patch)
    assert message in str(err.value) + "\n"
