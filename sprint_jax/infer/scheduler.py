"""The engine's step: which rows prefill and decode, their arguments, and what the results mean.

`Scheduler` is the part of `sprint_jax.infer.engine.Engine` that turns the queued work into
program calls (`sprint_jax.infer.programs`). Each `step()` admits queued opens, runs one prefill
chunk for every sequence that has tokens to prefill (one call for parents, one for children) and
`decode_chunk` decode steps for every decoding row (one call), then checks stops on the host
(`StopScanner`, incremental) and finishes rows. Sampling per row: key fold_in(fold_in(key(seed),
j), step), j = the branch index, step = tokens this request generated so far, so a request gives
the same tokens whichever other requests share its steps.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from sprint_jax.infer import programs
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.pages import PageCopy, PoolExhausted, SeqPages, copy_args, copy_pages
from sprint_jax.infer.programs import DecodeRows, PrefillRows
from sprint_jax.infer.requests import ForkChild, Generation, NoProgress, Op, PrefillWork, Row
from sprint_jax.infer.sampling import TOP_LOGPROBS
from sprint_jax.infer.buckets import bucket, bucket_fine, page_bucket


@dataclasses.dataclass
class _Piece:
    """Tokens one prefill call writes for a sequence's queued work or a child's forced prefix: its
    owner (the `PrefillWork` or the child's `Row`), its slot (the shard block it is placed in),
    the pages and pool shard it writes, the tokens, where they start, the position shift."""
    owner: PrefillWork | Row
    slot: int
    pages: SeqPages
    part: int
    tokens: list[int]
    start: int
    pos_off: int


@dataclasses.dataclass
class _RowRun:
    """A row's part in a decode call: the row, whether it is a fork's child, its sequence's slot,
    the tokens of K/V its pages hold before the call, the tokens it runs (the pending one first,
    then forced ones) and, once placed, its row in the call."""
    row: Row
    child: bool
    slot: int
    start: int
    feed: list[int]
    at: int = -1

    @property
    def seq(self):
        return self.row.op.seq

    @property
    def pages(self) -> SeqPages:
        return self.row.pages if self.child else self.row.op.seq.pages

    @property
    def shared(self) -> int:
        """Tokens it reads as its sibling group's shared prefix (0: a generate row)."""
        return self.row.op.fork.shared_len if self.child else 0

    def writes(self, chunk: int) -> int:
        """The most tokens of K/V the call may write for it: its forced tokens, a chunk, and a fed
        last token (a join fork's child)."""
        return len(self.feed) - 1 + chunk + (self.child and self.row.op.join)


class Scheduler:
    """The step machinery of `Engine` (a mixin: it reads and writes the engine's queues, rows,
    cache and counters)."""

    # ---- one engine step ------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, prefill one chunk per sequence, decode one chunk for every decoding row.
        Returns whether anything happened (False: idle, or opens wait for slots that idle
        sequences hold; only closing one of them frees a slot)."""
        self.stats["steps"] += 1
        moved = lambda: (len(self._waiting), len(self._preempted), self.stats["prefill_calls"],  # noqa: E731
                         self.stats["decode_calls"])
        before = moved()
        # the oldest run that waited for pages last step, while it still holds pages (not since
        # preempted, closed or aborted): no younger run takes a fresh page this step
        w, self._wait_min = self._wait_min, None
        self._oldest_wait = w if w is not None and any(
            s.admitted == w and s.pages is not None for s in self._live_seqs()) else None
        self._admit()
        self._page_waits = 0
        self._prefill_parents()
        self._prefill_children()
        self._decode()
        if before != moved():
            return True
        if self._page_waits:
            # rows wait for pages that live runs hold: one run gives its pages back (and comes
            # back when no row waits for pages)
            return self._preempt()
        return False

    def run(self, ops: Sequence[Op] = ()) -> None:
        """Step until the given operations are done (or, without ops, until idle). Raises
        EngineError instead of waiting forever when no step can make progress."""
        while (not all(o.done for o in ops)) if ops else self.busy:
            self.step_or_raise()

    def step_or_raise(self) -> None:
        """`step`, raising `NoProgress` (an EngineError) that names what blocks it instead of returning False."""
        if not self.step():
            if self.live_rows or (self._waiting and self._free) or self._prefill_work:
                raise NoProgress(f"no progress: live sequences hold the KV pool's {self.num_pages} pages of "
                                  f"{self.page_size} tokens (close one, or give the engine more num_pages)")
            raise NoProgress(f"no progress: {len(self._waiting)} open(s) wait for a slot and all "
                              f"{self.max_seqs} slots hold idle sequences (close one)")

    def _forced_in_decode(self, work: PrefillWork) -> bool:
        """Whether a sequence's queued tokens ride as forced tokens in its next decode chunk (few
        left, and its generate op decodes next) instead of a prefill call."""
        rows = self._groups.get(work.seq.slot)
        return (work.left <= self.decode_chunk and rows is not None and rows[0] is not None
                and rows[0].reason is None)

    # ---- pages ----------------------------------------------------------------------------
    def _table(self, sp, part: int, width: int, first: int = 0) -> np.ndarray:
        """Pages first.. of a sequence's table as global ids, `width` wide (padding -1: never
        written, read only under the row's length)."""
        row = np.full(width, -1, np.int32)
        pages = sp.pages[first: first + width]
        row[: len(pages)] = np.asarray(pages, np.int32) + part * self._part_pages
        return row

    def _page_bucket(self, n_pages: int, cap_tokens: int) -> int:
        """A table width for n_pages pages (`buckets.page_bucket`)."""
        return page_bucket(n_pages, self.page_size, self.min_bucket, cap_tokens)

    def _reserve_now(self, seq, sp, start: int, n: int, copies: list) -> bool:
        """`_reserve` for a call that cannot wait for a later step (a merge join, teacher forcing):
        when the pool has no room, runs are preempted (`_preempt`, youngest first) until it has.
        False: nothing left to preempt."""
        while not self._reserve(seq, sp, start, n, copies, wait=False):
            if not self._preempt(seq.part):
                return False
        return True

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _reserve(self, seq, sp, start: int, n: int, copies: list, wait: bool = True) -> bool:
        """Pages for n tokens of run `seq` written at positions start.. of `sp` (copy on write of a
        shared page: its copy appended to `copies`). False when the pool has no room: the row
        waits, and until it has them no younger run takes a fresh page (the oldest waiting run
        gets the pages others free, so it always gets on: a run younger than it is preempted when
        nothing moves). wait=False: a call that cannot wait (no such hold)."""
        part = seq.part
        sp.length = start
        alloc = self._allocs[part]
        if (wait and self._oldest_wait is not None and seq.admitted > self._oldest_wait
                and alloc.fresh_pages(sp, n)):
            self._waits(seq)
            return False
        try:
            copies.extend((part, c) for c in alloc.prepare_write(sp, n))
        except PoolExhausted:
            self._waits(seq)
            return False
        return True

    def _waits(self, seq) -> None:
        self._page_waits += 1
        self._wait_min = seq.admitted if self._wait_min is None else min(self._wait_min, seq.admitted)

    def _run_copies(self, copies: list) -> None:
        """The copies on write of this call's rows, before it (one call)."""
        if not copies:
            return
        src, dst = copy_args([PageCopy(c.src + part * self._part_pages, c.dst + part * self._part_pages)
                              for part, c in copies], self.num_pages)
        self.cache = copy_pages(self.cache, src, dst, sharding=None if self._kv is None else self._kv[0])
        self.stats["page_copies"] = self.stats.get("page_copies", 0) + len(copies)

    def _child_pages(self, row: Row) -> bool:
        """Give a fork's child its page table: the fork's pages are made when the parent's queued
        tokens are written (a child shares what the parent holds then). False: not yet."""
        op = row.op
        if row.pages is None:
            if op.fork is None:
                if op.seq.id in self._prefill_work:
                    return False
                sp = op.seq.pages
                sp.length = op.seq.length
                op.fork = self._allocs[op.seq.part].fork(sp, len(op.prefixes))
            elif row.restarted:               # preempted: a new share of the parent's pages
                if op.seq.pages is None or op.seq.id in self._prefill_work:
                    return False
                sp = op.seq.pages
                sp.length = op.seq.length
                op.fork.children[row.j] = self._allocs[op.seq.part].fork(sp, 1).children[0]
                row.restarted = False
            row.pages = op.fork.children[row.j]
        return True

    def _prefill_parents(self) -> None:
        pieces, copies = [], []
        for work in self._prefill_work.values():
            if self._forced_in_decode(work) or work.seq.pages is None:
                continue
            seq = work.seq
            piece = _Piece(work, seq.slot, seq.pages, seq.part, work.run[work.done: work.done + self.prefill_chunk],
                           work.base + work.done, seq.pos_offset)
            if self._reserve(seq, seq.pages, piece.start, len(piece.tokens), copies):
                pieces.append(piece)
        if pieces:
            self._prefill_call(pieces, copies, cap=None, cap_tokens=self.parent_capacity)
        for piece in pieces:
            work = piece.owner
            work.done += len(piece.tokens)
            if work.left <= 0:
                del self._prefill_work[work.seq.id]

    def _prefill_children(self) -> None:
        pieces, copies = [], []
        for slot, rows in self._groups.items():
            for row in rows[1:]:
                if (row is not None and len(row.run) - 1 - row.prefill_pos > self.decode_chunk
                        and row.op.seq.id not in self._prefill_work and self._child_pages(row)):
                    seq = row.op.seq
                    piece = _Piece(row, slot, row.pages, seq.part,
                                   row.run[row.prefill_pos: len(row.run) - 1][: self.prefill_chunk],
                                   seq.length + row.prefill_pos, seq.pos_offset)
                    if self._reserve(seq, row.pages, piece.start, len(piece.tokens), copies):
                        pieces.append(piece)
        if pieces:
            self._prefill_call(pieces, copies, cap=self.max_seqs // self._parts * self.max_children,
                               cap_tokens=self.parent_capacity + self.child_capacity)
        for piece in pieces:
            piece.owner.prefill_pos += len(piece.tokens)

    def _prefill_call(self, pieces: list[_Piece], copies: list, cap: int | None, cap_tokens: int) -> None:
        """One prefill call writing every piece (each placed in its sequence's shard block; `cap`:
        rows per block, `cap_tokens`: the longest table such pieces can have)."""
        at, r_b = sh.slot_blocks([p.slot for p in pieces], self.max_seqs, self._parts, cap=cap)
        width = self._page_bucket(max(self._pages_for(p.start + len(p.tokens)) for p in pieces), cap_tokens)
        r = PrefillRows.empty(r_b, bucket_fine(max(len(p.tokens) for p in pieces), 16), width)
        for i, p in zip(at, pieces):
            r.tokens[i, : len(p.tokens)] = p.tokens
            r.table[i] = self._table(p.pages, p.part, width)
            r.start[i], r.n_valid[i], r.pos_off[i] = p.start, len(p.tokens), p.pos_off
        self._run_copies(copies)
        # host arrays go to the jitted call as they are (jnp.asarray / jnp.zeros would each be a
        # dispatched op: ~0.1-0.4 ms of host time per prefill call on a small model)
        self.cache = programs.prefill(self._step_params, self.config, self.cache, r, kv=self._kv).pool
        self.stats["prefill_calls"] += 1
        for p in pieces:
            p.pages.length = p.start + len(p.tokens)

    def _decoding(self, row: Row | None, child: bool) -> bool:
        """Whether the row decodes in this step: its context is written, but for at most
        decode_chunk tokens that its chunk takes as forced tokens."""
        if row is None or row.reason is not None or row.op.seq.pages is None:
            return False
        work = self._prefill_work.get(row.op.seq.id)
        if child:
            return (work is None and len(row.run) - 1 - row.prefill_pos <= self.decode_chunk
                    and self._child_pages(row))
        return work is None or self._forced_in_decode(work)

    def _feed(self, row: Row, child: bool) -> tuple[int, list[int]]:
        """(tokens of K/V the row's sequence holds before this call, tokens to run from there:
        the pending one first, then the forced ones)."""
        seq = row.op.seq
        if child:
            if row.gen:
                return seq.length + len(row.run) - 1 + len(row.gen), [row.gen[-1]]
            return seq.length + row.prefill_pos, row.run[row.prefill_pos:]
        work = self._prefill_work.get(seq.id)
        pending = row.gen[-1] if row.gen else seq.tokens[-1]
        if work is not None:          # a prompt or extend; a preempted run's tokens computed again
            return work.base + work.done, work.run[work.done:] + [pending]
        return seq.length + len(row.gen), [pending]

    def _decode(self) -> None:
        """One decode call over the active rows only: sequences running a generate op (rows A)
        and, grouped by fork, the children of running forks (rows F x w, w = the most children
        alive in one fork, bucketed). A read-only parent and a finished child take no row; a row
        the pool has no pages for waits for a later step."""
        gen_rows: list[_RowRun] = []
        forks: list[list[_RowRun]] = []
        copies: list = []
        for slot, rows in sorted(self._groups.items()):
            if self._decoding(rows[0], False):
                run = _RowRun(rows[0], False, slot, *self._feed(rows[0], False))
                if self._reserve(run.seq, run.pages, run.start, run.writes(self.decode_chunk), copies):
                    gen_rows.append(run)
            kids = []
            for r in rows[1:]:
                if self._decoding(r, True):
                    run = _RowRun(r, True, slot, *self._feed(r, True))
                    if self._reserve(run.seq, run.pages, run.start, run.writes(self.decode_chunk), copies):
                        kids.append(run)
            if kids:
                forks.append(kids)
        if not gen_rows and not forks:
            return
        # Rows in `parts` equal blocks (page shards, data > 1; one block otherwise): block j holds
        # its wa generate rows, then its wf fork groups of w rows, all of shard j's sequences
        # (`sh.slot_blocks`), so each shard's `programs.decode` body reads and writes only its pages.
        parts, chunk, ps = self._parts, self.decode_chunk, self.page_size
        at_a, na = sh.slot_blocks([g.slot for g in gen_rows], self.max_seqs, parts) if gen_rows else ([], 0)
        at_f, nf = sh.slot_blocks([k[0].slot for k in forks], self.max_seqs, parts) if forks else ([], 0)
        wa, wf = na // parts, nf // parts
        w = min(bucket(max(len(k) for k in forks), 1), self.max_children) if forks else 1
        ma = self._page_bucket(max((self._pages_for(g.start + g.writes(chunk)) for g in gen_rows), default=1),
                               self.parent_capacity)
        mg = self._page_bucket(max((k[0].shared // ps for k in forks), default=1), self.parent_capacity)
        mr = self._page_bucket(max((self._pages_for(c.start + c.writes(chunk) - c.shared) for k in forks for c in k),
                                   default=1), ps + self.child_capacity)
        r = DecodeRows.empty(na, nf, w, chunk, ma, mg, mr)
        placed: list[_RowRun] = []
        block = wa + wf * w                                           # rows per shard
        for p, g in zip(at_a, gen_rows):
            r.a_table[p] = self._table(g.pages, g.seq.part, ma)
            g.at = (p // wa) * block + p % wa
            placed.append(g)
        for q, kids in zip(at_f, forks):
            seq, shared = kids[0].seq, kids[0].shared
            r.b_gtable[q] = self._table(seq.pages, seq.part, mg)[:mg]
            r.b_gtable[q, shared // ps:] = -1                            # the shared full pages only
            r.b_glen[q] = shared
            for c, kid in enumerate(kids):
                r.b_table[q * w + c] = self._table(kid.pages, seq.part, mr, first=shared // ps)
                kid.at = (q // wf) * block + wa + (q % wf) * w + c
                placed.append(kid)
        for run in placed:
            i, row = run.at, run.row
            r.lengths[i] = run.start - run.shared
            r.pending[i] = run.feed[0]
            r.forced[i, : len(run.feed) - 1] = run.feed[1:]
            r.n_forced[i] = len(run.feed) - 1
            r.pos_off[i] = run.seq.pos_offset
            r.feed_last[i] = run.child and row.op.join
            r.active[i] = True
            r.remaining[i] = row.limit - len(row.gen)
            r.stop_ids[i] = self.stop_ids(row.stops)
            s = row.op.sampling
            r.seeds[i], r.branch[i], r.steps[i] = s.seed, row.key_branch, len(row.gen)
            r.temperature[i], r.top_k[i], r.top_p[i] = s.temperature, s.top_k, s.top_p
        fed_rows, n_forced = r.feed_last, r.n_forced
        feeding = bool(fed_rows.any())
        # the alternatives per token, only when a request asks (a second compiled variant)
        top_n = TOP_LOGPROBS if any(run.row.op.top_logprobs for run in placed) else 0
        packed, layout = r.pack()
        self._run_copies(copies)
        res = programs.decode(
            self._step_params, self.config, self.cache, packed, layout=layout, chunk=chunk, kv=self._kv,
            attention_impl=self.attention_impl, n_valid=self.n_valid, feeding=feeding, top_logprobs=top_n)
        self.cache, kept = res.pool, res.kept
        out, reason, lps, tops = jax.device_get((res.tokens, res.reason, res.logprobs,
                                                 (res.top_ids, res.top_logprobs) if top_n else None))
        self.stats["decode_calls"] += 1
        for run in placed:
            i, row, child = run.at, run.row, run.child
            if n_forced[i]:                   # all taken: a row forces before it can finish
                if child:
                    row.prefill_pos = len(row.run) - 1
                else:
                    del self._prefill_work[row.op.seq.id]
            cols = np.flatnonzero(out[i] >= 0)
            new = [int(t) for t in out[i, cols]]
            # K/V written: the forced tokens, the pending token of every sampling step, and a fed
            # last token
            run.pages.length = run.start + int(n_forced[i]) + len(new) + bool(fed_rows[i] and reason[i])
            self.stats["tokens"] += len(new)
            row.gen.extend(new)
            row.lps.extend(float(x) for x in lps[i, cols])
            if row.op.top_logprobs:
                n = row.op.top_logprobs
                row.tops.extend([(int(t), float(v)) for t, v in zip(tops[0][i, c, :n], tops[1][i, c, :n])
                                 if np.isfinite(v)] for c in cols)
            k = row.scanner.feed(new)
            if k is not None:
                row.overshoot = len(row.gen) - k
                row.gen, row.lps, row.tops = row.gen[:k], row.lps[:k], row.tops[:k]
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
                    row.last_logits = programs.row_of(kept, np.int32(i))   # the join logits of a merge (device)
                self._row_done(row, child)

    def _row_done(self, row: Row, child: bool) -> None:
        op, seq = row.op, row.op.seq
        gen = Generation(tokens=row.gen, text=self.decode_text(row.gen), stop_reason=row.reason,
                         overshoot=row.overshoot, steps=len(row.gen) + row.overshoot, logprobs=row.lps,
                         top_logprobs=row.tops if op.top_logprobs else None)
        group = self._groups[seq.slot]
        if not child:
            group[0] = None
            seq.tokens = seq.tokens + row.gen
            if seq.trace is not None:
                seq.trace.sync(seq, row.lps)
            self._finish(op, gen)
            return
        group[1 + row.j] = None
        op.result[row.j] = gen
        if seq.trace is not None:
            seq.trace.child(row.j, row.run[1:] + row.gen, len(row.gen), row.lps)
        if seq.last_fork is not None:
            # what a merge join needs: the child's tokens, how many of them its slot holds, and the
            # logits after the last (None: not kept). At the end every forced token (prefilled or
            # taken in a decode chunk) and each generated token but the last is written; the last
            # too when it was fed (row.fed; a host-side stop's overshoot wrote more: not counted)
            seq.last_fork.children[row.j] = ForkChild(row.run + row.gen, len(row.run) - 1 + len(row.gen) + row.fed,
                                                      row.last_logits, row.pages)
        if op.queued:                         # a serial fork: the next child starts
            nxt = op.queued.pop(0)
            group[1 + nxt.j] = nxt
        if all(r is not None for r in op.result):
            self._finish(op, op.result)
