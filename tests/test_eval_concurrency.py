"""`eval --concurrency`: results.jsonl is the same at concurrency 1, 4 and 16 (timings
aside); `eval compare` shows wall clock per problem, per correct
answer and the concurrency of each run."""
from __future__ import annotations

import json

import pytest

from sprint_jax.cli import main
from sprint_jax.tasks.types import Task
from sprint_jax.eval.evaluate import evaluate, untimed
from sprint_jax.infer.orchestrator import OrchestratorConfig
from test_eval import ANSWERS, TASKS, _prompt, _sprint_engine, _sprint_script
from test_orchestrator import DRUG_EXECUTORS
from test_orchestrator_drivers import ScriptedBatch


def _lines(path):
    """results.jsonl without its timings (the concurrency each problem ran at is one of them)."""
    return [untimed(json.loads(x)) for x in (path / "results.jsonl").read_text().splitlines()]


def test_scripted_eval_results_do_not_depend_on_concurrency(tmp_path):
    scripts = {_prompt(t): (_sprint_script(a), DRUG_EXECUTORS) for t, a in zip(TASKS, ANSWERS)}
    evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "single", progress=False)
    ref = _lines(tmp_path / "single")
    assert [r["correct"] for r in ref] == [True, True, False, True, True]
    for c in (1, 4, 16):
        _, report = evaluate(ScriptedBatch(scripts, seed=c), TASKS, "parallel", prompt_fn=_prompt,
                             out_dir=tmp_path / f"c{c}", progress=False, concurrency=c)
        assert _lines(tmp_path / f"c{c}") == ref, c
        assert report["meta"]["concurrency"] == c


def test_real_model_eval_results_do_not_depend_on_concurrency(hf_untied, tmp_path, capsys):
    from conftest import tiny_vocab_tokenizer
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model import from_pretrained

    model, tok = from_pretrained(hf_untied), tiny_vocab_tokenizer()
    caps = dict(max_seq_len=48, max_branch_tokens=24, decode_chunk=8, prefill_chunk=32, eos_token_ids=[])
    tasks = [Task(f"t{k}", "math", f"What is {k}+{k % 7}?", str(k + k % 7)) for k in range(12)]
    cfg = OrchestratorConfig(max_planner_tokens=10, max_total_tokens=14)
    batch = Engine(model, tok, max_seqs=16, max_children=2, **caps)
    evaluate(batch, tasks, "parallel", orchestrator_config=cfg, out_dir=tmp_path / "single", progress=False,
             concurrency=1)
    ref = _lines(tmp_path / "single")
    for c in (1, 4, 16):
        evaluate(batch, tasks, "parallel", orchestrator_config=cfg, out_dir=tmp_path / f"c{c}", progress=False,
                 concurrency=c)
        assert _lines(tmp_path / f"c{c}") == ref, c
    assert all(r["total_tokens"] > 0 for r in ref)
    assert main(["eval", "compare", str(tmp_path / "c16"), str(tmp_path / "c1"), "--names", "N16,N1",
                 "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "run wall clock / correct (s)" in printed and "latency / problem (s)" in printed
    line = next(x for x in printed.splitlines() if x.startswith("concurrency"))
    assert line.split()[1:] == ["16", "1"]
    wall = json.loads((tmp_path / "cmp" / "compare.json").read_text())["wall_clock"]
    report = json.loads((tmp_path / "c16" / "report.json").read_text())
    assert wall["N16"]["wall_per_problem_s"] == pytest.approx(report["wall_clock_s"] / 12)
    assert wall["N16"]["wall_per_correct_s"] is None      # random weights: nothing correct


def test_eval_refuses_flags_the_batched_engine_cannot_honour(hf_untied, tmp_path, capsys):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    for flags, message in ((["--concurrency", "0"], "--concurrency"),):
        assert main(["eval", "--model", str(hf_untied), "--data", str(tasks), "--out", str(tmp_path / "o"),
                     "--no-progress", *flags]) == 2
        assert message in capsys.readouterr().err
