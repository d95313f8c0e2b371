"""Decoding engine: a static-capacity KV cache, bucketed prefill, chunked on-device decode, and
branch-batched decoding over a forked, shared-prefix KV cache (DESIGN.md "Inference engine").

State layout. A `DecodeState` holds the KV of every token of its sequence except the last one,
which is *pending*: the next decode step (or extend) processes it first. Rolling back a stop that
was found mid-chunk is then just resetting `length` and `pending`; slots past `length` are never
read (masks) and are overwritten by the next write.

Fork modes of `decode_branches` (paper §10: every executor of a stage decodes at once):
- shared: the prefix KV is stored once; each branch owns a suffix cache. One branch's step
  attends to the prefix and to its suffix and merges the two by log-sum-exp (Hydragen). The step
  is written for one branch and `jax.vmap`ped over branches with the prefix unmapped, so XLA
  reads the prefix once per step for all branches.
- copy: the prefix is copied into every branch's cache (the baseline to beat).
- serial: one branch after another on the planner's own cache (no copy at all).
All three use the same layer code and the one attention module (`model/attention.py`): prefill and
extend chunks run `flash_attention` over the cache, a decode step the dense `attend_partial`.
A shared-mode decode step with attention_impl="pallas" runs the prefix + suffix attention of all
branches in the Pallas kernel (sprint_jax.kernels.shared_prefix_attention).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.sampling import GREEDY, Sampling, advance_rows, mask_padded, sample_tokens, valid_vocab
from sprint_jax.infer.stops import StopScanner
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import (attend_partial, decoder, dtype_of, embed, flash_attention, merge_partials,
                                   unembed)


class EngineError(ValueError):
    """A request the engine cannot serve (capacity, empty input): the message says which limit."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer keys and values with static capacity: k, v [L, B, C, Hkv, D]."""
    k: jax.Array
    v: jax.Array

    @property
    def nbytes(self) -> int:
        return int(self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize)

    @staticmethod
    def zeros(config: Qwen2Config, batch: int, capacity: int) -> "KVCache":
        shape = (config.num_hidden_layers, batch, capacity, config.num_key_value_heads, config.head_dim)
        dt = dtype_of(config.dtype)
        return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


@dataclasses.dataclass
class DecodeState:
    """A host-side handle on one sequence: its cache, and which tokens it holds.

    Engine calls update the handle in place (its cache buffers are donated to each step) and
    return it; `tokens` is the whole sequence so far, including the pending last token.
    """
    cache: KVCache
    tokens: list[int]
    # merge join (issue 17): position of cache slot s is s + pos_offset (a join places k branches
    # side by side in the cache but continues at fork + the longest, so slots run ahead of
    # positions); the first `joined` tokens are fixed by the last join (no rollback into them).
    # Right after a join (`after_join`) the last token's KV is already in the cache (computed in
    # its branch) and `join_logits` are its logits, from which the next token is sampled.
    pos_offset: int = 0
    joined: int = 0
    join_logits: jax.Array | None = None

    @property
    def after_join(self) -> bool:
        return self.join_logits is not None and len(self.tokens) == self.joined

    @property
    def length(self) -> int:          # tokens whose KV is in the cache
        return len(self.tokens) - (0 if self.after_join else 1)

    @property
    def pending(self) -> int:         # the last token, not yet run through the model
        return self.tokens[-1]


@dataclasses.dataclass
class Generation:
    tokens: list[int]                 # generated tokens only, up to and including the stop
    text: str
    stop_reason: str                  # "stop" | "eos" | "length"
    overshoot: int = 0                # tokens decoded past a stop within a chunk and discarded
    state: DecodeState | None = None  # generate(): the updated state
    steps: int = 0                    # decode steps run (host round trips x chunk)


@dataclasses.dataclass
class BranchStats:
    """What the last decode_branches call cost (read by benchmarks and tests)."""
    mode: str
    branches: int
    cache_bytes: int                  # bytes of KV the fork allocated/held (prefix + suffixes)
    steps: int
    wall_s: float


@dataclasses.dataclass
class _Fork:
    """The branches of the last shared / copy `decode_branches`, kept for a merge join.
    tokens[j] = [the planner's pending token] + prefix_j + generated_j: branch slot s (from
    `start`) holds the KV of tokens[j][s] for s < computed[j] (the last token never ran)."""
    state: DecodeState
    n_tokens: int                     # len(state.tokens) at the fork: the state must be unchanged
    p0: int                           # state.length at the fork: where slot 0 goes in the planner
    tokens: list[list[int]]
    computed: list[int]
    cache: KVCache                    # [L, n, S, ...] branch suffixes (shared) or full copies (copy)
    prefix: tuple | None              # the shared prefix (shared mode), None (copy)
    start: int                        # slot of tokens[j][0] in a branch row (0 shared, p0 copy)


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


@functools.partial(jax.jit, static_argnames=("greedy",))
def _sample_first_fn(logits, seed, temperature, top_k, top_p, greedy: bool):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), 0)   # row 0, step 0
    return sample_tokens(logits[None], key[None], temperature, top_k, top_p, greedy)[0]


def _sample_first(logits, sampling: Sampling) -> int:
    """The token a one-row decode would sample at step 0 from `logits` (same key stream)."""
    return int(_sample_first_fn(logits, jnp.int32(sampling.seed), jnp.float32(sampling.temperature),
                                jnp.int32(sampling.top_k), jnp.float32(sampling.top_p), sampling.greedy))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _place_rows(cache: KVCache, src: KVCache, rows, slots, dst) -> KVCache:
    """cache row 0 slots dst [M] <- src rows/slots [M] (a merge join's copy; dst out of range: dropped)."""
    return KVCache(cache.k.at[:, 0, dst].set(src.k[:, rows, slots], mode="drop"),
                   cache.v.at[:, 0, dst].set(src.v[:, rows, slots], mode="drop"))


def _bucket(n: int, lo: int = 16) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


# ---------------------------------------------------------------------------------------------
# Pure functions (jitted below). `prefix` = (k, v, length) of a shared prefix or None.
# ---------------------------------------------------------------------------------------------
def _write_rows(cache_layer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache_layer [B, C, Hkv, D] <- new [B, T, Hkv, D] at per-row offsets start [B]."""
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0)))(
        cache_layer, new, start)


def _cached_hidden(params, config: Qwen2Config, tokens, cache: KVCache, start, prefix, attention_impl: str,
                   pos_offset=0):
    """Run tokens [B, T] written at per-row cache offsets start [B]; returns hidden [B, T, E], cache.

    Without a prefix, positions are start + t + pos_offset. With a shared prefix (k, v [L, P, Hkv,
    D], length P0), the cache is a branch suffix: positions are P0 + start + t + pos_offset and
    attention covers the prefix's first P0 keys plus this row's suffix, merged by log-sum-exp.
    pos_offset is the sequence's slot-to-position shift after a merge join (DecodeState).
    """
    b, t = tokens.shape
    cap = cache.k.shape[2]
    offs = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]             # [B, T] slot index
    positions = (offs if prefix is None else offs + prefix[2]) + pos_offset
    mask_suffix = jnp.arange(cap, dtype=jnp.int32)[None, None, :] <= offs[:, :, None]  # [B, T, C]

    def attend(q, k, v, layer):
        if prefix is None:
            ck, cv = layer
        else:
            ck, cv, pk, pv = layer
        ck = _write_rows(ck, k, start)
        cv = _write_rows(cv, v, start)
        if t > 1:
            # prefill / extend chunk: flash attention over the cache; key blocks past this chunk's
            # last row are never read, so the work follows the used length, not the capacity
            part_s = flash_attention(q, ck, cv, jnp.full((b, cap), cap + t, jnp.int32), q_offset=start,
                                     return_lse=True)
        else:
            part_s = attend_partial(q, ck, cv, mask_suffix)
        if prefix is None:
            return part_s[0], (ck, cv)
        plen = prefix[2]
        if attention_impl == "pallas" and t == 1:
            # all branches at once: the kernel reads each prefix block once for every branch
            from sprint_jax.kernels import shared_prefix_attention
            out = shared_prefix_attention(q[:, 0], pk, pv, plen, ck, cv, start + 1,
                                          interpret=jax.default_backend() == "cpu")
            return out[:, None].astype(q.dtype), (ck, cv, pk, pv)
        else:
            p_mask = jnp.broadcast_to(jnp.arange(pk.shape[0])[None, None, :] < plen, (b, t, pk.shape[0]))
            part_p = attend_partial(q, jnp.broadcast_to(pk[None], (b,) + pk.shape),
                                    jnp.broadcast_to(pv[None], (b,) + pv.shape), p_mask)
        out, _ = merge_partials([part_p, part_s])
        return out, (ck, cv, pk, pv)

    layers = (cache.k, cache.v) if prefix is None else (cache.k, cache.v, prefix[0], prefix[1])
    x = embed(params, config, tokens)
    x, new = decoder(params, config, x, positions, attend, layers)
    return x, KVCache(new[0], new[1])


def _last_logits(params, config, hidden, n_valid):
    """Logits of each row's last valid position: hidden [B, T, E], n_valid [B] -> [B, V]."""
    idx = jnp.clip(n_valid - 1, 0, hidden.shape[1] - 1)
    h = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)              # [B, 1, E]
    return unembed(params, config, h)[:, 0]


def _step_plain(params, config, tokens, cache, start, prefix, attention_impl, pos_offset=0):
    return _cached_hidden(params, config, tokens, cache, start, None, attention_impl, pos_offset)


def _step_branches(params, config, tokens, cache, start, prefix, attention_impl, pos_offset=0):
    """vmap of a one-branch step over branches; the shared prefix is unmapped (read once).

    With attention_impl="pallas" a decode step runs all branches as one batch instead, and the
    Pallas kernel (sprint_jax.kernels) does the prefix + suffix attention for all of them.
    """
    if attention_impl == "pallas" and tokens.shape[1] == 1:
        return _cached_hidden(params, config, tokens, cache, start, prefix, attention_impl, pos_offset)
    def one(tok, c, s):
        h, nc = _cached_hidden(params, config, tok[None], jax.tree.map(lambda a: a[:, None], c),
                               s[None], prefix, attention_impl, pos_offset)
        return h[0], jax.tree.map(lambda a: a[:, 0], nc)
    # branch caches are stored [L, n, S, ...] like a batch; map over axis 1
    h, nc = jax.vmap(one, in_axes=(0, 1, 0), out_axes=(0, 1))(tokens, cache, start)
    return h, nc


@functools.partial(jax.jit, static_argnames=("config", "branched", "attention_impl", "all_logits"),
                   donate_argnames=("cache",))
def _extend_fn(params, config, tokens, cache, start, n_valid, prefix, branched: bool, attention_impl: str,
               pos_offset=0, all_logits: bool = False):
    fn = _step_branches if branched else _step_plain
    hidden, cache = fn(params, config, tokens, cache, start, prefix, attention_impl, pos_offset)
    if all_logits:                   # teacher forcing: every row's logits [B, T, V]
        return cache, unembed(params, config, hidden)
    return cache, _last_logits(params, config, hidden, n_valid)


@functools.partial(jax.jit, static_argnames=("config", "branched", "chunk", "greedy", "attention_impl", "n_valid"),
                   donate_argnames=("cache",))
def _decode_fn(params, config, cache, lengths, pending, done, remaining, stop_ids, keys, step0,
               temperature, top_k, top_p, prefix, branched: bool, chunk: int, greedy: bool,
               attention_impl: str, n_valid: int | None = None, pos_offset=0):
    """Up to `chunk` decode steps on device. Each step runs the pending token of every row,
    samples the next one, and stops rows on EOS/stop-token ids or their token budget.

    Returns the cache, per-row lengths/pending/done/remaining, the emitted tokens [B, chunk]
    (-1 = none), and per-row reason codes (0 running, 1 stop id, 2 length).
    """
    fn = _step_branches if branched else _step_plain
    b = pending.shape[0]
    out = jnp.full((b, chunk), -1, jnp.int32)
    reason = jnp.zeros((b,), jnp.int32)

    def cond(c):
        i, _, _, _, done, _, _, _ = c
        return (i < chunk) & ~jnp.all(done)

    def body(c):
        i, cache, lengths, pending, done, remaining, out, reason = c
        hidden, cache = fn(params, config, pending[:, None], cache, lengths, prefix, attention_impl, pos_offset)
        logits = mask_padded(unembed(params, config, hidden)[:, 0], n_valid)     # no padded ids
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step0 + i))(keys)
        tok = sample_tokens(logits, step_keys, temperature, top_k, top_p, greedy)
        tok, finished, remaining, reason, lengths, pending = advance_rows(
            tok, ~done, stop_ids, remaining, reason, lengths, pending)
        out = out.at[:, i].set(tok)
        done = done | finished
        return i + 1, cache, lengths, pending, done, remaining, out, reason

    init = (jnp.int32(0), cache, lengths, pending, done, remaining, out, reason)
    i, cache, lengths, pending, done, remaining, out, reason = jax.lax.while_loop(cond, body, init)
    return cache, lengths, pending, done, remaining, out, reason, i


@functools.partial(jax.jit, static_argnames=("size",))
def _slice_prefix(cache: KVCache, size: int):
    """The first `size` slots of row 0 as an unbatched prefix: k, v [L, size, Hkv, D]."""
    return cache.k[:, 0, :size], cache.v[:, 0, :size]


@functools.partial(jax.jit, static_argnames=("n", "suffix_cap"))
def _copy_fork(pk, pv, n: int, suffix_cap: int):
    """The copy-fork baseline: every branch gets its own copy of the prefix + a suffix region."""
    def rep(a):
        pad = jnp.zeros(a.shape[:1] + (suffix_cap,) + a.shape[2:], a.dtype)
        full = jnp.concatenate([a, pad], axis=1)                             # [L, P+S, Hkv, D]
        return jnp.broadcast_to(full[:, None], (full.shape[0], n) + full.shape[1:])
    return KVCache(rep(pk), rep(pv))


# ---------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------
class Engine:
    """Prefill / extend / generate / decode_branches over a Qwen2 model.

    Capacities (all optional):
      max_seq_len        tokens one sequence (the planner) may hold            (default 2048)
      max_branches       executor branches decoded together                     (default 8)
      max_branch_tokens  forced prefix + generated tokens per branch            (default 512)
      decode_chunk       decode steps per host round trip                       (default 16)
      prefill_chunk      longest piece prefilled in one call; lengths bucketed  (default 512)
      attention_impl     "xla" | "pallas" for the shared-fork prefix attention  (default "xla")

    mesh: a (data, fsdp, tensor) Mesh: parameters placed by the trainer's rules table
    (sprint_jax.infer.sharding); the caches follow by GSPMD propagation. The Pallas path is
    single-device for now (a mesh with attention_impl="pallas" is refused); the batched engine
    (infer/batch.py) is the one whose KV slots are sharded explicitly.
    """

    def __init__(self, model, tokenizer, *, max_seq_len: int = 2048, max_branches: int = 8,
                 max_branch_tokens: int = 512, decode_chunk: int = 16, prefill_chunk: int = 512,
                 attention_impl: str = "xla", eos_token_ids: Sequence[int] | None = None, mesh=None):
        if attention_impl not in ("xla", "pallas"):
            raise EngineError(f"attention_impl must be 'xla' or 'pallas', got {attention_impl!r}")
        for name, v in (("max_seq_len", max_seq_len), ("max_branches", max_branches),
                        ("max_branch_tokens", max_branch_tokens), ("decode_chunk", decode_chunk),
                        ("prefill_chunk", prefill_chunk)):
            if v <= 0:
                raise EngineError(f"{name} must be positive, got {v}")
        self.model = model
        self.config: Qwen2Config = model.config
        self.params = model.params
        self.mesh = mesh
        self.sharding_notes: list[str] = []
        if mesh is not None:
            if attention_impl == "pallas":
                raise EngineError("attention_impl='pallas' runs on one device for now; use 'xla' with a mesh")
            from sprint_jax.infer import sharding as sh
            self.params = sh.place_params(model.params, sh.param_shardings(self.config, mesh, self.sharding_notes))
            sh.log_notes(self.sharding_notes, "Engine on a mesh")
        self.tokenizer = tokenizer
        self.n_valid = valid_vocab(tokenizer, self.config.vocab_size)   # padded ids are never sampled
        self.max_seq_len = max_seq_len
        self.max_branches = max_branches
        self.max_branch_tokens = max_branch_tokens
        self.decode_chunk = decode_chunk
        self.prefill_chunk = _bucket(prefill_chunk)
        self.attention_impl = attention_impl
        if eos_token_ids is None:
            eos_token_ids = list(self.config.eos_token_ids)
            tok_eos = getattr(tokenizer, "eos_token_id", None)
            if tok_eos is not None and tok_eos not in eos_token_ids:
                eos_token_ids.append(tok_eos)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        # internal capacities carry slack for bucket padding, so padded writes never clamp
        self._seq_cap = max_seq_len + self.prefill_chunk
        self._suffix_cap = _bucket(max_branch_tokens) + self.prefill_chunk
        self.last_branch_stats: BranchStats | None = None
        self._fork: _Fork | None = None
        self.last_join_tokens = 0           # tokens the last merge ran (in their branches)
        self._single_token_stops: dict[str, int | None] = {}

    @property
    def seq_capacity(self) -> int:
        """Slots of one sequence's cache (max_seq_len + bucket-padding slack)."""
        return self._seq_cap

    @property
    def suffix_capacity(self) -> int:
        """Slots of one branch's suffix cache in shared mode."""
        return self._suffix_cap

    # ---- tokens <-> text ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_text(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # ---- prefill / extend -----------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> DecodeState:
        """A new state holding token_ids (the last one pending)."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise EngineError("prefill needs at least one token (got an empty input)")
        if len(token_ids) > self.max_seq_len:
            raise EngineError(f"input of {len(token_ids)} tokens exceeds max_seq_len={self.max_seq_len}")
        state = DecodeState(KVCache.zeros(self.config, 1, self._seq_cap), [token_ids[0]])
        return self.extend(state, token_ids[1:])

    def extend(self, state: DecodeState, token_ids: Sequence[int]) -> DecodeState:
        """Append token_ids, prefilling only them onto the existing cache (the orchestrator's sync)."""
        token_ids = [int(t) for t in token_ids]
        if len(state.tokens) + len(token_ids) > self.max_seq_len:
            raise EngineError(f"extending to {len(state.tokens) + len(token_ids)} tokens exceeds "
                              f"max_seq_len={self.max_seq_len}")
        if state.after_join and token_ids:
            # after a merge join the last token is already in the cache: the first new token is
            # the one its logits would have sampled (forced here), and becomes the pending one
            state.tokens = state.tokens + token_ids[:1]
            token_ids = token_ids[1:]
        run = [state.pending] + token_ids[:-1] if token_ids else []
        pos = 0
        while pos < len(run):
            piece = run[pos: pos + self.prefill_chunk]
            tb = _bucket(len(piece), lo=4)
            toks = np.zeros((1, tb), np.int32)
            toks[0, : len(piece)] = piece
            start = jnp.asarray([state.length + pos], jnp.int32)
            state.cache, _ = _extend_fn(self.params, self.config, jnp.asarray(toks), state.cache, start,
                                        jnp.asarray([len(piece)], jnp.int32), None, branched=False,
                                        attention_impl=self.attention_impl,
                                        pos_offset=jnp.int32(state.pos_offset))
            pos += len(piece)
        state.tokens = state.tokens + token_ids
        return state

    def truncate(self, state: DecodeState, n: int) -> DecodeState:
        """Keep the first n tokens of state (1 <= n <= its length): the orchestrator rolls a state
        back to where its tokens agree with the training layout's tokenization. Nothing moves on
        device: the KV past the new length is never read and the next write overwrites it."""
        if not 1 <= n <= len(state.tokens):
            raise EngineError(f"truncate to {n} tokens: the state holds {len(state.tokens)}")
        if n < state.joined:
            raise EngineError(f"truncate to {n} tokens: the first {state.joined} are fixed by a merge join "
                              "(its branches' KV cannot be rolled back)")
        state.tokens = state.tokens[:n]
        return state

    def step_logits(self, state: DecodeState) -> np.ndarray:
        """Next-token logits [V] after state's tokens (runs the pending token; state unchanged)."""
        if state.after_join:
            return np.asarray(state.join_logits)
        state.cache, logits = _extend_fn(
            self.params, self.config, jnp.asarray([[state.pending]], jnp.int32), state.cache,
            jnp.asarray([state.length], jnp.int32), jnp.asarray([1], jnp.int32), None, branched=False,
            attention_impl=self.attention_impl, pos_offset=jnp.int32(state.pos_offset))
        return np.asarray(logits[0])

    def extend_logits(self, state: DecodeState, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher forcing: append token_ids and return the logits [T, V] that predict each of them
        (row t: the logits after state's tokens + token_ids[:t]). One pass for the pending token and
        token_ids[:-1]; token_ids[-1] stays pending. Used by exactness tests."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            return np.zeros((0, self.config.vocab_size), np.float32)
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
        run = [state.pending] + token_ids[:-1]
        toks = np.zeros((1, _bucket(len(run), lo=4)), np.int32)
        toks[0, : len(run)] = run
        state.cache, logits = _extend_fn(
            self.params, self.config, jnp.asarray(toks), state.cache, jnp.asarray([state.length], jnp.int32),
            jnp.asarray([len(run)], jnp.int32), None, branched=False, attention_impl=self.attention_impl,
            pos_offset=jnp.int32(state.pos_offset), all_logits=True)
        state.tokens = state.tokens + token_ids
        rows = np.asarray(logits[0, : len(run)])
        return np.concatenate([np.stack(first), rows]) if first else rows

    # ---- stops ----------------------------------------------------------------------------
    def _stop_token(self, s: str) -> int | None:
        """The token id of a stop string that is exactly one token (checked on device)."""
        if s not in self._single_token_stops:
            ids = self.encode(s)
            self._single_token_stops[s] = ids[0] if len(ids) == 1 and self.decode_text(ids) == s else None
        return self._single_token_stops[s]

    def _stop_id_array(self, stops: Sequence[Sequence[str]]) -> jax.Array:
        rows = [list(self.eos_token_ids) + [t for s in st if (t := self._stop_token(s)) is not None]
                for st in stops]
        width = max(1, max(len(r) for r in rows))
        arr = np.full((len(rows), width), -2, np.int32)
        for i, r in enumerate(rows):
            arr[i, : len(r)] = r
        return jnp.asarray(arr)

    # ---- the decode loop shared by generate and the branch modes ---------------------------
    def _run_decode(self, cache, lengths, pending, limits, stops, sampling, prefix, branched, row_ids,
                    pos_offset: int = 0, first: int | None = None):
        """Decode rows until each stops. Returns (cache, per-row Generations, steps).
        `first` (one row): a token already sampled at step 0 (after a merge join), `pending` is it."""
        b = len(limits)
        gens: list[list[int]] = [[] for _ in range(b)]
        reasons: list[str | None] = [None] * b
        overshoot = [0] * b
        scanners = [StopScanner(self.decode_text, st) for st in stops]
        done = jnp.zeros((b,), bool)
        remaining = jnp.asarray(limits, jnp.int32)
        stop_ids = self._stop_id_array(stops)
        base = jax.random.key(sampling.seed)
        keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.asarray(row_ids, jnp.int32))
        steps = 0
        if first is not None:
            gens[0] = [first]
            k = scanners[0].feed([first])
            steps = 1
            if k is not None:
                reasons[0] = "stop"
            elif first in self.eos_token_ids:
                reasons[0] = "eos"
            elif limits[0] <= 1:
                reasons[0] = "length"
            remaining = remaining - 1
        while any(x is None for x in reasons):
            (cache, lengths, pending, done_dev, remaining, out, reason, n) = _decode_fn(
                self.params, self.config, cache, lengths, pending, done, remaining, stop_ids, keys,
                jnp.int32(steps), jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
                jnp.float32(sampling.top_p), prefix, branched=branched, chunk=self.decode_chunk,
                greedy=sampling.greedy, attention_impl=self.attention_impl, n_valid=self.n_valid,
                pos_offset=jnp.int32(pos_offset))
            out_h, reason_h, done_h = jax.device_get((out, reason, done_dev))
            steps += int(n)
            host_done = np.array(done_h)
            for r in range(b):
                if reasons[r] is not None:
                    continue
                new = [int(t) for t in out_h[r] if t >= 0]
                gens[r].extend(new)
                k = scanners[r].feed(new)
                if k is not None:
                    overshoot[r] = len(gens[r]) - k
                    gens[r] = gens[r][:k]
                    reasons[r] = "stop"
                    host_done[r] = True
                elif done_h[r]:
                    last = gens[r][-1] if gens[r] else None
                    if reason_h[r] == 1:
                        reasons[r] = "eos" if last in self.eos_token_ids else "stop"
                    else:
                        reasons[r] = "length"
            if all(x is not None for x in reasons):
                break
            done = jnp.asarray(host_done)
        out_gens = [Generation(tokens=g, text=self.decode_text(g), stop_reason=reasons[r], overshoot=overshoot[r],
                               steps=steps) for r, g in enumerate(gens)]
        return cache, out_gens, steps

    # ---- generate -------------------------------------------------------------------------
    def generate(self, state: DecodeState, max_new_tokens: int, stop: Sequence[str] = (),
                 sampling: Sampling | None = None) -> Generation:
        """Decode one sequence from `state` until EOS, a stop string, or max_new_tokens.

        The returned Generation carries the updated state (also updated in place): it holds the
        generated tokens up to the stop; anything decoded past it is discarded (overshoot).
        """
        sampling = sampling or GREEDY
        if max_new_tokens <= 0:
            raise EngineError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(state.tokens) + max_new_tokens > self.max_seq_len:
            raise EngineError(f"{len(state.tokens)} tokens + max_new_tokens={max_new_tokens} exceeds "
                              f"max_seq_len={self.max_seq_len}")
        first = None
        if state.after_join:
            # after a merge join: step 0 samples from the logits the last branch token had in its
            # branch (the key that step would use), then decoding continues from that token
            first = _sample_first(mask_padded(state.join_logits, self.n_valid), sampling)   # no padded ids
            state.tokens = state.tokens + [first]
        cache, gens, _ = self._run_decode(
            state.cache, jnp.asarray([state.length], jnp.int32), jnp.asarray([state.pending], jnp.int32),
            [max_new_tokens], [list(stop)], sampling, None, False, [0], state.pos_offset, first)
        g = gens[0]
        state.cache = cache
        state.tokens = state.tokens + (g.tokens[1:] if first is not None else g.tokens)
        g.state = state
        return g

    # ---- branches -------------------------------------------------------------------------
    def decode_branches(self, state: DecodeState, prefixes: Sequence[Sequence[int]],
                        max_new_tokens: int | Sequence[int], stop: Sequence[Sequence[str]] | Sequence[str] = (),
                        sampling: Sampling | None = None, mode: str = "shared") -> list[Generation]:
        """Fork `state` into len(prefixes) branches, force each branch's prefix tokens, decode all.

        Branch j continues state's sequence with prefixes[j] (e.g. the tokens of
        `<execution_2.j>`) and then decodes until its own stop strings / EOS / token limit.
        Returns one Generation per branch (generated tokens only). `state` keeps its content.
        """
        sampling = sampling or GREEDY
        n = len(prefixes)
        if mode not in ("shared", "copy", "serial"):
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
            if mode != "shared" and len(state.tokens) + len(p) + m > self.max_seq_len:
                raise EngineError(f"branch {j}: context + prefix + max_new_tokens exceeds max_seq_len="
                                  f"{self.max_seq_len}")
        t0 = time.perf_counter()
        self._fork = None
        if mode == "serial":
            gens, nbytes, steps = self._branches_serial(state, prefixes, limits, stops, sampling)
        else:
            gens, nbytes, steps = self._branches_batched(state, prefixes, limits, stops, sampling, mode)
            self._fork.tokens = [list(f) + g.tokens for f, g in zip(self._fork.tokens, gens)]
        self.last_branch_stats = BranchStats(mode, n, nbytes, steps, time.perf_counter() - t0)
        return gens

    # ---- merge join (issue 17) -----------------------------------------------------------
    def merge(self, state: DecodeState, branches: Sequence[Sequence[int]]) -> DecodeState:
        """Join the branches of the shared / copy fork just decoded from `state` into it without
        re-running them: branches[j] is branch j's final tokens after the fork (its forced opening,
        body and any repair, as the layout tokenizes them). Each branch first runs, in its own
        branch, only the tokens it never computed (its last token, a repair close tag, a re-tokenized
        end); then its KV rows are copied after the planner's prefix in branch order. Every branch
        keeps the positions it had (all start at the fork), so the state continues at fork + the
        longest branch: `pos_offset` takes the difference. The last branch's last token is in the
        cache with its in-branch logits (`join_logits`): the next token is sampled from them, as
        the one-sequence merge layout predicts it (train/data.py)."""
        f = self._fork
        if f is None or f.state is not state or f.n_tokens != len(state.tokens):
            raise EngineError("merge needs the shared or copy fork just decoded from this state "
                              "(decode_branches), with the state unchanged since")
        n = len(f.tokens)
        branches = check_merge_branches(branches, n, len(state.tokens), self.max_seq_len)
        keep = [min(common_prefix(have[1:], b), done - 1, len(b) - 1)
                for b, have, done in zip(branches, f.tokens, f.computed)]
        tails = [b[k:] for b, k in zip(branches, keep)]
        cache, last, pos = f.cache, None, 0
        while pos < max(len(t) for t in tails):
            pieces = [t[pos: pos + self.prefill_chunk] for t in tails]
            toks = np.zeros((n, _bucket(max(len(p) for p in pieces), lo=4)), np.int32)
            for j, p in enumerate(pieces):
                toks[j, : len(p)] = p
            start = np.asarray([f.start + 1 + k + pos for k in keep], np.int32)
            if int(start.max()) + toks.shape[1] > f.cache.k.shape[2]:   # a write would be clamped
                raise EngineError(f"merge: a branch of {max(len(b) for b in branches)} tokens does not fit its "
                                  f"branch cache (max_branch_tokens={self.max_branch_tokens})")
            cache, logits = _extend_fn(self.params, self.config, jnp.asarray(toks), cache, jnp.asarray(start),
                                       jnp.asarray([max(len(p), 1) for p in pieces], jnp.int32), f.prefix,
                                       branched=f.prefix is not None, attention_impl=self.attention_impl,
                                       pos_offset=jnp.int32(state.pos_offset))
            if pieces[-1]:
                last = logits[n - 1]
            pos += self.prefill_chunk
        rows = [0] + [j for j, b in enumerate(branches) for _ in b]
        slots = [f.start] + [f.start + 1 + s for b in branches for s in range(len(b))]
        m = _bucket(len(rows), lo=16)
        pad = m - len(rows)
        dst = np.arange(m, dtype=np.int32) + f.p0
        dst[len(rows):] = np.iinfo(np.int32).max
        state.cache = _place_rows(state.cache, cache, jnp.asarray(rows + [0] * pad, jnp.int32),
                                  jnp.asarray(slots + [0] * pad, jnp.int32), jnp.asarray(dst))
        longest, placed = max(len(b) for b in branches), sum(len(b) for b in branches)
        state.tokens = state.tokens + [t for b in branches for t in b]
        state.pos_offset += longest - placed
        state.joined = len(state.tokens)
        state.join_logits = last
        self._fork = None
        self.last_join_tokens = sum(len(t) for t in tails)
        return state

    def fork_logits(self, state: DecodeState, branches: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher forcing over a fork: branch j continues `state` with branches[j] (all forced, in a
        shared-prefix fork like decode_branches'); returns per branch the logits [len(branches[j]),
        V] that predict each of its tokens (row 0: the planner's pending token, run in the branch).
        The fork is kept for `merge` (each branch's last token is left for the join to run), so a
        trajectory can be checked token by token through fork, branches and merge."""
        if state.after_join:
            raise EngineError("fork right after a merge join: the planner must write a token first")
        branches = [[int(t) for t in b] for b in branches]
        n = len(branches)
        if not 1 <= n <= self.max_branches or any(not b for b in branches):
            raise EngineError(f"fork_logits needs 1..{self.max_branches} non-empty branches")
        if any(len(b) + 1 > self.max_branch_tokens for b in branches):
            raise EngineError(f"a branch exceeds max_branch_tokens={self.max_branch_tokens}")
        p0 = state.length
        pk, pv = _slice_prefix(state.cache, min(_bucket(max(p0, 1)), self._seq_cap))
        prefix = (pk, pv, jnp.int32(p0))
        runs = [[state.pending] + b[:-1] for b in branches]
        toks = np.zeros((n, _bucket(max(len(r) for r in runs), lo=4)), np.int32)
        for j, r in enumerate(runs):
            toks[j, : len(r)] = r
        cache, logits = _extend_fn(self.params, self.config, jnp.asarray(toks),
                                   KVCache.zeros(self.config, n, self._suffix_cap), jnp.zeros(n, jnp.int32),
                                   jnp.asarray([len(r) for r in runs], jnp.int32), prefix, branched=True,
                                   attention_impl=self.attention_impl, pos_offset=jnp.int32(state.pos_offset),
                                   all_logits=True)
        self._fork = _Fork(state, len(state.tokens), p0, [[state.pending] + b for b in branches],
                           [len(r) for r in runs], cache, prefix, 0)
        logits = np.asarray(logits)
        return [logits[j, : len(r)] for j, r in enumerate(runs)]

    def _branches_serial(self, state, prefixes, limits, stops, sampling):
        gens, steps = [], 0
        base_tokens = list(state.tokens)
        for j, (p, m, st) in enumerate(zip(prefixes, limits, stops)):
            # Branch j runs on the planner's own cache: it writes only past the shared context,
            # which stays valid; the handle is then reset to the context.
            self.extend(state, p)
            cache, (g,), s = self._run_decode(
                state.cache, jnp.asarray([state.length], jnp.int32), jnp.asarray([state.pending], jnp.int32),
                [m], [st], sampling, None, False, [j], state.pos_offset)
            state.cache = cache
            state.tokens = list(base_tokens)
            gens.append(g)
            steps += s
        return gens, state.cache.nbytes, steps

    def _branches_batched(self, state, prefixes, limits, stops, sampling, mode):
        n = len(prefixes)
        p0 = state.length
        pb = min(_bucket(max(p0, 1)), self._seq_cap)
        pk, pv = _slice_prefix(state.cache, pb)
        # every branch first runs [pending] + its prefix[:-1]; its last prefix token is pending
        runs = [[state.pending] + p[:-1] for p in prefixes]
        pend = [p[-1] if p else state.pending for p in prefixes]
        runs = [r if p else [] for r, p in zip(runs, prefixes)]
        if mode == "shared":
            cache = KVCache.zeros(self.config, n, self._suffix_cap)
            prefix = (pk, pv, jnp.int32(p0))
            start0 = np.zeros(n, np.int32)
            nbytes = cache.nbytes + int(pk.size * pk.dtype.itemsize * 2)
            branched = True
        else:
            cache = _copy_fork(pk, pv, n, self._suffix_cap)
            prefix = None
            start0 = np.full(n, p0, np.int32)
            nbytes = cache.nbytes
            branched = False
        del pk, pv  # the shared path holds them through `prefix`
        tmax = max(len(r) for r in runs)
        if tmax:
            tb = _bucket(tmax, lo=4)  # forced prefixes are a few tokens: pad them to 4, not 16
            toks = np.zeros((n, tb), np.int32)
            for j, r in enumerate(runs):
                toks[j, : len(r)] = r
            cache, _ = _extend_fn(self.params, self.config, jnp.asarray(toks), cache, jnp.asarray(start0),
                                  jnp.asarray([max(len(r), 1) for r in runs], jnp.int32), prefix,
                                  branched=branched, attention_impl=self.attention_impl,
                                  pos_offset=jnp.int32(state.pos_offset))
        lengths = jnp.asarray(start0 + np.array([len(r) for r in runs], np.int32))
        cache, gens, steps = self._run_decode(cache, lengths, jnp.asarray(pend, jnp.int32), limits, stops,
                                              sampling, prefix, branched, list(range(n)), state.pos_offset)
        # kept for a merge join (the branch caches are dropped by the next fork)
        self._fork = _Fork(state, len(state.tokens), p0, [[state.pending] + p for p in prefixes],
                           [len(r) + len(g.tokens) for r, g in zip(runs, gens)], cache, prefix, int(start0[0]))
        return gens, nbytes, steps
