"""The batched engine: a two-level slot cache and a scheduler that decodes many sequences per step
(docs/design.md "The engine").

Cache. `SlotCache` holds P parent slots (a planner, a prompt; capacity max_seq_len) and, for each
parent slot, G child slots (an executor, one of n samples; capacity max_branch_tokens). Child slot
g of parent p is row p*G + g of the child arrays. A child reads its parent's KV up to the fork
point plus its own suffix; the prefix is never copied. While a parent has live children it is
read-only (one operation per sequence at a time), so all its children share one fork point.

Step. One decode step runs every active row: the rows are grouped by parent slot, [parent row,
child rows...], and one attention over the parent's cache serves the whole group (the children's
queries ride along the query axis, so each parent's prefix is read once per step for all its
children); the children then attend to their own suffixes, every row to its new token, and the
partial attentions merge by log-sum-exp (Hydragen). Attention reads only the used length of the
cache (bucketed: a gather of the first S_b slots of the group's rows), never the capacity. The
layer scan carries no cache: each layer returns this step's new K/V (a few rows), and the whole
step's K/V is scattered into the donated cache after the scan, in place (no per-step copy of the
cache; tests/test_batch_engine.py checks the compiled HLO).

Scheduler. Requests are operations on sequences: open (prefill a prompt into a parent slot;
queued while every slot is taken), extend (prefill more tokens), generate (decode on the parent),
fork (k children with forced prefixes, decoded together), close (free the slot). Each
`BatchEngine.step()` admits queued opens, runs one prefill chunk for every sequence that has
tokens to prefill (one call for parents, one for children) and `decode_chunk` decode steps for
every decoding row (one call), then checks stops on the host (`StopScanner`, incremental) and
finishes rows. Sampling per row is the single-run engine's: key fold_in(fold_in(key(seed), j),
step), j = the branch index, step = tokens this request generated so far, so a request gives the
same tokens here as alone on `Engine`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from collections import deque
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer import sharding as sh
from sprint_jax.infer.engine import (EngineError, Generation, check_merge_branches, checked_sampling,
                                     common_prefix, decode_tokens)
from sprint_jax.infer.prefix_attention import pallas_parent_prefix_attention
from sprint_jax.infer.sampling import GREEDY, Sampling, advance_rows, mask_padded, sample_tokens, valid_vocab
from sprint_jax.infer.stops import StopScanner
from sprint_jax.model.attention import attend_partial_heads, flash_attention
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import (UNROLL_MAX_LAYERS, attend_partial, decoder, dtype_of, embed, merge_partials,
                                    per_layer, unembed)

STOP_WIDTH = 8    # device-checked stop ids per row (EOS ids first, then one-token stop strings)


def _bucket(n: int, lo: int) -> int:
    """The smallest lo * 2^k >= n (few shapes compile)."""
    b = lo
    while b < n:
        b *= 2
    return b


def _bucket_fine(n: int, lo: int) -> int:
    """The smallest of lo * 2^k and 1.5 * lo * 2^k >= n: prefill lengths (padding <= 1/3)."""
    b = lo
    while b < n:
        if b * 3 // 2 >= n and (b * 3) % 2 == 0:
            return b * 3 // 2
        b *= 2
    return b


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotCache:
    """Parent slots pk, pv [L, P, Hkv, Sp, D]; child slots ck, cv [L, P*G, Hkv, Sc, D].

    Heads before positions: a slot's keys of one KV head are one contiguous [S, D] block, so the
    decode step gathers a row's used slots as a whole [Hkv, S_b, D] slice (`_gather_rows`) and its
    attention (`attend_partial_heads`) multiplies them as they are: no transposed copy of the
    gathered K / V per step (the [.., S, Hkv, D] layout needed one, fused with the gather: a large
    part of a many-row step of the demo model on CPU; README, "The batched engine"). Prefill still
    transposes the rows it gathers for `flash_attention` (`_prefix_partial`); prefill calls are few."""
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


def _constrain(cache: SlotCache, kv) -> SlotCache:
    """The cache pinned to its (parent, child) NamedShardings on a mesh (kv=None: one device)."""
    if kv is None:
        return cache
    p, c = kv
    wsc = jax.lax.with_sharding_constraint
    return SlotCache(wsc(cache.pk, p), wsc(cache.pv, p), wsc(cache.ck, c), wsc(cache.cv, c))


def _gather_rows(cache: jax.Array, layer, rows: jax.Array, size: int) -> jax.Array:
    """cache [L, N, Hkv, C, D] -> the first `size` slots of `rows` at `layer`: [R, Hkv, size, D].
    Each row is one whole [1, 1, Hkv, size, D] slice (a vmapped dynamic_slice: one gather whose
    slices keep the cache's layout; nothing is transposed)."""
    def take(c):
        shape = (1, 1, c.shape[2], size, c.shape[4])
        zero = jnp.zeros((), jnp.int32)
        return jax.vmap(lambda r: jax.lax.dynamic_slice(
            c, (jnp.asarray(layer, jnp.int32), r.astype(jnp.int32), zero, zero, zero), shape)[0, 0])(rows)
    return _as_bits(cache, take)


def _as_bits(cache: jax.Array, fn) -> jax.Array:
    """fn(cache), run on the cache's uint16 bits on CPU (`_on_bits`); fn only moves elements."""
    if not _on_bits(cache):
        return fn(cache)
    bits = jax.lax.bitcast_convert_type
    return bits(fn(bits(cache, jnp.uint16)), cache.dtype)


def _take(cache: jax.Array, index) -> jax.Array:
    """cache[index] (as bits on CPU: `_on_bits`)."""
    return _as_bits(cache, lambda c: c[index])


def _on_bits(cache: jax.Array) -> bool:
    """XLA CPU has no bf16 gather / scatter: it widens the whole operand to f32 and, the cache being
    loop-invariant in the layer scan, hoists that copy out: a full f32 copy of the cache per decode
    step (qwen3-0.6b, 2.7 GiB bf16 cache: temporaries 6.9 GiB, 3.7 as bits; 7B at tensor=4: 8.9 ->
    7.4 GiB). On CPU a 16-bit cache is gathered and scattered as uint16 bits (GPU/TPU: as is)."""
    return cache.dtype.itemsize == 2 and jax.default_backend() == "cpu"


def _put(cache: jax.Array, index, new: jax.Array) -> jax.Array:
    """cache.at[index].set(new, mode="drop") (as bits on CPU: `_on_bits`)."""
    new = new.astype(cache.dtype)
    if not _on_bits(cache):
        return cache.at[index].set(new, mode="drop")
    bits = jax.lax.bitcast_convert_type
    return bits(bits(cache, jnp.uint16).at[index].set(bits(new, jnp.uint16), mode="drop"), cache.dtype)


def _put_slots(cache: jax.Array, slot: jax.Array, pos: jax.Array, new: jax.Array) -> jax.Array:
    """Write new K or V into the cache [L, N, Hkv, C, D] in place (`_put`): new [L, R, T, Hkv, D] at
    slot[r], positions pos[r, t] (prefill), or new [L, R, Hkv, D] at slot[r], position pos[r]
    (a decode step); out-of-range positions are dropped (padding)."""
    if new.ndim == 5:             # index (:, slot[R, 1], :, pos[R, T]): the update is [R, T, L, Hkv, D]
        return _put(cache, (slice(None), slot[:, None], slice(None), pos), jnp.transpose(new, (1, 2, 0, 3, 4)))
    return _put(cache, (slice(None), slot, slice(None), pos), jnp.swapaxes(new, 0, 1))    # [R, L, Hkv, D]


def _self_partial(q, k, v):
    """Each decode row's attention to its own new token (one query, one key: no mask)."""
    return attend_partial(q, k, v, jnp.ones(q.shape[:2] + k.shape[1:2], bool))


def _self_flash(q, k, v, n_valid):
    """A prefill chunk's attention to its own new keys (causal; only the first n_valid): the
    blockwise flash attention (model/attention.py) under the span rule, with lse for merging."""
    span_end = jnp.where(jnp.arange(q.shape[1])[None] < n_valid[:, None], jnp.int32(_NEVER), 0)
    return flash_attention(q, k, v, span_end, return_lse=True)


def _prefix_partial(q, k, v, n):
    """Each row's attention to the first n[r] of keys k, v [R, Hkv, S, D] (`_gather_rows`) that all
    precede its queries (a parent prefix, a child's own past): flash attention with the queries
    placed after the keys (q_offset = n), keys from n on never visible. (flash_attention takes
    [R, S, Hkv, D]: a prefill chunk transposes the rows it gathered; prefill calls are few.)"""
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    span_end = jnp.where(jnp.arange(k.shape[1])[None] < n[:, None], jnp.int32(_NEVER), 0)
    return flash_attention(q, k, v, span_end, q_offset=n, return_lse=True)


_NEVER = 1 << 30        # a span_end no query row reaches


# ---------------------------------------------------------------------------------------------
# Prefill: tokens [R, T] appended to R parent slots, or to R child slots (forced prefixes)
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("config", "kind", "s_b", "c_b", "kv", "return_logits", "all_logits"),
                   donate_argnames=("cache",))
@sh.slot_local(rows=("tokens", "slot", "parent", "fork_len", "start", "n_valid", "pos_off"),
               out=lambda a: ("cache", "rows") if a["return_logits"] else "cache", cache_kv=(0, 0, 1, 1))
def _prefill(params, config: Qwen2Config, cache: SlotCache, tokens, slot, parent, fork_len, start, n_valid,
             kind: str, s_b: int, c_b: int, kv=None, pos_off=None, return_logits: bool = False,
             all_logits: bool = False):
    """kind "parent": rows are parent slots `slot`, tokens written at start..start+n_valid.
    kind "child": rows are child slots `slot` of parent slots `parent`; they see the parent's
    first fork_len slots and their own first `start` slots; positions are fork_len + start + t.
    Slot ids are global; taken modulo the slots this call holds (all, or its shard's: slot_local).
    pos_off [R]: the (parent) sequence's slot-to-position shift after a merge join (Seq; None: 0).
    return_logits: also each row's logits at its last valid token [R, V] (a merge join's last);
    with all_logits, at every token [R, T, V] (teacher forcing: `forced_logits`, `fork_logits`)."""
    r, t = tokens.shape
    slot = slot % (cache.pk if kind == "parent" else cache.ck).shape[1]
    parent = parent % cache.pk.shape[1]
    offs = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]                  # [R, T]
    positions = offs if kind == "parent" else offs + fork_len[:, None]
    if pos_off is not None:
        positions = positions + pos_off[:, None]
    plen = start if kind == "parent" else fork_len

    def attend(q, k, v, layer):
        prow = slot if kind == "parent" else parent
        parts = [_prefix_partial(q, _gather_rows(cache.pk, layer, prow, s_b),
                                 _gather_rows(cache.pv, layer, prow, s_b), plen)]
        if kind == "child":
            parts.append(_prefix_partial(q, _gather_rows(cache.ck, layer, slot, c_b),
                                         _gather_rows(cache.cv, layer, slot, c_b), start))
        parts.append(_self_flash(q, k, v, n_valid))
        return merge_partials(parts)[0], (k, v)

    x = embed(params, config, tokens)
    hidden, (nk, nv) = decoder(params, config, x, positions, attend, jnp.arange(config.num_hidden_layers))
    pos = jnp.where(jnp.arange(t)[None] < n_valid[:, None], offs, 1 << 30)       # padding: dropped
    if kind == "parent":
        pk = _put_slots(cache.pk, slot, pos, nk)
        pv = _put_slots(cache.pv, slot, pos, nv)
        out = _constrain(SlotCache(pk, pv, cache.ck, cache.cv), kv)
    else:
        ck = _put_slots(cache.ck, slot, pos, nk)
        cv = _put_slots(cache.cv, slot, pos, nv)
        out = _constrain(SlotCache(cache.pk, cache.pv, ck, cv), kv)
    if not return_logits:
        return out
    if all_logits:
        return out, unembed(params, config, hidden)
    last = jnp.take_along_axis(hidden, jnp.clip(n_valid - 1, 0, t - 1)[:, None, None], axis=1)
    return out, unembed(params, config, last)[:, 0]


@functools.partial(jax.jit, static_argnames=("w", "kv"), donate_argnames=("cache",))
@sh.slot_local(rows=("meta",), out="cache", cache_kv=(0, 0, 1, 1))
def _copy_join(cache: SlotCache, meta, w: int, kv=None) -> SlotCache:
    """A merge join's copy: each child's slot rows into its parent's slot after the prefix, in
    child order, without running the model. meta [1, 2 + 2G] per slot shard (`BatchEngine._join_meta`;
    one row without shards): (parent slot, fork slot p0, then per child j (off_j, len_j)), off_j =
    len_0 + .. + len_{j-1}; len_j = 0: no child j (a shard that does not hold the sequence has
    none). Child j's slot t goes to parent slot p0 + off_j + t: slots 0..len_0 of child 0 (slot 0:
    the parent's pending token, run in every child) and 1..len_j of the others. One window of
    w >= max(len_j) + 1 slots per child, read and written whole (dynamic_slice / update_slice: XLA
    CPU runs the equivalent gather/scatter of single rows about 3x slower), its rows outside the
    child's kept as they were, so no slot outside the join is written. A window that would pass
    the parent's capacity is placed earlier, the child's rows shifted in it."""
    m = meta[0]
    slot, p0 = m[0], m[1]
    n_par, n_ch, cap = cache.pk.shape[1], cache.ck.shape[1], cache.pk.shape[3]
    layers, _, heads, _, dim = cache.pk.shape
    size = (layers, 1, heads, w, dim)
    ps = slot % n_par                                  # slot ids are global (see sh.slot_local)
    i = jnp.arange(w, dtype=jnp.int32)
    pk, pv = cache.pk, cache.pv
    for j in range((m.shape[0] - 2) // 2):
        off, n = m[2 + 2 * j], m[3 + 2 * j]
        at = jnp.clip(p0 + off, 0, cap - w)            # the window's first parent slot
        d = p0 + off - at                              # > 0 only at the end of the parent's capacity
        t = i - d                                      # the child slot each window row takes
        keep = ((t >= (0 if j == 0 else 1)) & (t <= n) & (n > 0))[None, None, None, :, None]
        crow = (slot * (n_ch // n_par) + j) % n_ch
        new = []
        for par, child in ((pk, cache.ck), (pv, cache.cv)):
            rows = jax.lax.dynamic_slice(child, (0, crow, 0, 0, 0), size)
            rows = jax.lax.dynamic_slice(jnp.concatenate([jnp.zeros_like(rows), rows], axis=3), (0, 0, 0, w - d, 0),
                                         size)         # row r: child slot r - d
            old = jax.lax.dynamic_slice(par, (0, ps, 0, at, 0), size)
            new.append(jax.lax.dynamic_update_slice(par, jnp.where(keep, rows, old), (0, ps, 0, at, 0)))
        pk, pv = new
    return _constrain(SlotCache(pk, pv, cache.ck, cache.cv), kv)


_PREFILL_ROWS = inspect.unwrap(_prefill)            # the bodies, for steps fused into one call
_COPY_JOIN = inspect.unwrap(_copy_join)


@functools.partial(jax.jit, static_argnames=("config", "s_b", "c_b", "w", "kv"), donate_argnames=("cache",))
@sh.slot_local(rows=("tokens", "slot", "parent", "fork_len", "start", "n_valid", "pos_off", "meta"),
               out=("cache", "rows"), cache_kv=(0, 0, 1, 1))
def _merge(params, config: Qwen2Config, cache: SlotCache, tokens, slot, parent, fork_len, start, n_valid, pos_off,
           meta, s_b: int, c_b: int, w: int, kv=None):
    """A merge join in one call: the children's never-computed tail tokens (a child `_prefill`
    with logits, rows [R]) then the copy of the children's rows into the parent slot
    (`_copy_join`'s body, meta [1, 2 + 2G] per slot shard). Returns (cache, logits [R, V] at each
    row's last tail token)."""
    cache, logits = _PREFILL_ROWS(params, config, cache, tokens, slot, parent, fork_len, start, n_valid,
                                  kind="child", s_b=s_b, c_b=c_b, kv=kv, pos_off=pos_off, return_logits=True)
    return _COPY_JOIN(cache, meta, w=w, kv=kv), logits


# ---------------------------------------------------------------------------------------------
# Decode: `chunk` steps for the active rows only, on device
# ---------------------------------------------------------------------------------------------
def _sample_rows(logits, base, steps, temperature, top_k, top_p):
    """Per-row sampling (temperature 0 = argmax); the sorting path, and the per-step keys
    fold_in(base, steps), run only when a row samples."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        keys = jax.vmap(jax.random.fold_in)(base, steps)
        tok = jax.vmap(lambda lg, k, t, tk, tp: sample_tokens(lg[None], k[None], t, tk, tp, False)[0])(
            logits, keys, temperature, top_k, top_p)
        return jnp.where(temperature > 0, tok, greedy)
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)


def parent_prefix_attention(pk: jax.Array, pv: jax.Array, layer, pslot: jax.Array, q: jax.Array,
                            plen: jax.Array, s_b: int, attention_impl: str = "xla", kv=None):
    """The shared-prefix attention of a step: group i's W queries q[i] [G, W, H, D] attend to the
    first plen[i, w] slots of parent slot pslot[i] (pk, pv [L, P, Hkv, Sp, D]). Each parent's
    prefix is read once for all W queries of its group (they ride on the query axis), never
    once per query. Returns (out [G, W, H, D], lse [G, W, H]) for `merge_partials`.
    This is the one place the many-parents Pallas kernel replaces (kernels/): attention_impl
    "pallas" runs `prefix_attention.pallas_parent_prefix_attention` (one call for all groups, each
    prefix read in place, never gathered; per shard over `kv`'s mesh when given)."""
    if attention_impl == "pallas":
        return pallas_parent_prefix_attention(q, pk, pv, layer, pslot, plen, kv)
    mask = jnp.arange(s_b)[None, None, :] < plen[:, :, None]                        # [G, W, S_b]
    return attend_partial_heads(q, _gather_rows(pk, layer, pslot, s_b), _gather_rows(pv, layer, pslot, s_b), mask)


# A decode call's per-row arguments travel as two host arrays, not fifteen: every numpy argument
# of a jitted call is a host-to-device transfer of its own at dispatch (~5-10 us each on CPU, a
# copy per array on an accelerator), paid once per decode call. `ints` [B, ROW_INT_COLS +
# STOP_WIDTH + forced width]: the ROW_INTS columns, then the row's stop ids, then its forced tokens;
# `floats` [B, 2]: ROW_FLOATS. `decode_rows` allocates them, `_decode` unpacks them on device.
ROW_INTS = ("lengths", "pending", "active", "remaining", "seeds", "branch", "steps", "top_k", "n_forced",
            "pos_off", "feed_last")
ROW_FLOATS = ("temperature", "top_p")
ROW_INT_COLS = len(ROW_INTS)


def decode_rows(b: int, forced_width: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(ints, floats, views): a decode call's packed row arrays for b rows, at their neutral values
    (inactive, budget 1, no stop ids, greedy, top_p 1), and a writable numpy view per field name
    (ROW_INTS, ROW_FLOATS, "stop_ids" [B, STOP_WIDTH], "forced" [B, forced_width])."""
    ints = np.zeros((b, ROW_INT_COLS + STOP_WIDTH + forced_width), np.int32)
    floats = np.zeros((b, len(ROW_FLOATS)), np.float32)
    views = {name: ints[:, i] for i, name in enumerate(ROW_INTS)}
    views.update({name: floats[:, i] for i, name in enumerate(ROW_FLOATS)})
    views["stop_ids"] = ints[:, ROW_INT_COLS: ROW_INT_COLS + STOP_WIDTH]
    views["forced"] = ints[:, ROW_INT_COLS + STOP_WIDTH:]
    views["remaining"][:] = 1
    views["stop_ids"][:] = -2
    views["top_p"][:] = 1.0
    return ints, floats, views


@functools.partial(jax.jit, static_argnames=("config", "w", "chunk", "s_b", "c_b", "kv", "attention_impl",
                                    "n_valid", "feeding", "join_w"),
                   donate_argnames=("cache",))
@sh.slot_local(rows=("a_slot", "b_pslot", "b_fork", "b_cslot", "ints", "floats", "join_meta"),
               out=lambda a: ("cache", "rows", "rows", "max") + ("rows",) * bool(a["feeding"]),
               cache_kv=(0, 0, 1, 1))
def _decode(params, config: Qwen2Config, cache: SlotCache, a_slot, b_pslot, b_fork, b_cslot, ints, floats,
            w: int, chunk: int, s_b: int, c_b: int, kv=None, attention_impl: str = "xla",
            n_valid: int | None = None, feeding: bool = False, join_meta=None, join_w: int = 1):
    """`decode_step` on the packed row arrays (`decode_rows`): the one jitted decode call.
    feeding: the rows' feed_last column is on (a merge join follows; see decode_step)."""
    col = {name: ints[:, i] for i, name in enumerate(ROW_INTS)}
    return decode_step(
        params, config, cache, a_slot, b_pslot, b_fork, b_cslot, col["lengths"], col["pending"],
        col["active"] > 0, col["remaining"], ints[:, ROW_INT_COLS: ROW_INT_COLS + STOP_WIDTH], col["seeds"],
        col["branch"], col["steps"], floats[:, 0], col["top_k"], floats[:, 1], ints[:, ROW_INT_COLS + STOP_WIDTH:],
        col["n_forced"], w=w, chunk=chunk, s_b=s_b, c_b=c_b, kv=kv, attention_impl=attention_impl,
        n_valid=n_valid, pos_off=col["pos_off"], feed_last=(col["feed_last"] > 0) if feeding else None,
        join_meta=join_meta, join_w=join_w)


def decode_step(params, config: Qwen2Config, cache: SlotCache, a_slot, b_pslot, b_fork, b_cslot, lengths, pending,
                active, remaining, stop_ids, seeds, branch, steps, temperature, top_k, top_p, forced, n_forced,
                w: int, chunk: int, s_b: int, c_b: int, kv=None, attention_impl: str = "xla",
                n_valid: int | None = None, pos_off=None, feed_last=None, join_meta=None, join_w: int = 1):
    """The active rows, packed: rows [0, A) decode on parent slots a_slot (a generate op: the row
    attends to its own parent slot); rows [A, A + F*w) are fork children, F groups of w rows,
    group i's children of parent slot b_pslot[i] (read-only, fork point b_fork[i]) in child
    slots b_cslot. No row is computed for a read-only parent or an absent child beyond the
    bucket padding. lengths = KV entries of the row's own slot (parent slot or child suffix).
    forced [B, F], n_forced [B]: tokens a row takes before it samples (a child's forced prefix, a
    sequence's short extend): step k < n_forced writes the pending token's KV and makes forced[k]
    pending; it emits nothing and is not one of the row's generated steps (its sampling key,
    budget and stops start after them), as if the tokens had been prefilled; nor does it count
    against `chunk` (a row runs up to n_forced + chunk steps per call), so a prompt or an
    opening that rides a decode chunk costs no extra host round trip.
    Under slot shards (data > 1, `sh.slot_local`) every row argument is `parts` equal blocks and
    this body sees one block: its A/parts generate rows, then its F/parts fork groups
    (`BatchEngine._decode` lays them out so); slot ids are global, taken modulo this call's slots.
    pos_off [B] (None: 0): the row's sequence's slot-to-position shift after a merge join (Seq).
    attention_impl: the parent-prefix attention's ("xla" gather or "pallas" kernel).
    feed_last [B] bool (None: off): a row that finishes on device (stop id, EOS, length) runs one
    more step that only feeds its last token: its KV is written and its logits (before the padded
    ids are masked) are kept; the token that step samples is dropped. A merge join's children
    so hold their close tag's KV, and the last one its join logits, with nothing left
    to run at the join. The feed step may run past the row's steps (one step, nothing emitted).
    join_meta [1, 2 + 2G] per slot shard (None: off), join_w: a merge join's copy (`_copy_join`'s
    meta and window) run before the first step, under a cond (no child length: nothing runs, and
    the cache is not copied): the join costs no call of its own.
    Returns the cache, the emitted tokens [B, chunk + F] (-1 = none), per-row reason codes
    (1 stop id / EOS, 2 length), the steps run, and with feed_last the kept logits [B, V] (a row's
    logits after its fed last token; zeros where no row was fed)."""
    if join_meta is not None:
        cache = jax.lax.cond(jnp.any(join_meta[0, 3::2] > 0), lambda c: _COPY_JOIN(c, join_meta, w=join_w),
                             lambda c: c, cache)
    na, nf = a_slot.shape[0], b_pslot.shape[0]
    b = na + nf * w
    a_slot = a_slot % cache.pk.shape[1]            # global slot ids -> this call's (see _prefill)
    b_pslot = b_pslot % cache.pk.shape[1]
    b_cslot = b_cslot % cache.ck.shape[1]
    n_layers = config.num_hidden_layers
    fork_of_row = jnp.concatenate([jnp.zeros(na, jnp.int32), jnp.repeat(b_fork, w)])   # [B]
    base = jax.vmap(lambda s, j: jax.random.fold_in(jax.random.key(s), j))(seeds, branch)
    drop = 1 << 30

    def one_step(cache, lengths, pending, active, steps, fed):
        positions = (fork_of_row + lengths)[:, None]                                  # [B, 1]
        if pos_off is not None:                        # the row's sequence's shift after a merge join
            positions = positions + pos_off[:, None]
        la, lb = lengths[:na], lengths[na:]

        def attend(q, k, v, layer):
            h, d = q.shape[2], q.shape[3]
            o_s, l_s = _self_partial(q, k, v)                    # every row's own new token
            outs = []
            if na:                                               # generate rows: their own slot
                own = parent_prefix_attention(cache.pk, cache.pv, layer, a_slot, q[:na, 0][:, None],
                                              la[:, None], s_b, attention_impl, kv)
                outs.append(merge_partials([own, (o_s[:na], l_s[:na])])[0])
            if nf:                                               # fork children: prefix + suffix
                o_p, l_p = parent_prefix_attention(cache.pk, cache.pv, layer, b_pslot,
                                                   q[na:, 0].reshape(nf, w, h, d),
                                                   jnp.broadcast_to(b_fork[:, None], (nf, w)), s_b,
                                                   attention_impl, kv)
                c_mask = jnp.arange(c_b)[None, None, :] < lb[:, None, None]            # [F*w, 1, C_b]
                suffix = attend_partial_heads(q[na:], _gather_rows(cache.ck, layer, b_cslot, c_b),
                                        _gather_rows(cache.cv, layer, b_cslot, c_b), c_mask)
                prefix = (o_p.reshape(nf * w, 1, h, d), l_p.reshape(nf * w, 1, h))
                outs.append(merge_partials([prefix, suffix, (o_s[na:], l_s[na:])])[0])
            return (jnp.concatenate(outs) if len(outs) > 1 else outs[0]), (k, v)

        x = embed(params, config, pending[:, None])
        hidden, (nk, nv) = decoder(params, config, x, positions, attend, jnp.arange(n_layers))
        nk, nv = nk[:, :, 0], nv[:, :, 0]                                            # [L, B, Hkv, D]
        pos = jnp.where(active | fed, lengths, drop)
        pk, pv, ck, cv = cache.pk, cache.pv, cache.ck, cache.cv
        if na:
            pk = _put_slots(pk, a_slot, pos[:na], nk[:, :na])
            pv = _put_slots(pv, a_slot, pos[:na], nv[:, :na])
        if nf:
            ck = _put_slots(ck, b_cslot, pos[na:], nk[:, na:])
            cv = _put_slots(cv, b_cslot, pos[na:], nv[:, na:])
        raw = unembed(params, config, hidden)[:, 0]
        logits = mask_padded(raw, n_valid)                                        # no padded ids
        tok = _sample_rows(logits, base, steps, temperature, top_k, top_p)
        return _constrain(SlotCache(pk, pv, ck, cv), kv), tok, raw

    out = jnp.full((b, chunk + forced.shape[1]), -1, jnp.int32)     # step i's token in column i
    reason = jnp.zeros((b,), jnp.int32)
    steps_cap = chunk + n_forced                      # a row's forced steps do not count against the chunk
    feeding = feed_last is not None
    fed0 = jnp.zeros((b,), bool)
    kept0 = jnp.zeros((b, config.vocab_size), jnp.float32) if feeding else jnp.zeros((b, 0), jnp.float32)

    def cond(c):
        return jnp.any(c[4] & (c[0] < steps_cap)) | jnp.any(c[9])

    def body(c):
        i, cache, lengths, pending, active, remaining, steps, out, reason, fed, kept = c
        cache, tok, raw = one_step(cache, lengths, pending, active, steps, fed)
        if feeding:                   # the rows fed their last token this step: its logits kept
            kept = jnp.where(fed[:, None], raw.astype(jnp.float32), kept)
        active = active & (i < steps_cap)             # a step past the chunk only feeds
        forcing = active & (i < n_forced)
        sampling = active & ~forcing
        tok, finished, remaining, reason, lengths, pending = advance_rows(
            tok, sampling, stop_ids, remaining, reason, lengths, pending)
        nxt = forced[:, jnp.minimum(i, forced.shape[1] - 1)]
        lengths = jnp.where(forcing, lengths + 1, lengths)
        pending = jnp.where(forcing, nxt, pending)
        out = out.at[:, i].set(tok, mode="drop")
        steps = jnp.where(sampling, steps + 1, steps)
        active = active & ~finished
        fed = (finished & feed_last) if feeding else fed
        return i + 1, cache, lengths, pending, active, remaining, steps, out, reason, fed, kept

    init = (jnp.int32(0), cache, lengths, pending, active, remaining, steps, out, reason, fed0, kept0)
    i, cache, *_, out, reason, _, kept = jax.lax.while_loop(cond, body, init)
    if feeding:
        return cache, out, reason, i, kept
    return cache, out, reason, i


@jax.jit
def _row_of(x: jax.Array, i) -> jax.Array:
    """x[i] as one jitted call (eager indexing dispatches several ops: ~0.2 ms on the latency path)."""
    return x[i]


# ---------------------------------------------------------------------------------------------
# Host side: sequences, operations, rows
# ---------------------------------------------------------------------------------------------
class Seq:
    """A parent sequence (a planner or a prompt): its tokens, the last one pending (not yet run)."""
    _ids = itertools.count()

    def __init__(self, tokens: list[int]):
        self.id = next(Seq._ids)
        self.tokens = tokens
        self.slot: int | None = None
        self.op: "Op | None" = None       # the operation in flight (one at a time)
        self.closed = False
        # merge join, as on `DecodeState`: slot s sits at position s + pos_offset; the
        # first `joined` tokens are fixed; right after a join the last token is already in the slot
        # (computed in its branch) and join_logits are its logits. last_fork: the last fork's
        # children, [(tokens from the parent's pending token on, slots computed)], for merge.
        self.pos_offset = 0
        self.joined = 0
        self.join_logits = None
        self.last_fork: tuple[int, list] | None = None

    @property
    def length(self) -> int:              # the slot of the last token (pending unless after_join)
        return len(self.tokens) - 1

    @property
    def after_join(self) -> bool:
        return self.join_logits is not None and len(self.tokens) == self.joined


@dataclasses.dataclass
class Op:
    """An operation on a sequence. `result`: Generation (generate), list[Generation] (fork),
    the Seq (open, extend, close)."""
    kind: str                             # open | extend | generate | fork | close
    seq: Seq
    tokens: list[int] = dataclasses.field(default_factory=list)          # open / extend
    prefixes: list[list[int]] = dataclasses.field(default_factory=list)  # fork
    limits: list[int] = dataclasses.field(default_factory=list)
    stops: list[list[str]] = dataclasses.field(default_factory=list)
    sampling: Sampling = GREEDY
    done: bool = False
    result: object = None
    tag: object = None                    # the caller's (e.g. which run this op belongs to)
    queued: list = dataclasses.field(default_factory=list)   # a serial fork's children not yet started
    join: bool = False                    # fork: its children will be merged (they feed their last token)


class _Row:
    """A decoding stream: the parent of a generate op (g = 0) or child g >= 1 of a fork."""

    def __init__(self, op: Op, j: int, run: list[int], limit: int, stops: list[str], scanner: StopScanner):
        self.op, self.j = op, j
        self.key_branch = j               # the sampling key stream (fold_in(key(seed), key_branch))
        self.run = run                    # child: [parent pending] + prefix (+ generated); parent: unused
        self.limit = limit
        self.stops = stops
        self.scanner = scanner
        self.gen: list[int] = []
        self.reason: str | None = None
        self.overshoot = 0
        self.prefill_pos = 0              # child: how much of run[:-1] is in its suffix slot
        self.fed = False                  # its last token was run (a join fork's child: `_decode` feed_last)
        self.last_logits = None           # then its logits after that token (device, [V]), if kept


class BatchEngine:
    """Many sequences, one decode step: the two-level slot cache and its scheduler.

    Capacities:
      max_seqs           parent slots (sequences held at once; more opens queue)    (default 16)
      max_children       child slots per parent (executors of a stage, n of n>1)     (default 8)
      max_seq_len        tokens one parent sequence may hold                         (default 2048)
      max_branch_tokens  forced prefix + generated tokens per child                   (default 512)
      decode_chunk       decode steps per host round trip                             (default 16)
      prefill_chunk      tokens per sequence per prefill call                         (default 256)

    mesh: a (data, fsdp, tensor) Mesh (`sprint_jax.infer.sharding.mesh_from_flag`): parameters
    placed by the trainer's rules table, parent and child slots over data, KV heads over tensor
    (replicated, with a logged note, where they do not divide); None = one device.
    `sharding_notes` lists what was replicated.

    attention_impl: "xla" or "pallas" for the parent-prefix attention of a decode step ("pallas":
    `sprint_jax.kernels.grouped_prefix_attention`, all groups in one call, per shard on a mesh;
    interpret mode on CPU, where it is slow and only a correctness check).

    Small models (at most `UNROLL_MAX_LAYERS` layers) on one device run their steps on a second,
    per-layer copy of the layer weights (`qwen2.per_layer`): the stacked form's layer scan copied
    every weight out of the stack on every decode step (on the demo's model, about half of a
    one-row step). `params` stays the stacked form; setting it (the RL trainer's update) renews
    the copy. Deep models and meshes keep the stacked scan.
    """

    def __init__(self, model, tokenizer, *, max_seqs: int = 16, max_children: int = 8, max_seq_len: int = 2048,
                 max_branch_tokens: int = 512, decode_chunk: int = 16, prefill_chunk: int = 256,
                 eos_token_ids: Sequence[int] | None = None, min_bucket: int = 64, mesh=None,
                 attention_impl: str = "xla"):
        if attention_impl not in ("xla", "pallas"):
            raise EngineError(f"attention_impl must be 'xla' or 'pallas', got {attention_impl!r}")
        self.attention_impl = attention_impl
        for name, v in (("max_seqs", max_seqs), ("max_children", max_children), ("max_seq_len", max_seq_len),
                        ("max_branch_tokens", max_branch_tokens), ("decode_chunk", decode_chunk),
                        ("prefill_chunk", prefill_chunk)):
            if v <= 0:
                raise EngineError(f"{name} must be positive, got {v}")
        self.config: Qwen2Config = model.config
        self._per_layer = mesh is None and self.config.num_hidden_layers <= UNROLL_MAX_LAYERS
        self.params = model.params
        self.tokenizer = tokenizer
        self.n_valid = valid_vocab(tokenizer, self.config.vocab_size)   # padded ids are never sampled
        self.max_seqs, self.max_children = max_seqs, max_children
        self.max_seq_len, self.max_branch_tokens = max_seq_len, max_branch_tokens
        self.decode_chunk, self.prefill_chunk = decode_chunk, prefill_chunk
        self.min_bucket = min_bucket
        if eos_token_ids is None:
            eos_token_ids = list(self.config.eos_token_ids)
            tok_eos = getattr(tokenizer, "eos_token_id", None)
            if tok_eos is not None and tok_eos not in eos_token_ids:
                eos_token_ids.append(tok_eos)
        self.eos_token_ids = [int(e) for e in eos_token_ids][:STOP_WIDTH]
        # the decode chunk may run past a row's last token before the host sees the stop
        self.parent_capacity = max_seq_len + decode_chunk
        self.child_capacity = max_branch_tokens + decode_chunk
        self.mesh = mesh
        self.sharding_notes: list[str] = []
        self._kv = None
        if mesh is None:
            self.cache = SlotCache.zeros(self.config, max_seqs, max_children, self.parent_capacity,
                                         self.child_capacity)
        else:
            notes = self.sharding_notes
            self.config, self.params = sh.shard_model(self.config, model.params, mesh, notes)
            self._kv = (sh.kv_sharding(self.config, mesh, max_seqs, notes, "parent slots"),
                        sh.kv_sharding(self.config, mesh, max_seqs * max_children, notes, "child slots"))
            if not sh.slot_axes(self._kv[:1]) and sh.slot_axes(self._kv[1:]):
                # too few parent slots to split (the single-run Engine's one): children stay with
                # their parent on every device rather than split apart from it (no per-step gathers)
                self._kv = (self._kv[0], sh.whole_slots(self._kv[1]))
                notes.append("child slots: replicated like the parent slots (too few parent slots to split)")
            sh.log_notes(notes, "BatchEngine on mesh " + ",".join(f"{k}={v}" for k, v in mesh.shape.items()))
            p, c = self._kv
            self.cache = jax.jit(SlotCache.zeros, static_argnums=(0, 1, 2, 3, 4),
                                 out_shardings=SlotCache(p, p, c, c))(
                self.config, max_seqs, max_children, self.parent_capacity, self.child_capacity)
        self._parts = sh.slot_parts(self._kv)          # slot shards (data > 1): rows placed per shard
        self._free = sh.slot_order(max_seqs, self._parts)
        self._waiting: deque[Op] = deque()             # opens waiting for a slot
        # seq id -> [seq, run, done, base]: tokens run[done:] still to write at slot positions
        # base + done.. (an open's prompt, extends; queued when submitted, written by the next step)
        self._prefill_work: dict[int, list] = {}
        self._groups: dict[int, list[_Row | None]] = {}                  # slot -> [parent row, children...]
        self._single_token: dict[str, list[int]] = {}     # stop string -> tokens whose text holds it
        self._texts: list[str] | None = None
        # join_copies: merge copies run inside a decode call (fused) or as a call of their own (alone)
        self.stats = dict(steps=0, decode_calls=0, prefill_calls=0, tokens=0, join_copies_fused=0,
                          join_copies_alone=0)
        self.last_join_tokens = 0           # tokens the last merge ran (in the children's slots)
        # a merge join's copy not yet run: (meta, window, slot). It rides the next `_decode` call
        # (a cond at its start: no call of its own); any other reader of the cache runs it first
        # (`cache`), so every later call sees the joined slot exactly as if it had run at the join.
        self._pending_join: tuple[np.ndarray, int, int] | None = None
        self._fused_join_w = self._join_window(self.child_capacity - 1)
        self._no_join = np.zeros((self._parts, 2 + 2 * max_children), np.int32)
        self._join_call = False             # the last merge dispatched a call (`flush_sync` waits for it)

    @property
    def params(self):
        """The weights, stacked on a leading layers axis (as the model and the trainer hold them)."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        self._params = value
        # what the engine's calls run (see the class docstring): small models per layer
        self._step_params = per_layer(value) if self._per_layer else value

    @property
    def cache(self) -> SlotCache:
        """The KV cache as every call so far left it (a pending merge copy run first)."""
        self._flush_join()
        return self._cache

    @cache.setter
    def cache(self, value: SlotCache) -> None:
        self._cache = value

    def _flush_join(self) -> None:
        """Run a pending merge copy now, as its own call (`_copy_join`)."""
        if self._pending_join is not None:
            meta, w, _ = self._pending_join
            self._pending_join = None
            self._cache = _copy_join(self._cache, meta, w=w, kv=self._kv)
            self.stats["join_copies_alone"] += 1

    # ---- tokens <-> text ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_text(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of tokens; special tokens (EOS, padding) are left out unless asked for, so
        no reply ends in the EOS token's text."""
        return decode_tokens(self.tokenizer, tokens, skip_special_tokens)

    # ---- submitting operations ------------------------------------------------------------
    def open(self, tokens: Sequence[int], tag=None) -> Op:
        """A new sequence holding `tokens` (queued until a parent slot is free)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EngineError("open needs at least one token (got an empty input)")
        if len(tokens) > self.max_seq_len:
            raise EngineError(f"input of {len(tokens)} tokens exceeds max_seq_len={self.max_seq_len}")
        seq = Seq([])
        op = Op("open", seq, tokens=tokens, tag=tag)
        seq.op = op
        self._waiting.append(op)
        self._admit()                     # a free slot: done now (its prompt is written by the next step)
        return op

    def _admit(self) -> None:
        while self._waiting and self._free:
            op = self._waiting.popleft()
            seq = op.seq
            seq.slot = self._free.pop(0)
            seq.tokens = op.tokens
            self._groups.pop(seq.slot, None)
            if len(op.tokens) > 1:
                self._queue_prefill(seq, op.tokens[:-1], 0)
            self._finish(op, seq)

    def _check_idle(self, seq: Seq, what: str):
        if seq.closed:
            raise EngineError(f"{what}: sequence {seq.id} is closed")
        if seq.op is not None:
            raise EngineError(f"{what}: sequence {seq.id} still runs a {seq.op.kind} (one operation at a time)")

    def extend(self, seq: Seq, tokens: Sequence[int], tag=None) -> Op:
        """Append tokens to a sequence, prefilling only them (the orchestrator's sync)."""
        self._check_idle(seq, "extend")
        tokens = [int(t) for t in tokens]
        if len(seq.tokens) + len(tokens) > self.max_seq_len:
            raise EngineError(f"extending to {len(seq.tokens) + len(tokens)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        if seq.after_join and tokens:
            # the last token is already in the slot: the first new one is what its logits sampled
            seq.tokens = seq.tokens + tokens[:1]
            tokens = tokens[1:]
        op = Op("extend", seq, tokens=tokens, tag=tag)
        seq.op = op
        if tokens:
            self._queue_prefill(seq, [seq.tokens[-1]] + tokens[:-1], seq.length)
            seq.tokens = seq.tokens + tokens
        self._finish(op, seq)
        return op

    def _queue_prefill(self, seq: Seq, run: list[int], base: int) -> None:
        """Tokens to write into the sequence's slot after what it holds. The op that queued them
        ends at once: the next step writes them (in a prefill call, or as forced tokens of the
        sequence's next decode chunk when few), before anything of the sequence decodes."""
        work = self._prefill_work.setdefault(seq.id, [seq, [], 0, base])
        work[1] = work[1] + run

    def generate(self, seq: Seq, max_new_tokens: int, stop: Sequence[str] = (), sampling: Sampling | None = None,
                 tag=None) -> Op:
        """Decode on the sequence itself until EOS, a stop string or max_new_tokens; the
        generated tokens (up to the stop) are appended to it."""
        self._check_idle(seq, "generate")
        if max_new_tokens <= 0:
            raise EngineError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(seq.tokens) + max_new_tokens > self.max_seq_len:
            raise EngineError(f"{len(seq.tokens)} tokens + max_new_tokens={max_new_tokens} exceeds "
                              f"max_seq_len={self.max_seq_len}")
        op = Op("generate", seq, limits=[max_new_tokens], stops=[list(stop)], sampling=checked_sampling(sampling),
                tag=tag)
        seq.op = op
        row = _Row(op, 0, [], max_new_tokens, list(stop), StopScanner(self.decode_text, stop))
        self._groups.setdefault(seq.slot, [None] * (1 + self.max_children))[0] = row
        if seq.after_join:
            # step 0 samples from the join logits (the key that step would use); the row then
            # decodes from that token, whose slot is the one after the join
            from sprint_jax.infer.engine import _sample_first
            first = _sample_first(seq.join_logits, op.sampling, self.n_valid)   # no padded ids
            row.gen.append(first)
            if row.scanner.feed([first]) is not None:
                row.reason = "stop"
            elif first in self.eos_token_ids:
                row.reason = "eos"
            elif max_new_tokens <= 1:
                row.reason = "length"
            if row.reason is not None:
                self._row_done(row, False)
        return op

    def fork(self, seq: Seq, prefixes: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
             stop: Sequence[Sequence[str]] | Sequence[str] = (), sampling: Sampling | None = None, tag=None,
             serial: bool = False, join: bool = False) -> Op:
        """len(prefixes) children of `seq`: child j continues seq with prefixes[j] (forced) and
        decodes until its own stops / EOS / limit. Result: one Generation per child (generated
        tokens only); `seq` keeps its content and is read-only until the fork finishes.
        serial: the children run one after another (child j starts when child j-1 ends), each
        alone on the parent's context: SPRINT's `serial` mode, the same tokens as together.
        join: the fork will be merged (`merge`): a child that ends on device (a one-token stop,
        EOS, its limit) runs one more step feeding its last token, so its slot holds that token's
        KV and the last child keeps its logits: a join whose branches are what the children
        generated runs no model call. The same tokens either way."""
        self._check_idle(seq, "fork")
        if seq.after_join:
            raise EngineError("fork right after a merge join: the planner must write a token first")
        n = len(prefixes)
        if n == 0:
            raise EngineError("fork needs at least one child prefix")
        if n > self.max_children:
            raise EngineError(f"{n} children exceed max_children={self.max_children}")
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if stop and isinstance(stop[0], str):
            stops = [list(stop)] * n
        else:
            stops = [list(s) for s in stop] if stop else [[] for _ in range(n)]
        if len(limits) != n or len(stops) != n:
            raise EngineError(f"fork of {n} children got {len(limits)} limits and {len(stops)} stop lists")
        prefixes = [[int(t) for t in p] for p in prefixes]
        for j, (p, m) in enumerate(zip(prefixes, limits)):
            if m <= 0:
                raise EngineError(f"child {j}: max_new_tokens must be positive, got {m}")
            if len(p) + 1 + m > self.max_branch_tokens:
                raise EngineError(f"child {j}: prefix of {len(p)} tokens + max_new_tokens={m} exceeds "
                                  f"max_branch_tokens={self.max_branch_tokens}")
        op = Op("fork", seq, prefixes=prefixes, limits=limits, stops=stops, sampling=checked_sampling(sampling),
                tag=tag, join=join)
        seq.op = op
        group = self._groups.setdefault(seq.slot, [None] * (1 + self.max_children))
        rows = [_Row(op, j, [seq.tokens[-1]] + p, m, st, StopScanner(self.decode_text, st))
                for j, (p, m, st) in enumerate(zip(prefixes, limits, stops))]
        if serial:
            rows, op.queued = rows[:1], rows[1:]
        for row in rows:
            group[1 + row.j] = row
        op.result = [None] * n
        seq.last_fork = (len(seq.tokens), [None] * n)
        return op

    def truncate(self, seq: Seq, n: int) -> Seq:
        """Keep the first n tokens (1 <= n <= its length), at once: the KV past the new length is
        never read and the next write overwrites it (the orchestrator's token-boundary rollback)."""
        self._check_idle(seq, "truncate")
        if not 1 <= n <= len(seq.tokens):
            raise EngineError(f"truncate to {n} tokens: the sequence holds {len(seq.tokens)}")
        if n < seq.joined:
            raise EngineError(f"truncate to {n} tokens: the first {seq.joined} are fixed by a merge join "
                              "(its branches' KV cannot be rolled back)")
        work = self._prefill_work.get(seq.id)
        if work is not None:                  # queued tokens past the new length are not written
            keep = n - 1 - work[3]
            if work[2] >= keep:
                del self._prefill_work[seq.id]
            else:
                work[1] = work[1][:keep]
        seq.tokens = seq.tokens[:n]
        return seq

    def _child_rows(self, seq: Seq, n: int, p0: int):
        """Rows of a child prefill call for `n` children of `seq` forked at `p0`, placed in the
        sequence's slot shard (sh.slot_blocks): (row of child j, rows, child slot, parent slot,
        fork length, position offset) per row; padding rows write nowhere."""
        at, r_b = sh.slot_blocks([seq.slot] * n, self.max_seqs, self._parts,
                                 cap=self.max_seqs // self._parts * self.max_children)
        cslot = np.full(r_b, self.max_seqs * self.max_children, np.int32)
        parent = np.full(r_b, seq.slot, np.int32)
        fork_len = np.full(r_b, p0, np.int32)
        pos_off = np.full(r_b, seq.pos_offset, np.int32)
        for j, i in enumerate(at):
            cslot[i] = seq.slot * self.max_children + j
        return at, r_b, cslot, parent, fork_len, pos_off

    def merge(self, seq: Seq, branches: Sequence[Sequence[int]]) -> Seq:
        """Join the children of the fork just finished on `seq` into its slot without re-running
        them (`Engine.merge` is the single-run twin): branches[j] is child j's final
        tokens after the fork (opening, body, repair as the layout tokenizes them). Their slot
        rows are copied after the parent's prefix in child order (one call, `_copy_join`).
        After a join fork (`fork(join=True)`) whose children's tokens are the branches, that copy is
        all: each child ran its last token in its decode and the last child kept its logits. Else the
        children first run, in their own slots, only the tokens they never computed (a repair, a
        re-tokenized end; a last token not run, or the last child's when its logits were not kept),
        fused with the copy in one call (`_merge`). The sequence continues at fork + the longest
        child (`pos_offset`); its next token is sampled from the last child's last logits
        (`join_logits`). Runs at once (no step needed): a model call (tails) is dispatched now; the
        copy alone is left pending and rides the sequence's next decode call (`_decode`'s
        join_meta), or runs on its own before any other call that reads the cache (`cache`)."""
        self._check_idle(seq, "merge")
        fork = seq.last_fork
        if fork is None or fork[0] != len(seq.tokens) or any(r is None for r in fork[1]):
            raise EngineError("merge needs the fork just finished on this sequence, with the sequence unchanged since")
        rows = fork[1]
        n = len(rows)
        branches = check_merge_branches(branches, n, len(seq.tokens), self.max_seq_len)
        if any(1 + len(b) > self.child_capacity for b in branches):
            raise EngineError(f"merge: a branch of {max(len(b) for b in branches)} tokens exceeds the child "
                              f"capacity ({self.child_capacity})")
        p0 = seq.length
        # branch j's first keep[j] tokens are in child j's slot as they must be (its slots
        # 1..keep[j]; slot 0 is the parent's pending token): the common prefix of what the child
        # ran and the branch, up to what its slot holds. The last child's last token also needs
        # its logits (the join's): kept from its decode (`fork(join=True)`), else it runs again.
        keep = [min(common_prefix(have[1:], b), done - 1) for b, (have, done, _) in zip(branches, rows)]
        if keep[-1] == len(branches[-1]) and not (rows[-1][2] is not None and rows[-1][1] - 1 == keep[-1]):
            keep[-1] -= 1
        tails = [b[k:] for b, k in zip(branches, keep)]
        # the copy (`_copy_join`): child 0's slots 0..len (slot 0: the parent's pending token, run
        # in every child), then each other child's slots 1..len, to parent slots p0.. in child
        # order; one window per child of a length bucket (few shapes; `warm_merge` compiles them)
        lens = [len(b) for b in branches]
        meta = self._join_meta(seq, p0, lens)
        w = self._join_window(max(lens))
        if not any(tails):
            # every token was computed in its branch (the children fed their last token): no
            # model call, only the copy, which rides the sequence's next decode call (`_decode`'s
            # join_meta; a different next call runs it first, on its own: `cache`)
            self._flush_join()
            self._pending_join = (meta, w, seq.slot)
            self._join_call = False
            return self._joined(seq, branches, rows[-1][2], 0)
        self._join_call = True
        at, r_b, cslot, parent, fork_len, pos_off = self._child_rows(seq, n, p0)
        # else one call (`_merge`): the tails (one child prefill row per child, its shard's block;
        # tail bucket 1, 2, 4, ...), then the copy. A tail longer than prefill_chunk (rare) runs
        # its leading chunks as child prefill calls first.
        s_b = self._merge_bucket(p0 + 1, self.parent_capacity)
        last, pos, longest = None, 0, max(len(t) for t in tails)
        while pos < longest:
            pieces = [t[pos: pos + self.prefill_chunk] for t in tails]
            # tails are short (a close tag, a repair): their own bucket (1, 2, 4, ...), no padding
            # to a prefill bucket (the call's compute is the tails' tokens, not 16 per child)
            toks = np.zeros((r_b, _bucket(max(len(p) for p in pieces), 1)), np.int32)
            start = np.zeros(r_b, np.int32)
            nval = np.zeros(r_b, np.int32)
            for i, j, p in zip(at, range(n), pieces):
                toks[i, : len(p)] = p
                start[i] = 1 + keep[j] + pos
                nval[i] = len(p)
            c_b = self._merge_bucket(int(start.max()) + 1, self.child_capacity)
            if pos + self.prefill_chunk < longest:
                self.cache, logits = _prefill(
                    self._step_params, self.config, self.cache, toks, cslot, parent, fork_len, start, nval,
                    kind="child", s_b=s_b, c_b=c_b, kv=self._kv, pos_off=pos_off, return_logits=True)
            else:
                self.cache, logits = _merge(self._step_params, self.config, self.cache, toks, cslot, parent, fork_len,
                                            start, nval, pos_off, meta, s_b=s_b, c_b=c_b, w=w, kv=self._kv)
            self.stats["prefill_calls"] += 1
            if pieces[-1]:
                last = logits[at[n - 1]]
            pos += self.prefill_chunk
        return self._joined(seq, branches, last if tails[-1] else rows[-1][2], sum(len(t) for t in tails))

    def _join_meta(self, seq: Seq, p0: int, lens: list[int]) -> np.ndarray:
        """`_copy_join`'s meta: one row per slot shard, the sequence's shard's (parent slot, p0, per
        child (offset, length)); the other rows copy nothing (no child)."""
        meta = np.zeros((self._parts, 2 + 2 * self.max_children), np.int32)
        row = meta[seq.slot // (self.max_seqs // self._parts)]
        row[0], row[1] = seq.slot, p0
        off = 0
        for j, n in enumerate(lens):
            row[2 + 2 * j], row[3 + 2 * j] = off, n
            off += n
        return meta

    def _join_window(self, longest: int) -> int:
        """`_copy_join`'s window: a length bucket holding a child's slots 0..longest."""
        return min(self._merge_bucket(longest + 1, self.child_capacity), self.parent_capacity)

    def _joined(self, seq: Seq, branches: list[list[int]], join_logits, ran: int) -> Seq:
        """The sequence after a merge join (see `Seq`)."""
        lens = [len(b) for b in branches]
        seq.tokens = seq.tokens + [t for b in branches for t in b]
        seq.pos_offset += max(lens) - sum(lens)
        seq.joined = len(seq.tokens)
        seq.join_logits = join_logits
        seq.last_fork = None
        self.last_join_tokens = ran
        return seq

    def flush(self, seq: Seq) -> None:
        """Write the sequence's queued tokens (an open's prompt, extends) into its slot now."""
        while seq.id in self._prefill_work:
            self._step_or_raise()

    def forced_logits(self, seq: Seq, tokens: Sequence[int] = ()) -> np.ndarray:
        """Teacher forcing on an idle sequence, now: its pending token and tokens[:-1] run through
        its slot (parent prefill calls) and tokens are appended; returns the logits [T, V] that
        predict each of tokens (row t: after the sequence + tokens[:t]). tokens empty: the next
        token's logits [1, V], nothing appended. The single-run `Engine`'s step_logits /
        extend_logits (exactness tests compare them with a plain forward)."""
        self._check_idle(seq, "forced_logits")
        if seq.after_join:
            raise EngineError("forced_logits right after a merge join: its logits are the join logits")
        tokens = [int(t) for t in tokens]
        if len(seq.tokens) + len(tokens) > self.max_seq_len:
            raise EngineError(f"extending to {len(seq.tokens) + len(tokens)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        self.flush(seq)
        run = [seq.tokens[-1]] + tokens[:-1]
        (i,), r_b = sh.slot_blocks([seq.slot], self.max_seqs, self._parts)
        rows = []
        for pos in range(0, len(run), self.prefill_chunk):
            piece = run[pos: pos + self.prefill_chunk]
            toks = np.zeros((r_b, _bucket_fine(len(piece), 16)), np.int32)
            slot = np.full(r_b, self.max_seqs, np.int32)     # padding rows: nothing valid, writes dropped
            start, nval, pos_off = (np.zeros(r_b, np.int32) for _ in range(3))
            toks[i, : len(piece)] = piece
            slot[i], start[i], nval[i], pos_off[i] = seq.slot, seq.length + pos, len(piece), seq.pos_offset
            s_b = min(_bucket(int(start[i]) + 1, self.min_bucket), self.parent_capacity)
            self.cache, logits = _prefill(self._step_params, self.config, self.cache, toks, slot, slot,
                                          np.zeros_like(slot), start, nval, kind="parent", s_b=s_b, c_b=1,
                                          kv=self._kv, pos_off=pos_off, return_logits=True, all_logits=True)
            self.stats["prefill_calls"] += 1
            rows.append(np.asarray(logits[i, : len(piece)]))
        seq.tokens = seq.tokens + tokens
        return np.concatenate(rows)

    def fork_logits(self, seq: Seq, branches: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher forcing over a fork, now: child j runs the sequence's pending token and
        branches[j][:-1] in its child slot (child prefill calls); returns per child the logits
        [len(branches[j]), V] that predict each of its tokens. The fork is recorded for `merge`
        (each child's last token is left for the join to run), as a finished `fork` would be."""
        self._check_idle(seq, "fork_logits")
        if seq.after_join:
            raise EngineError("fork right after a merge join: the planner must write a token first")
        branches = [[int(t) for t in b] for b in branches]
        n = len(branches)
        if not 1 <= n <= self.max_children or any(not b for b in branches):
            raise EngineError(f"fork_logits needs 1..{self.max_children} non-empty branches")
        if any(len(b) + 1 > self.max_branch_tokens for b in branches):
            raise EngineError(f"a branch exceeds max_branch_tokens={self.max_branch_tokens}")
        self.flush(seq)
        p0 = seq.length
        runs = [[seq.tokens[-1]] + b[:-1] for b in branches]
        at, r_b, cslot, parent, fork_len, pos_off = self._child_rows(seq, n, p0)
        out: list[list[np.ndarray]] = [[] for _ in range(n)]
        for pos in range(0, max(len(r) for r in runs), self.prefill_chunk):
            pieces = [r[pos: pos + self.prefill_chunk] for r in runs]
            toks = np.zeros((r_b, _bucket_fine(max(len(p) for p in pieces), 16)), np.int32)
            start = np.full(r_b, pos, np.int32)
            nval = np.zeros(r_b, np.int32)
            for i, p in zip(at, pieces):
                toks[i, : len(p)] = p
                nval[i] = len(p)
            s_b = min(_bucket(p0 + 1, self.min_bucket), self.parent_capacity)
            c_b = min(_bucket(pos + 1, self.min_bucket), self.child_capacity)
            self.cache, logits = _prefill(self._step_params, self.config, self.cache, toks, cslot, parent, fork_len,
                                          start, nval, kind="child", s_b=s_b, c_b=c_b, kv=self._kv, pos_off=pos_off,
                                          return_logits=True, all_logits=True)
            self.stats["prefill_calls"] += 1
            logits = np.asarray(logits)
            for j, (i, p) in enumerate(zip(at, pieces)):
                out[j].append(logits[i, : len(p)])
        seq.last_fork = (len(seq.tokens), [([seq.tokens[-1]] + b, len(r), None) for b, r in zip(branches, runs)])
        return [np.concatenate(o) for o in out]

    def flush_sync(self, seq: Seq) -> bool:
        """Write the sequence's queued tokens now and wait until its slot holds them: the end of
        the orchestrator's sync, so that a stage's `sync_s` is the join's real cost (an extend
        only queues its tokens for the next step; a merge's tails call runs asynchronously; a
        merge's copy alone has no call: it rides the next decode call, nothing to wait for). Only when
        nothing else is in flight and the tokens would take a prefill call anyway (more than a
        decode chunk; fewer ride the sequence's next decode chunk), so no batching or step is
        given up: the same prefill calls, run before the next step instead of in it. Returns
        whether it wrote anything."""
        work = self._prefill_work.get(seq.id)
        if (self._waiting or any(w[0] is not seq for w in self._prefill_work.values())
                or any(r is not None for rows in self._groups.values() for r in rows)
                or (work is not None and len(work[1]) - work[2] <= self.decode_chunk)):
            return False
        wrote = work is not None
        while seq.id in self._prefill_work:
            self._prefill_parents()
        if wrote or self._join_call:              # a merge's copy alone (pending) rides the next decode
            jax.block_until_ready(self._cache)    # call: nothing of the join is in flight to wait for
        self._join_call = False
        return wrote

    def _merge_bucket(self, n: int, cap: int) -> int:
        """A merge's length bucket (parent prefix, child rows): min_bucket * 2^k, capped."""
        return min(_bucket(n, self.min_bucket), cap)

    def warm_merge(self, children: int | None = None, max_parent_len: int | None = None,
                   tails: Sequence[int] = (1, 2)) -> int:
        """Compile the merge join's shapes ahead of time, so that no compile lands in a timed sync:
        one call per (parent length bucket up to max_parent_len (default max_seq_len), child length
        bucket, tail bucket in `tails`) for `children` children (default max_children); tails of 1
        and 2 tokens are the usual (each child's close tag, a repair); and the copy alone (a join
        with nothing left to run, the usual join) per child length bucket (one shape serves every
        number of children). The calls copy no child (they write nothing). Returns the number of
        shapes."""
        children = self.max_children if children is None else children
        if not 1 <= children <= self.max_children:
            raise EngineError(f"warm_merge: children must be in 1..{self.max_children}, got {children}")
        top = self.parent_capacity if max_parent_len is None else self._merge_bucket(max_parent_len + 1,
                                                                                      self.parent_capacity)
        _, r_b = sh.slot_blocks([0] * children, self.max_seqs, self._parts,
                                cap=self.max_seqs // self._parts * self.max_children)

        def buckets(cap: int, top: int) -> list[int]:
            out, b = [], self._merge_bucket(1, cap)
            while True:
                out.append(b)
                if b >= top:
                    return out
                b = self._merge_bucket(2 * b, cap)

        pad = np.full(r_b, self.max_seqs * self.max_children, np.int32)
        zeros = np.zeros(r_b, np.int32)
        shapes = 0
        meta = np.zeros((self._parts, 2 + 2 * self.max_children), np.int32)     # no child: writes nothing
        windows = sorted({min(c, self.parent_capacity) for c in buckets(self.child_capacity, self.child_capacity)})
        for w in windows:
            self.cache = _copy_join(self.cache, meta, w=w, kv=self._kv)            # the copy alone
            shapes += 1
        for s_b, c_b, t_b in itertools.product(buckets(self.parent_capacity, top),
                                               buckets(self.child_capacity, self.child_capacity),
                                               sorted({_bucket(t, 1) for t in tails})):
            self.cache, _ = _merge(self._step_params, self.config, self.cache, np.zeros((r_b, t_b), np.int32), pad,
                                   zeros, zeros, zeros, zeros, zeros, meta, s_b=s_b, c_b=c_b,
                                   w=min(c_b, self.parent_capacity), kv=self._kv)
            shapes += 1
        jax.block_until_ready(self.cache)
        return shapes

    @property
    def max_branches(self) -> int:        # the orchestrator's name for children per parent
        return self.max_children

    def close(self, seq: Seq) -> None:
        """Free the sequence's slot (immediately; the sequence must be idle)."""
        self._check_idle(seq, "close")
        seq.closed = True
        self._prefill_work.pop(seq.id, None)
        if self._pending_join is not None and self._pending_join[2] == seq.slot:
            self._pending_join = None             # a join copy into a slot now free: nothing reads it
        if seq.slot is not None:
            self._groups.pop(seq.slot, None)
            self._free.append(seq.slot)
            self._free.sort(key=sh.slot_order(self.max_seqs, self._parts).index)
            seq.slot = None

    def abort(self, seq: Seq) -> None:
        """Drop whatever operation the sequence has in flight (a queued open, a prefill, its
        decoding rows) and free its slot at once: a server's client went away. The op ends with
        `done` set and `result` None; the sequence is closed."""
        op = seq.op
        if op is not None:
            self._waiting = deque(o for o in self._waiting if o is not op)
            self._finish(op, None)
        self.close(seq)

    def progress(self, op: Op) -> list[list[int]]:
        """Tokens generated so far by a generate (one list) or fork (one per child) op, for
        streaming; a finished row's tokens are final (cut at its stop)."""
        if op.kind not in ("generate", "fork"):
            return []
        if op.done:
            return [op.result.tokens] if op.kind == "generate" else [g.tokens for g in op.result]
        rows = self._groups.get(op.seq.slot, [])
        if op.kind == "generate":
            return [list(rows[0].gen) if rows and rows[0] is not None else []]
        return [list(g.tokens) if g is not None else (list(rows[1 + j].gen) if rows and rows[1 + j] is not None else [])
                for j, g in enumerate(op.result)]

    # ---- state ----------------------------------------------------------------------------
    @property
    def live_rows(self) -> int:
        """Rows decoding or waiting to decode (parents of generate ops and fork children)."""
        return sum(r is not None for rows in self._groups.values() for r in rows)

    @property
    def waiting(self) -> int:
        """Opens queued for a free slot."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._prefill_work or any(
            r is not None for rows in self._groups.values() for r in rows))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _finish(self, op: Op, result) -> None:
        op.done, op.result = True, result
        op.seq.op = None

    def _stop_ids(self, stops: list[str]) -> list[int]:
        """The row's device stop ids: EOS, then every token whose own text contains one of the stop
        strings (" </Plan_1>" for "</Plan_1>"): emitting it completes that stop, so the row ends on
        device in the step it is written instead of at the end of the chunk. The host scanner
        still finds the earliest stop and cuts there; ids past STOP_WIDTH are left to it."""
        ids = list(self.eos_token_ids)
        for s in stops:
            if s not in self._single_token:
                texts = self._token_texts()
                self._single_token[s] = [i for i, t in enumerate(texts) if s and s in t]
            for t in self._single_token[s]:
                if len(ids) < STOP_WIDTH and t not in ids:
                    ids.append(t)
        return ids + [-2] * (STOP_WIDTH - len(ids))

    def _token_texts(self) -> list[str]:
        """Each token id's own text (once per engine; stop strings are matched against it)."""
        if self._texts is None:
            n = min(self.config.vocab_size, len(self.tokenizer))
            self._texts = list(self.tokenizer.batch_decode([[i] for i in range(n)])) \
                if hasattr(self.tokenizer, "batch_decode") else [self.decode_text([i]) for i in range(n)]
        return self._texts

    # ---- one engine step ------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, prefill one chunk per sequence, decode one chunk for every decoding row.
        Returns whether anything happened (False: idle, or opens wait for slots that idle
        sequences hold; only closing one of them frees a slot)."""
        self.stats["steps"] += 1
        before = (len(self._waiting), self.stats["prefill_calls"], self.stats["decode_calls"])
        self._admit()
        self._prefill_parents()
        self._prefill_children()
        self._decode()
        return before != (len(self._waiting), self.stats["prefill_calls"], self.stats["decode_calls"])

    def run(self, ops: Sequence[Op] = ()) -> None:
        """Step until the given operations are done (or, without ops, until idle). Raises
        EngineError instead of waiting forever when no step can make progress."""
        while (not all(o.done for o in ops)) if ops else self.busy:
            self._step_or_raise()

    def _step_or_raise(self) -> None:
        if not self.step():
            raise EngineError(f"no progress: {len(self._waiting)} open(s) wait for a slot and all "
                              f"{self.max_seqs} slots hold idle sequences (close one)")

    def _forced_in_decode(self, work: list) -> bool:
        """Whether a sequence's queued tokens ride as forced tokens in its next decode chunk (few
        left, and its generate op decodes next) instead of a prefill call."""
        seq = work[0]
        rows = self._groups.get(seq.slot)
        return (len(work[1]) - work[2] <= self.decode_chunk and rows is not None and rows[0] is not None
                and rows[0].reason is None)

    def _prefill_parents(self) -> None:
        rows = []
        for work in self._prefill_work.values():
            if not self._forced_in_decode(work):
                seq, run, done, base = work
                rows.append((work, run[done: done + self.prefill_chunk]))
        if not rows:
            return
        at, r_b = sh.slot_blocks([work[0].slot for work, _ in rows], self.max_seqs, self._parts)
        t_b = _bucket_fine(max(len(p) for _, p in rows), 16)
        toks = np.zeros((r_b, t_b), np.int32)
        slot = np.full(r_b, self.max_seqs, np.int32)   # padding rows write nowhere (dropped)
        start = np.zeros(r_b, np.int32)
        nval = np.zeros(r_b, np.int32)
        pos_off = np.zeros(r_b, np.int32)
        for i, (work, piece) in zip(at, rows):
            toks[i, : len(piece)] = piece
            slot[i] = work[0].slot
            start[i] = work[3] + work[2]
            nval[i] = len(piece)
            pos_off[i] = work[0].pos_offset
        s_b = min(_bucket_fine(int(start.max()) + 1, self.min_bucket), self.parent_capacity)
        # host arrays go to the jitted call as they are (jnp.asarray / jnp.zeros would each be a
        # dispatched op: ~0.1-0.4 ms of host time per prefill call on a small model)
        self.cache = _prefill(self._step_params, self.config, self.cache, toks, slot, slot, np.zeros(r_b, np.int32),
                              start, nval, kind="parent", s_b=s_b, c_b=1, kv=self._kv, pos_off=pos_off)
        self.stats["prefill_calls"] += 1
        for work, piece in rows:
            work[2] += len(piece)
            if work[2] >= len(work[1]):
                del self._prefill_work[work[0].id]

    def _prefill_children(self) -> None:
        work = []
        for slot, rows in self._groups.items():
            for g, row in enumerate(rows[1:]):
                if (row is not None and len(row.run) - 1 - row.prefill_pos > self.decode_chunk
                        and row.op.seq.id not in self._prefill_work):
                    work.append((slot, g, row))
        if not work:
            return
        pieces = [row.run[row.prefill_pos: len(row.run) - 1][: self.prefill_chunk] for _, _, row in work]
        at, r_b = sh.slot_blocks([slot for slot, _, _ in work], self.max_seqs, self._parts,
                                 cap=self.max_seqs // self._parts * self.max_children)
        t_b = _bucket_fine(max(len(p) for p in pieces), 16)
        s_b = min(_bucket_fine(max(row.op.seq.length for _, _, row in work), self.min_bucket), self.parent_capacity)
        c_b = min(_bucket_fine(max(row.prefill_pos for _, _, row in work) + 1, self.min_bucket), self.child_capacity)
        toks = np.zeros((r_b, t_b), np.int32)
        cslot = np.full(r_b, self.max_seqs * self.max_children, np.int32)
        parent = np.zeros(r_b, np.int32)
        fork = np.zeros(r_b, np.int32)
        start = np.zeros(r_b, np.int32)
        nval = np.zeros(r_b, np.int32)
        pos_off = np.zeros(r_b, np.int32)
        for i, (slot, g, row), piece in zip(at, work, pieces):
            pos_off[i] = row.op.seq.pos_offset
            toks[i, : len(piece)] = piece
            cslot[i] = slot * self.max_children + g
            parent[i] = slot
            fork[i] = row.op.seq.length
            start[i] = row.prefill_pos
            nval[i] = len(piece)
        self.cache = _prefill(self._step_params, self.config, self.cache, toks, cslot, parent, fork, start, nval,
                              kind="child", s_b=s_b, c_b=c_b, kv=self._kv, pos_off=pos_off)
        self.stats["prefill_calls"] += 1
        for (_, _, row), piece in zip(work, pieces):
            row.prefill_pos += len(piece)

    def _decoding(self, row: _Row | None, child: bool) -> bool:
        """Whether the row decodes in this step: its context is written, but for at most
        decode_chunk tokens that its chunk takes as forced tokens."""
        if row is None or row.reason is not None:
            return False
        work = self._prefill_work.get(row.op.seq.id)
        if child:
            return work is None and len(row.run) - 1 - row.prefill_pos <= self.decode_chunk
        return work is None or self._forced_in_decode(work)

    def _feed(self, row: _Row, child: bool) -> tuple[int, list[int]]:
        """(KV entries in the row's own slot, tokens to run from there: the pending one first,
        then the forced ones)."""
        if child:
            if row.gen:
                return len(row.run) - 1 + len(row.gen), [row.gen[-1]]
            return row.prefill_pos, row.run[row.prefill_pos:]
        seq = row.op.seq
        work = self._prefill_work.get(seq.id)
        if work is not None:
            _, run, done, base = work
            return base + done, run[done:] + [seq.tokens[-1]]
        return seq.length + len(row.gen), [row.gen[-1] if row.gen else seq.tokens[-1]]

    def _decode(self) -> None:
        """One decode call over the active rows only: parents running a generate op (rows A) and,
        grouped by parent, the children of running forks (rows F x w, w = the most children
        alive in one fork, bucketed). A read-only parent and a finished child take no row."""
        gen_rows: list[tuple[int, _Row]] = []
        forks: list[tuple[int, list[_Row]]] = []
        for slot, rows in sorted(self._groups.items()):
            if self._decoding(rows[0], False):
                gen_rows.append((slot, rows[0]))
            kids = [r for r in rows[1:] if self._decoding(r, True)]
            if kids:
                forks.append((slot, kids))
        if not gen_rows and not forks:
            return
        # Rows in `parts` equal blocks (slot shards, data > 1; one block otherwise): block j holds
        # its wa generate rows, then its wf fork groups of w rows, all of shard j's slots
        # (`sh.slot_blocks`), so each shard's `_decode` body reads and writes only its own slots.
        parts = self._parts
        at_a, na = sh.slot_blocks([slot for slot, _ in gen_rows], self.max_seqs, parts) if gen_rows else ([], 0)
        at_f, nf = sh.slot_blocks([slot for slot, _ in forks], self.max_seqs, parts) if forks else ([], 0)
        wa, wf = na // parts, nf // parts
        w = min(_bucket(max(len(k) for _, k in forks), 1), self.max_children) if forks else 1
        b = na + nf * w
        a_slot = np.full(na, self.max_seqs, np.int32)                 # padding rows write nowhere
        b_pslot = np.full(nf, self.max_seqs, np.int32)
        b_fork = np.zeros(nf, np.int32)
        b_cslot = np.full(nf * w, self.max_seqs * self.max_children, np.int32)
        ints, floats, col = decode_rows(b, self.decode_chunk)         # the per-row arrays, packed
        lengths, pending, active, remaining = col["lengths"], col["pending"], col["active"], col["remaining"]
        stop_ids, seeds, branch, steps = col["stop_ids"], col["seeds"], col["branch"], col["steps"]
        temp, top_k, top_p, pos_off = col["temperature"], col["top_k"], col["top_p"], col["pos_off"]
        forced, n_forced = col["forced"], col["n_forced"]
        fed_rows = col["feed_last"]                                   # rows that feed their last token
        need_p, need_c = 1, 1
        placed: list[tuple[int, _Row, bool]] = []
        block = wa + wf * w                                           # rows per slot shard
        for p, (slot, row) in zip(at_a, gen_rows):
            a_slot[p] = slot
            placed.append(((p // wa) * block + p % wa, row, False))
        for q, (slot, kids) in zip(at_f, forks):
            seq = kids[0].op.seq
            b_pslot[q], b_fork[q] = slot, seq.length
            need_p = max(need_p, seq.length)
            for c, row in enumerate(kids):
                b_cslot[q * w + c] = slot * self.max_children + row.j
                placed.append(((q // wf) * block + wa + (q % wf) * w + c, row, True))
        for i, row, child in placed:
            lengths[i], feed = self._feed(row, child)
            pending[i] = feed[0]
            forced[i, : len(feed) - 1] = feed[1:]
            n_forced[i] = len(feed) - 1
            pos_off[i] = row.op.seq.pos_offset
            # the row writes n_forced + decode_chunk slots at most (+ a feed step)
            if child:
                need_c = max(need_c, lengths[i] + n_forced[i] + self.decode_chunk + row.op.join)
                fed_rows[i] = row.op.join
            else:
                need_p = max(need_p, lengths[i] + n_forced[i] + self.decode_chunk)
            active[i] = True
            remaining[i] = row.limit - len(row.gen)
            stop_ids[i] = self._stop_ids(row.stops)
            s = row.op.sampling
            seeds[i], branch[i], steps[i] = s.seed, row.key_branch, len(row.gen)
            temp[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
        # attention reads s_b / c_b slots per row and layer: the finer buckets (1x, 1.5x powers of
        # two) cut the over-read (80 used -> 96, not 128), the per-row cost of a many-row step
        s_b = min(_bucket_fine(need_p, self.min_bucket), self.parent_capacity)
        c_b = min(_bucket_fine(need_c, self.min_bucket), self.child_capacity) if forks else 1
        join_meta, join_w = self._join_for_decode()
        res = _decode(
            self._step_params, self.config, self._cache, a_slot, b_pslot, b_fork, b_cslot, ints, floats,
            w=w, chunk=self.decode_chunk, s_b=s_b, c_b=c_b, kv=self._kv, attention_impl=self.attention_impl,
            n_valid=self.n_valid, feeding=bool(fed_rows.any()), join_meta=join_meta, join_w=join_w)
        self.cache, out, reason = res[:3]
        kept = res[4] if len(res) > 4 else None
        out, reason = jax.device_get((out, reason))
        self.stats["decode_calls"] += 1
        for i, row, child in placed:
            if n_forced[i]:                   # all taken: a row forces before it can finish
                if child:
                    row.prefill_pos = len(row.run) - 1
                else:
                    del self._prefill_work[row.op.seq.id]
            new = [int(t) for t in out[i] if t >= 0]
            self.stats["tokens"] += len(new)
            row.gen.extend(new)
            k = row.scanner.feed(new)
            if k is not None:
                row.overshoot = len(row.gen) - k
                row.gen = row.gen[:k]
                row.reason = "stop"
            elif reason[i] == 1:
                row.reason = "eos" if row.gen and row.gen[-1] in self.eos_token_ids else "stop"
            elif reason[i] == 2 or len(row.gen) >= row.limit:
                row.reason = "length"
            if row.reason is not None:
                # the last kept token was run: a later token was sampled from its logits (host-side
                # stop, overshoot), or the device ended the row and fed it (feed_last)
                row.fed = row.overshoot > 0 or bool(fed_rows[i] and reason[i])
                if fed_rows[i] and reason[i] and not row.overshoot and row.j == len(row.op.prefixes) - 1:
                    row.last_logits = _row_of(kept, np.int32(i))   # the join logits of a merge (device)
                self._row_done(row, child)

    def _join_for_decode(self) -> tuple[np.ndarray, int]:
        """The pending merge copy for `_decode` to run first (meta, window; zero lengths: none).
        One window for every join (`_fused_join_w`: a child's whole capacity, so it holds any
        join's), so a pending copy adds no compiled shape."""
        if self._pending_join is None:
            return self._no_join, self._fused_join_w
        meta = self._pending_join[0]
        self._pending_join = None
        self.stats["join_copies_fused"] += 1
        return meta, self._fused_join_w

    def _row_done(self, row: _Row, child: bool) -> None:
        op, seq = row.op, row.op.seq
        gen = Generation(tokens=row.gen, text=self.decode_text(row.gen), stop_reason=row.reason,
                         overshoot=row.overshoot, steps=len(row.gen) + row.overshoot)
        group = self._groups[seq.slot]
        if not child:
            group[0] = None
            seq.tokens = seq.tokens + row.gen
            self._finish(op, gen)
            return
        group[1 + row.j] = None
        op.result[row.j] = gen
        if seq.last_fork is not None:
            # what a merge join needs: the child's tokens, how many of them its slot holds, and the
            # logits after the last (None: not kept). At the end every forced token (prefilled or
            # taken in a decode chunk) and each generated token but the last is written; the last
            # too when it was fed (row.fed; a host-side stop's overshoot wrote more: not counted)
            seq.last_fork[1][row.j] = (row.run + row.gen, len(row.run) - 1 + len(row.gen) + row.fed,
                                       row.last_logits)
        if op.queued:                         # a serial fork: the next child starts
            nxt = op.queued.pop(0)
            group[1 + nxt.j] = nxt
        if all(r is not None for r in op.result):
            self._finish(op, op.result)

    # ---- convenience: whole requests ------------------------------------------------------
    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                      stop: Sequence[str] | Sequence[Sequence[str]] = (), sampling: Sampling | Sequence[Sampling] | None = None,
                      n: int = 1) -> list[list[Generation]]:
        """Each prompt's n samples (n=1: decoded on the prompt's own slot; n>1: n children forked
        from one prefill, each its own key stream). Prompts beyond the free slots queue."""
        k = len(prompts)
        limits = [max_new_tokens] * k if isinstance(max_new_tokens, int) else list(max_new_tokens)
        stops = [list(stop)] * k if (not stop or isinstance(stop[0], str)) else [list(s) for s in stop]
        samplings = [sampling or GREEDY] * k if (sampling is None or isinstance(sampling, Sampling)) else list(sampling)
        if n < 1:
            raise EngineError(f"n must be >= 1, got {n}")
        opens = [self.open(p, tag=i) for i, p in enumerate(prompts)]
        results: list[list[Generation] | None] = [None] * k
        pending: list[Op] = list(opens)
        while pending:
            nxt = []
            for op in pending:
                if not op.done:
                    nxt.append(op)
                    continue
                i, seq = op.tag, op.seq
                if op.kind == "open":
                    if n == 1:
                        nxt.append(self.generate(seq, limits[i], stops[i], samplings[i], tag=i))
                    else:
                        nxt.append(self.fork(seq, [[]] * n, limits[i], stops[i], samplings[i], tag=i))
                else:
                    results[i] = [op.result] if op.kind == "generate" else list(op.result)
                    self.close(seq)
            pending = nxt
            if pending:
                self._step_or_raise()
        return results

    def generate_one(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                     sampling: Sampling | None = None, n: int = 1) -> list[Generation]:
        """`generate(prompt, n=k)`: k samples of one prompt from one prefill."""
        return self.generate_many([prompt], max_new_tokens, stop, sampling, n=n)[0]
