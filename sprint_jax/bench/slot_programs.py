"""The slot engine's jitted programs, kept as the baseline the page pool is measured against
(`bench decode`'s paged vs slot step, `bench kernels`): a prefill chunk, a merge join's copy
(alone or fused after the join's tail tokens), and a decode call of `chunk` steps for the active
rows, over the two-level slot cache (`bench/slot_cache.py`). The engine runs on pages
(`sprint_jax.infer.programs`).

Each program takes its per-row arguments as one pytree (`PrefillRows`, `DecodeRows`: host numpy
arrays with a leading row axis, built by the scheduler in `sprint_jax.infer.engine`) and donates
the cache, which it updates in place. Under slot shards (data > 1, `sharding.slot_local`) every
row array is `parts` equal blocks and a program's body sees one block; slot ids stay global and
are taken modulo the slots the body holds. On a mesh every program is traced with the engine's
mesh as the active abstract mesh (`sharding.traced_on_mesh`, entered by `slot_local`), as a TPU
needs: a Mosaic kernel (the prefill's flash attention, the Pallas parent-prefix attention) runs
per shard inside a shard_map, never as one program XLA would partition.

Decode step. The rows are grouped by parent slot, [parent row, child rows...], and one attention
over the parent's cache serves the whole group (the children's queries ride along the query
axis, so each parent's prefix is read once per step for all its children); the children then
attend to their own suffixes, every row to its new token, and the partial attentions merge by
log-sum-exp (Hydragen). Attention reads only the used length of the cache (bucketed), never the
capacity. The layer scan carries no cache: each layer returns this step's new K/V (a few rows),
and the whole step's K/V is scattered into the donated cache after the scan, in place (no
per-step copy of the cache; tests/test_batch_engine.py checks the compiled HLO).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sprint_jax.infer import sharding as sh
from sprint_jax.infer.prefix_attention import axes_of
from sprint_jax.infer.programs import PackedRows, decode_loop, sample_rows
from sprint_jax.infer.sampling import mask_padded
from sprint_jax.bench.slot_cache import SlotCache, constrain, gather_rows, put_slots
from sprint_jax.model.attention import attend_partial_heads, flash_attention
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import attend_partial, decoder, embed, merge_partials, unembed

STOP_WIDTH = 8          # device-checked stop ids per row (EOS ids first, then one-token stop strings)
_NEVER = 1 << 30        # a span_end no query row reaches; a position every write drops


def _self_partial(q, k, v):
    """Each decode row's attention to its own new token (one query, one key: no mask)."""
    return attend_partial(q, k, v, jnp.ones(q.shape[:2] + k.shape[1:2], bool))


def _self_flash(q, k, v, n_valid):
    """A prefill chunk's attention to its own new keys (causal; only the first n_valid): the
    blockwise flash attention (model/attention.py) under the span rule, with lse for merging."""
    span_end = jnp.where(jnp.arange(q.shape[1])[None] < n_valid[:, None], jnp.int32(_NEVER), 0)
    return flash_attention(q, k, v, span_end, return_lse=True)


def _prefix_partial(q, k, v, n):
    """Each row's attention to the first n[r] of keys k, v [R, Hkv, S, D] (`gather_rows`) that all
    precede its queries (a parent prefix, a child's own past): flash attention with the queries
    placed after the keys (q_offset = n), keys from n on never visible. (flash_attention takes
    [R, S, Hkv, D]: a prefill chunk transposes the rows it gathered; prefill calls are few.)"""
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    span_end = jnp.where(jnp.arange(k.shape[1])[None] < n[:, None], jnp.int32(_NEVER), 0)
    return flash_attention(q, k, v, span_end, q_offset=n, return_lse=True)


# ---------------------------------------------------------------------------------------------
# Prefill: tokens [R, T] appended to R parent slots, or to R child slots (forced prefixes)
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillRows:
    """A prefill call's rows. Parent rows: tokens written into parent slot `slot` at positions
    start..start+n_valid. Child rows: into child slot `slot` of parent slot `parent`; the row sees
    the parent's first fork_len slots and its own first `start`; positions fork_len + start + t.
    pos_off: the sequence's slot-to-position shift after a merge join. Padding rows (n_valid 0,
    an out-of-range slot) write nothing."""
    tokens: np.ndarray      # [R, T]
    slot: np.ndarray
    parent: np.ndarray
    fork_len: np.ndarray
    start: np.ndarray
    n_valid: np.ndarray
    pos_off: np.ndarray

    @staticmethod
    def empty(rows: int, width: int, pad_slot: int) -> "PrefillRows":
        z = lambda: np.zeros(rows, np.int32)                 # noqa: E731
        return PrefillRows(np.zeros((rows, width), np.int32), np.full(rows, pad_slot, np.int32), z(), z(), z(), z(),
                           z())


@functools.partial(jax.jit, static_argnames=("config", "kind", "s_b", "c_b", "kv", "return_logits", "all_logits"),
                   donate_argnames=("cache",))
@sh.slot_local(rows=("rows",), out=lambda a: ("cache", "rows") if a["return_logits"] else "cache",
               cache_kv=(0, 0, 1, 1))
def prefill(params, config: Qwen2Config, cache: SlotCache, rows: PrefillRows, kind: str, s_b: int, c_b: int,
            kv=None, return_logits: bool = False, all_logits: bool = False):
    """Write `rows` (kind "parent" or "child", see PrefillRows) into the cache, reading s_b parent
    and c_b child slots per row. return_logits: also each row's logits at its last valid token
    [R, V] (a merge join's last); with all_logits, at every token [R, T, V] (teacher forcing)."""
    r, t = rows.tokens.shape
    slot = rows.slot % (cache.pk if kind == "parent" else cache.ck).shape[1]
    parent = rows.parent % cache.pk.shape[1]
    offs = rows.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]                  # [R, T]
    positions = (offs if kind == "parent" else offs + rows.fork_len[:, None]) + rows.pos_off[:, None]
    plen = rows.start if kind == "parent" else rows.fork_len

    def attend(q, k, v, layer):
        prow = slot if kind == "parent" else parent
        parts = [_prefix_partial(q, gather_rows(cache.pk, layer, prow, s_b),
                                 gather_rows(cache.pv, layer, prow, s_b), plen)]
        if kind == "child":
            parts.append(_prefix_partial(q, gather_rows(cache.ck, layer, slot, c_b),
                                         gather_rows(cache.cv, layer, slot, c_b), rows.start))
        parts.append(_self_flash(q, k, v, rows.n_valid))
        return merge_partials(parts)[0], (k, v)

    x = embed(params, config, rows.tokens)
    hidden, (nk, nv) = decoder(params, config, x, positions, attend, jnp.arange(config.num_hidden_layers))
    pos = jnp.where(jnp.arange(t)[None] < rows.n_valid[:, None], offs, _NEVER)       # padding: dropped
    if kind == "parent":
        out = SlotCache(put_slots(cache.pk, slot, pos, nk), put_slots(cache.pv, slot, pos, nv), cache.ck, cache.cv)
    else:
        out = SlotCache(cache.pk, cache.pv, put_slots(cache.ck, slot, pos, nk), put_slots(cache.cv, slot, pos, nv))
    out = constrain(out, kv)
    if not return_logits:
        return out
    if all_logits:
        return out, unembed(params, config, hidden)
    last = jnp.take_along_axis(hidden, jnp.clip(rows.n_valid - 1, 0, t - 1)[:, None, None], axis=1)
    return out, unembed(params, config, last)[:, 0]


@functools.partial(jax.jit, static_argnames=("w", "kv"), donate_argnames=("cache",))
@sh.slot_local(rows=("meta",), out="cache", cache_kv=(0, 0, 1, 1))
def copy_join(cache: SlotCache, meta, w: int, kv=None) -> SlotCache:
    """A merge join's copy: each child's slot rows into its parent's slot after the prefix, in
    child order, without running the model. meta [1, 2 + 2G] per slot shard (`Engine._join_meta`;
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
    ps = slot % n_par
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
    return constrain(SlotCache(pk, pv, cache.ck, cache.cv), kv)


_PREFILL_BODY = inspect.unwrap(prefill)            # the bodies, for programs fused into one call
_COPY_JOIN_BODY = inspect.unwrap(copy_join)


@functools.partial(jax.jit, static_argnames=("config", "s_b", "c_b", "w", "kv"), donate_argnames=("cache",))
@sh.slot_local(rows=("rows", "meta"), out=("cache", "rows"), cache_kv=(0, 0, 1, 1))
def merge(params, config: Qwen2Config, cache: SlotCache, rows: PrefillRows, meta, s_b: int, c_b: int, w: int,
          kv=None):
    """A merge join in one call: the children's never-computed tail tokens (child prefill rows
    with logits) then the copy of the children's rows into the parent slot (`copy_join`'s body).
    Returns (cache, logits [R, V] at each row's last tail token)."""
    cache, logits = _PREFILL_BODY(params, config, cache, rows, kind="child", s_b=s_b, c_b=c_b, kv=kv,
                                  return_logits=True)
    return _COPY_JOIN_BODY(cache, meta, w=w, kv=kv), logits


# ---------------------------------------------------------------------------------------------
# Decode: `chunk` steps for the active rows only, on device
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeRows(PackedRows):
    """A decode call's rows: A generate rows (each on its parent slot a_slot), then F fork groups
    of w rows (group i: children of parent slot b_pslot[i], read-only, forked at b_fork[i], in
    child slots b_cslot), B = A + F*w. Per row: lengths = KV entries of its own slot (parent slot
    or child suffix), the pending token, whether it decodes (active), its token budget, device
    stop ids, sampling (seed, key branch, steps so far, temperature, top_k, top_p), forced tokens
    taken before it samples (forced[:, :n_forced]), the slot-to-position shift pos_off, and
    feed_last (a merge join follows: see `decode`). `empty` gives neutral values.

    The rows travel to `decode` packed (`pack`): the per-row [B, ...] fields as one int32 and one
    float32 array, because every array argument of a jitted call is a host-to-device transfer of
    its own at dispatch: fifteen of them cost ~0.3 ms more per decode call than two on the demo's
    model on CPU (0.73 vs 0.44 ms for a one-token call), about 8% of a demo-shaped workload."""
    a_slot: np.ndarray        # [A]
    b_pslot: np.ndarray       # [F]
    b_fork: np.ndarray        # [F]
    b_cslot: np.ndarray       # [F * w]
    lengths: np.ndarray       # [B] ...
    pending: np.ndarray
    active: np.ndarray        # bool
    remaining: np.ndarray
    stop_ids: np.ndarray      # [B, STOP_WIDTH]
    seeds: np.ndarray
    branch: np.ndarray
    steps: np.ndarray
    temperature: np.ndarray   # float32
    top_k: np.ndarray
    top_p: np.ndarray         # float32
    forced: np.ndarray        # [B, forced width]
    n_forced: np.ndarray
    pos_off: np.ndarray
    feed_last: np.ndarray     # bool

    @staticmethod
    def empty(na: int, nf: int, w: int, forced_width: int, pad_parent: int, pad_child: int) -> "DecodeRows":
        b = na + nf * w
        z = lambda: np.zeros(b, np.int32)                    # noqa: E731
        return DecodeRows(
            a_slot=np.full(na, pad_parent, np.int32), b_pslot=np.full(nf, pad_parent, np.int32),
            b_fork=np.zeros(nf, np.int32), b_cslot=np.full(nf * w, pad_child, np.int32),
            lengths=z(), pending=z(), active=np.zeros(b, bool), remaining=np.ones(b, np.int32),
            stop_ids=np.full((b, STOP_WIDTH), -2, np.int32), seeds=z(), branch=z(), steps=z(),
            temperature=np.zeros(b, np.float32), top_k=z(), top_p=np.ones(b, np.float32),
            forced=np.zeros((b, forced_width), np.int32), n_forced=z(), pos_off=z(), feed_last=np.zeros(b, bool))



@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeOut:
    """What `decode` returns: the cache; per row the emitted tokens [B, chunk + F] (-1 = none),
    reason codes [B] (1 stop id / EOS, 2 length) and each emitted token's log-prob [B, chunk + F]
    fp32; the steps the call ran (scalar); with `feeding` the kept logits [B, V] (else None); with
    top_logprobs = n the n most likely ids and their log-probs per emitted token [B, chunk + F, n]
    (else None)."""
    cache: SlotCache
    tokens: jax.Array
    reason: jax.Array
    steps: jax.Array
    logprobs: jax.Array
    kept: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def _decode_fields(feeding: bool, top_logprobs: int) -> tuple[tuple[str, str], ...]:
    """The `DecodeOut` fields a decode call sets, in order, each with the kind `sh.slot_local`
    maps it by under slot shards ("cache", "rows", "max")."""
    return ((("cache", "cache"), ("tokens", "rows"), ("reason", "rows"), ("steps", "max"), ("logprobs", "rows"))
            + (("kept", "rows"),) * bool(feeding) + (("top_ids", "rows"), ("top_logprobs", "rows")) * bool(top_logprobs))


def parent_prefix_attention(pk: jax.Array, pv: jax.Array, layer, pslot: jax.Array, q: jax.Array,
                            plen: jax.Array, s_b: int, attention_impl: str = "xla", kv=None):
    """The shared-prefix attention of a step: group i's W queries q[i] [G, W, H, D] attend to the
    first plen[i, w] slots of parent slot pslot[i] (pk, pv [L, P, Hkv, Sp, D]). Each parent's
    prefix is read once for all W queries of its group (they ride on the query axis), never
    once per query. Returns (out [G, W, H, D], lse [G, W, H]) for `merge_partials`.
    attention_impl "pallas" runs `prefix_attention.pallas_parent_prefix_attention` instead (one
    call for all groups, each prefix read in place, never gathered; per shard over `kv`'s mesh)."""
    if attention_impl == "pallas":
        return pallas_parent_prefix_attention(q, pk, pv, layer, pslot, plen, kv)
    mask = jnp.arange(s_b)[None, None, :] < plen[:, :, None]                        # [G, W, S_b]
    return attend_partial_heads(q, gather_rows(pk, layer, pslot, s_b), gather_rows(pv, layer, pslot, s_b), mask)


@sh.slot_local(rows=("rows",), out=lambda a: tuple(k for _, k in _decode_fields(a["feeding"], a["top_logprobs"])),
               cache_kv=(0, 0, 1, 1))
def _decode_body(params, config: Qwen2Config, cache: SlotCache, rows, layout: tuple, chunk: int, s_b: int, c_b: int,
                 kv=None, attention_impl: str = "xla", n_valid: int | None = None, feeding: bool = False,
                 top_logprobs: int = 0):
    """Up to `chunk` decode steps of every active row (`rows, layout = DecodeRows.pack()`), reading
    s_b parent and c_b child slots per row. Forced tokens: step k < n_forced writes the pending token's KV and makes
    forced[k] pending; it emits nothing and is not one of the row's generated steps (its sampling
    key, budget and stops start after them), as if the tokens had been prefilled; nor does it
    count against `chunk` (a row runs up to n_forced + chunk steps per call), so a prompt or an
    opening that rides a decode chunk costs no extra host round trip.
    feeding (static; the rows' feed_last on): a row with feed_last that finishes on device (stop
    id, EOS, length) runs one more step that only feeds its last token: its KV is written and its
    logits (before the padded ids are masked) are kept; the token that step samples is dropped. A
    merge join's children so hold their close tag's KV, and the last one its join logits.
    Returns a flat tuple, the `DecodeOut` fields `_decode_fields` lists (`decode` names them):
    the cache, the emitted tokens [B, chunk + F] (-1 = none), per-row reason codes (1 stop id /
    EOS, 2 length), the steps run, each emitted token's log-prob [B, chunk + F] fp32
    (`_sample_rows`: under the distribution it was drawn from; computed here from the logits the
    step holds, so it costs no transfer but its [B, chunk + F] floats), with feeding the kept logits
    [B, V], and with top_logprobs = n (static) the n most likely ids and their log-probs per
    emitted token [B, chunk + F, n] (a second compiled variant, used only when a request asks)."""
    r = DecodeRows.unpack(rows, layout)
    na, nf = r.a_slot.shape[0], r.b_pslot.shape[0]
    w = r.b_cslot.shape[0] // max(nf, 1)
    a_slot = r.a_slot % cache.pk.shape[1]              # global slot ids -> this call's
    b_pslot = r.b_pslot % cache.pk.shape[1]
    b_cslot = r.b_cslot % cache.ck.shape[1]
    fork_of_row = jnp.concatenate([jnp.zeros(na, jnp.int32), jnp.repeat(r.b_fork, w)])   # [B]
    base = jax.vmap(lambda s, j: jax.random.fold_in(jax.random.key(s), j))(r.seeds, r.branch)

    def one_step(cache, lengths, pending, active, steps, fed):
        positions = (fork_of_row + lengths + r.pos_off)[:, None]                  # [B, 1]
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
                                                   jnp.broadcast_to(r.b_fork[:, None], (nf, w)), s_b,
                                                   attention_impl, kv)
                c_mask = jnp.arange(c_b)[None, None, :] < lb[:, None, None]            # [F*w, 1, C_b]
                suffix = attend_partial_heads(q[na:], gather_rows(cache.ck, layer, b_cslot, c_b),
                                              gather_rows(cache.cv, layer, b_cslot, c_b), c_mask)
                prefix = (o_p.reshape(nf * w, 1, h, d), l_p.reshape(nf * w, 1, h))
                outs.append(merge_partials([prefix, suffix, (o_s[na:], l_s[na:])])[0])
            return (jnp.concatenate(outs) if len(outs) > 1 else outs[0]), (k, v)

        x = embed(params, config, pending[:, None])
        hidden, (nk, nv) = decoder(params, config, x, positions, attend, jnp.arange(config.num_hidden_layers))
        nk, nv = nk[:, :, 0], nv[:, :, 0]                                            # [L, B, Hkv, D]
        pos = jnp.where(active | fed, lengths, _NEVER)
        pk, pv, ck, cv = cache.pk, cache.pv, cache.ck, cache.cv
        if na:
            pk = put_slots(pk, a_slot, pos[:na], nk[:, :na])
            pv = put_slots(pv, a_slot, pos[:na], nv[:, :na])
        if nf:
            ck = put_slots(ck, b_cslot, pos[na:], nk[:, na:])
            cv = put_slots(cv, b_cslot, pos[na:], nv[:, na:])
        raw = unembed(params, config, hidden)[:, 0]
        logits = mask_padded(raw, n_valid)                                        # no padded ids
        tok, lp, top_ids, top_lp = sample_rows(logits, base, steps, r.temperature, r.top_k, r.top_p, top_logprobs)
        return constrain(SlotCache(pk, pv, ck, cv), kv), tok, raw, (lp, top_ids, top_lp)

    return decode_loop(one_step, cache, r, chunk, config.vocab_size, feeding, top_logprobs)


@functools.partial(jax.jit, static_argnames=("config", "layout", "chunk", "s_b", "c_b", "kv", "attention_impl",
                                             "n_valid", "feeding", "top_logprobs"),
                   donate_argnames=("cache",))
def decode(params, config: Qwen2Config, cache: SlotCache, rows, layout: tuple, chunk: int, s_b: int, c_b: int,
           kv=None, attention_impl: str = "xla", n_valid: int | None = None, feeding: bool = False,
           top_logprobs: int = 0) -> DecodeOut:
    """Up to `chunk` decode steps of every active row (`_decode_body`); returns a `DecodeOut`
    (the optional fields set by `feeding` and `top_logprobs`)."""
    res = _decode_body(params, config, cache, rows, layout=layout, chunk=chunk, s_b=s_b, c_b=c_b, kv=kv,
                       attention_impl=attention_impl, n_valid=n_valid, feeding=feeding, top_logprobs=top_logprobs)
    return DecodeOut(**{name: x for (name, _), x in zip(_decode_fields(feeding, top_logprobs), res, strict=True)})


@jax.jit
def row_of(x: jax.Array, i) -> jax.Array:
    """x[i] as one jitted call (eager indexing dispatches several ops: ~0.2 ms on the latency path)."""
    return x[i]


# ---------------------------------------------------------------------------------------------
# The slot cache's parent-prefix attention on the Pallas path, per shard under a mesh
# ---------------------------------------------------------------------------------------------
def _kernel(q, pk, pv, layer, pslot, plen, slot_axes: tuple[str, ...] = ()):
    """The kernel on (a shard of) the parent cache pk, pv [L, P, Hkv, S, D]."""
    from sprint_jax.kernels.parent_prefix import grouped_prefix_attention, lowers_for

    n_layers, slots = pk.shape[:2]
    if slot_axes:   # this shard holds slots [index * slots, (index + 1) * slots)
        local = pslot - jax.lax.axis_index(slot_axes) * slots
        here = (local >= 0) & (local < slots)
        plen = jnp.where(here[:, None], plen, 0)
        pslot = jnp.clip(local, 0, slots - 1)
    rows = layer * slots + jnp.clip(pslot, 0, slots - 1)
    flat = (n_layers * slots,) + pk.shape[2:]                      # a view: [L*P, Hkv, S, D]
    body = lambda platform, interpret: lambda *a: grouped_prefix_attention(  # noqa: E731
        *a, platform=platform, interpret=interpret, heads_first=True)
    # Chosen when the step is lowered: Triton on GPUs, Mosaic on TPUs, the interpreter elsewhere,
    # so one jitted step also lowers (e.g. under jax.export) for a platform it does not run on.
    # A platform whose kernel does not take this head layout is left out unless it is the one we
    # run on (there the kernel's own error names the problem; no silent interpreter on a GPU).
    backend = jax.default_backend()
    runs_on = {"gpu": backend in ("gpu", "cuda", "rocm"), "tpu": backend == "tpu"}
    d, hkv = q.shape[-1], pk.shape[2]
    branches = {name: body(plat, False) for name, plat in (("cuda", "gpu"), ("rocm", "gpu"), ("tpu", "tpu"))
                if lowers_for(plat, d, hkv, heads_first=True) or runs_on[plat]}
    o, lse = jax.lax.platform_dependent(q, pk.reshape(flat), pv.reshape(flat), rows, plen,
                                        default=body("gpu", True), **branches)
    if slot_axes:
        o = jax.lax.psum(o.astype(jnp.float32), slot_axes).astype(q.dtype)
        lse = jax.lax.pmax(lse, slot_axes)
    return o, lse


def pallas_parent_prefix_attention(q, pk, pv, layer, pslot, plen, kv=None):
    """q [Rg, W, H, D] (the rows of each group); pk, pv [L, P, Hkv, S, D] (the parent cache);
    layer: the layer index; pslot [Rg]: each group's parent slot (out of range = a padding group,
    with plen 0); plen [Rg, W]: keys each row sees. kv: the engine's (parent, child)
    NamedShardings on a mesh (None: one device). Returns (out [Rg, W, H, D], lse [Rg, W, H])."""
    if kv is None:
        from sprint_jax.infer.sharding import local_head_axes
        mesh = jax.sharding.get_abstract_mesh()
        auto = frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                         if t != jax.sharding.AxisType.Manual)
        if mesh.empty or not auto:
            return _kernel(q, pk, pv, layer, pslot, plen)
        # Traced per slot shard (`sharding.slot_local`, the slot axes manual): the other mesh
        # axes are still automatic there, and a Mosaic kernel must sit fully inside a shard_map
        # (one XLA would partition is refused, and the interpreter's loops would hold
        # collectives). So a nested shard_map over every remaining axis: per KV head shard
        # where the heads are split (`local_head_axes`), a replicated call on each device else.
        head = local_head_axes()
        axes = axes_of(head)
        if q.shape[2] % math.prod(mesh.shape[a] for a in axes):
            raise ValueError(f"{q.shape[2]} query heads do not split over {axes} like the KV heads")
        run = jax.shard_map(
            lambda q, pk, pv, layer, pslot, plen: _kernel(q, pk, pv, layer, pslot, plen),
            mesh=mesh, axis_names=auto,
            in_specs=(P(None, None, head, None), P(None, None, head, None, None), P(None, None, head, None, None),
                      P(), P(None), P(None, None)),
            out_specs=(P(None, None, head, None), P(None, None, head)), check_vma=False)
        return run(q, pk, pv, jnp.asarray(layer, jnp.int32), pslot, plen)
    sharding = kv[0]
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (5 - len(sharding.spec))
    slot_axes = axes_of(spec[1])
    head_axes = axes_of(spec[2])
    heads = math.prod(mesh.shape[a] for a in head_axes)
    hq = head_axes if head_axes and q.shape[2] % heads == 0 else ()
    if head_axes and not hq:
        raise ValueError(f"{q.shape[2]} query heads do not split over {head_axes} like the KV heads")
    head = (hq if len(hq) > 1 else hq[0]) if hq else None
    run = jax.shard_map(
        lambda q, pk, pv, layer, pslot, plen: _kernel(q, pk, pv, layer, pslot, plen, slot_axes),
        mesh=mesh,
        in_specs=(P(None, None, head, None), P(*spec), P(*spec), P(), P(None), P(None, None)),
        out_specs=(P(None, None, head, None), P(None, None, head)), check_vma=False)
    return run(q, pk, pv, jnp.asarray(layer, jnp.int32), pslot, plen)
