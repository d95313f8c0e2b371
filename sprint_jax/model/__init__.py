"""Qwen2 and Qwen3 (one decoder, two families) in flax.nnx, its config, and HF checkpoint I/O."""
from sprint_jax.model.config import Qwen2Config, resolve_model_config
from sprint_jax.model.hf import CheckpointError, from_pretrained, load_params, save_params, save_pretrained
from sprint_jax.model.qwen2 import (PARAM_SPECS, Qwen2, abstract_params, forward, init_params,
                                    logical_axes, param_count)

__all__ = [
    "Qwen2Config", "resolve_model_config", "Qwen2", "forward", "init_params", "abstract_params",
    "logical_axes", "param_count", "PARAM_SPECS", "from_pretrained", "save_pretrained", "load_params",
    "save_params", "CheckpointError",
]
