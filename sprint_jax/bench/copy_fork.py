"""The copy-fork baseline: every branch decodes on its own copy of the planner's prefix KV.

Used ONLY as a reference point, never to serve: `decode_branches_copy` is the `copy` row of
`sprint-jax bench decode` (the baseline the engine's shared prefix is measured against, paper
§10), and `_decode_fn` the counterexample of tests/test_batch_engine.py's HLO test. It is the
pre-slot single-run path kept in its plainest form: the prefix [L, P, Hkv, D] is copied into a
fresh [L, n, P + S, Hkv, D] cache, the branches' forced prefixes are prefilled onto it, and the
layer scan carries the whole cache through each decode step, attending over the capacity (the
prototype of the batched engine, measured at 0.64-0.82x). Serving (`shared` and `serial` forks,
everything else) runs on the engine (`sprint_jax.infer.engine`).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.requests import EngineError, Generation, checked_sampling
from sprint_jax.infer.sampling import advance_rows, mask_padded, sample_tokens
from sprint_jax.infer.single import BranchStats, SingleRun
from sprint_jax.infer.buckets import bucket
from sprint_jax.infer.stops import StopScanner
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import attend_partial, decoder, dtype_of, embed, flash_attention, unembed


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


def _write_rows(cache_layer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache_layer [B, C, Hkv, D] <- new [B, T, Hkv, D] at per-row offsets start [B]."""
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (s, 0, 0)))(
        cache_layer, new, start)


def _cached_hidden(params, config: Qwen2Config, tokens, cache: KVCache, start, pos_offset=0):
    """Run tokens [B, T] written at per-row cache offsets start [B] (positions start + t +
    pos_offset); attention over the row's whole cache. Returns hidden [B, T, E], cache."""
    b, t = tokens.shape
    cap = cache.k.shape[2]
    offs = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]             # [B, T] slot index
    mask = jnp.arange(cap, dtype=jnp.int32)[None, None, :] <= offs[:, :, None]  # [B, T, C]

    def attend(q, k, v, layer):
        ck, cv = layer
        ck = _write_rows(ck, k, start)
        cv = _write_rows(cv, v, start)
        if t > 1:
            out = flash_attention(q, ck, cv, jnp.full((b, cap), cap + t, jnp.int32), q_offset=start)
        else:
            out = attend_partial(q, ck, cv, mask)[0]
        return out, (ck, cv)

    x = embed(params, config, tokens)
    x, new = decoder(params, config, x, offs + pos_offset, attend, (cache.k, cache.v))
    return x, KVCache(new[0], new[1])


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def _extend_fn(params, config, tokens, cache, start, pos_offset=0):
    return _cached_hidden(params, config, tokens, cache, start, pos_offset)[1]


@functools.partial(jax.jit, static_argnames=("config", "chunk", "greedy", "n_valid"), donate_argnames=("cache",))
def _decode_fn(params, config, cache, lengths, pending, done, remaining, stop_ids, keys, step0,
               temperature, top_k, top_p, chunk: int, greedy: bool, n_valid: int | None = None, pos_offset=0):
    """Up to `chunk` decode steps on device (the cache rides in the loop carry, as the baseline
    did). Returns the cache, lengths, pending, done, remaining, the emitted tokens [B, chunk]
    (-1 = none), reason codes (0 running, 1 stop id, 2 length) and the steps run."""
    b = pending.shape[0]
    out = jnp.full((b, chunk), -1, jnp.int32)
    reason = jnp.zeros((b,), jnp.int32)

    def cond(c):
        return (c[0] < chunk) & ~jnp.all(c[4])

    def body(c):
        i, cache, lengths, pending, done, remaining, out, reason = c
        hidden, cache = _cached_hidden(params, config, pending[:, None], cache, lengths, pos_offset)
        logits = mask_padded(unembed(params, config, hidden)[:, 0], n_valid)
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step0 + i))(keys)
        tok = sample_tokens(logits, step_keys, temperature, top_k, top_p, greedy)
        tok, finished, remaining, reason, lengths, pending = advance_rows(
            tok, ~done, stop_ids, remaining, reason, lengths, pending)
        return i + 1, cache, lengths, pending, done | finished, remaining, out.at[:, i].set(tok), reason

    init = (jnp.int32(0), cache, lengths, pending, done, remaining, out, reason)
    i, cache, lengths, pending, done, remaining, out, reason = jax.lax.while_loop(cond, body, init)
    return cache, lengths, pending, done, remaining, out, reason, i


@functools.partial(jax.jit, static_argnames=("n", "suffix_cap"))
def _copy_fork(pk, pv, n: int, suffix_cap: int) -> KVCache:
    """Every branch gets its own copy of the prefix pk, pv [L, P, Hkv, D] + a suffix region."""
    def rep(a):
        pad = jnp.zeros(a.shape[:1] + (suffix_cap,) + a.shape[2:], a.dtype)
        full = jnp.concatenate([a, pad], axis=1)                             # [L, P+S, Hkv, D]
        return jnp.broadcast_to(full[:, None], (full.shape[0], n) + full.shape[1:])
    return KVCache(rep(pk), rep(pv))


def _copy_fork_branches(engine, pk, pv, p0: int, pending: int, prefixes: list[list[int]], limits: list[int],
                       stops: list[list[str]], sampling, pos_offset: int, suffix_cap: int, prefill_chunk: int):
    """Decode branches on copies of the prefix (pk, pv: the planner's first slots, p0 used; its
    pending token not yet run). Branch j runs [pending] + prefixes[j] forced, then decodes with
    key stream j (the engine's). `engine`: the `Engine` (params, config, stop ids, text).
    Returns (Generations, bytes of the copied cache, decode steps)."""
    n = len(prefixes)
    cache = _copy_fork(pk, pv, n, suffix_cap)
    nbytes = cache.nbytes
    runs = [[pending] + p[:-1] if p else [] for p in prefixes]
    pend = [p[-1] if p else pending for p in prefixes]
    for pos in range(0, max(len(r) for r in runs), prefill_chunk):
        pieces = [r[pos: pos + prefill_chunk] for r in runs]
        # padding past a row's piece lands in slots it has not used yet; never past the capacity
        # (a clamped write would move the whole piece)
        width = min(bucket(max(len(p) for p in pieces), 4), cache.k.shape[2] - p0 - pos)
        toks = np.zeros((n, width), np.int32)
        for j, p in enumerate(pieces):
            toks[j, : len(p)] = p
        cache = _extend_fn(engine.params, engine.config, jnp.asarray(toks), cache,
                           jnp.full(n, p0 + pos, jnp.int32), jnp.int32(pos_offset))
    lengths = jnp.asarray([p0 + len(r) for r in runs], jnp.int32)
    gens: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    overshoot = [0] * n
    scanners = [StopScanner(engine.decode_text, st) for st in stops]
    done = jnp.zeros((n,), bool)
    remaining = jnp.asarray(limits, jnp.int32)
    stop_ids = jnp.asarray(np.stack([engine.stop_ids(list(st)) for st in stops]))
    base = jax.random.key(sampling.seed)
    keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(n, dtype=jnp.int32))
    pending_a = jnp.asarray(pend, jnp.int32)
    steps = 0
    while any(x is None for x in reasons):
        cache, lengths, pending_a, done_dev, remaining, out, reason, k = _decode_fn(
            engine.params, engine.config, cache, lengths, pending_a, done, remaining, stop_ids, keys,
            jnp.int32(steps), jnp.float32(sampling.temperature), jnp.int32(sampling.top_k),
            jnp.float32(sampling.top_p), chunk=engine.decode_chunk, greedy=sampling.greedy,
            n_valid=engine.n_valid, pos_offset=jnp.int32(pos_offset))
        out_h, reason_h, done_h = jax.device_get((out, reason, done_dev))
        steps += int(k)
        host_done = np.array(done_h)
        for r in range(n):
            if reasons[r] is not None:
                continue
            new = [int(t) for t in out_h[r] if t >= 0]
            gens[r].extend(new)
            cut = scanners[r].feed(new)
            if cut is not None:
                overshoot[r] = len(gens[r]) - cut
                gens[r] = gens[r][:cut]
                reasons[r] = "stop"
                host_done[r] = True
            elif done_h[r]:
                if reason_h[r] == 1:
                    reasons[r] = "eos" if gens[r] and gens[r][-1] in engine.eos_token_ids else "stop"
                else:
                    reasons[r] = "length"
        done = jnp.asarray(host_done)
    out_gens = [Generation(tokens=g, text=engine.decode_text(g), stop_reason=reasons[r], overshoot=overshoot[r],
                           steps=steps) for r, g in enumerate(gens)]
    return out_gens, nbytes, steps


def decode_branches_copy(run: SingleRun, seq, prefixes: Sequence[Sequence[int]], max_new_tokens: int,
                         sampling=None) -> list[Generation]:
    """`run.decode_branches(seq, prefixes, max_new_tokens)` on the copy-fork baseline: the
    planner's used slots (as a shared fork reads them) copied into every branch, no stop strings.
    Sets `run.last_branch_stats` (mode "copy")."""
    engine = run.engine
    sampling = checked_sampling(sampling)
    prefixes = [[int(t) for t in p] for p in prefixes]
    n = len(prefixes)
    if not 1 <= n <= engine.max_children:
        raise EngineError(f"{n} branches: 1..{engine.max_children}")
    for p in prefixes:
        if len(p) + 1 + max_new_tokens > engine.max_branch_tokens or \
                len(seq.tokens) + len(p) + max_new_tokens > engine.max_seq_len:
            raise EngineError("a branch exceeds max_branch_tokens or max_seq_len")
    t0 = time.perf_counter()
    engine.flush(seq)
    p0 = seq.length
    pb = min(bucket(max(p0, 1), engine.min_bucket), engine.parent_capacity)    # as a shared fork reads it
    # the sequence's pages read out of the pool, [L, Hkv, pb, D], as the baseline's [L, pb, Hkv, D]
    pages = -(-pb // engine.page_size)
    table = np.asarray((engine.page_ids(seq) + [0] * pages)[:pages])
    pk, pv = (jnp.swapaxes(a[:, :, table].reshape(a.shape[:2] + (-1, a.shape[-1]))[:, :, :pb], 1, 2)
              for a in (engine.cache.k, engine.cache.v))
    gens, nbytes, steps = _copy_fork_branches(engine, pk, pv, p0, seq.tokens[-1], prefixes, [max_new_tokens] * n,
                                              [[] for _ in range(n)], sampling, seq.pos_offset,
                                              engine.child_capacity, engine.prefill_chunk)
    run.last_branch_stats = BranchStats("copy", n, nbytes, steps, time.perf_counter() - t0)
    return gens
