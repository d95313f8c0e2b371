"""A radix tree over token ids that maps cached prefixes to pages of the KV pool
(`sprint_jax.infer.pages`), so a new sequence takes the pages of its longest cached prefix and
prefills only the rest.

Page-granular: the tree's symbols are whole pages of `page_size` token ids, so a node is one full
page (its tokens and the pool page holding their K/V) under the node of the page before it, and
only full pages are ever shared across requests (a partly filled page is still being written).
The tree holds one reference on each of its pages (`PageAllocator` counts it as a holder).

- `match(tokens)`: the pages of the longest cached prefix of whole pages.
- `insert(tokens, pages)`: a sequence's full pages cached under its tokens (a prefix the tree
  already caches keeps the tree's pages; the sequence keeps its own copies).
- `lock` / `unlock`: a node and its ancestors in use (`acquire` locks the matched path until
  `finish`); a locked node is never evicted.
- `evict(n)`: frees up to n pages, least recently used leaves first, among nodes that are unlocked
  and whose page only the tree holds. The allocator calls it when its free list is short, so the
  cache never makes a request fail: a miss or an eviction, never an error.

Eviction keeps a heap of the leaves by last use across calls (an entry is pushed when a node
becomes a leaf or a leaf is used; entries a later use or a new child made stale are skipped when
popped), so an eviction costs O((n + leaves in use) log leaves), not a walk of the tree: a pool of
a million pages stays cheap to admit into. `held` marks the pages the tree holds (a numpy mask,
for counts over the whole pool without a walk).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

import numpy as np

from sprint_jax.infer.pages import PageAllocator, SeqPages


class RadixNode:
    """One cached full page: its tokens (`key`), its pool page, the node of the page before it."""
    __slots__ = ("key", "page", "parent", "children", "lock", "last_used", "depth")

    def __init__(self, key: tuple[int, ...], page: int, parent: "RadixNode | None"):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock = 0
        self.last_used = 0
        self.depth = 0 if parent is None else parent.depth + 1     # pages from the root


class RadixTree:
    """Cached prefixes of the pool `alloc` (registers itself as its evictor). on_evict(page,
    depth): called for each evicted page (metrics). `hit_tokens` / `evicted` count what it did."""

    def __init__(self, alloc: PageAllocator, on_evict: Callable[[int, int], None] | None = None):
        self.alloc = alloc
        self.page_size = alloc.page_size
        self.root = RadixNode((), -1, None)
        self._clock = itertools.count(1)
        self.on_evict = on_evict
        self.cached_pages = 0
        self.hit_tokens = 0
        self.evicted = 0
        self.held = np.zeros(alloc.num_pages, bool)         # pages the tree holds
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_used, tiebreak, leaf), lazily pruned
        self._tie = itertools.count()
        alloc.evictor = self.evict

    def _touch(self, node: RadixNode, now: int) -> None:
        """node used at `now`; a leaf gets a heap entry at its new time (the older one is stale)."""
        node.last_used = now
        if not node.children:
            self._push(node)

    def _push(self, leaf: RadixNode) -> None:
        heapq.heappush(self._heap, (leaf.last_used, next(self._tie), leaf))
        if len(self._heap) > 4 * self.cached_pages + 64:     # mostly stale entries: rebuild
            self._heap = [(nd.last_used, next(self._tie), nd) for nd in self._leaves() if nd is not self.root]
            heapq.heapify(self._heap)

    def _keys(self, tokens: Sequence[int]):
        ps = self.page_size
        return (tuple(int(t) for t in tokens[i:i + ps]) for i in range(0, len(tokens) // ps * ps, ps))

    def _walk(self, tokens: Sequence[int]) -> list[RadixNode]:
        """The nodes of the longest cached page path of `tokens` (touched: most recently used)."""
        path, node, now = [], self.root, next(self._clock)
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        for nd in path:
            self._touch(nd, now)
        return path

    def match(self, tokens: Sequence[int]) -> tuple[list[int], RadixNode]:
        """(pages, node): the pages of the longest cached prefix of `tokens` made of whole pages
        (len(pages) * page_size tokens) and its last node (the root on a miss)."""
        path = self._walk(tokens)
        return [n.page for n in path], (path[-1] if path else self.root)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the full pages of a sequence: pages[i] holds tokens[i*ps:(i+1)*ps] (only whole
        pages of `tokens` count). Pages of prefixes already cached stay the tree's; the new ones
        get one reference each (the tree's). Returns the number of pages newly cached."""
        keys = list(self._keys(tokens))
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} full pages of tokens, {len(pages)} pages")
        node, now, added, path = self.root, next(self._clock), 0, []
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                self.alloc.incref([page])
                child = node.children[key] = RadixNode(key, int(page), node)
                self.held[child.page] = True
                added += 1
            path.append(child)
            node = child
        for nd in path:
            self._touch(nd, now)
        self.cached_pages += added
        return added

    def lock(self, node: RadixNode) -> None:
        """Mark `node` and its ancestors in use (never evicted until `unlock`)."""
        while node is not None and node.parent is not None:       # the root (any tree's) is never locked
            node.lock += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None and node.parent is not None:
            if node.lock <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock -= 1
            node = node.parent

    def evict(self, n: int) -> int:
        """Free up to n pages: least recently used evictable leaves first (a parent that becomes
        an evictable leaf joins them). Returns the number freed."""
        heap, kept, freed = self._heap, [], 0
        while heap and freed < n:
            entry = heapq.heappop(heap)
            used, _, node = entry
            if node.parent is None or node.children or used != node.last_used:
                continue                     # evicted or forgotten, no longer a leaf, or used since
            if node.lock or self.alloc.refcount[node.page] != 1:
                kept.append(entry)           # a leaf in use: back in the heap once this call is done
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.held[node.page] = False
            self.alloc.decref([node.page])
            freed += 1
            if self.on_evict is not None:
                self.on_evict(node.page, node.depth)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, next(self._tie), parent))
        for entry in kept:
            heapq.heappush(heap, entry)
        self.cached_pages -= freed
        self.evicted += freed
        return freed

    def cached_only(self) -> int:
        """Pages only the tree holds (evictable unless a sequence's lock covers them)."""
        return int(np.count_nonzero(self.held & (self.alloc.refcount == 1)))

    def clear(self) -> int:
        """Forget every cached prefix (new weights make its K/V stale): the tree's reference on
        each page is dropped (pages a live sequence holds stay with it; a sequence's lock on a
        forgotten path is harmless). Returns the pages the tree held."""
        held = [nd.page for nd in self.nodes()]
        self.alloc.decref(held)
        self.root = RadixNode((), -1, None)
        self.held[:] = False
        self._heap = []
        self.cached_pages = 0
        return len(held)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                yield node
            stack.extend(node.children.values())

    def nodes(self):
        """Every cached node (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- sequences on the tree --------------------------------------------------------------
    def acquire(self, tokens: Sequence[int]) -> SeqPages:
        """A new sequence for `tokens` holding the pages of their longest cached prefix, its path
        locked; the caller prefills tokens[seq.length:]. At least the last token is left to run
        (its logits are the ones a request needs), so a full hit still prefills one token."""
        pages, node = self.match(list(tokens)[:max(len(tokens) - 1, 0)])
        seq = self.alloc.new_seq(pages)
        seq.cached_node = node
        self.lock(node)
        self.hit_tokens += seq.length
        return seq

    def cancel(self, seq: SeqPages) -> None:
        """Undo an `acquire` whose sequence never ran (its pages could not all be had): the lock
        and the references dropped, its hit tokens not counted, nothing cached."""
        self.hit_tokens -= seq.length
        self.finish(seq, (), cache=False)

    def finish(self, seq: SeqPages, tokens: Sequence[int], cache: bool = True) -> None:
        """The sequence ends: its full pages cached under `tokens` (its token ids; with cache),
        its lock dropped and its pages released (the tree keeps what it cached)."""
        if cache:
            self.insert(list(tokens)[:seq.length], seq.pages)
        if seq.cached_node is not None:
            self.unlock(seq.cached_node)
            seq.cached_node = None
        self.alloc.release(seq)
