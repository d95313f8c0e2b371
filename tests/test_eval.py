"""Evaluation (paper §13): graders wired through the orchestrator, results/report consistency, the
SPRINT-vs-RFT table, task loading, and the eval / infer commands on a tiny real checkpoint."""
from __future__ import annotations

import io
import json
import shutil

import pytest

from sprint_jax.cli import main
from sprint_jax.tasks.types import Task
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.eval.report import RunFileError, compare, format_compare_table, load_results
from sprint_jax.infer.infer_cli import LiveDisplay
from sprint_jax.infer.orchestrator import OrchestratorConfig, run_query
from sprint_jax.model.hf import update_export_meta
from test_orchestrator import DRUG_EXECUTORS, DRUG_PLANNER, QUERY, ScriptedEngine

TASKS = [
    Task("m1", "math", "What is 1/2?", "\\frac{1}{2}"),
    Task("m2", "math", "Half of one?", "1/2"),
    Task("m3", "math", "2+2?", "5"),
    Task("c1", "countdown", "Reach 24 with 2 3 4", {"target": 24, "numbers": [2, 3, 4]}),
    Task("q1", "choice", "Pick B", "B", {"choices": ["w", "x", "y", "z"]}),
]
# what the scripted model answers for each task, in order (graded: T, T, F, T, T)
ANSWERS = ["\\boxed{0.5}", "0.5", "4", "2*3*4", "The answer is (B)"]


def _sprint_script(answer: str) -> list[str]:
    return DRUG_PLANNER[:3] + [f"\n<Final Answer> {answer} </Final Answer>"]


def _sprint_engine() -> ScriptedEngine:
    planner = [line for a in ANSWERS for line in _sprint_script(a)]
    return ScriptedEngine(planner, DRUG_EXECUTORS)


def _rft_engine() -> ScriptedEngine:
    return ScriptedEngine([f"Some long serial reasoning here ok. <Final Answer> {a} </Final Answer>" for a in ANSWERS])


def _prompt(task: Task) -> str:
    return task.problem


def test_evaluate_grades_and_writes_consistent_outputs(tmp_path):
    results, report = evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path,
                               progress=False)
    assert [r["correct"] for r in results] == [True, True, False, True, True]
    assert report["accuracy"] == pytest.approx(4 / 5) and report["correct"] == 4
    # every run is the drug-discovery shape with a 7-token final answer call or so: check vs the rows
    on_disk = load_results(tmp_path)
    assert on_disk == json.loads(json.dumps(results))
    assert {"id", "correct", "sequential_tokens", "total_tokens", "stages", "wall_s", "problems",
            "termination", "format_valid"} <= set(on_disk[0])
    for r in on_disk:
        assert r["sequential_tokens"] < r["total_tokens"] and r["stages"] == 3 and r["termination"] == "final_answer"
        assert r["total_tokens"] - r["sequential_tokens"] == 173 - 153   # stage 2's two shorter executors
    n = len(on_disk)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["mean_sequential_tokens"] == pytest.approx(sum(r["sequential_tokens"] for r in on_disk) / n)
    assert written["mean_total_tokens"] == pytest.approx(sum(r["total_tokens"] for r in on_disk) / n)
    assert written["format_valid_rate"] == 1.0 and written["terminations"] == {"final_answer": 5}
    assert written["mode"] == "parallel" and written["n"] == 5 and written["wall_clock_s"] > 0
    assert set(written["plots"]) == {"tokens.png", "sequential_to_total_by_length.png"}
    assert written["sequential_to_total"] == pytest.approx(
        sum(r["sequential_tokens"] for r in on_disk) / sum(r["total_tokens"] for r in on_disk))
    assert "token_reduction" not in written and written["grader_errors"] == 0
    for name in written["plots"]:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [t.id for t in TASKS]
    assert [r["sequential_tokens"] for r in records] == [r["sequential_tokens"] for r in on_disk]


def test_compare_table_matches_hand_computation(tmp_path):
    a, _ = evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "a", progress=False)
    b, _ = evaluate(_rft_engine(), TASKS, "sequential", prompt_fn=_prompt, out_dir=tmp_path / "b", progress=False)
    assert all(r["sequential_tokens"] == r["total_tokens"] for r in b)
    # give B a different order: matching is by id
    table = compare(a, list(reversed(b)))
    rows = {r["key"]: r for r in table["rows"]}
    seq_a = sum(r["sequential_tokens"] for r in a) / 5
    seq_b = sum(r["sequential_tokens"] for r in b) / 5
    assert rows["mean_sequential_tokens"]["SPRINT"] == pytest.approx(seq_a)
    assert rows["mean_sequential_tokens"]["relative"] == pytest.approx((seq_a - seq_b) / seq_b)
    assert rows["accuracy"]["points"] == pytest.approx(0.0)
    text = format_compare_table(table)
    assert "sequential tokens" in text and "SPRINT" in text and "RFT" in text
    with pytest.raises(RunFileError, match="different problems"):
        compare(a, b[:-1])
    # the command
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c")]) == 0
    saved = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert saved["n"] == 5 and saved["rows"][1]["SPRINT"] == pytest.approx(seq_a)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "results.jsonl").write_text("\n".join(json.dumps(r) for r in a[:2]) + "\n")
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "d")]) == 2
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert main(["eval", "--data", "math500"]) == 2      # no --model / --out: one-line error


def test_load_tasks(tmp_path):
    from sprint_jax.eval.cli import load_tasks

    math = load_tasks("math500", limit=2)
    assert len(math) == 2 and math[0].kind == "math" and math[0].id.startswith("test/")
    cd = load_tasks("countdown", limit=3)
    assert len(cd) == 3 and all(t.kind == "countdown" for t in cd)
    f = tmp_path / "gpqa.jsonl"
    f.write_text(json.dumps({"id": "g1", "question": "Which?", "choices": ["a", "b", "c", "d"], "answer": "C"}) + "\n")
    (t,) = load_tasks(str(f))
    assert t.kind == "choice" and t.answer == "C" and "C) c" in t.problem
    from sprint_jax.errors import UserError
    with pytest.raises(UserError, match="not math500"):
        load_tasks(str(tmp_path / "nope.jsonl"))


def test_live_display_shows_executors_side_by_side():
    out = io.StringIO()
    run_query(ScriptedEngine(DRUG_PLANNER, DRUG_EXECUTORS), QUERY, "parallel", on_event=LiveDisplay(out, width=120))
    text = out.getvalue()
    lines = text.splitlines()
    assert any("[2.1]" in line and "[2.2]" in line and "[2.3]" in line for line in lines)
    assert any("Quinazoline binds" in line and "Pyrimidine scores" in line for line in lines)
    assert "sync:" in text and "sequential tokens:  153" in text and "total tokens:       173" in text
    assert "final answer:       'A quinazoline lead.'" in text


# ---------------------------------------------------------------------------------------------
# A tiny real checkpoint (random weights: accuracy 0; the checks are structure and consistency)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def real_engine(engine_224):
    return engine_224


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tiny_math.jsonl"
    rows = [{"id": f"t{k}", "problem": f"What is {k}+{k}?", "answer": str(2 * k)} for k in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_real_model_eval_structure(real_engine, alone_224, task_file, tmp_path):
    from sprint_jax.tasks import load_task_file

    tasks = load_task_file(task_file, "math", limit=3)
    cfg = OrchestratorConfig(max_planner_tokens=10, max_branch_tokens=8, max_total_tokens=16)
    for mode in ("parallel", "sequential"):
        results, report = evaluate(real_engine, tasks, mode, orchestrator_config=cfg, out_dir=tmp_path / mode,
                                   progress=False)
        on_disk = load_results(tmp_path / mode)
        assert [r["id"] for r in on_disk] == ["t1", "t2", "t3"]
        assert report["accuracy"] == 0.0 and report["format_valid_rate"] == 0.0
        for r in on_disk:
            assert 0 < r["sequential_tokens"] <= r["total_tokens"] <= 16
            assert r["termination"] in ("planner_token_limit", "token_budget") and not r["correct"]
            if mode == "sequential":
                assert r["sequential_tokens"] == r["total_tokens"] == 16
        assert report["mean_total_tokens"] == pytest.approx(sum(r["total_tokens"] for r in on_disk) / 3)
        # the record's text is what the engine decodes alone from the same prompt
        rec = json.loads((tmp_path / mode / "records.jsonl").read_text().splitlines()[0])
        limit = 16 if mode == "sequential" else 10
        ref = alone_224.generate(alone_224.prefill(alone_224.encode(tasks[0].problem)), limit)
        assert rec["text"] == ref.text and rec["total_tokens"] == len(ref.tokens)


def test_eval_and_infer_commands(hf_untied, task_file, tmp_path, capsys):
    from conftest import tiny_vocab_tokenizer

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    caps = ["--max-seq-len", "224", "--decode-chunk", "8", "--prefill-chunk", "32", "--max-prompts", "2",
            "--max-branch-tokens", "8", "--max-planner-tokens", "6", "--max-total-tokens", "12"]
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(model), "--data", str(task_file), "--mode", "parallel", "--limit", "2",
                 "--out", str(out), "--no-progress", *caps]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["n"] == 2 and report["meta"]["config"]["max_planner_tokens"] == 6
    assert report["meta"]["config"]["layout"] == "flat"       # no sprint_jax.json: the documented default
    assert len(load_results(out)) == 2
    update_export_meta(model, layout="trie")                  # what `train` writes into its export
    assert main(["infer", "--model", str(model), "What is 1+1?", "--record", str(tmp_path / "r.json"), *caps]) == 0
    printed = capsys.readouterr().out
    assert "stage 1 · planner: 6 tokens" in printed and "termination:        planner_token_limit" in printed
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["total_tokens"] == 6 and record["config"]["layout"] == "trie"
    assert main(["infer", "--model", str(model), "hi", "--record", str(tmp_path / "r.json"), "--set", "layout=flat",
                 *caps]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["config"]["layout"] == "flat"
    update_export_meta(model, layout="diagonal")
    assert main(["infer", "--model", str(model), "hi", *caps]) == 2
    assert "layout" in capsys.readouterr().err
    assert main(["infer", "--model", str(tmp_path / "none"), "hi"]) == 2
    assert main(["infer", "--model", str(model), "hi", "--set", "max_stages=0"]) == 2


# ---------------------------------------------------------------------------------------------
# an existing --out (it used to be wiped before the first problem)
# ---------------------------------------------------------------------------------------------

def _engine_for(answers) -> ScriptedEngine:
    return ScriptedEngine([line for a in answers for line in _sprint_script(a)], DRUG_EXECUTORS)


def test_eval_into_an_existing_out_resumes_after_a_kill(tmp_path):
    """Simulate a run killed during problem 3: two complete lines and a cut one in results.jsonl,
    and a stale report.json from an earlier run. The rerun keeps the two, reruns the cut one and
    the rest (its engine is scripted for the last three problems only: a rerun of all five would
    grade them wrong), and writes a report over all five."""
    full, _ = evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    res = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    rec = (tmp_path / "records.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("".join(res[:2]) + res[2][: len(res[2]) // 2])
    (tmp_path / "records.jsonl").write_text("".join(rec[:2]))
    engine = _engine_for(ANSWERS[2:])
    results, report = evaluate(engine, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    assert [r["correct"] for r in results] == [True, True, False, True, True]
    assert results[:2] == json.loads(json.dumps(full[:2]))          # kept as written, not rerun
    assert report["n"] == 5 and report["correct"] == 4 and report["resumed_problems"] == 2
    on_disk = load_results(tmp_path)
    assert sorted(r["id"] for r in on_disk) == sorted(t.id for t in TASKS)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(t.id for t in TASKS)
    assert json.loads((tmp_path / "report.json").read_text())["n"] == 5
    # a finished run resumed again runs nothing
    idle = _engine_for([])
    again, _ = evaluate(idle, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    assert idle.calls == [] and again == results


def test_eval_into_an_existing_out_with_another_setup_is_refused(tmp_path):
    from sprint_jax.errors import UserError

    evaluate(_sprint_engine(), TASKS[:2], "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    before = (tmp_path / "results.jsonl").read_text()
    with pytest.raises(UserError, match=r"differs in: mode"):
        evaluate(_rft_engine(), TASKS[:2], "sequential", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    with pytest.raises(UserError, match=r"problem 'm1' has a different prompt"):
        evaluate(_sprint_engine(), TASKS[:2], "parallel", prompt_fn=lambda t: t.problem + "!", out_dir=tmp_path,
                 progress=False)
    assert (tmp_path / "results.jsonl").read_text() == before        # nothing lost
    results, _ = evaluate(_rft_engine(), TASKS[:2], "sequential", prompt_fn=_prompt, out_dir=tmp_path,
                          progress=False, overwrite=True)
    assert [r["mode"] for r in load_results(tmp_path)] == ["sequential", "sequential"]


def test_resuming_with_other_weights_is_refused(real_engine, hf_tied, task_file, tmp_path):
    """Same path, same flags, different weights (a model retrained in place): the results on disk
    were not made by this model, so resuming would mix two models in one report."""
    from conftest import SHARED_ENGINES, tiny_vocab_tokenizer
    from sprint_jax.tasks import load_task_file
    from sprint_jax.errors import UserError
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model import from_pretrained

    tasks = load_task_file(task_file, "math", limit=1)
    cfg = OrchestratorConfig(max_planner_tokens=4, max_branch_tokens=4, max_total_tokens=4)
    evaluate(real_engine, tasks, "sequential", orchestrator_config=cfg, out_dir=tmp_path, progress=False)
    other = Engine(from_pretrained(hf_tied), tiny_vocab_tokenizer(), **SHARED_ENGINES["engine_224"])
    with pytest.raises(UserError, match=r"differs in: weights"):
        evaluate(other, tasks, "sequential", orchestrator_config=cfg, out_dir=tmp_path, progress=False)
