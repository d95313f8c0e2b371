"""Countdown: solvable instances, TinyZero's prompt, and a programmatic teacher that writes its search.

Task format, prompt and reward follow TinyZero (Jiayi-Pan/TinyZero, Apache-2.0): 3-4
numbers and a target; use + - * / and each number once. TinyZero loads a fixed HF dataset; we
generate instead, building the target from a random expression over *all* the numbers (every
intermediate a whole number >= 0), so every instance is solvable.

`solve_trace` is the offline teacher (paper §4 needs serial traces to restructure). It is a real
search: it tries first moves (a pair of numbers and an operation), one attempt per paragraph, and
for each attempt decides with an exhaustive search over the remaining numbers whether it can reach
the target. Attempts use only the problem's numbers, never each other's results, so they are
independent work that SPRINT can run in parallel; the check of the found equation depends on the
successful attempt, and the conclusion on the check. Paragraph layout (blank-line separated; the
first sentence of a paragraph is its plan, the rest its execution) is what
`sprint_jax.curation.offline` splits on.
"""
from __future__ import annotations

import ast
import functools
import operator
import random
import re
from typing import Any, Callable, Sequence

from sprint_jax.tasks.answers import extract_boxed
from sprint_jax.tasks.types import Task, Trace

TEMPLATES = ("base", "qwen-instruct")

_INSTRUCTION = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> "
    "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)
_BASE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer.\nUser: {instruction}\nAssistant: Let me solve this step by step.\n<think>"
)
_QWEN_INSTRUCT = (
    "<|im_start|>system\nYou are a helpful assistant. You first thinks about the reasoning process in the "
    "mind and then provides the user with the answer.<|im_end|>\n<|im_start|>user\n {instruction}<|im_end|>\n"
    "<|im_start|>assistant\nLet me solve this step by step.\n<think>"
)


def instruction(numbers: Sequence[int], target: int) -> str:
    """TinyZero's user sentence; `numbers` is shown as a Python list repr, e.g. [44, 19, 35]."""
    return _INSTRUCTION.format(numbers=list(numbers), target=target)


def prompt_for(task: Task, template: str = "base") -> str:
    """TinyZero's prompt for a Countdown task. "base" ends exactly at `<think>` (no newline)."""
    target, numbers = _ground_truth(task)
    text = instruction(numbers, target)
    if template == "base":
        return _BASE.format(instruction=text)
    if template == "qwen-instruct":
        return _QWEN_INSTRUCT.format(instruction=text)
    raise ValueError(f"unknown Countdown template {template!r}; choose from {list(TEMPLATES)}")


def _ground_truth(task: Task) -> tuple[int, list[int]]:
    answer = task.answer
    if not isinstance(answer, dict) or "target" not in answer or "numbers" not in answer:
        raise ValueError(f"task {task.id!r}: a Countdown answer is {{'target': int, 'numbers': [int]}}, "
                         f"got {answer!r}")
    return int(answer["target"]), [int(n) for n in answer["numbers"]]


# ---------------------------------------------------------------------------------------------
# Moves: one binary operation on two whole numbers, with a whole-number result
# ---------------------------------------------------------------------------------------------

def _moves(a: int, b: int) -> list[tuple[int, str, int, int]]:
    """Every (x, op, y, result) combining a and b into a whole number >= 0, larger operand first
    for - and /."""
    hi, lo = (a, b) if a >= b else (b, a)
    out = [(hi, "+", lo, hi + lo), (hi, "-", lo, hi - lo), (hi, "*", lo, hi * lo)]
    if lo != 0 and hi % lo == 0:
        out.append((hi, "/", lo, hi // lo))
    return out


@functools.lru_cache(maxsize=200_000)
def _solve(values: tuple[int, ...], target: int) -> tuple[tuple[int, str, int, int], ...] | None:
    """A shortest list of moves that reduces the sorted multiset `values` to exactly [target]
    using every value, or None. Exhaustive (at most 4 values: a few thousand states)."""
    if len(values) == 1:
        return () if values[0] == target else None
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            rest = values[:i] + values[i + 1:j] + values[j + 1:]
            for move in _moves(values[i], values[j]):
                sub = _solve(tuple(sorted(rest + (move[3],))), target)
                if sub is not None:
                    return (move,) + sub
    return None


def _fmt(expr: str, top: bool) -> str:
    return expr if top or expr.isdigit() else f"({expr})"


class _Pool:
    """Numbers still available, each with the expression that produced it."""

    def __init__(self, numbers: Sequence[int]):
        self.items: list[tuple[int, str]] = [(n, str(n)) for n in numbers]

    def apply(self, move: tuple[int, str, int, int]) -> None:
        x, op, y, r = move
        ix = next(k for k, (v, _) in enumerate(self.items) if v == x)
        ex = self.items.pop(ix)[1]
        iy = next(k for k, (v, _) in enumerate(self.items) if v == y)
        ey = self.items.pop(iy)[1]
        self.items.append((r, f"{_fmt(ex, False)} {op} {_fmt(ey, False)}"))

    @property
    def values(self) -> list[int]:
        return [v for v, _ in self.items]


def _say_list(values: Sequence[int]) -> str:
    vs = [str(v) for v in values]
    return vs[0] if len(vs) == 1 else ", ".join(vs[:-1]) + " and " + vs[-1]


# ---------------------------------------------------------------------------------------------
# Instances
# ---------------------------------------------------------------------------------------------

def generate(n: int, seed: int, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99,
             min_target: int = 10, max_target: int = 100, max_tries: int = 10_000) -> list[Task]:
    """`n` distinct solvable Countdown tasks, deterministic for `seed`.

    Each task draws 3-4 numbers in 1..max_number and combines *all* of them in a random order with
    random operations (every intermediate a whole number >= 0); an expression whose value lands in
    [min_target, max_target] gives the target. The construction is kept in `meta["construction"]`.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 2 <= min_numbers <= max_numbers:
        raise ValueError(f"need 2 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
    if max_number < 1 or not 0 <= min_target <= max_target:
        raise ValueError("need max_number >= 1 and 0 <= min_target <= max_target")
    rng = random.Random(seed)
    tasks: list[Task] = []
    seen: set[tuple] = set()
    tries = 0
    while len(tasks) < n:
        tries += 1
        if tries > max_tries * max(1, n):
            raise ValueError(f"could not build {n} distinct tasks in range [{min_target}, {max_target}]; "
                             "widen the target range or max_number")
        k = rng.randint(min_numbers, max_numbers)
        numbers = [rng.randint(1, max_number) for _ in range(k)]
        pool = [(v, str(v)) for v in numbers]
        while len(pool) > 1:
            (a, ea), (b, eb) = [pool.pop(rng.randrange(len(pool))) for _ in range(2)]
            x, op, y, r = rng.choice(_moves(a, b))
            ex, ey = (ea, eb) if x == a and (y == b) else (eb, ea)
            pool.append((r, f"{_fmt(ex, False)} {op} {_fmt(ey, False)}"))
        target, expr = pool[0]
        key = (tuple(sorted(numbers)), target)
        if not min_target <= target <= max_target or key in seen:
            continue
        seen.add(key)
        idx = len(tasks)
        tasks.append(Task(id=f"countdown-{seed}-{idx}", kind="countdown", problem=instruction(numbers, target),
                          answer={"target": target, "numbers": numbers},
                          meta={"construction": _fmt(expr, True)}))
    return tasks


# ---------------------------------------------------------------------------------------------
# The programmatic teacher
# ---------------------------------------------------------------------------------------------

_ATTEMPT_PLANS = (
    "Try {x} {op} {y} as the first step.",
    "Consider starting with {x} {op} {y}.",
    "Another option is to begin with {x} {op} {y}.",
    "What if we start with {x} {op} {y}?",
    "Try opening with {x} {op} {y}.",
)


def _two_left(a: int, b: int, target: int) -> str:
    """Every whole-number way to finish from two values, written out."""
    parts = [f"{x} {op} {y} = {r}" for x, op, y, r in _moves(a, b)]
    hi, lo = max(a, b), min(a, b)
    if lo == 0:
        parts.append(f"{hi} / 0 is undefined")
    elif hi % lo:
        parts.append(f"{hi} / {lo} is not a whole number")
    return f"The ways to finish are {', '.join(parts[:-1])} and {parts[-1]}; none of them is {target}."


def _three_left(values: list[int], target: int) -> str:
    """For each pair among three values, the finish that comes closest to the target."""
    sentences = []
    for i in range(3):
        for j in range(i + 1, 3):
            other = values[3 - i - j]
            best = None
            for x, op, y, r in _moves(values[i], values[j]):
                for x2, op2, y2, r2 in _moves(r, other):
                    if best is None or abs(r2 - target) < abs(best[1][3] - target):
                        best = ((x, op, y, r), (x2, op2, y2, r2))
            (x, op, y, r), (x2, op2, y2, r2) = best
            sentences.append(f"Pairing {values[i]} and {values[j]} first, the closest finish is "
                             f"{x} {op} {y} = {r} and {x2} {op2} {y2} = {r2}.")
    return " ".join(sentences) + f" None of these is {target}, and no other order of operations on " \
                                 f"{_say_list(values)} reaches it either."


def _attempt_failure(move: tuple[int, str, int, int], numbers: list[int], target: int) -> str:
    pool = _Pool(numbers)
    pool.apply(move)
    x, op, y, r = move
    left = pool.values
    text = f"{x} {op} {y} = {r}, which leaves {_say_list(left)}. "
    if len(left) == 1:
        text += f"That is not {target}."
    elif len(left) == 2:
        text += _two_left(left[0], left[1], target)
    else:
        text += _three_left(left, target)
    return text + " So this start does not work."


def _attempt_success(move: tuple[int, str, int, int], numbers: list[int], target: int
                     ) -> tuple[str, str, list[tuple[int, str, int, int]]]:
    pool = _Pool(numbers)
    pool.apply(move)
    x, op, y, r = move
    text = f"{x} {op} {y} = {r}, which leaves {_say_list(pool.values)}."
    rest = _solve(tuple(sorted(pool.values)), target)
    assert rest is not None
    for m in rest:
        pool.apply(m)
        text += f" Then {m[0]} {m[1]} {m[2]} = {m[3]}."
    equation = _fmt(pool.items[0][1], True)
    text += f" That reaches the target, so {equation} = {target} works."
    return text, equation, [move, *rest]


def solve_trace(task: Task, seed: int = 0, max_failed_attempts: int = 3) -> Trace:
    """A serial natural-language search for `task`, deterministic for (task, seed).

    Paragraphs: the setup; 1..max_failed_attempts failed first moves and then a successful one
    (first moves in a seeded order, each checked exhaustively; when no first move fails, two
    working ones); a check of the equation found last; the conclusion. `Trace.final_answer` is the equation, e.g. "(44 + 19) + 35".
    Raises ValueError when no whole-number solution exists.
    """
    target, numbers = _ground_truth(task)
    if len(numbers) < 2:
        raise ValueError(f"task {task.id!r}: Countdown needs at least 2 numbers, got {numbers}")
    rng = random.Random(f"{seed}:{task.id}:{target}:{numbers}")
    first_moves = []
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            rest = numbers[:i] + numbers[i + 1:j] + numbers[j + 1:]
            for move in _moves(numbers[i], numbers[j]):
                works = _solve(tuple(sorted(rest + [move[3]])), target) is not None
                first_moves.append((move, works))
    rng.shuffle(first_moves)
    successes = [m for m, ok in first_moves if ok]
    failures = [m for m, ok in first_moves if not ok]
    if not successes:
        raise ValueError(f"task {task.id!r}: no equation over {numbers} with whole-number steps reaches {target}")
    n_fail = rng.randint(1, min(max_failed_attempts, len(failures))) if failures and max_failed_attempts > 0 else 0
    # when every first move works (e.g. [95, 95, 95, 6]) two independent routes are shown instead
    attempts = failures[:n_fail] + successes[:1] if n_fail else successes[:2]

    paragraphs = [f"We need to reach {target} from {_say_list(numbers)}, using each number exactly once "
                  f"with +, -, * and /, and keeping every intermediate result a whole number."]
    equation, path = "", []
    for move in attempts:
        x, op, y, _ = move
        plan = rng.choice(_ATTEMPT_PLANS).format(x=x, op=op, y=y)
        if move in successes:
            body, equation, path = _attempt_success(move, numbers, target)
        else:
            body = _attempt_failure(move, numbers, target)
        paragraphs.append(plan + " " + body)
    recompute = ", then ".join(f"{x} {op} {y} = {r}" for x, op, y, r in path)
    paragraphs.append(f"Check the equation found above, {equation}, from the start. {recompute}, which is "
                      f"the target, and {_say_list(sorted(numbers))} are each used exactly once.")
    paragraphs.append(f"So the equation is {equation} = {target}.")
    return Trace(task_id=task.id, text="\n\n".join(paragraphs), final_answer=equation, teacher="countdown-solver")




# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------
_EQUATION_CHARS = re.compile(r"^[0-9+\-*/()\s]+$")
_TOLERANCE = 1e-5                    # TinyZero's
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
}


class _EvalError(Exception):
    pass


def _evaluate(node: ast.AST) -> Any:
    """Python's own arithmetic on the parsed expression, admitting only integer literals and
    binary + - * / (no unary minus, no ** or //: not Countdown moves)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise _EvalError(f"literal {node.value!r} not allowed")
        return node.value
    if isinstance(node, ast.BinOp):
        fn = _BINOPS.get(type(node.op))
        if fn is None:
            raise _EvalError(f"operator {type(node.op).__name__} not allowed")
        return fn(_evaluate(node.left), _evaluate(node.right))
    raise _EvalError(f"{type(node).__name__} not allowed")


def _numbers_match(equation: str, numbers: list[int]) -> bool:
    """Every given number used exactly once and no other integer literal (TinyZero's check:
    all `\\d+` runs, as ints, sorted, equal the sorted numbers)."""
    try:
        used = sorted(int(n) for n in re.findall(r"\d+", equation))
        return used == sorted(int(n) for n in numbers)
    except (ValueError, TypeError):
        return False


def _equation_value(equation: str) -> Any:
    """The value of the equation, or None when it does not pass the whitelist or fails to evaluate."""
    if not _EQUATION_CHARS.match(equation):
        return None
    try:
        return _evaluate(ast.parse(equation, mode="eval"))
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError, _EvalError):
        return None


def _hits_target(value: Any, target: float) -> bool:
    try:
        return bool(abs(value - target) < _TOLERANCE)
    except Exception:
        return False


_LATEX_OPS = [(r"\times", "*"), (r"\cdot", "*"), (r"\div", "/"), ("×", "*"), ("÷", "/"), ("−", "-"),
              (r"\left", ""), (r"\right", ""), ("$", "")]


def countdown_equation(text: str) -> str:
    """Our final answer -> the bare equation: the last <answer>...</answer> or \\boxed{...} if
    present, LaTeX / unicode operators mapped to + - * /, and a trailing `= value` dropped."""
    eq = text.strip()
    answers = re.findall(r"<answer>(.*?)</answer>", eq, flags=re.S)
    if answers:
        eq = answers[-1]
    else:
        boxed = extract_boxed(eq)
        if boxed is not None:
            eq = boxed
    for src, dst in _LATEX_OPS:
        eq = eq.replace(src, dst)
    if "=" in eq:
        eq = eq.split("=", 1)[0]
    return eq.strip()


def grade_countdown(equation_or_text: str, target: float, numbers: list[int]) -> bool:
    """Our own final answers: every number exactly once, only integer literals, binary + - * / and
    parentheses (no unary minus, no ** or //), value equal to the target within TinyZero's 1e-5."""
    if not isinstance(equation_or_text, str):
        return False
    eq = countdown_equation(equation_or_text)
    if not eq or not _numbers_match(eq, numbers):
        return False
    value = _equation_value(eq)
    return value is not None and _hits_target(value, target)


def grade(task: Task, text: str) -> bool:
    answer = task.answer
    return grade_countdown(text, answer["target"], answer["numbers"])


__all__ = ["TEMPLATES", "instruction", "prompt_for", "generate", "solve_trace", "countdown_equation",
           "grade_countdown", "grade"]
