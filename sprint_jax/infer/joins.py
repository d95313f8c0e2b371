"""Merge joins and teacher forcing: the engine's calls that run at once, outside the step.

`Joins` is the part of `sprint_jax.infer.engine.Engine` that joins a finished fork's children
into their parent's slot without re-running them (`merge`, `warm_merge` for its shapes), writes a
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
from sprint_jax.infer.programs import PrefillRows
from sprint_jax.infer.requests import EngineError, ForkChild, ForkRecord, Seq, common_prefix
from sprint_jax.infer.slot_cache import bucket, bucket_fine


class Joins:
    """Merge joins and teacher forcing of `Engine` (a mixin over the engine's cache and slots)."""

    def _child_rows(self, seq: Seq, n: int, p0: int, width: int) -> tuple[list[int], PrefillRows]:
        """A child prefill call's rows for `n` children of `seq` forked at `p0`, `width` tokens
        each, placed in the sequence's slot shard (sh.slot_blocks): (the row of child j, the rows);
        padding rows write nowhere. The caller fills in tokens, start and n_valid."""
        at, r_b = sh.slot_blocks([seq.slot] * n, self.max_seqs, self._parts,
                                 cap=self.max_seqs // self._parts * self.max_children)
        rows = PrefillRows.empty(r_b, width, self.max_seqs * self.max_children)
        rows.parent[:], rows.fork_len[:], rows.pos_off[:] = seq.slot, p0, seq.pos_offset
        for j, i in enumerate(at):
            rows.slot[i] = seq.slot * self.max_children + j
        return at, rows

    def merge(self, seq: Seq, branches: Sequence[Sequence[int]]) -> Seq:
        """Join the children of the fork just finished on `seq` into its slot without re-running
        them: branches[j] is child j's final tokens after the fork (opening, body, repair as the
        layout tokenizes them): one non-empty branch per child. Their slot rows are copied after
        the parent's prefix in child order (one call, `programs.copy_join`).
        After a join fork (`fork(join=True)`) whose children's tokens are the branches, that copy is
        all: each child ran its last token in its decode and the last child kept its logits. Else the
        children first run, in their own slots, only the tokens they never computed (a repair, a
        re-tokenized end; a last token not run, or the last child's when its logits were not kept),
        fused with the copy in one call (`programs.merge`). The sequence continues at fork + the longest
        child (`pos_offset`); its next token is sampled from the last child's last logits
        (`join_logits`). Runs at once (no step needed): the call is dispatched now."""
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
        # branch j's first keep[j] tokens are in child j's slot as they must be (its slots
        # 1..keep[j]; slot 0 is the parent's pending token): the common prefix of what the child
        # ran and the branch, up to what its slot holds. The last child's last token also needs
        # its logits (the join's): kept from its decode (`fork(join=True)`), else it runs again.
        keep = [min(common_prefix(kid.tokens[1:], b), kid.written - 1) for b, kid in zip(branches, kids)]
        if keep[-1] == len(branches[-1]) and not (kids[-1].logits is not None and kids[-1].written - 1 == keep[-1]):
            keep[-1] -= 1
        tails = [b[k:] for b, k in zip(branches, keep)]
        # the copy (`copy_join`): child 0's slots 0..len (slot 0: the parent's pending token, run
        # in every child), then each other child's slots 1..len, to parent slots p0.. in child
        # order; one window per child of a length bucket (few shapes; `warm_merge` compiles them)
        lens = [len(b) for b in branches]
        meta = self._join_meta(seq, p0, lens)
        w = self._join_window(max(lens))
        self.stats["join_copies"] += 1
        if not any(tails):
            # every token was computed in its branch (the children fed their last token): no
            # model call, only the copy
            self.cache = programs.copy_join(self.cache, meta, w=w, kv=self._kv)
            return self._joined(seq, branches, kids[-1].logits, 0)
        # else one call (`programs.merge`): the tails (one child prefill row per child, its shard's
        # block; tail bucket 1, 2, 4, ...), then the copy. A tail longer than prefill_chunk (rare) runs
        # its leading chunks as child prefill calls first.
        s_b = self._merge_bucket(p0 + 1, self.parent_capacity)
        last, pos, longest = None, 0, max(len(t) for t in tails)
        while pos < longest:
            pieces = [t[pos: pos + self.prefill_chunk] for t in tails]
            # tails are short (a close tag, a repair): their own bucket (1, 2, 4, ...), no padding
            # to a prefill bucket (the call's compute is the tails' tokens, not 16 per child)
            at, rows_ = self._child_rows(seq, n, p0, bucket(max(len(p) for p in pieces), 1))
            for i, j, p in zip(at, range(n), pieces):
                rows_.tokens[i, : len(p)] = p
                rows_.start[i] = 1 + keep[j] + pos
                rows_.n_valid[i] = len(p)
            c_b = self._merge_bucket(int(rows_.start.max()) + 1, self.child_capacity)
            if pos + self.prefill_chunk < longest:
                self.cache, logits = programs.prefill(self._step_params, self.config, self.cache, rows_, kind="child",
                                                      s_b=s_b, c_b=c_b, kv=self._kv, return_logits=True)
            else:
                self.cache, logits = programs.merge(self._step_params, self.config, self.cache, rows_, meta, s_b=s_b,
                                                    c_b=c_b, w=w, kv=self._kv)
            self.stats["prefill_calls"] += 1
            if pieces[-1]:
                last = logits[at[n - 1]]
            pos += self.prefill_chunk
        return self._joined(seq, branches, last if tails[-1] else kids[-1].logits, sum(len(t) for t in tails))

    def _join_meta(self, seq: Seq, p0: int, lens: list[int]) -> np.ndarray:
        """`copy_join`'s meta: one row per slot shard, the sequence's shard's (parent slot, p0, per
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
        """`copy_join`'s window: a length bucket holding a child's slots 0..longest."""
        return min(self._merge_bucket(longest + 1, self.child_capacity), self.parent_capacity)

    def _joined(self, seq: Seq, branches: list[list[int]], join_logits, ran: int) -> Seq:
        """The sequence after a merge join (see `Seq`)."""
        lens = [len(b) for b in branches]
        if seq.trace is not None:
            seq.trace.merged(branches)
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
        token's logits [1, V], nothing appended (exactness tests compare them with a plain forward)."""
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
            r = PrefillRows.empty(r_b, bucket_fine(len(piece), 16), self.max_seqs)   # padding rows write nowhere
            r.tokens[i, : len(piece)] = piece
            r.slot[i] = r.parent[i] = seq.slot
            r.start[i], r.n_valid[i], r.pos_off[i] = seq.length + pos, len(piece), seq.pos_offset
            s_b = min(bucket(int(r.start[i]) + 1, self.min_bucket), self.parent_capacity)
            self.cache, logits = programs.prefill(self._step_params, self.config, self.cache, r, kind="parent",
                                                  s_b=s_b, c_b=1, kv=self._kv, return_logits=True, all_logits=True)
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
        out: list[list[np.ndarray]] = [[] for _ in range(n)]
        for pos in range(0, max(len(r) for r in runs), self.prefill_chunk):
            pieces = [r[pos: pos + self.prefill_chunk] for r in runs]
            at, rows = self._child_rows(seq, n, p0, bucket_fine(max(len(p) for p in pieces), 16))
            rows.start[:] = pos
            for i, p in zip(at, pieces):
                rows.tokens[i, : len(p)] = p
                rows.n_valid[i] = len(p)
            s_b = min(bucket(p0 + 1, self.min_bucket), self.parent_capacity)
            c_b = min(bucket(pos + 1, self.min_bucket), self.child_capacity)
            self.cache, logits = programs.prefill(self._step_params, self.config, self.cache, rows, kind="child",
                                                  s_b=s_b, c_b=c_b, kv=self._kv, return_logits=True, all_logits=True)
            self.stats["prefill_calls"] += 1
            logits = np.asarray(logits)
            for j, (i, p) in enumerate(zip(at, pieces)):
                out[j].append(logits[i, : len(p)])
        seq.last_fork = ForkRecord(len(seq.tokens), [ForkChild([seq.tokens[-1]] + b, len(r))
                                                     for b, r in zip(branches, runs)])
        if seq.trace is not None:               # teacher forcing: not followed by the trace
            seq.trace.exact = False
        return [np.concatenate(o) for o in out]

    def flush_sync(self, seq: Seq) -> bool:
        """Write the sequence's queued tokens now and wait until its slot holds them: the end of
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
            self._prefill_parents()
        jax.block_until_ready(self.cache)
        return wrote

    def _merge_bucket(self, n: int, cap: int) -> int:
        """A merge's length bucket (parent prefix, child rows): min_bucket * 2^k, capped."""
        return min(bucket(n, self.min_bucket), cap)

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

        shapes = 0
        meta = np.zeros((self._parts, 2 + 2 * self.max_children), np.int32)     # no child: writes nothing
        windows = sorted({min(c, self.parent_capacity) for c in buckets(self.child_capacity, self.child_capacity)})
        for w in windows:
            self.cache = programs.copy_join(self.cache, meta, w=w, kv=self._kv)    # the copy alone
            shapes += 1
        for s_b, c_b, t_b in itertools.product(buckets(self.parent_capacity, top),
                                               buckets(self.child_capacity, self.child_capacity),
                                               sorted({bucket(t, 1) for t in tails})):
            rows = PrefillRows.empty(r_b, t_b, self.max_seqs * self.max_children)
            self.cache, _ = programs.merge(self._step_params, self.config, self.cache, rows, meta, s_b=s_b, c_b=c_b,
                                           w=min(c_b, self.parent_capacity), kv=self._kv)
            shapes += 1
        jax.block_until_ready(self.cache)
        return shapes
