"""Graders against hand-checked cases, TinyZero's scoring rules, and real MATH-500 records.
Also the task loaders (their answers are what the graders compare against)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sprint_jax.errors import UserError
from sprint_jax.tasks import Task, TaskFileError, extract_boxed, grade, load_math500, load_task_file
from sprint_jax.tasks.choice import extract_choice, grade_choice, load_choice
from sprint_jax.tasks.countdown import countdown_equation, grade_countdown
from sprint_jax.tasks.math import grade_math
from sprint_jax.tasks.sources import read_file_records


def load_math_jsonl(path, limit=None):
    return load_task_file(path, "math", limit)


def load_choice_jsonl(path, limit=None, shuffle_seed=0):
    return load_choice(read_file_records(path), Path(path).stem, limit, shuffle_seed)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{x^{2} + \sqrt{y}}", r"x^{2} + \sqrt{y}"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed 5$ done", "5"),
    (r"\fbox{7}", "7"),
    (r"\boxed{2} and an unclosed \boxed{3", "2"),
    ("no box here", None),
    (r"\boxedfoo{1}", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("pred", ["0.5", "1/2", r"\frac{1}{2}", r"\frac12", r"\dfrac{1}{2}", r"\boxed{0.5}",
                                  r"The answer is $\frac{1}{2}$.", r"so we get \boxed{\tfrac{1}{2}}", "2/4"])
def test_math_equivalent_forms(pred):
    assert grade_math(pred, r"\frac{1}{2}")
    assert grade_math(pred, "0.5")


@pytest.mark.parametrize("pred, gold, ok", [
    ("0.6", r"\frac{1}{2}", False),
    (r"\boxed{3}", "4", False),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"(3, \pi)", r"\left( 3, \frac{\pi}{2} \right)", False),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
    ("", "1", False),
    ("{{{{ \\frac", "1", False),
    ("1", "", False),
])
def test_math_hand_checked(pred, gold, ok):
    assert grade_math(pred, gold) is ok


def test_math_from_a_worker_thread():
    """Curation grades from threads; math-verify's SIGALRM timeout must not be used there."""
    out = []
    t = threading.Thread(target=lambda: out.append(grade_math(r"\boxed{0.5}", r"\frac{1}{2}")))
    t.start()
    t.join()
    assert out == [True]


def test_math500_reference_solutions_grade_correct():
    """Real data: each record's worked solution (last \\boxed{}) against its answer field; and a
    mismatched pairing (answer of the next record) is graded wrong for most records."""
    tasks = load_math500(limit=40)
    assert len(tasks) == 40 and tasks[0].id == "test/precalculus/807.json"
    assert all(grade(t, t.meta["solution"]) for t in tasks)
    wrong = sum(grade_math(t.meta["solution"], nxt.answer) for t, nxt in zip(tasks, tasks[1:]))
    assert wrong <= 2


# ---------------------------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------------------------

@given(st.text(max_size=80))
@settings(max_examples=100, deadline=None)
def test_countdown_grader_is_total(text):
    assert grade_countdown(text, 10, [1, 2, 3]) in (True, False)
    assert grade_countdown("<answer>" + text.replace("\n", " ") + "</answer>", 10, [1, 2, 3]) in (True, False)


@pytest.mark.parametrize("answer, ok", [
    ("(44 + 19) + 35", True),
    ("(44 + 19) + 35 = 98", True),
    ("<answer> 44 + 19 + 35 </answer>", True),
    (r"\boxed{44 + 19 + 35}", True),
    (r"$44 + 19 + 35$", True),
    ("44 + 19 + 34", False),
    ("44 + 19 + 35 + 0", False),
    ("44 + 54", False),
    ("-44 + 19 + 35 + 88", False),
    ("-(44 - 19 - 35) + 88", False),     # would need 88; and unary minus is not a Countdown move
    ("44 + 19 + 35.0", False),
    ("44 ** 1 + 19 + 35", False),        # only + - * / allowed in our own answers
    ("", False),
])
def test_grade_countdown(answer, ok):
    assert grade_countdown(answer, 98, [44, 19, 35]) is ok


def test_grade_countdown_is_binary_only():
    assert not grade_countdown("-44 + 19 + 35", 10, [44, 19, 35])     # Python would say 10: no unary minus
    assert grade_countdown("19 + 35 - 44", 10, [44, 19, 35])
    assert not grade_countdown("99**99**99", 1, [99, 99, 99])          # no powers, and no hang on them


def test_grade_countdown_latex_operators_and_tolerance():
    assert grade_countdown(r"\boxed{(6 \times 4) \div 2}", 12, [6, 4, 2])
    assert grade_countdown("(6 × 4) ÷ 2", 12, [6, 4, 2])
    assert countdown_equation(r"\boxed{(6 \times 4) \div 2 = 12}") == "(6 * 4) / 2"
    assert grade_countdown("(6 * 4) / 2", 12, [6, 4, 2]) and not grade_countdown("(6 * 4) / 2", 13, [6, 4, 2])
    assert grade_countdown("1 / 3 * 3", 1, [1, 3, 3]) and grade_countdown("10 / 4", 2.5, [10, 4])   # true division
    assert not grade_countdown("5 / (3 - 3)", 1, [5, 3, 3])                                          # x / 0


# ---------------------------------------------------------------------------------------------
# Multiple choice and dispatch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, letter", [
    ("The answer is (C).", "C"),
    ("C", "C"),
    ("(b)", None),
    (r"so \boxed{B}", "B"),
    (r"\boxed{\text{D}}", "D"),
    ("Answer: D", "D"),
    ("I think the answer is A because", "A"),
    ("A) 3\nB) 4\nC) 5", None),           # a list of options is not an answer
    ("C) because it is larger", "C"),
    ("no idea", None),
])
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_grade_dispatch():
    assert grade(Task("m", "math", "", r"\frac{1}{2}"), "0.5")
    assert not grade(Task("m", "math", "", r"\frac{1}{2}"), "0.6")
    assert grade(Task("c", "countdown", "", {"target": 98, "numbers": [44, 19, 35]}), "44 + 19 + 35")
    assert grade(Task("q", "choice", "", "B"), "The answer is B")
    assert not grade(Task("q", "choice", "", "B"), "The answer is C")
    assert grade_choice("(E)", "E", letters="ABCDE")
    assert grade(Task("q", "choice", "", "E", meta={"choices": list("abcde")}), "E")
    with pytest.raises(ValueError, match="no grader"):
        grade(Task("x", "poetry", "", ""), "a")


# ---------------------------------------------------------------------------------------------
# Task loaders
# ---------------------------------------------------------------------------------------------

def _write(tmp_path: Path, lines: list) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_load_math(tmp_path):
    tasks = load_math500()
    assert len(tasks) == 500 and len({t.id for t in tasks}) == 500
    assert tasks[0].answer == r"\left( 3, \frac{\pi}{2} \right)" and tasks[0].meta["level"] == 2
    assert load_math500(limit=3) == tasks[:3]
    p = _write(tmp_path, [{"problem": "1+1?", "answer": 2}, "", {"question": "x?", "solution": r"so \boxed{4}"}])
    got = load_math_jsonl(p)
    assert [(t.id, t.problem, t.answer) for t in got] == [("t-1", "1+1?", "2"), ("t-2", "x?", "4")]


@pytest.mark.parametrize("lines, match", [
    (['{"problem": "a", "answer": "1"}', "{not json"], r"t\.jsonl:2: not valid JSON"),
    ([{"answer": "1"}], r":1: missing field 'problem' or 'question'"),
    ([{"problem": "a"}], r":1: missing field 'answer'"),
    ([[1, 2]], r":1: expected a JSON object"),
    ([{"problem": ["a"], "answer": "1"}], "must be str"),
    ([{"problem": "a", "answer": "1", "id": "x"}, {"problem": "b", "answer": "2", "id": "x"}], "duplicate task id"),
])
def test_load_math_errors_name_the_line(tmp_path, lines, match):
    with pytest.raises(TaskFileError, match=match) as err:
        load_math_jsonl(_write(tmp_path, lines))
    assert isinstance(err.value, UserError)


def test_load_math_missing_file(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist"):
        load_math_jsonl(tmp_path / "nope.jsonl")


def test_load_choice_formats(tmp_path):
    gpqa = {"Record ID": "rec1", "Question": "Which?", "Correct Answer": "right",
            "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"}
    p = _write(tmp_path, [
        {"id": "a", "question": "Pick", "choices": ["x", "y", "z"], "answer": "C"},
        {"id": "b", "question": "Pick", "choices": {"A": "x", "B": "y"}, "answer": 0},
        {"id": "c", "question": "Pick one. (A) 1 (B) 2 (C) 3 (D) 4", "answer": "(D)"},
        gpqa,
    ])
    a, b, c, g = load_choice_jsonl(p)
    assert (a.answer, a.problem) == ("C", "Pick\n\nA) x\nB) y\nC) z")
    assert (b.answer, b.meta["choices"]) == ("A", ["x", "y"])
    assert (c.answer, c.meta["choices"], c.problem) == ("D", [], "Pick one. (A) 1 (B) 2 (C) 3 (D) 4")
    assert g.id == "rec1" and sorted(g.meta["choices"]) == ["right", "w1", "w2", "w3"]
    assert g.meta["choices"]["ABCD".index(g.answer)] == "right"
    assert load_choice_jsonl(p)[3] == g                                  # deterministic shuffle
    orders = {tuple(load_choice_jsonl(p, shuffle_seed=s)[3].meta["choices"]) for s in range(12)}
    assert len(orders) > 1


@pytest.mark.parametrize("record, match", [
    ({"question": "q", "choices": ["x", "y"], "answer": "C"}, "only 2 choices"),
    ({"question": "q", "choices": ["x", "y"], "answer": 5}, "out of range"),
    ({"question": "q", "choices": ["x"], "answer": "A"}, "2..10 choices"),
    ({"question": "q", "choices": {"B": "x", "A": "y"}, "answer": "A"}, "in order"),
    ({"question": "q", "choices": ["x", "y"]}, "missing field 'answer'"),
    ({"question": "q", "answer": "maybe"}, "letter"),
])
def test_load_choice_errors(tmp_path, record, match):
    with pytest.raises(TaskFileError, match=match):
        load_choice_jsonl(_write(tmp_path, [record]))
