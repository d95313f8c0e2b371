"""Blocking single-run calls over an `Engine`: each call submits one operation and steps the
engine until it is done. For one sequence at a time (a CLI's one prompt, a benchmark's stage, a
test's reference); many runs go through `Engine` directly or `orchestrator.run_many`.

The handle is the engine's `Seq` (its tokens, the last one pending). `prefill` opens a new
sequence and closes the one this helper opened before, so an engine with one slot serves every
call; an older handle is closed and the engine refuses it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from sprint_jax.infer.engine import Engine
from sprint_jax.infer.requests import EngineError, Generation, Seq
from sprint_jax.infer.sampling import Sampling


@dataclasses.dataclass
class BranchStats:
    """What the last decode_branches call cost (read by benchmarks and the orchestrator)."""
    mode: str
    branches: int
    cache_bytes: int                  # KV bytes the fork held: its prefix's pages + each child's own
    steps: int                        # decode steps that produced a token (together: the longest; serial: the sum)
    wall_s: float


def fork_bytes(engine: Engine, seq) -> int:
    """KV bytes the last fork of `seq` holds in the pool: the pages of its prefix (shared by every
    child, once) and each child's own pages (its copy of a partly filled last page, its tokens)."""
    c = engine.cache
    page = 2 * c.k.shape[0] * c.k.shape[1] * c.k.shape[3] * c.k.shape[4] * c.k.dtype.itemsize   # K + V, every layer
    held = set(seq.pages.pages[: -(-seq.length // engine.page_size)])
    for child in (seq.last_fork.children if seq.last_fork is not None else ()):
        if child is not None and child.pages is not None:
            held.update(child.pages.pages)
    return len(held) * page


class SingleRun:
    """prefill / extend / truncate / generate / decode_branches / merge, and the teacher-forcing
    calls (step_logits, extend_logits, fork_logits), one sequence at a time on `engine`. Other
    attributes (encode, decode_text, max_seq_len, tokenizer, stats...) are the engine's."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.last_branch_stats: BranchStats | None = None
        self._seq: Seq | None = None

    def __getattr__(self, name: str):
        if name == "engine":                    # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    @property
    def max_branches(self) -> int:
        return self.engine.max_children

    def prefill(self, tokens: Sequence[int]) -> Seq:
        """A new sequence holding `tokens` (the last one pending); the previous one is closed."""
        self.close()
        op = self.engine.open(tokens)
        self.engine.run([op])
        self._seq = op.seq
        return op.seq

    def close(self) -> None:
        """Close the sequence the last prefill opened (its slot is free again)."""
        if self._seq is not None and not self._seq.closed:
            self.engine.close(self._seq)
        self._seq = None

    def extend(self, seq: Seq, tokens: Sequence[int]) -> Seq:
        """Append tokens (written by the next call that runs the model)."""
        return self.engine.extend(seq, tokens).result

    def truncate(self, seq: Seq, n: int) -> Seq:
        return self.engine.truncate(seq, n)

    def merge(self, seq: Seq, branches: Sequence[Sequence[int]]) -> Seq:
        return self.engine.merge(seq, branches)

    def generate(self, seq: Seq, max_new_tokens: int, stop: Sequence[str] = (),
                 sampling: Sampling | None = None) -> Generation:
        """Decode on `seq` until EOS, a stop string or max_new_tokens (appended to seq)."""
        op = self.engine.generate(seq, max_new_tokens, stop, sampling)
        self.engine.run([op])
        return op.result

    def decode_branches(self, seq: Seq, prefixes: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                        stop: Sequence[Sequence[str]] | Sequence[str] = (), sampling: Sampling | None = None,
                        mode: str = "shared", join: bool = False) -> list[Generation]:
        """A fork of len(prefixes) children of `seq` (`Engine.fork`), all decoded together (mode
        "shared") or one after another ("serial"); one Generation per child. join: a merge follows."""
        if mode not in ("shared", "serial"):
            raise EngineError(f"mode must be 'shared' or 'serial', got {mode!r}")
        t0 = time.perf_counter()
        op = self.engine.fork(seq, prefixes, max_new_tokens, stop, sampling, serial=mode == "serial",
                              join=join and mode == "shared")
        self.engine.run([op])
        gens = list(op.result)
        steps = (sum if mode == "serial" else max)(g.steps for g in gens)
        self.last_branch_stats = BranchStats(mode, len(gens), fork_bytes(self.engine, seq), steps,
                                             time.perf_counter() - t0)
        return gens

    def step_logits(self, seq: Seq) -> np.ndarray:
        """Next-token logits [V] after seq's tokens (seq unchanged)."""
        if seq.after_join:
            return np.asarray(seq.join_logits)
        return self.engine.forced_logits(seq, [])[0]

    def extend_logits(self, seq: Seq, tokens: Sequence[int]) -> np.ndarray:
        """Teacher forcing: append tokens and return the logits [T, V] that predict each of them."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            return np.zeros((0, self.engine.config.vocab_size), np.float32)
        first = []
        if seq.after_join:
            first = [np.asarray(seq.join_logits)]
            self.extend(seq, tokens[:1])
            tokens = tokens[1:]
            if not tokens:
                return np.stack(first)
        rows = self.engine.forced_logits(seq, tokens)
        return np.concatenate([np.stack(first), rows]) if first else rows

    def fork_logits(self, seq: Seq, branches: Sequence[Sequence[int]]) -> list[np.ndarray]:
        return self.engine.fork_logits(seq, branches)
