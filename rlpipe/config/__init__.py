"""Configuration: pydantic models mirroring `params.yaml`, section by section, and their validation.

- `components`: the names of every pluggable component and the 16 presets (pure data);
- `sections`: one model per params section, with every default and a docstring per field;
- `params`: `Params` (the whole file) and `load_params()`.

Torch-free, so that each stage validates the whole file before any model loads.
"""

from rlpipe.config.components import GROUP_ESTIMATORS, PRESETS
from rlpipe.config.params import ParamsError, Params, default_params_path, load_params, params_from_dict
from rlpipe.config.sections import (AlgorithmConfig, DataConfig, EvalConfig, KeyedError, LoRAConfig,
                                    ModelConfig, ResolvedAlgorithm, RewardConfig, RolloutConfig, RolloutVLLMConfig,
                                    RuntimeConfig, TinyModelConfig, TrackingConfig, UpdateConfig, ValueConfig,
                                    WarmStartConfig)

__all__ = [
    "GROUP_ESTIMATORS", "PRESETS", "ParamsError", "Params", "default_params_path", "load_params", "params_from_dict",
    "AlgorithmConfig", "DataConfig", "EvalConfig", "KeyedError", "LoRAConfig", "ModelConfig", "ResolvedAlgorithm",
    "RewardConfig", "RolloutConfig", "RolloutVLLMConfig", "RuntimeConfig", "TinyModelConfig", "TrackingConfig",
    "UpdateConfig",
    "ValueConfig", "WarmStartConfig",
]
