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
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

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
        alloc.evictor = self.evict

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
            node.last_used = now
            path.append(node)
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
        node, now, added = self.root, next(self._clock), 0
        for key, page in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                self.alloc.incref([page])
                child = node.children[key] = RadixNode(key, int(page), node)
                added += 1
            child.last_used = now
            node = child
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

    def _evictable(self, node: RadixNode) -> bool:
        return (node is not self.root and not node.children and node.lock == 0
                and self.alloc.refcount[node.page] == 1)

    def evict(self, n: int) -> int:
        """Free up to n pages: least recently used evictable leaves first (a parent that becomes
        an evictable leaf joins them). Returns the number freed."""
        heap = [(nd.last_used, id(nd), nd) for nd in self._leaves() if self._evictable(nd)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            if not self._evictable(node):
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.alloc.decref([node.page])
            freed += 1
            if self.on_evict is not None:
                self.on_evict(node.page, node.depth)
            if self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.cached_pages -= freed
        self.evicted += freed
        return freed

    def clear(self) -> int:
        """Forget every cached prefix (new weights make its K/V stale): the tree's reference on
        each page is dropped (pages a live sequence holds stay with it; a sequence's lock on a
        forgotten path is harmless). Returns the pages the tree held."""
        held = [nd.page for nd in self.nodes()]
        self.alloc.decref(held)
        self.root = RadixNode((), -1, None)
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
