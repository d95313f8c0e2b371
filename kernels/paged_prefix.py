"""Many groups per call over the paged KV pool: each group's pages read once for all its rows (Pallas).

Why. The paged engine (sprint_jax/infer/pages.py) keeps K/V in a pool of fixed-size pages, and a
decode step groups rows by fork (siblings share the pages of their common prefix). Every row of a
group attends over the group's pages; the W x H/Hkv queries of a group meet each key block once,
so a group's pages are read from HBM once per step (per query block) whatever the number of rows.
This is `grouped_prefix_attention` (parent_prefix.py) with the slot cache replaced by pages read
through a page table; its (out, lse) pair merges by log-sum-exp with the rows' other partials.

What. `grouped_paged_prefix_attention(q [G, W, H, D], k_pool, v_pool [L, Hkv, N, ps, D], layer,
page_table [G, M], lens [G, W])`: member w of group g sees the first lens[g, w] tokens of its
group's pages (token t lies in page page_table[g, t // ps] at slot t % ps). The whole pool is
passed in and viewed as [L*Hkv, N, ps, D] (a free reshape): a kernel reads (layer*Hkv + head,
page) blocks of [ps, D], so the layer is never sliced out or copied. Page ids are clipped to
[0, N), the layer to [0, L), lens to [0, M*ps]; pages past a group's longest row are never read.

  * "tpu" (Mosaic): grid (group, KV head, query block, key block); a key block is
    `pages_per_block` pages, one BlockSpec per page whose index map reads the scalar-prefetched
    (flattened) page table, the group lengths and the layer. Past the group's last used block the
    index maps repeat that block's pages (the pipeline issues no new DMA) and `pl.when` skips the
    compute; within the last block, a page slot past the last used page repeats its index of the
    block before (no DMA; `tpu_page_slot`). Only the group's used pages are read, except that a
    group shorter than one block reads its last page again in the unused slots (at most
    pages_per_block - 1 pages: the reason the default block is 256 keys, not more). The block's
    pages are concatenated in VMEM into one [pages_per_block * ps, D] key block for the step.
    The page table is scalar-prefetched into SMEM (1 MiB on v5e / v5p): groups whose tables
    exceed `TPU_SMEM_TABLE_BYTES` run as several calls over the groups.
  * "gpu" (Triton): grid (group, KV head, query block, split); a program loops over its split of
    the group's pages, one page a step (block_k = page size), loading page table[g, j] of the whole
    pool ref by pointer arithmetic (masked past the group's length), trip count from the length.
    Split-K (flash-decoding) fills the GPU when groups x KV heads x query blocks is small; the
    splits merge by lse outside the kernel. ps must be a power of two >= 16 (Triton tiles).
On CPU either body runs with interpret=True (the tests).

Layout. As parent_prefix: queries of a group are laid out per KV head as W x (H/Hkv) rows
(member-major), padded to the query block; per-row lengths and the lse are lane-replicated
[.., 128] blocks on TPU.
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

from . import gpu_target
from .parent_prefix import online_softmax_step
from .reference import attend_partial_heads, merge_partials
from .shared_prefix import (GPU_MIN_DIM, LOG2E, M_INIT, TPU_LANES, TPU_MAX_BLOCK_Q, BlockSizes,
                            Platform, auto_splits, finish, next_pow2, resolve_platform, round_up)

# TPU: keys per key block (pages_per_block = this // page_size). A grid step costs ~0.35 us
# whatever it moves; 256 keys of K and V at D=128 bf16 are 128 KiB a step.
TPU_BLOCK_KEYS = 256
# TPU: bytes of page table one call scalar-prefetches into SMEM (1 MiB on v5e and v5p: a 1 MiB table
# was refused there, "Ran out of memory in memory space smem", 512 KiB compiled); more groups x
# pages than this run as several calls over the groups.
TPU_SMEM_TABLE_BYTES = 512 * 1024


def default_paged_block_sizes(platform: Platform, groups: int, width: int, num_heads: int,
                              num_kv_heads: int, max_pages: int, page_size: int, *,
                              head_dim: int = 128, dtype=jnp.bfloat16) -> BlockSizes:
    """Tiles for `groups` groups of `width` rows over page tables of `max_pages` pages.

    block_k is the keys of one key block: TPU, `TPU_BLOCK_KEYS` rounded down to whole pages (at
    least one, at most the table); GPU, one page. block_q: TPU, all W x H/Hkv rows of a group
    (padded to 16) up to 1024, else 512; GPU, the next power of two up to 128, halved while the
    tiles exceed the target GPU's shared memory (`gpu_target.decode_smem`), split-K to ~2 programs
    per SM (at least 2 pages a split)."""
    rows = width * (num_heads // num_kv_heads)
    if platform == "tpu":
        block_q = round_up(rows, 16) if rows <= TPU_MAX_BLOCK_Q else 512
        pages = max(1, min(max_pages, TPU_BLOCK_KEYS // page_size))
        return BlockSizes(block_q=block_q, block_k=pages * page_size, num_splits=1)
    block_q = min(128, max(GPU_MIN_DIM, next_pow2(rows)))
    smem = gpu_target.shared_memory()
    dp = max(GPU_MIN_DIM, next_pow2(head_dim))
    while gpu_target.decode_smem(block_q, page_size, dp, dtype) > smem:
        if block_q == GPU_MIN_DIM:
            raise ValueError(f"no decode block fits {smem} bytes of shared memory with pages of {page_size} "
                             f"at head_dim {head_dim}, {jnp.dtype(dtype).name}")
        block_q //= 2
    programs = groups * num_kv_heads * -(-rows // block_q)
    return BlockSizes(block_q=block_q, block_k=page_size, num_splits=auto_splits(programs, max_pages),
                      num_warps=8 if block_q >= 128 else 4, num_stages=2)


def tpu_groups_per_call(max_pages: int) -> int:
    """Groups whose page tables of `max_pages` pages fit one TPU call's SMEM budget."""
    if 4 * max_pages > TPU_SMEM_TABLE_BYTES:
        raise ValueError(f"a page table of {max_pages} pages exceeds the TPU kernel's SMEM budget "
                         f"({TPU_SMEM_TABLE_BYTES // 4} pages)")
    return TPU_SMEM_TABLE_BYTES // (4 * max_pages)


def tpu_page_slot(kb, i, used, pages_per_block: int):
    """The table slot that page i of key block kb reads on TPU, for a group of `used` pages.

    Block kb < the last used block: slot kb*ppb + i. Past the last used block: the last block's
    slots again (the pipeline sees the same block index and issues no DMA). In the last block a
    slot past the last used page repeats the slot of the block before (no DMA either; its keys
    lie past the length and are masked), or, when the last block is the first, the last used page.
    So only the group's used pages are read. Works on ints and on traced int32 scalars."""
    last = jnp.maximum(pl.cdiv(used, pages_per_block) - 1, 0)
    b = jnp.minimum(kb, last)
    j = b * pages_per_block + i
    return jnp.where(j < used, j, jnp.where(b > 0, j - pages_per_block, jnp.maximum(used - 1, 0)))


def _gpu_kernel(layer_ref, table_ref, glen_ref, rlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                num_kv_heads: int, page_size: int, split_pages: int, scale_log2: float, precision):
    """Program (group, KV head, query block, split): pages [split*split_pages, ..) of the group."""
    g, head = pl.program_id(0), pl.program_id(1)
    row = layer_ref[0] * num_kv_heads + head
    first = pl.program_id(3) * split_pages
    start = first * page_size
    end = jnp.minimum(start + split_pages * page_size, glen_ref[()])
    row_end = jnp.minimum(rlen_ref[...], end)[:, None]                             # [bq, 1]
    q = q_ref[...]
    bq, d = q.shape

    def body(i, carry):
        j = first + i
        page = table_ref[g, j]
        row0 = j * page_size
        ok = row0 + lax.broadcasted_iota(jnp.int32, (page_size, d), 0) < end
        k = plgpu.load(k_ref.at[row, page, :, :], mask=ok, other=0)
        v = plgpu.load(v_ref.at[row, page, :, :], mask=ok, other=0)
        return online_softmax_step(q, k, v, row0, row_end, end, *carry, scale_log2=scale_log2, precision=precision)

    init = (jnp.full((bq, 1), M_INIT, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros((bq, d), jnp.float32))
    m, l, acc = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), page_size), body, init)
    o, lse = finish(m, l, acc)
    o_ref[...] = o
    lse_ref[...] = lse.reshape(bq)


def _tpu_kernel(layer_ref, table_ref, glens_ref, rlen_ref, q_ref, *refs, pages_per_block: int,
                page_size: int, scale_log2: float, precision):
    """Grid step (group, KV head, query block, key block kb): refs are the block's K pages, its V
    pages, then out, lse and the VMEM statistics."""
    del layer_ref, table_ref                     # read by the index maps only
    k_refs, v_refs = refs[:pages_per_block], refs[pages_per_block:2 * pages_per_block]
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * pages_per_block:]
    block_k = pages_per_block * page_size
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

    def block(refs):
        return refs[0][...] if len(refs) == 1 else jnp.concatenate([r[...] for r in refs], axis=0)

    @pl.when(kb * block_k < length)
    def _step_block():
        m, l = stats()
        row_end = jnp.max(rlen_ref[...], axis=1, keepdims=True)                     # [bq, 1] f32
        m, l, acc = online_softmax_step(q_ref[...], block(k_refs), block(v_refs), kb * block_k, row_end, length,
                          m, l, acc_ref[...], scale_log2=scale_log2, precision=precision)
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
        acc_ref[...] = acc

    @pl.when(kb == pl.num_programs(3) - 1)
    def _store():
        m, l = stats()
        o, lse = finish(m, l, acc_ref[...])
        o_ref[...] = o
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _check_inputs(q, k_pool, v_pool, layer, page_table, lens):
    if q.ndim != 4:
        raise ValueError(f"q must be [groups, W, H, D], got shape {q.shape}")
    gr, w, h, d = q.shape
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [L, Hkv, N, page_size, D], got {k_pool.shape} "
                         f"and {v_pool.shape}")
    nl, hkv, n, ps, dk = k_pool.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q has D={d}, k_pool has D={dk}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    if q.dtype != k_pool.dtype or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"q, k_pool and v_pool must share one dtype, got {q.dtype}, {k_pool.dtype}, "
                         f"{v_pool.dtype}")
    if jnp.shape(layer) not in ((), (1,)):
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    if jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != gr:
        raise ValueError(f"page_table must be [groups={gr}, M], got shape {jnp.shape(page_table)}")
    if jnp.shape(lens) != (gr, w):
        raise ValueError(f"lens must be [groups={gr}, W={w}], got shape {jnp.shape(lens)}")
    return gr, w, h, hkv, d, nl, n, ps, jnp.shape(page_table)[1]


@functools.partial(jax.jit, static_argnames=("interpret", "platform", "block_sizes"))
def grouped_paged_prefix_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                                   page_table: jax.Array, lens: jax.Array, *, interpret: bool = False,
                                   platform: Platform | None = None,
                                   block_sizes: BlockSizes | None = None):
    """Attention of every group's rows over its own pages of the KV pool, each page read once (Pallas).

    q [G, W, H, D]; k_pool, v_pool [L, Hkv, N, ps, D] (the whole pool); layer int scalar (clipped
    to [0, L)); page_table [G, M] int (group g's pages in token order; ids clipped to [0, N);
    entries past a group's longest row are never read); lens [G, W] int (clipped to [0, M*ps]):
    member w of group g sees the group's first lens[g, w] tokens. Query head h uses KV head
    h // (H / Hkv); scale 1 / sqrt(D); logits and softmax in fp32 (fp32 inputs: IEEE-fp32
    products). Returns (out [G, W, H, D] in q's dtype, lse [G, W, H] fp32 natural log; a row with
    no key: out 0, lse NEG_INF), the contract of `grouped_prefix_attention`.

    platform "gpu" (Triton) / "tpu" (Mosaic), default from jax.default_backend() (the GPU body on
    CPU); interpret=True runs the body in the Pallas interpreter (required on CPU). block_sizes:
    block_q (query rows per program), block_k (keys per key block: TPU a multiple of ps, GPU ps),
    num_splits (GPU split-K), num_warps / num_stages (GPU); None fields take
    `default_paged_block_sizes`.
    """
    gr, w, h, hkv, d, nl, n, ps, mp = _check_inputs(q, k_pool, v_pool, layer, page_table, lens)
    if not interpret and platform is None and jax.default_backend() == "cpu":
        raise ValueError("Pallas has no CPU lowering: call grouped_paged_prefix_attention with "
                         "interpret=True on CPU")
    plat = resolve_platform(platform)
    if plat == "gpu" and not interpret:
        if d < GPU_MIN_DIM or d & (d - 1):
            raise ValueError(f"the GPU kernel needs head_dim a power of two >= 16 (got {d})")
        if ps < GPU_MIN_DIM or ps & (ps - 1):
            raise ValueError(f"the GPU kernel needs page_size a power of two >= 16 (got {ps})")
    sizes = default_paged_block_sizes(plat, gr, w, h, hkv, mp, ps, head_dim=d, dtype=q.dtype)
    if block_sizes is not None:
        sizes = dataclasses.replace(sizes, **{f.name: getattr(block_sizes, f.name)
                                              for f in dataclasses.fields(block_sizes)
                                              if getattr(block_sizes, f.name) is not None})
    for name in ("block_q", "block_k", "num_splits"):
        if not isinstance(getattr(sizes, name), int) or getattr(sizes, name) < 1:
            raise ValueError(f"block_sizes.{name} must be a positive int, got {getattr(sizes, name)!r}")
    bq, bk = sizes.block_q, sizes.block_k
    if plat == "tpu" and bk % ps:
        raise ValueError(f"block_sizes.block_k={bk} must be a multiple of the page size {ps} on TPU")
    if plat == "gpu" and bk != ps:
        raise ValueError(f"block_sizes.block_k={bk} must be the page size {ps} on GPU (one page a step)")
    if plat == "gpu" and not interpret and (bq < GPU_MIN_DIM or bq & (bq - 1)):
        raise ValueError(f"block_sizes.block_q={bq}: Triton needs a power of two >= 16")
    g = h // hkv
    rows = w * g
    m_pad = round_up(rows, bq)
    scale_log2 = LOG2E / math.sqrt(d)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    # queries per (group, KV head): member-major rows [w0 heads.., w1 heads.., ..], padded
    qk = q.reshape(gr, w, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(gr, hkv, rows, d)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, m_pad - rows), (0, 0)))
    lens = jnp.clip(jnp.asarray(lens, jnp.int32), 0, mp * ps)
    row_len = jnp.pad(jnp.repeat(lens, g, axis=1), ((0, 0), (0, m_pad - rows)))    # [G, m_pad]
    glen = jnp.max(lens, axis=1)
    table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, n - 1)
    layer = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(1), 0, nl - 1)
    # [L*Hkv, N, ps, D]: a free view; (layer*Hkv + head, page) names one [ps, D] page
    kv = (k_pool.reshape(nl * hkv, n, ps, d), v_pool.reshape(nl * hkv, n, ps, d))
    q_shape = (None, None, bq, d)

    if plat == "tpu":
        ppb = bk // ps
        key_blocks = pl.cdiv(mp, ppb)
        calls = -(-gr // tpu_groups_per_call(mp))                  # the page table lives in SMEM
        per_call = -(-gr // calls)

        def page_map(i):
            def index(gi, hi, qi, kb, layer_ref, table_ref, glens_ref):
                j = tpu_page_slot(kb, i, pl.cdiv(glens_ref[gi], ps), ppb)
                return layer_ref[0] * hkv + hi, table_ref[gi * mp + j], 0, 0
            return index

        page_specs = [pl.BlockSpec((None, None, ps, d), page_map(i)) for i in range(ppb)]
        q_map = lambda gi, hi, qi, kb, *_: (gi, hi, qi, 0)  # noqa: E731
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(per_call, hkv, m_pad // bq, key_blocks),
            in_specs=[pl.BlockSpec((None, bq, TPU_LANES), lambda gi, hi, qi, kb, *_: (gi, qi, 0)),
                      pl.BlockSpec(q_shape, q_map), *page_specs, *page_specs],
            out_specs=[pl.BlockSpec(q_shape, q_map),
                       pl.BlockSpec((None, None, bq, TPU_LANES), q_map)],
            scratch_shapes=[pltpu.VMEM((bq, TPU_LANES), jnp.float32),
                            pltpu.VMEM((bq, TPU_LANES), jnp.float32),
                            pltpu.VMEM((bq, d), jnp.float32)])
        rlen = jnp.broadcast_to(row_len.astype(jnp.float32)[..., None], (gr, m_pad, TPU_LANES))
        call = pl.pallas_call(
            functools.partial(_tpu_kernel, pages_per_block=ppb, page_size=ps, scale_log2=scale_log2,
                              precision=precision),
            grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((per_call, hkv, m_pad, d), jnp.float32),
                       jax.ShapeDtypeStruct((per_call, hkv, m_pad, TPU_LANES), jnp.float32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret, name="grouped_paged_prefix_attention")
        # groups in `calls` calls of `per_call` (the last padded with groups of length 0: they read
        # one page and compute nothing)
        pad = calls * per_call - gr
        padded = [jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)) for a in (table, glen, rlen, qk)]
        outs = [call(layer, *(a[c * per_call:(c + 1) * per_call].reshape(-1) if i == 0 else
                              a[c * per_call:(c + 1) * per_call] for i, a in enumerate(padded)),
                     *([kv[0]] * ppb), *([kv[1]] * ppb)) for c in range(calls)]
        o = jnp.concatenate([x[0] for x in outs])[:gr] if calls > 1 else outs[0][0]
        lse = jnp.concatenate([x[1] for x in outs])[:gr] if calls > 1 else outs[0][1]
        parts = [(o, lse[..., 0])]
    else:
        per_split = -(-mp // max(1, min(sizes.num_splits, mp)))
        splits = -(-mp // per_split)
        whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
        o, lse = pl.pallas_call(
            functools.partial(_gpu_kernel, num_kv_heads=hkv, page_size=ps, split_pages=per_split,
                              scale_log2=scale_log2, precision=precision),
            grid=(gr, hkv, m_pad // bq, splits),
            in_specs=[whole(layer), whole(table),
                      pl.BlockSpec((None,), lambda gi, hi, qi, si: (gi,)),
                      pl.BlockSpec((None, bq), lambda gi, hi, qi, si: (gi, qi)),
                      pl.BlockSpec(q_shape, lambda gi, hi, qi, si: (gi, hi, qi, 0)),
                      whole(kv[0]), whole(kv[1])],
            out_specs=[pl.BlockSpec((None, None, None, bq, d),
                                    lambda gi, hi, qi, si: (si, gi, hi, qi, 0)),
                       pl.BlockSpec((None, None, None, bq), lambda gi, hi, qi, si: (si, gi, hi, qi))],
            out_shape=[jax.ShapeDtypeStruct((splits, gr, hkv, m_pad, d), jnp.float32),
                       jax.ShapeDtypeStruct((splits, gr, hkv, m_pad), jnp.float32)],
            compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps or 4,
                                                 num_stages=sizes.num_stages or 2),
            interpret=interpret, name="grouped_paged_prefix_attention",
        )(layer, table, glen, row_len, qk, *kv)
        parts = [(o[i], lse[i]) for i in range(splits)]
    out, lse = merge_partials(parts) if len(parts) > 1 else parts[0]
    out = out[:, :, :rows].reshape(gr, hkv, w, g, d).transpose(0, 2, 1, 3, 4).reshape(gr, w, h, d)
    lse = lse[:, :, :rows].reshape(gr, hkv, w, g).transpose(0, 2, 1, 3).reshape(gr, w, h)
    return out.astype(q.dtype), lse


@jax.jit
def grouped_paged_prefix_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                                             page_table: jax.Array, lens: jax.Array):
    """`grouped_paged_prefix_attention` in plain jnp: gather each group's pages at the layer (ids
    clipped) into [G, Hkv, M*ps, D] and `attend_partial_heads` under the length mask."""
    gr, w, h, hkv, d, nl, n, ps, mp = _check_inputs(q, k_pool, v_pool, layer, page_table, lens)
    at = jnp.clip(jnp.asarray(layer, jnp.int32).reshape(()), 0, nl - 1)
    table = jnp.clip(jnp.asarray(page_table, jnp.int32), 0, n - 1)

    def gather(pool):                                        # [Hkv, N, ps, D] -> [G, Hkv, M*ps, D]
        pages = jnp.take(lax.dynamic_index_in_dim(pool, at, 0, keepdims=False), table, axis=1)
        return jnp.swapaxes(pages, 0, 1).reshape(gr, hkv, mp * ps, d)

    mask = jnp.arange(mp * ps)[None, None, :] < jnp.asarray(lens)[:, :, None]          # [G, W, M*ps]
    return attend_partial_heads(q, gather(k_pool), gather(v_pool), mask)


def paged_group_bytes_read(group_lens, width: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           page_size: int, dtype) -> int:
    """HBM bytes one grouped paged step must read: each group's pages up to its longest row, once
    (K and V, whole pages), and the queries. `group_lens`: the used length of each group."""
    item = jnp.dtype(dtype).itemsize
    page = 2 * num_kv_heads * page_size * head_dim * item
    pages = sum(-(-int(n) // page_size) for n in group_lens)
    return pages * page + len(group_lens) * width * num_heads * head_dim * item
