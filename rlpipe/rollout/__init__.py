"""Generation backends: M responses per prompt from a policy checkpoint, with behaviour logprobs.

`ROLLOUT_BACKENDS` maps `rollout.backend` to a factory; `vllm` is imported only when chosen. Every stage
that generates (rollout, value pretraining, evaluation) builds its backend here and generates through
`rlpipe.rollout.generate.generate_groups`.
"""

from __future__ import annotations

import math
from pathlib import Path

from rlpipe.config import Params, RolloutConfig
from rlpipe.registry import Registry

ROLLOUT_BACKENDS = Registry("rollout backend")


def rollout_backend(models, policy_path: Path, cfg: RolloutConfig, dtype: str):
    """A generation backend on the policy at `policy_path`, from the stage's model store: the HF backend on
    the model the store holds, or the store's one vLLM engine with the checkpoint loaded in place."""
    return ROLLOUT_BACKENDS.get(cfg.backend)(models, Path(policy_path), cfg, dtype)


# A factory takes (the stage's model store, policy_path, rollout config, dtype) and returns a backend with
# `.tokenizer`, a `generate` (see base.py) and `.startup_seconds`.
@ROLLOUT_BACKENDS.register("hf")
def _hf_backend(models, policy_path: Path, cfg: RolloutConfig, dtype: str):
    from rlpipe.rollout.hf import HFBackend

    model, tokenizer = models.policy(policy_path, dtype)
    return HFBackend(model, tokenizer, batch_size=cfg.batch_size, bf16=cfg.bf16)


@ROLLOUT_BACKENDS.register("vllm")
def _vllm_backend(models, policy_path: Path, cfg: RolloutConfig, dtype: str):
    from rlpipe.rollout.vllm import VLLMBackend, engine_settings

    # On a GPU, the engine's turn: what the store holds waits on the CPU while an engine starts (it sizes
    # its memory from what is free) or wakes from sleep mode; an engine without sleep mode keeps its share
    # all along, beside the models.
    if models.engine is None or models.engine.settings != engine_settings(cfg, dtype, policy_path):
        from transformers import AutoTokenizer

        models.engine = None  # the old engine's memory goes before the new one takes its own
        models.offload()
        models.engine = VLLMBackend(str(policy_path), AutoTokenizer.from_pretrained(str(policy_path)), cfg, dtype=dtype)
    else:
        if models.engine.sleep_mode:
            models.offload()
        models.engine.startup_seconds = 0.0  # started for an earlier checkpoint
        models.engine.use_weights(policy_path)
    return models.engine


def prompts_to_generate(params: Params) -> int:
    """The round's prompts, over-sampled when dynamic sampling will drop groups."""
    n = params.rollout.prompts_per_round
    if params.algorithm.resolve().dynamic_sampling:
        n = math.ceil(n * params.rollout.oversample)
    return n
