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
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.sampling import GREEDY, Sampling, SamplingError, filtered_logits, mask_padded
from sprint_jax.infer.stops import StopScanner


class EngineError(ValueError):
    """A request the engine cannot serve (capacity, empty input, a busy or closed sequence): the
    message says which limit."""


class NoProgress(EngineError):
    """No step can move: the KV pool or the sequence slots are held by what waits on them (a pool
    or slot count the queued work cannot share)."""


@dataclasses.dataclass
class Generation:
    tokens: list[int]                 # generated tokens only, up to and including the stop
    text: str
    stop_reason: str                  # "stop" | "eos" | "length"
    overshoot: int = 0                # tokens decoded past a stop within a chunk and discarded
    steps: int = 0                    # decode steps that ran for this row (its tokens + overshoot)
    # per token, fp32: log p(token) under the distribution it was drawn from (logits / temperature
    # after top-k / top-p; greedy: the model's own at temperature 1), computed in the decode program
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # per token, when the request asked (Op.top_logprobs = n): the n most likely (id, log-prob) of
    # that distribution, most likely first (ids it cannot draw left out)
    top_logprobs: list[list[tuple[int, float]]] | None = None


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
        # record (its children's tokens and what their slots hold), for merge.
        self.pos_offset = 0
        self.joined = 0
        self.join_logits = None
        self.last_fork: ForkRecord | None = None
        self.trace: DecodeTrace | None = None   # how its tokens were computed (Engine(trace=True))
        # its place in the page pool (`pages.SeqPages`, from admission to close), the pool shard
        # of its slot, and how many leading tokens' K/V a plain prefill would give (a merge join
        # places branches side by side: none past the first fork that was merged is cached)
        self.pages = None
        self.part = 0
        self.cache_len = 1 << 62
        self.cache_epoch = 0
        self.admitted = 0                 # admission order (the youngest run is preempted first)

    @property
    def length(self) -> int:              # the slot of the last token (pending unless after_join)
        return len(self.tokens) - 1

    @property
    def after_join(self) -> bool:
        return self.join_logits is not None and len(self.tokens) == self.joined


@dataclasses.dataclass
class _TraceFork:
    """The fork a `DecodeTrace` follows: the parent's pending node, the children's stage tag,
    whether it will be merged, and each child's nodes (None until it finished)."""
    pending: int
    stage: int
    join: bool
    kids: list


class DecodeTrace:
    """How a sequence's tokens were computed, as the engine ran them (kept when the engine is built
    with `trace=True`; RL lays its loss out from it). One node per token that was run or sampled:
    its id, position, `stage` / `branch` tags, `pred` (the node whose logits predicted it, -1
    none), `up` (its parent in a tree whose ancestors hold everything it may see) and its log-prob
    (None: forced, not sampled). Row i sees node j iff j is an ancestor of i and `merge_visible`
    holds (j is branch 0, of an earlier stage, or of i's own (stage, branch)). Planner text after m
    merge joins has stage 2m; the children of a fork are chains under the parent's pending token
    (a fork that is merged: stage 2m + 1, branch j + 1, else the planner's tags). A merge join
    re-hangs branch j under branch j - 1's last token, so the planner after it descends from every
    branch while the tags keep siblings apart: exactly what the join's KV and positions give.
    `exact` turns False after a call the trace does not follow (teacher forcing of a fork)."""

    def __init__(self):
        self.token: list[int] = []
        self.pos: list[int] = []
        self.stage: list[int] = []
        self.branch: list[int] = []
        self.pred: list[int] = []
        self.up: list[int] = []
        self.logprob: list[float | None] = []
        self.planner: list[int] = []          # the nodes of the sequence's tokens, in slot order
        self.merges = 0
        self.exact = True
        self._fork: _TraceFork | None = None

    def __len__(self) -> int:
        return len(self.token)

    def _node(self, token: int, pos: int, stage: int, branch: int, pred: int, up: int, lp=None) -> int:
        for a, v in ((self.token, int(token)), (self.pos, int(pos)), (self.stage, stage), (self.branch, branch),
                     (self.pred, pred), (self.up, up), (self.logprob, lp)):
            a.append(v)
        return len(self.token) - 1

    def sync(self, seq: "Seq", logprobs: Sequence[float] = ()) -> None:
        """Follow the sequence's tokens: drop nodes past their common prefix (a truncate), add one
        per new token at slot s (position s + pos_offset); the last len(logprobs) were sampled."""
        toks = seq.tokens
        n = common_prefix([self.token[x] for x in self.planner], toks)
        del self.planner[n:]
        m = len(toks) - n
        sampled = [float(x) for x in logprobs][-m:] if m else []
        lps = [None] * (m - len(sampled)) + sampled
        for s in range(n, len(toks)):
            prev = self.planner[-1] if self.planner else -1
            self.planner.append(self._node(toks[s], s + seq.pos_offset, 2 * self.merges, 0, prev, prev,
                                           lps[s - n]))

    def fork(self, seq: "Seq", n: int, join: bool) -> None:
        self.sync(seq)
        stage = 2 * self.merges + 1 if join else 2 * self.merges
        self._fork = _TraceFork(self.planner[-1], stage, join, [None] * n)

    def child(self, j: int, tokens: Sequence[int], generated: int, logprobs: Sequence[float]) -> None:
        """Child j's tokens after the parent's pending one (forced prefix, then `generated` sampled)."""
        if self._fork is None:
            self.exact = False
            return
        f = self._fork
        pending, stage, join, kids = f.pending, f.stage, f.join, f.kids
        lps = [None] * (len(tokens) - generated) + [float(x) for x in logprobs]
        prev, nodes = pending, []
        for k, t in enumerate(tokens):
            prev = self._node(t, self.pos[pending] + 1 + k, stage, j + 1 if join else 0, prev, prev, lps[k])
            nodes.append(prev)
        kids[j] = nodes

    def merged(self, branches: Sequence[Sequence[int]]) -> None:
        """The fork's children joined into the sequence (`Joins.merge`): branch j keeps child j's
        nodes over their common prefix; tokens the child never ran are new nodes in its chain."""
        if self._fork is None or any(k is None for k in self._fork.kids) or len(branches) != len(self._fork.kids):
            self.exact = False
            return
        f = self._fork
        pending, stage, join, kids = f.pending, f.stage, f.join, f.kids
        prev_end = None
        for j, (b, nodes) in enumerate(zip(branches, kids)):
            k = common_prefix([self.token[x] for x in nodes], b)
            chain = nodes[:k]
            prev = chain[-1] if chain else pending
            for t in b[k:]:
                prev = self._node(t, self.pos[prev] + 1, stage, j + 1 if join else 0, prev, prev)
                chain.append(prev)
            if prev_end is not None:
                self.up[chain[0]] = prev_end
            prev_end = chain[-1]
            self.planner += chain
        self.merges += 1
        self._fork = None


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
    top_logprobs: int = 0                 # generate / fork: alternatives per token to report (0 = none)
    fork: object = None                   # fork: its children's pages (`pages.Fork`), made when they first run


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
        self.lps: list[float] = []        # the log-prob of each token of gen (Generation.logprobs)
        self.tops: list[list[tuple[int, float]]] = []   # with op.top_logprobs: per token of gen
        self.reason: str | None = None
        self.overshoot = 0
        self.prefill_pos = 0              # child: how much of run[:-1] is in its suffix slot
        self.fed = False                  # its last token was run (a join fork's child: decode's feed_last)
        self.last_logits = None           # then its logits after that token (device, [V]), if kept
        self.pages = None                 # child: its page table (`pages.SeqPages`, from the fork)
        self.restarted = False            # child: preempted, takes a new share of the parent's pages


@dataclasses.dataclass
class PrefillWork:
    """A sequence's queued tokens (an open's prompt, extends): run[done:] still to be written into
    its slot at slots base + done.. (by a prefill call, or as forced tokens of its next decode
    chunk when few are left)."""
    seq: Seq
    run: list[int]
    done: int
    base: int

    @property
    def left(self) -> int:
        """Tokens still to write."""
        return len(self.run) - self.done


@dataclasses.dataclass
class ForkChild:
    """One finished child of a fork, as a merge join needs it: its tokens from the parent's pending
    token on (forced prefix, then generated), how many of them its pages hold (`written`, from
    the fork point on), its logits after the last one (device [V]; None: not kept) and its pages."""
    tokens: list[int]
    written: int
    logits: object = None
    pages: object = None                  # its page table (`pages.SeqPages`), held until a merge or the next op


@dataclasses.dataclass
class ForkRecord:
    """A sequence's last fork: its length when forked (`at`) and each child once it finished
    (None while it runs)."""
    at: int
    children: list[ForkChild | None]

    @property
    def finished(self) -> bool:
        return all(c is not None for c in self.children)


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


@functools.partial(jax.jit, static_argnames=("n_valid", "top_n"))
def _sample_first_fn(logits, seed, temperature, top_k, top_p, n_valid: int | None, top_n: int):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), 0)   # row 0, step 0
    dist = filtered_logits(mask_padded(logits, n_valid)[None].astype(jnp.float32), temperature, top_k, top_p)
    tok = jax.random.categorical(key, dist[0]).astype(jnp.int32)
    lp = dist[0] - jax.nn.logsumexp(dist[0])
    top = jax.lax.top_k(lp, top_n) if top_n else None
    return tok, lp[tok], top


def _host_top(lp: np.ndarray, n: int) -> list[tuple[int, float]]:
    ids = np.argsort(-lp, kind="stable")[:n]
    return [(int(i), float(lp[i])) for i in ids if np.isfinite(lp[i])]


def sample_first(logits, sampling: Sampling, n_valid: int | None = None,
                 top_n: int = 0) -> tuple[int, float, list[tuple[int, float]] | None]:
    """The token a one-row decode would sample at step 0 from `logits` [V] (same key stream), never
    a padded id (>= n_valid), with its log-prob under the same distribution as the decode
    program's (`programs._sample_rows`) and, with top_n, the top_n (id, log-prob). Greedy: the
    argmax of the logits brought to the host (one small transfer, no device op: this runs on the
    latency path, once per merge join); else one jitted call with host scalars."""
    if sampling.greedy:
        host = np.asarray(logits, np.float32)
        if n_valid is not None:
            host = np.where(np.arange(host.shape[-1]) < n_valid, host, -np.inf).astype(np.float32)
        m = host.max()
        lp = (host - (m + np.log(np.sum(np.exp(host - m), dtype=np.float32)))).astype(np.float32)
        tok = int(np.argmax(host))
        return tok, float(lp[tok]), (_host_top(lp, top_n) if top_n else None)
    tok, lp, top = _sample_first_fn(logits, np.int32(sampling.seed), np.float32(sampling.temperature),
                                    np.int32(sampling.top_k), np.float32(sampling.top_p), n_valid=n_valid,
                                    top_n=top_n)
    if top is not None:
        vals, ids = jax.device_get(top)
        top = [(int(i), float(v)) for i, v in zip(ids, vals) if np.isfinite(v)]
    return int(tok), float(lp), top
