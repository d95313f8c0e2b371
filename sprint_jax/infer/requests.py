"""What the engine's callers hold: sequences (`Seq`), operations on them (`Op`), their results
(`Generation`), the engine's one error type, and the host-side helpers every driver shares.

A `Seq` is a parent sequence (a planner, a prompt) in one parent slot: its tokens, the last one
pending (not yet run through the model). An `Op` is one request on a sequence (open, extend,
generate, fork, close), done when a later engine step (or the submission itself) finished it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from typing import Sequence

import jax
import numpy as np

from sprint_jax.infer.sampling import GREEDY, Sampling, SamplingError, mask_padded, sample_tokens
from sprint_jax.infer.stops import StopScanner


class EngineError(ValueError):
    """A request the engine cannot serve (capacity, empty input, a busy or closed sequence): the
    message says which limit."""


@dataclasses.dataclass
class Generation:
    tokens: list[int]                 # generated tokens only, up to and including the stop
    text: str
    stop_reason: str                  # "stop" | "eos" | "length"
    overshoot: int = 0                # tokens decoded past a stop within a chunk and discarded
    steps: int = 0                    # decode steps that ran for this row (its tokens + overshoot)


class Seq:
    """A parent sequence (a planner or a prompt): its tokens, the last one pending (not yet run)."""
    _ids = itertools.count()

    def __init__(self, tokens: list[int]):
        self.id = next(Seq._ids)
        self.tokens = tokens
        self.slot: int | None = None
        self.op: "Op | None" = None       # the operation in flight (one at a time)
        self.closed = False
        # merge join: slot s sits at position s + pos_offset (a join places k branches side by
        # side in the slot but continues at fork + the longest); the first `joined` tokens are
        # fixed (no rollback into them); right after a join the last token is already in the slot
        # (computed in its branch) and join_logits are its logits. last_fork: the last fork's
        # children, [(tokens from the parent's pending token on, slots computed)], for merge.
        self.pos_offset = 0
        self.joined = 0
        self.join_logits = None
        self.last_fork: tuple[int, list] | None = None

    @property
    def length(self) -> int:              # the slot of the last token (pending unless after_join)
        return len(self.tokens) - 1

    @property
    def after_join(self) -> bool:
        return self.join_logits is not None and len(self.tokens) == self.joined


@dataclasses.dataclass
class Op:
    """An operation on a sequence. `result`: Generation (generate), list[Generation] (fork),
    the Seq (open, extend, close)."""
    kind: str                             # open | extend | generate | fork | close
    seq: Seq
    tokens: list[int] = dataclasses.field(default_factory=list)          # open / extend
    prefixes: list[list[int]] = dataclasses.field(default_factory=list)  # fork
    limits: list[int] = dataclasses.field(default_factory=list)
    stops: list[list[str]] = dataclasses.field(default_factory=list)
    sampling: Sampling = GREEDY
    done: bool = False
    result: object = None
    tag: object = None                    # the caller's (e.g. which run this op belongs to)
    queued: list = dataclasses.field(default_factory=list)   # a serial fork's children not yet started
    join: bool = False                    # fork: its children will be merged (they feed their last token)


class Row:
    """A decoding stream: the parent of a generate op (g = 0) or child g >= 1 of a fork."""

    def __init__(self, op: Op, j: int, run: list[int], limit: int, stops: list[str], scanner: StopScanner):
        self.op, self.j = op, j
        self.key_branch = j               # the sampling key stream (fold_in(key(seed), key_branch))
        self.run = run                    # child: [parent pending] + prefix (+ generated); parent: unused
        self.limit = limit
        self.stops = stops
        self.scanner = scanner
        self.gen: list[int] = []
        self.reason: str | None = None
        self.overshoot = 0
        self.prefill_pos = 0              # child: how much of run[:-1] is in its suffix slot
        self.fed = False                  # its last token was run (a join fork's child: decode's feed_last)
        self.last_logits = None           # then its logits after that token (device, [V]), if kept


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


@functools.partial(jax.jit, static_argnames=("n_valid",))
def _sample_first_fn(logits, seed, temperature, top_k, top_p, n_valid: int | None):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), 0)   # row 0, step 0
    return sample_tokens(mask_padded(logits, n_valid)[None], key[None], temperature, top_k, top_p, False)[0]


def sample_first(logits, sampling: Sampling, n_valid: int | None = None) -> int:
    """The token a one-row decode would sample at step 0 from `logits` [V] (same key stream), never
    a padded id (>= n_valid). Greedy: the argmax of the logits brought to the host (one small
    transfer, no device op: this runs on the latency path, once per merge join); else one jitted
    call with host scalars."""
    if sampling.greedy:
        host = np.asarray(logits, np.float32)
        return int(np.argmax(host[:n_valid] if n_valid is not None else host))
    return int(_sample_first_fn(logits, np.int32(sampling.seed), np.float32(sampling.temperature),
                                np.int32(sampling.top_k), np.float32(sampling.top_p), n_valid=n_valid))
