"""The paged KV pool (sprint_jax/infer/pages.py): the allocator's reference counts, forks and copy on
write against hand-derived tables, and the device ops (write through page tables, page copy,
gather) against numpy indexing."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sprint_jax.infer.pages import (KVPages, PageAllocator, PageCopy, PoolExhausted, copy_args, copy_pages, copy_tokens,
                                    gather_pages, write_kv)
from sprint_jax.infer.requests import EngineError
from sprint_jax.model.config import Qwen2Config


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    a = PageAllocator(8, 4)
    root = a.new_seq()
    assert a.prepare_write(root, 6) == []              # 6 tokens: pages 0, 1 (page 1 half filled)
    a.advance(root, 6)
    assert root.pages == [0, 1] and a.free_pages == 6
    fork = a.fork(root, 2)
    c1, c2 = fork.children
    assert fork.shared_len == 4                         # one full page shared by the group
    assert c1.pages == c2.pages == [0, 1] and c1.length == c2.length == 6
    assert list(a.refcount[:2]) == [3, 3]
    # c1 writes 3 tokens (positions 6..8): page 1 is copied to a fresh page, one more page added
    copies = a.prepare_write(c1, 3)
    assert copies == [PageCopy(1, 3)] and c1.pages == [0, 3, 2]
    assert list(a.refcount[:4]) == [3, 2, 1, 1]
    a.advance(c1, 3)
    # a grandchild of c1 at length 9: shares pages 0 and 3 (full), page 2 partial
    g = a.fork(c1, 1)
    assert g.shared_len == 8 and g.children[0].pages == [0, 3, 2]
    # c2 copies page 1 too; then the root is its only holder and writes it in place
    assert a.prepare_write(c2, 1) == [PageCopy(1, 4)]
    assert a.prepare_write(root, 1) == [] and root.pages == [0, 1] and a.refcount[1] == 1
    # the grandchild writes into its shared partial page 2: copied; at a page boundary: no copy
    gc = g.children[0]
    assert a.prepare_write(gc, 1) == [PageCopy(2, 5)]
    a.advance(gc, 3)
    assert gc.length == 12 and a.prepare_write(gc, 1) == [] and len(gc.pages) == 4


def test_fork_leaves_reserved_pages_to_the_parent():
    a = PageAllocator(8, 4)
    s = a.new_seq()
    a.prepare_write(s, 8)                 # room for 8 tokens, only 4 written
    a.advance(s, 4)
    c = a.fork(s, 1).children[0]
    assert c.pages == [0] and a.refcount[1] == 1
    assert a.prepare_write(c, 1) == [] and c.pages == [0, 2]       # a fresh page, not the parent's


def test_exhausted_pool_changes_nothing_and_release_frees():
    a = PageAllocator(3, 2)
    s = a.new_seq()
    a.prepare_write(s, 3)
    a.advance(s, 3)
    c = a.fork(s, 1).children[0]
    before = (list(c.pages), a.refcount.copy(), a.free_list())
    with pytest.raises(PoolExhausted):
        a.prepare_write(c, 4)                      # needs a copy + 2 pages, 1 free
    assert (c.pages, list(a.refcount), a.free_list()) == (before[0], list(before[1]), before[2])
    a.release(c)
    a.release(s)
    assert a.free_pages == 3 and not a.refcount.any()
    with pytest.raises(EngineError, match="released"):
        a.release(s)


def test_truncate_releases_pages_and_copies_a_shared_page_on_write():
    a = PageAllocator(8, 4)
    s = a.new_seq()
    a.prepare_write(s, 10)
    a.advance(s, 10)                            # pages 0, 1, 2
    c = a.fork(s, 1).children[0]
    a.truncate(c, 5)                            # keeps pages 0, 1 (page 1 now partial, shared)
    assert c.pages == [0, 1] and list(a.refcount[:3]) == [2, 2, 1]
    assert a.prepare_write(c, 1) == [PageCopy(1, 3)]
    with pytest.raises(EngineError):
        a.truncate(c, 6)


def test_cached_pages_start_a_sequence():
    a = PageAllocator(8, 4)
    s = a.new_seq()
    a.prepare_write(s, 8)
    a.advance(s, 8)
    t = a.new_seq(s.pages[:2])
    assert t.length == 8 and list(a.refcount[:2]) == [2, 2]
    assert a.prepare_write(t, 1) == [] and t.pages == [0, 1, 2]
    u = a.new_seq(s.pages[:2], cached_len=6)   # a partial hit on the second page: copied on write
    assert a.prepare_write(u, 1) == [PageCopy(1, 3)]
    with pytest.raises(EngineError):
        a.new_seq([0], cached_len=5)


def _pool(n_pages=7, ps=3, layers=2, hkv=2, d=6, seed=0):
    config = Qwen2Config(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=layers,
                         num_attention_heads=hkv, num_key_value_heads=hkv, head_dim=d)
    pool = KVPages.zeros(config, n_pages, ps)
    assert pool.k.shape == (layers, hkv, n_pages, ps, d)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(pool.k.shape).astype(np.float32)
    v = rng.standard_normal(pool.k.shape).astype(np.float32)
    return KVPages(jnp.asarray(k), jnp.asarray(v)), k, v, rng


def test_write_kv_scatters_through_page_tables_like_numpy():
    pool, k, v, rng = _pool()
    table = np.array([[4, 1, 6], [2, 0, 5]], np.int32)
    pos = np.array([[2, 3, 4, 7], [0, 1, -1, -1]], np.int32)           # -1: padding, dropped
    nk = rng.standard_normal((2, 2, 4, 2, 6)).astype(np.float32)
    nv = rng.standard_normal((2, 2, 4, 2, 6)).astype(np.float32)
    out = write_kv(pool, jnp.asarray(table), jnp.asarray(pos), jnp.asarray(nk), jnp.asarray(nv))
    for r in range(2):
        for t in range(4):
            if pos[r, t] >= 0:
                page, slot = table[r, pos[r, t] // 3], pos[r, t] % 3
                k[:, :, page, slot], v[:, :, page, slot] = nk[:, r, t], nv[:, r, t]
    np.testing.assert_array_equal(np.asarray(out.k), k)
    np.testing.assert_array_equal(np.asarray(out.v), v)


def test_copy_pages_and_gather_pages_like_numpy():
    pool, k, v, _ = _pool()
    src, dst = copy_args([PageCopy(1, 5), PageCopy(3, 0), PageCopy(6, 2)], pool.num_pages)
    assert len(src) == 4 and dst[3] == pool.num_pages                   # padded to a power of two
    out = copy_pages(pool, jnp.asarray(src), jnp.asarray(dst))
    for s, d in ((1, 5), (3, 0), (6, 2)):
        k[:, :, d], v[:, :, d] = k[:, :, s], v[:, :, s]
    np.testing.assert_array_equal(np.asarray(out.k), k)
    np.testing.assert_array_equal(np.asarray(out.v), v)
    table = np.array([[2, 5], [6, 0]], np.int32)
    got = np.asarray(gather_pages(out.k, 1, jnp.asarray(table)))
    want = np.stack([np.concatenate([k[1, :, p] for p in row], axis=1) for row in table], axis=1)   # [Hkv, R, S, D]
    np.testing.assert_array_equal(got, want)


def test_copy_tokens_places_tokens_through_page_tables_like_numpy():
    """A merge join's copy: each child's tokens after the parent's prefix, by page tables."""
    pool, k, v, _ = _pool()
    src = np.array([[3, 5, 0], [6, 1, 2]], np.int32)        # two children's tables
    dst = np.array([[4, 2, 0], [4, 2, 0]], np.int32)        # the parent's (both rows)
    src_pos = np.array([[0, 1, 2, 3], [1, 2, 0, 0]], np.int32)
    dst_pos = np.array([[3, 4, 5, 6], [7, 8, -1, -1]], np.int32)
    out = copy_tokens(pool, jnp.asarray(src), jnp.asarray(src_pos), jnp.asarray(dst), jnp.asarray(dst_pos))
    k0, v0 = k.copy(), v.copy()
    for r in range(2):
        for t in range(4):
            if dst_pos[r, t] >= 0:
                sp, ss = src[r, src_pos[r, t] // 3], src_pos[r, t] % 3
                dp, ds = dst[r, dst_pos[r, t] // 3], dst_pos[r, t] % 3
                k[:, :, dp, ds], v[:, :, dp, ds] = k0[:, :, sp, ss], v0[:, :, sp, ss]
    np.testing.assert_array_equal(np.asarray(out.k), k)
    np.testing.assert_array_equal(np.asarray(out.v), v)
