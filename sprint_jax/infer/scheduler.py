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
        before = (len(self._waiting), self.stats["prefill_calls"], self.stats["decode_calls"])
        self._admit()
        self._prefill_parents()
        self._prefill_children()
        self._decode()
        return before != (len(self._waiting), self.stats["prefill_calls"], self.stats["decode_calls"])

    def run(self, ops: Sequence[Op] = ()) -> None:
        """Step until the given operations are done (or, without ops, until idle). Raises
        EngineError instead of waiting forever when no step can make progress."""
        while (not all(o.done for o in ops)) if ops else self.busy:
            self._step_or_raise()

    def _step_or_raise(self) -> None:
        if not self.step():
            raise EngineError(f"no progress: {len(self._waiting)} open(s) wait for a slot and all "
                              f"{self.max_seqs} slots hold idle sequences (close one)")

    def _forced_in_decode(self, work: PrefillWork) -> bool:
        """Whether a sequence's queued tokens ride as forced tokens in its next decode chunk (few
        left, and its generate op decodes next) instead of a prefill call."""
        rows = self._groups.get(work.seq.slot)
        return (work.left <= self.decode_chunk and rows is not None and rows[0] is not None
                and rows[0].reason is None)

    def _prefill_parents(self) -> None:
        rows = []
        for work in self._prefill_work.values():
            if not self._forced_in_decode(work):
                rows.append((work, work.run[work.done: work.done + self.prefill_chunk]))
        if not rows:
            return
        at, r_b = sh.slot_blocks([work.seq.slot for work, _ in rows], self.max_seqs, self._parts)
        r = PrefillRows.empty(r_b, bucket_fine(max(len(p) for _, p in rows), 16), self.max_seqs)
        for i, (work, piece) in zip(at, rows):
            r.tokens[i, : len(piece)] = piece
            r.slot[i] = r.parent[i] = work.seq.slot
            r.start[i] = work.base + work.done
            r.n_valid[i] = len(piece)
            r.pos_off[i] = work.seq.pos_offset
        s_b = min(bucket_fine(int(r.start.max()) + 1, self.min_bucket), self.parent_capacity)
        # host arrays go to the jitted call as they are (jnp.asarray / jnp.zeros would each be a
        # dispatched op: ~0.1-0.4 ms of host time per prefill call on a small model)
        self.cache = programs.prefill(self._step_params, self.config, self.cache, r, kind="parent", s_b=s_b, c_b=1,
                                      kv=self._kv)
        self.stats["prefill_calls"] += 1
        for work, piece in rows:
            work.done += len(piece)
            if work.left <= 0:
                del self._prefill_work[work.seq.id]

    def _prefill_children(self) -> None:
        work = []
        for slot, rows in self._groups.items():
            for g, row in enumerate(rows[1:]):
                if (row is not None and len(row.run) - 1 - row.prefill_pos > self.decode_chunk
                        and row.op.seq.id not in self._prefill_work):
                    work.append((slot, g, row))
        if not work:
            return
        pieces = [row.run[row.prefill_pos: len(row.run) - 1][: self.prefill_chunk] for _, _, row in work]
        at, r_b = sh.slot_blocks([slot for slot, _, _ in work], self.max_seqs, self._parts,
                                 cap=self.max_seqs // self._parts * self.max_children)
        s_b = min(bucket_fine(max(row.op.seq.length for _, _, row in work), self.min_bucket), self.parent_capacity)
        c_b = min(bucket_fine(max(row.prefill_pos for _, _, row in work) + 1, self.min_bucket), self.child_capacity)
        r = PrefillRows.empty(r_b, bucket_fine(max(len(p) for p in pieces), 16), self.max_seqs * self.max_children)
        for i, (slot, g, row), piece in zip(at, work, pieces):
            r.pos_off[i] = row.op.seq.pos_offset
            r.tokens[i, : len(piece)] = piece
            r.slot[i] = slot * self.max_children + g
            r.parent[i] = slot
            r.fork_len[i] = row.op.seq.length
            r.start[i] = row.prefill_pos
            r.n_valid[i] = len(piece)
        self.cache = programs.prefill(self._step_params, self.config, self.cache, r, kind="child", s_b=s_b, c_b=c_b,
                                      kv=self._kv)
        self.stats["prefill_calls"] += 1
        for (_, _, row), piece in zip(work, pieces):
            row.prefill_pos += len(piece)

    def _decoding(self, row: Row | None, child: bool) -> bool:
        """Whether the row decodes in this step: its context is written, but for at most
        decode_chunk tokens that its chunk takes as forced tokens."""
        if row is None or row.reason is not None:
            return False
        work = self._prefill_work.get(row.op.seq.id)
        if child:
            return work is None and len(row.run) - 1 - row.prefill_pos <= self.decode_chunk
        return work is None or self._forced_in_decode(work)

    def _feed(self, row: Row, child: bool) -> tuple[int, list[int]]:
        """(KV entries in the row's own slot, tokens to run from there: the pending one first,
        then the forced ones)."""
        if child:
            if row.gen:
                return len(row.run) - 1 + len(row.gen), [row.gen[-1]]
            return row.prefill_pos, row.run[row.prefill_pos:]
        seq = row.op.seq
        work = self._prefill_work.get(seq.id)
        if work is not None:
            return work.base + work.done, work.run[work.done:] + [seq.tokens[-1]]
        return seq.length + len(row.gen), [row.gen[-1] if row.gen else seq.tokens[-1]]

    def _decode(self) -> None:
        """One decode call over the active rows only: parents running a generate op (rows A) and,
        grouped by parent, the children of running forks (rows F x w, w = the most children
        alive in one fork, bucketed). A read-only parent and a finished child take no row."""
        gen_rows: list[tuple[int, Row]] = []
        forks: list[tuple[int, list[Row]]] = []
        for slot, rows in sorted(self._groups.items()):
            if self._decoding(rows[0], False):
                gen_rows.append((slot, rows[0]))
            kids = [r for r in rows[1:] if self._decoding(r, True)]
            if kids:
                forks.append((slot, kids))
        if not gen_rows and not forks:
            return
        # Rows in `parts` equal blocks (slot shards, data > 1; one block otherwise): block j holds
        # its wa generate rows, then its wf fork groups of w rows, all of shard j's slots
        # (`sh.slot_blocks`), so each shard's `programs.decode` body reads and writes only its own slots.
        parts = self._parts
        at_a, na = sh.slot_blocks([slot for slot, _ in gen_rows], self.max_seqs, parts) if gen_rows else ([], 0)
        at_f, nf = sh.slot_blocks([slot for slot, _ in forks], self.max_seqs, parts) if forks else ([], 0)
        wa, wf = na // parts, nf // parts
        w = min(bucket(max(len(k) for _, k in forks), 1), self.max_children) if forks else 1
        # padding rows write nowhere (slots past the last)
        r = DecodeRows.empty(na, nf, w, self.decode_chunk, self.max_seqs, self.max_seqs * self.max_children)
        need_p, need_c = 1, 1
        placed: list[tuple[int, Row, bool]] = []
        block = wa + wf * w                                           # rows per slot shard
        for p, (slot, row) in zip(at_a, gen_rows):
            r.a_slot[p] = slot
            placed.append(((p // wa) * block + p % wa, row, False))
        for q, (slot, kids) in zip(at_f, forks):
            seq = kids[0].op.seq
            r.b_pslot[q], r.b_fork[q] = slot, seq.length
            need_p = max(need_p, seq.length)
            for c, row in enumerate(kids):
                r.b_cslot[q * w + c] = slot * self.max_children + row.j
                placed.append(((q // wf) * block + wa + (q % wf) * w + c, row, True))
        for i, row, child in placed:
            r.lengths[i], feed = self._feed(row, child)
            r.pending[i] = feed[0]
            r.forced[i, : len(feed) - 1] = feed[1:]
            r.n_forced[i] = len(feed) - 1
            r.pos_off[i] = row.op.seq.pos_offset
            # the row writes n_forced + decode_chunk slots at most (+ a feed step)
            if child:
                need_c = max(need_c, r.lengths[i] + r.n_forced[i] + self.decode_chunk + row.op.join)
                r.feed_last[i] = row.op.join
            else:
                need_p = max(need_p, r.lengths[i] + r.n_forced[i] + self.decode_chunk)
            r.active[i] = True
            r.remaining[i] = row.limit - len(row.gen)
            r.stop_ids[i] = self._stop_ids(row.stops)
            s = row.op.sampling
            r.seeds[i], r.branch[i], r.steps[i] = s.seed, row.key_branch, len(row.gen)
            r.temperature[i], r.top_k[i], r.top_p[i] = s.temperature, s.top_k, s.top_p
        # attention reads s_b / c_b slots per row and layer: the finer buckets (1x, 1.5x powers of
        # two) cut the over-read (80 used -> 96, not 128), the per-row cost of a many-row step
        s_b = min(bucket_fine(need_p, self.min_bucket), self.parent_capacity)
        c_b = min(bucket_fine(need_c, self.min_bucket), self.child_capacity) if forks else 1
        fed_rows, n_forced = r.feed_last, r.n_forced
        feeding = bool(fed_rows.any())
        # the alternatives per token, only when a request asks (a second compiled variant)
        top_n = TOP_LOGPROBS if any(row.op.top_logprobs for _, row, _ in placed) else 0
        packed, layout = r.pack()
        res = programs.decode(
            self._step_params, self.config, self.cache, packed, layout=layout, chunk=self.decode_chunk, s_b=s_b,
            c_b=c_b, kv=self._kv, attention_impl=self.attention_impl, n_valid=self.n_valid,
            feeding=feeding, top_logprobs=top_n)
        self.cache, kept = res.cache, res.kept
        out, reason, lps, tops = jax.device_get((res.tokens, res.reason, res.logprobs,
                                                 (res.top_ids, res.top_logprobs) if top_n else None))
        self.stats["decode_calls"] += 1
        for i, row, child in placed:
            if n_forced[i]:                   # all taken: a row forces before it can finish
                if child:
                    row.prefill_pos = len(row.run) - 1
                else:
                    del self._prefill_work[row.op.seq.id]
            cols = np.flatnonzero(out[i] >= 0)
            new = [int(t) for t in out[i, cols]]
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
                                                      row.last_logits)
        if op.queued:                         # a serial fork: the next child starts
            nxt = op.queued.pop(0)
            group[1 + nxt.j] = nxt
        if all(r is not None for r in op.result):
            self._finish(op, op.result)
