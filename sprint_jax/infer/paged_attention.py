"""Attention over the paged KV pool on the XLA path (CPU, and the reference for the paged kernels),
and the two model programs built on it: a prefill chunk and one decode step through page tables.

A row's keys are read through its page table (`pages.gather_pages`: whole pages, in order). A
decode step groups rows as the slot engine does (`programs.parent_prefix_attention`): the rows of
a fork group (siblings) share the pages of their common prefix (`Fork.shared_len`, whole pages),
so the group's queries ride one query axis over those pages, read once per step for the whole
group; each row then attends to its own pages (from the shared prefix on: the copied partly filled
page and its own tokens), and the partial attentions merge by log-sum-exp (`merge_partials`).
A row alone is a group of one (shared length 0, or its own full pages).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.pages import KVPages, constrain_pool, gather_pages, scatter_pages
from sprint_jax.model.attention import NEG_INF, attend_partial, flash_attention
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import decoder, embed, merge_partials, unembed

_NEVER = 1 << 30        # a span_end no query row reaches


def _on_mesh(sharding):
    """Trace under the pool's mesh as the active abstract mesh (the model's activation
    constraints read it, as in the slot engine's `sharding.traced_on_mesh`); one device: nothing."""
    if sharding is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(sharding.mesh.abstract_mesh)


def paged_partial(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, layer, table: jax.Array,
                  n: jax.Array):
    """Each row's attention to the first n[r] tokens of its pages table [R, M] (all of them
    before its queries q [R, T, H, D]; pool_k, pool_v [L, Hkv, N, ps, D]). Returns (out [R, T, H, D],
    lse [R, T, H]) for `merge_partials` (n = 0: out 0, lse NEG_INF).

    The gathered keys stay heads-first, [Hkv, R, S, D] (`gather_pages`), and both products take
    them as they lie: (KV head, row) are the leading batch axes of the scores and of P x V, and only
    the small outputs are moved to [R, T, H, ...]."""
    k = gather_pages(pool_k, layer, table)                                 # [Hkv, R, S, D]
    v = gather_pages(pool_v, layer, table)
    r, t, h, d = q.shape
    hkv, s_len = k.shape[0], k.shape[2]
    qg = q.reshape(r, t, hkv, h // hkv, d)
    s = jnp.einsum("rtkgd,krsd->krgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    visible = (jnp.arange(s_len)[None, :] < n[:, None])[None, :, None, None, :]       # [1, R, 1, 1, S]
    s = jnp.where(visible, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(safe[..., 0]), NEG_INF)   # [Hkv, R, G, T]
    o = jnp.einsum("krgts,krsd->krgtd", (p / safe).astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.transpose(o, (1, 3, 0, 2, 4)).reshape(r, t, h, d).astype(q.dtype)
    return out, jnp.transpose(lse, (1, 3, 0, 2)).reshape(r, t, h)


def grouped_paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, layer,
                            group_table: jax.Array, group_len: jax.Array, row_table: jax.Array,
                            row_len: jax.Array):
    """A decode step's attention to cached keys, by sibling group: q [G, W, H, D] (group g's W
    rows); group g's shared prefix is the first group_len[g] tokens of pages group_table [G, Mg],
    read once for its W rows (they ride the query axis); row b = g*W + w then attends to the first
    row_len[b] tokens of its own pages row_table [G*W, Mr] (the tokens after the shared prefix).
    Returns the merged (out [G, W, H, D], lse [G, W, H])."""
    g, w, h, d = q.shape
    shared = paged_partial(q, pool_k, pool_v, layer, group_table, group_len)         # [G, W, H, D]
    o_r, l_r = paged_partial(q.reshape(g * w, 1, h, d), pool_k, pool_v, layer, row_table, row_len)
    own = (o_r.reshape(g, w, h, d), l_r.reshape(g, w, h))
    return merge_partials([shared, own])


# ---------------------------------------------------------------------------------------------
# Programs: a prefill chunk and a decode step through page tables
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedPrefillRows:
    """A prefill call's rows: tokens [R, T] written at positions start[r] + t (t < n_valid[r])
    through page tables table [R, M]; each row sees its first start[r] cached tokens. Padding
    rows: n_valid 0."""
    tokens: np.ndarray
    table: np.ndarray
    start: np.ndarray
    n_valid: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedDecodeRows:
    """A decode step's rows, G sibling groups of W rows (B = G*W): row b's pending token
    tokens[b] at position length[b] (the K/V it holds) through its page table table [B, M];
    group g's rows share the first shared[g] tokens (whole pages, the same pages in each row's
    table); active [B] false: a padding row (writes nothing)."""
    tokens: np.ndarray      # [B]
    table: np.ndarray       # [B, M]
    length: np.ndarray      # [B]
    shared: np.ndarray      # [G]
    active: np.ndarray      # [B] bool


@functools.partial(jax.jit, static_argnames=("config", "sharding", "all_logits"), donate_argnames=("pool",))
def paged_prefill(params, config: Qwen2Config, pool: KVPages, rows: PagedPrefillRows, sharding=None,
                  all_logits: bool = False):
    """Write the rows' tokens into their pages (see PagedPrefillRows); returns (pool, logits at each
    row's last valid token [R, V]; with all_logits at every token [R, T, V]). sharding: the pool's
    (`pool_sharding`; params placed by `sharding.shard_model` on its mesh), None: one device."""
    with _on_mesh(sharding):
        return _prefill(params, config, pool, rows, sharding, all_logits)


def _prefill(params, config, pool, rows, sharding, all_logits):
    r, t = rows.tokens.shape
    offs = rows.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]                 # [R, T]

    def attend(q, k, v, layer):
        prefix = paged_partial(q, pool.k, pool.v, layer, rows.table, rows.start)
        span_end = jnp.where(jnp.arange(t)[None] < rows.n_valid[:, None], jnp.int32(_NEVER), 0)
        own = flash_attention(q, k, v, span_end, return_lse=True)                    # causal in the chunk
        return merge_partials([prefix, own])[0], (k, v)

    hidden, (nk, nv) = decoder(params, config, embed(params, config, rows.tokens), offs, attend,
                               jnp.arange(config.num_hidden_layers))
    pos = jnp.where(jnp.arange(t)[None] < rows.n_valid[:, None], offs, -1)
    pool = constrain_pool(KVPages(scatter_pages(pool.k, rows.table, pos, nk),
                              scatter_pages(pool.v, rows.table, pos, nv)), sharding)
    if all_logits:
        return pool, unembed(params, config, hidden)
    last = jnp.take_along_axis(hidden, jnp.clip(rows.n_valid - 1, 0, t - 1)[:, None, None], axis=1)
    return pool, unembed(params, config, last)[:, 0]


@functools.partial(jax.jit, static_argnames=("config", "mg", "mr", "sharding"), donate_argnames=("pool",))
def paged_decode_step(params, config: Qwen2Config, pool: KVPages, rows: PagedDecodeRows, mg: int, mr: int,
                      sharding=None):
    """One decode step of every row (see PagedDecodeRows): each runs its pending token, attending
    to its group's shared prefix (mg pages read per group, once for its rows), its own pages after
    it (mr pages read per row) and itself; the new K/V is written through the page tables after
    the layer scan (the pages must be held by their row alone: `PageAllocator.prepare_write`).
    Returns (pool, logits [B, V])."""
    with _on_mesh(sharding):
        return _decode_step(params, config, pool, rows, mg, mr, sharding)


def _decode_step(params, config, pool, rows, mg, mr, sharding):
    b = rows.tokens.shape[0]
    g = rows.shared.shape[0]
    w = b // g
    ps = pool.page_size
    shared_rows = jnp.repeat(rows.shared, w)                                          # [B]
    group_table = rows.table[::w, :mg]                                                # a group's first row
    own_idx = (shared_rows // ps)[:, None] + jnp.arange(mr, dtype=jnp.int32)[None]
    own_table = jnp.take_along_axis(rows.table, jnp.clip(own_idx, 0, rows.table.shape[1] - 1), axis=1)
    own_len = rows.length - shared_rows

    def attend(q, k, v, layer):
        h, d = q.shape[2:]
        cached = grouped_paged_attention(q[:, 0].reshape(g, w, h, d), pool.k, pool.v, layer, group_table,
                                         rows.shared, own_table, own_len)
        cached = (cached[0].reshape(b, 1, h, d), cached[1].reshape(b, 1, h))
        itself = attend_partial(q, k, v, jnp.ones((b, 1, 1), bool))
        return merge_partials([cached, itself])[0], (k, v)

    hidden, (nk, nv) = decoder(params, config, embed(params, config, rows.tokens[:, None]),
                               rows.length[:, None], attend, jnp.arange(config.num_hidden_layers))
    pos = jnp.where(rows.active, rows.length, -1)[:, None]
    pool = constrain_pool(KVPages(scatter_pages(pool.k, rows.table, pos, nk),
                              scatter_pages(pool.v, rows.table, pos, nv)), sharding)
    return pool, unembed(params, config, hidden)[:, 0]
