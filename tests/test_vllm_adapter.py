"""The vLLM backend's pure adapters, without vllm: rows -> per-prompt requests, RequestOutputs -> rows.

The fakes below have the shape of vLLM's RequestOutput / CompletionOutput / Logprob (0.32); the real
engine is exercised by tests/test_vllm_engine.py (`make test-vllm`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import pytest
import torch

from rlpipe.config import RolloutConfig, RolloutVLLMConfig
from rlpipe.rollout.base import GenerationRows, SamplingSpec
from rlpipe.rollout.vllm import (
    NO_TOP_K,
    VLLMBackend,
    VLLMSettingsError,
    build_requests,
    check_platform,
    checkpoint_dtype,
    engine_arguments,
    engine_settings,
    logprobs_exact,
    logprobs_mode,
    set_cpu_env,
    to_generation_output,
    vllm_top_k,
)

EOS = 2
SPEC = SamplingSpec(max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def make_rows(prompts: list[list[int]], per_prompt: int, greedy_last: bool = False) -> GenerationRows:
    rows = [p for p in prompts for _ in range(per_prompt)]
    seeds = [1000 + 7 * i for i, _ in enumerate(prompts) for _ in range(per_prompt)]
    greedy = torch.tensor([greedy_last and k == per_prompt - 1 for _ in prompts for k in range(per_prompt)])
    return GenerationRows(rows, torch.zeros(len(rows), SPEC.max_new_tokens, dtype=torch.float64), greedy, seeds)


def completion(index: int, ids: list[int], reason: str, base: float = -1.0) -> CompletionOutput:
    # logprobs=0 returns the emitted token; a top-k request may add others: take the emitted one.
    logprobs = [{t: Logprob(base - 0.1 * k), 999: Logprob(-50.0)} for k, t in enumerate(ids)]
    return CompletionOutput(index, ids, logprobs, reason, None)


def test_module_imports_without_vllm():
    had = "vllm" in sys.modules
    import rlpipe.rollout.vllm  # noqa: F401

    assert had or "vllm" not in sys.modules


def test_one_request_per_prompt_with_its_own_seed():
    rows = make_rows([[1, 5, 6], [1, 7], [1, 8, 9, 4]], per_prompt=4)
    requests = build_requests(rows, SPEC, stop_token_ids=[EOS])
    assert len(requests) == 3
    assert [r.rows for r in requests] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [r.prompt_token_ids for r in requests] == [[1, 5, 6], [1, 7], [1, 8, 9, 4]]
    seeds = [r.params["seed"] for r in requests]
    assert seeds == [rows.prompt_seeds[0], rows.prompt_seeds[4], rows.prompt_seeds[8]]
    assert len(set(seeds)) == 3  # not one SamplingParams(seed=S, n=M) shared by every prompt
    for r in requests:
        assert r.params == {"n": 4, "seed": r.params["seed"], "temperature": 1.0, "top_k": NO_TOP_K, "top_p": 1.0,
                            "max_tokens": 4, "logprobs": 0, "stop_token_ids": [EOS], "detokenize": False}


def test_adjacent_equal_prompts_with_different_seeds_stay_apart():
    rows = make_rows([[1, 5], [1, 5]], per_prompt=2)
    requests = build_requests(rows, SPEC)
    assert [r.rows for r in requests] == [[0, 1], [2, 3]]
    assert requests[0].params["seed"] != requests[1].params["seed"]


def test_greedy_row_is_a_separate_temperature_zero_request():
    rows = make_rows([[1, 5, 6], [1, 7]], per_prompt=5, greedy_last=True)  # ReMax: 4 samples + greedy
    requests = build_requests(rows, SamplingSpec(4, 0.7, 5, 0.9))
    assert [r.rows for r in requests] == [[0, 1, 2, 3], [4], [5, 6, 7, 8], [9]]
    sampled, greedy = requests[0].params, requests[1].params
    assert sampled["n"] == 4 and sampled["temperature"] == 0.7 and sampled["top_k"] == 5 and sampled["top_p"] == 0.9
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0 and greedy["logprobs"] == 0
    assert greedy["max_tokens"] == 4 and "seed" not in greedy
    assert requests[1].prompt_token_ids == [1, 5, 6] and requests[3].prompt_token_ids == [1, 7]


def test_top_k_mapping():
    assert vllm_top_k(0) == NO_TOP_K == 0  # vLLM 0.32: 0 (or -1) disables top-k
    assert vllm_top_k(5) == 5


def test_missing_seeds_are_refused():
    rows = make_rows([[1, 5]], per_prompt=2)
    rows.prompt_seeds = None
    with pytest.raises(ValueError, match="prompt_seeds"):
        build_requests(rows, SPEC)


def test_outputs_come_back_in_row_order():
    rows = make_rows([[1, 5, 6], [1, 7]], per_prompt=3, greedy_last=True)
    requests = build_requests(rows, SPEC, [EOS])
    outputs = [
        # completions finish in any order; `index` says which sample each is
        RequestOutput("0", [1, 5, 6], [completion(1, [4, EOS], "stop", -1.0), completion(0, [3, 3, 3, 3], "length", -2.0)]),
        RequestOutput("1", [1, 5, 6], [completion(0, [9, EOS], "stop", -3.0)]),
        RequestOutput("2", [1, 7], [completion(0, [EOS], "stop", -4.0), completion(1, [5, 6, 7, 8], "length", -5.0)]),
        RequestOutput("3", [1, 7], [completion(0, [8, 8, EOS], "stop", -6.0)]),
    ]
    out = to_generation_output(requests, outputs, len(rows.prompt_ids), seconds=1.5)
    assert out.response_ids == [[3, 3, 3, 3], [4, EOS], [9, EOS], [EOS], [5, 6, 7, 8], [8, 8, EOS]]
    assert out.finish_reason == ["length", "stop", "stop", "stop", "length", "stop"]
    assert out.logprobs[0] == pytest.approx([-2.0, -2.1, -2.2, -2.3])
    assert out.logprobs[1] == pytest.approx([-1.0, -1.1])  # the eos keeps its logprob
    assert out.logprobs[5] == pytest.approx([-6.0, -6.1, -6.2])
    assert out.generated_tokens == 4 + 2 + 2 + 1 + 4 + 3 and out.seconds == 1.5
    assert all(len(ids) == len(lp) for ids, lp in zip(out.response_ids, out.logprobs))


@pytest.mark.parametrize("reason", ["abort", None, "repetition"])
def test_other_finish_reasons_fail_loudly(reason):
    rows = make_rows([[1, 5]], per_prompt=1)
    requests = build_requests(rows, SPEC)
    with pytest.raises(RuntimeError, match="finished with"):
        to_generation_output(requests, [RequestOutput("0", [1, 5], [completion(0, [4], reason)])], 1)


def test_inconsistent_outputs_fail_loudly():
    rows = make_rows([[1, 5], [1, 6]], per_prompt=2)
    requests = build_requests(rows, SPEC)
    good = [RequestOutput("0", [1, 5], [completion(0, [4], "stop"), completion(1, [4], "stop")]),
            RequestOutput("1", [1, 6], [completion(0, [4], "stop"), completion(1, [4], "stop")])]
    with pytest.raises(RuntimeError, match="outputs for"):
        to_generation_output(requests, good[:1], 4)
    with pytest.raises(RuntimeError, match="out of order"):
        to_generation_output(requests, good[::-1], 4)
    short = [good[0], RequestOutput("1", [1, 6], [completion(0, [4], "stop")])]
    with pytest.raises(RuntimeError, match="completions for"):
        to_generation_output(requests, short, 4)
    no_logprobs = [good[0], RequestOutput("1", [1, 6], [completion(0, [4], "stop"), CompletionOutput(1, [4], None, "stop")])]
    with pytest.raises(RuntimeError, match="no logprob"):
        to_generation_output(requests, no_logprobs, 4)


def test_logprobs_mode_follows_the_contract():
    assert logprobs_mode(SamplingSpec(4, 1.0, 5, 0.9)) == "raw_logprobs"  # T = 1: raw is exact, truncation or not
    assert logprobs_exact(SamplingSpec(4, 1.0, 5, 0.9))
    assert logprobs_mode(SamplingSpec(4, 0.7, 0, 1.0)) == "processed_logprobs"  # = log softmax(logits / T)
    assert logprobs_exact(SamplingSpec(4, 0.7, 0, 1.0))
    assert not logprobs_exact(SamplingSpec(4, 0.7, 0, 0.9))


def test_untrue_behaviour_logprobs_need_a_recompute():
    cfg = RolloutConfig(backend="vllm", temperature=0.7, top_p=0.9, recompute_old_logprobs="never")
    with pytest.raises(VLLMSettingsError, match="recompute_old_logprobs"):
        VLLMBackend("unused", tokenizer=None, cfg=cfg)  # raised before vllm is imported


def test_checkpoint_dtype_and_cpu_env(tmp_path):
    assert checkpoint_dtype(str(tmp_path)) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
    set_cpu_env(env)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "4"}
    env = {}
    set_cpu_env(env)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_engine_arguments_pass_only_the_settings_given():
    assert engine_arguments(RolloutVLLMConfig()) == {"tensor_parallel_size": 1, "enforce_eager": False}
    settings = RolloutVLLMConfig(max_model_len=48, enable_prefix_caching=False, gpu_memory_utilization=0.5,
                                 enable_sleep_mode=True)
    assert engine_arguments(settings) == {"tensor_parallel_size": 1, "enforce_eager": False, "max_model_len": 48,
                                          "enable_prefix_caching": False, "gpu_memory_utilization": 0.5}


def test_a_changed_engine_setting_asks_for_a_new_engine(tmp_path):
    cfg = RolloutConfig(backend="vllm")
    same = cfg.model_copy(update={"prompts_per_round": 8, "batch_size": 64})  # not the engine's business
    assert engine_settings(same, "float32") == engine_settings(cfg, "float32")
    for change in ({"max_model_len": 48}, {"enforce_eager": True}, {"max_num_seqs": 8}, {"tensor_parallel_size": 2}):
        other = cfg.model_copy(update={"vllm": RolloutVLLMConfig(**change)})
        assert engine_settings(other, "float32") != engine_settings(cfg, "float32"), change


@dataclass
class FakePlatform:
    cpu: bool = False
    cuda: bool = False
    sleep: bool = False

    def is_cpu(self):
        return self.cpu

    def is_cuda_alike(self):
        return self.cuda

    def is_sleep_mode_available(self):
        return self.sleep


def test_settings_this_machine_cannot_run_name_the_key(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpu, gpu = FakePlatform(cpu=True), FakePlatform(cuda=True, sleep=True)
    tp2 = RolloutVLLMConfig(tensor_parallel_size=2)
    # vLLM binds each CPU rank to its own NUMA node: on one node its engine process dies with an assertion
    with pytest.raises(VLLMSettingsError, match=r"^rollout.vllm.tensor_parallel_size: 2 ranks on CPU need one NUMA"):
        check_platform(tp2, cpu, numa_nodes=[0])
    check_platform(tp2, cpu, numa_nodes=[0, 1])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # bound by hand: vLLM's business
    check_platform(tp2, cpu, numa_nodes=[0])
    with pytest.raises(VLLMSettingsError, match=r"^rollout.vllm.tensor_parallel_size: 2 GPUs asked for, 1 visible"):
        check_platform(tp2, gpu, gpus=1)
    check_platform(tp2, gpu, gpus=2)
    with pytest.raises(VLLMSettingsError, match=r"^rollout.vllm.enable_sleep_mode: "):
        check_platform(RolloutVLLMConfig(enable_sleep_mode=True), cpu)
    check_platform(RolloutVLLMConfig(enable_sleep_mode=True), gpu)
    check_platform(RolloutVLLMConfig(), cpu)  # null: off where vLLM has no sleep mode


def test_eval_generates_at_its_own_temperature_on_the_configured_engine():
    """evaluate samples at eval.temperature through rollout.backend; the engine's logprobs mode must be that
    temperature's, else `generate` refuses the spec. At the rollout's temperature one engine serves both."""
    from rlpipe.config import params_from_dict
    from rlpipe.stages.evaluate import eval_rollout_config

    rollout = {"backend": "vllm", "temperature": 1.0, "vllm": {"max_model_len": 48, "enforce_eager": True}}
    params = params_from_dict({"rollout": rollout, "eval": {"temperature": 0.7}})
    cfg = eval_rollout_config(params)
    assert cfg.backend == "vllm" and cfg.vllm == params.rollout.vllm and cfg.temperature == 0.7
    assert engine_settings(cfg, "float32")[0] == logprobs_mode(SamplingSpec(6, 0.7, 0, 1.0)) == "processed_logprobs"
    params = params_from_dict({"rollout": rollout, "eval": {"temperature": 1.0}})
    assert engine_settings(eval_rollout_config(params), "float32") == engine_settings(params.rollout, "float32")
