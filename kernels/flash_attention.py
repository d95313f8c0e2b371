"""Flash attention under the span rule in Pallas: the GPU (Triton) and TPU (Mosaic) bodies.

What. The bodies behind `sprint_jax.model.attention.flash_attention` on accelerators: row
i = q_offset[b] + t sees key j iff j <= i < span_end[b, j] (train/data.py; flat packing and the
trie are both this rule). `flash_forward` returns (out, lse); `flash_backward` returns (dq, dk, dv)
from the saved lse, recomputing each tile (FlashAttention-2, Dao 2023). The custom_vjp, the
argument checks and the mesh handling live in the model module; the reference is its XLA body
(`attention._xla_forward/_xla_backward`) and, independently, the dense `attend_partial`.

Empty tiles. A (query block, key block) tile is skipped when the key block starts after the
query block's last row, or when kmax[b, key block] (the largest span_end in it, computed once
per call) is <= the query block's first row.
  * gpu: grid (batch, query head, query block) for the forward and dq, (batch, query head, key
    block) for dk/dv; each program loops only over the causal range of the other axis and runs
    a tile under `lax.cond` on its visibility. Keys / queries of a head are one full-length block
    read with `pl.ds` slices; grouped-query heads index their KV head in the index map.
  * tpu: grid (batch, query head, query block, key block) with the inner axis sequential
    ("arbitrary") and running statistics in VMEM scratch; q_offset and kmax are scalar-prefetched,
    so the index map clamps the inner block to the causal range (no DMA past it: a repeated block
    index is not re-fetched) and `pl.when` skips the compute of every empty tile. Row statistics
    (lse, delta) travel replicated across the 128 lanes, as in jax's TPU flash attention.
The (stage, branch) form (merge layout; the rule in `sprint_jax.model.attention`, its tile test in
`reference`): with `tags` [B, 2, S] every kernel also ANDs `merge_visible` into the tile mask and
`merge_tile_visible` into the skip test. gpu: the kernels read the query rows' and keys' tags ([2, N] refs) and reduce
the block summaries in the kernel. tpu: query tags come as [B, Tp, 2] (a block's rows read as
[bq, 1] columns), key tags as [B, 2, Sp], and the block summaries are scalar-prefetched
(ksum [B*nk*4], qsum [B*nq*3]); `pl.when` skips a tile either test empties.
Layout: q, o [B, T, H*D] and k, v [B, S, Hkv*D] (free views); a block is (rows, D) at column
block h, so TPU needs D % 128 == 0 when there is more than one head (Qwen2: D = 128). GPU pads a
head dim that is not a power of two >= 16 (Triton); lengths are padded to whole blocks (padded keys
get span_end 0: never visible). dk/dv are computed per query head and summed over the group.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from . import gpu_target
from .reference import (NEG_INF, key_summary, merge_summaries, merge_tile_visible, merge_visible,
                        pad_query_tags, query_summary, query_tags)

_M_INIT = -1e30
_LANES = 128
_PAD_LSE = 1e30      # padded query rows: exp(s - lse) = 0, so they add nothing (not inf * 0)
_GPU_MIN_DIM = 16
_DIMS_T = (((1,), (1,)), ((), ()))       # a @ b.T
_DIMS_N = (((1,), (0,)), ((), ()))       # a @ b


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _dot(a, b, dims, precision):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _mask(row_lo, col_lo, se, shape):
    """[bq, bk] tile mask; se [1, bk] or [bk] are the keys' span ends."""
    rows = row_lo + lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = col_lo + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (cols <= rows) & (rows < se.reshape(1, shape[1]))


# GPU tile candidates, largest first: 128 x 128 is what 8 warps hold as one fp32 tile; smaller ones
# keep the tiles inside the GPU's shared memory (fp32, wide heads, 99 KB parts).
_GPU_BLOCKS = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (32, 16), (16, 16))


def gpu_blocks(t: int, s: int, head_dim: int, dtype, smem: int | None = None) -> tuple[int, int]:
    """(block_q, block_k) for the GPU kernels: the largest candidate whose tiles fit `smem` bytes of
    shared memory (default: the target GPU's, `gpu_target`) at this dtype and head dim, each no
    larger than its (power-of-two, >= 16) length needs."""
    smem = gpu_target.shared_memory() if smem is None else smem
    dp = max(_GPU_MIN_DIM, _next_pow2(head_dim))
    cap_q, cap_k = max(_GPU_MIN_DIM, _next_pow2(t)), max(_GPU_MIN_DIM, _next_pow2(s))
    for bq, bk in _GPU_BLOCKS:
        bq, bk = min(bq, cap_q), min(bk, cap_k)
        if gpu_target.flash_smem(bq, bk, dp, dtype) <= smem:
            return bq, bk
    raise ValueError(f"no flash block fits {smem} bytes of shared memory at head_dim {head_dim}, {dtype}")


class _Prep:
    """Padded, viewed operands shared by both platforms' forward and backward. With the merge
    form (`tags` [B, 2, S] = stage, branch): q_tags [B, 2, Tp] (gpu) or [B, Tp, 2] (tpu: a block
    of rows reads its tags as [bq, 1] columns), k_tags [B, 2, Sp]; tpu also gets the per-block
    summaries flattened for scalar prefetch (ksum [B*nk*4], qsum [B*nq*3])."""

    def __init__(self, q, k, v, span_end, q_offset, platform, block_q, block_k, tags=None):
        b, t, h, d = q.shape
        s, hkv = k.shape[1], k.shape[2]
        self.b, self.t, self.h, self.d, self.s, self.hkv, self.g = b, t, h, d, s, hkv, h // hkv
        self.bq, self.bk = block_q, block_k
        self.dp = max(_GPU_MIN_DIM, _next_pow2(d)) if platform == "gpu" else d
        self.tp, self.sp = _round_up(t, block_q), _round_up(s, block_k)
        self.nq, self.nk = self.tp // block_q, self.sp // block_k
        self.scale = 1.0 / math.sqrt(d)
        self.precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        self.span_end = _pad_axis(span_end.astype(jnp.int32), 1, self.sp)          # [B, Sp]
        self.kmax = jnp.max(self.span_end.reshape(b, self.nk, block_k), axis=-1)   # [B, nk]
        self.q_offset = q_offset.astype(jnp.int32)
        self.merge = tags is not None
        if self.merge:
            q_tags = pad_query_tags(query_tags(tags, t, self.q_offset), self.tp)     # [B, 2, Tp]
            self.k_tags = _pad_axis(tags.astype(jnp.int32), 2, self.sp)              # [B, 2, Sp]
            self.q_tags = q_tags if platform == "gpu" else jnp.swapaxes(q_tags, 1, 2)
            qsum, ksum = merge_summaries(q_tags, self.k_tags, self.span_end, block_q, block_k)
            self.qsum = jnp.stack(qsum, axis=-1).reshape(-1)                        # [B*nq*3]
            self.ksum = jnp.stack(ksum, axis=-1).reshape(-1)                        # [B*nk*4]

    def rows(self, x, n):            # [B, T, N, D] -> [B, Tp, N*Dp]
        x = _pad_axis(_pad_axis(x, 3, self.dp), 1, self.tp)
        return x.reshape(x.shape[0], self.tp, n * self.dp)

    def keys(self, x, n):            # [B, S, N, D] -> [B, Sp, N*Dp]
        x = _pad_axis(_pad_axis(x, 3, self.dp), 1, self.sp)
        return x.reshape(x.shape[0], self.sp, n * self.dp)

    def unrows(self, x, n):          # [B, Tp, N*Dp] -> [B, T, N, D]
        return x.reshape(self.b, self.tp, n, self.dp)[:, :self.t, :, :self.d]

    def unkeys(self, x, n):
        return x.reshape(self.b, self.sp, n, self.dp)[:, :self.s, :, :self.d]


# ---------------------------------------------------------------------------------------------
# GPU (Triton)
# ---------------------------------------------------------------------------------------------
class _GpuMerge:
    """The (stage, branch) factor inside a GPU forward / dq kernel: this program's query rows' tags
    ([2, bq] ref) and the row's key tags ([2, Sp] ref). Summaries are reduced in the kernel from
    the tags (cheap next to a tile's matmuls), so no summary arrays are passed."""

    def __init__(self, qt_ref, kt_ref, bq, bk):
        self.kt_ref, self.bk = kt_ref, bk
        qs, qb = qt_ref[0, :], qt_ref[1, :]
        self.qsum = query_summary(qs, qb)
        self.qs, self.qb = qs.reshape(bq, 1), qb.reshape(bq, 1)

    def keys(self, c0, se):
        """(stage, branch, some row may see it) of key block c0 .. c0 + bk."""
        ks, kb = self.kt_ref[0, pl.ds(c0, self.bk)], self.kt_ref[1, pl.ds(c0, self.bk)]
        return ks, kb, se > c0 + lax.broadcasted_iota(jnp.int32, (self.bk,), 0)

    def visible(self, ks, kb, valid):
        return merge_tile_visible(self.qsum, key_summary(ks, kb, valid))

    def mask(self, ks, kb):
        return merge_visible(self.qs, self.qb, ks.reshape(1, self.bk), kb.reshape(1, self.bk))


def _gpu_fwd_kernel(off_ref, kmax_ref, q_ref, k_ref, v_ref, se_ref, *refs, bq, bk,
                    nk, scale, precision, merge):
    qt_ref, kt_ref, o_ref, lse_ref = refs if merge else (None, None, *refs)
    row_lo = off_ref[()] + pl.program_id(2) * bq
    row_hi = row_lo + bq - 1
    q = q_ref[...]                                                               # [bq, Dp]
    mg = _GpuMerge(qt_ref, kt_ref, bq, bk) if merge else None

    def step(ki, carry):
        m, l, acc = carry
        c0 = pl.multiple_of(ki * bk, bk)
        k = k_ref[pl.ds(c0, bk), :]
        v = v_ref[pl.ds(c0, bk), :]
        mask = _mask(row_lo, c0, se_ref[pl.ds(c0, bk)], (bq, bk))
        if merge:
            mask &= mg.mask(*mg.keys(c0, se_ref[pl.ds(c0, bk)])[:2])
        s = jnp.where(mask, _dot(q, k, _DIMS_T, precision) * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
                alpha * acc + _dot(p.astype(v.dtype), v, _DIMS_N, precision))

    def body(ki, carry):
        vis = (ki * bk <= row_hi) & (kmax_ref[ki] > row_lo)
        if merge:
            vis &= mg.visible(*mg.keys(ki * bk, se_ref[pl.ds(ki * bk, bk)]))
        return lax.cond(vis, functools.partial(step, ki), lambda c: c, carry)

    d = q.shape[1]
    init = (jnp.full((bq, 1), _M_INIT, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros((bq, d), jnp.float32))
    hi = jnp.minimum(lax.div(jnp.maximum(row_hi, 0), bk) + 1, nk)
    m, l, acc = lax.fori_loop(0, hi, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), NEG_INF).reshape(bq)


def _gpu_dkdv_kernel(off_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref, *refs,
                     bq, bk, nq, scale, precision, merge):
    qt_ref, kt_ref, dk_ref, dv_ref = refs if merge else (None, None, *refs)
    ki = pl.program_id(2)
    c0 = ki * bk
    off = off_ref[()]
    k, v = k_ref[...], v_ref[...]                                                # [bk, Dp]
    se = se_ref[...]
    kmax = jnp.max(se)
    if merge:     # this program's key block: its tags ([2, bk] ref) and summary, once
        ks, kb = kt_ref[0, :], kt_ref[1, :]
        ksum = key_summary(ks, kb, se > c0 + lax.broadcasted_iota(jnp.int32, (bk,), 0))
        ks, kb = ks.reshape(1, bk), kb.reshape(1, bk)

    def q_tags(r0):
        return qt_ref[0, pl.ds(r0, bq)], qt_ref[1, pl.ds(r0, bq)]

    def step(qi, carry):
        dk, dv = carry
        r0 = pl.multiple_of(qi * bq, bq)
        q = q_ref[pl.ds(r0, bq), :]
        do = do_ref[pl.ds(r0, bq), :]
        lse = lse_ref[pl.ds(r0, bq)].reshape(bq, 1)
        delta = delta_ref[pl.ds(r0, bq)].reshape(bq, 1)
        mask = _mask(off + r0, c0, se, (bq, bk))
        if merge:
            qs, qb = q_tags(r0)
            mask &= merge_visible(qs.reshape(bq, 1), qb.reshape(bq, 1), ks, kb)
        s = _dot(q, k, _DIMS_T, precision) * scale
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dv = dv + _dot(p.T.astype(do.dtype), do, _DIMS_N, precision)
        ds = p * (_dot(do, v, _DIMS_T, precision) - delta) * scale
        dk = dk + _dot(ds.T.astype(q.dtype), q, _DIMS_N, precision)
        return dk, dv

    def body(qi, carry):
        row_lo = off + qi * bq
        vis = (c0 <= row_lo + bq - 1) & (kmax > row_lo)
        if merge:
            vis &= merge_tile_visible(query_summary(*q_tags(qi * bq)), ksum)
        return lax.cond(vis, functools.partial(step, qi), lambda c: c, carry)

    d = k.shape[1]
    zeros = jnp.zeros((bk, d), jnp.float32)
    lo = jnp.minimum(lax.div(jnp.maximum(c0 - off, 0), bq), nq)
    hi = jnp.maximum(jnp.minimum(lax.div(jnp.maximum(kmax - off, 0) + bq - 1, bq), nq), lo)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _gpu_dq_kernel(off_ref, kmax_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref,
                   *refs, bq, bk, nk, scale, precision, merge):
    qt_ref, kt_ref, dq_ref = refs if merge else (None, None, *refs)
    row_lo = off_ref[()] + pl.program_id(2) * bq
    row_hi = row_lo + bq - 1
    q, do = q_ref[...], do_ref[...]
    lse = lse_ref[...].reshape(bq, 1)
    delta = delta_ref[...].reshape(bq, 1)
    mg = _GpuMerge(qt_ref, kt_ref, bq, bk) if merge else None

    def step(ki, dq):
        c0 = pl.multiple_of(ki * bk, bk)
        k = k_ref[pl.ds(c0, bk), :]
        v = v_ref[pl.ds(c0, bk), :]
        mask = _mask(row_lo, c0, se_ref[pl.ds(c0, bk)], (bq, bk))
        if merge:
            mask &= mg.mask(*mg.keys(c0, se_ref[pl.ds(c0, bk)])[:2])
        p = jnp.where(mask, jnp.exp(_dot(q, k, _DIMS_T, precision) * scale - lse), 0.0)
        ds = p * (_dot(do, v, _DIMS_T, precision) - delta) * scale
        return dq + _dot(ds.astype(k.dtype), k, _DIMS_N, precision)

    def body(ki, dq):
        vis = (ki * bk <= row_hi) & (kmax_ref[ki] > row_lo)
        if merge:
            vis &= mg.visible(*mg.keys(ki * bk, se_ref[pl.ds(ki * bk, bk)]))
        return lax.cond(vis, functools.partial(step, ki), lambda c: c, dq)

    hi = jnp.minimum(lax.div(jnp.maximum(row_hi, 0), bk) + 1, nk)
    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _gpu_forward(pp: _Prep, q, k, v, interpret):
    b, h, g, bq, bk, dp = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp
    num_warps = 8 if bq >= 128 else 4
    tag_specs, tags = [], []
    if pp.merge:
        tag_specs = [pl.BlockSpec((None, 2, bq), lambda bi, hi, qi: (bi, 0, qi)),
                     pl.BlockSpec((None, 2, pp.sp), lambda bi, hi, qi: (bi, 0, 0))]
        tags = [pp.q_tags, pp.k_tags]
    o, lse = pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, bq=bq, bk=bk, nk=pp.nk, scale=pp.scale,
                          precision=pp.precision, merge=pp.merge),
        grid=(b, h, pp.nq),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, qi: (bi,)),
                  pl.BlockSpec((None, pp.nk), lambda bi, hi, qi: (bi, 0)),
                  pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
                  pl.BlockSpec((None, pp.sp, dp), lambda bi, hi, qi: (bi, 0, lax.div(hi, g))),
                  pl.BlockSpec((None, pp.sp, dp), lambda bi, hi, qi: (bi, 0, lax.div(hi, g))),
                  pl.BlockSpec((None, pp.sp), lambda bi, hi, qi: (bi, 0))] + tag_specs,
        out_specs=[pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
                   pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))],
        out_shape=[jax.ShapeDtypeStruct((b, pp.tp, h * dp), q.dtype),
                   jax.ShapeDtypeStruct((b, h, pp.tp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret, name="flash_span_fwd",
    )(pp.q_offset, pp.kmax, q, k, v, pp.span_end, *tags)
    return o, lse                                                    # lse [B, H, Tp]


def _gpu_backward(pp: _Prep, q, k, v, do, lse, delta, interpret):
    b, h, g, bq, bk, dp = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp
    num_warps = 8 if max(bq, bk) >= 128 else 4
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    full_q = pl.BlockSpec((None, pp.tp, dp), lambda bi, hi, ki: (bi, 0, hi))
    full_row = pl.BlockSpec((None, None, pp.tp), lambda bi, hi, ki: (bi, hi, 0))
    tag_specs, tags = [], []
    if pp.merge:
        tag_specs = [pl.BlockSpec((None, 2, pp.tp), lambda bi, hi, ki: (bi, 0, 0)),
                     pl.BlockSpec((None, 2, bk), lambda bi, hi, ki: (bi, 0, ki))]
        tags = [pp.q_tags, pp.k_tags]
    dk, dv = pl.pallas_call(
        functools.partial(_gpu_dkdv_kernel, bq=bq, bk=bk, nq=pp.nq, scale=pp.scale,
                          precision=pp.precision, merge=pp.merge),
        grid=(b, h, pp.nk),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, ki: (bi,)), full_q, full_q, full_row,
                  full_row,
                  pl.BlockSpec((None, bk, dp), lambda bi, hi, ki: (bi, ki, lax.div(hi, g))),
                  pl.BlockSpec((None, bk, dp), lambda bi, hi, ki: (bi, ki, lax.div(hi, g))),
                  pl.BlockSpec((None, bk), lambda bi, hi, ki: (bi, ki))] + tag_specs,
        out_specs=[pl.BlockSpec((None, bk, dp), lambda bi, hi, ki: (bi, ki, hi))] * 2,
        out_shape=[jax.ShapeDtypeStruct((b, pp.sp, h * dp), jnp.float32)] * 2,
        compiler_params=params, interpret=interpret, name="flash_span_dkdv",
    )(pp.q_offset, q, do, lse, delta, k, v, pp.span_end, *tags)
    full_k = pl.BlockSpec((None, pp.sp, dp), lambda bi, hi, qi: (bi, 0, lax.div(hi, g)))
    row = pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))
    tag_specs = []
    if pp.merge:
        tag_specs = [pl.BlockSpec((None, 2, bq), lambda bi, hi, qi: (bi, 0, qi)),
                     pl.BlockSpec((None, 2, pp.sp), lambda bi, hi, qi: (bi, 0, 0))]
    dq = pl.pallas_call(
        functools.partial(_gpu_dq_kernel, bq=bq, bk=bk, nk=pp.nk, scale=pp.scale,
                          precision=pp.precision, merge=pp.merge),
        grid=(b, h, pp.nq),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, qi: (bi,)),
                  pl.BlockSpec((None, pp.nk), lambda bi, hi, qi: (bi, 0)),
                  pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
                  pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)), row, row,
                  full_k, full_k, pl.BlockSpec((None, pp.sp), lambda bi, hi, qi: (bi, 0))] + tag_specs,
        out_specs=pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
        out_shape=jax.ShapeDtypeStruct((b, pp.tp, h * dp), jnp.float32),
        compiler_params=params, interpret=interpret, name="flash_span_dq",
    )(pp.q_offset, pp.kmax, q, do, lse, delta, k, v, pp.span_end, *tags)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic)
# ---------------------------------------------------------------------------------------------
def _lane_max(ref):
    """[rows, 128] lane-replicated statistic -> [rows, 1] (a layout-safe read)."""
    return jnp.max(ref[...], axis=1, keepdims=True)


def _tpu_merge_visible(ksum_ref, qsum_ref, bi, qi, ki, nq, nk):
    """The merge summaries' tile test from the scalar-prefetched [B*nq*3] / [B*nk*4] arrays."""
    qa, ka = (bi * nq + qi) * 3, (bi * nk + ki) * 4
    return merge_tile_visible(tuple(qsum_ref[qa + f] for f in range(3)),
                              tuple(ksum_ref[ka + f] for f in range(4)))


def _tpu_merge_mask(qt_ref, kt_ref):
    """[bq, bk] merge factor: q tags [bq, 2] (rows on sublanes), k tags [2, bk]."""
    return merge_visible(qt_ref[:, 0:1], qt_ref[:, 1:2], kt_ref[0:1, :], kt_ref[1:2, :])


def _tpu_refs(refs, merge, n_in):
    """Split a TPU kernel's refs after (off, kmax): (ksum, qsum, inputs..., qt, kt, rest...) with
    the merge form, (None, None, inputs..., None, None, rest...) without."""
    if merge:
        ksum, qsum, *rest = refs
        return (ksum, qsum, *rest[:n_in], *rest[n_in:n_in + 2], *rest[n_in + 2:])
    return (None, None, *refs[:n_in], None, None, *refs[n_in:])


def _tpu_fwd_kernel(off_ref, kmax_ref, *refs, bq, bk, nq, nk, scale, precision, merge):
    (ksum_ref, qsum_ref, q_ref, k_ref, v_ref, se_ref, qt_ref, kt_ref, o_ref, lse_ref,
     m_sc, l_sc, acc_sc) = _tpu_refs(refs, merge, 4)
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row_lo = off_ref[bi] + qi * bq
    row_hi = row_lo + bq - 1
    vis = (ki * bk <= row_hi) & (kmax_ref[bi * nk + ki] > row_lo)
    if merge:
        vis &= _tpu_merge_visible(ksum_ref, qsum_ref, bi, qi, ki, nq, nk)

    @pl.when(ki == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _M_INIT, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(vis)
    def _step():
        m, l = _lane_max(m_sc), _lane_max(l_sc)
        v = v_ref[...]
        mask = _mask(row_lo, ki * bk, se_ref[...], (bq, bk))
        if merge:
            mask &= _tpu_merge_mask(qt_ref, kt_ref)
        s = jnp.where(mask, _dot(q_ref[...], k_ref[...], _DIMS_T, precision) * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(alpha * l + jnp.sum(p, axis=1, keepdims=True), l_sc.shape)
        acc_sc[...] = alpha * acc_sc[...] + _dot(p.astype(v.dtype), v, _DIMS_N, precision)

    @pl.when(ki == nk - 1)
    def _store():
        m, l = _lane_max(m_sc), _lane_max(l_sc)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.broadcast_to(jnp.where(seen, m + jnp.log(l_safe), NEG_INF),
                                        lse_ref.shape)


def _tpu_dkdv_kernel(off_ref, kmax_ref, *refs, bq, bk, nk, nq, scale, precision, merge):
    (ksum_ref, qsum_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref, qt_ref, kt_ref,
     dk_ref, dv_ref, dk_sc, dv_sc) = _tpu_refs(refs, merge, 7)
    bi, ki, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row_lo = off_ref[bi] + qi * bq
    vis = (ki * bk <= row_lo + bq - 1) & (kmax_ref[bi * nk + ki] > row_lo)
    if merge:
        vis &= _tpu_merge_visible(ksum_ref, qsum_ref, bi, qi, ki, nq, nk)

    @pl.when(qi == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(vis)
    def _step():
        q, do, k, v = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        mask = _mask(row_lo, ki * bk, se_ref[...], (bq, bk))
        if merge:
            mask &= _tpu_merge_mask(qt_ref, kt_ref)
        s = _dot(q, k, _DIMS_T, precision) * scale
        p = jnp.where(mask, jnp.exp(s - _lane_max(lse_ref)), 0.0)
        dv_sc[...] += _dot(p.T.astype(do.dtype), do, _DIMS_N, precision)
        ds = p * (_dot(do, v, _DIMS_T, precision) - _lane_max(delta_ref)) * scale
        dk_sc[...] += _dot(ds.T.astype(q.dtype), q, _DIMS_N, precision)

    @pl.when(qi == nq - 1)
    def _store():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_dq_kernel(off_ref, kmax_ref, *refs, bq, bk, nq, nk, scale, precision, merge):
    (ksum_ref, qsum_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref, qt_ref, kt_ref,
     dq_ref, dq_sc) = _tpu_refs(refs, merge, 7)
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row_lo = off_ref[bi] + qi * bq
    vis = (ki * bk <= row_lo + bq - 1) & (kmax_ref[bi * nk + ki] > row_lo)
    if merge:
        vis &= _tpu_merge_visible(ksum_ref, qsum_ref, bi, qi, ki, nq, nk)

    @pl.when(ki == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(vis)
    def _step():
        q, do, k, v = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        mask = _mask(row_lo, ki * bk, se_ref[...], (bq, bk))
        if merge:
            mask &= _tpu_merge_mask(qt_ref, kt_ref)
        s = _dot(q, k, _DIMS_T, precision) * scale
        p = jnp.where(mask, jnp.exp(s - _lane_max(lse_ref)), 0.0)
        ds = p * (_dot(do, v, _DIMS_T, precision) - _lane_max(delta_ref)) * scale
        dq_sc[...] += _dot(ds.astype(k.dtype), k, _DIMS_N, precision)

    @pl.when(ki == nk - 1)
    def _store():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _tpu_key_clamp(bq, bk, nk):
    """Index of the key block to fetch at (b, qi, ki): clamped to the causal range of query block
    qi, so blocks past it repeat the last index (the pipeline does not re-fetch them)."""
    def last(bi, qi, off_ref):
        return jnp.minimum(lax.div(jnp.maximum(off_ref[bi] + qi * bq + bq - 1, 0), bk), nk - 1)
    return lambda bi, qi, ki, off_ref: jnp.minimum(ki, last(bi, qi, off_ref))


def _tpu_merge_args(pp: _Prep, q_block, k_block):
    """(prefetch args, block specs, arrays) the merge form adds to a TPU call; q_block / k_block
    map grid indices (+ the q_offset ref) to the query / key block index."""
    if not pp.merge:
        return [], [], []
    specs = [pl.BlockSpec((None, pp.bq, 2), lambda *a: (a[0], q_block(*a), 0)),
             pl.BlockSpec((None, 2, pp.bk), lambda *a: (a[0], 0, k_block(*a)))]
    return [pp.ksum, pp.qsum], specs, [pp.q_tags, pp.k_tags]


def _tpu_forward(pp: _Prep, q, k, v, interpret):
    b, h, g, bq, bk, d, nk = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp, pp.nk
    kc = _tpu_key_clamp(bq, bk, nk)
    kv_spec = pl.BlockSpec((None, bk, d), lambda bi, hi, qi, ki, o, *_: (bi, kc(bi, qi, ki, o),
                                                                        lax.div(hi, g)))
    pre, tag_specs, tags = _tpu_merge_args(pp, lambda bi, hi, qi, ki, *_: qi,
                                           lambda bi, hi, qi, ki, o, *_: kc(bi, qi, ki, o))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2 + len(pre), grid=(b, h, pp.nq, nk),
        in_specs=[pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi)),
                  kv_spec, kv_spec,
                  pl.BlockSpec((None, 1, bk), lambda bi, hi, qi, ki, o, *_: (bi, 0,
                                                                             kc(bi, qi, ki, o)))]
        + tag_specs,
        out_specs=[pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi)),
                   pl.BlockSpec((None, None, bq, _LANES), lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0))],
        scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32),
                        pltpu.VMEM((bq, _LANES), jnp.float32),
                        pltpu.VMEM((bq, d), jnp.float32)])
    o, lse = pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, bq=bq, bk=bk, nq=pp.nq, nk=nk, scale=pp.scale,
                          precision=pp.precision, merge=pp.merge),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, pp.tp, h * d), q.dtype),
                   jax.ShapeDtypeStruct((b, h, pp.tp, _LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="flash_span_fwd",
    )(pp.q_offset, pp.kmax.reshape(-1), *pre, q, k, v, pp.span_end.reshape(b, 1, pp.sp), *tags)
    return o, lse[..., 0]


def _tpu_backward(pp: _Prep, q, k, v, do, lse, delta, interpret):
    b, h, g, bq, bk, d, nq, nk = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp, pp.nq, pp.nk
    lanes = lambda x: jnp.broadcast_to(x[..., None], x.shape + (_LANES,))  # noqa: E731
    lse4, delta4 = lanes(lse), lanes(delta)
    se3 = pp.span_end.reshape(b, 1, pp.sp)
    kmax = pp.kmax.reshape(-1)
    sem = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    def qc(bi, ki, qi, off_ref):      # first query block that can see key block ki
        lo = jnp.minimum(lax.div(jnp.maximum(ki * bk - off_ref[bi], 0), bq), nq - 1)
        return jnp.maximum(qi, lo)

    q_spec = pl.BlockSpec((None, bq, d), lambda bi, hi, ki, qi, o, *_: (bi, qc(bi, ki, qi, o), hi))
    row_spec = pl.BlockSpec((None, None, bq, _LANES),
                            lambda bi, hi, ki, qi, o, *_: (bi, hi, qc(bi, ki, qi, o), 0))
    kv_spec = pl.BlockSpec((None, bk, d), lambda bi, hi, ki, qi, *_: (bi, ki, lax.div(hi, g)))
    pre, tag_specs, tags = _tpu_merge_args(pp, lambda bi, hi, ki, qi, o, *_: qc(bi, ki, qi, o),
                                           lambda bi, hi, ki, qi, *_: ki)
    dk, dv = pl.pallas_call(
        functools.partial(_tpu_dkdv_kernel, bq=bq, bk=bk, nk=nk, nq=nq, scale=pp.scale,
                          precision=pp.precision, merge=pp.merge),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 + len(pre), grid=(b, h, nk, nq),
            in_specs=[q_spec, q_spec, row_spec, row_spec, kv_spec, kv_spec,
                      pl.BlockSpec((None, 1, bk), lambda bi, hi, ki, qi, *_: (bi, 0, ki))] + tag_specs,
            out_specs=[pl.BlockSpec((None, bk, d), lambda bi, hi, ki, qi, *_: (bi, ki, hi))] * 2,
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((b, pp.sp, h * d), jnp.float32)] * 2,
        compiler_params=sem, interpret=interpret, name="flash_span_dkdv",
    )(pp.q_offset, kmax, *pre, q, do, lse4, delta4, k, v, se3, *tags)

    kc = _tpu_key_clamp(bq, bk, nk)
    kv_spec = pl.BlockSpec((None, bk, d), lambda bi, hi, qi, ki, o, *_: (bi, kc(bi, qi, ki, o),
                                                                        lax.div(hi, g)))
    q_spec = pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi))
    row_spec = pl.BlockSpec((None, None, bq, _LANES), lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0))
    pre, tag_specs, tags = _tpu_merge_args(pp, lambda bi, hi, qi, ki, *_: qi,
                                           lambda bi, hi, qi, ki, o, *_: kc(bi, qi, ki, o))
    dq = pl.pallas_call(
        functools.partial(_tpu_dq_kernel, bq=bq, bk=bk, nq=nq, nk=nk, scale=pp.scale,
                          precision=pp.precision, merge=pp.merge),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 + len(pre), grid=(b, h, nq, nk),
            in_specs=[q_spec, q_spec, row_spec, row_spec, kv_spec, kv_spec,
                      pl.BlockSpec((None, 1, bk), lambda bi, hi, qi, ki, o, *_: (bi, 0,
                                                                                 kc(bi, qi, ki, o)))]
            + tag_specs,
            out_specs=pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi)),
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((b, pp.tp, h * d), jnp.float32),
        compiler_params=sem, interpret=interpret, name="flash_span_dq",
    )(pp.q_offset, kmax, *pre, q, do, lse4, delta4, k, v, se3, *tags)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Entry points (called by sprint_jax.model.attention's custom_vjp)
# ---------------------------------------------------------------------------------------------
def _check(platform, block_q, block_k, d, h, interpret):
    if platform not in ("gpu", "tpu"):
        raise ValueError(f"platform must be 'gpu' or 'tpu', got {platform!r}")
    if interpret:
        return
    if platform == "gpu":
        for name, val in (("block_q", block_q), ("block_k", block_k)):
            if val < _GPU_MIN_DIM or val & (val - 1):
                raise ValueError(f"{name}={val}: Triton needs a power of two >= 16")
    elif d % 128 and h > 1:
        raise ValueError(f"the TPU flash kernel needs head_dim a multiple of 128 (got {d}) with "
                         f"more than one head: a (rows, D) block of the [T, H*D] view is lane-tiled")


def flash_forward(q, k, v, span_end, q_offset, tags=None, *, platform: str, block_q: int, block_k: int,
                  interpret: bool = False):
    """(out [B, T, H, D] in q's dtype, lse [B, T, H] fp32) under the span rule (see module doc)."""
    _check(platform, block_q, block_k, q.shape[3], q.shape[2], interpret)
    pp = _Prep(q, k, v, span_end, q_offset, platform, block_q, block_k, tags)
    run = _gpu_forward if platform == "gpu" else _tpu_forward
    o, lse = run(pp, pp.rows(q, pp.h), pp.keys(k, pp.hkv), pp.keys(v, pp.hkv), interpret)
    return pp.unrows(o, pp.h), jnp.swapaxes(lse, 1, 2)[:, :pp.t]


def flash_backward(q, k, v, span_end, q_offset, tags, o, lse, do, dlse, *, platform: str, block_q: int,
                   block_k: int, interpret: bool = False):
    """(dq, dk, dv) for cotangents do [B, T, H, D] and dlse [B, T, H], recomputing every tile."""
    _check(platform, block_q, block_k, q.shape[3], q.shape[2], interpret)
    pp = _Prep(q, k, v, span_end, q_offset, platform, block_q, block_k, tags)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse     # [B, T, H]
    rows_t = lambda x, fill: _pad_axis(jnp.swapaxes(x, 1, 2), 2, pp.tp, fill)  # noqa: E731
    run = _gpu_backward if platform == "gpu" else _tpu_backward
    dq, dk, dv = run(pp, pp.rows(q, pp.h), pp.keys(k, pp.hkv), pp.keys(v, pp.hkv),
                     pp.rows(do.astype(q.dtype), pp.h), rows_t(lse, _PAD_LSE), rows_t(delta, 0.0),
                     interpret)
    dq = pp.unrows(dq, pp.h)
    group = lambda x: pp.unkeys(x, pp.h).reshape(pp.b, pp.s, pp.hkv, pp.g, pp.d).sum(3)  # noqa: E731
    return dq.astype(q.dtype), group(dk).astype(k.dtype), group(dv).astype(v.dtype)
