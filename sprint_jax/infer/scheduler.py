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

from typing import Sequence

import jax
import numpy as np

from sprint_jax.infer import programs
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.pages import PageCopy, PoolExhausted, copy_args, copy_pages
from sprint_jax.infer.programs import DecodeRows, PrefillRows
from sprint_jax.infer.requests import EngineError, ForkChild, Generation, Op, PrefillWork, Row
from sprint_jax.infer.sampling import TOP_LOGPROBS
from sprint_jax.infer.slot_cache import bucket, bucket_fine


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
            self._step_or_raise()

    def _step_or_raise(self) -> None:
        if not self.step():
            if self.live_rows or (self._waiting and self._free) or self._prefill_work:
                raise EngineError(f"no progress: live sequences hold the KV pool's {self.num_pages} pages of "
                                  f"{self.page_size} tokens (close one, or give the engine more num_pages)")
            raise EngineError(f"no progress: {len(self._waiting)} open(s) wait for a slot and all "
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

    def _page_bucket(self, n_pages: int) -> int:
        """A table width for n_pages pages: few shapes compile (1x, 1.5x powers of two from
        min_bucket tokens' pages)."""
        return bucket_fine(max(n_pages, 1), max(1, self.min_bucket // self.page_size))

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _reserve(self, part: int, sp, start: int, n: int, copies: list) -> bool:
        """Pages for n tokens written at positions start.. of `sp` (copy on write of a shared page:
        its copy appended to `copies`). False when the pool has no room (the row waits)."""
        sp.length = start
        try:
            copies.extend((part, c) for c in self._allocs[part].prepare_write(sp, n))
        except PoolExhausted:
            self._page_waits += 1
            return False
        return True

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
            row.pages = op.fork.children[row.j]
        return True

    def _prefill_parents(self) -> None:
        rows, copies = [], []
        for work in self._prefill_work.values():
            if self._forced_in_decode(work) or work.seq.pages is None:
                continue
            seq, start = work.seq, work.base + work.done
            piece = work.run[work.done: work.done + self.prefill_chunk]
            if self._reserve(seq.part, seq.pages, start, len(piece), copies):
                rows.append((work, piece, start))
        if not rows:
            return
        at, r_b = sh.slot_blocks([work.seq.slot for work, _, _ in rows], self.max_seqs, self._parts)
        width = self._page_bucket(max(self._pages_for(start + len(p)) for _, p, start in rows))
        r = PrefillRows.empty(r_b, bucket_fine(max(len(p) for _, p, _ in rows), 16), width)
        for i, (work, piece, start) in zip(at, rows):
            r.tokens[i, : len(piece)] = piece
            r.table[i] = self._table(work.seq.pages, work.seq.part, width)
            r.start[i] = start
            r.n_valid[i] = len(piece)
            r.pos_off[i] = work.seq.pos_offset
        self._run_copies(copies)
        # host arrays go to the jitted call as they are (jnp.asarray / jnp.zeros would each be a
        # dispatched op: ~0.1-0.4 ms of host time per prefill call on a small model)
        self.cache = programs.prefill(self._step_params, self.config, self.cache, r, kv=self._kv)
        self.stats["prefill_calls"] += 1
        for work, piece, start in rows:
            work.done += len(piece)
            work.seq.pages.length = start + len(piece)
            if work.left <= 0:
                del self._prefill_work[work.seq.id]

    def _prefill_children(self) -> None:
        work, copies = [], []
        for slot, rows in self._groups.items():
            for row in rows[1:]:
                if (row is not None and len(row.run) - 1 - row.prefill_pos > self.decode_chunk
                        and row.op.seq.id not in self._prefill_work and self._child_pages(row)):
                    piece = row.run[row.prefill_pos: len(row.run) - 1][: self.prefill_chunk]
                    start = row.op.seq.length + row.prefill_pos
                    if self._reserve(row.op.seq.part, row.pages, start, len(piece), copies):
                        work.append((slot, row, piece, start))
        if not work:
            return
        at, r_b = sh.slot_blocks([slot for slot, _, _, _ in work], self.max_seqs, self._parts,
                                 cap=self.max_seqs // self._parts * self.max_children)
        width = self._page_bucket(max(self._pages_for(start + len(p)) for _, _, p, start in work))
        r = PrefillRows.empty(r_b, bucket_fine(max(len(p) for _, _, p, _ in work), 16), width)
        for i, (_, row, piece, start) in zip(at, work):
            r.tokens[i, : len(piece)] = piece
            r.table[i] = self._table(row.pages, row.op.seq.part, width)
            r.start[i] = start
            r.n_valid[i] = len(piece)
            r.pos_off[i] = row.op.seq.pos_offset
        self._run_copies(copies)
        self.cache = programs.prefill(self._step_params, self.config, self.cache, r, kv=self._kv)
        self.stats["prefill_calls"] += 1
        for _, row, piece, start in work:
            row.prefill_pos += len(piece)
            row.pages.length = start + len(piece)

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
        gen_rows: list[tuple[int, Row, int, list[int]]] = []
        forks: list[tuple[int, list[tuple[Row, int, list[int]]]]] = []
        copies: list = []
        for slot, rows in sorted(self._groups.items()):
            if self._decoding(rows[0], False):
                start, feed = self._feed(rows[0], False)
                seq = rows[0].op.seq
                if self._reserve(seq.part, seq.pages, start, len(feed) - 1 + self.decode_chunk, copies):
                    gen_rows.append((slot, rows[0], start, feed))
            kids = []
            for r in rows[1:]:
                if self._decoding(r, True):
                    start, feed = self._feed(r, True)
                    n = len(feed) - 1 + self.decode_chunk + r.op.join
                    if self._reserve(r.op.seq.part, r.pages, start, n, copies):
                        kids.append((r, start, feed))
            if kids:
                forks.append((slot, kids))
        if not gen_rows and not forks:
            return
        # Rows in `parts` equal blocks (page shards, data > 1; one block otherwise): block j holds
        # its wa generate rows, then its wf fork groups of w rows, all of shard j's sequences
        # (`sh.slot_blocks`), so each shard's `programs.decode` body reads and writes only its pages.
        parts, chunk = self._parts, self.decode_chunk
        at_a, na = sh.slot_blocks([slot for slot, *_ in gen_rows], self.max_seqs, parts) if gen_rows else ([], 0)
        at_f, nf = sh.slot_blocks([slot for slot, _ in forks], self.max_seqs, parts) if forks else ([], 0)
        wa, wf = na // parts, nf // parts
        w = min(bucket(max(len(k) for _, k in forks), 1), self.max_children) if forks else 1
        ps = self.page_size
        ma = self._page_bucket(max((self._pages_for(st + len(f) - 1 + chunk) for _, _, st, f in gen_rows), default=1))
        mg = self._page_bucket(max((k[0][0].op.fork.shared_len // ps for _, k in forks), default=1))
        mr = self._page_bucket(max((self._pages_for(st + len(f) + chunk + r.op.join - r.op.fork.shared_len)
                                    for _, k in forks for r, st, f in k), default=1))
        r = DecodeRows.empty(na, nf, w, chunk, ma, mg, mr)
        placed: list[tuple[int, Row, bool, int, list[int]]] = []
        block = wa + wf * w                                           # rows per shard
        for p, (slot, row, start, feed) in zip(at_a, gen_rows):
            r.a_table[p] = self._table(row.op.seq.pages, row.op.seq.part, ma)
            placed.append(((p // wa) * block + p % wa, row, False, start, feed))
        for q, (slot, kids) in zip(at_f, forks):
            seq, fork = kids[0][0].op.seq, kids[0][0].op.fork
            r.b_gtable[q] = self._table(seq.pages, seq.part, mg)[:mg]
            r.b_gtable[q, fork.shared_len // ps:] = -1                   # the shared full pages only
            r.b_glen[q] = fork.shared_len
            for c, (row, start, feed) in enumerate(kids):
                r.b_table[q * w + c] = self._table(row.pages, seq.part, mr, first=fork.shared_len // ps)
                placed.append(((q // wf) * block + wa + (q % wf) * w + c, row, True, start, feed))
        for i, row, child, start, feed in placed:
            r.lengths[i] = start - (row.op.fork.shared_len if child else 0)
            r.pending[i] = feed[0]
            r.forced[i, : len(feed) - 1] = feed[1:]
            r.n_forced[i] = len(feed) - 1
            r.pos_off[i] = row.op.seq.pos_offset
            r.feed_last[i] = child and row.op.join
            r.active[i] = True
            r.remaining[i] = row.limit - len(row.gen)
            r.stop_ids[i] = self._stop_ids(row.stops)
            s = row.op.sampling
            r.seeds[i], r.branch[i], r.steps[i] = s.seed, row.key_branch, len(row.gen)
            r.temperature[i], r.top_k[i], r.top_p[i] = s.temperature, s.top_k, s.top_p
        fed_rows, n_forced = r.feed_last, r.n_forced
        feeding = bool(fed_rows.any())
        # the alternatives per token, only when a request asks (a second compiled variant)
        top_n = TOP_LOGPROBS if any(row.op.top_logprobs for _, row, *_ in placed) else 0
        packed, layout = r.pack()
        self._run_copies(copies)
        res = programs.decode(
            self._step_params, self.config, self.cache, packed, layout=layout, chunk=chunk, kv=self._kv,
            attention_impl=self.attention_impl, n_valid=self.n_valid, feeding=feeding, top_logprobs=top_n)
        self.cache, kept = res.pool, res.kept
        out, reason, lps, tops = jax.device_get((res.tokens, res.reason, res.logprobs,
                                                 (res.top_ids, res.top_logprobs) if top_n else None))
        self.stats["decode_calls"] += 1
        for i, row, child, start, feed in placed:
            if n_forced[i]:                   # all taken: a row forces before it can finish
                if child:
                    row.prefill_pos = len(row.run) - 1
                else:
                    del self._prefill_work[row.op.seq.id]
            cols = np.flatnonzero(out[i] >= 0)
            new = [int(t) for t in out[i, cols]]
            # K/V written: the forced tokens, the pending token of every sampling step, and a fed
            # last token
            (row.pages if child else row.op.seq.pages).length = (start + int(n_forced[i]) + len(new)
                                                                 + bool(fed_rows[i] and reason[i]))
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
