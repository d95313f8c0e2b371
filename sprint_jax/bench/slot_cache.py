"""The slot engine's two-level KV cache (the baseline `bench decode` measures the page pool
against) and the helpers that read and write it in place.

`SlotCache` holds P parent slots (a planner, a prompt; capacity max_seq_len) and, for each
parent slot, G child slots (an executor, one of n samples; capacity max_branch_tokens). Child
slot g of parent p is row p*G + g of the child arrays. A child reads its parent's KV up to the
fork point plus its own suffix; the prefix is never copied.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sprint_jax.infer.pages import as_bits, put_dropping
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import dtype_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotCache:
    """Parent slots pk, pv [L, P, Hkv, Sp, D]; child slots ck, cv [L, P*G, Hkv, Sc, D].

    Heads before positions: a slot's keys of one KV head are one contiguous [S, D] block, so the
    decode step gathers a row's used slots as a whole [Hkv, S_b, D] slice (`gather_rows`) and its
    attention (`attend_partial_heads`) multiplies them as they are: no transposed copy of the
    gathered K / V per step (the [.., S, Hkv, D] layout needed one, fused with the gather: a large
    part of a many-row step of the demo model on CPU). Prefill still transposes the rows it
    gathers for `flash_attention` (`programs.prefix_partial`); prefill calls are few."""
    pk: jax.Array
    pv: jax.Array
    ck: jax.Array
    cv: jax.Array

    @staticmethod
    def zeros(config: Qwen2Config, parents: int, children: int, parent_cap: int, child_cap: int) -> "SlotCache":
        dt = dtype_of(config.dtype)
        hkv, d = config.num_key_value_heads, config.head_dim
        p = (config.num_hidden_layers, parents, hkv, parent_cap, d)
        c = (config.num_hidden_layers, parents * children, hkv, child_cap, d)
        return SlotCache(jnp.zeros(p, dt), jnp.zeros(p, dt), jnp.zeros(c, dt), jnp.zeros(c, dt))

    @property
    def nbytes(self) -> int:
        return int(sum(a.size * a.dtype.itemsize for a in (self.pk, self.pv, self.ck, self.cv)))


def constrain(cache: SlotCache, kv) -> SlotCache:
    """The cache pinned to its (parent, child) NamedShardings on a mesh (kv=None: one device)."""
    if kv is None:
        return cache
    p, c = kv
    wsc = jax.lax.with_sharding_constraint
    return SlotCache(wsc(cache.pk, p), wsc(cache.pv, p), wsc(cache.ck, c), wsc(cache.cv, c))


def gather_rows(cache: jax.Array, layer, rows: jax.Array, size: int) -> jax.Array:
    """cache [L, N, Hkv, C, D] -> the first `size` slots of `rows` at `layer`: [R, Hkv, size, D].
    Each row is one whole [1, 1, Hkv, size, D] slice (a vmapped dynamic_slice: one gather whose
    slices keep the cache's layout; nothing is transposed)."""
    def take(c):
        shape = (1, 1, c.shape[2], size, c.shape[4])
        zero = jnp.zeros((), jnp.int32)
        return jax.vmap(lambda r: jax.lax.dynamic_slice(
            c, (jnp.asarray(layer, jnp.int32), r.astype(jnp.int32), zero, zero, zero), shape)[0, 0])(rows)
    return as_bits(cache, take)


def put_slots(cache: jax.Array, slot: jax.Array, pos: jax.Array, new: jax.Array) -> jax.Array:
    """Write new K or V into the cache [L, N, Hkv, C, D] in place (`put_dropping`): new [L, R, T, Hkv, D] at
    slot[r], positions pos[r, t] (prefill), or new [L, R, Hkv, D] at slot[r], position pos[r]
    (a decode step); out-of-range positions are dropped (padding).

    Every axis but head_dim is indexed by an explicit index array, so the scatter's update block is
    one [D] row and `new` is the update as it is. Indexing only slot and position (slices for L and
    Hkv) makes the block [L, Hkv, D], and XLA's TPU compile then carries the cache of a decode loop
    in a transposed layout, a second copy of the slots it writes."""
    n_layers, n_kv = cache.shape[0], cache.shape[2]
    if new.ndim == 5:             # index arrays broadcast to [L, R, T, Hkv]: the update is new itself
        layer = jnp.arange(n_layers)[:, None, None, None]
        head = jnp.arange(n_kv)[None, None, None, :]
        return put_dropping(cache, (layer, slot[None, :, None, None], head, pos[None, :, :, None]), new)
    layer = jnp.arange(n_layers)[:, None, None]    # [L, R, Hkv]
    head = jnp.arange(n_kv)[None, None, :]
    return put_dropping(cache, (layer, slot[None, :, None], head, pos[None, :, None]), new)
