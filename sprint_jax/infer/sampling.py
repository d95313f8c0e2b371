"""Token sampling: greedy, temperature, top-k, top-p, with a PRNG stream per row.

Each row's key is fold_in(fold_in(key(seed), row), step): executor branches of one stage never
share a random stream, and the same seed reproduces the same outputs.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.errors import UserError


# the ranges the decode step's per-row int32 / float32 arrays hold
SEED_RANGE = (-2 ** 31, 2 ** 31 - 1)
# the seeds a user may give a run or a request: each one a sampling stream of its own on every path
# (a row's key folds in a Sampling seed as is; a SPRINT run derives each call's seed from its seed
# modulo 2^31, one-to-one on this range only: s and s + 2^31, or -1 and 2^31 - 1, would share draws)
USER_SEED_RANGE = (0, 2 ** 31 - 1)
TOP_K_MAX = 2 ** 31 - 1
TEMPERATURE_MAX = float(np.finfo(np.float32).max)


class SamplingError(UserError, ValueError):
    """A sampling value out of its range: a user mistake (one line, exit 2 on the command line),
    and a ValueError for callers that validate configs."""


def _integer(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise SamplingError(f"{name} must be an integer, got {v!r}")
    if int(v) < lo:
        raise SamplingError(f"{name} must be >= {lo}, got {v}")
    if int(v) > hi:
        raise SamplingError(f"{name} must be at most {hi}, got {v}")
    return int(v)


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise SamplingError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def user_seed(v, name: str = "seed") -> int:
    """A seed given by a user (a config, a request) as an int in USER_SEED_RANGE; SamplingError
    naming `name` otherwise."""
    return _integer(name, v, *USER_SEED_RANGE)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling values of one request, checked at construction (SamplingError names the field):
    temperature finite in [0, float32 max], top_k an integer in [0, 2^31 - 1] (values past the
    vocabulary keep every token), top_p in (0, 1], seed an integer in the int32 range."""
    temperature: float = 0.0   # 0 = greedy (argmax)
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int = 0

    def __post_init__(self):
        t = _real("temperature", self.temperature)
        if t < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if t > TEMPERATURE_MAX:
            raise SamplingError(f"temperature must be at most {TEMPERATURE_MAX:.4g}, got {self.temperature}")
        p = _real("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k, 0, TOP_K_MAX)
        _integer("seed", self.seed, *SEED_RANGE)

    def checked(self) -> "Sampling":
        """The same values, checked again (an engine's guard against an instance whose fields were
        changed after construction)."""
        return Sampling(self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def valid_vocab(tokenizer, vocab_size: int) -> int | None:
    """How many leading ids the tokenizer knows, when the model's vocabulary is padded past it
    (e.g. to a multiple of 8); None when nothing is padded (or the tokenizer has no length)."""
    try:
        n = len(tokenizer)
    except TypeError:
        return None
    return n if 0 < n < vocab_size else None


def mask_padded(logits: jax.Array, n_valid: int | None) -> jax.Array:
    """Logits [..., V] with the padded ids (>= n_valid) at -inf, so neither argmax nor sampling can
    pick an id the tokenizer cannot decode. n_valid None: unchanged."""
    if n_valid is None or n_valid >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < n_valid, logits, -jnp.inf)


TOP_LOGPROBS = 20       # alternatives per token a decode reports when asked (the OpenAI API's most)


def filtered_logits(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """The logits a sampled row draws from, [B, V] fp32: logits / temperature with every id outside
    top-k and outside the top-p nucleus at -inf (top_k 0 and top_p 1 keep every id)."""
    v = logits.shape[-1]
    logits = logits / jnp.maximum(temperature, 1e-6)
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]                       # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_logits, jnp.full((logits.shape[0], 1), k - 1), axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # smallest prefix of the sorted vocabulary whose mass reaches top_p (always keeps the top token)
    cutoff_idx = jnp.sum(cum - probs < top_p, axis=-1, keepdims=True) - 1
    pth = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
    threshold = jnp.maximum(kth, pth)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_tokens(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p, greedy: bool) -> jax.Array:
    """logits [B, V] fp32, keys [B] -> tokens [B] int32. temperature/top_k/top_p are traced scalars."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    masked = filtered_logits(logits, temperature, top_k, top_p)
    return jax.vmap(lambda kk, lg: jax.random.categorical(kk, lg))(keys, masked).astype(jnp.int32)


def advance_rows(tok, active, stop_ids, remaining, reason, lengths, pending):
    """One decode step's bookkeeping, shared by both engines' on-device loops: the sampled token of
    each active row (-1 for inactive rows), whether it finished the row (a stop id, or its token
    budget used up), and the updated remaining budgets, stop reasons (1 stop, 2 length), lengths
    and pending tokens. Returns (tok, finished, remaining, reason, lengths, pending)."""
    tok = jnp.where(active, tok, -1)
    hit_stop = active & jnp.any(tok[:, None] == stop_ids, axis=-1)
    remaining = remaining - active.astype(jnp.int32)
    hit_len = active & ~hit_stop & (remaining <= 0)
    reason = jnp.where(hit_stop, 1, jnp.where(hit_len, 2, reason))
    lengths = jnp.where(active, lengths + 1, lengths)
    pending = jnp.where(active, tok, pending)
    return tok, hit_stop | hit_len, remaining, reason, lengths, pending
