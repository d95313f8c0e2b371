"""Rollouts for P-GRPO: G SPRINT runs per prompt through the orchestrator, with the exact tokens of
every call (ThreadWeaver, Lian et al., arXiv 2512.07843, section 4: parallel rollouts).

The loss needs the token ids the policy sampled in each planner and executor call, not a
re-tokenisation of their text (a BPE need not round-trip). `RecordingEngine` wraps the engine and
records, for every call the orchestrator makes, the unit (context ids, completion ids):
  * `generate(state, ...)`           -> (state.tokens before the call, the generated tokens)
  * `decode_branches(state, P, ...)` -> per branch j, (state.tokens + P[j], branch j's tokens)
This is the same cut the `trie` training layout makes (train/data.py): a planner call sees its
context, an executor sees the planner context, its plan and its forced `<execution_i.j>`, never
its siblings. Generated tokens include an EOS the model wrote (it was sampled, so it is learnt);
forced openings and the orchestrator's repairs are context.

`Rollouts` is the small interface the RL loop drives: `run(queries, seeds, mode)` returns one
`Trajectory` per (query, seed).
  * `BatchedRollouts` (the default): every run of the step advances together on the `BatchEngine`
    through `run_many` (the path `sprint-jax eval --concurrency` takes), each run with its own
    config (its seed), each stage's executors a shared-prefix fork inside it; the units come from
    run_many's `on_call` hook with the same cut as `RecordingEngine`.
  * `SingleRunRollouts`: one run after another on the single-run `Engine` (`Orchestrator.run`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol, Sequence

from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunRecord


@dataclasses.dataclass
class Unit:
    """One model call: the tokens it saw and the tokens it sampled."""
    context: list[int]
    completion: list[int]
    kind: str                        # "planner" | "executor"


@dataclasses.dataclass
class Trajectory:
    """One rollout: the run record (text, accounting) and the units that carry loss."""
    record: RunRecord
    units: list[Unit]
    seed: int

    @property
    def generated_tokens(self) -> int:
        return sum(len(u.completion) for u in self.units)


class RecordingEngine:
    """Forwards to `engine` and records every call as a Unit (see the module docstring)."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.units: list[Unit] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, state, max_new_tokens, stop=(), sampling=None):
        context = list(state.tokens)
        g = self._engine.generate(state, max_new_tokens, stop=stop, sampling=sampling)
        self.units.append(Unit(context, list(g.tokens), "planner"))
        return g

    def decode_branches(self, state, prefixes, max_new_tokens, stop=(), sampling=None, mode="shared", join=False):
        context = list(state.tokens)
        gens = self._engine.decode_branches(state, prefixes, max_new_tokens, stop=stop, sampling=sampling, mode=mode,
                                            join=join)
        for p, g in zip(prefixes, gens):
            self.units.append(Unit(context + [int(t) for t in p], list(g.tokens), "executor"))
        return gens


class Rollouts(Protocol):
    def run(self, queries: Sequence[str], seeds: Sequence[int], mode: str) -> list[Trajectory]: ...


class SingleRunRollouts:
    """Runs each (query, seed) alone through `Orchestrator.run` on the plain engine."""

    def __init__(self, engine: Any, config: OrchestratorConfig):
        self.engine = engine
        self.config = config

    def run(self, queries: Sequence[str], seeds: Sequence[int], mode: str) -> list[Trajectory]:
        out = []
        for q, s in zip(queries, seeds):
            rec = RecordingEngine(self.engine)
            cfg = dataclasses.replace(self.config, seed=int(s))
            record = Orchestrator(rec, cfg).run(q, mode)
            out.append(Trajectory(record, rec.units, int(s)))
        return out


class BatchedRollouts:
    """All (query, seed) runs at once on a `BatchEngine` (`run_many` with a config per run)."""

    def __init__(self, engine: Any, config: OrchestratorConfig, concurrency: int | None = None):
        self.engine = engine
        self.config = config
        self.concurrency = concurrency

    def run(self, queries: Sequence[str], seeds: Sequence[int], mode: str) -> list[Trajectory]:
        from sprint_jax.infer.orchestrator import run_many

        units: list[list[Unit]] = [[] for _ in queries]

        def on_call(i: int, call, context: list[int], result) -> None:
            if call.kind == "generate":
                units[i].append(Unit(context, list(result.tokens), "planner"))
            elif call.kind == "branches":
                for p, g in zip(call.prefixes, result):
                    units[i].append(Unit(context + [int(t) for t in p], list(g.tokens), "executor"))

        configs = [dataclasses.replace(self.config, seed=int(s)) for s in seeds]
        records = run_many(self.engine, list(queries), mode, self.config, concurrency=self.concurrency,
                           configs=configs, on_call=on_call)
        return [Trajectory(r, u, int(s)) for r, u, s in zip(records, units, seeds)]


def timed_run(rollouts: Rollouts, queries, seeds, mode) -> tuple[list[Trajectory], float]:
    t = time.perf_counter()
    trajs = rollouts.run(queries, seeds, mode)
    return trajs, time.perf_counter() - t


__all__ = ["Unit", "Trajectory", "RecordingEngine", "Rollouts", "SingleRunRollouts", "BatchedRollouts", "timed_run"]
