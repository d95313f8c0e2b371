"""Rollouts for P-GRPO: G SPRINT runs per prompt through the orchestrator, with the exact tokens of
every call (ThreadWeaver, Lian et al., arXiv 2512.07843, section 4: parallel rollouts).

The loss needs the token ids the policy sampled in each planner and executor call, not a
re-tokenisation of their text (a BPE need not round-trip). `Rollouts.run` runs every (query, seed)
of a step at once on the engine through `run_many` (the path `sprint-jax eval --concurrency`
takes), each run with its own config (its seed), each stage's executors a shared-prefix fork
inside it, and records from run_many's `on_call` hook, for every call, the unit (context ids,
completion ids):
  * a planner call (generate)  -> (the sequence's tokens before the call, the generated tokens)
  * an executor (a fork child) -> (the sequence's tokens + its forced prefix, its tokens)
This is the same cut the `trie` training layout makes (train/data.py): a planner call sees its
context, an executor sees the planner context, its plan and its forced `<execution_i.j>`, never
its siblings. Generated tokens include an EOS the model wrote (it was sampled, so it is learnt);
forced openings and the orchestrator's repairs are context. On an engine built with `trace=True`
each trajectory also holds its sequence's `DecodeTrace`: every token as the engine computed it
(positions, join, the log-prob it was sampled with), which the loss lays out for every layout,
the merge join included (rl/layout.py `layout_trace`); the units stay for accounting and tests.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from sprint_jax.infer.orchestrator import OrchestratorConfig, RunRecord, run_many
from sprint_jax.infer.requests import DecodeTrace


@dataclasses.dataclass
class Unit:
    """One model call: the tokens it saw and the tokens it sampled."""
    context: list[int]
    completion: list[int]
    kind: str                        # "planner" | "executor"


@dataclasses.dataclass
class Trajectory:
    """One rollout: the run record (text, accounting), the units that carry loss, and (on an
    engine built with `trace=True`) how the engine computed every token (`DecodeTrace`: what the
    loss lays out, `rl/layout.py` `layout_trace`)."""
    record: RunRecord
    units: list[Unit]
    seed: int
    trace: DecodeTrace | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(u.completion) for u in self.units)


class Rollouts:
    """All (query, seed) runs of a step at once on an `Engine` (`run_many` with a config per run)."""

    def __init__(self, engine: Any, config: OrchestratorConfig, concurrency: int | None = None):
        self.engine = engine
        self.config = config
        self.concurrency = concurrency

    def run(self, queries: Sequence[str], seeds: Sequence[int], mode: str) -> list[Trajectory]:
        units: list[list[Unit]] = [[] for _ in queries]
        traces: list[DecodeTrace | None] = [None] * len(queries)

        def on_call(i: int, call, context: list[int], result) -> None:
            if traces[i] is None:
                traces[i] = getattr(call.state, "trace", None)
            if call.kind == "generate":
                units[i].append(Unit(context, list(result.tokens), "planner"))
            elif call.kind == "branches":
                for p, g in zip(call.prefixes, result):
                    units[i].append(Unit(context + [int(t) for t in p], list(g.tokens), "executor"))

        configs = [dataclasses.replace(self.config, seed=int(s)) for s in seeds]
        records = run_many(self.engine, list(queries), mode, self.config, concurrency=self.concurrency,
                           configs=configs, on_call=on_call)
        return [Trajectory(r, u, int(s), t) for r, u, s, t in zip(records, units, seeds, traces)]


def timed_run(rollouts: Rollouts, queries, seeds, mode) -> tuple[list[Trajectory], float]:
    t = time.perf_counter()
    trajs = rollouts.run(queries, seeds, mode)
    return trajs, time.perf_counter() - t


__all__ = ["Unit", "Trajectory", "Rollouts", "timed_run"]
