"""Task loaders: the problems curation starts from (paper §4) and evaluation grades against.

Files are JSON lines; a bad file stops with one clear error naming the file and line number
(`TaskFileError` is a `sprint_jax.cli.UserError`, so the CLI prints it as one line).
"""
from __future__ import annotations

import hashlib
import random
from pathlib import Path

from sprint_jax.jsonl import iter_objects
from typing import Any, Iterator

from sprint_jax.errors import UserError
from sprint_jax.curation.types import Task

LETTERS = "ABCDEFGHIJ"


class TaskFileError(UserError, ValueError):
    """A task file is missing or malformed; the message names the file and line."""


def _records(path: str | Path) -> Iterator[tuple[int, dict]]:
    p = Path(path)
    if not p.is_file():
        raise TaskFileError(f"task file {str(p)!r} does not exist" if not p.exists()
                            else f"task file {str(p)!r} is not a file")
    yield from iter_objects(p, TaskFileError)


def _field(record: dict, names: tuple[str, ...], where: str, kind: type = str) -> Any:
    for name in names:
        if name in record and record[name] is not None:
            value = record[name]
            if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, kind):
                raise TaskFileError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
            return value
    raise TaskFileError(f"{where}: missing field {' or '.join(repr(n) for n in names)}")


def load_math_jsonl(path: str | Path, limit: int | None = None) -> list[Task]:
    """MATH-style problems: one `{"problem": str, "answer": str, ...}` object per line.

    `question` is accepted for `problem`. `answer` may be a string or a number; when it is absent,
    the last \\boxed{} of `solution` is used. The id is `unique_id` (or `id`) when present, else
    `<file stem>-<line>`. Other fields (subject, level, solution, ...) go to `Task.meta`.
    """
    from sprint_jax.eval.graders import extract_boxed
    if limit is not None and limit < 0:
        raise TaskFileError(f"limit must be >= 0, got {limit}")
    tasks: list[Task] = []
    seen: set[str] = set()
    stem = Path(path).stem
    for lineno, rec in _records(path):
        if limit is not None and len(tasks) >= limit:
            break
        where = f"{path}:{lineno}"
        problem = _field(rec, ("problem", "question"), where)
        if "answer" in rec and rec["answer"] is not None:
            answer = _field(rec, ("answer",), where)
        elif isinstance(rec.get("solution"), str) and extract_boxed(rec["solution"]) is not None:
            answer = extract_boxed(rec["solution"])
        else:
            raise TaskFileError(f"{where}: missing field 'answer' (and no \\boxed{{}} in 'solution')")
        tid = str(rec.get("unique_id") or rec.get("id") or f"{stem}-{lineno}")
        if tid in seen:
            raise TaskFileError(f"{where}: duplicate task id {tid!r}")
        seen.add(tid)
        meta = {k: v for k, v in rec.items() if k not in ("problem", "question", "answer")}
        tasks.append(Task(id=tid, kind="math", problem=problem, answer=str(answer).strip(), meta=meta))
    return tasks


_GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def _choice_problem(question: str, choices: list[str]) -> str:
    lines = [question.strip(), ""] + [f"{LETTERS[k]}) {c.strip()}" for k, c in enumerate(choices)]
    return "\n".join(lines)


def _stable_rng(*parts: object) -> random.Random:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def load_choice_jsonl(path: str | Path, limit: int | None = None, shuffle_seed: int = 0) -> list[Task]:
    """Multiple-choice problems (GPQA-style). Accepted line formats:

    1. `{"question": str, "choices": [str, ...] | {"A": str, ...}, "answer": "B" | 1}`: choices in
       order A, B, ... (2 to 10 of them); answer a letter, or a 0-based index into the choices.
    2. The original GPQA columns `{"Question", "Correct Answer", "Incorrect Answer 1".."3"}`: the
       four options are shuffled with a seed derived from (`shuffle_seed`, record id), so the
       correct one is not always A, and the same file always gives the same order.
    3. `{"question": str, "answer": "B"}` with the options already written inside the question
       (e.g. LIMO's GPQA file).

    The problem text is the question followed by one `X) option` line per choice. The id is
    `id` / `Record ID` / `unique_id` when present, else `<file stem>-<line>`. `meta["choices"]`
    holds the option texts in letter order (empty for format 3).
    """
    if limit is not None and limit < 0:
        raise TaskFileError(f"limit must be >= 0, got {limit}")
    tasks: list[Task] = []
    stem = Path(path).stem
    for lineno, rec in _records(path):
        if limit is not None and len(tasks) >= limit:
            break
        where = f"{path}:{lineno}"
        tid = str(rec.get("id") or rec.get("Record ID") or rec.get("unique_id") or f"{stem}-{lineno}")
        if all(c in rec for c in _GPQA_COLUMNS):
            question = _field(rec, ("Question",), where)
            options = [_field(rec, (c,), where) for c in _GPQA_COLUMNS[1:]]
            order = list(range(4))
            _stable_rng(shuffle_seed, tid).shuffle(order)
            choices = [options[k].strip() for k in order]
            letter = LETTERS[order.index(0)]
            problem = _choice_problem(question, choices)
        else:
            question = _field(rec, ("question", "problem"), where)
            raw = rec.get("choices", rec.get("options"))
            if raw is None:
                choices = []
            elif isinstance(raw, dict):
                keys = [str(k).strip().upper() for k in raw]
                if keys != list(LETTERS[:len(keys)]):
                    raise TaskFileError(f"{where}: choice keys must be A, B, C, ... in order, got {list(raw)}")
                choices = [str(v) for v in raw.values()]
            elif isinstance(raw, list) and all(isinstance(c, (str, int, float)) for c in raw):
                choices = [str(c) for c in raw]
            else:
                raise TaskFileError(f"{where}: 'choices' must be a list of strings or an A/B/C... mapping")
            if choices and not 2 <= len(choices) <= len(LETTERS):
                raise TaskFileError(f"{where}: expected 2..{len(LETTERS)} choices, got {len(choices)}")
            if "answer" not in rec:
                raise TaskFileError(f"{where}: missing field 'answer'")
            answer = rec["answer"]
            n = len(choices) or 4
            if isinstance(answer, int) and not isinstance(answer, bool):
                if not 0 <= answer < n:
                    raise TaskFileError(f"{where}: answer index {answer} out of range for {n} choices")
                letter = LETTERS[answer]
            elif isinstance(answer, str) and answer.strip().strip("()").upper() in LETTERS[:max(n, 4)]:
                letter = answer.strip().strip("()").upper()
            else:
                raise TaskFileError(f"{where}: answer must be a letter A..{LETTERS[n - 1]} or a 0-based index, "
                                    f"got {answer!r}")
            if choices and LETTERS.index(letter) >= len(choices):
                raise TaskFileError(f"{where}: answer {letter} but only {len(choices)} choices")
            choices = [c.strip() for c in choices]
            problem = _choice_problem(question, choices) if choices else question.strip()
        meta = {"choices": choices, "source_line": lineno}
        tasks.append(Task(id=tid, kind="choice", problem=problem, answer=letter, meta=meta))
    return tasks


__all__ = ["TaskFileError", "load_math_jsonl", "load_choice_jsonl", "LETTERS"]
