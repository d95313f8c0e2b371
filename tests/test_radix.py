"""The radix tree over the page pool (sprint_jax/infer/radix.py): hand-derived matches and
evictions, and a fuzz of random open / extend / fork / truncate / finish / insert / evict
sequences against a plain reference model (a dict from cached page paths to pages, and each page's
tokens as a numpy array that copies and writes update), checking after every operation that
reference counts equal the holders, no page is both free and held, evicted pages are in no live
page table, the pool never exceeds its capacity, every live sequence reads its own tokens through
its table, and match returns the true longest cached prefix of whole pages."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sprint_jax.infer.pages import PageAllocator, PoolExhausted
from sprint_jax.infer.radix import RadixTree


def _written(a: PageAllocator, tokens):
    s = a.new_seq()
    a.prepare_write(s, len(tokens))
    a.advance(s, len(tokens))
    return s


def test_match_is_page_granular_and_a_hit_reuses_pages():
    a = PageAllocator(10, 4)
    tree = RadixTree(a)
    doc = list(range(10, 21))                           # 11 tokens: 2 full pages
    s = _written(a, doc)
    assert tree.insert(doc, s.pages) == 2 and tree.cached_pages == 2
    assert list(a.refcount[:3]) == [2, 2, 1]            # the tree holds the full pages only
    assert tree.match(doc[:7])[0] == [s.pages[0]]       # 7 tokens: one whole page
    assert tree.match(doc[:8])[0] == s.pages[:2]
    assert tree.match([10, 11, 12, 99] + doc[4:])[0] == []
    a.release(s)
    assert list(a.refcount[:3]) == [1, 1, 0]
    t = tree.acquire(doc[:8] + [5, 6])                  # a hit of 8 tokens; 2 left to prefill
    assert t.pages == [0, 1] and t.length == 8 and tree.hit_tokens == 8
    u = tree.acquire(doc[:8])                           # a full hit still leaves its last token
    assert u.length == 4 and u.pages == [0]
    assert tree.evict(5) == 0                           # every cached page is locked / held
    tree.finish(u, doc[:8])
    tree.finish(t, doc[:8] + [5, 6])
    assert tree.evict(1) == 1 and tree.match(doc)[0] == [0]       # the leaf (page 1) goes first


def test_lru_eviction_and_the_cache_never_fails_a_request():
    a = PageAllocator(4, 2)
    evicted = []
    tree = RadixTree(a, on_evict=lambda page, depth: evicted.append((page, depth)))
    for doc in ([1, 2, 3, 4], [5, 6, 7, 8]):            # 4 pages cached, none free
        tree.finish(_written(a, doc), doc)
    assert a.free_pages == 0 and tree.cached_pages == 4
    tree.match([1, 2, 3, 4])                            # doc 1 used last: doc 2's pages go first
    s = tree.acquire([9, 9, 9])
    a.prepare_write(s, 3)                               # 2 pages: evicts doc 2's leaf, then its root page
    assert evicted == [(3, 2), (2, 1)] and tree.evicted == 2
    assert tree.match([1, 2, 3, 4])[0] == [0, 1] and tree.match([5, 6, 7, 8])[0] == []
    a.advance(s, 3)
    a.prepare_write(s, 2)                               # a third page: doc 1's leaf
    assert evicted[-1] == (1, 2)
    with pytest.raises(PoolExhausted):                  # live pages only: the scheduler's to handle
        a.prepare_write(s, 6)                           # 2 pages: doc 1 evicted, 1 free


def _lru_reference(tree: RadixTree, a: PageAllocator, n: int) -> list[int]:
    """The pages evict(n) frees, by a walk of the whole tree: repeatedly the least recently used
    leaf that is unlocked and held by the tree alone (a parent whose children all went joins)."""
    gone, out = set(), []
    while len(out) < n:
        leaves = [nd for nd in tree.nodes() if id(nd) not in gone and nd.lock == 0
                  and a.refcount[nd.page] == 1 and all(id(c) in gone for c in nd.children.values())]
        if not leaves:
            break
        node = min(leaves, key=lambda nd: nd.last_used)
        gone.add(id(node))
        out.append(node.page)
    return out


def test_the_eviction_heap_stays_bounded_without_evictions():
    """Every hit pushes a heap entry; with no eviction to prune them, stale entries are rebuilt
    away, so a long-lived server's tree stays the size of its cache."""
    a = PageAllocator(64, 2)
    tree = RadixTree(a)
    docs = [[d, d, d + 1, d + 1] for d in range(0, 20, 2)]
    for doc in docs:
        tree.finish(_written(a, doc), doc)
    for i in range(5000):
        tree.match(docs[i % len(docs)])
    assert len(tree._heap) <= 4 * tree.cached_pages + 65     # the module's own bound
    tree.match(docs[3])                                       # used last: evicted last
    assert tree.evict(18) == 18 and tree.match(docs[3])[0] != [] and tree.cached_pages == 2


def _path_pages(tree: RadixTree) -> dict:
    out = {}
    for node in tree.nodes():
        keys, n = [], node
        while n is not tree.root:
            keys.append(n.key)
            n = n.parent
        out[tuple(t for k in reversed(keys) for t in k)] = node.page
    return out


class _Model:
    """The reference: live sequences with their tokens, the cached page paths, each page's tokens."""

    def __init__(self, n_pages: int, ps: int, rng):
        self.a = PageAllocator(n_pages, ps)
        self.tree = RadixTree(self.a, on_evict=self._evicted)
        self.ps, self.rng = ps, rng
        self.live: list[tuple] = []                     # (seq, tokens)
        self.cached: dict[tuple, int] = {}              # token path of whole pages -> page
        self.content = np.full((n_pages, ps), -1)       # each page's tokens
        docs = [list(rng.integers(0, 3, 24)) for _ in range(3)]   # few symbols: shared prefixes
        self.docs = docs
        self.evicted: list[int] = []

    def _evicted(self, page, depth):
        self.evicted.append(page)
        assert all(page not in s.pages for s, _ in self.live), "an evicted page is in a live table"
        paths = [p for p, pg in self.cached.items() if pg == page]
        assert len(paths) == 1 and len(paths[0]) == depth * self.ps
        del self.cached[paths[0]]

    def longest(self, tokens):
        pages, k = [], 1
        while k * self.ps <= len(tokens) and tuple(tokens[:k * self.ps]) in self.cached:
            pages.append(self.cached[tuple(tokens[:k * self.ps])])
            k += 1
        return pages

    def write(self, seq, tokens, new):
        copies = self.a.prepare_write(seq, len(new))
        for c in copies:
            self.content[c.dst] = self.content[c.src]
        for i, t in enumerate(new, start=seq.length):
            self.content[seq.pages[i // self.ps], i % self.ps] = t
        self.a.advance(seq, len(new))
        tokens.extend(new)

    def insert(self, seq, tokens):
        for k in range(1, seq.length // self.ps + 1):
            self.cached.setdefault(tuple(tokens[:k * self.ps]), seq.pages[k - 1])
        self.tree.insert(tokens[:seq.length], seq.pages)

    def step(self, op: int):
        rng, ps = self.rng, self.ps
        pick = (lambda: self.live[rng.integers(len(self.live))]) if self.live else None
        if op == 0 or not self.live:                     # open a request
            doc = self.docs[rng.integers(3)]
            tokens = doc[:rng.integers(1, 20)] + list(rng.integers(0, 3, rng.integers(0, 4)))
            want = self.longest(tokens[:-1])
            seq = self.tree.acquire(tokens)
            assert seq.pages == want and seq.length == len(want) * ps
            have = tokens[:seq.length]
            try:
                self.live.append((seq, have))
                self.write(seq, have, tokens[seq.length:])
            except PoolExhausted:
                self.live.pop()
                self.tree.finish(seq, have, cache=False)
        elif op == 1:                                    # extend
            seq, tokens = pick()
            try:
                self.write(seq, tokens, list(rng.integers(0, 3, rng.integers(1, 6))))
            except PoolExhausted:
                pass
        elif op == 2:                                    # fork (at any depth)
            seq, tokens = pick()
            fork = self.a.fork(seq, int(rng.integers(1, 4)))
            assert fork.shared_len == seq.length // ps * ps
            self.live += [(c, list(tokens)) for c in fork.children]
        elif op == 3:                                    # truncate
            seq, tokens = pick()
            n = int(rng.integers(0, seq.length + 1))
            self.a.truncate(seq, n)
            del tokens[n:]
        elif op == 4:                                    # finish
            i = int(rng.integers(len(self.live)))
            seq, tokens = self.live.pop(i)
            cache = bool(rng.integers(2))
            if cache:
                self.insert(seq, tokens)
            self.tree.finish(seq, tokens, cache=False)
        elif op == 5:                                    # a live sequence caches its prefix
            self.insert(*pick())
        else:                                            # evict: least recently used first
            n = int(rng.integers(1, 4))
            want = _lru_reference(self.tree, self.a, n)
            before = len(self.evicted)
            assert self.tree.evict(n) == len(want)
            assert self.evicted[before:] == want

    def check(self):
        a, tree = self.a, self.tree
        holders = Counter(p for s, _ in self.live for p in s.pages) + Counter(self.cached.values())
        assert [holders[p] for p in range(a.num_pages)] == list(a.refcount)
        free = a.free_list()
        assert len(free) == len(set(free)) and set(free) == {p for p in range(a.num_pages) if holders[p] == 0}
        assert len(free) + sum(1 for p in range(a.num_pages) if holders[p]) == a.num_pages
        assert _path_pages(tree) == self.cached and tree.cached_pages == len(self.cached)
        for s, tokens in self.live:
            assert s.length == len(tokens) and len(s.pages) >= -(-s.length // self.ps)
            got = [self.content[s.pages[i // self.ps], i % self.ps] for i in range(s.length)]
            assert got == tokens
        for path, page in self.cached.items():
            assert list(self.content[page]) == list(path[-self.ps:])
        locks = Counter()
        for s, _ in self.live:
            n = s.cached_node
            while n is not None and n is not tree.root:
                locks[id(n)] += 1
                n = n.parent
        assert all(node.lock == locks[id(node)] for node in tree.nodes())
        assert tree.cached_only() == sum(1 for node in tree.nodes() if a.refcount[node.page] == 1)
        for doc in self.docs:
            q = doc[:int(self.rng.integers(0, 24))]
            assert tree.match(q)[0] == self.longest(q)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), n_pages=st.integers(3, 24), ps=st.integers(1, 4))
def test_fuzz_pool_and_tree_invariants(seed, n_pages, ps):
    rng = np.random.default_rng(seed)
    m = _Model(n_pages, ps, rng)
    for _ in range(60):
        m.step(int(rng.integers(7)))
        m.check()
    while m.live:                                        # everything ends: only the cache holds pages
        seq, tokens = m.live.pop()
        m.tree.finish(seq, tokens, cache=False)
    m.check()
    m.tree.evict(n_pages)
    assert m.a.free_pages == n_pages and not m.cached
