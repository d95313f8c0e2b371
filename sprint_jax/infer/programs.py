"""The engine's jitted programs over the paged KV pool: a prefill chunk, a merge join (the
children's tail tokens and the copy of their tokens into the parent), and a decode call of
`chunk` steps for the active rows.

Every row reaches the pool through a page table (`sprint_jax.infer.pages`): global page ids, the
pool's [L, Hkv, pages, page_size, D] arrays read by `paged_attention.paged_partial` (whole pages,
gathered in order) and written by `pages.scatter_pages`. Each program takes its per-row arguments
as one pytree (`PrefillRows`, `CopyRows`, `DecodeRows`: host numpy arrays with a leading row
axis, built by the scheduler in `sprint_jax.infer.scheduler`) and donates the pool, which it
updates in place. Pages over data (data > 1, `sharding.slot_local`): every row array is `parts`
equal blocks, a program's body sees one block and its shard's pages; page ids stay global and are
taken modulo the pages the body holds (a sequence's pages all lie in its shard).

Decode step. Rows come as generate rows (a sequence decoding on itself: its whole table) and
sibling groups (the children of a fork, w rows each): a group's shared prefix (the parent's
full pages at the fork, `pages.Fork.shared_len`) is one page table read once per step for all
its rows (their queries ride one query axis); each child then attends to its own pages after
that prefix (the copied partly filled page and its own tokens), every row to its new token, and
the partial attentions merge by log-sum-exp (Hydragen). Reads cover the used pages only (a page
bucket), never the pool. The layer scan carries no pool: each layer returns this step's new K/V
(a few rows), scattered into the donated pool after the scan, in place.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer import sharding as sh
from sprint_jax.infer.pages import KVPages, constrain_pool, gather_pages, move_tokens, scatter_pages
from sprint_jax.infer.paged_attention import paged_partial
from sprint_jax.infer.prefix_attention import pallas_paged_prefix_attention
from sprint_jax.infer.sampling import advance_rows, filtered_logits, mask_padded
from sprint_jax.model.attention import attend_partial, flash_attention
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import decoder, embed, merge_partials, unembed

STOP_WIDTH = 8          # device-checked stop ids per row (EOS ids first, then one-token stop strings)
_NEVER = 1 << 30        # a span_end no query row reaches
POOL_DIMS = (2, 1)      # the pool's (pages, KV heads) axes, for `sharding.slot_local`


def local_pages(table: jax.Array, n_pages: int) -> jax.Array:
    """Global page ids -> the ids of the pool (shard) of n_pages pages; a negative id (table
    padding) -> n_pages, out of range: never written (`scatter_pages` drops it), read clipped and
    masked by the row's length."""
    return jnp.where(table < 0, n_pages, table % n_pages)


def _pin(pool: KVPages, kv) -> KVPages:
    """The pool pinned to its sharding (kv: the engine's (pool sharding,); None: as it is)."""
    return constrain_pool(pool, None if kv is None else kv[0])


def _self_partial(q, k, v):
    """Each decode row's attention to its own new token (one query, one key: no mask)."""
    return attend_partial(q, k, v, jnp.ones(q.shape[:2] + k.shape[1:2], bool))


def _self_flash(q, k, v, n_valid):
    """A prefill chunk's attention to its own new keys (causal; only the first n_valid): the
    blockwise flash attention (model/attention.py) under the span rule, with lse for merging."""
    span_end = jnp.where(jnp.arange(q.shape[1])[None] < n_valid[:, None], jnp.int32(_NEVER), 0)
    return flash_attention(q, k, v, span_end, return_lse=True)


def _prefix_flash(q, pool: KVPages, layer, table, n):
    """A prefill chunk's attention to the first n[r] tokens of each row's pages (all before its
    queries q [R, T, H, D]): the pages gathered in token order, then the blockwise flash attention
    with the queries placed after the keys (q_offset = n), so the scores are never held whole (a
    7B chunk of 256 tokens over 32k cached tokens would hold ~1.4 GB of fp32 scores per row).
    flash_attention takes [R, S, Hkv, D]: the gathered pages are transposed (prefill calls are few)."""
    k, v = (jnp.transpose(gather_pages(a, layer, table), (1, 2, 0, 3)) for a in (pool.k, pool.v))
    span_end = jnp.where(jnp.arange(k.shape[1])[None] < n[:, None], jnp.int32(_NEVER), 0)
    return flash_attention(q, k, v, span_end, q_offset=n, return_lse=True)


# ---------------------------------------------------------------------------------------------
# Prefill: tokens [R, T] written through R page tables
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillRows:
    """A prefill call's rows: tokens [R, T] written at table positions start[r] + t (t <
    n_valid[r]) through page tables table [R, M]; each row sees its first start[r] tokens (a
    parent's past, or a child's: its fork's prefix and its own). Token i of a table sits at model
    position i + pos_off (the sequence's shift after a merge join). Padding rows: n_valid 0."""
    tokens: np.ndarray      # [R, T]
    table: np.ndarray       # [R, M]
    start: np.ndarray
    n_valid: np.ndarray
    pos_off: np.ndarray

    @staticmethod
    def empty(rows: int, width: int, pages: int) -> "PrefillRows":
        z = lambda: np.zeros(rows, np.int32)                 # noqa: E731
        return PrefillRows(np.zeros((rows, width), np.int32), np.full((rows, pages), -1, np.int32), z(), z(), z())


def _prefill_body(params, config: Qwen2Config, pool: KVPages, rows: PrefillRows, kv=None, return_logits=False,
                  all_logits=False):
    r, t = rows.tokens.shape
    table = local_pages(rows.table, pool.num_pages)          # global page ids -> this shard's
    offs = rows.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]                 # [R, T]

    def attend(q, k, v, layer):
        prefix = _prefix_flash(q, pool, layer, table, rows.start)
        return merge_partials([prefix, _self_flash(q, k, v, rows.n_valid)])[0], (k, v)

    x = embed(params, config, rows.tokens)
    hidden, (nk, nv) = decoder(params, config, x, offs + rows.pos_off[:, None], attend,
                               jnp.arange(config.num_hidden_layers))
    pos = jnp.where(jnp.arange(t)[None] < rows.n_valid[:, None], offs, -1)          # padding: dropped
    out = _pin(KVPages(scatter_pages(pool.k, table, pos, nk), scatter_pages(pool.v, table, pos, nv)), kv)
    if not return_logits:
        return out
    if all_logits:
        return out, unembed(params, config, hidden)
    last = jnp.take_along_axis(hidden, jnp.clip(rows.n_valid - 1, 0, t - 1)[:, None, None], axis=1)
    return out, unembed(params, config, last)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillOut:
    """What `prefill` and `merge` return: the pool, and the logits asked for (None: none): [R, V]
    at each row's last valid token, or with all_logits [R, T, V] at every token."""
    pool: KVPages
    logits: jax.Array | None = None


@sh.slot_local(rows=("rows",), out=("cache", "rows"), cache_kv=(0, 0), dims=POOL_DIMS)
def _prefill_local(params, config: Qwen2Config, cache: KVPages, rows: PrefillRows, kv=None, all_logits: bool = False):
    return _prefill_body(params, config, cache, rows, kv, True, all_logits)


@sh.slot_local(rows=("rows",), out="cache", cache_kv=(0, 0), dims=POOL_DIMS)
def _prefill_write(params, config: Qwen2Config, cache: KVPages, rows: PrefillRows, kv=None):
    return _prefill_body(params, config, cache, rows, kv)


@functools.partial(jax.jit, static_argnames=("config", "kv", "return_logits", "all_logits"), donate_argnames=("pool",))
def prefill(params, config: Qwen2Config, pool: KVPages, rows: PrefillRows, kv=None, return_logits: bool = False,
            all_logits: bool = False) -> PrefillOut:
    """Write `rows` (see PrefillRows) into the pool; a `PrefillOut`. return_logits: with each row's
    logits at its last valid token [R, V] (a merge join's last); with all_logits, at every token
    [R, T, V] (teacher forcing)."""
    if not return_logits:
        return PrefillOut(_prefill_write(params, config, pool, rows, kv=kv))
    return PrefillOut(*_prefill_local(params, config, pool, rows, kv=kv, all_logits=all_logits))


# ---------------------------------------------------------------------------------------------
# Merge join: tokens copied between page tables, alone or after the children's tails
# ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CopyRows:
    """Token copies, one row per child of a merge: row r's token at table position src_pos[r, t]
    of src_table[r] goes to position dst_pos[r, t] of dst_table[r] (dst_pos < 0: padding)."""
    src_table: np.ndarray   # [R, Ms]
    src_pos: np.ndarray     # [R, T]
    dst_table: np.ndarray   # [R, Md]
    dst_pos: np.ndarray     # [R, T]

    @staticmethod
    def empty(rows: int, width: int, src_pages: int, dst_pages: int) -> "CopyRows":
        return CopyRows(np.full((rows, src_pages), -1, np.int32), np.zeros((rows, width), np.int32),
                        np.full((rows, dst_pages), -1, np.int32), np.full((rows, width), -1, np.int32))


def _copy_body(pool: KVPages, copy: CopyRows, kv=None) -> KVPages:
    n_pages = pool.num_pages
    src, dst = local_pages(copy.src_table, n_pages), local_pages(copy.dst_table, n_pages)
    return _pin(KVPages(*(move_tokens(a, src, copy.src_pos, dst, copy.dst_pos) for a in (pool.k, pool.v))), kv)


@functools.partial(jax.jit, static_argnames=("kv",), donate_argnames=("cache",))
@sh.slot_local(rows=("copy",), out="cache", cache_kv=(0, 0), dims=POOL_DIMS)
def copy_join(cache: KVPages, copy: CopyRows, kv=None) -> KVPages:
    """A merge join's copy alone: each child's tokens after the fork into the parent's pages, in
    child order (`CopyRows`), without running the model. The destination pages must be held by
    the parent alone (`PageAllocator.prepare_write`)."""
    return _copy_body(cache, copy, kv)


@sh.slot_local(rows=("rows", "copy"), out=("cache", "rows"), cache_kv=(0, 0), dims=POOL_DIMS)
def _merge_local(params, config: Qwen2Config, cache: KVPages, rows: PrefillRows, copy: CopyRows, kv=None):
    pool, logits = _prefill_body(params, config, cache, rows, kv, return_logits=True)
    return _copy_body(pool, copy, kv), logits


@functools.partial(jax.jit, static_argnames=("config", "kv"), donate_argnames=("pool",))
def merge(params, config: Qwen2Config, pool: KVPages, rows: PrefillRows, copy: CopyRows, kv=None) -> PrefillOut:
    """A merge join in one call: the children's never-computed tail tokens (prefill rows through
    the children's tables, with logits) then the copy (`copy_join`'s body). A `PrefillOut` with
    the logits [R, V] at each row's last tail token."""
    return PrefillOut(*_merge_local(params, config, pool, rows, copy, kv=kv))


# ---------------------------------------------------------------------------------------------
# Decode: `chunk` steps for the active rows only, on device
# ---------------------------------------------------------------------------------------------
class PackedRows:
    """Rows that travel to a decode call packed: their first `LEAD` fields (tables or slot ids)
    as they are, the per-row [B, ...] fields after them as one int32 and one float32 array
    (`pack`), because every array argument of a jitted call is a host-to-device transfer of its
    own at dispatch (fifteen of them cost ~0.3 ms more per decode call than two on the demo's model
    on CPU)."""
    LEAD = 4

    def pack(self) -> tuple[tuple[np.ndarray, ...], tuple]:
        """((the lead fields..., ints [B, *], floats [B, *]), layout): the per-row fields side by
        side in field order, integer and bool ones in `ints`, float ones in `floats`; `layout`
        (static, hashable) is what `unpack` needs to take them apart."""
        b = self.lengths.shape[0]
        ints, floats, layout = [], [], []
        for f in dataclasses.fields(self)[self.LEAD:]:
            a = np.asarray(getattr(self, f.name))
            (floats if a.dtype == np.float32 else ints).append(a.reshape(b, -1))
            layout.append((f.name, a.shape[1:], a.dtype.str))
        cat = lambda xs, dt: np.concatenate(xs, axis=1).astype(dt, copy=False)     # noqa: E731
        lead = tuple(getattr(self, f.name) for f in dataclasses.fields(self)[:self.LEAD])
        return lead + (cat(ints, np.int32), cat(floats, np.float32)), tuple(layout)

    @classmethod
    def unpack(cls, packed, layout: tuple):
        """The rows `pack` packed (on device, inside a program)."""
        *lead, ints, floats = packed
        fields, at = {}, {"i": 0, "f": 0}
        for name, shape, dt in layout:
            width = int(np.prod(shape)) if shape else 1
            src, key = (floats, "f") if np.dtype(dt) == np.float32 else (ints, "i")
            col = src[:, at[key]: at[key] + width].reshape((src.shape[0],) + tuple(shape))
            at[key] += width
            fields[name] = col > 0 if np.dtype(dt) == np.bool_ else col
        return cls(*lead, **fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeRows(PackedRows):
    """A decode call's rows: A generate rows (row a reads and writes pages a_table[a]), then F
    sibling groups of w rows (group i shares the first b_glen[i] tokens, pages b_gtable[i], read
    once for its rows; its row c reads and writes its own pages after them, b_table[i*w + c]),
    B = A + F*w. Per row: lengths = tokens in its own table (a generate row: all its tokens; a
    child: those after the shared prefix), the pending token, whether it decodes (active), its
    token budget, device stop ids, sampling (seed, key branch, steps so far, temperature, top_k,
    top_p), forced tokens taken before it samples (forced[:, :n_forced]), the position shift
    pos_off (model position = shared + lengths + pos_off), and feed_last (a merge join follows:
    see `decode`). `empty` gives neutral values (padding rows write nothing). Packed for the call
    (`PackedRows`)."""
    a_table: np.ndarray       # [A, Ma]
    b_gtable: np.ndarray      # [F, Mg]
    b_glen: np.ndarray        # [F]
    b_table: np.ndarray       # [F * w, Mr]
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
    def empty(na: int, nf: int, w: int, forced_width: int, ma: int = 1, mg: int = 1, mr: int = 1) -> "DecodeRows":
        b = na + nf * w
        z = lambda: np.zeros(b, np.int32)                    # noqa: E731
        return DecodeRows(
            a_table=np.full((na, ma), -1, np.int32), b_gtable=np.full((nf, mg), -1, np.int32),
            b_glen=np.zeros(nf, np.int32), b_table=np.full((nf * w, mr), -1, np.int32),
            lengths=z(), pending=z(), active=np.zeros(b, bool), remaining=np.ones(b, np.int32),
            stop_ids=np.full((b, STOP_WIDTH), -2, np.int32), seeds=z(), branch=z(), steps=z(),
            temperature=np.zeros(b, np.float32), top_k=z(), top_p=np.ones(b, np.float32),
            forced=np.zeros((b, forced_width), np.int32), n_forced=z(), pos_off=z(), feed_last=np.zeros(b, bool))



def sample_rows(logits, base, steps, temperature, top_k, top_p, top_n: int = 0):
    """Per-row sampling (temperature 0 = argmax); the sorting path, and the per-step keys
    fold_in(base, steps), run only when a row samples. Returns (tokens [B], their log-probs [B]
    fp32, and with top_n > 0 the top_n ids [B, n] and log-probs [B, n] of the same distribution).
    The distribution is the one the token was drawn from: log softmax of logits / temperature after
    top-k / top-p for a sampled row (what an importance ratio needs); a greedy row's is the model's
    own at temperature 1 (the argmax is a point mass, whose log-prob 0 says nothing)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    plain = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)

    def sampled():
        keys = jax.vmap(jax.random.fold_in)(base, steps)
        dist = jax.vmap(lambda lg, t, tk, tp: filtered_logits(lg[None], t, tk, tp)[0])(
            logits, temperature, top_k, top_p)
        tok = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys, dist).astype(jnp.int32)
        drawn = temperature > 0
        lp = dist - jax.nn.logsumexp(dist, axis=-1, keepdims=True)
        return jnp.where(drawn, tok, greedy), jnp.where(drawn[:, None], lp, plain)
    # the same branch on every slot shard: the sampled one gathers the vocabulary over tensor
    tok, dist_lp = jax.lax.cond(sh.any_slot_shard(jnp.any(temperature > 0)), sampled, lambda: (greedy, plain))
    lp = jnp.take_along_axis(dist_lp, tok[:, None], axis=-1)[:, 0]
    if not top_n:
        return tok, lp, None, None
    top_lp, top_ids = jax.lax.top_k(dist_lp, top_n)
    return tok, lp, top_ids.astype(jnp.int32), top_lp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeOut:
    """What `decode` returns: the pool; per row the emitted tokens [B, chunk + F] (-1 = none),
    reason codes [B] (1 stop id / EOS, 2 length) and each emitted token's log-prob [B, chunk + F]
    fp32; the steps the call ran (scalar); with `feeding` the kept logits [B, V] (else None); with
    top_logprobs = n the n most likely ids and their log-probs per emitted token [B, chunk + F, n]
    (else None)."""
    pool: KVPages
    tokens: jax.Array
    reason: jax.Array
    steps: jax.Array
    logprobs: jax.Array
    kept: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def _decode_fields(feeding: bool, top_logprobs: int) -> tuple[tuple[str, str], ...]:
    """The `DecodeOut` fields a decode call sets, in order, each with the kind `sh.slot_local`
    maps it by under page shards ("cache", "rows", "max")."""
    return ((("pool", "cache"), ("tokens", "rows"), ("reason", "rows"), ("steps", "max"), ("logprobs", "rows"))
            + (("kept", "rows"),) * bool(feeding) + (("top_ids", "rows"), ("top_logprobs", "rows")) * bool(top_logprobs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeCarry:
    """The decode loop's state (`jax.lax.while_loop`'s carry), per row [B, ...] but `i` (the step)
    and `state` (the KV store the steps write: the pool, or the slot baseline's cache): each row's
    tokens of K/V, pending token, whether it still decodes, its token budget and sampled steps, the
    emitted tokens and reason codes so far, whether it feeds its last token this step (`fed`), the
    logits kept from such a step, and the emitted tokens' log-probs (with the top ids / log-probs,
    [.., 0] wide when not asked for)."""
    i: jax.Array
    state: object
    lengths: jax.Array
    pending: jax.Array
    active: jax.Array
    remaining: jax.Array
    steps: jax.Array
    out: jax.Array
    reason: jax.Array
    fed: jax.Array
    kept: jax.Array
    lps: jax.Array
    top_ids: jax.Array
    top_lps: jax.Array


def decode_loop(one_step, state, r, chunk: int, vocab_size: int, feeding: bool, top_logprobs: int) -> tuple:
    """Up to `chunk` decode steps of every active row of `r` (a DecodeRows-like pytree with
    lengths, pending, active, remaining, stop_ids, steps, forced, n_forced, feed_last), as
    `_decode_body` documents them; `one_step(state, lengths, pending, active, steps, fed)` runs one
    model step of every row and returns (state, sampled tokens, raw logits, (log-probs, top ids,
    top log-probs)). Returns the flat tuple `_decode_fields` names (state first)."""
    b = r.lengths.shape[0]
    forced, n_forced = r.forced, r.n_forced
    out = jnp.full((b, chunk + forced.shape[1]), -1, jnp.int32)     # step i's token in column i
    steps_cap = chunk + n_forced                      # a row's forced steps do not count against the chunk
    top_shape = out.shape + (top_logprobs,)
    kept0 = jnp.zeros((b, vocab_size if feeding else 0), jnp.float32)
    lps0, top_ids0, top_lps0 = (jnp.zeros(out.shape, jnp.float32), jnp.zeros(top_shape, jnp.int32),
                                jnp.zeros(top_shape, jnp.float32))

    def cond(c: DecodeCarry):           # the same trip count on every shard (see any_slot_shard)
        return sh.any_slot_shard(jnp.any(c.active & (c.i < steps_cap)) | jnp.any(c.fed))

    def body(c: DecodeCarry) -> DecodeCarry:
        i = c.i
        state, tok, raw, (lp, top_ids, top_lp) = one_step(c.state, c.lengths, c.pending, c.active, c.steps, c.fed)
        lps, tids, tlps = c.lps.at[:, i].set(lp, mode="drop"), c.top_ids, c.top_lps
        if top_logprobs:
            tids, tlps = tids.at[:, i].set(top_ids, mode="drop"), tlps.at[:, i].set(top_lp, mode="drop")
        kept = c.kept
        if feeding:                   # the rows fed their last token this step: its logits kept
            kept = jnp.where(c.fed[:, None], raw.astype(jnp.float32), kept)
        active = c.active & (i < steps_cap)           # a step past the chunk only feeds
        forcing = active & (i < n_forced)
        sampling = active & ~forcing
        tok, finished, remaining, reason, lengths, pending = advance_rows(
            tok, sampling, r.stop_ids, c.remaining, c.reason, c.lengths, c.pending)
        nxt = forced[:, jnp.minimum(i, forced.shape[1] - 1)]
        lengths = jnp.where(forcing, lengths + 1, lengths)
        pending = jnp.where(forcing, nxt, pending)
        out = c.out.at[:, i].set(tok, mode="drop")
        steps = jnp.where(sampling, c.steps + 1, c.steps)
        active = active & ~finished
        fed = (finished & r.feed_last) if feeding else c.fed
        return DecodeCarry(i=i + 1, state=state, lengths=lengths, pending=pending, active=active, remaining=remaining,
                           steps=steps, out=out, reason=reason, fed=fed, kept=kept, lps=lps, top_ids=tids,
                           top_lps=tlps)

    init = DecodeCarry(i=jnp.int32(0), state=state, lengths=r.lengths, pending=r.pending, active=r.active,
                       remaining=r.remaining, steps=r.steps, out=out, reason=jnp.zeros((b,), jnp.int32),
                       fed=jnp.zeros((b,), bool), kept=kept0, lps=lps0, top_ids=top_ids0, top_lps=top_lps0)
    c = jax.lax.while_loop(cond, body, init)
    return ((c.state, c.out, c.reason, c.i, c.lps) + ((c.kept,) if feeding else ())
            + ((c.top_ids, c.top_lps) if top_logprobs else ()))


def grouped_prefix(q: jax.Array, pool: KVPages, layer, table: jax.Array, n: jax.Array, attention_impl: str = "xla",
                   kv=None):
    """A decode step's attention of group g's W queries q[g] [G, W, H, D] to the first n[g]
    tokens of its page table table[g] (local page ids), read once for the whole group. Returns
    (out [G, W, H, D], lse [G, W, H]) for `merge_partials`. attention_impl "pallas": the Pallas
    kernel over the pages in place (`prefix_attention.pallas_paged_prefix_attention`)."""
    if attention_impl == "pallas":
        lens = jnp.broadcast_to(n[:, None], q.shape[:2])
        return pallas_paged_prefix_attention(q, pool.k, pool.v, layer, table, lens, None if kv is None else kv[0])
    return paged_partial(q, pool.k, pool.v, layer, table, n)


@sh.slot_local(rows=("rows",), out=lambda a: tuple(k for _, k in _decode_fields(a["feeding"], a["top_logprobs"])),
               cache_kv=(0, 0), dims=POOL_DIMS)
def _decode_body(params, config: Qwen2Config, cache: KVPages, rows, layout: tuple, chunk: int, kv=None,
                 attention_impl: str = "xla", n_valid: int | None = None, feeding: bool = False,
                 top_logprobs: int = 0):
    """Up to `chunk` decode steps of every active row (`rows, layout = DecodeRows.pack()`).
    Forced tokens: step k < n_forced writes the pending token's KV and makes forced[k] pending; it
    emits nothing and is not one of the row's generated steps (its sampling key, budget and stops
    start after them), as if the tokens had been prefilled; nor does it count against `chunk` (a
    row runs up to n_forced + chunk steps per call), so a prompt or an opening that rides a decode
    chunk costs no extra host round trip.
    feeding (static; the rows' feed_last on): a row with feed_last that finishes on device (stop
    id, EOS, length) runs one more step that only feeds its last token: its KV is written and its
    logits (before the padded ids are masked) are kept; the token that step samples is dropped. A
    merge join's children so hold their close tag's KV, and the last one its join logits.
    Returns a flat tuple, the `DecodeOut` fields `_decode_fields` lists (`decode` names them): the
    pool, the emitted tokens [B, chunk + F] (-1 = none), per-row reason codes (1 stop id / EOS, 2
    length), the steps run, each emitted token's log-prob [B, chunk + F] fp32 (`sample_rows`),
    with feeding the kept logits [B, V], and with top_logprobs = n (static) the n most likely ids
    and their log-probs per emitted token [B, chunk + F, n] (a second compiled variant, used only
    when a request asks)."""
    pool = cache
    r = DecodeRows.unpack(rows, layout)
    na, nf = r.a_table.shape[0], r.b_gtable.shape[0]
    w = r.b_table.shape[0] // max(nf, 1)
    n_pages = pool.num_pages
    a_table, b_gtable, b_table = (local_pages(t, n_pages) for t in (r.a_table, r.b_gtable, r.b_table))
    shared = jnp.concatenate([jnp.zeros(na, jnp.int32), jnp.repeat(r.b_glen, w)])          # [B]
    base = jax.vmap(lambda s, j: jax.random.fold_in(jax.random.key(s), j))(r.seeds, r.branch)

    def one_step(pool, lengths, pending, active, steps, fed):
        positions = (shared + lengths + r.pos_off)[:, None]                       # [B, 1]
        la, lb = lengths[:na], lengths[na:]

        def attend(q, k, v, layer):
            h, d = q.shape[2], q.shape[3]
            o_s, l_s = _self_partial(q, k, v)                    # every row's own new token
            outs = []
            if na:                                               # generate rows: their own pages
                own = grouped_prefix(q[:na], pool, layer, a_table, la, attention_impl, kv)
                outs.append(merge_partials([own, (o_s[:na], l_s[:na])])[0])
            if nf:                                               # siblings: shared prefix + own pages
                o_p, l_p = grouped_prefix(q[na:, 0].reshape(nf, w, h, d), pool, layer, b_gtable, r.b_glen,
                                          attention_impl, kv)
                prefix = (o_p.reshape(nf * w, 1, h, d), l_p.reshape(nf * w, 1, h))
                own = grouped_prefix(q[na:], pool, layer, b_table, lb, attention_impl, kv)   # groups of one
                outs.append(merge_partials([prefix, own, (o_s[na:], l_s[na:])])[0])
            return (jnp.concatenate(outs) if len(outs) > 1 else outs[0]), (k, v)

        x = embed(params, config, pending[:, None])
        hidden, (nk, nv) = decoder(params, config, x, positions, attend, jnp.arange(config.num_hidden_layers))
        pos = jnp.where(active | fed, lengths, -1)[:, None]                         # [B, 1]
        pk, pv = pool.k, pool.v
        if na:
            pk = scatter_pages(pk, a_table, pos[:na], nk[:, :na])
            pv = scatter_pages(pv, a_table, pos[:na], nv[:, :na])
        if nf:
            pk = scatter_pages(pk, b_table, pos[na:], nk[:, na:])
            pv = scatter_pages(pv, b_table, pos[na:], nv[:, na:])
        raw = unembed(params, config, hidden)[:, 0]
        logits = mask_padded(raw, n_valid)                                        # no padded ids
        tok, lp, top_ids, top_lp = sample_rows(logits, base, steps, r.temperature, r.top_k, r.top_p, top_logprobs)
        return _pin(KVPages(pk, pv), kv), tok, raw, (lp, top_ids, top_lp)

    return decode_loop(one_step, pool, r, chunk, config.vocab_size, feeding, top_logprobs)


@functools.partial(jax.jit, static_argnames=("config", "layout", "chunk", "kv", "attention_impl", "n_valid", "feeding",
                                             "top_logprobs"),
                   donate_argnames=("pool",))
def decode(params, config: Qwen2Config, pool: KVPages, rows, layout: tuple, chunk: int, kv=None,
           attention_impl: str = "xla", n_valid: int | None = None, feeding: bool = False,
           top_logprobs: int = 0) -> DecodeOut:
    """Up to `chunk` decode steps of every active row (`_decode_body`); returns a `DecodeOut`
    (the optional fields set by `feeding` and `top_logprobs`)."""
    res = _decode_body(params, config, pool, rows, layout=layout, chunk=chunk, kv=kv, attention_impl=attention_impl,
                       n_valid=n_valid, feeding=feeding, top_logprobs=top_logprobs)
    return DecodeOut(**{name: x for (name, _), x in zip(_decode_fields(feeding, top_logprobs), res, strict=True)})


@jax.jit
def row_of(x: jax.Array, i) -> jax.Array:
    """x[i] as one jitted call (eager indexing dispatches several ops: ~0.2 ms on the latency path)."""
    return x[i]
