"""The paper's length analysis in `eval compare` (bins by the baseline's length, speedups), answer
extraction and grader errors through `evaluate`, and the train -> eval contamination guard."""
from __future__ import annotations

import hashlib
import json
import shutil
import unicodedata
from pathlib import Path

import pytest

from sprint_jax.cli import main
from sprint_jax.config import CONFIG_DIR
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.eval.report import compare, format_compare_table, length_bins
from sprint_jax.tasks import Task
from test_orchestrator import ScriptedEngine

REPO = Path(__file__).resolve().parents[1]


def _row(pid, correct, seq, wall, total=None):
    return {"id": pid, "correct": correct, "sequential_tokens": seq, "total_tokens": total or seq, "wall_s": wall}


# SPRINT (A) and RFT (B) on six problems; B's sequential lengths 1000, 1500, 3000, 5000, 9000, 12000
A = [_row("p1", True, 900, 1.0, 1200), _row("p2", False, 1500, 2.0, 1800), _row("p3", True, 2000, 2.0, 3100),
     _row("p4", True, 3000, 3.0, 5200), _row("p5", True, 5000, 4.0, 9500), _row("p6", False, 6000, 5.0, 12500)]
B = [_row("p1", True, 1000, 1.0), _row("p2", True, 1500, 1.5), _row("p3", False, 3000, 3.0),
     _row("p4", True, 5000, 5.0), _row("p5", False, 9000, 9.0), _row("p6", True, 12000, 10.0)]


def test_fixed_and_quantile_bins_match_a_hand_computation():
    pairs = list(zip(A, B))
    bins = length_bins(pairs, [2000, 4000, 8000], quantiles=3)
    fixed = bins["fixed"]
    assert [(b["min_baseline_tokens"], b["max_baseline_tokens"], b["n"]) for b in fixed] == [
        (0, 2000, 2), (2000, 4000, 1), (4000, 8000, 1), (8000, None, 2)]
    # [0, 2000): p1, p2
    b0 = fixed[0]
    assert b0["a"] == {"accuracy": 0.5, "mean_sequential_tokens": 1200.0, "mean_wall_s": 1.5}
    assert b0["b"] == {"accuracy": 1.0, "mean_sequential_tokens": 1250.0, "mean_wall_s": 1.25}
    assert b0["sequential_ratio"] == pytest.approx(2400 / 2500) and b0["wall_ratio"] == pytest.approx(3.0 / 2.5)
    # [8000, inf): p5, p6 (the paper's "> 8k tokens" bin)
    b3 = fixed[3]
    assert b3["a"]["accuracy"] == 0.5 and b3["b"]["accuracy"] == 0.5
    assert b3["a"]["mean_sequential_tokens"] == 5500.0 and b3["b"]["mean_sequential_tokens"] == 10500.0
    assert b3["sequential_ratio"] == pytest.approx(11000 / 21000) and b3["wall_ratio"] == pytest.approx(9 / 19)
    # quantiles: three bins of two problems each, by B's length
    q = bins["quantiles"]
    assert [(b["min_baseline_tokens"], b["max_baseline_tokens"], b["n"]) for b in q] == [
        (1000, 1500, 2), (3000, 5000, 2), (9000, 12000, 2)]
    assert q[1]["sequential_ratio"] == pytest.approx(5000 / 8000) and q[1]["a"]["accuracy"] == 1.0
    # an empty fixed bin is kept with n = 0
    assert length_bins(pairs, [100])["fixed"][0]["n"] == 0


def test_compare_reports_bins_speedups_and_never_calls_the_internal_ratio_a_gain(tmp_path, capsys):
    table = compare(A, list(reversed(B)), bins=(2000, 4000, 8000), quantiles=2)
    assert table["speedups"]["tokens"] == pytest.approx([1000 / 900, 1, 1.5, 5000 / 3000, 1.8, 2.0])
    assert table["speedups"]["wall"] == pytest.approx([1.0, 0.75, 1.5, 5 / 3, 9 / 4, 2.0])
    text = format_compare_table(table)
    assert "fixed bins" in text and "8000-inf" in text and "quantile bins" in text
    for name, rows in (("a", A), ("b", B)):
        d = tmp_path / name
        d.mkdir()
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp"
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--bins", "2000,4000,8000",
                 "--quantiles", "3", "--out", str(out)]) == 0
    saved = json.loads((out / "compare.json").read_text())
    assert [b["n"] for b in saved["length_bins"]["fixed"]] == [2, 1, 1, 2]
    for png in ("bins_by_baseline_length.png", "speedup_histogram.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--bins", "4000,2000"]) == 2
    assert "increasing positive" in capsys.readouterr().err


def test_answer_from_boxed_last_grades_a_model_without_the_format():
    tasks = [Task("h", "math", "Half of one?", "1/2"), Task("t", "math", "Two?", "2")]
    outputs = ["Let me think. It is $\\boxed{0.5}$.", "I think \\boxed{3}"]
    got = {}
    for mode in ("final_answer", "boxed_last", "auto"):
        results, report = evaluate(ScriptedEngine(list(outputs)), tasks, "sequential", prompt_fn=lambda t: t.problem,
                                   progress=False, answer_from=mode)
        got[mode] = [r["correct"] for r in results]
        assert report["meta"]["answer_from"] == mode
    assert got == {"final_answer": [False, False], "boxed_last": [True, False], "auto": [True, False]}
    with pytest.raises(ValueError, match="answer extraction"):
        evaluate(ScriptedEngine(list(outputs)), tasks, "sequential", progress=False, answer_from="box")


def test_grader_errors_are_counted_not_silently_wrong(tmp_path):
    tasks = [Task("ok", "math", "Two?", "2"), Task("broken", "countdown", "p", {"numbers": [1, 2]})]
    outputs = ["<Final Answer> 2 </Final Answer>", "<Final Answer> 1 + 2 </Final Answer>"]
    results, report = evaluate(ScriptedEngine(outputs), tasks, "sequential", prompt_fn=lambda t: t.problem,
                               progress=False, out_dir=tmp_path)
    assert [r["correct"] for r in results] == [True, False]
    assert results[0]["grader_error"] is None and results[1]["grader_error"].startswith("KeyError")
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["grader_errors"] == 1 and on_disk["grader_error_ids"] == ["broken"]


def _hash(text: str) -> str:       # the fingerprint's documented normalisation, written out again here
    norm = " ".join(unicodedata.normalize("NFKC", text).lower().split())
    return hashlib.sha256(norm.encode()).hexdigest()[:16]


def test_train_writes_the_fingerprint_and_eval_refuses_overlap(tmp_path, capsys):
    data = REPO / "tests" / "data" / "sft_tiny_sprint.jsonl"
    examples = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    out = tmp_path / "run"
    assert main(["train", "--config", str(CONFIG_DIR / "sft_tiny_cpu.yaml"), "--out", str(out), "--no-progress",
                 "--set", "steps=1", "--set", "optim.warmup_steps=0", "--set", "data.seq_len=512",
                 "--set", "tensorboard=false", "--set", "plot=false", "--set", "checkpoint.every=0"]) == 0
    meta = json.loads((out / "hf" / "sprint_jax.json").read_text())
    assert meta["train_fingerprint"]["hashes"] == sorted({_hash(e["prompt"]) for e in examples})
    # a task file with one training problem (spacing changed) and one new problem
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"id": "seen", "problem": "  " + examples[0]["prompt"].replace(" ", "  "), "answer": "1"},
            {"id": "new", "problem": "Compute 1+1.\n", "answer": "2"}]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    caps = ["--max-seq-len", "256", "--max-total-tokens", "4", "--max-planner-tokens", "4", "--no-progress"]
    capsys.readouterr()
    assert main(["eval", "--model", str(out / "hf"), "--data", str(tasks), "--out", str(tmp_path / "e1"), *caps]) == 2
    captured = capsys.readouterr()
    assert "1 of 2 evaluated problems" in captured.out and "  seen" in captured.out
    assert "--allow-overlap" in captured.err and not (tmp_path / "e1" / "report.json").exists()
    assert main(["eval", "--model", str(out / "hf"), "--data", str(tasks), "--out", str(tmp_path / "e2"),
                 "--allow-overlap", *caps]) == 0
    report = json.loads((tmp_path / "e2" / "report.json").read_text())
    assert report["meta"]["train_overlap"] == {"checked": True, "overlap": 1, "overlap_ids": ["seen"]}
    # a model without the metadata file (not trained here) is not checked
    bare = tmp_path / "bare"
    shutil.copytree(out / "hf", bare)
    (bare / "sprint_jax.json").unlink()
    assert main(["eval", "--model", str(bare), "--data", str(tasks), "--out", str(tmp_path / "e3"), *caps]) == 0


def test_quantile_bins_with_coinciding_edges_are_merged():
    """Eleven of sixteen baseline runs end at 93 tokens (e.g. a token limit): four quantile bins of
    four (cuts after the 4th, 8th and 12th) would be 93-93 twice and 93-150 once; problems of equal
    length share one bin instead (the cuts inside the 93s move past them, to the 11th)."""
    lengths = [93] * 11 + [120, 150, 400, 800, 1600]
    pairs = [(_row(f"p{i}", i % 2 == 0, n // 2, 1.0), _row(f"p{i}", i % 3 == 0, n, 2.0)) for i, n in enumerate(lengths)]
    q = length_bins(pairs, [], quantiles=4)["quantiles"]
    assert [(b["min_baseline_tokens"], b["max_baseline_tokens"], b["n"]) for b in q] == [
        (93, 93, 11), (120, 120, 1), (150, 1600, 4)]
    assert q[0]["b"]["accuracy"] == pytest.approx(4 / 11)           # p0, p3, p6, p9
    assert q[0]["a"]["mean_sequential_tokens"] == 46.0
    # a cut inside a run of equal lengths moves to the run's nearer end
    lengths = [1, 2, 3, 4, 5, 5, 5, 5, 5, 5]
    pairs = [(_row(f"p{i}", True, n, 1.0), _row(f"p{i}", True, n, 1.0)) for i, n in enumerate(lengths)]
    assert [b["n"] for b in length_bins(pairs, [], quantiles=2)["quantiles"]] == [4, 6]
    # one run's own sequential / total by length, five bins of two: the same rule (cuts after the
    # 2nd, 4th, 6th all move past the 93s, to the 8th)
    from sprint_jax.eval.report import format_compare_table, sequential_to_total_by_length
    rows = [_row(f"p{i}", True, 50, 1.0, total=t) for i, t in enumerate([93] * 8 + [200, 300])]
    assert [(b["min_length"], b["max_length"], b["n"]) for b in sequential_to_total_by_length(rows)] == [
        (93, 93, 8), (200, 300, 2)]
    a = [p[0] for p in pairs]
    text = format_compare_table(compare(a, [p[1] for p in pairs], bins=(), quantiles=5))
    assert text.count("5-5") == 1


def test_compare_names_the_file_and_field_of_an_ill_typed_value(tmp_path, capsys):
    for name, rows in (("a", A), ("b", B)):
        d = tmp_path / name
        d.mkdir()
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = [dict(r) for r in B]
    bad[2]["sequential_tokens"] = "3000"
    (tmp_path / "b" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    capsys.readouterr()
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'b' / 'results.jsonl'}:3" in err[0] and "'sequential_tokens'" in err[0]
    for field, value in (("correct", "yes"), ("wall_s", None), ("total_tokens", 1.5), ("concurrency", 0)):
        bad = [dict(r) for r in B]
        bad[0][field] = value
        (tmp_path / "b" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
        assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2, field
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"results.jsonl:1: field {field!r}" in err[0], err
    # a run without per-problem timings reads its clock from report.json: a bad value there too
    (tmp_path / "b" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in B))
    (tmp_path / "b" / "report.json").write_text(json.dumps({"n": 6, "wall_clock_s": "abc", "meta": {}}))
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "b" / "report.json") in err[0] and "'wall_clock_s'" in err[0]


def test_the_internal_ratio_plot_is_titled_by_the_run_s_kind(tmp_path, monkeypatch):
    import matplotlib.axes

    from sprint_jax.eval.report import write_plots

    titles = []
    original = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **k: (titles.append(label), original(self, label, *a, **k))[1])
    for mode, rows in (("sequential", B), ("parallel", A)):
        titles.clear()
        write_plots([{**r, "mode": mode, "stages": 1, "format_valid": True, "termination": "final_answer"}
                     for r in rows], tmp_path)
        internal = titles[-1]
        assert ("SPRINT" in internal) == (mode == "parallel"), internal
        assert (tmp_path / "sequential_to_total_by_length.png").read_bytes()[:4] == b"\x89PNG"
