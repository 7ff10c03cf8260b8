"""`Params`, the whole `params.yaml`, and `load_params()`, which validates it before any stage works.

Cross-section rules (group estimators need >= 2 samples per prompt, chain_steps needs the chain task, ...)
are validators, so a bad params file fails before any model loads, with a message naming the key. An
unknown key names the nearest valid one. Torch-free: every stage validates the whole file first,
cheaply.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from rlpipe.config.components import GROUP_ESTIMATORS, VerifierName
from rlpipe.config.sections import (AlgorithmConfig, DataConfig, EvalConfig, KeyedError, ModelConfig, RewardConfig,
                                    RolloutConfig, RuntimeConfig, Section, TrackingConfig, UpdateConfig,
                                    ValueConfig, error_key)
from rlpipe.errors import PipelineError


class ParamsError(PipelineError, ValueError):
    """A params file that does not validate; the message names the file and each bad key."""


class Params(Section):
    seed: int = 0
    """Seed of everything random: data generation, the embedded model's init, sampling, shuffling."""
    runtime: RuntimeConfig = RuntimeConfig()
    """How stages run (threads, the warm worker); changes no artifact."""
    data: DataConfig = DataConfig()
    """The prompts: synthetic task, local files or a hub dataset."""
    model: ModelConfig = ModelConfig()
    """The policy: the embedded tiny model or a checkpoint."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling the round's responses."""
    reward: RewardConfig = RewardConfig()
    """Verifying the responses."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """The RL algorithm: a preset, and an override for any of its components."""
    update: UpdateConfig = UpdateConfig()
    """The policy update (and the critic's optimisation settings it shares)."""
    value: ValueConfig = ValueConfig()
    """The critic, for presets with one (ppo, orz, vapo)."""
    eval: EvalConfig = EvalConfig()
    """Scoring the policies on the test split."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow."""
    rounds: int = Field(1, ge=1)
    """How many rounds `dvc repro` runs: r1 .. rN, each starting from the previous round's policy (r0 is
    the init policy). The pipeline files must hold at least this many (`rlpipe pipeline` writes them);
    fewer run as they are, e.g. `dvc exp run --temp -S rounds=3`."""

    @field_validator("rounds", mode="before")
    @classmethod
    def _rounds_is_a_number(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise ValueError("is the number of rounds (e.g. `rounds: 6`), no longer a mapping of round names "
                             "(r1: {prev: r0}, ...); then run `rlpipe pipeline` to write the round files")
        return value

    @model_validator(mode="after")
    def _cross_section(self) -> "Params":
        algo = self.algorithm.resolve()
        if algo.estimator in GROUP_ESTIMATORS and self.rollout.samples_per_prompt < 2:
            raise KeyedError(
                "rollout.samples_per_prompt",
                f"must be >= 2 for estimator {algo.estimator!r} (preset {self.algorithm.preset!r}): "
                f"a group of one has no baseline; got {self.rollout.samples_per_prompt}",
            )
        if self.update.lr_schedule == "cosine" and self.update.lr_decay_steps is None:
            per_round = self.update.epochs * -(-self.rollout.prompts_per_round // self.update.minibatch_prompts)
            raise KeyedError("update.lr_decay_steps", f"the cosine schedule needs its horizon in optimizer steps: "
                                                      f"{per_round * self.rounds} for these {self.rounds} rounds of "
                                                      f"{per_round} steps (fewer if dynamic sampling drops groups)")
        if self.value.pretrain.verifier_steps and (self.data.source != "synthetic"
                                                   or self.data.task not in ("addition", "reasoning")):
            raise KeyedError("value.pretrain.verifier_steps", f"the verifier phase makes near misses of synthetic "
                                                              f"sums: data.source 'synthetic' with data.task "
                                                              f"'addition' or 'reasoning' only (got "
                                                              f"{self.data.source!r}, {self.data.task!r}); set it to 0")
        if self.value.pretrain.process_steps and self.data.source != "synthetic":
            raise KeyedError("value.pretrain.process_steps", f"the process phase labels each state against the "
                                                             f"right responses of a synthetic task: needs "
                                                             f"data.source 'synthetic' (got {self.data.source!r}); "
                                                             f"set it to 0")
        if self.value.pretrain.target_continuations and algo.gamma != 1:
            raise KeyedError("value.pretrain.target_continuations", f"the continuations' rewards are not "
                                                                    f"discounted: needs algorithm.gamma 1 (got "
                                                                    f"{algo.gamma}); set it to 0")
        if self.update.minibatch_mix == "rows" and algo.loss_agg == "group-token-mean":
            raise KeyedError("update.minibatch_mix", f"'rows' splits groups across steps, and loss_agg "
                                                     f"'group-token-mean' (preset {self.algorithm.preset!r}) "
                                                     f"weighs each group by its whole token count: use 'groups', "
                                                     f"or set algorithm.loss_agg")
        if self.resolved_verifier() == "chain_steps" and self.data.task != "chain":
            raise KeyedError("reward.verifier", "'chain_steps' needs data.task 'chain'")
        if self.model.lora.rank > 0 and self.update.strategy == "fsdp2":
            # peft saves its adapters from the live parameters, which FSDP2 holds as shards (DTensors)
            raise KeyedError("model.lora.rank", "LoRA trains under update.strategy 'ddp' (the adapters are small; "
                                                "the base is frozen), not 'fsdp2'")
        if self.data.source == "synthetic" and self.data.task == "reasoning" and \
                self.resolved_verifier() in ("exact_match", "chain_steps"):
            raise KeyedError("reward.verifier", f"{self.resolved_verifier()!r} cannot read data.task 'reasoning' "
                                                f"answers (after '#'); use marked_answer or auto")
        self._warn_if_answers_truncated()
        self._check_sequences_fit_the_embedded_model()
        return self

    def _warn_if_answers_truncated(self) -> None:
        """The embedded char tokenizer writes one token per character: a synthetic task whose answers
        (plus eos) exceed rollout.max_new_tokens would be truncated, and score (almost) nothing."""
        if self.data.source != "synthetic" or self.model.path is not None:
            return
        from rlpipe.data.tasks import longest_answer_chars

        needed = longest_answer_chars(self.data.task, self.data.digits, self.data.chain_terms, self.data.max_terms) + 1
        if self.rollout.max_new_tokens < needed:
            import warnings

            warnings.warn(f"rollout.max_new_tokens = {self.rollout.max_new_tokens} is shorter than the longest "
                          f"{self.data.task!r} answer with {self.data.digits}-digit operands ({needed} tokens with "
                          f"eos): those responses will be truncated; set rollout.max_new_tokens >= {needed}",
                          stacklevel=2)

    def _check_sequences_fit_the_embedded_model(self) -> None:
        """The embedded model is built for model.tiny.max_positions tokens: a synthetic prompt (one token a
        character, after <bos>) and a response of rollout.max_new_tokens must fit, or the policy would
        generate at positions it never saw in its warm start (nothing fails: transformers only logs a reminder)."""
        if self.data.source != "synthetic" or self.model.path is not None:
            return
        from rlpipe.data.tasks import longest_prompt_chars

        prompt = 1 + longest_prompt_chars(self.data.task, self.data.digits, self.data.chain_terms, self.data.max_terms)
        needed = prompt + self.rollout.max_new_tokens
        if self.model.tiny.max_positions < needed:
            raise KeyedError("model.tiny.max_positions", f"{self.model.tiny.max_positions} is shorter than the "
                                                         f"longest {self.data.task!r} prompt ({prompt} tokens with "
                                                         f"<bos>) plus rollout.max_new_tokens = "
                                                         f"{self.rollout.max_new_tokens}: set it to at least "
                                                         f"{needed}, or lower rollout.max_new_tokens")

    # derived settings, in one place -------------------------------------------------------------
    def resolved_verifier(self) -> VerifierName:
        if self.reward.verifier != "auto":
            return self.reward.verifier
        if self.data.source != "synthetic":
            return "math"
        return {"chain": "chain_steps", "reasoning": "marked_answer"}.get(self.data.task, "exact_match")

    @property
    def round_names(self) -> list[str]:
        return [f"r{k}" for k in range(1, self.rounds + 1)]

    @property
    def final_round(self) -> str:
        return f"r{self.rounds}"


# ----------------------------------------------------------------------------------------------
def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The model that holds the last key of `loc` (the section an unknown key was written in)."""
    current: Any = Params
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = current.model_fields[part].annotation
        elif getattr(current, "__origin__", None) is dict:
            current = current.__args__[1]
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def unknown_key_message(loc: tuple) -> str:
    """`unknown key`, with the nearest valid key of the same section when one is close."""
    model = _model_at(loc)
    valid = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
    if not close:
        return "unknown key"
    return f"unknown key; did you mean {'.'.join(map(str, (*loc[:-1], close[0])))}?"


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid params ({err.error_count()} error{'s' * (err.error_count() > 1)})"]
    for e in err.errors():
        keyed = e.get("ctx", {}).get("error")
        if isinstance(keyed, KeyedError):
            lines.append(f"  {keyed.key}: {keyed.message}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  {'.'.join(map(str, e['loc']))}: {unknown_key_message(e['loc'])}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  {error_key(e['loc'], Params) or '(top level)'}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def params_from_dict(raw: dict, source: str = "params") -> Params:
    try:
        return Params.model_validate(raw)
    except ValidationError as err:
        raise ParamsError(format_validation_error(err, source)) from None


def default_params_path() -> Path:
    return Path(os.environ.get("RLPIPE_PARAMS", "params.yaml"))


def load_params(path: str | Path | None = None) -> Params:
    """Read and validate the whole params file; raise ParamsError naming every bad key."""
    path = Path(path) if path is not None else default_params_path()
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found (cwd {Path.cwd()})")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return params_from_dict(raw, str(path))
