"""The engine: many sequences, one decode step, over a pool of KV pages with a prefix cache.

Requests are operations on sequences (`sprint_jax.infer.requests`): open (take the longest cached
prefix, prefill the rest; queued while no slot or pages are free), extend (prefill more tokens),
generate (decode on the sequence), fork (k children with forced prefixes, decoded together, each
sharing the sequence's pages and reading its prefix in place), split (sequences continuing this
one: forks nested to any depth), merge (join a finished fork's children into the sequence without
re-running them), truncate, close. `Engine.step()` serves the queued work of every sequence at
once (`scheduler.Scheduler`); the jitted programs it calls are in `sprint_jax.infer.programs`, the
pool in `sprint_jax.infer.pages`, the prefix cache in `sprint_jax.infer.radix`, merge joins and
teacher forcing in `sprint_jax.infer.joins`.
A single run is an engine with one sequence slot (`max_seqs=1`); `sprint_jax.infer.single.SingleRun`
drives one with blocking calls.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import deque
from typing import Sequence


from sprint_jax.infer import sharding as sh
from sprint_jax.infer.engine_config import EngineConfig
from sprint_jax.infer.joins import Joins
from sprint_jax.infer.programs import STOP_WIDTH
from sprint_jax.infer.requests import (DecodeTrace, EngineError, ForkRecord, Generation, Op, PrefillWork, Row,
                                       Seq, checked_sampling, decode_tokens, sample_first)
from sprint_jax.infer.sampling import TOP_LOGPROBS, Sampling, valid_vocab
from sprint_jax.infer.scheduler import Scheduler
from sprint_jax.infer.pages import KVPages, PageAllocator, PoolExhausted
from sprint_jax.infer.radix import RadixTree
from sprint_jax.infer.stops import StopScanner
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import UNROLL_MAX_LAYERS, per_layer


def _check_top(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= TOP_LOGPROBS:
        raise EngineError(f"top_logprobs must be an integer in 0..{TOP_LOGPROBS}, got {n!r}")


class Engine(Scheduler, Joins):
    """Many sequences, one decode step: the page pool, its prefix cache and the scheduler. A single
    run is an engine with max_seqs=1.

    Sizes: an `EngineConfig` (`engine_config`), or its fields as keyword arguments (max_seqs,
    max_children, max_seq_len, max_branch_tokens, decode_chunk, prefill_chunk, page_size,
    num_pages, min_bucket; see `sprint_jax.infer.engine_config`), not both.

    mesh: a (data, fsdp, tensor) Mesh (`sprint_jax.infer.sharding.mesh_from_flag`): parameters
    placed by the trainer's rules table, pages over data like the sequence slots, KV heads over
    tensor (replicated, with a logged note, where they do not divide); None = one device.
    `sharding_notes` lists what was replicated.

    attention_impl: "xla" or "pallas" for a decode step's attention to cached keys ("pallas":
    `sprint_jax.kernels.paged_prefix`, reading pages in place through the page tables, per shard
    on a mesh; interpret mode on CPU, where it is slow and only a correctness check).

    per_layer_weights: run the programs on a second, per-layer copy of the layer weights
    (`qwen2.per_layer`, a `lax.switch` over the layers) instead of the stacked form, whose layer
    scan XLA CPU runs by copying every weight out of the stack at every step. None (default): on
    for a model of at most `UNROLL_MAX_LAYERS` layers on one device (the copy is small there and
    the demo's model decodes faster with it), off for deep models and meshes. `params` stays the
    stacked form; setting it (the RL trainer's update) renews the copy and forgets the prefix cache.
    """

    def __init__(self, model, tokenizer, engine_config: EngineConfig | None = None, *,
                 eos_token_ids: Sequence[int] | None = None, mesh=None, attention_impl: str = "xla",
                 per_layer_weights: bool | None = None, trace: bool = False, **sizes):
        if engine_config is not None and sizes:
            raise EngineError(f"give an EngineConfig or its fields, not both (got {sorted(sizes)})")
        unknown = sorted(set(sizes) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise EngineError(f"unknown engine setting(s): {', '.join(unknown)}")
        ec = self.engine_config = engine_config or EngineConfig(**sizes)
        if attention_impl not in ("xla", "pallas"):
            raise EngineError(f"attention_impl must be 'xla' or 'pallas', got {attention_impl!r}")
        self.attention_impl = attention_impl
        self.trace = trace                # each sequence keeps a DecodeTrace (RL's loss layout)
        self.config: Qwen2Config = model.config
        self.model_config: Qwen2Config = model.config   # as trained (on a mesh `config` is the serving layout's)
        if per_layer_weights is None:
            per_layer_weights = mesh is None and self.config.num_hidden_layers <= UNROLL_MAX_LAYERS
        self.per_layer_weights = bool(per_layer_weights)
        self.mesh = mesh
        self.tokenizer = tokenizer
        self.n_valid = valid_vocab(tokenizer, self.config.vocab_size)   # padded ids are never sampled
        self.max_seqs, self.max_children = ec.max_seqs, ec.max_children
        self.max_seq_len, self.max_branch_tokens = ec.max_seq_len, ec.max_branch_tokens
        self.decode_chunk, self.prefill_chunk = ec.decode_chunk, ec.prefill_chunk
        self.min_bucket, self.page_size = ec.min_bucket, ec.page_size
        if eos_token_ids is None:
            eos_token_ids = list(self.config.eos_token_ids)
            tok_eos = getattr(tokenizer, "eos_token_id", None)
            if tok_eos is not None and tok_eos not in eos_token_ids:
                eos_token_ids.append(tok_eos)
        self.eos_token_ids = [int(e) for e in eos_token_ids][:STOP_WIDTH]
        # the decode chunk may run past a row's last token before the host sees the stop
        self.parent_capacity, self.child_capacity = ec.parent_capacity, ec.child_capacity
        self.sharding_notes: list[str] = []
        self._kv = None
        if mesh is None:
            self._set_params(model.params)
            self._parts = 1
        else:
            notes = self.sharding_notes
            self.config, params = sh.shard_model(self.config, model.params, mesh, notes)
            self._set_params(params)
            # pages split over data like the slots (each sequence's pages on its slot's shard),
            # KV heads over tensor; too few slots to split (a single run's one): whole pages
            slots = sh.kv_sharding(self.config, mesh, ec.max_seqs, notes, "sequence slots")
            self._parts = sh.slot_parts((slots,))
            self._kv = (sh.pool_sharding(self.config, mesh, slots, ec.pool_pages(self._parts), ec.page_size, notes),)
            sh.log_notes(notes, "Engine on mesh " + ",".join(f"{k}={v}" for k, v in mesh.shape.items()))
        self.num_pages = pages = ec.pool_pages(self._parts)
        self._part_pages = pages // self._parts                 # pages per shard (global id = part * this + local)
        self._allocs = [PageAllocator(self._part_pages, ec.page_size) for _ in range(self._parts)]
        self._trees = [RadixTree(a) for a in self._allocs]
        self._cache_epoch = 0                 # reset_prefix_cache: sequences opened before are not cached
        self.cache = KVPages.zeros(self.config, pages, ec.page_size, None if self._kv is None else self._kv[0])
        self._free = sh.slot_order(ec.max_seqs, self._parts)
        self._waiting: deque[Op] = deque()             # opens waiting for a slot
        # seq id -> its queued tokens (an open's prompt, extends; queued when submitted, written
        # by the next step)
        self._prefill_work: dict[int, PrefillWork] = {}
        self._groups: dict[int, list[Row | None]] = {}                  # slot -> [parent row, children...]
        self._single_token: dict[str, list[int]] = {}     # stop string -> tokens whose text holds it
        self._texts: list[str] | None = None
        self.stats = dict(steps=0, decode_calls=0, prefill_calls=0, tokens=0, join_copies=0, preemptions=0)
        self._preempted: deque[Seq] = deque()      # runs whose pages were taken back, waiting for pages
        self._admissions = itertools.count()
        self._page_waits = 0                       # rows the last step could not give pages
        self._wait_min = None                      # the oldest run (admission order) among them
        self._oldest_wait = None                   # ... as this step found it
        self.last_join_tokens = 0           # tokens the last merge ran (in the children's slots)

    @property
    def params(self):
        """The weights, stacked on a leading layers axis (as the model and the trainer hold them)."""
        return self._params

    @params.setter
    def params(self, value) -> None:
        """New weights (the RL trainer's in-process update), used from the next call on; on a mesh
        placed as the first ones were."""
        if self.mesh is not None:
            value = sh.shard_model(self.model_config, value, self.mesh, [])[1]
        self._set_params(value)
        self.reset_prefix_cache()             # the cached K/V was computed by the old weights

    def _set_params(self, value) -> None:
        self._params = value
        # what the engine's calls run (see the class docstring)
        self._step_params = per_layer(value) if self.per_layer_weights else value

    # ---- tokens <-> text ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_text(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of tokens; special tokens (EOS, padding) are left out unless asked for, so
        no reply ends in the EOS token's text."""
        return decode_tokens(self.tokenizer, tokens, skip_special_tokens)

    # ---- submitting operations ------------------------------------------------------------
    def open(self, tokens: Sequence[int], tag=None) -> Op:
        """A new sequence holding `tokens` (queued until a parent slot is free)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EngineError("open needs at least one token (got an empty input)")
        if len(tokens) > self.max_seq_len:
            raise EngineError(f"input of {len(tokens)} tokens exceeds max_seq_len={self.max_seq_len}")
        seq = Seq([])
        op = Op("open", seq, tokens=tokens, tag=tag)
        seq.op = op
        self._waiting.append(op)
        self._admit()                     # a free slot: done now (its prompt is written by the next step)
        return op

    def _admit(self) -> None:
        """Queued opens take a free slot and the pages of their prompt: the longest cached prefix
        from the slot's shard's radix tree, fresh pages for the rest (evicting cached pages no
        sequence holds); an open whose pages are not there waits (admission by free pages)."""
        while self._preempted and not self._page_waits:   # preempted runs come back first, once no row waits
            seq = self._preempted[0]
            full = self._preempted_tokens(seq)
            sp = self._take_pages(seq.part, full)  # resumed from what the cache still holds
            if sp is None:
                return
            self._preempted.popleft()
            seq.pages = sp
            if len(full) - 1 > sp.length:        # recomputed: the rest is prefilled again
                self._prefill_work[seq.id] = PrefillWork(seq, full[sp.length:-1], 0, sp.length)
        while self._waiting and self._free and self._oldest_wait is None:   # no new run while one waits
            op = self._waiting[0]
            seq = op.seq
            slot = self._free[0]
            part = self._part_of(slot)
            sp = self._take_pages(part, op.tokens)
            if sp is None:
                return
            self._waiting.popleft()
            self._free.pop(0)
            seq.slot, seq.part, seq.pages = slot, part, sp
            seq.cache_epoch = self._cache_epoch
            seq.admitted = next(self._admissions)
            seq.tokens = op.tokens
            if self.trace:
                seq.trace = DecodeTrace()
                seq.trace.sync(seq)
            self._groups.pop(seq.slot, None)
            if len(op.tokens) - 1 > sp.length:
                self._queue_prefill(seq, op.tokens[sp.length:-1], sp.length)
            self._finish(op, seq)

    def _take_pages(self, part: int, tokens: list[int]):
        """A sequence's pages for `tokens` in pool shard `part`: its longest cached prefix and
        fresh pages for the rest but the last token (evicting cached pages no sequence holds), or
        None when the pool has no room (nothing taken)."""
        tree = self._trees[part]
        sp = tree.acquire(tokens)
        try:
            self._allocs[part].prepare_write(sp, len(tokens) - 1 - sp.length)
        except PoolExhausted:
            tree.cancel(sp)
            return None
        return sp

    def _preempted_tokens(self, seq: Seq) -> list[int]:
        """A preempted sequence's tokens with what its generate op has decoded so far (the last one
        pending)."""
        row = self._groups.get(seq.slot, [None])[0]
        return seq.tokens + (row.gen if row is not None else [])

    def _preempt(self, part: int | None = None) -> bool:
        """Free the pages of the most recently admitted run that can be recomputed exactly, so the
        older runs go on. A sequence decoding a generate op (no merge join in it, no fork held), or
        a fork whose parent is a plain prefix and none of whose children has finished, gives its
        pages back whole: its full pages go to the radix tree (evictable; a later admission resumes
        from what is still cached there), a fork's children release theirs, and it is requeued,
        first in line once no row waits for pages, to prefill the rest again and decode on with
        its own key streams (a fork's children from their prefixes), so the same tokens come out.
        Otherwise a fork's unfinished children alone give back their pages and start again (the
        parent's pages, with merge joins in them, stay). False: no such run, or it is the only live
        one. part: only runs of that pool shard, even the only live one (for a call that cannot
        wait: the run making it is not live)."""
        live = [s for s in self._live_seqs() if s.pages is not None and (part is None or s.part == part)]
        whole = [s for s in live if s.op is not None and s.cache_len >= len(s.tokens)
                 and ((s.op.kind == "generate" and s.last_fork is None
                       and self._groups.get(s.slot, [None])[0] is not None)
                      or (s.op.kind == "fork" and s.op.fork is not None
                          and (s.trace is None or all(c is None for c in s.last_fork.children))))]
        children = [s for s in live if s not in whole and s.op is not None and s.op.kind == "fork"
                    and s.op.fork is not None
                    and any(self._restartable(r) for r in self._groups.get(s.slot, [None])[1:])]
        if (len(live) < 2 and part is None) or not (whole or children):
            return False
        seq = max(whole + children, key=lambda s: s.admitted)
        self.stats["preemptions"] += 1
        if seq.op.kind == "fork":
            self._restart_children(seq, finished=seq in whole)
            if seq in children:
                return True
            for child in seq.op.fork.children:            # the children's shares of the parent's pages
                if not child.released:
                    self._alloc(seq).release(child)
            for row in self._groups[seq.slot][1:] + list(seq.op.queued):
                if row is not None:
                    row.pages, row.restarted = None, True
        full = self._preempted_tokens(seq)
        sp = seq.pages
        sp.length = min(sp.length, len(full) - 1)
        self._trees[seq.part].finish(sp, full, cache=seq.cache_epoch == self._cache_epoch)
        seq.pages = None
        self._prefill_work.pop(seq.id, None)
        self._preempted.append(seq)
        return True

    @staticmethod
    def _restartable(row: Row | None) -> bool:
        """A fork child still decoding that holds pages of its own."""
        return row is not None and row.reason is None and row.pages is not None and not row.pages.released

    def _restart_children(self, seq: Seq, finished: bool = False) -> None:
        """The unfinished children of seq's fork release their pages and start over: fresh rows
        with the same prefixes, limits, stops and key streams (`_child_pages` gives each a new share
        of the parent's pages). finished: the finished ones too (their results and pages dropped;
        they decode the same tokens again); else they keep theirs."""
        group, op = self._groups[seq.slot], seq.op
        for j, row in enumerate(group[1:]):
            if self._restartable(row):
                self._alloc(seq).release(row.pages)
            elif not (finished and row is None and j < len(op.prefixes) and op.result[j] is not None):
                continue
            else:                                          # finished: its result and pages go
                kid = seq.last_fork.children[j]
                if kid is not None and kid.pages is not None and not kid.pages.released:
                    self._alloc(seq).release(kid.pages)
                seq.last_fork.children[j], op.result[j] = None, None
            fresh = Row(op, j, [seq.tokens[-1]] + op.prefixes[j], op.limits[j], op.stops[j],
                        StopScanner(self.decode_text, op.stops[j]))
            fresh.restarted = True
            group[1 + j] = fresh

    def _live_seqs(self) -> list[Seq]:
        """Every admitted sequence that holds a slot (through its rows' ops)."""
        return [rows[0].op.seq if rows[0] is not None else next(r.op.seq for r in rows if r is not None)
                for rows in self._groups.values() if any(r is not None for r in rows)]

    def _part_of(self, slot: int) -> int:
        """The shard whose pages a sequence in `slot` uses (0 without page shards)."""
        return slot // (self.max_seqs // self._parts)

    def _check_idle(self, seq: Seq, what: str):
        if seq.closed:
            raise EngineError(f"{what}: sequence {seq.id} is closed")
        if seq.op is not None:
            raise EngineError(f"{what}: sequence {seq.id} still runs a {seq.op.kind} (one operation at a time)")

    def extend(self, seq: Seq, tokens: Sequence[int], tag=None) -> Op:
        """Append tokens to a sequence, prefilling only them (the orchestrator's sync)."""
        self._check_idle(seq, "extend")
        tokens = [int(t) for t in tokens]
        if len(seq.tokens) + len(tokens) > self.max_seq_len:
            raise EngineError(f"extending to {len(seq.tokens) + len(tokens)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        if seq.after_join and tokens:
            # the last token is already in the slot: the first new one is what its logits sampled
            seq.tokens = seq.tokens + tokens[:1]
            tokens = tokens[1:]
        self._retire_fork(seq)
        op = Op("extend", seq, tokens=tokens, tag=tag)
        seq.op = op
        if tokens:
            self._queue_prefill(seq, [seq.tokens[-1]] + tokens[:-1], seq.length)
            seq.tokens = seq.tokens + tokens
        if seq.trace is not None:
            seq.trace.sync(seq)
        self._finish(op, seq)
        return op

    def _queue_prefill(self, seq: Seq, run: list[int], base: int) -> None:
        """Tokens to write into the sequence's slot after what it holds. The op that queued them
        ends at once: the next step writes them (in a prefill call, or as forced tokens of the
        sequence's next decode chunk when few), before anything of the sequence decodes."""
        work = self._prefill_work.setdefault(seq.id, PrefillWork(seq, [], 0, base))
        work.run = work.run + run

    def generate(self, seq: Seq, max_new_tokens: int, stop: Sequence[str] = (), sampling: Sampling | None = None,
                 tag=None, top_logprobs: int = 0) -> Op:
        """Decode on the sequence itself until EOS, a stop string or max_new_tokens; the
        generated tokens (up to the stop) are appended to it. The Generation carries each token's
        log-prob; top_logprobs = n (<= TOP_LOGPROBS) adds the n most likely alternatives."""
        self._check_idle(seq, "generate")
        _check_top(top_logprobs)
        if max_new_tokens <= 0:
            raise EngineError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(seq.tokens) + max_new_tokens > self.max_seq_len:
            raise EngineError(f"{len(seq.tokens)} tokens + max_new_tokens={max_new_tokens} exceeds "
                              f"max_seq_len={self.max_seq_len}")
        self._retire_fork(seq)
        op = Op("generate", seq, limits=[max_new_tokens], stops=[list(stop)], sampling=checked_sampling(sampling),
                tag=tag, top_logprobs=top_logprobs)
        seq.op = op
        row = Row(op, 0, [], max_new_tokens, list(stop), StopScanner(self.decode_text, stop))
        self._groups.setdefault(seq.slot, [None] * (1 + self.max_children))[0] = row
        if seq.after_join:
            # step 0 samples from the join logits (the key that step would use); the row then
            # decodes from that token, whose slot is the one after the join
            first, lp, top = sample_first(seq.join_logits, op.sampling, self.n_valid, top_logprobs and TOP_LOGPROBS)
            row.gen.append(first)                                               # no padded ids
            row.lps.append(lp)
            if top_logprobs:
                row.tops.append(top[:top_logprobs])
            if row.scanner.feed([first]) is not None:
                row.reason = "stop"
            elif first in self.eos_token_ids:
                row.reason = "eos"
            elif max_new_tokens <= 1:
                row.reason = "length"
            if row.reason is not None:
                self._row_done(row, False)
        return op

    def fork(self, seq: Seq, prefixes: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
             stop: Sequence[Sequence[str]] | Sequence[str] = (), sampling: Sampling | None = None, tag=None,
             serial: bool = False, join: bool = False, top_logprobs: int = 0) -> Op:
        """len(prefixes) children of `seq`: child j continues seq with prefixes[j] (forced) and
        decodes until its own stops / EOS / limit. Result: one Generation per child (generated
        tokens only); `seq` keeps its content and is read-only until the fork finishes.
        serial: the children run one after another (child j starts when child j-1 ends), each
        alone on the parent's context: SPRINT's `serial` mode, the same tokens as together.
        join: the fork will be merged (`merge`): a child that ends on device (a one-token stop,
        EOS, its limit) runs one more step feeding its last token, so its slot holds that token's
        KV and the last child keeps its logits: a join whose branches are what the children
        generated runs no model call. The same tokens either way. Log-probs as `generate`'s."""
        self._check_idle(seq, "fork")
        _check_top(top_logprobs)
        if seq.after_join:
            raise EngineError("fork right after a merge join: the planner must write a token first")
        n = len(prefixes)
        if n == 0:
            raise EngineError("fork needs at least one child prefix")
        if n > self.max_children:
            raise EngineError(f"{n} children exceed max_children={self.max_children}")
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if stop and isinstance(stop[0], str):
            stops = [list(stop)] * n
        else:
            stops = [list(s) for s in stop] if stop else [[] for _ in range(n)]
        if len(limits) != n or len(stops) != n:
            raise EngineError(f"fork of {n} children got {len(limits)} limits and {len(stops)} stop lists")
        prefixes = [[int(t) for t in p] for p in prefixes]
        for j, (p, m) in enumerate(zip(prefixes, limits)):
            if m <= 0:
                raise EngineError(f"child {j}: max_new_tokens must be positive, got {m}")
            if len(p) + 1 + m > self.max_branch_tokens:
                raise EngineError(f"child {j}: prefix of {len(p)} tokens + max_new_tokens={m} exceeds "
                                  f"max_branch_tokens={self.max_branch_tokens}")
        self._retire_fork(seq)
        op = Op("fork", seq, prefixes=prefixes, limits=limits, stops=stops, sampling=checked_sampling(sampling),
                tag=tag, join=join, top_logprobs=top_logprobs)
        seq.op = op
        group = self._groups.setdefault(seq.slot, [None] * (1 + self.max_children))
        rows = [Row(op, j, [seq.tokens[-1]] + p, m, st, StopScanner(self.decode_text, st))
                for j, (p, m, st) in enumerate(zip(prefixes, limits, stops))]
        if serial:
            rows, op.queued = rows[:1], rows[1:]
        for row in rows:
            group[1 + row.j] = row
        op.result = [None] * n
        seq.last_fork = ForkRecord(len(seq.tokens), [None] * n)
        if seq.trace is not None:
            seq.trace.fork(seq, n, join)
        return op

    def split(self, seq: Seq, n: int) -> list[Seq]:
        """n new sequences, each continuing `seq` as it is now (its tokens, its pending token, a
        merge join's state), at once: they share its pages (counted references; a partly filled
        last page is copied when one first writes into it), each in a free slot of `seq`'s pool
        shard, and each a sequence like any other (extend, generate, fork, split again, close),
        so forks nest to any depth. `seq` stays as it was. Its queued tokens are written first."""
        self._check_idle(seq, "split")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise EngineError(f"split needs a positive number of sequences, got {n!r}")
        free = [s for s in self._free if self._part_of(s) == seq.part]
        if len(free) < n:
            raise EngineError(f"split into {n}: {len(free)} free slot(s) in the sequence's shard "
                              f"(max_seqs={self.max_seqs})")
        self.flush(seq)
        seq.pages.length = seq.length + seq.after_join       # after a join the last token is written
        fork = self._alloc(seq).fork(seq.pages, n)
        out = []
        for slot, pages in zip(free, fork.children):
            child = Seq(list(seq.tokens))
            self._free.remove(slot)
            child.slot, child.part, child.pages = slot, seq.part, pages
            for name in ("pos_offset", "joined", "join_logits", "cache_len", "cache_epoch"):
                setattr(child, name, getattr(seq, name))
            if seq.trace is not None:
                child.trace = copy.deepcopy(seq.trace)
            out.append(child)
        return out

    def truncate(self, seq: Seq, n: int) -> Seq:
        """Keep the first n tokens (1 <= n <= its length), at once: the pages past the new length
        are released and the next write goes after it (the orchestrator's token-boundary rollback;
        a kept page shared with the cache or a fork is copied on that write)."""
        self._check_idle(seq, "truncate")
        if not 1 <= n <= len(seq.tokens):
            raise EngineError(f"truncate to {n} tokens: the sequence holds {len(seq.tokens)}")
        if n < seq.joined:
            raise EngineError(f"truncate to {n} tokens: the first {seq.joined} are fixed by a merge join "
                              "(its branches' KV cannot be rolled back)")
        self._retire_fork(seq)
        work = self._prefill_work.get(seq.id)
        if work is not None:                  # queued tokens past the new length are not written
            keep = n - 1 - work.base
            if work.done >= keep:
                del self._prefill_work[seq.id]
            else:
                work.run = work.run[:keep]
        self._alloc(seq).truncate(seq.pages, min(seq.pages.length, n - 1))
        seq.tokens = seq.tokens[:n]
        if seq.trace is not None:
            seq.trace.sync(seq)
        return seq

    @property
    def max_branches(self) -> int:        # the orchestrator's name for children per parent
        return self.max_children

    def close(self, seq: Seq) -> None:
        """Free the sequence's slot and pages (immediately; the sequence must be idle). Its full
        pages of plain prefix (before any merge join) stay cached in the radix tree for the next
        sequence that starts with the same tokens."""
        self._check_idle(seq, "close")
        seq.closed = True
        self._prefill_work.pop(seq.id, None)
        if seq.slot is not None:
            self._retire_fork(seq)
            group = self._groups.pop(seq.slot, None)
            for row in group or ():                       # an aborted fork's children
                if row is not None and row.pages is not None and not row.pages.released:
                    self._alloc(seq).release(row.pages)
            sp = seq.pages
            if sp is not None:
                sp.length = min(sp.length, len(seq.tokens) - 1, seq.cache_len)
                self._trees[seq.part].finish(sp, seq.tokens, cache=seq.cache_epoch == self._cache_epoch)
            else:                                          # aborted while preempted
                self._preempted = deque(s for s in self._preempted if s is not seq)
            seq.pages = None
            self._free.append(seq.slot)
            self._free.sort(key=sh.slot_order(self.max_seqs, self._parts).index)
            seq.slot = None

    def abort(self, seq: Seq) -> None:
        """Drop whatever operation the sequence has in flight (a queued open, a prefill, its
        decoding rows) and free its slot at once: a server's client went away. The op ends with
        `done` set and `result` None; the sequence is closed."""
        op = seq.op
        if op is not None:
            self._waiting = deque(o for o in self._waiting if o is not op)
            if op.kind == "fork" and op.fork is not None:
                for child in op.fork.children:
                    if not child.released:
                        self._alloc(seq).release(child)
            self._finish(op, None)
        self.close(seq)

    def _alloc(self, seq: Seq) -> PageAllocator:
        return self._allocs[seq.part]

    def _retire_fork(self, seq: Seq) -> None:
        """The sequence moves on from its last fork without merging it: the children's pages go."""
        fork = seq.last_fork
        if fork is not None:
            for child in fork.children:
                if child is not None and child.pages is not None and not child.pages.released:
                    self._alloc(seq).release(child.pages)
            seq.last_fork = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (new weights make them stale; a test that zeroes the pool);
        sequences open now are not cached when they close. Returns the pages the cache held."""
        self._cache_epoch += 1
        return sum(t.clear() for t in self._trees)

    def page_ids(self, seq: Seq) -> list[int]:
        """The sequence's page table as pool page ids (token i: page ids[i // page_size])."""
        return [p + seq.part * self._part_pages for p in seq.pages.pages]

    def page_stats(self) -> dict[str, int]:
        """The pool now: pages in all, free, held by live sequences or cached only by the radix
        tree (evictable), the prefix tokens sequences took from the cache instead of prefilling,
        and the pages evicted so far."""
        free = sum(a.free_pages for a in self._allocs)
        cached_only = sum(t.cached_only() for t in self._trees)
        return dict(pages_total=self.num_pages, pages_free=free, pages_used=self.num_pages - free - cached_only,
                    pages_cached=cached_only, page_size=self.page_size,
                    prefix_hit_tokens=sum(t.hit_tokens for t in self._trees),
                    evicted_pages=sum(t.evicted for t in self._trees))

    def progress(self, op: Op) -> list[list[int]]:
        """Tokens generated so far by a generate (one list) or fork (one per child) op, for
        streaming; a finished row's tokens are final (cut at its stop)."""
        if op.kind not in ("generate", "fork"):
            return []
        if op.done:
            return [op.result.tokens] if op.kind == "generate" else [g.tokens for g in op.result]
        rows = self.running_rows(op)
        if op.kind == "generate":
            return [list(rows[0].gen) if rows[0] is not None else []]
        return [list(g.tokens) if g is not None else (list(r.gen) if r is not None else [])
                for g, r in zip(op.result, rows)]

    def running_rows(self, op: Op) -> list[Row | None]:
        """Per choice of an unfinished generate (one) or fork (one per child) op, the `Row` that
        decodes it now (its tokens so far in `gen`, their log-probs in `lps` / `tops`), or None:
        finished, or a serial fork's child not started yet. Read-only for callers (a server
        streaming partial results)."""
        group = self._groups.get(op.seq.slot) if op.seq.slot is not None else None
        n = 1 if op.kind == "generate" else len(op.prefixes)
        if group is None:
            return [None] * n
        return [group[0]] if op.kind == "generate" else [group[1 + j] for j in range(n)]

    # ---- state ----------------------------------------------------------------------------
    @property
    def live_rows(self) -> int:
        """Rows decoding or waiting to decode (parents of generate ops and fork children)."""
        return sum(r is not None for rows in self._groups.values() for r in rows)

    @property
    def waiting(self) -> int:
        """Opens queued for a free slot."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._prefill_work or self._preempted or any(
            r is not None for rows in self._groups.values() for r in rows))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _finish(self, op: Op, result) -> None:
        op.done, op.result = True, result
        op.seq.op = None

    def stop_ids(self, stops: list[str]) -> list[int]:
        """The row's device stop ids: EOS, then every token whose own text contains one of the stop
        strings (" </Plan_1>" for "</Plan_1>"): emitting it completes that stop, so the row ends on
        device in the step it is written instead of at the end of the chunk. The host scanner
        still finds the earliest stop and cuts there; ids past STOP_WIDTH are left to it."""
        ids = list(self.eos_token_ids)
        for s in stops:
            if s not in self._single_token:
                texts = self._token_texts()
                self._single_token[s] = [i for i, t in enumerate(texts) if s and s in t]
            for t in self._single_token[s]:
                if len(ids) < STOP_WIDTH and t not in ids:
                    ids.append(t)
        return ids + [-2] * (STOP_WIDTH - len(ids))

    def _token_texts(self) -> list[str]:
        """Each token id's own text (once per engine; stop strings are matched against it)."""
        if self._texts is None:
            n = min(self.config.vocab_size, len(self.tokenizer))
            self._texts = list(self.tokenizer.batch_decode([[i] for i in range(n)])) \
                if hasattr(self.tokenizer, "batch_decode") else [self.decode_text([i]) for i in range(n)]
        return self._texts


__all__ = ["Engine", "EngineConfig", "EngineError", "Generation", "Op", "Seq"]
