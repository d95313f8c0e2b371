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

from sprint_jax.model.attention import NEG_INF

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


class _Prep:
    """Padded, viewed operands shared by both platforms' forward and backward."""

    def __init__(self, q, k, v, span_end, q_offset, platform, block_q, block_k):
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
def _gpu_fwd_kernel(off_ref, kmax_ref, q_ref, k_ref, v_ref, se_ref, o_ref, lse_ref, *, bq, bk,
                    nk, scale, precision):
    row_lo = off_ref[()] + pl.program_id(2) * bq
    row_hi = row_lo + bq - 1
    q = q_ref[...]                                                               # [bq, Dp]

    def step(ki, carry):
        m, l, acc = carry
        c0 = pl.multiple_of(ki * bk, bk)
        k = k_ref[pl.ds(c0, bk), :]
        v = v_ref[pl.ds(c0, bk), :]
        mask = _mask(row_lo, c0, se_ref[pl.ds(c0, bk)], (bq, bk))
        s = jnp.where(mask, _dot(q, k, _DIMS_T, precision) * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
                alpha * acc + _dot(p.astype(v.dtype), v, _DIMS_N, precision))

    def body(ki, carry):
        vis = (ki * bk <= row_hi) & (kmax_ref[ki] > row_lo)
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


def _gpu_dkdv_kernel(off_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref,
                     dk_ref, dv_ref, *, bq, bk, nq, scale, precision):
    ki = pl.program_id(2)
    c0 = ki * bk
    off = off_ref[()]
    k, v = k_ref[...], v_ref[...]                                                # [bk, Dp]
    se = se_ref[...]
    kmax = jnp.max(se)

    def step(qi, carry):
        dk, dv = carry
        r0 = pl.multiple_of(qi * bq, bq)
        q = q_ref[pl.ds(r0, bq), :]
        do = do_ref[pl.ds(r0, bq), :]
        lse = lse_ref[pl.ds(r0, bq)].reshape(bq, 1)
        delta = delta_ref[pl.ds(r0, bq)].reshape(bq, 1)
        mask = _mask(off + r0, c0, se, (bq, bk))
        s = _dot(q, k, _DIMS_T, precision) * scale
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)
        dv = dv + _dot(p.T.astype(do.dtype), do, _DIMS_N, precision)
        ds = p * (_dot(do, v, _DIMS_T, precision) - delta) * scale
        dk = dk + _dot(ds.T.astype(q.dtype), q, _DIMS_N, precision)
        return dk, dv

    def body(qi, carry):
        row_lo = off + qi * bq
        vis = (c0 <= row_lo + bq - 1) & (kmax > row_lo)
        return lax.cond(vis, functools.partial(step, qi), lambda c: c, carry)

    d = k.shape[1]
    zeros = jnp.zeros((bk, d), jnp.float32)
    lo = jnp.minimum(lax.div(jnp.maximum(c0 - off, 0), bq), nq)
    hi = jnp.maximum(jnp.minimum(lax.div(jnp.maximum(kmax - off, 0) + bq - 1, bq), nq), lo)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _gpu_dq_kernel(off_ref, kmax_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref,
                   dq_ref, *, bq, bk, nk, scale, precision):
    row_lo = off_ref[()] + pl.program_id(2) * bq
    row_hi = row_lo + bq - 1
    q, do = q_ref[...], do_ref[...]
    lse = lse_ref[...].reshape(bq, 1)
    delta = delta_ref[...].reshape(bq, 1)

    def step(ki, dq):
        c0 = pl.multiple_of(ki * bk, bk)
        k = k_ref[pl.ds(c0, bk), :]
        v = v_ref[pl.ds(c0, bk), :]
        mask = _mask(row_lo, c0, se_ref[pl.ds(c0, bk)], (bq, bk))
        p = jnp.where(mask, jnp.exp(_dot(q, k, _DIMS_T, precision) * scale - lse), 0.0)
        ds = p * (_dot(do, v, _DIMS_T, precision) - delta) * scale
        return dq + _dot(ds.astype(k.dtype), k, _DIMS_N, precision)

    def body(ki, dq):
        vis = (ki * bk <= row_hi) & (kmax_ref[ki] > row_lo)
        return lax.cond(vis, functools.partial(step, ki), lambda c: c, dq)

    hi = jnp.minimum(lax.div(jnp.maximum(row_hi, 0), bk) + 1, nk)
    dq = lax.fori_loop(0, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _gpu_forward(pp: _Prep, q, k, v, interpret):
    b, h, g, bq, bk, dp = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp
    num_warps = 8 if bq >= 128 else 4
    o, lse = pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, bq=bq, bk=bk, nk=pp.nk, scale=pp.scale,
                          precision=pp.precision),
        grid=(b, h, pp.nq),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, qi: (bi,)),
                  pl.BlockSpec((None, pp.nk), lambda bi, hi, qi: (bi, 0)),
                  pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
                  pl.BlockSpec((None, pp.sp, dp), lambda bi, hi, qi: (bi, 0, lax.div(hi, g))),
                  pl.BlockSpec((None, pp.sp, dp), lambda bi, hi, qi: (bi, 0, lax.div(hi, g))),
                  pl.BlockSpec((None, pp.sp), lambda bi, hi, qi: (bi, 0))],
        out_specs=[pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
                   pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))],
        out_shape=[jax.ShapeDtypeStruct((b, pp.tp, h * dp), q.dtype),
                   jax.ShapeDtypeStruct((b, h, pp.tp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret, name="flash_span_fwd",
    )(pp.q_offset, pp.kmax, q, k, v, pp.span_end)
    return o, lse                                                    # lse [B, H, Tp]


def _gpu_backward(pp: _Prep, q, k, v, do, lse, delta, interpret):
    b, h, g, bq, bk, dp = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp
    num_warps = 8 if max(bq, bk) >= 128 else 4
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    full_q = pl.BlockSpec((None, pp.tp, dp), lambda bi, hi, ki: (bi, 0, hi))
    full_row = pl.BlockSpec((None, None, pp.tp), lambda bi, hi, ki: (bi, hi, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_gpu_dkdv_kernel, bq=bq, bk=bk, nq=pp.nq, scale=pp.scale,
                          precision=pp.precision),
        grid=(b, h, pp.nk),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, ki: (bi,)), full_q, full_q, full_row,
                  full_row,
                  pl.BlockSpec((None, bk, dp), lambda bi, hi, ki: (bi, ki, lax.div(hi, g))),
                  pl.BlockSpec((None, bk, dp), lambda bi, hi, ki: (bi, ki, lax.div(hi, g))),
                  pl.BlockSpec((None, bk), lambda bi, hi, ki: (bi, ki))],
        out_specs=[pl.BlockSpec((None, bk, dp), lambda bi, hi, ki: (bi, ki, hi))] * 2,
        out_shape=[jax.ShapeDtypeStruct((b, pp.sp, h * dp), jnp.float32)] * 2,
        compiler_params=params, interpret=interpret, name="flash_span_dkdv",
    )(pp.q_offset, q, do, lse, delta, k, v, pp.span_end)
    full_k = pl.BlockSpec((None, pp.sp, dp), lambda bi, hi, qi: (bi, 0, lax.div(hi, g)))
    row = pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi))
    dq = pl.pallas_call(
        functools.partial(_gpu_dq_kernel, bq=bq, bk=bk, nk=pp.nk, scale=pp.scale,
                          precision=pp.precision),
        grid=(b, h, pp.nq),
        in_specs=[pl.BlockSpec((None,), lambda bi, hi, qi: (bi,)),
                  pl.BlockSpec((None, pp.nk), lambda bi, hi, qi: (bi, 0)),
                  pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
                  pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)), row, row,
                  full_k, full_k, pl.BlockSpec((None, pp.sp), lambda bi, hi, qi: (bi, 0))],
        out_specs=pl.BlockSpec((None, bq, dp), lambda bi, hi, qi: (bi, qi, hi)),
        out_shape=jax.ShapeDtypeStruct((b, pp.tp, h * dp), jnp.float32),
        compiler_params=params, interpret=interpret, name="flash_span_dq",
    )(pp.q_offset, pp.kmax, q, do, lse, delta, k, v, pp.span_end)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic)
# ---------------------------------------------------------------------------------------------
def _lane_max(ref):
    """[rows, 128] lane-replicated statistic -> [rows, 1] (a layout-safe read)."""
    return jnp.max(ref[...], axis=1, keepdims=True)


def _tpu_fwd_kernel(off_ref, kmax_ref, q_ref, k_ref, v_ref, se_ref, o_ref, lse_ref,
                    m_sc, l_sc, acc_sc, *, bq, bk, nk, scale, precision):
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row_lo = off_ref[bi] + qi * bq
    row_hi = row_lo + bq - 1

    @pl.when(ki == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _M_INIT, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((ki * bk <= row_hi) & (kmax_ref[bi * nk + ki] > row_lo))
    def _step():
        m, l = _lane_max(m_sc), _lane_max(l_sc)
        v = v_ref[...]
        mask = _mask(row_lo, ki * bk, se_ref[...], (bq, bk))
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


def _tpu_dkdv_kernel(off_ref, kmax_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref,
                     dk_ref, dv_ref, dk_sc, dv_sc, *, bq, bk, nk, nq, scale, precision):
    bi, ki, qi = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row_lo = off_ref[bi] + qi * bq

    @pl.when(qi == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when((ki * bk <= row_lo + bq - 1) & (kmax_ref[bi * nk + ki] > row_lo))
    def _step():
        q, do, k, v = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        mask = _mask(row_lo, ki * bk, se_ref[...], (bq, bk))
        s = _dot(q, k, _DIMS_T, precision) * scale
        p = jnp.where(mask, jnp.exp(s - _lane_max(lse_ref)), 0.0)
        dv_sc[...] += _dot(p.T.astype(do.dtype), do, _DIMS_N, precision)
        ds = p * (_dot(do, v, _DIMS_T, precision) - _lane_max(delta_ref)) * scale
        dk_sc[...] += _dot(ds.T.astype(q.dtype), q, _DIMS_N, precision)

    @pl.when(qi == nq - 1)
    def _store():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tpu_dq_kernel(off_ref, kmax_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, se_ref,
                   dq_ref, dq_sc, *, bq, bk, nk, scale, precision):
    bi, qi, ki = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    row_lo = off_ref[bi] + qi * bq

    @pl.when(ki == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when((ki * bk <= row_lo + bq - 1) & (kmax_ref[bi * nk + ki] > row_lo))
    def _step():
        q, do, k, v = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        mask = _mask(row_lo, ki * bk, se_ref[...], (bq, bk))
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


def _tpu_forward(pp: _Prep, q, k, v, interpret):
    b, h, g, bq, bk, d, nk = pp.b, pp.h, pp.g, pp.bq, pp.bk, pp.dp, pp.nk
    kc = _tpu_key_clamp(bq, bk, nk)
    kv_spec = pl.BlockSpec((None, bk, d), lambda bi, hi, qi, ki, o, _: (bi, kc(bi, qi, ki, o),
                                                                        lax.div(hi, g)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(b, h, pp.nq, nk),
        in_specs=[pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi)),
                  kv_spec, kv_spec,
                  pl.BlockSpec((None, 1, bk), lambda bi, hi, qi, ki, o, _: (bi, 0,
                                                                             kc(bi, qi, ki, o)))],
        out_specs=[pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi)),
                   pl.BlockSpec((None, None, bq, _LANES), lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0))],
        scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32),
                        pltpu.VMEM((bq, _LANES), jnp.float32),
                        pltpu.VMEM((bq, d), jnp.float32)])
    o, lse = pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, bq=bq, bk=bk, nk=nk, scale=pp.scale,
                          precision=pp.precision),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((b, pp.tp, h * d), q.dtype),
                   jax.ShapeDtypeStruct((b, h, pp.tp, _LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="flash_span_fwd",
    )(pp.q_offset, pp.kmax.reshape(-1), q, k, v, pp.span_end.reshape(b, 1, pp.sp))
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

    q_spec = pl.BlockSpec((None, bq, d), lambda bi, hi, ki, qi, o, _: (bi, qc(bi, ki, qi, o), hi))
    row_spec = pl.BlockSpec((None, None, bq, _LANES),
                            lambda bi, hi, ki, qi, o, _: (bi, hi, qc(bi, ki, qi, o), 0))
    kv_spec = pl.BlockSpec((None, bk, d), lambda bi, hi, ki, qi, *_: (bi, ki, lax.div(hi, g)))
    dk, dv = pl.pallas_call(
        functools.partial(_tpu_dkdv_kernel, bq=bq, bk=bk, nk=nk, nq=nq, scale=pp.scale,
                          precision=pp.precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, h, nk, nq),
            in_specs=[q_spec, q_spec, row_spec, row_spec, kv_spec, kv_spec,
                      pl.BlockSpec((None, 1, bk), lambda bi, hi, ki, qi, *_: (bi, 0, ki))],
            out_specs=[pl.BlockSpec((None, bk, d), lambda bi, hi, ki, qi, *_: (bi, ki, hi))] * 2,
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((b, pp.sp, h * d), jnp.float32)] * 2,
        compiler_params=sem, interpret=interpret, name="flash_span_dkdv",
    )(pp.q_offset, kmax, q, do, lse4, delta4, k, v, se3)

    kc = _tpu_key_clamp(bq, bk, nk)
    kv_spec = pl.BlockSpec((None, bk, d), lambda bi, hi, qi, ki, o, _: (bi, kc(bi, qi, ki, o),
                                                                        lax.div(hi, g)))
    q_spec = pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi))
    row_spec = pl.BlockSpec((None, None, bq, _LANES), lambda bi, hi, qi, ki, *_: (bi, hi, qi, 0))
    dq = pl.pallas_call(
        functools.partial(_tpu_dq_kernel, bq=bq, bk=bk, nk=nk, scale=pp.scale,
                          precision=pp.precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, h, nq, nk),
            in_specs=[q_spec, q_spec, row_spec, row_spec, kv_spec, kv_spec,
                      pl.BlockSpec((None, 1, bk), lambda bi, hi, qi, ki, o, _: (bi, 0,
                                                                                 kc(bi, qi, ki, o)))],
            out_specs=pl.BlockSpec((None, bq, d), lambda bi, hi, qi, ki, *_: (bi, qi, hi)),
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((b, pp.tp, h * d), jnp.float32),
        compiler_params=sem, interpret=interpret, name="flash_span_dq",
    )(pp.q_offset, kmax, q, do, lse4, delta4, k, v, se3)
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
    if tags is not None:
        raise NotImplementedError("the (stage, branch) mask form has no Pallas body yet")
    pp = _Prep(q, k, v, span_end, q_offset, platform, block_q, block_k)
    run = _gpu_forward if platform == "gpu" else _tpu_forward
    o, lse = run(pp, pp.rows(q, pp.h), pp.keys(k, pp.hkv), pp.keys(v, pp.hkv), interpret)
    return pp.unrows(o, pp.h), jnp.swapaxes(lse, 1, 2)[:, :pp.t]


def flash_backward(q, k, v, span_end, q_offset, tags, o, lse, do, dlse, *, platform: str, block_q: int,
                   block_k: int, interpret: bool = False):
    """(dq, dk, dv) for cotangents do [B, T, H, D] and dlse [B, T, H], recomputing every tile."""
    _check(platform, block_q, block_k, q.shape[3], q.shape[2], interpret)
    if tags is not None:
        raise NotImplementedError("the (stage, branch) mask form has no Pallas body yet")
    pp = _Prep(q, k, v, span_end, q_offset, platform, block_q, block_k)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse     # [B, T, H]
    rows_t = lambda x, fill: _pad_axis(jnp.swapaxes(x, 1, 2), 2, pp.tp, fill)  # noqa: E731
    run = _gpu_backward if platform == "gpu" else _tpu_backward
    dq, dk, dv = run(pp, pp.rows(q, pp.h), pp.keys(k, pp.hkv), pp.keys(v, pp.hkv),
                     pp.rows(do.astype(q.dtype), pp.h), rows_t(lse, _PAD_LSE), rows_t(delta, 0.0),
                     interpret)
    dq = pp.unrows(dq, pp.h)
    group = lambda x: pp.unkeys(x, pp.h).reshape(pp.b, pp.s, pp.hkv, pp.g, pp.d).sum(3)  # noqa: E731
    return dq.astype(q.dtype), group(dk).astype(k.dtype), group(dv).astype(v.dtype)


def flash_reference(q, k, v, span_end, q_offset=0):
    """The dense reference: `attend_partial` under the explicit span mask ([T, S] scores)."""
    from sprint_jax.model.attention import attend_partial, span_mask
    return attend_partial(q, k, v, span_mask(span_end, q.shape[1], q_offset))
