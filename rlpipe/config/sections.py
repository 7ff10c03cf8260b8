"""The sections of `params.yaml`, one pydantic model each; `rlpipe.config.params` assembles them.

Every model forbids unknown keys and holds its defaults (nowhere else does); every field has a
docstring, from which docs/params.md is generated. Cross-field rules are validators that raise
`KeyedError`, so that the message names the key. Torch-free.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator,
                      model_validator)

from rlpipe.config.components import (PRESETS, EstimatorName, KLEstimatorName, LossAggName, LRScheduleName,
                                      PolicyLossName, PretrainLRScheduleName, PresetName, RolloutCorrectionName,
                                      RolloutBackendName, TaskName, VerifierName, VerifierTargetsName)


class KeyedError(ValueError):
    """A cross-field rule broken at one params key; the formatter reports it at that key."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def error_key(loc: tuple, model: type[BaseModel]) -> str:
    """The dotted params key of a pydantic error location, without pydantic's union-branch tags."""
    parts: list[str] = []
    current: Any = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            parts.append(str(part))
            current = current.model_fields[part].annotation
        elif getattr(current, "__origin__", None) is dict:
            parts.append(str(part))
            current = current.__args__[1]
        else:
            break
    return ".".join(parts)


class RuntimeConfig(Section):
    torch_threads: int = Field(2, ge=1)
    """Threads each torch stage uses. On a loaded 2-core machine, 1 can beat 2."""
    warm_worker: bool = True
    """Run the stages' work in one resident worker per pipeline execution, which keeps torch imported and
    the models the last stage loaded or wrote in memory (README, "The warm worker"); the artifacts are
    the same bytes either way (on a GPU, with `deterministic`). false: every stage is a cold process that
    imports and loads everything."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where a stage's models run when it is one process: rollout (hf backend), advantage, evaluation,
    value pretraining and an update with update.nproc 1. auto = the GPU when torch sees one, else the
    CPU; cuda without a GPU stops the stage naming this key. The embedded model's warm start (init) stays
    on the CPU, and an update under torchrun (nproc > 1) takes each rank's GPU (nccl) or the CPU (gloo)
    whatever this says. Not part of any stage's DVC params, as the threads: it changes how a stage runs,
    and on a GPU the last bits of what it writes, not what it computes."""
    deterministic: bool = False
    """Run torch's deterministic kernels (`torch.use_deterministic_algorithms`, with cuBLAS's fixed
    workspace) in every torch stage, the warm worker and the torchrun ranks. On a GPU some kernels (atomic
    adds in backward passes, cuBLAS's split reductions) sum in a varying order, so a rerun, or a warm run
    against a cold one, can differ in the last bits; this makes them repeat, where every op the stage
    runs has a deterministic kernel (torch stops the stage naming an op that has none). On the CPU every
    kernel rlpipe runs repeats already, and the bytes are the same either way. vLLM's own kernels (the
    `vllm` backend) are beyond it. Not part of any stage's DVC params, as the device."""


# ----------------------------------------------------------------------------------------------
class DataConfig(Section):
    source: Literal["synthetic", "file", "hf"] = "synthetic"
    """`synthetic`: the seeded generator; `file`: local JSONL/Parquet files; `hf`: `datasets.load_dataset`."""
    task: TaskName = "addition"
    """Synthetic task: `addition` ("37+45=" -> "82"), `chain` (multi-step sums, one step per partial sum), or
    `reasoning` (min_terms to max_terms operands, with or without carries; the response may write the running
    sums before its marked answer, "12+35=47;47+8=55;#55", or give the answer alone, "#55")."""
    num_train: int = Field(7000, ge=1)
    """Synthetic: training prompts generated."""
    num_test: int = Field(500, ge=1)
    """Synthetic: held-out prompts generated (disjoint from train)."""
    digits: int = Field(2, ge=1, le=6)
    """Synthetic: digits per operand."""
    chain_terms: int = Field(3, ge=2, le=8)
    """Synthetic: operands per prompt of the `chain` task."""
    min_terms: int = Field(2, ge=2, le=8)
    """`reasoning`: fewest operands of a prompt; the operand count is uniform in [min_terms, max_terms]."""
    max_terms: int = Field(5, ge=2, le=8)
    """`reasoning`: most operands of a prompt. Its step-by-step answer with 2-digit operands is 47 characters
    at 5 operands (one token each with the embedded tokenizer), 58 at 6."""
    step_target_fraction: float = Field(0.5, ge=0, le=1)
    """`reasoning`: the share of train prompts whose warm-start (SFT) target writes the running sums; the
    others jump to the marked answer. Mixing both gives the initial policy short and long responses
    whose accuracy differs, which RL can trade off."""
    train_file: Optional[str] = None
    """`file`: train split, .jsonl or .parquet (relative paths are from the repo root)."""
    test_file: Optional[str] = None
    """`file`: test split, .jsonl or .parquet (relative paths are from the repo root)."""
    hf_dataset: Optional[str] = None
    """`hf`: dataset name for `datasets.load_dataset`, e.g. openai/gsm8k."""
    hf_config: Optional[str] = None
    """`hf`: the dataset's configuration name (the second argument of `load_dataset`), e.g. main for gsm8k."""
    train_split: str = "train"
    """`hf`: the split used for training."""
    test_split: str = "test"
    """`hf`: the held-out split used by `evaluate`."""
    question_field: str = "question"
    """`file`/`hf`: the column holding the problem."""
    answer_field: str = "answer"
    """`file`/`hf`: the column holding the reference answer (or the whole reference solution)."""
    answer_format: Literal["raw", "gsm8k"] = "raw"
    """`gsm8k`: the reference is a solution whose last line is `#### <answer>`; keep the answer only."""
    max_train: Optional[int] = Field(None, ge=1)
    """Keep only the first rows of the train split (None = all)."""
    max_test: Optional[int] = Field(None, ge=1)
    """Keep only the first rows of the test split (None = all)."""
    prompt_template: str = "{question}"
    """Plain template of the user message; `{question}` is replaced by the problem."""
    chat_template: bool = False
    """Wrap the message with the tokenizer's chat template (instruct models) at tokenization time."""
    system_prompt: Optional[str] = None
    """System message, used with chat_template."""

    @model_validator(mode="after")
    def _source_fields(self) -> "DataConfig":
        if self.source == "file" and not (self.train_file and self.test_file):
            raise KeyedError("data.train_file", "data.source 'file' needs data.train_file and data.test_file")
        if self.source == "hf" and not self.hf_dataset:
            raise KeyedError("data.hf_dataset", "data.source 'hf' needs a dataset name")
        if "{question}" not in self.prompt_template:
            raise KeyedError("data.prompt_template", "must contain {question}")
        if self.system_prompt is not None and not self.chat_template:
            raise KeyedError("data.system_prompt", "is only used with data.chat_template: true")
        if self.min_terms > self.max_terms:
            raise KeyedError("data.min_terms", f"must be <= data.max_terms = {self.max_terms}; got {self.min_terms}")
        return self


# ----------------------------------------------------------------------------------------------
class TinyModelConfig(Section):
    """The embedded policy: a small Llama built from config, no download."""

    layers: int = Field(4, ge=1)
    """Transformer layers of the embedded Llama."""
    hidden: int = Field(128, ge=8)
    """Hidden size; must be divisible by `heads`."""
    heads: int = Field(4, ge=1)
    """Attention heads (also the key/value heads: no grouped-query attention)."""
    intermediate: int = Field(512, ge=8)
    """Width of the MLP."""
    max_positions: int = Field(64, ge=8)
    """Longest sequence (prompt + response) the model is built for. With a synthetic task, the longest
    prompt plus `rollout.max_new_tokens` must fit (checked when params.yaml is read)."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "TinyModelConfig":
        if self.hidden % self.heads:
            raise KeyedError("model.tiny.hidden", f"{self.hidden} is not divisible by model.tiny.heads = {self.heads}")
        return self


class WarmStartConfig(Section):
    """Supervised warm start of the tiny model, so that RL starts from a partly right policy."""

    steps: int = Field(300, ge=0)
    """Optimizer steps of SFT on (prompt, answer) pairs of the train split (with `target_pass_at_1`, the
    most). 0 = start from random weights."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the warm start."""
    batch_size: int = Field(64, ge=1)
    """(prompt, answer) pairs per warm-start step, drawn with replacement."""
    target_pass_at_1: float | None = Field(None, gt=0, le=1)
    """Stop SFT at the first check at which greedy pass@1 on `check_prompts` train prompts (held out of
    SFT) reaches this; `steps` is then the most it runs, and init's metrics say where it stopped. null:
    exactly `steps` steps. SFT stops on the steep part of its curve, where a fixed step count lands at
    another pass@1 for every seed and CPU (0.07-0.45 at 280 steps on the embedded default); a target
    starts them alike."""
    check_every: int = Field(10, ge=1)
    """With `target_pass_at_1`: SFT steps between checks."""
    check_prompts: int = Field(256, ge=1)
    """With `target_pass_at_1`: how many train prompts (a seeded sample) SFT leaves out and each check
    decodes greedily."""


class LoRAConfig(Section):
    """Low-rank adapters on the policy (peft): only the adapters train, and each round stores only them."""

    rank: int = Field(0, ge=0)
    """r of every adapter; 0 = off (the whole policy trains and each round stores all its weights)."""
    alpha: float = Field(16.0, gt=0)
    """lora_alpha: the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (the logprobs of rollout and advantage have none)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get adapters (peft's target_modules); the default is every linear
    layer of a Llama/Qwen block. Checked against the policy's modules when the first update attaches them."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one module (e.g. q_proj)")
        return value


class ModelConfig(Section):
    path: Optional[str] = None
    """HF model directory or hub name of the policy. null = the embedded tiny model, built in `init`."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights' dtype wherever a stage loads the policy, the reference or the critic."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the embedded model (used when `path` is null)."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """SFT of the embedded model in `init` (used when `path` is null)."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA on the policy (off at rank 0): the base is round 0's checkpoint, stored once."""


# ----------------------------------------------------------------------------------------------
class RolloutVLLMConfig(Section):
    """Settings of the vLLM engine, used where `rollout.backend` is vllm: by every stage that generates
    (rollout, value_pretrain, evaluate). Each goes to `vllm.LLM` under its vLLM 0.32 name; null = vLLM's
    own default. With the hf backend they are ignored (kept, so that switching backend is one edit).
    Changing one starts a new engine (the warm worker's resident engine is rebuilt), and, like any
    `rollout` key, reruns the stages that read the section."""

    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine shards the policy over (the attention heads must divide evenly). Checked when the
    engine starts: at most the GPUs present; on CPU, vLLM binds each rank to its own NUMA node."""
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1)
    """Fraction of each GPU's memory the engine may take (weights, activations, KV cache); null = vLLM's
    default (0.92 in 0.32). Lower it when the trainer's models share the GPU. On CPU the KV cache is
    VLLM_CPU_KVCACHE_SPACE GiB instead (rlpipe's default 1)."""
    max_model_len: Optional[int] = Field(None, ge=1)
    """Longest sequence (prompt + response) the engine holds; null = the model's context length. Must
    exceed rollout.max_new_tokens. A response stops early (finish reason `length`) where prompt and
    response reach it; a prompt of this many tokens or more fails at generation."""
    enforce_eager: bool = False
    """Run the model eagerly: no CUDA graphs or torch.compile, so a faster engine start and less memory,
    for slower generation."""
    enable_prefix_caching: Optional[bool] = None
    """Reuse the KV blocks of a prompt shared by requests (a group's M samples); null = vLLM's default
    (on). The cache is dropped whenever new weights are loaded."""
    max_num_seqs: Optional[int] = Field(None, ge=1)
    """Most sequences in one engine step (a prompt's M samples count M); null = vLLM's default."""
    max_num_batched_tokens: Optional[int] = Field(None, ge=1)
    """Most tokens in one engine step; null = vLLM's default. On CPU rlpipe turns chunked prefill off, so a
    whole prompt must fit in one step: vLLM then needs it >= max_model_len."""
    cpu_offload_gb: Optional[float] = Field(None, ge=0)
    """GiB of each GPU's share of the weights kept in CPU memory and streamed in at every forward pass: a
    model bigger than the GPU, slowly; null = vLLM's 0. vLLM 0.32 has no `swap_space` (the CPU swap of
    preempted sequences left with the V0 engine; V1 recomputes a preempted request)."""
    enable_sleep_mode: Optional[bool] = None
    """Free the engine's GPU memory (weights and KV cache, sleep level 2) while the update runs, and reload
    the next checkpoint on waking; null = on with CUDA, off elsewhere. vLLM supports it on CUDA and ROCm
    only: true on CPU stops when the engine starts, naming this key."""


class RolloutConfig(Section):
    backend: RolloutBackendName = "hf"
    """`hf`: transformers generate (CPU or GPU). `vllm`: the vLLM engine (optional extra)."""
    prompts_per_round: int = Field(1024, ge=1)
    """Prompts sampled per round: the round's train batch (verl: train_batch_size)."""
    samples_per_prompt: int = Field(8, ge=1)
    """M: responses per prompt, one group."""
    oversample: float = Field(1.0, ge=1.0)
    """With dynamic sampling, generate ceil(oversample * prompts_per_round) prompts so enough groups survive."""
    max_new_tokens: int = Field(8, ge=1)
    """L_max of the response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; behaviour logprobs are those of softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1.0 = off."""
    top_k: int = Field(0, ge=0)
    """0 = off."""
    batch_size: int = Field(2048, ge=1)
    """Sequences per generate call."""
    bf16: bool = False
    """bf16 autocast of the `hf` backend's generation (weights stay in `model.dtype`): faster on GPUs and on
    CPUs with avx512_bf16 or AMX (a round's generate call on the embedded default: 0.76x the fp32 time on
    the development machine), and what TRL does under `bf16=True` (accelerate wraps the policy's forward
    in autocast, generation included). Responses are sampled from the bf16 logits, and the behaviour
    logprobs are theirs. Also for value pretraining's samples and the oracle's continuations; evaluation
    generates without it, so that pass@1 stays comparable between runs that differ only here. `vllm`
    runs in `model.dtype` and rejects it."""
    recompute_old_logprobs: Literal["auto", "always", "never"] = "auto"
    """`auto` recomputes pi_old with the trainer whenever the rollout engine is not the trainer's (vllm).
    Under `update.bf16` the HF engine's fp32 logprobs (without `rollout.bf16`) differ from the update's by
    about 0.005 nats a token (at most 0.2-0.5 a round on the embedded default); `always` recomputes pi_old
    in the update's precision, as TRL does, at one more forward of the round's responses (BENCHMARKS.md, e)."""
    vllm: RolloutVLLMConfig = RolloutVLLMConfig()
    """The vLLM engine's settings (`backend: vllm`)."""

    @model_validator(mode="after")
    def _bf16_is_the_hf_backends(self) -> "RolloutConfig":
        if self.bf16 and self.backend != "hf":
            raise KeyedError("rollout.bf16", f"applies to the hf backend; {self.backend} generates in model.dtype "
                             "(set model.dtype: bfloat16 there)")
        return self

    @model_validator(mode="after")
    def _engine_fits_a_response(self) -> "RolloutConfig":
        # The prompt's length is known only at generation; a response of max_new_tokens after a prompt of
        # at least one token is known now.
        if self.vllm.max_model_len is not None and self.vllm.max_model_len <= self.max_new_tokens:
            raise KeyedError("rollout.vllm.max_model_len",
                             f"must exceed rollout.max_new_tokens = {self.max_new_tokens} (a prompt plus the "
                             f"response); got {self.vllm.max_model_len}")
        return self


class RewardConfig(Section):
    verifier: Literal["auto"] | VerifierName = "auto"
    """`auto`: exact_match for `addition`, chain_steps for `chain`, marked_answer for `reasoning`, math
    (math-verify) for file/hf data."""
    overlong_cache_len: int = Field(2, ge=0)
    """L_cache of DAPO's soft overlong punishment (applied when the algorithm's overlong_shaping is on)."""
    process_model: Optional[str] = None
    """HF directory of a process reward model (one-label token classifier) that scores each step end;
    None = the verifier's own step rewards."""


# ----------------------------------------------------------------------------------------------
class ResolvedAlgorithm(Section):
    """Every component of one algorithm, after a preset is expanded and the overrides applied."""

    estimator: EstimatorName = "group_norm"
    """Advantage estimator (docs/algorithms.md, Advantage estimators)."""
    kl_placement: Literal["reward", "loss", "none"] = "none"
    """Where the KL to the reference goes: folded into the reward, added to the loss, or nowhere."""
    kl_estimator: KLEstimatorName = "k1"
    """Estimator of the per-token KL to the reference: k1, k2 or k3."""
    kl_beta: float = Field(0.0, ge=0)
    """KL coefficient; 0 disables the KL term wherever it is placed."""
    policy_loss: PolicyLossName = "ppo_clip"
    """Per-token policy loss (docs/algorithms.md, Policy loss): `ppo_clip` (PPO's clipped token ratio),
    `gspo` (one length-normalised ratio per response, clipped per response), `cispo` (REINFORCE weighted
    by the clipped ratio, gradient stopped)."""
    loss_agg: LossAggName = "token-mean"
    """How per-token losses are aggregated over the minibatch (docs/algorithms.md, Loss aggregation)."""
    eps_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip range of the ratio: clip(ratio, 1 - eps_low, 1 + eps_high)."""
    eps_high: float = Field(0.2, ge=0)
    """Clip range (1 - eps_low, 1 + eps_high); eps_high > eps_low is DAPO's clip-higher."""
    clip_ratio_c: float = Field(0.0, ge=0)
    """Dual-clip constant for negative advantages (e.g. 3.0); 0 = off."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus in the loss; 0 = off."""
    nll_coef: float = Field(0.0, ge=0)
    """mu of VAPO's positive-example NLL term."""
    whiten_advantages: bool = False
    """Whiten A over all valid tokens of the batch (ppo). The critic's returns use the raw A."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of GAE and of the Monte-Carlo returns of value pretraining."""
    lam: Annotated[float, Field(ge=0, le=1)] | Literal["adaptive"] = 1.0
    """GAE lambda of the policy advantages; `adaptive` = VAPO's clamp(1 - 1/(alpha T_b), 0, 1)."""
    lambda_critic: float = Field(1.0, ge=0, le=1)
    """GAE lambda of the critic's returns (decoupled GAE)."""
    adaptive_lambda_alpha: float = Field(0.05, gt=0)
    """alpha of the length-adaptive lambda; used only when lam = adaptive."""
    std_ddof: Literal[0, 1] = 0
    """0: population std (the analysis' sqrt(p(1-p))); 1: unbiased std as in verl/TRL."""
    std_eps: float = Field(1e-6, gt=0)
    """Added to every std a value is divided by (group norm, whitening)."""
    dynamic_sampling: bool = False
    """Drop groups whose outcomes are all equal (DAPO); see rollout.oversample."""
    dynamic_sampling_metric: Literal["correct", "reward"] = "correct"
    """Equal `correct` (as DAPO and verl) or equal shaped `reward` marks a group as carrying no signal."""
    overlong_shaping: bool = False
    """Add DAPO's soft overlong penalty (reward.overlong_cache_len) to the reward."""
    overlong_filtering: bool = False
    """Give truncated responses zero loss weight."""
    rollout_correction: RolloutCorrectionName = "none"
    """Correct for the rollout engine's probabilities differing from the trainer's (docs/algorithms.md,
    Rollout correction): each token's policy-gradient term is weighted by rho = pi_old / pi_rollout,
    truncated at rollout_correction_cap (`tis`), or dropped where rho leaves [rollout_correction_lower,
    rollout_correction_upper] (`mis`). `none`: off. Needs pi_old recomputed by the trainer
    (rollout.recompute_old_logprobs), or rho is 1."""
    rollout_correction_level: Literal["token", "sequence"] = "token"
    """`token`: one ratio per token; `sequence`: one per response, on all its tokens."""
    rollout_correction_sequence_ratio: Literal["geometric", "product"] = "geometric"
    """Sequence level: the response's ratio is the geometric mean of its token ratios, or their product."""
    rollout_correction_cap: float = Field(2.0, ge=1)
    """`tis`: the largest weight, C in min(rho, C)."""
    rollout_correction_lower: float = Field(0.5, ge=0, le=1)
    """`mis`: ratios below this leave the loss."""
    rollout_correction_upper: float = Field(2.0, ge=1)
    """`mis`: ratios above this leave the loss."""

    @field_validator("clip_ratio_c")
    @classmethod
    def _dual_clip_above_one(cls, value: float, info: ValidationInfo) -> float:
        if 0 < value <= 1:
            raise ValueError("must be 0 (off) or > 1")
        if value > 0 and info.data.get("policy_loss", "ppo_clip") != "ppo_clip":
            raise ValueError(f"the dual clip applies to policy_loss ppo_clip only, not {info.data['policy_loss']!r}")
        return value

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def needs_reference(self) -> bool:
        return self.kl_placement != "none" and self.kl_beta > 0

    @property
    def greedy_baseline(self) -> bool:
        """ReMax: one extra greedy sample per prompt whose reward is the group's baseline."""
        return self.estimator == "remax"


def _as_override(field) -> tuple[Any, Any]:
    """The field as an optional override: same type and bounds, None = take the preset's value."""
    annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return Optional[annotation], Field(None, description=field.description)


# `algorithm` = a preset plus an optional override for every component of ResolvedAlgorithm. Built from
# ResolvedAlgorithm's fields so that the two can never drift apart, and so that a bad override is
# reported at its own key (algorithm.eps_high) with the component's own bounds.
_AlgorithmOverrides = create_model(
    "_AlgorithmOverrides",
    __base__=Section,
    **{name: _as_override(field) for name, field in ResolvedAlgorithm.model_fields.items()},
)


class AlgorithmConfig(_AlgorithmOverrides):
    preset: PresetName = "grpo"
    """One of the 16 presets of docs/algorithms.md; every other key of this section overrides one component."""

    @model_validator(mode="after")
    def _resolves(self) -> "AlgorithmConfig":
        self.resolve()  # cross-component rules of ResolvedAlgorithm fail here, at load time
        return self

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self if k != "preset" and v is not None}

    def resolve(self) -> ResolvedAlgorithm:
        try:
            return ResolvedAlgorithm(**{**PRESETS[self.preset], **self.overrides()})
        except ValidationError as err:
            first = err.errors()[0]
            key = "algorithm." + error_key(first["loc"], ResolvedAlgorithm)
            raise KeyedError(key, f"{first['msg'].removeprefix('Value error, ')} (preset {self.preset!r})") from None


# ----------------------------------------------------------------------------------------------
ENDPOINT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[\w.-]+):(?P<port>\d{1,5})")
"""torchrun's rendezvous endpoint: a host name, IPv4 address or bracketed IPv6 address, and a port."""


class UpdateConfig(Section):
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate of the policy: the schedule's peak (re-applied every step, so it may change
    between rounds)."""
    lr_schedule: LRScheduleName = "constant"
    """Over the whole run, by global optimizer step (rlpipe/train/schedule.py): `constant`,
    `linear_warmup` (0 to lr over warmup_steps, then lr) or `cosine` (the warmup, then down to
    min_lr_ratio * lr at lr_decay_steps)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup (linear_warmup, cosine)."""
    lr_decay_steps: Optional[int] = Field(None, ge=1)
    """cosine: the global optimizer step at which the decay ends (warmup included); needed for cosine.
    Given in steps, not derived from `rounds`, so that lengthening a run changes no earlier round."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """cosine: the learning rate at and after lr_decay_steps, as a fraction of lr."""
    epochs: int = Field(1, ge=1)
    """Passes over the round's batch (verl: ppo_epochs)."""
    minibatch_prompts: int = Field(64, ge=1)
    """Prompts per optimizer step (verl: ppo_mini_batch_size): a round of P kept prompts takes
    ceil(P / minibatch_prompts) steps per epoch, whose rows `minibatch_mix` chooses."""
    minibatch_mix: Literal["groups", "rows"] = "groups"
    """What a step holds: `groups`, whole groups (all samples of minibatch_prompts prompts; verl);
    `rows`, the round's rows shuffled across prompts and dealt to the same number of steps (TRL,
    OpenRLHF), so that a step sees most of the round's prompts, one or two samples each. Advantages are
    computed over whole groups before either (the advantage stage)."""
    micro_batch_tokens: int = Field(16384, ge=1)
    """Token budget of one forward/backward; gradients accumulate exactly over micro-batches."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clip of every policy and critic step (value pretraining included)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of the policy."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1 of the policy."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2 of the policy."""
    shuffle: bool = True
    """Shuffle groups (or rows, under minibatch_mix rows) into minibatches (seeded)."""
    nproc: int = Field(1, ge=1)
    """Processes of the update under torchrun (gloo on CPU, nccl on GPU), on each node; a step's groups
    (or rows, under minibatch_mix rows) are dealt to ranks whole."""
    nnodes: int = Field(1, ge=1)
    """Machines of the update, each running update.nproc processes (nnodes * nproc ranks). Node 0 is the
    machine that runs `dvc repro`; each other node runs `rlpipe update-node --round rK --node-rank K` for
    every round, in the same checkout on a shared filesystem (README, "Multi-node updates")."""
    rdzv_endpoint: Optional[str] = None
    """host:port of node 0, where its torchrun agent listens for the other nodes (torchrun's static
    rendezvous, which gives node 0 the global rank 0 that writes the checkpoints); needed when
    nnodes > 1. The rendezvous id is `rlpipe-update-rK`, one per round."""
    rdzv_timeout: int = Field(1800, ge=1)
    """Seconds a node waits at the rendezvous for the others: a node started for round K early waits
    while node 0 still runs the round's rollout."""
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """Data parallelism across the nproc processes: DDP (replicated) or FSDP2 (`fully_shard`, sharded)."""
    bf16: bool = False
    """bf16 autocast of the update's forward passes, on GPU or CPU, and of the logprobs the update
    compares its own with (the advantage stage's reference logprobs and recomputed old logprobs);
    weights, optimizer state and the loss stay fp32. Fast on CPUs with avx512_bf16 or AMX (an update
    step of the embedded model: 2.1x fp32 with eager attention, 1.5x with sdpa; benchmark d), a slow
    emulation on CPUs without."""
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    """Attention kernel of the update (transformers' attn_implementation). auto = eager on CPU when the
    round's longest sequence is <= 128 tokens, else sdpa: CPU SDPA's backward is slow on short sequences
    (eager 1.6x faster at 13 tokens, equal at 128, 0.5x at 512)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about a third more compute)."""

    @model_validator(mode="after")
    def _schedule(self) -> "UpdateConfig":
        if self.lr_schedule == "constant" and self.warmup_steps > 0:
            raise KeyedError("update.warmup_steps", "the constant schedule has no warmup; use linear_warmup or cosine")
        if self.lr_schedule == "cosine" and self.lr_decay_steps is not None and self.lr_decay_steps <= self.warmup_steps:
            raise KeyedError("update.lr_decay_steps", f"must be after the warmup (update.warmup_steps = "
                                                      f"{self.warmup_steps}); got {self.lr_decay_steps}")
        return self

    @model_validator(mode="after")
    def _rendezvous(self) -> "UpdateConfig":
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise KeyedError("update.rdzv_endpoint", f"update.nnodes = {self.nnodes} needs node 0's address for the "
                                                     f"other nodes to meet at, as host:port (e.g. 10.0.0.1:29500)")
        if self.rdzv_endpoint is not None:
            found = ENDPOINT.fullmatch(self.rdzv_endpoint)
            if found is None or not 1 <= int(found["port"]) <= 65535:
                # port 0 would let node 0 pick a port the other nodes cannot know
                raise KeyedError("update.rdzv_endpoint", f"must be host:port with a port in 1..65535 (an IPv6 host "
                                                         f"in brackets: [::1]:29500); got {self.rdzv_endpoint!r}")
        return self

    @property
    def world_size(self) -> int:
        """Ranks of the update: update.nproc on each of update.nnodes nodes."""
        return self.nproc * self.nnodes


class ValueModelConfig(Section):
    path: Optional[str] = None
    """Backbone of the critic; null = initialise from the init policy."""


class ValuePretrainConfig(Section):
    max_steps: int = Field(100, ge=0)
    """Most optimizer steps of value pretraining; 0 leaves the fresh value head as it is."""
    min_explained_variance: float = Field(0.5, le=1)
    """Stop early once the held-out explained variance reaches this."""
    eval_every: int = Field(5, ge=1)
    """Steps between held-out evaluations (and after the last step), where early stopping is checked. Each is
    a forward pass over the held-out responses, a quarter of `prompts` x M: with many prompts it outweighs
    the training steps (on reasoning, 4,096 prompts: 600 steps evaluated every 5 took as long as 1,200
    every 50; docs/critic.md, "More prompts"). The verifier and process phases evaluate 20 times in all, at
    least this many steps apart. Evaluating changes no weight: only where early stopping stops."""
    prompts: int = Field(512, ge=1)
    """Prompts sampled from the init policy (M responses each) to fit the critic on, a quarter of them held
    out; past the train split's size the draw goes round it again. On reasoning's seed 1, from the
    verifier phase alone, 2,048 -> 8,192 (the split's 7,000 and 1,192 again) raised the critic from 0.45
    to 0.56 of the ceiling on a common probe (docs/critic.md, "More prompts"); the cost of
    `target_continuations`, sampled at every state of every training response, grows with it."""
    verifier_steps: int = Field(0, ge=0)
    """Steps of a verifier phase before value pretraining (synthetic addition or reasoning; 0 = off). The
    critic first learns to tell each train prompt's sum from a one-digit near miss (reasoning: also its
    running sums from the same with one slip carried to the answer), reward 1 or 0, in value pretraining's
    own loop; then value pretraining starts from it, head kept. On addition, 3,000 steps (about 20 minutes
    on 2 cores) took the critic from 0.02 to 0.63 of its ceiling (through `dvc repro value_pretrain` on
    three seeds: 0.49, 0.76 and 0.67), and 6,000 steps to 0.73, 0.78 and 0.73 on the same seeds; on
    reasoning, 4,000 steps and then
    value pretraining of 300 steps at `value.lr` 3e-4 on 2,048 prompts took it from 0.44 to 0.71 on seed 0,
    and to 0.55 and 0.69 on seeds 1 and 2; on another CPU the three seeds gave 0.66, 0.60 and 0.73
    (docs/critic.md). A `value.lr` of 1e-3 after it
    undoes part of the check."""
    verifier_prompts: int = Field(8192, ge=1)
    """Train prompts of the verifier phase (at most the split's), each with its sum and a near miss."""
    verifier_lr: float = Field(0.001, gt=0)
    """Learning rate of the verifier phase, backbone and head."""
    verifier_lr_schedule: PretrainLRScheduleName = "constant"
    """The verifier phase's learning rate over its steps, as `lr_schedule` (from `verifier_lr`)."""
    verifier_targets: VerifierTargetsName = "outcome"
    """What the verifier phase fits at each state of its rows. `outcome`: the row's reward at every state,
    so that the states before a slip, which the right row shares, learn 0.5 from the two rows' 1 and 0.
    `on_track`: 1 while the text written so far is the start of one of the prompt's right responses and 0
    from the slipped token on (`on_track_labels`, the process phase's labels), so that every state teaches
    the check itself; the phase's held-out EV is then taken against those labels. On reasoning, with the
    whole recipe through `dvc repro value_pretrain`, `on_track` took seed 0's verifier to catch 96% of the
    slipped running sums (77% with `outcome`), and its critic moved from 0.72 to 0.73 of the ceiling; seed
    1's caught 69% (76%), and its critic went from 0.57 to 0.55 (docs/critic.md). So `outcome` stays the
    default."""
    process_steps: int = Field(0, ge=0)
    """Steps of a process phase after the verifier phase, before value pretraining (synthetic tasks; 0 =
    off). The init policy answers the train prompts (value pretraining's held-out ones left out),
    `process_samples` responses each, and every state is labelled 1 while the text written so far is the
    start of a right response (on reasoning: the running sums, or the marked answer alone) and 0 from the
    first token that leaves them all: whether the sums written so far are right, on the policy's own
    slips rather than the verifier phase's made-up ones. The critic is fit to those labels in value
    pretraining's loop at `process_lr`, then value pretraining starts from it. On reasoning, 1,000 steps
    after a 4,000-step verifier phase (14-19 minutes at one thread) took the three seeds' critics from
    0.65, 0.69 and 0.76 of their ceiling to 0.68, 0.68 and 0.78 (through `dvc repro value_pretrain` on
    another CPU, with the whole recipe: 0.72, 0.57 and 0.72 on seeds 0-2); from the init policy, without
    the verifier phase, it lowered seed 0's to 0.55 (docs/critic.md)."""
    process_samples: int = Field(4, ge=1)
    """Responses of the init policy to each train prompt in the process phase."""
    process_lr: float = Field(0.0003, gt=0)
    """Learning rate of the process phase, backbone and head (constant)."""
    lr_schedule: PretrainLRScheduleName = "constant"
    """Value pretraining's learning rate over its `max_steps`: `constant` (`value.lr`) or `cosine` (at step
    k of n, value.lr (1 + cos(pi k / n)) / 2: down towards 0 at the last step, so that the critic written
    is not one noisy step of a constant-rate walk). On the reasoning task (one seed, after the verifier
    phase) its gain was within the spread between two draws of the batches (docs/critic.md)."""
    average_from: Optional[float] = Field(None, ge=0, lt=1)
    """Write the uniform average of the critic's weights over the steps after this fraction of `max_steps`
    (0.5: the last half) instead of the last step's weights; null = the last step's. At a constant rate the
    held-out explained variance wanders on a plateau, and the average of that walk predicts better than
    any one step of it. On the reasoning task, after the verifier phase, 0.5 moved the critic's fraction
    of its ceiling by +0.04 and +0.01 (seed 1, two draws of the batches), +0.00 (seed 0) and +0.02
    (seed 2): a small gain, never a loss (docs/critic.md). The held-out EV and the oracle
    are then the averaged critic's; early stopping still reads the last step's, and a run stopped before
    the average starts writes the last step's weights. The verifier phase does not average."""
    target_continuations: int = Field(0, ge=0)
    """K continuations sampled from the init policy at every state of every training response (not the
    held-out ones); value pretraining then fits, at each state, the mean of the response's own return and
    their K rewards, K + 1 samples of V(s_t) where the return alone is one (VinePPO's Monte-Carlo values).
    0 = the return alone. The continuations are drawn and scored as the oracle's (`value.oracle_ev`) and
    cost K x (response length) generations per training response, less the states responses share (drawn
    once: 44% of them are distinct on reasoning). On the reasoning task, after the verifier phase, K = 2
    over 2,048 prompts took 13-19 minutes at one thread beside another job (before states were shared) and
    moved the critic's fraction of its ceiling by +0.01 to +0.02 on three seeds, never down
    (docs/critic.md). Needs `algorithm.gamma` 1 (their rewards are not discounted). The held-out EV is
    still taken against the returns."""


class OracleEVConfig(Section):
    """The critic's ceiling: the explained variance of the oracle V*(prefix), from Monte-Carlo
    continuations of each response prefix under the current policy (rlpipe/rollout/oracle.py)."""

    continuations: int = Field(0, ge=0)
    """K continuations sampled from every prefix of every probed response; their mean reward estimates
    V*(prefix). 0 = off; otherwise >= 2 (their spread corrects the estimate's noise). Costs K x (response
    length) generations per probed response, in value_pretrain and in every round's advantage stage, for
    presets with a critic (a no-op for the others)."""
    max_responses: int = Field(64, ge=1)
    """Most responses probed (a seeded sample of the batch, or of value pretraining's held-out responses)."""

    @field_validator("continuations")
    @classmethod
    def _off_or_two(cls, value: int) -> int:
        if value == 1:
            raise ValueError("must be 0 (off) or >= 2: one continuation gives no estimate of its own noise")
        return value


class ValueConfig(Section):
    model: ValueModelConfig = ValueModelConfig()
    """Where the critic's backbone comes from."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate of the critic (value pretraining and the per-round update)."""
    epochs: int = Field(1, ge=1)
    """Passes of the per-round critic update over the round's batch."""
    clip_range: float = Field(0.2, gt=0)
    """Clip of the value loss around the values of the rollout: V_old +- clip_range."""
    pretrain: ValuePretrainConfig = ValuePretrainConfig()
    """Value pretraining (the `value_pretrain` stage), for presets with a critic."""
    oracle_ev: OracleEVConfig = OracleEVConfig()
    """The oracle explained variance logged beside the critic's (`value/oracle_explained_variance`,
    `value/ev_fraction_of_ceiling`, with its 95% bootstrap interval over the probed responses in
    `value/ev_fraction_of_ceiling_low` and `_high`): after value pretraining and in every round's
    advantage stage."""


class EvalConfig(Section):
    max_prompts: int = Field(500, ge=1)
    """Test prompts scored (the first ones of the test split)."""
    samples: int = Field(8, ge=1)
    """n sampled responses per prompt for the unbiased pass@k."""
    k: list[int] = Field(default_factory=lambda: [1, 4, 8])
    """The k of pass@k; each must be <= samples."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the sampled pass@k and maj@k (greedy pass@1 ignores it)."""
    curve: bool = True
    """Also score every round's checkpoint (greedy pass@1), for the learning curve."""

    @model_validator(mode="after")
    def _k_le_samples(self) -> "EvalConfig":
        bad = [k for k in self.k if not 1 <= k <= self.samples]
        if bad:
            raise KeyedError("eval.k", f"each k must lie in [1, eval.samples = {self.samples}], got {bad}")
        return self


class TrackingConfig(Section):
    experiment: str = "rlpipe"
    """MLflow experiment name."""
    enabled: bool = True
    """Log to MLflow (RLPIPE_TRACKING=0 also turns it off); metrics files are written either way."""
