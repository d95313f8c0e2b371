"""The single-run engine: one sequence's prefill / extend / generate / decode_branches / merge, as a
thin layer over the batched slot core (`sprint_jax.infer.batch.BatchEngine`; docs/design.md
"The engine").

`Engine` holds a `BatchEngine(max_seqs=1, max_children=max_branches)`: the sequence lives in its one
parent slot, a fork's branches in that slot's children, and every call is the core's operation
run to completion (`BatchEngine.run`). So the single-run API and the scheduler share one decode
step, one cache layout and one sampling key stream (a request gives the same tokens on both), and
the single-run engine gets the core's mesh path (`mesh=`: parameters by the rules table, KV heads
copied where `tensor` exceeds them, the Pallas parent-prefix kernel per shard).

State. A `DecodeState` is a value-like handle on the sequence: its tokens (the last one pending:
not yet run through the model) and a merge join's fields. The KV lives in the engine's slot;
each call first checks that the slot holds the state's tokens. A state that is a prefix of what
the slot holds (an older handle after a rollback) truncates the slot; a state whose slot was
taken by a later `prefill` is prefilled again from its tokens (same results, that prefill's
cost); a merge join's KV cannot be rebuilt from tokens, so such a state raises EngineError.

Fork modes of `decode_branches` (paper §10: every executor of a stage decodes at once):
- shared: the slot core's fork: each branch is a child slot that reads the planner's prefix in
  place (read once per step for all branches) plus its own suffix (Hydragen-style merge).
- serial: the same children, one after another (each alone on the planner's context).
- copy: the prefix copied into every branch (`sprint_jax.infer.copy_fork`): a baseline for
  `bench decode` only, not a serving path.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.copy_fork import KVCache
from sprint_jax.infer.sampling import GREEDY, Sampling, mask_padded, sample_tokens, valid_vocab


class EngineError(ValueError):
    """A request the engine cannot serve (capacity, empty input): the message says which limit."""


@dataclasses.dataclass
class DecodeState:
    """A handle on the single-run engine's sequence: `tokens` is the whole sequence so far,
    including the pending last token. Engine calls update the handle in place and return it.
    The KV lives in the engine's slot (`cache` reads it); see the module docstring for how a
    state the slot no longer holds is treated."""
    tokens: list[int]
    # merge join: position of cache slot s is s + pos_offset (a join places k branches
    # side by side in the cache but continues at fork + the longest, so slots run ahead of
    # positions); the first `joined` tokens are fixed by the last join (no rollback into them).
    # Right after a join (`after_join`) the last token's KV is already in the cache (computed in
    # its branch) and `join_logits` are its logits, from which the next token is sampled.
    pos_offset: int = 0
    joined: int = 0
    join_logits: jax.Array | None = None
    _engine: "Engine | None" = dataclasses.field(default=None, repr=False, compare=False)
    _seq: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def after_join(self) -> bool:
        return self.join_logits is not None and len(self.tokens) == self.joined

    @property
    def length(self) -> int:          # tokens whose KV is in the cache
        return len(self.tokens) - (0 if self.after_join else 1)

    @property
    def pending(self) -> int:         # the last token, not yet run through the model
        return self.tokens[-1]

    @property
    def cache(self) -> KVCache:
        """The sequence's KV: the engine's parent slot, k, v [L, 1, capacity, Hkv, D] (a copy;
        slots past `length` hold nothing meaningful)."""
        return self._engine._slot_cache(self)


@dataclasses.dataclass
class Generation:
    tokens: list[int]                 # generated tokens only, up to and including the stop
    text: str
    stop_reason: str                  # "stop" | "eos" | "length"
    overshoot: int = 0                # tokens decoded past a stop within a chunk and discarded
    state: DecodeState | None = None  # generate(): the updated state
    steps: int = 0                    # decode steps that ran for this row (its tokens + overshoot)


@dataclasses.dataclass
class BranchStats:
    """What the last decode_branches call cost (read by benchmarks and tests)."""
    mode: str
    branches: int
    cache_bytes: int                  # bytes of KV the fork held (prefix as read + branch slots / copies)
    steps: int
    wall_s: float


@functools.lru_cache(maxsize=None)
def _takes_skip_flag(tokenizer_type: type) -> bool:
    try:
        params = inspect.signature(tokenizer_type.decode).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "skip_special_tokens" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def decode_tokens(tokenizer, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
    """tokenizer.decode(tokens), special tokens left out when asked (a minimal tokenizer whose
    decode takes no such flag has none to leave out)."""
    if not _takes_skip_flag(type(tokenizer)):
        return tokenizer.decode(list(tokens))
    return tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)


def checked_sampling(sampling: Sampling | None) -> Sampling:
    """`sampling` (GREEDY for None) with its values checked again: a request's values reach the
    decode step's int32 / float32 row arrays, where an out-of-range one would fail the whole step
    of every request sharing it; here it fails only its own call (EngineError naming the field)."""
    from sprint_jax.infer.sampling import SamplingError

    if sampling is None:
        return GREEDY
    try:
        return sampling.checked()
    except SamplingError as e:
        raise EngineError(f"sampling: {e}") from None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_merge_branches(branches: Sequence[Sequence[int]], n: int, n_tokens: int,
                         max_seq_len: int) -> list[list[int]]:
    """A merge join's branches as int lists, or an EngineError naming what does not fit (both
    engines' `merge`): one non-empty branch per fork child, the merged length within max_seq_len."""
    branches = [[int(t) for t in b] for b in branches]
    if len(branches) != n:
        raise EngineError(f"merge of {len(branches)} branches; the fork has {n}")
    if any(not b for b in branches):
        raise EngineError("merge: a branch has no tokens")
    total = n_tokens + sum(len(b) for b in branches)
    if total > max_seq_len:
        raise EngineError(f"merging to {total} tokens exceeds max_seq_len={max_seq_len}")
    return branches


@functools.partial(jax.jit, static_argnames=("n_valid",))
def _sample_first_fn(logits, seed, temperature, top_k, top_p, n_valid: int | None):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), 0)   # row 0, step 0
    return sample_tokens(mask_padded(logits, n_valid)[None], key[None], temperature, top_k, top_p, False)[0]


def _sample_first(logits, sampling: Sampling, n_valid: int | None = None) -> int:
    """The token a one-row decode would sample at step 0 from `logits` [V] (same key stream), never
    a padded id (>= n_valid). Greedy: the argmax of the logits brought to the host (one small
    transfer, no device op: this runs on the latency path, once per merge join); else one jitted
    call with host scalars."""
    if sampling.greedy:
        host = np.asarray(logits, np.float32)
        return int(np.argmax(host[:n_valid] if n_valid is not None else host))
    return int(_sample_first_fn(logits, np.int32(sampling.seed), np.float32(sampling.temperature),
                                np.int32(sampling.top_k), np.float32(sampling.top_p), n_valid=n_valid))


def _bucket(n: int, lo: int = 16) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


MODES = ("shared", "copy", "serial")


class Engine:
    """Prefill / extend / generate / decode_branches / merge over a Qwen2 model, one sequence at a
    time, on the batched slot core (`BatchEngine(max_seqs=1, max_children=max_branches)`).

    Capacities (all optional):
      max_seq_len        tokens one sequence (the planner) may hold            (default 2048)
      max_branches       executor branches decoded together                     (default 8)
      max_branch_tokens  forced prefix + generated tokens per branch            (default 512)
      decode_chunk       decode steps per host round trip                       (default 16)
      prefill_chunk      longest piece prefilled in one call                    (default 512)
      attention_impl     "xla" | "pallas" for the fork's parent-prefix attention (default "xla")

    mesh: a (data, fsdp, tensor) Mesh: the core's mesh path (parameters by the trainer's rules
    table, KV heads over tensor, copied where tensor exceeds them, with a logged note; the Pallas
    kernel per shard). One sequence has one parent slot, so `data` replicates it (noted).
    `core` is the BatchEngine; `sharding_notes` what the mesh replicated or copied.
    """

    def __init__(self, model, tokenizer, *, max_seq_len: int = 2048, max_branches: int = 8,
                 max_branch_tokens: int = 512, decode_chunk: int = 16, prefill_chunk: int = 512,
                 attention_impl: str = "xla", eos_token_ids: Sequence[int] | None = None, mesh=None):
        from sprint_jax.infer.batch import BatchEngine

        if attention_impl not in ("xla", "pallas"):
            raise EngineError(f"attention_impl must be 'xla' or 'pallas', got {attention_impl!r}")
        for name, v in (("max_seq_len", max_seq_len), ("max_branches", max_branches),
                        ("max_branch_tokens", max_branch_tokens), ("decode_chunk", decode_chunk),
                        ("prefill_chunk", prefill_chunk)):
            if v <= 0:
                raise EngineError(f"{name} must be positive, got {v}")
        self.core = BatchEngine(model, tokenizer, max_seqs=1, max_children=max_branches, max_seq_len=max_seq_len,
                                max_branch_tokens=max_branch_tokens, decode_chunk=decode_chunk,
                                prefill_chunk=prefill_chunk, eos_token_ids=eos_token_ids, mesh=mesh,
                                attention_impl=attention_impl)
        self.model = model
        self.mesh = mesh
        self.sharding_notes = self.core.sharding_notes
        self.tokenizer = tokenizer
        self.n_valid = valid_vocab(tokenizer, model.config.vocab_size)   # padded ids are never sampled
        self.max_seq_len = max_seq_len
        self.max_branches = max_branches
        self.max_branch_tokens = max_branch_tokens
        self.decode_chunk = decode_chunk
        self.prefill_chunk = prefill_chunk
        self.attention_impl = attention_impl
        self.eos_token_ids = self.core.eos_token_ids
        self.last_branch_stats: BranchStats | None = None
        self._seq = None                          # the core's sequence (the slot's content)
        self._fork: tuple[DecodeState, int] | None = None   # the last shared fork, kept for merge

    @property
    def config(self):
        """The config the core runs (on a mesh: the serving layout's, e.g. copied KV heads)."""
        return self.core.config

    @property
    def params(self):
        return self.core.params

    @params.setter
    def params(self, params) -> None:
        """New weights (the RL trainer's in-process update): the core decodes with them from the next
        call on (on a mesh placed as the core placed the first ones)."""
        if self.mesh is None:
            self.core.params = params
        else:
            from sprint_jax.infer import sharding as sh
            self.core.params = sh.shard_model(self.model.config, params, self.mesh, [])[1]

    @property
    def seq_capacity(self) -> int:
        """Slots of the sequence's parent slot (max_seq_len + decode-chunk slack)."""
        return self.core.parent_capacity

    @property
    def suffix_capacity(self) -> int:
        """Slots of one branch's child slot."""
        return self.core.child_capacity

    @property
    def stats(self) -> dict:
        """The core's counters (steps, decode_calls, prefill_calls, tokens)."""
        return self.core.stats

    @property
    def last_join_tokens(self) -> int:
        """Tokens the last merge ran (in their branches)."""
        return self.core.last_join_tokens

    # ---- tokens <-> text ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_text(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of tokens; special tokens (EOS, padding) are left out unless asked for."""
        return decode_tokens(self.tokenizer, tokens, skip_special_tokens)

    def stop_ids(self, stops: Sequence[str]) -> list[int]:
        """The device stop ids of a row with these stop strings (EOS first; the core's rule)."""
        return self.core._stop_ids(list(stops))

    # ---- the state <-> the slot -------------------------------------------------------------
    def _open(self, state: DecodeState):
        """Put the state's tokens in the slot (a new core sequence; the previous one is closed)."""
        if self._seq is not None and not self._seq.closed:
            self.core.close(self._seq)
        self._seq = self.core.open(state.tokens).result
        self._fork = None
        state._seq = self._seq
        return self._seq

    def _bind(self, state: DecodeState):
        """The core sequence holding exactly `state`'s tokens (see the module docstring)."""
        if not isinstance(state, DecodeState) or state._engine is not self:
            raise EngineError("the state was not made by this engine's prefill")
        seq = state._seq
        if (seq is self._seq and seq is not None and not seq.closed and seq.join_logits is state.join_logits
                and (seq.pos_offset, seq.joined) == (state.pos_offset, state.joined)):
            n = len(state.tokens)
            if seq.tokens == state.tokens:
                return seq
            if 1 <= n <= len(seq.tokens) and seq.tokens[:n] == state.tokens:
                self.core.truncate(seq, n)        # an older handle: roll the slot back (refused into a join)
                return seq
        if state.joined or state.pos_offset or state.join_logits is not None:
            raise EngineError("this state holds a merge join whose KV is no longer in the engine's slot (a later "
                              "prefill or a diverging state replaced it); the single-run engine holds one sequence")
        return self._open(state)

    def _sync(self, state: DecodeState, seq) -> DecodeState:
        state.tokens = list(seq.tokens)
        state.pos_offset, state.joined, state.join_logits = seq.pos_offset, seq.joined, seq.join_logits
        return state

    def _slot_cache(self, state: DecodeState) -> KVCache:
        seq = self._bind(state)
        self.core.flush(seq)
        c, s = self.core.cache, seq.slot
        # KVCache is [L, B, C, Hkv, D]; the slot cache [L, N, Hkv, C, D] (a copy of the one slot)
        return KVCache(jnp.swapaxes(c.pk[:, s: s + 1], 2, 3), jnp.swapaxes(c.pv[:, s: s + 1], 2, 3))

    # ---- prefill / extend -----------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> DecodeState:
        """A new state holding token_ids (the last one pending). It takes the engine's slot."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise EngineError("prefill needs at least one token (got an empty input)")
        if len(token_ids) > self.max_seq_len:
            raise EngineError(f"input of {len(token_ids)} tokens exceeds max_seq_len={self.max_seq_len}")
        state = DecodeState(token_ids, _engine=self)
        return self._sync(state, self._open(state))

    def extend(self, state: DecodeState, token_ids: Sequence[int]) -> DecodeState:
        """Append token_ids, prefilling only them onto the existing cache (the orchestrator's sync)."""
        token_ids = [int(t) for t in token_ids]
        if len(state.tokens) + len(token_ids) > self.max_seq_len:
            raise EngineError(f"extending to {len(state.tokens) + len(token_ids)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        seq = self._bind(state)
        self.core.extend(seq, token_ids)          # written by the next core step (or flush)
        return self._sync(state, seq)

    def truncate(self, state: DecodeState, n: int) -> DecodeState:
        """Keep the first n tokens of state (1 <= n <= its length): the orchestrator rolls a state
        back to where its tokens agree with the training layout's tokenization. Nothing moves on
        device: the KV past the new length is never read and the next write overwrites it."""
        if not 1 <= n <= len(state.tokens):
            raise EngineError(f"truncate to {n} tokens: the state holds {len(state.tokens)}")
        if n < state.joined:
            raise EngineError(f"truncate to {n} tokens: the first {state.joined} are fixed by a merge join "
                              "(its branches' KV cannot be rolled back)")
        seq = self._bind(state)
        self.core.truncate(seq, n)
        return self._sync(state, seq)

    def step_logits(self, state: DecodeState) -> np.ndarray:
        """Next-token logits [V] after state's tokens (runs the pending token; state unchanged)."""
        if state.after_join:
            return np.asarray(state.join_logits)
        return self.core.forced_logits(self._bind(state), [])[0]

    def extend_logits(self, state: DecodeState, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher forcing: append token_ids and return the logits [T, V] that predict each of them
        (row t: the logits after state's tokens + token_ids[:t]). One pass for the pending token and
        token_ids[:-1]; token_ids[-1] stays pending. Used by exactness tests."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            return np.zeros((0, self.model.config.vocab_size), np.float32)
        first = []
        if state.after_join:
            first = [np.asarray(state.join_logits)]
            self.extend(state, token_ids[:1])
            token_ids = token_ids[1:]
            if not token_ids:
                return np.stack(first)
        if len(state.tokens) + len(token_ids) > self.max_seq_len:
            raise EngineError(f"extending to {len(state.tokens) + len(token_ids)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        seq = self._bind(state)
        rows = self.core.forced_logits(seq, token_ids)
        self._sync(state, seq)
        return np.concatenate([np.stack(first), rows]) if first else rows

    # ---- generate -------------------------------------------------------------------------
    def generate(self, state: DecodeState, max_new_tokens: int, stop: Sequence[str] = (),
                 sampling: Sampling | None = None) -> Generation:
        """Decode one sequence from `state` until EOS, a stop string, or max_new_tokens.

        The returned Generation carries the updated state (also updated in place): it holds the
        generated tokens up to the stop; anything decoded past it is discarded (overshoot).
        """
        if max_new_tokens <= 0:
            raise EngineError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(state.tokens) + max_new_tokens > self.max_seq_len:
            raise EngineError(f"{len(state.tokens)} tokens + max_new_tokens={max_new_tokens} exceeds "
                              f"max_seq_len={self.max_seq_len}")
        seq = self._bind(state)
        op = self.core.generate(seq, max_new_tokens, stop, sampling)
        self.core.run([op])
        g = op.result
        g.state = self._sync(state, seq)
        return g

    # ---- branches -------------------------------------------------------------------------
    def decode_branches(self, state: DecodeState, prefixes: Sequence[Sequence[int]],
                        max_new_tokens: int | Sequence[int], stop: Sequence[Sequence[str]] | Sequence[str] = (),
                        sampling: Sampling | None = None, mode: str = "shared", join: bool = False) -> list[Generation]:
        """Fork `state` into len(prefixes) branches, force each branch's prefix tokens, decode all.

        Branch j continues state's sequence with prefixes[j] (e.g. the tokens of
        `<execution_2.j>`) and then decodes until its own stop strings / EOS / token limit, with
        key stream j. Returns one Generation per branch (generated tokens only). `state` keeps
        its content. A shared fork is kept for `merge`; join=True (a merge follows): each branch
        also runs its last token (`BatchEngine.fork`), so the merge runs no model call.
        """
        sampling = checked_sampling(sampling)
        n = len(prefixes)
        if mode not in MODES:
            raise EngineError(f"mode must be 'shared', 'copy' or 'serial', got {mode!r}")
        if n == 0:
            raise EngineError("decode_branches needs at least one branch prefix")
        if n > self.max_branches:
            raise EngineError(f"{n} branches exceed max_branches={self.max_branches}")
        if state.after_join:
            raise EngineError("decode_branches right after a merge join: the planner must write a token first")
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
        if len(limits) != n:
            raise EngineError(f"max_new_tokens has {len(limits)} entries for {n} branches")
        if stop and isinstance(stop[0], str):
            stops = [list(stop)] * n  # the same stop strings for every branch
        else:
            stops = [list(s) for s in stop] if stop else [[] for _ in range(n)]
        if len(stops) != n:
            raise EngineError(f"stop has {len(stops)} entries for {n} branches")
        prefixes = [[int(t) for t in p] for p in prefixes]
        for j, (p, m) in enumerate(zip(prefixes, limits)):
            if m <= 0:
                raise EngineError(f"branch {j}: max_new_tokens must be positive, got {m}")
            if len(p) + 1 + m > self.max_branch_tokens:
                raise EngineError(f"branch {j}: prefix of {len(p)} tokens + max_new_tokens={m} exceeds "
                                  f"max_branch_tokens={self.max_branch_tokens}")
            if mode == "copy" and len(state.tokens) + len(p) + m > self.max_seq_len:
                raise EngineError(f"branch {j}: context + prefix + max_new_tokens exceeds max_seq_len="
                                  f"{self.max_seq_len}")
        seq = self._bind(state)
        t0 = time.perf_counter()
        self._fork = None
        if mode == "copy":
            gens, nbytes, steps = self._branches_copy(seq, prefixes, limits, stops, sampling)
        else:
            op = self.core.fork(seq, prefixes, limits, stops, sampling, serial=mode == "serial",
                                join=join and mode == "shared")
            self.core.run([op])
            gens = list(op.result)
            nbytes = self._fork_bytes(seq.length, n)
            # decode steps that produced a token: branches step together (shared) or in turn (serial)
            steps = (sum if mode == "serial" else max)(g.steps for g in gens)
            if mode == "shared":
                self._fork = (state, len(state.tokens))
        self.last_branch_stats = BranchStats(mode, n, nbytes, steps, time.perf_counter() - t0)
        self._sync(state, seq)
        return gens

    def _fork_bytes(self, p0: int, n: int) -> int:
        """KV bytes a slot fork of n branches holds, from the cache arrays: the planner's prefix as
        a step reads it (its p0 used slots, bucketed) + each branch's child slot (the prefix is never
        copied)."""
        c = self.core.cache
        per_slot = 2 * c.pk.shape[0] * c.pk.shape[2] * c.pk.shape[4] * c.pk.dtype.itemsize   # K + V, every layer
        prefix = min(_bucket(max(p0, 1), self.core.min_bucket), c.pk.shape[3])
        return (prefix + n * c.ck.shape[3]) * per_slot

    def _branches_copy(self, seq, prefixes, limits, stops, sampling):
        """The copy-fork baseline (`copy_fork`): the planner's used slots copied into every branch."""
        from sprint_jax.infer.copy_fork import copy_fork_branches

        self.core.flush(seq)
        p0 = seq.length
        pb = min(_bucket(max(p0, 1), self.core.min_bucket), self.core.parent_capacity)   # as a shared fork reads it
        # [L, Hkv, pb, D] slices of the slot cache, as the baseline's [L, pb, Hkv, D]
        pk = jnp.swapaxes(self.core.cache.pk[:, seq.slot, :, :pb], 1, 2)
        pv = jnp.swapaxes(self.core.cache.pv[:, seq.slot, :, :pb], 1, 2)
        return copy_fork_branches(self, pk, pv, p0, seq.tokens[-1], prefixes, limits, stops, sampling,
                                  seq.pos_offset, self.core.child_capacity, self.prefill_chunk)

    # ---- merge join ----------------------------------------------------------------------
    def merge(self, state: DecodeState, branches: Sequence[Sequence[int]]) -> DecodeState:
        """Join the branches of the shared fork just decoded from `state` into it without re-running
        them (`BatchEngine.merge`): branches[j] is branch j's final tokens after the fork (its forced
        opening, body and any repair, as the layout tokenizes them). Each branch first runs, in its
        child slot, only the tokens it never computed; then the branches' KV rows are copied after
        the planner's prefix in branch order. Every branch keeps the positions it had (all start at
        the fork), so the state continues at fork + the longest branch: `pos_offset` takes the
        difference. The next token is sampled from the last branch's last logits (`join_logits`),
        as the one-sequence merge layout predicts it (train/data.py)."""
        if self._fork is None or self._fork[0] is not state or self._fork[1] != len(state.tokens):
            raise EngineError("merge needs the shared fork just decoded from this state (decode_branches or "
                              "fork_logits), with the state unchanged since")
        seq = self._bind(state)
        self.core.merge(seq, branches)
        self._fork = None
        return self._sync(state, seq)

    def fork_logits(self, state: DecodeState, branches: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher forcing over a fork: branch j continues `state` with branches[j] (all forced, in
        the slot core's fork); returns per branch the logits [len(branches[j]), V] that predict each
        of its tokens (row 0: the planner's pending token, run in the branch). The fork is kept for
        `merge` (each branch's last token is left for the join to run), so a trajectory can be
        checked token by token through fork, branches and merge."""
        seq = self._bind(state)
        out = self.core.fork_logits(seq, branches)       # the core checks the branches (same errors)
        self._fork = (state, len(state.tokens))
        return out
