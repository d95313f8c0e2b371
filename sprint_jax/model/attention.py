"""The one attention module: the dense reference, masks and a blockwise (flash) attention for span masks.

Dense reference. `attend_partial(q, k, v, mask)` is grouped-query attention over one block of keys
with an explicit [B, T, S] mask, returning the output and its log-sum-exp; `merge_partials` merges
partial attentions over disjoint key blocks exactly by log-sum-exp (Hydragen's decomposition; the
engine's shared-prefix decode uses both). It materialises the [T, S] scores: it is the reference.
Both, and the merge rule's tile summaries below, are defined in `sprint_jax.kernels.reference`
(the Pallas kernels share them and import nothing above themselves) and re-exported here.

Flash attention. The trainer has one mask rule for both layouts (train/data.py): row i sees
column j iff `j <= i < span_end[j]`. Flat packing (segments: span_end[j] = end of j's example) and
the trie (span_end[j] = end of j's subtree, depth-first order) are both this rule. A (query block,
key block) tile is empty when the key block starts after the query block ends, or when the largest
span_end in the key block is <= the query block's first row; `flash_attention` never computes such
a tile. It follows FlashAttention-2 (Dao, 2023): the online-softmax recurrence over key blocks in
the forward pass, which stores only the output and the log-sum-exp, and a `custom_vjp` backward
that recomputes each visible tile's probabilities from the saved log-sum-exp instead of storing
scores. Memory is O(T) per head instead of O(T^2).

Bodies, chosen per backend behind the one function:
  * "xla": blockwise jnp under lax loops (CPU, and the readable version of the kernels): a scan
    over query blocks with a loop over the key blocks from the first one whose spans reach the
    query block to the causal limit (backward: a scan over key blocks, looping over the query
    blocks from the causal start to the block's largest span_end), each tile under `lax.cond` on
    its visibility (XLA runs only the taken branch; under vmap cond becomes select).
  * "gpu" / "tpu": Pallas kernels in `sprint_jax.kernels.flash_attention` (Triton / Mosaic).
  * "splash": the flat layout on TPU through jax's splash attention (`sprint_jax.kernels.splash`):
    there span_end is a segment id and the rule is "causal and same segment", which the platform
    library does with its own kernels and backward. Chosen by default (impl=None) on a TPU backend
    when the caller says `layout="flat"` (the train step does, from data.layout), no lse is asked
    and the queries are the keys; the trie, the merge layout, the engine's prefill (q_offset, lse)
    and any call without `layout="flat"` run our "tpu" kernel. `resolve_impl` is that choice.
On GPU the flat layout stays on our Triton body: `jax.nn.dot_product_attention` (implementation=
"cudnn", jax 0.10.2) takes only a dense mask / bias (the [T, T] we avoid), `is_causal` and one
sequence length per row, no segment ids; packed segments exist only in the private
`jax._src.cudnn` API (q_offsets / kv_offsets, Hopper only), and both query the local cuDNN at trace
time ("cuDNN is not detected." on a CPU host), so nothing of it can be built or tested here.

Queries may sit at an offset into the keys (`q_offset`, per batch row): query t of row b is row
i = q_offset[b] + t of the rule. The engine's prefill uses that to attend a chunk to its cache.

The (stage, branch) form (the merge layout, docs/design.md "Layouts: flat, trie, merge"). With
per-token `stage` and `branch` [B, S] the rule gains a factor: row i sees j iff
j <= i < span_end[j] and
    branch[j] == 0  or  stage[j] < stage[i]  or  (stage[j], branch[j]) == (stage[i], branch[i])
(planner text is seen by every later row; an executor token by its own branch and by everything
of a later stage; never by a sibling branch). It is not an interval in j, so span_end alone cannot
say it. A tile is empty under it when no pair of (query row, key) passes, which per-block
summaries bound without looking at pairs (`merge_summaries`): over the keys some row may see
(span_end[j] > j), plan = any key with branch 0, smin = the smallest executor stage, [clo, chi] the
range of executor codes stage * 2^16 + branch; over the query rows, smax = the largest stage and
[clo, chi] their executor codes. The tile can hold a visible pair only if
    plan  or  key smin < query smax  or  the two code ranges overlap
(the three clauses of the rule, each necessary for its clause). A tile is computed iff that and
the span test both hold; otherwise skipped. The bound is conservative (a skipped tile is always
empty; a computed one may be empty, e.g. a key block whose only planner keys belong to another
packed example); on the packed merge rows of tests/test_merge_attention.py it computed exactly
the non-empty tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

# the dense reference and the merge rule's summaries, used here and re-exported (see the docstring)
from sprint_jax.kernels.reference import (NEG_INF, attend_partial, attend_partial_heads,  # noqa: F401
                                         key_summary, merge_partials, merge_summaries,
                                         merge_tile_visible, merge_visible, pad_query_tags,
                                         query_summary, query_tags)
from sprint_jax.model.sharding import RULES, logical_to_spec

_M_INIT = -1e30            # running max before any key: finite, so exp(m - m_new) is never NaN
_PAD_LSE = 1e30            # lse of padded query rows in the backward: exp(s - lse) = 0 there


# ---------------------------------------------------------------------------------------------
# Dense masks
# ---------------------------------------------------------------------------------------------
def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids -> [B, T, T] mask: causal, and never across segments."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same


def span_mask(span_end: jax.Array, num_queries: int | None = None,
              q_offset: jax.Array | int = 0, stage: jax.Array | None = None,
              branch: jax.Array | None = None) -> jax.Array:
    """[B, S] span ends -> [B, T, S] dense mask: query t (row i = q_offset + t) sees key j iff
    j <= i < span_end[j]; with stage and branch [B, S] also `merge_visible` of rows i and j (the
    merge layout). T defaults to S (queries are the keys)."""
    b, s = span_end.shape
    t = s if num_queries is None else num_queries
    off = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(-1), (b,))
    i = off[:, None] + jnp.arange(t, dtype=jnp.int32)[None]                   # [B, T]
    j = jnp.arange(s, dtype=jnp.int32)
    mask = (j[None, None, :] <= i[:, :, None]) & (i[:, :, None] < span_end[:, None, :])
    if stage is None and branch is None:
        return mask
    tags = _tags(stage, branch, span_end.shape)
    qt = query_tags(tags, t, off)
    return mask & merge_visible(qt[:, 0, :, None], qt[:, 1, :, None], tags[:, 0, None, :],
                                tags[:, 1, None, :])


def _tags(stage, branch, shape) -> jax.Array:
    """stage, branch [B, S] -> one int32 [B, 2, S] array (both or neither must be given)."""
    if stage is None or branch is None:
        raise ValueError("the merge mask needs both stage and branch")
    if stage.shape != shape or branch.shape != shape:
        raise ValueError(f"stage and branch must be [B, S] = {shape}, got {stage.shape}, {branch.shape}")
    return jnp.stack([stage, branch], axis=1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Flash attention: tiling
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static choices of one flash call (hashable: a custom_vjp non-differentiable argument)."""
    impl: str            # "xla" | "gpu" | "tpu"
    block_q: int
    block_k: int
    interpret: bool = False
    unroll_tiles: int = 16   # XLA body: Python-unroll the tile loops when nq * nk <= this (`_tile_loop`)
    no_offset: bool = False  # q_offset is known to be 0 (the queries are the keys): unrolled loops
                             # leave out the tiles past the causal limit at trace time


def default_blocks(impl: str, t: int, s: int, head_dim: int = 128, dtype=jnp.bfloat16) -> tuple[int, int]:
    """Tile sizes: on GPU the largest up to 128 x 128 whose tiles fit the target GPU's shared memory
    at this dtype and head dim (`kernels.flash_attention.gpu_blocks`), 512 x 512 on TPU
    (lane-dense, long DMAs; VMEM holds it), and 64 x 64 for the XLA body (measured on CPU at the
    demo's shape, fwd + bwd: 64 beat 32 and 128; small enough that empty tiles are skipped at
    packing granularity); never more than the (16-rounded) length itself."""
    if impl == "gpu":
        from sprint_jax.kernels.flash_attention import gpu_blocks
        return gpu_blocks(t, s, head_dim, dtype)
    base = {"tpu": 512}.get(impl, 64)
    r16 = lambda n: max(16, -(-n // 16) * 16)  # noqa: E731
    return min(base, r16(t)), min(base, r16(s))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def tile_visible(kmax: jax.Array, k_start, row_lo: jax.Array, row_hi: jax.Array) -> jax.Array:
    """A (query rows row_lo..row_hi, key block from k_start with max span_end kmax) tile has a
    visible pair: the key block starts at or before the last row, and some key's span reaches
    past the first row. Elementwise over any leading batch shape."""
    return (k_start <= row_hi) & (kmax > row_lo)


# ---------------------------------------------------------------------------------------------
# The XLA body
# ---------------------------------------------------------------------------------------------
def _q_blocks(q, hkv, bq):
    """[B, T, H, D] -> [nq, B, Hkv, G*bq, D] (padded to whole blocks; rows ordered (g, t))."""
    b, t, h, d = q.shape
    nq, g = _round_up(t, bq) // bq, h // hkv
    qb = _pad_to(q, 1, nq * bq).reshape(b, nq, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)
    return qb.reshape(nq, b, hkv, g * bq, d)


def _blocks(q, k, v, span_end, bq, bk):
    """Pad to whole blocks and lay out block-major with (batch, KV head) leading, so that every
    tile product is a plain batched matmul (no transposes inside the loops; on CPU that is ~10%
    of the tiny train step): q [nq, B, Hkv, G*bq, D] (a KV head's G query heads stacked as rows,
    ordered (g, t)), k/v [nk, B, Hkv, bk, D], span_end [nk, B, bk] (padded keys get span_end 0:
    never visible), kmax [nk, B]."""
    b, s, hkv, d = k.shape
    sp = _round_up(s, bk)
    nk = sp // bk
    qb = _q_blocks(q, hkv, bq)
    kv = lambda x: _pad_to(x, 1, sp).reshape(b, nk, bk, hkv, d).transpose(1, 0, 3, 2, 4)  # noqa: E731
    se = jnp.moveaxis(_pad_to(span_end, 1, sp).reshape(b, nk, bk), 1, 0)
    return qb, kv(k), kv(v), se, jnp.max(se, axis=-1)


def _tile_mask(q_offset, qi, ki, bq, bk, se_tile):
    """[B, bq, bk] mask of the tile (query block qi, key block ki)."""
    rows = q_offset[:, None] + qi * bq + jnp.arange(bq, dtype=jnp.int32)[None]       # [B, bq]
    cols = ki * bk + jnp.arange(bk, dtype=jnp.int32)                                  # [bk]
    return (cols[None, None, :] <= rows[:, :, None]) & (rows[:, :, None] < se_tile[:, None, :])


class _Tiles:
    """The mask and the visibility test of the XLA body's tiles, with or without the merge factor."""

    def __init__(self, span_end, q_offset, tags, t, bq, bk):
        b, s = span_end.shape
        self.q_offset, self.bq, self.bk = q_offset, bq, bk
        self.tags = tags
        if tags is None:
            return
        tp, sp = _round_up(t, bq), _round_up(s, bk)
        qtags = pad_query_tags(query_tags(tags, t, q_offset), tp)                  # [B, 2, Tp]
        ktags = _pad_to(tags, 2, sp)                                               # [B, 2, Sp]
        qsum, ksum = merge_summaries(qtags, ktags, _pad_to(span_end, 1, sp), bq, bk)
        self.qtags = jnp.moveaxis(qtags.reshape(b, 2, tp // bq, bq), 2, 0)         # [nq, B, 2, bq]
        self.ktags = jnp.moveaxis(ktags.reshape(b, 2, sp // bk, bk), 2, 0)         # [nk, B, 2, bk]
        # the merge test of every tile at once (one gather per tile in the loops, not ~20 ops)
        self.merge_vis = jnp.moveaxis(merge_tile_visible(
            tuple(x[:, :, None] for x in qsum), tuple(x[:, None, :] for x in ksum)), 0, 2)  # [nq, nk, B]

    def mask(self, qi, ki, se_tile):
        """[B, bq, bk]"""
        m = _tile_mask(self.q_offset, qi, ki, self.bq, self.bk, se_tile)
        if self.tags is None:
            return m
        qt, kt = self.qtags[qi], self.ktags[ki]
        return m & merge_visible(qt[:, 0, :, None], qt[:, 1, :, None], kt[:, 0, None, :], kt[:, 1, None, :])

    def visible(self, qi, ki, kmax_k):
        """Scalar: may the tile hold a visible pair for some batch row (module docstring)?"""
        row_lo = self.q_offset + qi * self.bq
        vis = tile_visible(kmax_k, ki * self.bk, row_lo, row_lo + self.bq - 1)
        if self.tags is not None:
            vis = vis & self.merge_vis[qi, ki]
        return jnp.any(vis)


def _tile_loop(lo, hi, count: int, visible, step, carry, unroll: bool, first: int = 0):
    """carry = step(i, carry) for each i in [lo, hi) with visible(i); other tiles are never computed.

    Rolled: a `lax.fori_loop` over [lo, hi) with each tile under `lax.cond`. Unrolled (short rows:
    `FlashConfig.unroll_tiles`): a Python loop over first..count-1 (static bounds containing
    [lo, hi)), each tile under one `lax.cond` on (lo <= i < hi and visible). Same tiles, same
    order, same arithmetic; static indices slice blocks without dynamic-slice copies and XLA CPU
    runs the tiles without while-loop bookkeeping (the 10M train step at T = 256: 4 x 4 tiles)."""
    if not unroll:
        return lax.fori_loop(lo, hi, lambda i, c: lax.cond(visible(i), functools.partial(step, i),
                                                           lambda c: c, c), carry)
    for i in range(first, count):
        carry = lax.cond((lo <= i) & (i < hi) & visible(i), functools.partial(step, i), lambda c: c, carry)
    return carry


def _block_scan(f, carry, xs, count: int, unroll: bool):
    """`lax.scan` of f(carry, i, xs[i]) over blocks i < count, or the same Python-unrolled with
    static i (see `_tile_loop`); ys stacked on a leading block axis either way."""
    if not unroll:
        return lax.scan(lambda c, a: f(c, a[0], a[1]), carry, (jnp.arange(count, dtype=jnp.int32), xs))
    ys = []
    for i in range(count):
        carry, y = f(carry, i, jax.tree.map(lambda x: x[i], xs))
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _xla_forward(q, k, v, span_end, q_offset, tags, cfg: FlashConfig):
    """(out, lse, tiles computed); tags None or the merge form's [B, 2, S] (stage, branch)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    bq, bk = cfg.block_q, cfg.block_k
    qb, kb, vb, se, kmax = _blocks(q, k, v, span_end, bq, bk)
    nq, nk = qb.shape[0], kb.shape[0]
    scale = 1.0 / math.sqrt(d)
    tiles = _Tiles(span_end, q_offset, tags, t, bq, bk)

    unroll = nq * nk <= cfg.unroll_tiles

    def q_block(n_acc, qi, qt):                                            # qt [B, Hkv, G*bq, D]
        row_lo = q_offset + qi * bq                                        # [B]
        row_hi = row_lo + bq - 1
        hi = jnp.clip(jnp.max(row_hi) // bk + 1, 0, nk)                   # causal limit
        # key blocks before the first one whose spans reach this query block are all empty
        lo = jnp.argmax(jnp.any(kmax > row_lo[None, :], axis=1))

        def step(ki, carry):
            m, l, acc, n = carry                            # [B, Hkv, G, bq] x 2, [B, Hkv, G*bq, D], []
            mask = tiles.mask(qi, ki, se[ki])[:, None, None]                           # [B,1,1,bq,bk]
            s = jnp.einsum("bkmd,bksd->bkms", qt, kb[ki], preferred_element_type=jnp.float32)
            s = jnp.where(mask, s.reshape(b, hkv, g, bq, bk) * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkms,bksd->bkmd", p.reshape(b, hkv, g * bq, bk).astype(v.dtype), vb[ki],
                            preferred_element_type=jnp.float32)
            return (m_new, alpha * l + jnp.sum(p, axis=-1), alpha.reshape(b, hkv, g * bq, 1) * acc + pv,
                    n + 1)

        init = (jnp.full((b, hkv, g, bq), _M_INIT, jnp.float32),
                jnp.zeros((b, hkv, g, bq), jnp.float32),
                jnp.zeros((b, hkv, g * bq, d), jnp.float32), n_acc)
        # with no offset, key blocks past this query block's last row are never visible
        nk_q = min(nk, ((qi + 1) * bq - 1) // bk + 1) if unroll and cfg.no_offset else nk
        m, l, acc, n = _tile_loop(jnp.minimum(lo, hi), hi, nk_q, lambda ki: tiles.visible(qi, ki, kmax[ki]),
                                  step, init, unroll)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o = acc.reshape(b, hkv, g, bq, d) / l_safe[..., None]
        lse = jnp.where(seen, m + jnp.log(l_safe), NEG_INF)
        o = jnp.einsum("bkgqd->bqkgd", o).reshape(b, bq, h, d).astype(q.dtype)
        return n, (o, jnp.einsum("bkgq->bqkg", lse).reshape(b, bq, h))

    n, (o, lse) = _block_scan(q_block, jnp.int32(0), qb, nq, unroll)
    o = jnp.moveaxis(o, 0, 1).reshape(b, nq * bq, h, d)[:, :t]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, nq * bq, h)[:, :t]
    return o, lse, n


def _xla_backward(q, k, v, span_end, q_offset, tags, o, lse, do, dlse, cfg: FlashConfig):
    """FlashAttention-2 backward: per key block, loop over the query blocks that can see it,
    recompute p from the saved lse; dk, dv accumulate in the loop, dq in the scan carry.
    Returns (dq, dk, dv, tiles computed)."""
    b, t, h, d = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    bq, bk = cfg.block_q, cfg.block_k
    qb, kb, vb, se, kmax = _blocks(q, k, v, span_end, bq, bk)
    dob = _q_blocks(do, hkv, bq)
    tiles = _Tiles(span_end, q_offset, tags, t, bq, bk)
    nq, nk = qb.shape[0], kb.shape[0]
    tp = nq * bq
    scale = 1.0 / math.sqrt(d)
    # delta_i = rowsum(dO * O) - dlse_i: the lse cotangent enters as a shift of the same term
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse    # [B, T, H]

    def q_layout(x, fill=0.0):                                            # [B, T, H] -> [nq,B,Hkv,G,bq]
        x = _pad_to(x, 1, tp, fill).reshape(b, nq, bq, hkv, g)
        return jnp.einsum("bnqkg->nbkgq", x)

    lse_b = q_layout(lse, _PAD_LSE)
    delta_b = q_layout(delta)

    unroll = nq * nk <= cfg.unroll_tiles

    def k_block(carry, ki, xs):
        dq, n = carry
        kt, vt, se_t, kmax_t = xs                                         # kt, vt [B, Hkv, bk, D]
        k_start = ki * bk
        # first query block whose last row can reach this key block (rows >= k_start)
        lo = jnp.clip(jnp.min(k_start - q_offset) // bq, 0, nq)
        # rows at or past the block's largest span_end see none of its keys
        hi = jnp.clip(-(-jnp.max(kmax_t - q_offset) // bq), lo, nq)

        def step(qi, carry):
            dk, dv, dq, n = carry
            qt, dot = qb[qi], dob[qi]                                     # [B, Hkv, G*bq, D]
            mask = tiles.mask(qi, ki, se_t)[:, None, None]                # [B,1,1,bq,bk]
            s = jnp.einsum("bkmd,bksd->bkms", qt, kt, preferred_element_type=jnp.float32)
            s = s.reshape(b, hkv, g, bq, bk) * scale
            p = jnp.where(mask, jnp.exp(s - lse_b[qi][..., None]), 0.0)      # [B, Hkv, G, bq, bk]
            dp = jnp.einsum("bkmd,bksd->bkms", dot, vt, preferred_element_type=jnp.float32)
            ds = p * (dp.reshape(b, hkv, g, bq, bk) - delta_b[qi][..., None]) * scale
            p, ds = p.reshape(b, hkv, g * bq, bk), ds.reshape(b, hkv, g * bq, bk)
            dv = dv + jnp.einsum("bkms,bkmd->bksd", p.astype(do.dtype), dot,
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkms,bkmd->bksd", ds.astype(q.dtype), qt,
                                 preferred_element_type=jnp.float32)
            dq_t = jnp.einsum("bkms,bksd->bkmd", ds.astype(k.dtype), kt,
                              preferred_element_type=jnp.float32)
            return dk, dv, dq.at[qi].add(dq_t), n + 1

        zeros = jnp.zeros((b, hkv, bk, d), jnp.float32)
        first = k_start // bq if unroll and cfg.no_offset else 0     # with no offset: causal start
        dk, dv, dq, n = _tile_loop(lo, hi, nq, lambda qi: tiles.visible(qi, ki, kmax_t), step,
                                   (zeros, zeros, dq, n), unroll, first)
        return (dq, n), (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    (dq, n), (dk, dv) = _block_scan(k_block, (dq0, jnp.int32(0)), (kb, vb, se, kmax), nk, unroll)
    dq = dq.reshape(nq, b, hkv, g, bq, d).transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, h, d)[:, :t]   # [B,T,H,D]
    kv_out = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, hkv, d)[:, :s_len]  # noqa: E731
    return dq.astype(q.dtype), kv_out(dk).astype(k.dtype), kv_out(dv).astype(v.dtype), n


# ---------------------------------------------------------------------------------------------
# custom_vjp over the bodies
# ---------------------------------------------------------------------------------------------
def _body_forward(q, k, v, span_end, q_offset, tags, cfg: FlashConfig):
    if cfg.impl == "xla":
        return _xla_forward(q, k, v, span_end, q_offset, tags, cfg)[:2]
    from sprint_jax.kernels import flash_attention as kernel
    return kernel.flash_forward(q, k, v, span_end, q_offset, tags, platform=cfg.impl,
                                block_q=cfg.block_q, block_k=cfg.block_k, interpret=cfg.interpret)


def _body_backward(q, k, v, span_end, q_offset, tags, o, lse, do, dlse, cfg: FlashConfig):
    if cfg.impl == "xla":
        return _xla_backward(q, k, v, span_end, q_offset, tags, o, lse, do, dlse, cfg)[:3]
    from sprint_jax.kernels import flash_attention as kernel
    return kernel.flash_backward(q, k, v, span_end, q_offset, tags, o, lse, do, dlse,
                                 platform=cfg.impl, block_q=cfg.block_q, block_k=cfg.block_k,
                                 interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, span_end, q_offset, tags, cfg: FlashConfig):
    return _body_forward(q, k, v, span_end, q_offset, tags, cfg)


def _flash_fwd(q, k, v, span_end, q_offset, tags, cfg):
    o, lse = _body_forward(q, k, v, span_end, q_offset, tags, cfg)
    return (o, lse), (q, k, v, span_end, q_offset, tags, o, lse)


def _flash_bwd(cfg, res, cts):
    q, k, v, span_end, q_offset, tags, o, lse = res
    do, dlse = cts
    dq, dk, dv = _body_backward(q, k, v, span_end, q_offset, tags, o, lse, do,
                                dlse.astype(jnp.float32), cfg)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


LAYOUTS = (None, "flat", "trie", "merge")


def resolve_impl(impl: str | None, layout: str | None = None, *, splash_ok: bool = True,
                 backend: str | None = None) -> str:
    """The body that runs (module docstring). None -> per backend (default jax's): "splash" on
    TPU for layout "flat" when `splash_ok` (no lse, no q_offset, no merge tags), else Pallas
    ("gpu" / "tpu") on GPU / TPU and "xla" elsewhere. An explicit impl is kept ("splash" only where
    it is exact: layout "flat" and `splash_ok`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"flash attention layout must be one of {LAYOUTS}, got {layout!r}")
    flat = layout == "flat" and splash_ok
    if impl is None:
        backend = backend or jax.default_backend()
        if backend == "tpu" and flat:
            return "splash"
        return backend if backend in ("gpu", "tpu") else "xla"
    if impl not in ("xla", "gpu", "tpu", "splash"):
        raise ValueError(f"flash attention impl must be 'xla', 'gpu', 'tpu' or 'splash', got {impl!r}")
    if impl == "splash" and not flat:
        raise ValueError("impl='splash' needs layout='flat' (segment mask) and no lse, q_offset or "
                         f"stage / branch; got layout={layout!r}")
    return impl


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Pin an activation to the trainer's rules table (logical axis names, None = whole) under
    the active mesh (`jax.sharding.use_abstract_mesh` / `jax.set_mesh`); a no-op without one.

    Why: with FSDP the weights are sharded over the model width and the rows over (data, fsdp);
    left alone, GSPMD may keep the weights sharded and gather the *activations* of every row
    instead (measured: the 7B step at 8 x 2048 computed its MLP and logits on all 8 rows on every
    device). Pinning the rows keeps FSDP what it should be: gather weights, never rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec([a or "head_dim" for a in axes], x.shape, mesh)   # head_dim: whole
    manual = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}

    def auto(sp):               # inside a shard_map, the manual axes are already split by hand
        sp = (sp,) if isinstance(sp, str) else tuple(sp or ())
        sp = tuple(m for m in sp if m not in manual)
        return sp[0] if len(sp) == 1 else (sp or None)
    spec = P(*[None if a is None else auto(sp) for a, sp in zip(axes, spec)])
    return jax.lax.with_sharding_constraint(x, spec)


def _mesh_specs(mesh, q, k):
    """shard_map specs for a Pallas body under the rules table: rows over (data, fsdp) and heads
    over tensor, each only where the size divides (query and KV heads both, so that a shard's
    query heads use that shard's KV heads); everything else whole. An axis already manual (the
    call sits inside a shard_map over it, as the engine's slot-local programs over data) is
    left out: the arrays here are that axis's shard already."""
    manual = set(getattr(mesh, "manual_axes", ()))

    def axes(rule, size):
        names = (rule,) if isinstance(rule, str) else tuple(rule or ())
        names = tuple(n for n in names if n in mesh.shape and mesh.shape[n] > 1 and n not in manual)
        n = math.prod(mesh.shape[a] for a in names) if names else 1
        return (names if len(names) > 1 else (names[0] if names else None)) if size % n == 0 else None

    bax = axes(RULES["batch"], q.shape[0])
    hax = axes(RULES["heads"], q.shape[2])
    if axes(RULES["kv_heads"], k.shape[2]) != hax:
        hax = None
    return (P(bax, None, hax, None), P(bax, None, hax, None), P(bax, None), P(bax), P(bax, None, hax),
            P(bax, None, None))


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, span_end: jax.Array, *,
                    stage: jax.Array | None = None, branch: jax.Array | None = None,
                    q_offset: jax.Array | int | None = None, impl: str | None = None,
                    block_q: int | None = None, block_k: int | None = None,
                    interpret: bool = False, return_lse: bool = False, layout: str | None = None):
    """Blockwise attention under the span rule, with a recomputing backward (custom_vjp).

    q [B, T, H, D]; k, v [B, S, Hkv, D] (H % Hkv == 0; query head h uses KV head h // (H/Hkv));
    span_end [B, S] int: query t of row b (rule row i = q_offset[b] + t) sees key j iff
    j <= i < span_end[b, j]. q_offset: int or [B] (default 0: the queries are the keys).
    stage, branch [B, S] int (both or neither): the merge form, which also requires
    `merge_visible` of rows i and j (module docstring); a query row's own (stage, branch) is the
    key entry at its row i.
    Returns out [B, T, H, D] in q's dtype (0 for a row that sees no key) and with return_lse
    also lse [B, T, H] (natural log, fp32; NEG_INF for such a row). Softmax scale 1/sqrt(D).
    Gradients flow to q, k, v (and through lse); span_end and q_offset are integers.

    impl: "xla" (blockwise jnp), "gpu" (Pallas Triton), "tpu" (Pallas Mosaic) or "splash" (jax's
    TPU splash attention, flat layout only); default by jax.default_backend() (`resolve_impl`).
    layout: "flat" promises span_end is the flat layout's (contiguous segments, span_end[j] = end
    of j's segment > j), which lets TPU run splash; None / "trie" / "merge": the general rule.
    block_q / block_k: tile sizes (splash: block_q is its one block, a multiple of 128).
    interpret=True runs a Pallas body in the interpreter (CPU tests).
    Under an active mesh (`jax.set_mesh`) a Pallas body runs per shard (shard_map): batch over
    (data, fsdp), heads over tensor, per the trainer's rules table.
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, T, H, D] and k, v both [B, S, Hkv, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    b, t, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"k/v {k.shape} do not fit q {q.shape} (batch, head dim, H % Hkv)")
    if span_end.shape != (b, k.shape[1]):
        raise ValueError(f"span_end must be [B, S] = {(b, k.shape[1])}, got {span_end.shape}")
    tags = None if stage is None and branch is None else _tags(stage, branch, span_end.shape)
    impl = resolve_impl(impl, layout, splash_ok=tags is None and q_offset is None and not return_lse
                        and t == k.shape[1])
    mesh = jax.sharding.get_abstract_mesh()
    if impl == "splash":
        from sprint_jax.kernels.splash import splash_attention
        run_s = functools.partial(splash_attention, block=block_q, interpret=interpret)
        if not mesh.empty:
            qs, ks, ss, *_ = _mesh_specs(mesh, q, k)
            run_s = jax.shard_map(run_s, mesh=mesh, in_specs=(qs, ks, ks, ss), out_specs=qs,
                                  check_vma=False)
        return run_s(q, k, v, span_end.astype(jnp.int32))
    dq_, dk_ = default_blocks(impl, t, k.shape[1], d, q.dtype)
    cfg = FlashConfig(impl, block_q or dq_, block_k or dk_, interpret, no_offset=q_offset is None)
    off = jnp.zeros((b,), jnp.int32) if q_offset is None else \
        jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32).reshape(-1), (b,))
    span_end = span_end.astype(jnp.int32)
    run = lambda *a: _flash(*a, cfg)  # noqa: E731
    if impl != "xla" and not mesh.empty:
        qs, ks, ss, os_, ls, ts = _mesh_specs(mesh, q, k)
        run = jax.shard_map(lambda *a: _flash(*a, cfg), mesh=mesh,
                            in_specs=(qs, ks, ks, ss, os_, None if tags is None else ts),
                            out_specs=(qs, ls), check_vma=False)
    o, lse = run(q, k, v, span_end, off, tags)
    return (o, lse) if return_lse else o
