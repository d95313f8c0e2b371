"""The one driver of orchestrator runs on an `Engine`, shared by `orchestrator.run_many` and the
server's worker.

A run is `Orchestrator.steps`: a generator that yields `EngineCall`s, receives each call's answer
(or has the engine's `EngineError` thrown in) and returns its `RunRecord`. `RunDriver` answers
those calls: `advance` hands the run a value and submits the calls it asks for next until one has
to wait for engine steps (the engine answers truncate and merge at once, and an op may be done when
submitted); `poll`, after a step, hands a finished op's result to its run and advances it. A call
the engine refuses (EngineError) is thrown into that run only; the run's policy decides (it ends
with `engine_error`), the other runs go on.

What differs between drivers plugs in through hooks, each given the run:
  on_answer(run, call, context, value)  a call was answered (not when refused), before the run
                                        sees `value`; `context` is the state's tokens when the call
                                        was issued (with `context=True`, else [])
  on_done(run, record)                  the generator returned its record
  interrupt(run)                        asked after each call a run yields: an exception (e.g.
                                        `RunEnded`) thrown into the run in place of that call's
                                        answer, or None
  top_logprobs(run)                     alternatives per token its generate / branches calls ask for
Stepping the engine, admitting runs and everything else a driver does between steps (run_many's
concurrency and progress check; the server's plain requests, streaming previews, cancellation)
stays with each driver.

The per-run state the driver reads and writes lives on the run object: `steps` (the generator),
`seq` (the Seq its prefill opened, for the caller to close or abort), `op` (the engine op in
flight, None when none), `call` / `context` (the call that op answers). `Run` holds exactly these;
the server's `Job` carries the same attributes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from sprint_jax.infer.requests import EngineError
from sprint_jax.infer.sampling import Sampling


@dataclasses.dataclass
class EngineCall:
    """One request of the stage loop. prefill -> a state; generate -> a Generation; branches ->
    one Generation per prefix; extend / truncate / merge -> the state. `state` is the `Seq` a
    prefill returned."""
    kind: str                                   # prefill | generate | branches | extend | truncate | merge
    state: Any = None
    tokens: list[int] = dataclasses.field(default_factory=list)        # prefill / extend
    n: int = 0                                                         # truncate
    prefixes: list[list[int]] = dataclasses.field(default_factory=list)  # branches; merge: each branch's tokens
    limits: list[int] = dataclasses.field(default_factory=list)
    stops: list[list[str]] = dataclasses.field(default_factory=list)
    sampling: Sampling | None = None
    mode: str = "shared"                        # branches: shared | serial
    join: bool = False                          # branches: a merge join follows (children feed their last token)


def submit_call(engine: Any, call: EngineCall, top_logprobs: int = 0) -> tuple[Any, Any]:
    """One stage-loop call handed to an `Engine`: (None, value) for a call the engine answers at
    once (truncate, merge), else (op, None) with the engine's `Op` (a prefill opens a sequence; a
    serial stage's branches run one executor at a time; top_logprobs > 0 asks generate and
    branches for that many alternatives per token). EngineError passes through."""
    top = {"top_logprobs": top_logprobs} if top_logprobs else {}
    if call.kind == "truncate":
        return None, engine.truncate(call.state, call.n)
    if call.kind == "merge":              # a copy of KV rows (+ a few tokens): done at once
        return None, engine.merge(call.state, call.prefixes)
    if call.kind == "prefill":
        return engine.open(call.tokens), None
    if call.kind == "generate":
        return engine.generate(call.state, call.limits[0], call.stops[0], call.sampling, **top), None
    if call.kind == "branches":
        serial = {"serial": True} if call.mode == "serial" else {}   # one executor at a time
        join = {"join": True} if call.join else {}
        return engine.fork(call.state, call.prefixes, call.limits, call.stops, call.sampling, **serial, **join,
                           **top), None
    if call.kind == "extend":
        return engine.extend(call.state, call.tokens), None
    raise ValueError(f"unknown engine call {call.kind!r}")


@dataclasses.dataclass
class Run:
    """One driven run's state (see the module docstring); `key` is the caller's (run_many: the
    query's index)."""
    steps: Any
    key: Any = None
    seq: Any = None
    op: Any = None
    call: EngineCall | None = None
    context: list[int] = dataclasses.field(default_factory=list)


class RunDriver:
    """Answers the calls of runs on `engine` (see the module docstring for the hooks). An exception
    the generator raises (not a StopIteration) propagates to the caller of `advance` / `poll`."""

    def __init__(self, engine: Any, *, on_answer: Callable[[Any, EngineCall, list[int], Any], None] | None = None,
                 on_done: Callable[[Any, Any], None] | None = None,
                 interrupt: Callable[[Any], BaseException | None] | None = None,
                 top_logprobs: Callable[[Any], int] | None = None, context: bool = False):
        self.engine = engine
        self.on_answer = on_answer
        self.on_done = on_done
        self.interrupt = interrupt
        self.top_logprobs = top_logprobs
        self.context = context

    def _answered(self, run, call: EngineCall, context: list[int], value) -> None:
        if self.on_answer is not None:
            self.on_answer(run, call, context, value)

    def advance(self, run, value=None, error: BaseException | None = None) -> None:
        """Hand `value` (or throw `error`) into the run, then submit the calls it yields until one
        waits for engine steps (`run.op` set) or the run returns (`on_done`). Call it once with no
        value to start a run."""
        while True:
            try:
                call = run.steps.throw(error) if error is not None else run.steps.send(value)
                stop = self.interrupt(run) if self.interrupt is not None else None
                if stop is not None:
                    call = run.steps.throw(stop)
            except StopIteration as done:
                if self.on_done is not None:
                    self.on_done(run, done.value)
                return
            value, error = None, None
            context = list(call.state.tokens) if self.context and call.state is not None else []
            top = self.top_logprobs(run) if self.top_logprobs is not None else 0
            try:
                op, value = submit_call(self.engine, call, top)
            except EngineError as e:          # refused: the run's own policy decides
                error = e
                continue
            if op is None:                    # truncate, merge: answered at once
                self._answered(run, call, context, value)
                continue
            if call.kind == "prefill":
                run.seq = op.seq
            if op.done:
                value = op.result
                self._answered(run, call, context, value)
                continue
            run.op, run.call, run.context = op, call, context
            return

    def poll(self, run) -> bool:
        """If the run's op in flight is done, hand its result to the run and advance it; whether it
        was done."""
        op = run.op
        if op is None or not op.done:
            return False
        run.op = None
        self._answered(run, run.call, run.context, op.result)
        self.advance(run, op.result)
        return True


__all__ = ["EngineCall", "submit_call", "Run", "RunDriver"]
