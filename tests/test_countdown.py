"""Countdown: generated instances are solvable, the prompt is TinyZero's, the solver's search is true."""
from __future__ import annotations

import itertools
import re
from fractions import Fraction

import pytest

from sprint_jax.tasks import countdown
from sprint_jax.tasks.types import Task
from sprint_jax.tasks import grade
from sprint_jax.tasks.countdown import grade_countdown


def whole_number_reachable(values: list[int], target: int) -> bool:
    """Independent brute force: can the values reach target, all intermediates whole numbers >= 0?"""
    if len(values) == 1:
        return values[0] == target
    for i, j in itertools.combinations(range(len(values)), 2):
        a, b = values[i], values[j]
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        results = {a + b, a * b, abs(a - b)}
        if b and a % b == 0:
            results.add(a // b)
        if a and b % a == 0:
            results.add(b // a)
        if any(whole_number_reachable(rest + [r], target) for r in results):
            return True
    return False


def test_generate_is_deterministic_solvable_and_distinct():
    tasks = countdown.generate(60, seed=7)
    assert tasks == countdown.generate(60, seed=7)
    assert tasks != countdown.generate(60, seed=8)
    assert len({(tuple(sorted(t.answer["numbers"])), t.answer["target"]) for t in tasks}) == 60
    assert len({t.id for t in tasks}) == 60
    sizes = {len(t.answer["numbers"]) for t in tasks}
    assert sizes == {3, 4}
    for t in tasks:
        assert t.kind == "countdown"
        assert 10 <= t.answer["target"] <= 100
        assert all(1 <= n <= 99 for n in t.answer["numbers"])
        # the construction uses every number once and evaluates to the target (checked by the grader)
        assert grade_countdown(t.meta["construction"], t.answer["target"], t.answer["numbers"])
        assert whole_number_reachable(t.answer["numbers"], t.answer["target"])


def test_generate_options_and_errors():
    three = countdown.generate(10, seed=0, min_numbers=3, max_numbers=3, max_number=20, max_target=50)
    assert all(len(t.answer["numbers"]) == 3 and max(t.answer["numbers"]) <= 20 for t in three)
    with pytest.raises(ValueError, match="min_numbers"):
        countdown.generate(1, seed=0, min_numbers=5, max_numbers=4)
    with pytest.raises(ValueError, match="distinct tasks"):
        countdown.generate(50, seed=0, min_numbers=2, max_numbers=2, max_number=2, max_tries=20)


TASK = Task("cd", "countdown", "", {"target": 98, "numbers": [44, 19, 35]})


def test_prompt_is_tinyzero_verbatim():
    assert countdown.prompt_for(TASK) == (
        "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
        "The assistant first thinks about the reasoning process in the mind and then provides the user with "
        "the answer.\n"
        "User: Using the numbers [44, 19, 35], create an equation that equals 98. You can use basic arithmetic "
        "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
        "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\n"
        "Assistant: Let me solve this step by step.\n<think>")
    qwen = countdown.prompt_for(TASK, "qwen-instruct")
    assert qwen.startswith("<|im_start|>system\nYou are a helpful assistant. You first thinks about")
    assert "<|im_start|>user\n Using the numbers [44, 19, 35], create" in qwen
    assert qwen.endswith("</answer>.<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>")
    with pytest.raises(ValueError, match="template"):
        countdown.prompt_for(TASK, "chatml")
    with pytest.raises(ValueError, match="Countdown answer"):
        countdown.prompt_for(Task("x", "countdown", "", "98"))


def test_solve_trace_is_deterministic_and_correct():
    trace = countdown.solve_trace(TASK, seed=3)
    assert trace == countdown.solve_trace(TASK, seed=3)
    assert grade(TASK, trace.final_answer)
    assert trace.text.endswith(f"So the equation is {trace.final_answer} = 98.")
    texts = {countdown.solve_trace(TASK, seed=s).text for s in range(8)}
    assert len(texts) > 1                     # the seed changes the search order


_ATTEMPT = re.compile(r"(?:with|begin with|start with|Try|opening with) (\d+) ([-+*/]) (\d+)")


@pytest.mark.parametrize("seed", range(12))
def test_attempts_are_true_and_independent(seed):
    task = countdown.generate(1, seed=100 + seed)[0]
    target, numbers = task.answer["target"], task.answer["numbers"]
    trace = countdown.solve_trace(task, seed=seed)
    paragraphs = trace.text.split("\n\n")
    attempts = paragraphs[1:-2]
    assert 2 <= len(attempts) <= 4
    for k, para in enumerate(attempts):
        x, op, y = _ATTEMPT.search(para.split(".")[0] + ".").groups()
        x, y = int(x), int(y)
        rest = list(numbers)
        rest.remove(x)
        rest.remove(y)                       # each attempt starts from the problem's own numbers
        r = {"+": x + y, "-": x - y, "*": x * y, "/": Fraction(x, y) if y else None}[op]
        assert r is not None and r == int(r) and r >= 0
        works = whole_number_reachable(rest + [int(r)], target)
        assert ("does not work" in para) != works, para
        assert works or k < len(attempts) - 1          # the search stops at a working start
    # every "a op b = c" written anywhere in the trace is true arithmetic
    for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", trace.text):
        a, b, c = int(a), int(b), int(c)
        assert {"+": a + b, "-": a - b, "*": a * b, "/": Fraction(a, b)}[op] == c


def test_every_first_move_works():
    """[95, 95, 95, 6] -> 89: no first move fails, so two independent working routes are shown."""
    task = Task("d", "countdown", "", {"target": 89, "numbers": [95, 6, 95, 95]})
    trace = countdown.solve_trace(task, seed=0)
    attempts = trace.text.split("\n\n")[1:-2]
    assert len(attempts) == 2 and all(a.endswith("works.") for a in attempts)
    assert grade(task, trace.final_answer)


def test_unsolvable_raises():
    with pytest.raises(ValueError, match="no equation"):
        countdown.solve_trace(Task("u", "countdown", "", {"target": 1000, "numbers": [1, 2, 3]}))
