"""The engine: many sequences, one decode step, over a two-level slot cache.

Requests are operations on sequences (`sprint_jax.infer.requests`): open (prefill a prompt into a
parent slot; queued while every slot is taken), extend (prefill more tokens), generate (decode on
the parent), fork (k children with forced prefixes, decoded together, each a child slot reading
the parent's prefix in place), merge (join a finished fork's children into the parent without
re-running them), truncate, close. `Engine.step()` serves the queued work of every sequence at
once (`scheduler.Scheduler`); the jitted programs it calls are in `sprint_jax.infer.programs`, the
cache in `sprint_jax.infer.slot_cache`, merge joins and teacher forcing in `sprint_jax.infer.joins`.
A single run is an engine with one sequence slot (`max_seqs=1`); `sprint_jax.infer.single.SingleRun`
drives one with blocking calls.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import jax

from sprint_jax.infer import sharding as sh
from sprint_jax.infer.joins import Joins
from sprint_jax.infer.programs import STOP_WIDTH
from sprint_jax.infer.requests import (DecodeTrace, EngineError, ForkRecord, Generation, Op, PrefillWork, Row,
                                       Seq, checked_sampling, decode_tokens, sample_first)
from sprint_jax.infer.sampling import TOP_LOGPROBS, Sampling, valid_vocab
from sprint_jax.infer.scheduler import Scheduler
from sprint_jax.infer.slot_cache import SlotCache
from sprint_jax.infer.stops import StopScanner
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import UNROLL_MAX_LAYERS, per_layer


def _check_top(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= TOP_LOGPROBS:
        raise EngineError(f"top_logprobs must be an integer in 0..{TOP_LOGPROBS}, got {n!r}")


class Engine(Scheduler, Joins):
    """Many sequences, one decode step: the two-level slot cache and its scheduler. A single run
    is an engine with max_seqs=1.

    Capacities:
      max_seqs           parent slots (sequences held at once; more opens queue)    (default 16)
      max_children       child slots per parent (executors of a stage, n of n>1)     (default 8)
      max_seq_len        tokens one parent sequence may hold                         (default 2048)
      max_branch_tokens  forced prefix + generated tokens per child                   (default 512)
      decode_chunk       decode steps per host round trip                             (default 16)
      prefill_chunk      tokens per sequence per prefill call                         (default 256)

    mesh: a (data, fsdp, tensor) Mesh (`sprint_jax.infer.sharding.mesh_from_flag`): parameters
    placed by the trainer's rules table, parent and child slots over data, KV heads over tensor
    (replicated, with a logged note, where they do not divide); None = one device.
    `sharding_notes` lists what was replicated.

    attention_impl: "xla" or "pallas" for the parent-prefix attention of a decode step ("pallas":
    `sprint_jax.kernels.grouped_prefix_attention`, all groups in one call, per shard on a mesh;
    interpret mode on CPU, where it is slow and only a correctness check).

    per_layer_weights: run the programs on a second, per-layer copy of the layer weights
    (`qwen2.per_layer`, a `lax.switch` over the layers) instead of the stacked form, whose layer
    scan XLA CPU runs by copying every weight out of the stack at every step. None (default): on
    for a model of at most `UNROLL_MAX_LAYERS` layers on one device (the copy is small there and
    the demo's model decodes faster with it), off for deep models and meshes. `params` stays the
    stacked form; setting it (the RL trainer's update) renews the copy.
    """

    def __init__(self, model, tokenizer, *, max_seqs: int = 16, max_children: int = 8, max_seq_len: int = 2048,
                 max_branch_tokens: int = 512, decode_chunk: int = 16, prefill_chunk: int = 256,
                 eos_token_ids: Sequence[int] | None = None, min_bucket: int = 64, mesh=None,
                 attention_impl: str = "xla", per_layer_weights: bool | None = None, trace: bool = False):
        if attention_impl not in ("xla", "pallas"):
            raise EngineError(f"attention_impl must be 'xla' or 'pallas', got {attention_impl!r}")
        self.attention_impl = attention_impl
        self.trace = trace                # each sequence keeps a DecodeTrace (RL's loss layout)
        for name, v in (("max_seqs", max_seqs), ("max_children", max_children), ("max_seq_len", max_seq_len),
                        ("max_branch_tokens", max_branch_tokens), ("decode_chunk", decode_chunk),
                        ("prefill_chunk", prefill_chunk)):
            if v <= 0:
                raise EngineError(f"{name} must be positive, got {v}")
        self.config: Qwen2Config = model.config
        self.model_config: Qwen2Config = model.config   # as trained (on a mesh `config` is the serving layout's)
        if per_layer_weights is None:
            per_layer_weights = mesh is None and self.config.num_hidden_layers <= UNROLL_MAX_LAYERS
        self.per_layer_weights = bool(per_layer_weights)
        self.mesh = mesh
        self.tokenizer = tokenizer
        self.n_valid = valid_vocab(tokenizer, self.config.vocab_size)   # padded ids are never sampled
        self.max_seqs, self.max_children = max_seqs, max_children
        self.max_seq_len, self.max_branch_tokens = max_seq_len, max_branch_tokens
        self.decode_chunk, self.prefill_chunk = decode_chunk, prefill_chunk
        self.min_bucket = min_bucket
        if eos_token_ids is None:
            eos_token_ids = list(self.config.eos_token_ids)
            tok_eos = getattr(tokenizer, "eos_token_id", None)
            if tok_eos is not None and tok_eos not in eos_token_ids:
                eos_token_ids.append(tok_eos)
        self.eos_token_ids = [int(e) for e in eos_token_ids][:STOP_WIDTH]
        # the decode chunk may run past a row's last token before the host sees the stop
        self.parent_capacity = max_seq_len + decode_chunk
        self.child_capacity = max_branch_tokens + decode_chunk
        self.sharding_notes: list[str] = []
        self._kv = None
        if mesh is None:
            self.params = model.params
            self.cache = SlotCache.zeros(self.config, max_seqs, max_children, self.parent_capacity,
                                         self.child_capacity)
        else:
            notes = self.sharding_notes
            self.config, params = sh.shard_model(self.config, model.params, mesh, notes)
            self._set_params(params)
            self._kv = (sh.kv_sharding(self.config, mesh, max_seqs, notes, "parent slots"),
                        sh.kv_sharding(self.config, mesh, max_seqs * max_children, notes, "child slots"))
            if not sh.slot_axes(self._kv[:1]) and sh.slot_axes(self._kv[1:]):
                # too few parent slots to split (a single run's one): children stay with
                # their parent on every device rather than split apart from it (no per-step gathers)
                self._kv = (self._kv[0], sh.whole_slots(self._kv[1]))
                notes.append("child slots: replicated like the parent slots (too few parent slots to split)")
            sh.log_notes(notes, "Engine on mesh " + ",".join(f"{k}={v}" for k, v in mesh.shape.items()))
            p, c = self._kv
            self.cache = jax.jit(SlotCache.zeros, static_argnums=(0, 1, 2, 3, 4),
                                 out_shardings=SlotCache(p, p, c, c))(
                self.config, max_seqs, max_children, self.parent_capacity, self.child_capacity)
        self._parts = sh.slot_parts(self._kv)          # slot shards (data > 1): rows placed per shard
        self._free = sh.slot_order(max_seqs, self._parts)
        self._waiting: deque[Op] = deque()             # opens waiting for a slot
        # seq id -> its queued tokens (an open's prompt, extends; queued when submitted, written
        # by the next step)
        self._prefill_work: dict[int, PrefillWork] = {}
        self._groups: dict[int, list[Row | None]] = {}                  # slot -> [parent row, children...]
        self._single_token: dict[str, list[int]] = {}     # stop string -> tokens whose text holds it
        self._texts: list[str] | None = None
        self.stats = dict(steps=0, decode_calls=0, prefill_calls=0, tokens=0, join_copies=0)
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
        while self._waiting and self._free:
            op = self._waiting.popleft()
            seq = op.seq
            seq.slot = self._free.pop(0)
            seq.tokens = op.tokens
            if self.trace:
                seq.trace = DecodeTrace()
                seq.trace.sync(seq)
            self._groups.pop(seq.slot, None)
            if len(op.tokens) > 1:
                self._queue_prefill(seq, op.tokens[:-1], 0)
            self._finish(op, seq)

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

    def truncate(self, seq: Seq, n: int) -> Seq:
        """Keep the first n tokens (1 <= n <= its length), at once: the KV past the new length is
        never read and the next write overwrites it (the orchestrator's token-boundary rollback)."""
        self._check_idle(seq, "truncate")
        if not 1 <= n <= len(seq.tokens):
            raise EngineError(f"truncate to {n} tokens: the sequence holds {len(seq.tokens)}")
        if n < seq.joined:
            raise EngineError(f"truncate to {n} tokens: the first {seq.joined} are fixed by a merge join "
                              "(its branches' KV cannot be rolled back)")
        work = self._prefill_work.get(seq.id)
        if work is not None:                  # queued tokens past the new length are not written
            keep = n - 1 - work.base
            if work.done >= keep:
                del self._prefill_work[seq.id]
            else:
                work.run = work.run[:keep]
        seq.tokens = seq.tokens[:n]
        if seq.trace is not None:
            seq.trace.sync(seq)
        return seq

    @property
    def max_branches(self) -> int:        # the orchestrator's name for children per parent
        return self.max_children

    def close(self, seq: Seq) -> None:
        """Free the sequence's slot (immediately; the sequence must be idle)."""
        self._check_idle(seq, "close")
        seq.closed = True
        self._prefill_work.pop(seq.id, None)
        if seq.slot is not None:
            self._groups.pop(seq.slot, None)
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
            self._finish(op, None)
        self.close(seq)

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
        return bool(self._waiting or self._prefill_work or any(
            r is not None for rows in self._groups.values() for r in rows))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def _finish(self, op: Op, result) -> None:
        op.done, op.result = True, result
        op.seq.op = None

    def _stop_ids(self, stops: list[str]) -> list[int]:
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


__all__ = ["Engine", "EngineError", "Generation", "Op", "Seq"]
