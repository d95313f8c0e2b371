"""Many parents per call: each parent's prefix read once for all rows of its group (Pallas).

Why. The batched engine (sprint_jax/infer/programs.py) decodes rows in groups
[parent, child_1..child_G]: a planner or prompt and the executors / samples forked from it. Every
row of a group attends over its parent's slot of the parent cache (the parent row over its own
past, a child over the prefix up to the fork point), then over its own suffix, and the parts merge
by log-sum-exp (Hydragen; FlashInfer's cascade attention). `shared_prefix_attention` (this
package) serves one parent; this kernel serves all groups of a decode step in one pallas_call:
the W x H/Hkv queries of a group meet each key block of its parent's prefix once, so a prefix is
read from HBM once per step (per query block) whatever the number of children.

What. `grouped_prefix_attention(q [Gr, W, H, D], k_cache, v_cache [N, S, Hkv, D], kv_rows [Gr],
lens [Gr, W])` (or [N, Hkv, S, D] with heads_first=True, the engine's layout: below): group g reads
cache row kv_rows[g] (the engine passes the layer's parent cache as rows layer*P + slot of a free
[L*P, Hkv, S, D] view, so neither the layer nor the slot is ever gathered or copied); member w
sees its first lens[g, w] keys. Returns (out [Gr, W, H, D] in q's dtype, lse [Gr, W, H] natural
log fp32): the same pair as the engine's XLA path
(`grouped_prefix_attention_reference`: gather the slot, `attend_partial` under the length mask),
so the child-suffix and self parts merge with it exactly as before. A row that sees no key gives
out 0 and lse NEG_INF (it vanishes in the merge).

Key blocks past a group's used length (the max of its lens) are never read:
  * "gpu" (Triton): grid (group, KV head, query block, split); a program loops over its split of
    the keys with a trip count from the group length (scalar input), masked loads; the cache is a
    whole-array ref addressed by (kv_rows[g], rows, head): pointer arithmetic, no gather.
    Split-K (flash-decoding) fills the GPU when groups x KV heads x query blocks is small; the
    splits merge by lse outside the kernel.
  * "tpu" (Mosaic): grid (group, KV head, query block, key block), key axis sequential with the
    running statistics in VMEM scratch; kv_rows and the group lengths are scalar-prefetched, so
    the K/V index map picks the slot and clamps to the group's last used block (no DMA past it)
    and `pl.when` skips its compute. Per-row lengths and lse are lane-replicated [.., 128] blocks
    (the layout the single-parent kernel uses for its statistics).
On CPU either body runs with interpret=True (tests); `jax.export` lowers both at 7B sizes.

heads_first=True takes the cache as [N, Hkv, S, D] (the batched engine's slot cache layout since
the decode step reads whole [Hkv, S, D] slices: `sprint_jax.bench.slot_cache.SlotCache`): the GPU body
addresses (row, head, keys) instead of (row, keys, head); the TPU body takes (bk, D) blocks of
(row, head) directly, so it needs no [S, Hkv*D] view and no D % 128 == 0.

Layout. Queries of a group are laid out per KV head as W x (H/Hkv) rows (member-major), padded to
the query block. With the default [N, S, Hkv, D] cache (heads_first=False: `bench kernels`' single
cache, the tests) the TPU body views it [N, S, Hkv*D] (a (rows, D) block at column block h), which
needs D % 128 == 0 when Hkv > 1 (Qwen2: 128); heads_first=True needs neither. On GPU D must be a
power of two >= 16 in both layouts.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from .reference import attend_partial, attend_partial_heads, merge_partials
from .shared_prefix import (GPU_MIN_DIM, LOG2E, M_INIT, TPU_LANES, TPU_MAX_BLOCK_Q, BlockSizes,
                            Platform, auto_splits, finish, fit_gpu_blocks, next_pow2, resolve_platform,
                            round_up)


def default_group_block_sizes(platform: Platform, groups: int, width: int, num_heads: int,
                              num_kv_heads: int, capacity: int, *, head_dim: int = 128,
                              dtype=jnp.bfloat16) -> BlockSizes:
    """Tiles for `groups` groups of `width` rows over a cache of `capacity` keys per slot.

    A group has width x H/Hkv query rows per KV head. GPU: up to 128 rows a block, 64-key blocks
    at 128 rows and 128-key blocks below, split-K to ~2 programs per SM, smaller blocks where the
    tiles would not fit the target GPU's shared memory (`fit_gpu_blocks`). TPU: all rows of a group
    in one block up to 1024 (the prefix is then read exactly once), 512-key blocks or the whole
    capacity when shorter.
    """
    rows = width * (num_heads // num_kv_heads)
    if platform == "tpu":
        block_q = round_up(rows, 16) if rows <= TPU_MAX_BLOCK_Q else 512
        return BlockSizes(block_q=block_q, block_k=max(1, min(512, capacity)), num_splits=1)
    block_q = min(128, max(GPU_MIN_DIM, next_pow2(rows)))
    block_k = min(64 if block_q >= 128 else 128, max(GPU_MIN_DIM, next_pow2(capacity)))
    block_q, block_k = fit_gpu_blocks(block_q, block_k, head_dim, dtype)
    programs = groups * num_kv_heads * -(-rows // block_q)
    return BlockSizes(block_q=block_q, block_k=block_k,
                      num_splits=auto_splits(programs, -(-capacity // block_k)),
                      num_warps=8 if block_q >= 128 else 4, num_stages=2)


def lowers_for(platform: Platform, head_dim: int, num_kv_heads: int, heads_first: bool = False) -> bool:
    """Whether the real (non-interpret) body of `platform` takes this head layout."""
    if platform == "tpu":
        return heads_first or head_dim % 128 == 0 or num_kv_heads == 1
    return head_dim >= GPU_MIN_DIM and not head_dim & (head_dim - 1)


def online_softmax_step(q, k, v, row0, row_end, end, m, l, acc, *, scale_log2: float, precision):
    """Online-softmax update of q [bq, D] with keys row0.. (k, v [bk, D]).

    Query row r sees keys < row_end[r] (row_end [bq, 1]); V rows >= end (the group's length) are
    zeroed: their p is 0, but 0 x whatever lies past the valid rows (or past the array, in a
    partial last block) could be NaN. m, l [bq, 1] base-2 running max / sum; acc [bq, D] fp32."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=precision) * scale_log2                          # [bq, bk]
    cols = row0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where(cols.astype(row_end.dtype) < row_end, s, -jnp.inf)
    m_next = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp2(s - m_next)
    alpha = jnp.exp2(m - m_next)
    v = jnp.where(row0 + lax.broadcasted_iota(jnp.int32, v.shape, 0) < end, v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=precision)
    return m_next, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _gpu_kernel(row_ref, glen_ref, rlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_k: int,
                split_len: int, scale_log2: float, precision, heads_first: bool = False):
    """Program (group, KV head, query block, split): keys [split*split_len, ..) of the group's slot."""
    head = pl.program_id(1)
    slot = row_ref[()]
    start = pl.program_id(3) * split_len
    end = jnp.minimum(start + split_len, glen_ref[()])
    row_end = jnp.minimum(rlen_ref[...], end)[:, None]                             # [bq, 1]
    q = q_ref[...]
    bq, d = q.shape

    def body(i, carry):
        row0 = pl.multiple_of(start + i * block_k, block_k)
        ok = row0 + lax.broadcasted_iota(jnp.int32, (block_k, d), 0) < end
        at = (slot, head, pl.ds(row0, block_k)) if heads_first else (slot, pl.ds(row0, block_k), head)
        k = plgpu.load(k_ref.at[at + (slice(None),)], mask=ok, other=0)
        v = plgpu.load(v_ref.at[at + (slice(None),)], mask=ok, other=0)
        return online_softmax_step(q, k, v, row0, row_end, end, *carry, scale_log2=scale_log2,
                     precision=precision)

    init = (jnp.full((bq, 1), M_INIT, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros((bq, d), jnp.float32))
    m, l, acc = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), block_k), body, init)
    o, lse = finish(m, l, acc)
    o_ref[...] = o
    lse_ref[...] = lse.reshape(bq)


def _tpu_kernel(rows_ref, glens_ref, rlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref,
                acc_ref, *, block_k: int, scale_log2: float, precision):
    """Grid step (group, KV head, query block, key block kb); statistics in VMEM scratch."""
    kb = pl.program_id(3)
    length = glens_ref[pl.program_id(0)]

    @pl.when(kb == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, M_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def stats():  # the lanes hold copies: a lane max is a layout-safe [bq, 1] read
        return (jnp.max(m_ref[...], axis=1, keepdims=True),
                jnp.max(l_ref[...], axis=1, keepdims=True))

    @pl.when(kb * block_k < length)
    def _step_block():
        m, l = stats()
        row_end = jnp.max(rlen_ref[...], axis=1, keepdims=True)                     # [bq, 1] f32
        m, l, acc = online_softmax_step(q_ref[...], k_ref[...], v_ref[...], kb * block_k, row_end, length, m, l,
                          acc_ref[...], scale_log2=scale_log2, precision=precision)
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    @pl.when(kb == pl.num_programs(3) - 1)
    def _store():
        m, l = stats()
        o, lse = finish(m, l, acc_ref[...])
        o_ref[...] = o
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _check_inputs(q, k_cache, v_cache, kv_rows, lens, heads_first: bool = False):
    if q.ndim != 4:
        raise ValueError(f"q must be [groups, W, H, D], got shape {q.shape}")
    gr, w, h, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        layout = "[N, Hkv, S, D]" if heads_first else "[N, S, Hkv, D]"
        raise ValueError(f"k_cache and v_cache must both be {layout}, got {k_cache.shape} "
                         f"and {v_cache.shape}")
    hkv = k_cache.shape[1 if heads_first else 2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head dim mismatch: q has D={d}, k_cache has D={k_cache.shape[3]}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if jnp.shape(kv_rows) != (gr,):
        raise ValueError(f"kv_rows must be [groups={gr}], got shape {jnp.shape(kv_rows)}")
    if jnp.shape(lens) != (gr, w):
        raise ValueError(f"lens must be [groups={gr}, W={w}], got shape {jnp.shape(lens)}")
    return gr, w, h, hkv, d, k_cache.shape[0], k_cache.shape[2 if heads_first else 1]


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes", "platform", "heads_first"))
def grouped_prefix_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                             kv_rows: jax.Array, lens: jax.Array, *, interpret: bool = False,
                             block_sizes: BlockSizes | None = None,
                             platform: Platform | None = None, heads_first: bool = False):
    """Attention of every group's rows over its own cache row, each prefix read once (Pallas).

    q [Gr, W, H, D]; k_cache, v_cache [N, S, Hkv, D]; kv_rows [Gr] int (clipped to [0, N)); lens
    [Gr, W] int (clipped to [0, S]): member w of group g sees keys 0..lens[g, w]-1 of cache row
    kv_rows[g]. Query head h uses KV head h // (H / Hkv); scale 1 / sqrt(D); logits and softmax
    in fp32 (fp32 inputs: IEEE-fp32 products). Returns (out [Gr, W, H, D] in q's dtype, lse
    [Gr, W, H] fp32 natural log; a row with no key: out 0, lse NEG_INF).

    platform "gpu" (Triton) / "tpu" (Mosaic), default from jax.default_backend() (the GPU body on
    CPU); interpret=True runs the body in the Pallas interpreter (required on CPU).
    heads_first: k_cache, v_cache are [N, Hkv, S, D] instead.
    """
    gr, w, h, hkv, d, n, s = _check_inputs(q, k_cache, v_cache, kv_rows, lens, heads_first)
    if not interpret and platform is None and jax.default_backend() == "cpu":
        raise ValueError("Pallas has no CPU lowering: call grouped_prefix_attention with "
                         "interpret=True on CPU")
    plat = resolve_platform(platform)
    if not interpret and not lowers_for(plat, d, hkv, heads_first):
        raise ValueError(
            f"the TPU kernel needs head_dim a multiple of 128 (got {d}) when Hkv > 1: a (rows, D) "
            f"block of the [S, Hkv*D] cache view is lane-tiled" if plat == "tpu" else
            f"the GPU kernel needs head_dim a power of two >= 16 (got {d})")
    sizes = default_group_block_sizes(plat, gr, w, h, hkv, s, head_dim=d, dtype=q.dtype)
    if block_sizes is not None:
        sizes = dataclasses.replace(sizes, **{f.name: getattr(block_sizes, f.name)
                                              for f in dataclasses.fields(block_sizes)
                                              if getattr(block_sizes, f.name) is not None})
    for name in ("block_q", "block_k", "num_splits"):
        if not isinstance(getattr(sizes, name), int) or getattr(sizes, name) < 1:
            raise ValueError(f"block_sizes.{name} must be a positive int, got {getattr(sizes, name)!r}")
    bq, bk = sizes.block_q, sizes.block_k
    if plat == "gpu" and not interpret and any(x < GPU_MIN_DIM or x & (x - 1) for x in (bq, bk)):
        raise ValueError(f"block_sizes {bq}x{bk}: Triton needs powers of two >= 16")
    g = h // hkv
    rows = w * g
    m_pad = round_up(rows, bq)
    scale_log2 = LOG2E / math.sqrt(d)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    # queries per (group, KV head): member-major rows [w0 heads.., w1 heads.., ..], padded
    qk = q.reshape(gr, w, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(gr, hkv, rows, d)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, m_pad - rows), (0, 0)))
    lens = jnp.clip(jnp.asarray(lens, jnp.int32), 0, s)
    row_len = jnp.pad(jnp.repeat(lens, g, axis=1), ((0, 0), (0, m_pad - rows)))    # [Gr, M]
    glen = jnp.max(lens, axis=1)
    kv_rows = jnp.clip(jnp.asarray(kv_rows, jnp.int32), 0, n - 1)
    q_shape = (None, None, bq, d)

    if plat == "tpu":
        key_blocks = pl.cdiv(s, bk)

        def kv_map(gi, hi, qi, kb, rows_ref, glens_ref):
            last = jnp.maximum(pl.cdiv(glens_ref[gi], bk) - 1, 0)
            if heads_first:                        # block (bk, D) of (row, head): [N, Hkv, S, D]
                return rows_ref[gi], hi, jnp.minimum(kb, last), 0
            return rows_ref[gi], jnp.minimum(kb, last), hi

        kv_block = (None, None, bk, d) if heads_first else (None, bk, d)

        q_map = lambda gi, hi, qi, kb, *_: (gi, hi, qi, 0)  # noqa: E731
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(gr, hkv, m_pad // bq, key_blocks),
            in_specs=[pl.BlockSpec((None, bq, TPU_LANES), lambda gi, hi, qi, kb, *_: (gi, qi, 0)),
                      pl.BlockSpec(q_shape, q_map),
                      pl.BlockSpec(kv_block, kv_map),
                      pl.BlockSpec(kv_block, kv_map)],
            out_specs=[pl.BlockSpec(q_shape, q_map),
                       pl.BlockSpec((None, None, bq, TPU_LANES), q_map)],
            scratch_shapes=[pltpu.VMEM((bq, TPU_LANES), jnp.float32),
                            pltpu.VMEM((bq, TPU_LANES), jnp.float32),
                            pltpu.VMEM((bq, d), jnp.float32)])
        rlen = jnp.broadcast_to(row_len.astype(jnp.float32)[..., None], (gr, m_pad, TPU_LANES))
        o, lse = pl.pallas_call(
            functools.partial(_tpu_kernel, block_k=bk, scale_log2=scale_log2, precision=precision),
            grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((gr, hkv, m_pad, d), jnp.float32),
                       jax.ShapeDtypeStruct((gr, hkv, m_pad, TPU_LANES), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret, name="grouped_prefix_attention",
        )(kv_rows, glen, rlen, qk, *((k_cache, v_cache) if heads_first else
                                      (k_cache.reshape(n, s, hkv * d), v_cache.reshape(n, s, hkv * d))))
        parts = [(o, lse[..., 0])]
    else:
        key_blocks = pl.cdiv(s, bk)
        per_split = -(-key_blocks // max(1, min(sizes.num_splits, key_blocks)))
        splits = -(-key_blocks // per_split)
        whole = pl.BlockSpec(k_cache.shape, lambda gi, hi, qi, si: (0, 0, 0, 0))
        o, lse = pl.pallas_call(
            functools.partial(_gpu_kernel, block_k=bk, split_len=per_split * bk,
                              scale_log2=scale_log2, precision=precision, heads_first=heads_first),
            grid=(gr, hkv, m_pad // bq, splits),
            in_specs=[pl.BlockSpec((None,), lambda gi, hi, qi, si: (gi,)),
                      pl.BlockSpec((None,), lambda gi, hi, qi, si: (gi,)),
                      pl.BlockSpec((None, bq), lambda gi, hi, qi, si: (gi, qi)),
                      pl.BlockSpec(q_shape, lambda gi, hi, qi, si: (gi, hi, qi, 0)),
                      whole, whole],
            out_specs=[pl.BlockSpec((None, None, None, bq, d),
                                    lambda gi, hi, qi, si: (si, gi, hi, qi, 0)),
                       pl.BlockSpec((None, None, None, bq), lambda gi, hi, qi, si: (si, gi, hi, qi))],
            out_shape=[jax.ShapeDtypeStruct((splits, gr, hkv, m_pad, d), jnp.float32),
                       jax.ShapeDtypeStruct((splits, gr, hkv, m_pad), jnp.float32)],
            compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps,
                                                 num_stages=sizes.num_stages),
            interpret=interpret, name="grouped_prefix_attention",
        )(kv_rows, glen, row_len, qk, k_cache, v_cache)
        parts = [(o[i], lse[i]) for i in range(splits)]
    out, lse = merge_partials(parts) if len(parts) > 1 else parts[0]
    out = out[:, :, :rows].reshape(gr, hkv, w, g, d).transpose(0, 2, 1, 3, 4).reshape(gr, w, h, d)
    lse = lse[:, :, :rows].reshape(gr, hkv, w, g).transpose(0, 2, 1, 3).reshape(gr, w, h)
    return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=("heads_first",))
def grouped_prefix_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                       kv_rows: jax.Array, lens: jax.Array, heads_first: bool = False):
    """`grouped_prefix_attention` in plain jnp: the batched engine's XLA path (gather each group's
    cache row, `attend_partial` with the group's queries on the query axis under a length mask;
    heads_first: the [N, Hkv, S, D] cache and `attend_partial_heads`)."""
    gr, w, h, hkv, d, n, s = _check_inputs(q, k_cache, v_cache, kv_rows, lens, heads_first)
    rows = jnp.clip(jnp.asarray(kv_rows, jnp.int32), 0, n - 1)
    mask = jnp.arange(s)[None, None, :] < jnp.asarray(lens)[:, :, None]                # [Gr, W, S]
    attend = attend_partial_heads if heads_first else attend_partial
    return attend(q, k_cache[rows], v_cache[rows], mask)


def group_bytes_read(group_lens, width: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype) -> int:
    """HBM bytes one grouped step must read: each group's prefix up to its longest row, once
    (K and V), and the queries. `group_lens`: the used length of each group."""
    item = jnp.dtype(dtype).itemsize
    kv_row = 2 * num_kv_heads * head_dim * item
    return int(sum(group_lens)) * kv_row + len(group_lens) * width * num_heads * head_dim * item
