"""The driver shared by `run_many` and the server (`infer.drive.RunDriver`): its hooks, a run ended
by a driver's own limit, and a refused call that ends one run while the others go on."""
from __future__ import annotations

from sprint_jax.infer.drive import Run, RunDriver
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunEnded, run_many
from sprint_jax.infer.requests import EngineError
from test_orchestrator_drivers import ScriptedBatch, _untimed, _variant

CFG = OrchestratorConfig(max_planner_tokens=60, max_branch_tokens=40)


def _drive(engine, driver: RunDriver, run: Run, done: list) -> None:
    driver.advance(run)
    while not done:
        engine.step()
        driver.poll(run)


def test_interrupt_ends_the_run_with_the_drivers_reason_and_hooks_see_every_answer():
    q = "Q0: propose a lead."
    scripts = {q: _variant(0)}
    answered, done = [], []
    driver = RunDriver(ScriptedBatch(scripts), on_answer=lambda run, call, ctx, v: answered.append(call.kind),
                       on_done=lambda run, rec: done.append(rec),
                       interrupt=lambda run: RunEnded("driver_limit", "ended by the driver")
                       if "generate" in answered else None)
    _drive(driver.engine, driver, Run(Orchestrator(driver.engine, CFG).steps(q, "parallel")), done)
    rec = done[0]
    assert answered == ["prefill", "generate"]      # the call after the first planner call was not submitted
    assert rec.termination == "driver_limit" and "ended by the driver" in rec.problems
    # without the interrupt the same run goes on to its answer, and run_many reports the same answers
    calls: list[str] = []
    full = run_many(ScriptedBatch(scripts), [q], "parallel", CFG,
                    on_call=lambda i, call, ctx, v: calls.append(call.kind))[0]
    assert full.termination == "final_answer" and calls[:2] == answered and len(calls) > 2


class _Refusing(ScriptedBatch):
    """Refuses every generate of the sequence opened for `bad` (as Engine refuses at submit)."""

    def __init__(self, scripts, bad: str, **kw):
        super().__init__(scripts, **kw)
        self.bad = bad

    def generate(self, seq, limit, stop, sampling):
        if self.decode_text(seq.tokens).startswith(self.bad):
            raise EngineError("refused for the test")
        return super().generate(seq, limit, stop, sampling)


def test_a_refused_call_ends_only_its_run():
    scripts = {f"Q{k}: propose a lead.": _variant(k) for k in (0, 4, 8)}
    queries = list(scripts)
    alone = [Orchestrator(ScriptedBatch(scripts), CFG).run(q, "parallel") for q in queries]
    many = run_many(_Refusing(scripts, queries[1], seed=3), queries, "parallel", CFG, concurrency=3)
    assert many[1].termination == "engine_error"
    assert any("refused for the test" in p for p in many[1].problems)
    assert [_untimed(many[k]) for k in (0, 2)] == [_untimed(alone[k]) for k in (0, 2)]
    assert all(r.termination == "final_answer" for r in (alone[0], alone[2]))
