"""Exact checksums of array trees (the bits, not the values) and a finiteness check, on device.

Used to verify a restored checkpoint against what was saved (train/checkpoint.py) and to name
the weights an evaluation ran with (eval/evaluate.py: a resumed eval must use the same model).
Integer sums wrap the same way in any reduction order, so the result is exact under any sharding
and never needs the arrays on the host.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _as_u32(x):
    """The bits of `x` as a flat uint32 vector (one entry per element; 8-byte types give two)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    size = x.dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    if size in (1, 2):
        small = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, small).astype(jnp.uint32).reshape(-1)
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)   # 8 bytes -> [..., 2]


@jax.jit
def _checksum_and_finite(tree) -> Any:
    """Per leaf: [sum of the bits, position-weighted sum of the bits] mod 2**32, and all-finite.

    Integer sums wrap the same way in any reduction order, so the checksum is exact under any
    sharding; the odd position weights make a moved value change it."""
    def sums(x):
        u = _as_u32(x)
        w = jnp.arange(u.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * w, dtype=jnp.uint32)])

    def finite(x):
        x = jnp.asarray(x)
        return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return jax.tree.map(sums, tree), jax.tree.map(finite, tree)


def checksum(state) -> tuple[list[list[int]], list[str]]:
    """(per-leaf [bit sum, weighted bit sum] as ints, paths of the leaves that are not finite)."""
    sums, finite = jax.device_get(_checksum_and_finite(state))
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    return ([[int(v) for v in np.asarray(s)] for s in jax.tree.leaves(sums)],
            [p for p, ok in zip(paths, jax.tree.leaves(finite)) if not bool(ok)])


def digest(tree) -> str:
    """A short hex name for the exact bits of every array in `tree`."""
    import hashlib
    import json
    sums, _ = checksum(tree)
    return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]
