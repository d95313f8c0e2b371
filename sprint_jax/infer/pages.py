"""A KV pool of fixed-size pages: the host-side allocator, sequences as page tables, and the
jitted device ops that write K/V through page tables and copy pages.

Host side (`PageAllocator`). The pool holds `num_pages` pages of `page_size` tokens. Every page has
a reference count: the number of holders, where a holder is a sequence whose page table lists the
page, or a node of the radix tree (`sprint_jax.infer.radix`) that caches it. A page with count 0 is
on the free list and in no page table. A sequence (`SeqPages`) is a page table plus a length: token
i of the sequence lies in page `pages[i // page_size]` at slot `i % page_size`.

A fork (`fork`) gives each child the parent's whole page table (every count + 1) and the parent's
length, at any depth (a child of a child forks the same way). Only a page with count 1 is ever
written: before a write `prepare_write` gives the writer a fresh copy of a shared, partly filled
last page (copy on write; the copy is a device op, `copy_pages`, that the caller runs before the
write) and fresh pages for the tokens past its table. Full shared pages are never written, so the
siblings of a fork read the parent's full pages as one shared prefix (`Fork.shared_len`) and the
partly filled page as their own.

When the free list is short the allocator asks its `evictor` (the radix tree: least recently used
pages that only the tree holds) for pages; if live sequences hold the rest, `PoolExhausted` says
so (the scheduler preempts a run; the cache itself never makes a request fail).

Device side (`KVPages`). Pool arrays k, v [layers, kv_heads, pages, page_size, head_dim]: one
layer's slice is the [Hkv, pages, page_size, D] layout of JAX's Pallas paged-attention kernels (TPU
and GPU), and a page of one KV head is one contiguous [page_size, D] block, so the XLA path's
attention multiplies gathered pages without transposing them (heads-first, as the slot cache is).
Placed with KV heads over `tensor` (`pool_sharding`); the pages axis is whole on every device.
`write_kv` scatters new tokens' K/V (a prefill chunk or a decode step) through page tables in
place (the pool is donated); `copy_pages` copies whole pages (copy on write); `copy_tokens` copies
single tokens between page tables (a merge join's placement of the children's tokens).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.requests import EngineError
from sprint_jax.model import sharding as mesh_lib
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import dtype_of

POOL_AXES = ("layers", "kv_heads", "kv_seq", "kv_seq", "head_dim")   # [L, Hkv, pages, page_size, D]


class PoolExhausted(EngineError):
    """Live sequences hold every page: nothing is free and nothing cached can be evicted."""


# ---------------------------------------------------------------------------------------------
# Host side: sequences, forks, the allocator
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class SeqPages:
    """A sequence's place in the pool: its page table and how many tokens of it hold K/V.
    `cached_node` is the radix node whose path it locked when it took cached pages (or None)."""
    pages: list[int]
    length: int = 0
    id: int = dataclasses.field(default_factory=itertools.count().__next__)
    cached_node: object = None
    released: bool = False


@dataclasses.dataclass
class Fork:
    """A fork of `parent` into `children`: every child starts with the parent's page table and
    length. The first `shared_len` tokens (the parent's full pages at the fork) are a prefix all
    children read and none writes: a decode step reads them once for the whole sibling group."""
    parent: SeqPages
    children: list[SeqPages]
    shared_len: int


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """A copy on write: page `src`'s K/V into page `dst` (`copy_pages`)."""
    src: int
    dst: int


class PageAllocator:
    """Reference-counted pages of one pool (see the module docstring). `evictor(n)`: asked for n
    pages when the free list is short; frees what it can and returns how many it freed."""

    def __init__(self, num_pages: int, page_size: int, evictor: Callable[[int], int] | None = None):
        if num_pages <= 0 or page_size <= 0:
            raise EngineError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.refcount = np.zeros(num_pages, np.int32)
        self._free = list(range(num_pages - 1, -1, -1))      # a stack: page 0 is handed out first
        self.evictor = evictor

    # -- pages --------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    def free_list(self) -> list[int]:
        """The free pages' ids (a copy)."""
        return list(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` tokens."""
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages (count 1 each), evicting cached pages if the free list is short."""
        if n > len(self._free) and self.evictor is not None:
            self.evictor(n - len(self._free))
        if n > len(self._free):
            raise PoolExhausted(f"the KV pool has {len(self._free)} free pages of {self.num_pages}, "
                                f"{n} needed, and every other page is held by a live sequence")
        out = [self._free.pop() for _ in range(n)]
        self.refcount[out] = 1
        return out

    def incref(self, pages) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} is free: a holder cannot share it")
            self.refcount[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"page {p} released more often than held")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    # -- sequences ----------------------------------------------------------------------------
    def new_seq(self, cached_pages: list[int] = (), cached_len: int | None = None) -> SeqPages:
        """A sequence starting from cached pages (a radix match; each count + 1) holding
        cached_len tokens (default: the pages' full length), or an empty one."""
        pages = list(cached_pages)
        length = len(pages) * self.page_size if cached_len is None else cached_len
        if length > len(pages) * self.page_size or length < 0:
            raise EngineError(f"{length} tokens do not fit {len(pages)} pages of {self.page_size}")
        self.incref(pages)
        return SeqPages(pages, length)

    def fork(self, parent: SeqPages, n: int) -> Fork:
        """n children of `parent` sharing the pages that hold its tokens (counts + n; pages
        reserved past its length stay the parent's); the partly filled last page, if any, is
        copied when a child (or the parent) first writes into it (`prepare_write`)."""
        self._live(parent)
        held = parent.pages[:self.pages_for(parent.length)]
        children = []
        for _ in range(n):
            self.incref(held)
            children.append(SeqPages(list(held), parent.length))
        full = parent.length // self.page_size * self.page_size
        return Fork(parent, children, full)

    def prepare_write(self, seq: SeqPages, n: int) -> list[PageCopy]:
        """Make room for n more tokens of `seq` (at positions length..length+n-1) and return the
        page copies to run first (`copy_pages`). Every page those positions fall in ends up held
        by `seq` alone: one that others also hold is replaced by a fresh page (copied first if it
        holds tokens: the partly filled last page after a fork; the sequence's count on the old
        page is dropped), and pages are added past the table. Does not change `length`
        (`advance` does, once the K/V is written). On PoolExhausted nothing has changed."""
        self._live(seq)
        if n <= 0:
            return []
        shared, grow = self._write_needs(seq, n)
        fresh = self.alloc(len(shared) + grow)                               # raises before any change
        copies = []
        for j in shared:
            dst = fresh.pop()
            if j * self.page_size < seq.length:          # it holds tokens of this sequence
                copies.append(PageCopy(seq.pages[j], dst))
            self.decref([seq.pages[j]])
            seq.pages[j] = dst
        seq.pages.extend(fresh)
        return copies

    def fresh_pages(self, seq: SeqPages, n: int) -> int:
        """Pages `prepare_write(seq, n)` would take from the pool (copies of shared pages and
        pages past the table)."""
        if n <= 0:
            return 0
        shared, grow = self._write_needs(seq, n)
        return len(shared) + grow

    def _write_needs(self, seq: SeqPages, n: int) -> tuple[list[int], int]:
        """(table indices of the shared pages that positions length..length+n-1 fall in, pages to
        add past the table)."""
        first, end = seq.length // self.page_size, self.pages_for(seq.length + n)
        shared = [j for j in range(first, min(end, len(seq.pages))) if self.refcount[seq.pages[j]] > 1]
        return shared, max(end - len(seq.pages), 0)

    def advance(self, seq: SeqPages, n: int) -> None:
        """n tokens of K/V written (after `prepare_write` made room for them)."""
        if self.pages_for(seq.length + n) > len(seq.pages):
            raise RuntimeError(f"sequence {seq.id}: {seq.length + n} tokens exceed its {len(seq.pages)} pages")
        seq.length += n

    def truncate(self, seq: SeqPages, length: int) -> None:
        """Keep the first `length` tokens; pages past them are released (a shared partly filled
        last page is copied on the next write, like any other)."""
        self._live(seq)
        if not 0 <= length <= seq.length:
            raise EngineError(f"cannot truncate a sequence of {seq.length} tokens to {length}")
        keep = self.pages_for(length)
        self.decref(seq.pages[keep:])
        del seq.pages[keep:]
        seq.length = length

    def release(self, seq: SeqPages) -> None:
        """The sequence ends: its counts are dropped (pages nobody else holds are free again)."""
        self._live(seq)
        self.decref(seq.pages)
        seq.pages, seq.length, seq.released = [], 0, True

    def _live(self, seq: SeqPages) -> None:
        if seq.released:
            raise EngineError(f"sequence {seq.id} was released")

    def table(self, seqs: list[SeqPages], width: int) -> np.ndarray:
        """The page tables of `seqs` as an int32 [len(seqs), width] array for the device
        (padding: page 0, never read past a sequence's length nor written)."""
        out = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            if len(s.pages) > width:
                raise RuntimeError(f"sequence {s.id} has {len(s.pages)} pages, the table {width}")
            out[i, :len(s.pages)] = s.pages
        return out


# ---------------------------------------------------------------------------------------------
# Device side: the pool arrays and their jitted ops
# ---------------------------------------------------------------------------------------------
def _on_bits(cache: jax.Array) -> bool:
    """XLA CPU has no bf16 gather / scatter: it widens the whole operand to f32 and, the cache being
    loop-invariant in the layer scan, hoists that copy out: a full f32 copy of the cache per decode
    step (qwen3-0.6b, 2.7 GiB bf16 cache: temporaries 6.9 GiB, 3.7 as bits; 7B at tensor=4: 8.9 ->
    7.4 GiB). On CPU a 16-bit cache is gathered and scattered as uint16 bits (GPU/TPU: as is)."""
    return cache.dtype.itemsize == 2 and jax.default_backend() == "cpu"


def as_bits(cache: jax.Array, fn) -> jax.Array:
    """fn(cache), run on the cache's uint16 bits on CPU (`_on_bits`); fn only moves elements."""
    if not _on_bits(cache):
        return fn(cache)
    bits = jax.lax.bitcast_convert_type
    return bits(fn(bits(cache, jnp.uint16)), cache.dtype)


def put_dropping(cache: jax.Array, index, new: jax.Array) -> jax.Array:
    """cache.at[index].set(new, mode="drop") (as bits on CPU: `_on_bits`)."""
    new = new.astype(cache.dtype)
    if not _on_bits(cache):
        return cache.at[index].set(new, mode="drop")
    bits = jax.lax.bitcast_convert_type
    return bits(bits(cache, jnp.uint16).at[index].set(bits(new, jnp.uint16), mode="drop"), cache.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """The pool's K and V, each [L, Hkv, num_pages, page_size, D]."""
    k: jax.Array
    v: jax.Array

    @staticmethod
    def zeros(config: Qwen2Config, num_pages: int, page_size: int, sharding=None) -> "KVPages":
        """A zero pool (placed on `sharding`, e.g. `pool_sharding`, when given)."""
        shape = pool_shape(config, num_pages, page_size)
        dt = dtype_of(config.dtype)
        if sharding is None:
            return KVPages(jnp.zeros(shape, dt), jnp.zeros(shape, dt))
        make = jax.jit(lambda: KVPages(jnp.zeros(shape, dt), jnp.zeros(shape, dt)),
                       out_shardings=KVPages(sharding, sharding))
        return make()

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return int(self.k.size * self.k.dtype.itemsize * 2)


def pool_shape(config: Qwen2Config, num_pages: int, page_size: int) -> tuple[int, ...]:
    """[L, Hkv, num_pages, page_size, D]."""
    return (config.num_hidden_layers, config.num_key_value_heads, num_pages, page_size, config.head_dim)


def pool_sharding(config: Qwen2Config, mesh, num_pages: int, page_size: int, notes: list[str] | None = None):
    """The NamedSharding of a pool array: KV heads over `tensor` (replicated, with a note, where
    they do not divide); layers, pages and tokens whole on every device."""
    shape = pool_shape(config, num_pages, page_size)
    return jax.sharding.NamedSharding(mesh, mesh_lib.logical_to_spec(POOL_AXES, shape, mesh, notes=notes,
                                                                     name="kv pages"))


def constrain_pool(pool: KVPages, sharding) -> KVPages:
    """The pool pinned to `sharding` (`pool_sharding`; None: as it is)."""
    if sharding is None:
        return pool
    wsc = jax.lax.with_sharding_constraint
    return KVPages(wsc(pool.k, sharding), wsc(pool.v, sharding))


def token_slots(table: jax.Array, pos: jax.Array, page_size: int, num_pages: int):
    """(page, slot) of positions pos [R, T] through page tables table [R, M]; a negative position
    or one past the table gives page num_pages (out of range: a write there is dropped)."""
    idx = pos // page_size
    ok = (pos >= 0) & (idx < table.shape[1])
    page = jnp.take_along_axis(table, jnp.clip(idx, 0, table.shape[1] - 1), axis=1)
    return jnp.where(ok, page, num_pages), pos % page_size


def scatter_pages(pool: jax.Array, table: jax.Array, pos: jax.Array, new: jax.Array) -> jax.Array:
    """pool [L, Hkv, N, ps, D] with new [L, R, T, Hkv, D] written at positions pos [R, T] of the
    rows' page tables table [R, M] (negative positions: padding, dropped). As `put_slots` does,
    every axis but D is indexed by an index array (broadcast to [L, R, T, Hkv]), so the update is
    `new` as it is."""
    n_layers, n_kv, n_pages, ps = pool.shape[:4]
    page, slot = token_slots(table, pos, ps, n_pages)
    layer = jnp.arange(n_layers)[:, None, None, None]                  # [L, R, T, Hkv]
    head = jnp.arange(n_kv)[None, None, None, :]
    return put_dropping(pool, (layer, head, page[None, :, :, None], slot[None, :, :, None]), new)


@functools.partial(jax.jit, static_argnames=("sharding",), donate_argnames=("pool",))
def write_kv(pool: KVPages, table: jax.Array, pos: jax.Array, k: jax.Array, v: jax.Array, sharding=None) -> KVPages:
    """Write new K, V [L, R, T, Hkv, D] (a prefill chunk; T = 1: a decode step) at positions
    pos [R, T] through page tables table [R, M], in place (negative positions: dropped). The pages
    written must be held by their writer alone (`PageAllocator.prepare_write`)."""
    return constrain_pool(KVPages(scatter_pages(pool.k, table, pos, k), scatter_pages(pool.v, table, pos, v)), sharding)


@functools.partial(jax.jit, static_argnames=("sharding",), donate_argnames=("pool",))
def copy_pages(pool: KVPages, src: jax.Array, dst: jax.Array, sharding=None) -> KVPages:
    """Copy whole pages src [n] -> dst [n] (every layer, K and V), in place; dst out of range
    (>= num_pages) is padding, dropped. `copy_args` builds src, dst from `PageCopy`s."""
    def one(a):
        return as_bits(a, lambda b: b.at[:, :, dst].set(b[:, :, jnp.clip(src, 0, b.shape[2] - 1)], mode="drop"))
    return constrain_pool(KVPages(one(pool.k), one(pool.v)), sharding)


def move_tokens(array: jax.Array, src_table: jax.Array, src_pos: jax.Array, dst_table: jax.Array,
                dst_pos: jax.Array) -> jax.Array:
    """array [L, Hkv, N, ps, D] (K or V) with row r's token at src_pos[r, t] of src_table[r] copied
    to dst_pos[r, t] of dst_table[r] (every layer and KV head); dst_pos < 0 or a destination page
    out of range: padding, dropped. Every source is read before any destination is written."""
    n_layers, n_kv, n_pages, ps = array.shape[:4]
    page, slot = token_slots(src_table, jnp.maximum(src_pos, 0), ps, n_pages)
    layer = jnp.arange(n_layers)[:, None, None, None]              # [L, R, T, Hkv]
    head = jnp.arange(n_kv)[None, None, None, :]
    rows = as_bits(array, lambda b: b[layer, head, jnp.minimum(page, n_pages - 1)[None, :, :, None],
                                       slot[None, :, :, None]])   # [L, R, T, Hkv, D]
    return scatter_pages(array, dst_table, dst_pos, rows)


@functools.partial(jax.jit, static_argnames=("sharding",), donate_argnames=("pool",))
def copy_tokens(pool: KVPages, src_table: jax.Array, src_pos: jax.Array, dst_table: jax.Array, dst_pos: jax.Array,
                sharding=None) -> KVPages:
    """Copy single tokens' K/V through page tables, in place (`move_tokens` on K and V): a merge
    join's placement of the children's tokens after the parent's prefix (the destination pages
    must be held by the parent alone, `PageAllocator.prepare_write`)."""
    return constrain_pool(KVPages(*(move_tokens(a, src_table, src_pos, dst_table, dst_pos)
                                    for a in (pool.k, pool.v))), sharding)


def copy_args(copies: list[PageCopy], num_pages: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) int32 arrays of `copies`, padded to `width` (default: the next power of two, so
    few shapes compile) with dst = num_pages (dropped)."""
    width = width or max(1, 1 << max(len(copies) - 1, 0).bit_length())
    src = np.zeros(width, np.int32)
    dst = np.full(width, num_pages, np.int32)
    for i, c in enumerate(copies):
        src[i], dst[i] = c.src, c.dst
    return src, dst


def gather_pages(pool: jax.Array, layer, table: jax.Array) -> jax.Array:
    """pool [L, Hkv, N, ps, D] -> the keys (or values) of the pages table [R, M] at `layer`, as
    tokens in order per KV head: [Hkv, R, M * ps, D] (one gather of whole [ps, D] blocks; the
    reshape is free)."""
    r, m = table.shape
    hkv, _, ps, d = pool.shape[1:]

    def take(a):
        # one gather of whole [ps, D] blocks indexed by (layer, KV head, page): no slice of the
        # layer out of the pool first (a copy of 1/L of the pool that XLA may materialize);
        # padding entries are clipped to a valid page, never read past the row's length
        head = jnp.arange(hkv, dtype=jnp.int32)[:, None, None]
        pages = jnp.clip(table, 0, a.shape[2] - 1)[None]
        return a[jnp.asarray(layer, jnp.int32), head, pages]                   # [Hkv, R, M, ps, D]
    return as_bits(pool, take).reshape(hkv, r, m * ps, d)
