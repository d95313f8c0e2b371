"""Eval timings: XLA compilation is timed apart from each problem's wall clock (compile_s), from
the compile spans JAX reports, and the accounting changes no record."""
from __future__ import annotations

import json
import time

import pytest

from sprint_jax.tasks.types import Task
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.infer.orchestrator import OrchestratorConfig
from test_orchestrator import ScriptedEngine

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"    # the event JAX reports per compile


class CompilingOnce(ScriptedEngine):
    """A scripted engine whose `compile_on`-th generate call stalls `stall` seconds and reports
    them to jax.monitoring as a backend compile span, as a first compile of a shape would."""

    def __init__(self, outputs, compile_on: int, stall: float):
        super().__init__(outputs)
        self.compile_on, self.stall, self.generates = compile_on, stall, 0

    def generate(self, *args, **kwargs):
        from jax import monitoring

        self.generates += 1
        if self.generates == self.compile_on:
            t = time.time()
            time.sleep(self.stall)
            monitoring.record_event_time_span(BACKEND_COMPILE, t, t + self.stall, fun_name="test")
        return super().generate(*args, **kwargs)


def test_a_compile_inside_a_problem_is_taken_out_of_its_wall_clock(tmp_path):
    tasks = [Task(f"p{i}", "math", f"{i}+1?", str(i + 1)) for i in range(3)]
    outputs = [f"<Final Answer> {i + 1} </Final Answer>" for i in range(3)]
    stall = 0.2
    results, report = evaluate(CompilingOnce(outputs, compile_on=2, stall=stall), tasks, "sequential",
                               prompt_fn=lambda t: t.problem, out_dir=tmp_path, progress=False)
    assert [r["correct"] for r in results] == [True, True, True]
    records = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["compile_s"] for r in results[::2]] == [0.0, 0.0]
    assert results[1]["compile_s"] == pytest.approx(stall, abs=1e-6)       # the reported span, whole
    for r, rec in zip(results, records):
        assert rec["compile_s"] == r["compile_s"]
        assert r["wall_s"] + r["compile_s"] == pytest.approx(rec["wall_s"])  # the record keeps the raw clock
    assert records[1]["wall_s"] >= stall
    assert report["compile_s"] == pytest.approx(stall, abs=1e-6)
    # on the invocation's clock (compilation excluded) the problems ran one after another
    for before, after in zip(results, results[1:]):
        assert after["finished_s"] - after["wall_s"] >= before["finished_s"] - 1e-3


def test_real_model_compile_accounting_changes_no_record(hf_untied, tmp_path):
    """The same problems on a cold and on a warm engine: the cold run compiles (compile_s > 0),
    the warm one not at all, and every result and record is the same apart from the timings."""
    from conftest import tiny_vocab_tokenizer
    from sprint_jax.eval.report import untimed
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model import from_pretrained

    engine = Engine(from_pretrained(hf_untied), tiny_vocab_tokenizer(), max_seqs=2, max_children=2,
                    max_seq_len=48, max_branch_tokens=16, decode_chunk=8, prefill_chunk=32, eos_token_ids=[])
    tasks = [Task(f"t{k}", "math", f"What is {k}+{k}?", str(2 * k)) for k in range(3)]
    cfg = OrchestratorConfig(max_planner_tokens=8, max_branch_tokens=6, max_total_tokens=12)
    runs = {}
    for name in ("cold", "warm"):
        evaluate(engine, tasks, "parallel", orchestrator_config=cfg, out_dir=tmp_path / name, progress=False,
                 concurrency=2)
        runs[name] = ([json.loads(x) for x in (tmp_path / name / "results.jsonl").read_text().splitlines()],
                      [json.loads(x) for x in (tmp_path / name / "records.jsonl").read_text().splitlines()])
    (cold, cold_rec), (warm, warm_rec) = runs["cold"], runs["warm"]
    assert cold[0]["compile_s"] > 0 and all(r["compile_s"] == 0.0 for r in warm)
    assert [untimed(r) for r in cold] == [untimed(r) for r in warm]
    assert all(r["total_tokens"] > 0 for r in cold)

    def no_times(x):
        if isinstance(x, dict):
            return {k: no_times(v) for k, v in x.items() if not k.endswith("_s")}
        return [no_times(v) for v in x] if isinstance(x, list) else x
    assert no_times(cold_rec) == no_times(warm_rec)
    for r, rec in zip(cold, cold_rec):
        assert r["wall_s"] + r["compile_s"] == pytest.approx(rec["wall_s"])
