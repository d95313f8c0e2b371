"""Shared-prefix decode attention in Pallas: read the forked prefix once for all branches.

Why. In SPRINT inference (paper §10) every executor of a stage is forked from the planner's
cache after `</Plan_i>`, so n branches decode over one long shared prefix plus a short suffix
each. Copy-fork attention, and paged caches (which share the prefix's *memory* but not its
*reads*), stream the prefix from HBM once per branch per step: n x P x Hkv x D x 2 elements,
which dominates decode at long prefixes. Hydragen (Juravsky et al., 2024) and FlashInfer's
cascade attention (Ye et al., 2025) split attention into a part over the shared prefix and a
part over each branch's suffix and merge the two exactly by log-sum-exp; the prefix part turns
into a matrix-matrix product in which all n x G queries of a KV head (G = H / Hkv, grouped-query
attention) meet each prefix block once.

What. `shared_prefix_attention` runs two passes of one ragged multi-query Pallas kernel
  prefix: batch 1, rows = the n x G queries of each KV head, keys = prefix[:prefix_len]
  suffix: batch n, rows = the G queries of each KV head,     keys = suffix[b, :suffix_lens[b]]
and merges them, and any split-K partials, with `reference.merge_partials` (the
engine's own merge, natural-log lse). Inside the kernel logits are in base 2 (exp2, the scale
carries log2 e); the lse is converted back to base e before it leaves the kernel.

Two kernel bodies share the online-softmax step `_softmax_step`:
  * "gpu" (Triton lowering): grid (batch, KV head, query block, split). A program loops over its
    split of the keys with a trip count from the valid length, so spare cache capacity past the
    valid rows is never read. Splits (flash-decoding) fill the GPU when there are few
    (KV head x query block) programs; they merge by lse outside the kernel.
  * "tpu" (Mosaic lowering): grid (batch, KV head, query block, key block), the key axis
    sequential ("arbitrary") with running statistics in VMEM scratch; the valid lengths are
    scalar-prefetched so the key index map clamps to the last valid block (the pipeline issues
    no DMA past it) and `pl.when` skips its compute.
On CPU the kernels run with interpret=True (the tests run both bodies that way).

HBM traffic. The prefix is read once per query block, ceil(n*G / block_q) times (once when
n*G <= block_q; default block_q is 128 on GPU, up to 1024 on TPU), against n times for copy-fork.
`bytes_read` is the ideal count (prefix once) that the benchmark divides by time.

Layout. K/V [batch, L, Hkv, D] are viewed as [batch, L, Hkv*D] (a free reshape) and a block is
(key rows, D) at column block h, so the cache is neither transposed, padded nor copied, whatever
its capacity L (the last key block is masked). The one copy: on GPU a head dim that is not a
power of two is zero-padded (Triton tensors have power-of-two shapes; Qwen2's 128 is one).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from . import gpu_target
from .reference import NEG_INF, attend_partial, merge_partials

Platform = Literal["gpu", "tpu"]

LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Running max (base-2 logits) before any key: finite, so exp2(m_prev - m_next) is 0 or 1, never NaN.
M_INIT = -1e30
TPU_LANES = 128              # TPU row statistics are kept replicated across the 128 lanes
_GPU_TARGET_PROGRAMS = 264    # 2 programs per SM on H100 / H200 (132 SMs): split-K fills the rest
_GPU_MIN_BLOCKS_PER_SPLIT = 2  # a split shorter than this costs more in partials than it saves
GPU_MIN_DIM = 16             # Triton's dot needs every dimension >= 16
TPU_MAX_BLOCK_Q = 1024       # TPU keeps all n*G prefix queries in one block up to this many


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes for `shared_prefix_attention`; a None field takes the platform default."""
    block_q: int | None = None         # prefix query rows (of the n*G per KV head) per program
    block_k: int | None = None         # prefix keys per online-softmax step
    block_k_suffix: int | None = None  # suffix keys per online-softmax step
    num_splits: int | None = None      # GPU: prefix split-K programs per (KV head, query block)
    num_warps: int | None = None       # GPU: Triton warps per program
    num_stages: int | None = None      # GPU: Triton software-pipelining stages


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-int(x) // m) * m


def auto_splits(programs: int, key_blocks: int) -> int:
    """Split-K count bringing the GPU program count near its target, >= 2 key blocks a split."""
    want = -(-_GPU_TARGET_PROGRAMS // max(programs, 1))
    return max(1, min(want, key_blocks // _GPU_MIN_BLOCKS_PER_SPLIT))


def fit_gpu_blocks(block_q: int, block_k: int, head_dim: int, dtype, smem: int | None = None) -> tuple[int, int]:
    """Shrink GPU decode blocks (the key block first, down to 32, then the query block) until their
    tiles fit the target GPU's shared memory (`gpu_target.decode_smem`; default: the target's)."""
    smem = gpu_target.shared_memory() if smem is None else smem
    dp = max(GPU_MIN_DIM, next_pow2(head_dim))
    while gpu_target.decode_smem(block_q, block_k, dp, dtype) > smem:
        if block_k > 32 or (block_k > GPU_MIN_DIM and block_q == GPU_MIN_DIM):
            block_k //= 2
        elif block_q > GPU_MIN_DIM:
            block_q //= 2
        else:
            raise ValueError(f"no decode block fits {smem} bytes of shared memory at head_dim {head_dim}, {dtype}")
    return block_q, block_k


def default_block_sizes(platform: Platform, n: int, num_heads: int, num_kv_heads: int,
                        prefix_capacity: int, suffix_capacity: int, *, head_dim: int = 128,
                        dtype=jnp.bfloat16) -> BlockSizes:
    """Per-backend tiles for n branches, H query / Hkv KV heads, prefix P and suffix S rows.

    GPU: query blocks of up to 128 rows (a 128 x 128 fp32 accumulator is what 8 warps hold in
    registers), 64-key blocks at 128 rows and 128-key blocks below, split-K to ~2 programs/SM;
    smaller where the tiles would not fit the target GPU's shared memory (`fit_gpu_blocks`).
    TPU: all n*G prefix queries in one block up to 1024 rows (VMEM holds it easily), so the
    prefix is read exactly once; 512-key blocks (lane-dense logits, long DMAs), or one block of
    the whole length when shorter (a block equal to the array dim is always a legal tile).
    """
    rows = n * (num_heads // num_kv_heads)
    if platform == "tpu":
        block_q = round_up(rows, 16) if rows <= TPU_MAX_BLOCK_Q else 512
        return BlockSizes(block_q=block_q,
                          block_k=max(1, min(512, prefix_capacity)),
                          block_k_suffix=max(1, min(512, suffix_capacity)),
                          num_splits=1, num_warps=None, num_stages=None)
    block_q = min(128, max(GPU_MIN_DIM, next_pow2(rows)))
    block_k = min(64 if block_q >= 128 else 128, max(GPU_MIN_DIM, next_pow2(prefix_capacity)))
    block_q, block_k = fit_gpu_blocks(block_q, block_k, head_dim, dtype)
    suffix_q, block_s = fit_gpu_blocks(block_q, min(64, max(GPU_MIN_DIM, next_pow2(suffix_capacity))), head_dim,
                                       dtype)
    block_q = min(block_q, suffix_q)
    key_blocks = -(-prefix_capacity // block_k)
    return BlockSizes(
        block_q=block_q, block_k=block_k,
        block_k_suffix=block_s,
        num_splits=auto_splits(num_kv_heads * -(-rows // block_q), key_blocks),
        num_warps=8 if block_q >= 128 else 4, num_stages=2)


def bytes_read(n: int, prefix_len: int, suffix_len: int, num_heads: int, num_kv_heads: int,
               head_dim: int, dtype) -> int:
    """HBM bytes one shared-prefix decode step must read: prefix K/V once, every suffix, q."""
    item = jnp.dtype(dtype).itemsize
    kv_row = 2 * num_kv_heads * head_dim * item
    return prefix_len * kv_row + n * suffix_len * kv_row + n * num_heads * head_dim * item


def copy_fork_bytes_read(n: int, prefix_len: int, suffix_len: int, num_heads: int,
                         num_kv_heads: int, head_dim: int, dtype) -> int:
    """HBM bytes a copy-fork step reads: every branch streams its own copy of the prefix."""
    item = jnp.dtype(dtype).itemsize
    kv_row = 2 * num_kv_heads * head_dim * item
    return n * (prefix_len + suffix_len) * kv_row + n * num_heads * head_dim * item


# ---------------------------------------------------------------------------------------------
# Kernel bodies
# ---------------------------------------------------------------------------------------------
def _softmax_step(q, k, v, row0, end, m, l, acc, *, scale_log2: float, precision):
    """One online-softmax update (FlashAttention-2) of rows q [bq, D] with keys row0.. of a block.

    k, v [bk, D]; keys at absolute rows >= end are masked (ragged length, padding, garbage past
    the valid rows of a cache). m, l [bq, 1]: running max of base-2 logits and sum of exp2;
    acc [bq, D] fp32: unnormalised output.
    """
    dims_qk = (((1,), (1,)), ((), ()))
    s = lax.dot_general(q, k, dims_qk, preferred_element_type=jnp.float32,
                        precision=precision) * scale_log2                          # [bq, bk]
    key_ok = row0 + lax.broadcasted_iota(jnp.int32, s.shape, 1) < end
    s = jnp.where(key_ok, s, -jnp.inf)
    m_next = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp2(s - m_next)
    alpha = jnp.exp2(m - m_next)
    # Zero V rows past `end`: p is 0 there, but 0 * (inf or NaN left in unused cache) is NaN.
    v = jnp.where(row0 + lax.broadcasted_iota(jnp.int32, v.shape, 0) < end, v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=precision)
    return m_next, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def finish(m, l, acc):
    """Normalised output and natural-log lse; rows that saw no key give 0 and NEG_INF."""
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    lse = jnp.where(seen, m * _LN2 + jnp.log(l_safe), NEG_INF)
    return acc / l_safe, lse


def _gpu_kernel(lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_k: int, split_len: int,
                scale_log2: float, precision):
    """Program (b, h, query block, split): keys [split*split_len, ..) of batch b, KV head h."""
    length = lens_ref[()]
    start = pl.program_id(3) * split_len
    end = jnp.minimum(start + split_len, length)
    q = q_ref[...]                                                                 # [bq, D]
    bq, d = q.shape

    def body(i, carry):
        row0 = pl.multiple_of(start + i * block_k, block_k)
        # Masked loads: the last block may run past the valid rows and past the cache's end.
        rows_ok = row0 + lax.broadcasted_iota(jnp.int32, (block_k, d), 0) < end
        k = plgpu.load(k_ref.at[pl.ds(row0, block_k), :], mask=rows_ok, other=0)
        v = plgpu.load(v_ref.at[pl.ds(row0, block_k), :], mask=rows_ok, other=0)
        return _softmax_step(q, k, v, row0, end, *carry, scale_log2=scale_log2,
                             precision=precision)

    init = (jnp.full((bq, 1), M_INIT, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros((bq, d), jnp.float32))
    m, l, acc = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), block_k), body, init)
    o, lse = finish(m, l, acc)
    o_ref[...] = o
    lse_ref[...] = lse.reshape(bq)


def _tpu_kernel(lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref, *,
                block_k: int, scale_log2: float, precision):
    """Grid step (b, h, query block, key block kb); statistics carried in VMEM scratch."""
    kb = pl.program_id(3)
    length = lens_ref[pl.program_id(0)]

    @pl.when(kb == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, M_INIT, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def stats():  # the lanes hold copies: a lane max is a layout-safe [bq, 1] read
        return (jnp.max(m_ref[...], axis=1, keepdims=True),
                jnp.max(l_ref[...], axis=1, keepdims=True))

    @pl.when(kb * block_k < length)
    def _step():
        m, l = stats()
        m, l, acc = _softmax_step(q_ref[...], k_ref[...], v_ref[...], kb * block_k, length, m, l,
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


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _ragged_attention(platform: Platform, q, k, v, lens, *, block_q: int, block_k: int,
                      num_splits: int, num_warps: int | None, num_stages: int | None,
                      scale_log2: float, precision, interpret: bool):
    """Multi-query GQA attention of q [B, Hkv, M, D] over k, v [B, L, Hkv, D] (rows < lens[b]).

    M must be a multiple of block_q; L need not be a multiple of block_k (GPU: masked loads;
    TPU: a partial last block, whose undefined rows the step masks). Returns partials
    [(o [B, Hkv, M, D] fp32, lse [B, Hkv, M] natural log)], one per GPU split, merged by lse.
    """
    b, hkv, m_rows, d = q.shape
    length = k.shape[1]
    k = k.reshape(b, length, hkv * d)                                              # free view
    v = v.reshape(b, length, hkv * d)
    key_blocks = pl.cdiv(length, block_k)
    q_spec_shape = (None, None, block_q, d)
    if platform == "tpu":
        def kv_map(bi, h, qi, kb, lens_ref):
            last = jnp.maximum(pl.cdiv(lens_ref[bi], block_k) - 1, 0)
            return bi, jnp.minimum(kb, last), h

        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, hkv, m_rows // block_q, key_blocks),
            in_specs=[pl.BlockSpec(q_spec_shape, lambda bi, h, qi, kb, _: (bi, h, qi, 0)),
                      pl.BlockSpec((None, block_k, d), kv_map),
                      pl.BlockSpec((None, block_k, d), kv_map)],
            out_specs=[pl.BlockSpec(q_spec_shape, lambda bi, h, qi, kb, _: (bi, h, qi, 0)),
                       pl.BlockSpec((None, None, block_q, TPU_LANES),
                                    lambda bi, h, qi, kb, _: (bi, h, qi, 0))],
            scratch_shapes=[pltpu.VMEM((block_q, TPU_LANES), jnp.float32),
                            pltpu.VMEM((block_q, TPU_LANES), jnp.float32),
                            pltpu.VMEM((block_q, d), jnp.float32)])
        o, lse = pl.pallas_call(
            functools.partial(_tpu_kernel, block_k=block_k, scale_log2=scale_log2,
                              precision=precision),
            grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((b, hkv, m_rows, d), jnp.float32),
                       jax.ShapeDtypeStruct((b, hkv, m_rows, TPU_LANES), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret, name="shared_prefix_ragged_attention",
        )(lens, q, k, v)
        return [(o, lse[..., 0])]

    blocks_per_split = -(-key_blocks // max(1, min(num_splits, key_blocks)))
    splits = -(-key_blocks // blocks_per_split)
    o, lse = pl.pallas_call(
        functools.partial(_gpu_kernel, block_k=block_k, split_len=blocks_per_split * block_k,
                          scale_log2=scale_log2, precision=precision),
        grid=(b, hkv, m_rows // block_q, splits),
        in_specs=[pl.BlockSpec((None,), lambda bi, h, qi, s: (bi,)),
                  pl.BlockSpec(q_spec_shape, lambda bi, h, qi, s: (bi, h, qi, 0)),
                  pl.BlockSpec((None, length, d), lambda bi, h, qi, s: (bi, 0, h)),
                  pl.BlockSpec((None, length, d), lambda bi, h, qi, s: (bi, 0, h))],
        out_specs=[pl.BlockSpec((None, None, None, block_q, d),
                                lambda bi, h, qi, s: (s, bi, h, qi, 0)),
                   pl.BlockSpec((None, None, None, block_q), lambda bi, h, qi, s: (s, bi, h, qi))],
        out_shape=[jax.ShapeDtypeStruct((splits, b, hkv, m_rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, hkv, m_rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="shared_prefix_ragged_attention",
    )(lens, q, k, v)
    return [(o[i], lse[i]) for i in range(splits)]


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
def _check_inputs(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v, suffix_lens):
    """Shape / dtype checks at trace time; every message names the offending argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [n, H, D], got shape {q.shape}")
    n, h, d = q.shape
    if prefix_k.ndim != 3 or prefix_k.shape != prefix_v.shape:
        raise ValueError(f"prefix_k and prefix_v must both be [P, Hkv, D], got {prefix_k.shape} "
                         f"and {prefix_v.shape}")
    p, hkv, dk = prefix_k.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q has D={d}, prefix_k has D={dk}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    if suffix_k.shape != suffix_v.shape or suffix_k.ndim != 4 or \
            suffix_k.shape[0] != n or suffix_k.shape[2:] != (hkv, d):
        raise ValueError(f"suffix_k and suffix_v must both be [n={n}, S, Hkv={hkv}, D={d}], got "
                         f"{suffix_k.shape} and {suffix_v.shape}")
    dtypes = {a.dtype for a in (q, prefix_k, prefix_v, suffix_k, suffix_v)}
    if len(dtypes) != 1:
        raise ValueError(f"q, prefix_k/v and suffix_k/v must share one dtype, got "
                         f"{sorted(str(t) for t in dtypes)}")
    if jnp.ndim(prefix_len) != 0:
        raise ValueError(f"prefix_len must be a scalar, got shape {jnp.shape(prefix_len)}")
    if jnp.shape(suffix_lens) != (n,):
        raise ValueError(f"suffix_lens must be [n={n}], got shape {jnp.shape(suffix_lens)}")
    return n, h, hkv, d, p, suffix_k.shape[1]


def resolve_platform(platform: str | None) -> Platform:
    """The kernel body to lower: `platform` ("gpu" or "tpu"), or by default "tpu" on a TPU backend
    and "gpu" elsewhere (CPU runs the GPU body with interpret=True); anything else is ValueError."""
    plat = platform or ("tpu" if jax.default_backend() == "tpu" else "gpu")
    if plat not in ("gpu", "tpu"):
        raise ValueError(f"platform must be 'gpu' or 'tpu', got {platform!r}")
    return plat  # type: ignore[return-value]


def _resolve_block_sizes(plat: Platform, user: BlockSizes | None, n: int, h: int, hkv: int,
                         p: int, s: int, interpret: bool, head_dim: int = 128, dtype=jnp.bfloat16) -> BlockSizes:
    sizes = default_block_sizes(plat, n, h, hkv, p, s, head_dim=head_dim, dtype=dtype)
    if user is not None:
        sizes = dataclasses.replace(
            sizes, **{f.name: getattr(user, f.name) for f in dataclasses.fields(user)
                      if getattr(user, f.name) is not None})
    for name in ("block_q", "block_k", "block_k_suffix", "num_splits"):
        value = getattr(sizes, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"block_sizes.{name} must be a positive int, got {value!r}")
    if plat == "gpu" and not interpret:
        for name in ("block_q", "block_k", "block_k_suffix"):
            value = getattr(sizes, name)
            if value < GPU_MIN_DIM or value & (value - 1):
                raise ValueError(f"block_sizes.{name}={value}: Triton needs a power of two >= 16")
    return sizes


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes", "return_lse", "platform"))
def shared_prefix_attention(q: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array,
                            prefix_len: jax.Array, suffix_k: jax.Array, suffix_v: jax.Array,
                            suffix_lens: jax.Array, *, interpret: bool = False,
                            block_sizes: BlockSizes | None = None, return_lse: bool = False,
                            platform: Platform | None = None):
    """One decode step of n branches over a shared prefix, reading the prefix once (Pallas).

    q [n, H, D]: one query per branch. prefix_k/v [P, Hkv, D]: shared by all branches, rows
    < prefix_len valid (a traced int scalar, clipped to [0, P]). suffix_k/v [n, S, Hkv, D]: branch
    b's own keys (the current token's included), rows < suffix_lens[b] valid (clipped to [0, S]).
    H % Hkv == 0 (query head h uses KV head h // (H / Hkv)). All five arrays share one dtype;
    logits and the softmax are fp32 (fp32 inputs: IEEE-fp32 products, no TF32). Softmax scale
    1 / sqrt(D). Returns out [n, H, D] in q's dtype, and with return_lse=True also lse [n, H]
    (natural log, fp32; NEG_INF for a branch with no valid key, whose output is 0).

    platform: "gpu" (Triton body) or "tpu" (Mosaic body); default from jax.default_backend(), the
    GPU body on CPU. interpret=True runs either body in the Pallas interpreter (required on CPU;
    an explicit platform with interpret=False lowers for that platform, e.g. under jax.export).
    block_sizes: a `BlockSizes` overriding `default_block_sizes` field by field.
    """
    n, h, hkv, d, p, s = _check_inputs(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v,
                                       suffix_lens)
    if not interpret and platform is None and jax.default_backend() == "cpu":
        raise ValueError("Pallas has no CPU lowering: call shared_prefix_attention with "
                         "interpret=True on CPU")
    plat = resolve_platform(platform)
    if plat == "tpu" and not interpret and d % 128 and hkv > 1:
        raise ValueError(f"the TPU kernel needs head_dim a multiple of 128 (got {d}) when "
                         f"Hkv > 1: a (rows, D) block of the [L, Hkv*D] cache view is lane-tiled")
    sizes = _resolve_block_sizes(plat, block_sizes, n, h, hkv, p, s, interpret, head_dim=d, dtype=q.dtype)
    g = h // hkv
    scale_log2 = LOG2E / math.sqrt(d)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    dp = max(GPU_MIN_DIM, next_pow2(d)) if plat == "gpu" else d
    q, prefix_k, prefix_v, suffix_k, suffix_v = (
        _pad_axis(a, a.ndim - 1, dp) for a in (q, prefix_k, prefix_v, suffix_k, suffix_v))
    run = functools.partial(_ragged_attention, plat, num_warps=sizes.num_warps,
                            num_stages=sizes.num_stages, scale_log2=scale_log2,
                            precision=precision, interpret=interpret)
    qg = q.reshape(n, hkv, g, dp)
    parts = []
    if p > 0:
        rows = n * g
        q_pre = _pad_axis(qg.transpose(1, 0, 2, 3).reshape(1, hkv, rows, dp), 2,
                          round_up(rows, sizes.block_q))
        lens = jnp.clip(jnp.asarray(prefix_len, jnp.int32), 0, p).reshape(1)
        for o, lse in run(q_pre, prefix_k[None], prefix_v[None], lens, block_q=sizes.block_q,
                          block_k=sizes.block_k, num_splits=sizes.num_splits):
            o = o[0, :, :rows, :d].reshape(hkv, n, g, d).transpose(1, 0, 2, 3).reshape(n, h, d)
            parts.append((o, lse[0, :, :rows].reshape(hkv, n, g).transpose(1, 0, 2).reshape(n, h)))
    if s > 0:
        g_pad = max(GPU_MIN_DIM, next_pow2(g)) if plat == "gpu" else round_up(g, 8)
        lens = jnp.clip(jnp.asarray(suffix_lens, jnp.int32), 0, s)
        splits = 1 if plat == "tpu" else auto_splits(n * hkv, -(-s // sizes.block_k_suffix))
        for o, lse in run(_pad_axis(qg, 2, g_pad), suffix_k, suffix_v, lens, block_q=g_pad,
                          block_k=sizes.block_k_suffix, num_splits=splits):
            parts.append((o[:, :, :g, :d].reshape(n, h, d), lse[:, :, :g].reshape(n, h)))
    if parts:
        out, lse = merge_partials(parts)
    else:
        out, lse = jnp.zeros((n, h, d), jnp.float32), jnp.full((n, h), NEG_INF, jnp.float32)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("interpret", "block_sizes", "return_lse", "platform"))
def shared_prefix_attention_reference(q: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array,
                                      prefix_len: jax.Array, suffix_k: jax.Array,
                                      suffix_v: jax.Array, suffix_lens: jax.Array, *,
                                      interpret: bool = False,
                                      block_sizes: BlockSizes | None = None,
                                      return_lse: bool = False,
                                      platform: Platform | None = None):
    """`shared_prefix_attention` in plain jnp: the engine's XLA shared-fork path, no Pallas.

    The prefix part treats the n branch queries as n positions of one sequence, so XLA computes
    it as one product over the prefix (read once, Hydragen's inter-sequence batching); the suffix
    part is per branch; both use `reference.attend_partial` and merge with `reference.merge_partials`.
    The keyword arguments only mirror the kernel's signature (nothing here is tiled).
    """
    del interpret, block_sizes, platform
    n, h, hkv, d, p, s = _check_inputs(q, prefix_k, prefix_v, prefix_len, suffix_k, suffix_v,
                                       suffix_lens)
    prefix_mask = jnp.broadcast_to(jnp.arange(p) < prefix_len, (1, n, p))
    o_pre, lse_pre = attend_partial(q[None], prefix_k[None], prefix_v[None], prefix_mask)
    suffix_mask = (jnp.arange(s)[None, :] < jnp.asarray(suffix_lens)[:, None])[:, None, :]
    o_suf, lse_suf = attend_partial(q[:, None], suffix_k, suffix_v, suffix_mask)
    out, lse = merge_partials([(o_pre[0], lse_pre[0]), (o_suf[:, 0], lse_suf[:, 0])])
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out
