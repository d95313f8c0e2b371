"""What the Pallas kernels and the model's attention share: the dense reference attention and the
merge rule with its per-block tile summaries.

Dense reference. `attend_partial(q, k, v, mask)` is grouped-query attention over one block of keys
with an explicit [B, T, S] mask, returning the output and its log-sum-exp; `merge_partials` merges
partial attentions over disjoint key blocks exactly by log-sum-exp (Hydragen's decomposition; the
engine's shared-prefix decode and the prefix kernels' references use both). It materialises the
[T, S] scores: it is the reference every kernel is tested against.

The merge rule (the merge layout's (stage, branch) factor, `sprint_jax.model.attention` states it
in full): `merge_visible` is the rule elementwise; `query_summary` / `key_summary` /
`merge_summaries` bound a whole (query block, key block) tile and `merge_tile_visible` says
whether it can hold a visible pair, so the XLA body and the Pallas bodies skip the same tiles.

Here, below the model, so that the kernels import nothing of the package above them;
`sprint_jax.model.attention` re-exports every name.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

NEG_INF = -1e30


# ---------------------------------------------------------------------------------------------
# Dense reference
# ---------------------------------------------------------------------------------------------
def attend_partial(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
    """Grouped-query attention over one block of keys, returning (output, log-sum-exp).

    q [B, T, H, D]; k, v [B, S, Hkv, D]; mask [B, T, S] (True = may attend).
    Returns out [B, T, H, D] (normalised within this block, in q's dtype) and lse [B, T, H]
    (natural log, fp32). Rows with no visible key give out = 0 and lse = -inf-ish, so they
    vanish when merged with `merge_partials`.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    p, lse = _block_softmax(s, mask, d)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype), lse


def _block_softmax(s: jax.Array, mask: jax.Array, d: int):
    """Scores s [B, K, G, T, S] (fp32, unscaled) of one key block under mask [B, T, S] -> (the
    probabilities normalised within the block, masked keys 0, and lse [B, T, K*G]; a row with no
    visible key: probabilities 0, lse NEG_INF)."""
    b, k, g, t, _ = s.shape
    s = s / jnp.sqrt(jnp.float32(d))
    s = jnp.where(mask[:, None, None, :, :], s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)                                   # [B, K, G, T, 1]
    p = jnp.exp(s - m)
    p = jnp.where(mask[:, None, None, :, :], p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(safe[..., 0]), NEG_INF)  # [B, K, G, T]
    return p / safe, jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, k * g)


def attend_partial_heads(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
    """`attend_partial` with keys and values heads-first: k, v [B, Hkv, S, D] (the batched engine's
    slot cache layout, sprint_jax/bench/slot_cache.py), so that neither einsum needs K or V transposed
    (each (b, kv head) is one [S, D] matrix). q [B, T, H, D]; mask [B, T, S]; returns the same
    (out [B, T, H, D], lse [B, T, H])."""
    b, t, h, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    p, lse = _block_softmax(s, mask, d)
    # P [.., T, S] x V [.., S, D] in the dot's own output order [B, K, G, T, D], then the (small)
    # output moved to [B, T, K, G, D]: asking the einsum for "btkgd" directly let XLA CPU compute
    # V^T P^T with V's contracting axis major, a plain dot instead of its YNNPACK matmul
    o = jnp.einsum("bkgts,bksd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = jnp.transpose(o, (0, 3, 1, 2, 4))
    return o.reshape(b, t, h, d).astype(q.dtype), lse


def merge_partials(parts: Sequence[tuple[jax.Array, jax.Array]]):
    """Merge attention outputs over disjoint key blocks by their log-sum-exps (exact)."""
    lses = jnp.stack([l for _, l in parts])                                   # [P, B, T, H]
    m = jnp.max(lses, axis=0)
    w = jnp.exp(lses - m)                                                     # [P, B, T, H]
    tot = jnp.sum(w, axis=0)
    out = sum(o.astype(jnp.float32) * (wi / tot)[..., None] for (o, _), wi in zip(parts, w))
    return out.astype(parts[0][0].dtype), m + jnp.log(tot)


# ---------------------------------------------------------------------------------------------
# The merge rule and its tile summaries
# ---------------------------------------------------------------------------------------------
def merge_visible(stage_q, branch_q, stage_k, branch_k):
    """The merge factor of the rule, elementwise (broadcasting): query (stage_q, branch_q) may see
    key (stage_k, branch_k) iff the key is planner text, of an earlier stage, or of the same branch."""
    return (branch_k == 0) | (stage_k < stage_q) | ((stage_k == stage_q) & (branch_k == branch_q))


def query_tags(tags: jax.Array, num_queries: int, q_offset: jax.Array) -> jax.Array:
    """[B, 2, S] key (stage, branch) -> [B, 2, T] of the query rows q_offset + t (clipped to S)."""
    s = tags.shape[2]
    rows = jnp.clip(q_offset.reshape(-1, 1) + jnp.arange(num_queries, dtype=jnp.int32)[None], 0, s - 1)
    return jnp.take_along_axis(tags, rows[:, None, :], axis=2)


_BIG = 2 ** 31 - 1
_CODE_STAGES = 2 ** 15 - 1          # codes = stage * 2^16 + branch fit int32; larger values are
_CODE_BRANCHES = 2 ** 16 - 1        # clipped, which only widens ranges (still a safe bound)


def _exec_code(stage, branch):
    return jnp.clip(stage, 0, _CODE_STAGES) * (_CODE_BRANCHES + 1) + jnp.clip(branch, 1, _CODE_BRANCHES)


def query_summary(stage, branch):
    """Merge summary of query rows (last axis): (largest stage, lowest and highest executor code)."""
    ex = branch != 0
    code = _exec_code(stage, branch)
    return (jnp.max(stage, axis=-1), jnp.min(jnp.where(ex, code, _BIG), axis=-1),
            jnp.max(jnp.where(ex, code, -1), axis=-1))


def key_summary(stage, branch, valid):
    """Merge summary of keys (last axis) over those some row may see (`valid`): (any planner key
    as 0/1, smallest executor stage, lowest and highest executor code)."""
    ex = valid & (branch != 0)
    code = _exec_code(stage, branch)
    return (jnp.max((valid & (branch == 0)).astype(jnp.int32), axis=-1),
            jnp.min(jnp.where(ex, stage, _BIG), axis=-1), jnp.min(jnp.where(ex, code, _BIG), axis=-1),
            jnp.max(jnp.where(ex, code, -1), axis=-1))


def merge_tile_visible(qsum, ksum):
    """Can a tile with these summaries (see the module docstring) hold a merge-visible pair?"""
    qmax, qlo, qhi = qsum
    plan, kmin, klo, khi = ksum
    return (plan > 0) | (kmin < qmax) | ((klo <= qhi) & (qlo <= khi))


def merge_summaries(q_tags, k_tags, span_end, bq: int, bk: int):
    """Per-block summaries: q_tags [B, 2, Tp] (padded rows: stage INT_MIN, branch 0), k_tags
    [B, 2, Sp], span_end [B, Sp] (padded keys 0) -> qsum: 3 x [B, nq], ksum: 4 x [B, nk]."""
    b, _, tp = q_tags.shape
    sp = k_tags.shape[2]
    qsum = query_summary(q_tags[:, 0].reshape(b, tp // bq, bq), q_tags[:, 1].reshape(b, tp // bq, bq))
    valid = (span_end > jnp.arange(sp, dtype=jnp.int32)[None]).reshape(b, sp // bk, bk)
    ksum = key_summary(k_tags[:, 0].reshape(b, sp // bk, bk), k_tags[:, 1].reshape(b, sp // bk, bk), valid)
    return qsum, ksum


def pad_query_tags(q_tags, tp: int):
    """Pad [B, 2, T] query tags to Tp rows that no summary counts (stage INT_MIN, branch 0)."""
    t = q_tags.shape[2]
    if t == tp:
        return q_tags
    pad = jnp.broadcast_to(jnp.asarray([-_BIG - 1, 0], jnp.int32)[None, :, None],
                           (q_tags.shape[0], 2, tp - t))
    return jnp.concatenate([q_tags, pad], axis=2)
