"""Resuming an eval directory: a rerun over fewer problems keeps every finished result on disk and
reports over the problems it was asked for; `eval compare` derives a resumed run's wall clock and
concurrency from the problems' own timings (every invocation counted, none twice)."""
from __future__ import annotations

import json

import pytest

from sprint_jax.cli import main
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.eval.report import load_results, wall_clock_summary
from test_eval import ANSWERS, TASKS, _engine_for, _prompt, _rft_engine, _sprint_engine, _sprint_script
from test_orchestrator import DRUG_EXECUTORS
from test_orchestrator_drivers import ScriptedBatch


def _read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_rerun_over_fewer_problems_keeps_the_other_results(tmp_path):
    evaluate(_sprint_engine(), TASKS[:3], "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    results, records = _read(tmp_path / "results.jsonl"), _read(tmp_path / "records.jsonl")
    assert [r["id"] for r in results] == ["m1", "m2", "m3"]
    idle = _engine_for([])
    again, report = evaluate(idle, TASKS[:1], "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    assert idle.calls == []                                   # m1 was finished: nothing runs
    assert _read(tmp_path / "results.jsonl") == results       # m2, m3 still there, unchanged
    assert _read(tmp_path / "records.jsonl") == records
    # the report covers what this invocation was asked for, and says how many are on disk
    assert report["n"] == 1 and report["correct"] == 1 and [r["id"] for r in again] == ["m1"]
    assert report["problems_in_out"] == 3 and report["resumed_problems"] == 1
    assert json.loads((tmp_path / "report.json").read_text())["n"] == 1
    # a longer run afterwards runs only the two new problems and reports all five
    engine = _engine_for(ANSWERS[3:])
    full, report = evaluate(engine, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    assert [r["correct"] for r in full] == [True, True, False, True, True]
    assert report["n"] == 5 and report["problems_in_out"] == 5 and report["resumed_problems"] == 3
    assert [r["id"] for r in _read(tmp_path / "results.jsonl")] == [t.id for t in TASKS]


def _union(spans):
    """Seconds covered by the intervals, by a sweep over their sorted end points."""
    points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda p: (p[0], -p[1]))
    covered, depth, since = 0.0, 0, None
    for x, step in points:
        if depth == 0 and step == 1:
            since = x
        depth += step
        if depth == 0:
            covered += x - since
    return covered


def test_run_wall_clock_on_constructed_timings():
    from sprint_jax.eval.report import run_wall_clock

    rows = [{"invocation": 1, "finished_s": 2.0, "wall_s": 2.0}, {"invocation": 1, "finished_s": 3.0, "wall_s": 2.0},
            {"invocation": 1, "finished_s": 7.0, "wall_s": 1.0}, {"invocation": 2, "finished_s": 1.5, "wall_s": 1.0}]
    # invocation 1: [0, 2] u [1, 3] u [6, 7] = 4 s; invocation 2: [0.5, 1.5] = 1 s
    assert run_wall_clock(rows) == pytest.approx(5.0)
    assert run_wall_clock(rows + [{"wall_s": 1.0}]) is None      # a line of an older run: unknown


def test_compare_counts_every_invocation_of_a_resumed_run(tmp_path, capsys):
    scripts = {_prompt(t): (_sprint_script(a), DRUG_EXECUTORS) for t, a in zip(TASKS, ANSWERS)}
    a, b = tmp_path / "a", tmp_path / "b"
    # A: three problems at concurrency 1, then all five at concurrency 4, then once more (nothing to run)
    evaluate(ScriptedBatch(scripts, seed=1), TASKS[:3], "parallel", prompt_fn=_prompt, out_dir=a, progress=False,
             concurrency=1)
    evaluate(ScriptedBatch(scripts, seed=2), TASKS, "parallel", prompt_fn=_prompt, out_dir=a, progress=False,
             concurrency=4)
    rows = load_results(a)
    assert [r["invocation"] for r in rows] == [1, 1, 1, 2, 2] and [r["concurrency"] for r in rows] == [1, 1, 1, 4, 4]
    by_inv = {}
    for r in rows:
        by_inv.setdefault(r["invocation"], []).append((r["finished_s"] - r["wall_s"], r["finished_s"]))
    expected = sum(_union(s) for s in by_inv.values())
    assert expected > 0
    # at concurrency 1 the problems ran one after another: their intervals do not overlap
    assert _union(by_inv[1]) == pytest.approx(sum(r["wall_s"] for r in rows[:3]))
    first = json.loads((a / "report.json").read_text())
    assert first["wall_clock_s"] == pytest.approx(expected) and first["concurrency"] == [1, 4]
    _, rerun = evaluate(ScriptedBatch(scripts, seed=3), TASKS, "parallel", prompt_fn=_prompt, out_dir=a,
                        progress=False, concurrency=8)
    assert rerun["wall_clock_s"] == pytest.approx(expected) and rerun["concurrency"] == [1, 4]
    assert load_results(a) == rows
    evaluate(_rft_engine(), TASKS, "sequential", prompt_fn=_prompt, out_dir=b, progress=False)

    capsys.readouterr()
    assert main(["eval", "compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("concurrency"))
    assert line.split()[1:] == ["1,4", "1"]
    wall = json.loads((tmp_path / "cmp" / "compare.json").read_text())["wall_clock"]["SPRINT"]
    assert wall["wall_clock_s"] == pytest.approx(expected)
    assert wall["wall_per_problem_s"] == pytest.approx(expected / 5)
    assert wall["concurrency"] == [1, 4]


def test_a_run_without_per_problem_timings_is_not_given_a_wrong_wall_clock(tmp_path):
    """Lines written before the per-problem timings: the report's clock is used only when it
    covers exactly those problems in one invocation; a resumed run's is n/a, not a wrong number."""
    rows = [{"id": f"p{i}", "correct": True, "sequential_tokens": 5, "total_tokens": 5, "wall_s": 1.0}
            for i in range(4)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = {"n": 4, "wall_clock_s": 8.0, "meta": {"concurrency": 2}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    whole = wall_clock_summary(tmp_path, load_results(tmp_path))
    assert whole["wall_per_problem_s"] == 2.0 and whole["concurrency"] == 2
    (tmp_path / "report.json").write_text(json.dumps({**report, "wall_clock_s": 0.01, "resumed_problems": 4}))
    resumed = wall_clock_summary(tmp_path, load_results(tmp_path))
    assert resumed["wall_per_problem_s"] is None and resumed["concurrency"] is None
