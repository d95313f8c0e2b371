"""Dtype names <-> JAX dtypes: the one place that spells them (`--dtype`, config fields, exports).

The project computes and stores in two dtypes, named as JAX and HF name them. Anything else is
an error naming the accepted spellings, never a silent fallback.
"""
from __future__ import annotations

from typing import Any, Literal

DType = Literal["float32", "bfloat16"]
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16")


def dtype_of(dtype: Any):
    """A dtype name ("float32" | "bfloat16") or dtype object -> the JAX dtype."""
    import jax.numpy as jnp
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name(dtype)]


def dtype_name(dtype: Any) -> str:
    """A dtype name or dtype object (jnp / numpy / ml_dtypes) -> "float32" | "bfloat16"."""
    if isinstance(dtype, str):
        if dtype in DTYPE_NAMES:
            return dtype
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    import numpy as np
    name = np.dtype(dtype).name
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name} is not one of {', '.join(DTYPE_NAMES)}")
    return name


def torch_dtype(dtype: Any):
    """The torch dtype of the same name (HF reference models in tests and benchmarks)."""
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name(dtype)]


__all__ = ["DType", "DTYPE_NAMES", "dtype_of", "dtype_name", "torch_dtype"]
