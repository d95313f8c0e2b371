"""Merge joins and teacher forcing: the engine's calls that run at once, outside the step.

`Joins` is the part of `sprint_jax.infer.engine.Engine` that joins a finished fork's children
into their parent's pages without re-running them (`merge`, `warm_merge` for its shapes), writes a
sequence's queued tokens now (`flush`, `flush_sync`), and runs tokens forced through a sequence or
a fork returning their logits (`forced_logits`, `fork_logits`: exactness tests compare them with a
plain forward).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import jax
import numpy as np

from sprint_jax.infer import programs
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.pages import PoolExhausted
from sprint_jax.infer.programs import CopyRows, PrefillRows
from sprint_jax.infer.requests import EngineError, ForkChild, ForkRecord, Seq, common_prefix
from sprint_jax.infer.buckets import bucket, bucket_fine, merge_pages


class Joins:
    """Merge joins and teacher forcing of `Engine` (a mixin over the engine's pool and tables)."""

    def _child_rows(self, seq: Seq, n: int, width: int, pages: int) -> tuple[list[int], PrefillRows]:
        """A prefill call's rows for `n` children of `seq`, `width` tokens and `pages` pages each,
        placed in the sequence's shard block (sh.slot_blocks): (the row of child j, the rows);
        padding rows write nowhere. The caller fills in tokens, tables, start and n_valid."""
        at, r_b = self._fork_blocks(seq, n)
        rows = PrefillRows.empty(r_b, width, pages)
        rows.pos_off[:] = seq.pos_offset
        return at, rows

    def _fork_blocks(self, seq: Seq, n: int) -> tuple[list[int], int]:
        return sh.slot_blocks([seq.slot] * n, self.max_seqs, self._parts,
                              cap=self.max_seqs // self._parts * self.max_children)

    def _merge_pages(self, tokens: int) -> int:
        """A merge's table width for `tokens` positions (`buckets.merge_pages`, capped at the
        parent capacity)."""
        return merge_pages(tokens, self.page_size, self.min_bucket, self.parent_capacity)

    def merge(self, seq: Seq, branches: Sequence[Sequence[int]]) -> Seq:
        """Join the children of the fork just finished on `seq` into it without re-running them:
        branches[j] is child j's final tokens after the fork (opening, body, repair as the layout
        tokenizes them): one non-empty branch per child. Their K/V is copied from the children's
        pages into the parent's after its prefix, in child order (one call, `programs.copy_join`).
        After a join fork (`fork(join=True)`) whose children's tokens are the branches, that copy is
        all: each child ran its last token in its decode and the last child kept its logits. Else the
        children first run, in their own pages, only the tokens they never computed (a repair, a
        re-tokenized end; a last token not run, or the last child's when its logits were not kept),
        fused with the copy in one call (`programs.merge`). The sequence continues at fork + the
        longest child (`pos_offset`); its next token is sampled from the last child's last logits
        (`join_logits`). The children's pages are released. Runs at once (no step needed): the
        call is dispatched now."""
        self._check_idle(seq, "merge")
        fork = seq.last_fork
        if fork is None or fork.at != len(seq.tokens) or not fork.finished:
            raise EngineError("merge needs the fork just finished on this sequence, with the sequence unchanged since")
        kids: list[ForkChild] = fork.children
        n = len(kids)
        branches = [[int(t) for t in b] for b in branches]
        if len(branches) != n:
            raise EngineError(f"merge of {len(branches)} branches; the fork has {n}")
        if any(not b for b in branches):
            raise EngineError("merge: a branch has no tokens")
        total = len(seq.tokens) + sum(len(b) for b in branches)
        if total > self.max_seq_len:
            raise EngineError(f"merging to {total} tokens exceeds max_seq_len={self.max_seq_len}")
        if any(1 + len(b) > self.child_capacity for b in branches):
            raise EngineError(f"merge: a branch of {max(len(b) for b in branches)} tokens exceeds the child "
                              f"capacity ({self.child_capacity})")
        p0 = seq.length
        # branch j's first keep[j] tokens are in child j's pages as they must be (positions
        # p0+1..p0+keep[j]; p0 holds the parent's pending token): the common prefix of what the
        # child ran and the branch, up to what it wrote. The last child's last token also needs
        # its logits (the join's): kept from its decode (`fork(join=True)`), else it runs again.
        keep = [min(common_prefix(kid.tokens[1:], b), kid.written - 1) for b, kid in zip(branches, kids)]
        if keep[-1] == len(branches[-1]) and not (kids[-1].logits is not None and kids[-1].written - 1 == keep[-1]):
            keep[-1] -= 1
        tails = [b[k:] for b, k in zip(branches, keep)]
        lens = [len(b) for b in branches]
        pages = self._merge_pages(p0 + sum(lens) + 1)
        # the copy: child 0's positions p0..p0+len_0 (p0: the parent's pending token, run in every
        # child), then each other child's p0+1..p0+len_j, to the parent's p0.. in child order; one
        # window of a length bucket per child (few shapes; `warm_merge` compiles them)
        at, _ = self._fork_blocks(seq, n)
        copies: list = []
        pieces_at = []
        pos, longest = 0, max(len(t) for t in tails)
        while pos < longest:
            pieces = [t[pos: pos + self.prefill_chunk] for t in tails]
            for j, p in enumerate(pieces):
                if p and not self._reserve_now(seq, kids[j].pages, p0 + 1 + keep[j] + pos, len(p), copies):
                    raise PoolExhausted(f"merge: the KV pool has no page for child {j}'s last tokens")
            pieces_at.append((pos, pieces))
            pos += self.prefill_chunk
        if not self._reserve_now(seq, seq.pages, p0, sum(lens) + 1, copies):
            raise PoolExhausted("merge: the KV pool has no pages for the joined branches")
        self._run_copies(copies)
        copy = self._join_copy(seq, at, kids, p0, lens, pages)      # the tables as reserved
        self.stats["join_copies"] += 1
        if not any(tails):
            # every token was computed in its branch (the children fed their last token): no
            # model call, only the copy
            self.cache = programs.copy_join(self.cache, copy, kv=self._kv)
            return self._joined(seq, branches, kids, kids[-1].logits, 0)
        # else one call (`programs.merge`): the tails (one prefill row per child, its shard's
        # block; tail bucket 1, 2, 4, ...), then the copy. A tail longer than prefill_chunk (rare)
        # runs its leading chunks as prefill calls first.
        last = None
        for k, (pos, pieces) in enumerate(pieces_at):
            # tails are short (a close tag, a repair): their own bucket (1, 2, 4, ...), no padding
            # to a prefill bucket (the call's compute is the tails' tokens, not 16 per child)
            _, rows_ = self._child_rows(seq, n, bucket(max(len(p) for p in pieces), 1), pages)
            for i, j, p in zip(at, range(n), pieces):
                rows_.tokens[i, : len(p)] = p
                rows_.table[i] = self._table(kids[j].pages, seq.part, pages)
                rows_.start[i] = p0 + 1 + keep[j] + pos
                rows_.n_valid[i] = len(p)
            if k + 1 < len(pieces_at):
                out = programs.prefill(self._step_params, self.config, self.cache, rows_, kv=self._kv,
                                       return_logits=True)
            else:
                out = programs.merge(self._step_params, self.config, self.cache, rows_, copy, kv=self._kv)
            self.cache, logits = out.pool, out.logits
            self.stats["prefill_calls"] += 1
            if pieces[-1]:
                last = logits[at[n - 1]]
        return self._joined(seq, branches, kids, last if tails[-1] else kids[-1].logits, sum(len(t) for t in tails))

    def _join_copy(self, seq: Seq, at: list[int], kids: list[ForkChild], p0: int, lens: list[int],
                   pages: int) -> CopyRows:
        """`copy_join`'s rows: child j (row at[j]) copies its positions p0 + t, t = 0..len_0 for
        child 0 and 1..len_j for the others, to the parent's p0 + off_j + t (off_j: the lengths of
        the children before it)."""
        width = self._join_window(max(lens))
        _, r_b = self._fork_blocks(seq, len(kids))
        copy = CopyRows.empty(r_b, width, pages, pages)
        parent = self._table(seq.pages, seq.part, pages)
        off = 0
        for j, (i, kid, n) in enumerate(zip(at, kids, lens)):
            t = np.arange(0 if j == 0 else 1, n + 1)
            copy.src_table[i] = self._table(kid.pages, seq.part, pages)
            copy.dst_table[i] = parent
            copy.src_pos[i, : len(t)] = p0 + t
            copy.dst_pos[i, : len(t)] = p0 + off + t
            off += n
        return copy

    def _join_window(self, longest: int) -> int:
        """`copy_join`'s window: a length bucket holding a child's positions 0..longest."""
        return min(bucket(longest + 1, self.min_bucket), self.child_capacity)

    def _joined(self, seq: Seq, branches: list[list[int]], kids: list[ForkChild], join_logits, ran: int) -> Seq:
        """The sequence after a merge join (see `Seq`): the children's pages released, nothing
        from the fork on cached (the branches sit side by side, not as one plain prefix)."""
        lens = [len(b) for b in branches]
        if seq.trace is not None:
            seq.trace.merged(branches)
        for kid in kids:
            self._alloc(seq).release(kid.pages)
        seq.pages.length = seq.length + 1 + sum(lens)
        seq.cache_len = min(seq.cache_len, seq.length)
        seq.tokens = seq.tokens + [t for b in branches for t in b]
        seq.pos_offset += max(lens) - sum(lens)
        seq.joined = len(seq.tokens)
        seq.join_logits = join_logits
        seq.last_fork = None
        self.last_join_tokens = ran
        return seq

    def flush(self, seq: Seq) -> None:
        """Write the sequence's queued tokens (an open's prompt, extends) into its pages now."""
        while seq.id in self._prefill_work:
            self.step_or_raise()

    def _write_rows(self, seq: Seq, sp, i: int, r_b: int, piece: list[int], start: int) -> PrefillRows:
        """One prefill row (at row i of r_b) writing `piece` at positions start.. of `sp` (pages
        reserved, copies on write run)."""
        copies: list = []
        if not self._reserve_now(seq, sp, start, len(piece), copies):
            raise PoolExhausted("the KV pool has no pages for these tokens")
        self._run_copies(copies)
        width = self._merge_pages(start + len(piece))
        r = PrefillRows.empty(r_b, bucket_fine(len(piece), 16), width)      # padding rows write nowhere
        r.tokens[i, : len(piece)] = piece
        r.table[i] = self._table(sp, seq.part, width)
        r.start[i], r.n_valid[i], r.pos_off[i] = start, len(piece), seq.pos_offset
        return r

    def forced_logits(self, seq: Seq, tokens: Sequence[int] = ()) -> np.ndarray:
        """Teacher forcing on an idle sequence, now: its pending token and tokens[:-1] run through
        its pages (prefill calls) and tokens are appended; returns the logits [T, V] that predict
        each of tokens (row t: after the sequence + tokens[:t]). tokens empty: the next token's
        logits [1, V], nothing appended (exactness tests compare them with a plain forward)."""
        self._check_idle(seq, "forced_logits")
        if seq.after_join:
            raise EngineError("forced_logits right after a merge join: its logits are the join logits")
        tokens = [int(t) for t in tokens]
        if len(seq.tokens) + len(tokens) > self.max_seq_len:
            raise EngineError(f"extending to {len(seq.tokens) + len(tokens)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        self._retire_fork(seq)
        self.flush(seq)
        run = [seq.tokens[-1]] + tokens[:-1]
        (i,), r_b = sh.slot_blocks([seq.slot], self.max_seqs, self._parts)
        rows = []
        for pos in range(0, len(run), self.prefill_chunk):
            piece = run[pos: pos + self.prefill_chunk]
            r = self._write_rows(seq, seq.pages, i, r_b, piece, seq.length + pos)
            out = programs.prefill(self._step_params, self.config, self.cache, r, kv=self._kv, return_logits=True,
                                   all_logits=True)
            self.cache, logits = out.pool, out.logits
            seq.pages.length = seq.length + pos + len(piece)
            self.stats["prefill_calls"] += 1
            rows.append(np.asarray(logits[i, : len(piece)]))
        seq.tokens = seq.tokens + tokens
        return np.concatenate(rows)

    def fork_logits(self, seq: Seq, branches: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher forcing over a fork, now: child j runs the sequence's pending token and
        branches[j][:-1] in its own pages (prefill calls); returns per child the logits
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
        self._retire_fork(seq)
        self.flush(seq)
        p0 = seq.length
        seq.pages.length = p0
        children = self._alloc(seq).fork(seq.pages, n).children
        runs = [[seq.tokens[-1]] + b[:-1] for b in branches]
        out: list[list[np.ndarray]] = [[] for _ in range(n)]
        for pos in range(0, max(len(r) for r in runs), self.prefill_chunk):
            pieces = [r[pos: pos + self.prefill_chunk] for r in runs]
            pages = self._merge_pages(p0 + pos + max(len(p) for p in pieces))
            at, rows = self._child_rows(seq, n, bucket_fine(max(len(p) for p in pieces), 16), pages)
            copies: list = []
            for i, p, sp in zip(at, pieces, children):
                if p and not self._reserve_now(seq, sp, p0 + pos, len(p), copies):
                    raise PoolExhausted("fork_logits: the KV pool has no pages for the branches")
                rows.tokens[i, : len(p)] = p
                rows.table[i] = self._table(sp, seq.part, pages)
                rows.start[i] = p0 + pos
                rows.n_valid[i] = len(p)
            self._run_copies(copies)
            res = programs.prefill(self._step_params, self.config, self.cache, rows, kv=self._kv,
                                   return_logits=True, all_logits=True)
            self.cache, logits = res.pool, np.asarray(res.logits)
            self.stats["prefill_calls"] += 1
            for j, (i, p) in enumerate(zip(at, pieces)):
                if p:
                    children[j].length = p0 + pos + len(p)
                out[j].append(logits[i, : len(p)])
        seq.last_fork = ForkRecord(len(seq.tokens), [ForkChild([seq.tokens[-1]] + b, len(r), None, sp)
                                                     for b, r, sp in zip(branches, runs, children)])
        if seq.trace is not None:               # teacher forcing: not followed by the trace
            seq.trace.exact = False
        return [np.concatenate(o) for o in out]

    def flush_sync(self, seq: Seq) -> bool:
        """Write the sequence's queued tokens now and wait until its pages hold them: the end of
        the orchestrator's sync, so that a stage's `sync_s` is the join's real cost (an extend
        only queues its tokens for the next step; a merge's call runs asynchronously). Only when
        nothing else is in flight and the tokens would take a prefill call anyway (more than a
        decode chunk; fewer ride the sequence's next decode chunk), so no batching or step is
        given up: the same prefill calls, run before the next step instead of in it. Returns
        whether it wrote anything."""
        work = self._prefill_work.get(seq.id)
        if (self._waiting or any(w.seq is not seq for w in self._prefill_work.values())
                or any(r is not None for rows in self._groups.values() for r in rows)
                or (work is not None and work.left <= self.decode_chunk)):
            return False
        wrote = work is not None
        while seq.id in self._prefill_work:
            calls = self.stats["prefill_calls"]
            self._prefill_parents()
            if self.stats["prefill_calls"] == calls:
                raise PoolExhausted("the KV pool has no pages for the sequence's queued tokens")
        jax.block_until_ready(self.cache)
        return wrote

    def warm_merge(self, children: int | None = None, max_parent_len: int | None = None,
                   tails: Sequence[int] = (1, 2)) -> int:
        """Compile the merge join's shapes ahead of time, so that no compile lands in a timed sync:
        for `children` children (default max_children), one call per (table width up to
        max_parent_len (default max_seq_len), copy window up to the child capacity, tail bucket in
        `tails`; tails of 1 and 2 tokens are the usual: each child's close tag, a repair) and the
        copy alone (a join with nothing left to run, the usual join) per (table width, window).
        The calls write nothing (padding rows). Returns the number of shapes."""
        children = self.max_children if children is None else children
        if not 1 <= children <= self.max_children:
            raise EngineError(f"warm_merge: children must be in 1..{self.max_children}, got {children}")
        top_pages = self._merge_pages(self.parent_capacity if max_parent_len is None else max_parent_len + 1)
        _, r_b = sh.slot_blocks([0] * children, self.max_seqs, self._parts,
                                cap=self.max_seqs // self._parts * self.max_children)

        def ladder(first: int, top: int, step) -> list[int]:
            out, b = [], first
            while True:
                out.append(b)
                if b >= top:
                    return out
                b = step(b)

        widths = ladder(self._merge_pages(1), top_pages, lambda b: min(2 * b, top_pages))
        windows = ladder(self._join_window(0), self.child_capacity, lambda b: self._join_window(2 * b - 1))
        shapes = 0
        for pages, win in itertools.product(widths, windows):
            copy = CopyRows.empty(r_b, win, pages, pages)
            self.cache = programs.copy_join(self.cache, copy, kv=self._kv)            # the copy alone
            shapes += 1
            for t_b in sorted({bucket(t, 1) for t in tails}):
                rows = PrefillRows.empty(r_b, t_b, pages)
                self.cache = programs.merge(self._step_params, self.config, self.cache, rows, copy, kv=self._kv).pool
                shapes += 1
        jax.block_until_ready(self.cache)
        return shapes
