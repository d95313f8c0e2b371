"""MATH-style tasks: records with a problem and an answer; graded with math-verify.

The prompt is the problem text itself (what the teacher and the fine-tuned model both see).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable

from sprint_jax.tasks.answers import extract_boxed
from sprint_jax.tasks.types import Task, TaskFileError

MATH500 = "math500.jsonl"     # under sprint_jax.model.tokenizer.data_dir() (package data, MIT)


def math500_path() -> Path:
    """MATH-500 as the package carries it (sprint_jax/data, see its SOURCES.md)."""
    from sprint_jax.model.tokenizer import data_file
    return data_file(MATH500)


# ---------------------------------------------------------------------------------------------
# records -> tasks (shared with choice.py)
# ---------------------------------------------------------------------------------------------
def field(record: dict, names: tuple[str, ...], where: str, kind: type = str) -> Any:
    """The first of `names` present and not None; numbers are accepted for strings."""
    for name in names:
        if name in record and record[name] is not None:
            value = record[name]
            if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, kind):
                raise TaskFileError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
            return value
    raise TaskFileError(f"{where}: missing field {' or '.join(repr(n) for n in names)}")


def text_field(record: dict, names: tuple[str, ...], where: str) -> str:
    """A string field that must hold some text (an empty problem cannot be posed)."""
    value = field(record, names, where)
    if not value.strip():
        raise TaskFileError(f"{where}: field {next(n for n in names if record.get(n) is not None)!r} is empty")
    return value


def record_id(record: dict, names: tuple[str, ...], where: str, fallback: str) -> str:
    """The first id field present (0 and "" are ids too: only absent / null falls back)."""
    for name in names:
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TaskFileError(f"{where}: field {name!r} must be a string or an integer, got {type(value).__name__}")
        if isinstance(value, str) and not value.strip():
            raise TaskFileError(f"{where}: field {name!r} is empty")
        return str(value)
    return fallback


class UniqueIds:
    """Duplicate ids are an error naming both places (results are matched by id)."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}

    def add(self, tid: str, where: str) -> None:
        if tid in self.first:
            raise TaskFileError(f"{where}: duplicate task id {tid!r} (first at {self.first[tid]})")
        self.first[tid] = where


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 0:
        raise TaskFileError(f"limit must be >= 0, got {limit}")


def load_math(records: Iterable[tuple[str, dict]], stem: str, limit: int | None = None) -> list[Task]:
    """MATH-style records: `{"problem": str, "answer": str, ...}`.

    `question` is accepted for `problem`. `answer` may be a string or a number; when it is absent,
    the last \\boxed{} of `solution` is used (the MATH train split has only solutions). The id is
    `unique_id` (or `id`) when present, else `<stem>-<n>` (n counts records from 1). Other fields
    (subject, level, solution, ...) go to `Task.meta`.
    """
    check_limit(limit)
    tasks: list[Task] = []
    ids = UniqueIds()
    for n, (where, rec) in enumerate(records, start=1):
        if limit is not None and len(tasks) >= limit:
            break
        problem = text_field(rec, ("problem", "question"), where)
        if rec.get("answer") is not None:
            answer = field(rec, ("answer",), where)
        elif isinstance(rec.get("solution"), str) and extract_boxed(rec["solution"]) is not None:
            answer = extract_boxed(rec["solution"])
        else:
            raise TaskFileError(f"{where}: missing field 'answer' (and no \\boxed{{}} in 'solution')")
        if not str(answer).strip():
            raise TaskFileError(f"{where}: field 'answer' is empty")
        tid = record_id(rec, ("unique_id", "id"), where, f"{stem}-{n}")
        ids.add(tid, where)
        meta = {k: v for k, v in rec.items() if k not in ("problem", "question", "answer")}
        tasks.append(Task(id=tid, kind="math", problem=problem, answer=str(answer).strip(), meta=meta))
    return tasks


# ---------------------------------------------------------------------------------------------
# grading (math-verify)
# ---------------------------------------------------------------------------------------------
def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set (curation grades
    # from worker threads); elsewhere parse without a timeout.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _mv_parse(text: str) -> list:
    from math_verify import parse
    return parse(text, parsing_timeout=_timeout())


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
    answer) is mathematically equal to `gold` under math-verify. An exception inside math-verify
    propagates: `sprint_jax.tasks.grade_result` counts it as a grader error, never as "wrong"."""
    from math_verify import verify
    if not isinstance(prediction_text, str) or not prediction_text.strip():
        return False
    gold = str(gold).strip()
    if not gold:
        return False
    gold_parsed = _parse_first(["$" + gold + "$", gold])
    pred_parsed = _parse_first(_math_candidates(prediction_text))
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_timeout()))


def prompt_for(task: Task) -> str:
    return task.problem


__all__ = ["MATH500", "math500_path", "load_math", "grade_math", "prompt_for"]
