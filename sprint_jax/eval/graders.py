"""Answer graders: the one place that decides correctness.

Used twice with the same code: by the curation correctness filter (paper §4: only traces whose
final answer is correct are restructured) and by evaluation. Three task kinds:

* math      - math-verify (`parse` + `verify`), so 1/2, 0.5 and \\frac{1}{2} are the same answer;
* countdown - TinyZero's rule-based reward (`countdown_score`), and a strict equation check for our
              own final answers (`grade_countdown`); both run on one shared core;
* choice    - a multiple-choice letter (GPQA-style).

Every grader is total on text: odd model output is graded wrong, never raised.
"""
from __future__ import annotations

import ast
import functools
import operator
import re
import threading
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------
# \boxed{...}
# ---------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def extract_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces respected,
    stripped. `\\boxed 5` (no braces) gives the token after it. None when there is no box."""
    if not isinstance(text, str):
        return None
    for m in reversed(list(_BOXED.finditer(text))):
        rest = text[m.end():].lstrip()
        if not rest:
            continue
        if rest[0] != "{":
            token = re.match(r"[^\s${}]+", rest)
            if token:
                return token.group(0)
            continue
        depth = 0
        for k, ch in enumerate(rest):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return rest[1:k].strip()
        # unclosed: an earlier complete box may still exist
    return None


# ---------------------------------------------------------------------------------------------
# math (math-verify)
# ---------------------------------------------------------------------------------------------

def _mv_parse(text: str) -> list:
    from math_verify import parse
    # math-verify's timeouts use SIGALRM, which only the main thread may set (curation grades
    # from worker threads); elsewhere parse without a timeout.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return parse(text, parsing_timeout=timeout)


def _math_candidates(text: str) -> list[str]:
    boxed = extract_boxed(text)
    if boxed is not None:
        return ["$" + boxed + "$", "\\boxed{" + boxed + "}"]
    stripped = text.strip()
    if "$" in stripped or "\\(" in stripped or "\\[" in stripped:
        return [stripped]
    # a bare answer ("\frac{1}{2}", "0.5"): as inline math first, then as free text
    return ["$" + stripped + "$", stripped]


def _parse_first(candidates: list[str]) -> list:
    for c in candidates:
        parsed = _mv_parse(c)
        if parsed:
            return parsed
    return []


def grade_math(prediction_text: str, gold: str) -> bool:
    """True when the prediction's answer (its last \\boxed{...}, else the whole text as a bare
    answer) is mathematically equal to `gold` under math-verify."""
    from math_verify import verify
    if not isinstance(prediction_text, str) or not prediction_text.strip():
        return False
    gold = str(gold).strip()
    if not gold:
        return False
    try:
        gold_parsed = _parse_first(["$" + gold + "$", gold])
        pred_parsed = _parse_first(_math_candidates(prediction_text))
        if not gold_parsed or not pred_parsed:
            return False
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # math-verify on adversarial LaTeX: graded wrong, never a crash
        return False


# ---------------------------------------------------------------------------------------------
# Countdown: one core for TinyZero's reward and for our strict equation check
# ---------------------------------------------------------------------------------------------

_TINYZERO_CHARS = re.compile(r"^[\d+\-*/().\s]+$")
_STRICT_CHARS = re.compile(r"^[0-9+\-*/()\s]+$")
_TOLERANCE = 1e-5
# Python would compute 99**99**99 for ever; TinyZero's `eval` hangs on it. A power whose result
# would exceed this many bits is an evaluation error instead (score: format_score, the same score
# any finite value that large gets since it cannot equal a Countdown target).
_MAX_POW_BITS = 1 << 16

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
}
_STRICT_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)


class _EvalError(Exception):
    pass


def _pow(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        if b * a.bit_length() > _MAX_POW_BITS:
            raise _EvalError("power too large")
    return operator.pow(a, b)


def _evaluate(node: ast.AST, strict: bool) -> Any:
    """Python's own arithmetic on the parsed expression (identical results to `eval` with no
    builtins for everything the character whitelist admits), minus unbounded powers. `strict`:
    only integer literals and binary + - * /."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, strict)
    if isinstance(node, ast.Constant):
        if strict and not (type(node.value) is int):
            raise _EvalError(f"literal {node.value!r} not allowed")
        return node.value
    if isinstance(node, ast.BinOp):
        if strict and not isinstance(node.op, _STRICT_BINOPS):
            raise _EvalError(f"operator {type(node.op).__name__} not allowed")
        fn = _pow if isinstance(node.op, ast.Pow) else _BINOPS.get(type(node.op))
        if fn is None:
            raise _EvalError(f"operator {type(node.op).__name__} not allowed")
        return fn(_evaluate(node.left, strict), _evaluate(node.right, strict))
    if isinstance(node, ast.UnaryOp) and not strict:
        if isinstance(node.op, ast.USub):
            return -_evaluate(node.operand, strict)
        if isinstance(node.op, ast.UAdd):
            return +_evaluate(node.operand, strict)
    if isinstance(node, ast.Tuple) and not strict:
        return tuple(_evaluate(e, strict) for e in node.elts)
    raise _EvalError(f"{type(node).__name__} not allowed")


def _numbers_match(equation: str, numbers: list[int]) -> bool:
    """Every given number used exactly once and no other integer literal (TinyZero's check:
    all `\\d+` runs, as ints, sorted, equal the sorted numbers)."""
    try:
        used = sorted(int(n) for n in re.findall(r"\d+", equation))
        return used == sorted(int(n) for n in numbers)
    except (ValueError, TypeError):
        return False


def _equation_value(equation: str, strict: bool) -> Any:
    """The value of the equation, or None when it does not pass the whitelist or fails to evaluate."""
    allowed = _STRICT_CHARS if strict else _TINYZERO_CHARS
    if not allowed.match(equation):
        return None
    try:
        return _evaluate(ast.parse(equation, mode="eval"), strict)
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError, _EvalError):
        return None


def _hits_target(value: Any, target: float) -> bool:
    try:
        return bool(abs(value - target) < _TOLERANCE)
    except Exception:  # a tuple, Ellipsis: TinyZero's bare except gives the format score
        return False


def _tinyzero_equation(solution_str: str) -> str | None:
    """TinyZero's extraction: after the first "Assistant:" (else "<|im_start|>assistant"), the
    last line, the last non-greedy <answer>...</answer> on it, stripped."""
    for marker in ("Assistant:", "<|im_start|>assistant"):
        if marker in solution_str:
            rest = solution_str.split(marker, 1)[1]
            break
    else:
        return None
    last_line = rest.split("\n")[-1]
    matches = re.findall(r"<answer>(.*?)</answer>", last_line)
    return matches[-1].strip() if matches else None


def countdown_score(solution_str: str, target: float, numbers: list[int],
                    format_score: float = 0.1, score: float = 1.0) -> float:
    """TinyZero's Countdown reward (verl/utils/reward_score/countdown.py), see
    shared/data/SOURCES.md: 0 without an extractable <answer>; `format_score` when the numbers
    do not match or the equation fails the whitelist / evaluation / target check; `score` when
    it evaluates to the target within 1e-5. `solution_str` is prompt + response."""
    if not isinstance(solution_str, str):
        return 0
    equation = _tinyzero_equation(solution_str)
    if equation is None:
        return 0
    if not _numbers_match(equation, numbers):
        return format_score
    value = _equation_value(equation, strict=False)
    if value is None:
        return format_score
    return score if _hits_target(value, target) else format_score


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
    parentheses (no unary minus, no ** or //), value equal to the target within TinyZero's 1e-5.
    Same core as `countdown_score` (number check, evaluator, tolerance), stricter whitelist."""
    if not isinstance(equation_or_text, str):
        return False
    eq = countdown_equation(equation_or_text)
    if not eq or not _numbers_match(eq, numbers):
        return False
    value = _equation_value(eq, strict=True)
    return value is not None and _hits_target(value, target)


# ---------------------------------------------------------------------------------------------
# multiple choice
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _choice_patterns(letters: str) -> list[re.Pattern]:
    L = "[" + re.escape(letters) + "]"
    return [
        re.compile(rf"\\boxed\s*\{{\s*\(?\s*(?:\\text\{{\s*)?({L})\s*\}}?\s*\)?\s*\}}"),
        re.compile(rf"(?i:answer)(?:\s+is)?\s*[:\-]?\s*(?i:option|choice)?\s*\**\(?({L})\)?(?![A-Za-z0-9])"),
        re.compile(rf"^\s*\**\(?({L})\)?\**[.:)]?\s*$"),
        re.compile(rf"^\s*\(?({L})[).:]\s", re.M),
    ]


def extract_choice(text: str, letters: str = "ABCD") -> str | None:
    """The chosen letter among `letters`: the last \\boxed{X}, else the last "answer is (X)" /
    "Answer: X", else a text that is only a letter ("C", "(C)", "C."), else the letter of the only line
    that starts "C) ..." (several such lines are a list of options, not an answer)."""
    if not isinstance(text, str):
        return None
    *answer_patterns, line_pattern = _choice_patterns(letters.upper())
    for pattern in answer_patterns:
        matches = pattern.findall(text)
        if matches:
            return matches[-1].upper()
    lines = set(line_pattern.findall(text))
    return lines.pop().upper() if len(lines) == 1 else None   # several "X) ..." lines: a list of options


def grade_choice(text: str, gold_letter: str, letters: str = "ABCD") -> bool:
    gold = str(gold_letter).strip().strip("()").upper()
    if gold not in letters.upper():
        letters = letters + gold
    got = extract_choice(text, letters)
    return got is not None and got == gold


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------

def grade(task: Any, final_answer_text: str) -> bool:
    """Grade a final answer against `task.answer` by `task.kind` ("math" | "countdown" | "choice")."""
    kind = getattr(task, "kind", None)
    if kind == "math":
        return grade_math(final_answer_text, task.answer)
    if kind == "countdown":
        answer = task.answer
        return grade_countdown(final_answer_text, answer["target"], answer["numbers"])
    if kind == "chains":
        from sprint_jax.curation import chains
        return chains.grade(task, final_answer_text)
    if kind == "choice":
        n = len(getattr(task, "meta", {}).get("choices") or "ABCD")
        return grade_choice(final_answer_text, task.answer, "ABCDEFGHIJ"[:max(1, min(n, 10))])
    raise ValueError(f"no grader for task kind {kind!r}; expected 'math', 'countdown', 'choice' or 'chains'")


__all__ = ["extract_boxed", "grade_math", "countdown_score", "countdown_equation", "grade_countdown",
           "extract_choice", "grade_choice", "grade"]
