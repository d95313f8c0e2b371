"""Multiple-choice tasks (GPQA-style): loader, and a grader that compares letters."""
from __future__ import annotations

import functools
import hashlib
import random
import re
from typing import Iterable

from sprint_jax.tasks.math import UniqueIds, check_limit, record_id, text_field
from sprint_jax.tasks.types import Task, TaskFileError

LETTERS = "ABCDEFGHIJ"

_GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def _choice_problem(question: str, choices: list[str]) -> str:
    lines = [question.strip(), ""] + [f"{LETTERS[k]}) {c.strip()}" for k, c in enumerate(choices)]
    return "\n".join(lines)


def _stable_rng(*parts: object) -> random.Random:
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def load_choice(records: Iterable[tuple[str, dict]], stem: str, limit: int | None = None,
                shuffle_seed: int = 0) -> list[Task]:
    """Multiple-choice problems (GPQA-style). Accepted line formats:

    1. `{"question": str, "choices": [str, ...] | {"A": str, ...}, "answer": "B" | 1}`: choices in
       order A, B, ... (2 to 10 of them); answer a letter, or a 0-based index into the choices.
    2. The original GPQA columns `{"Question", "Correct Answer", "Incorrect Answer 1".."3"}`: the
       four options are shuffled with a seed derived from (`shuffle_seed`, record id), so the
       correct one is not always A, and the same file always gives the same order.
    3. `{"question": str, "answer": "B"}` with the options already written inside the question
       (e.g. LIMO's GPQA file).

    The problem text is the question followed by one `X) option` line per choice. The id is
    `id` / `Record ID` / `unique_id` when present, else `<stem>-<n>` (n counts records from 1);
    a duplicate id is an error. `meta["choices"]` holds the option texts in letter order (empty
    for format 3).
    """
    check_limit(limit)
    tasks: list[Task] = []
    ids = UniqueIds()
    for n, (where, rec) in enumerate(records, start=1):
        if limit is not None and len(tasks) >= limit:
            break
        tid = record_id(rec, ("id", "Record ID", "unique_id"), where, f"{stem}-{n}")
        ids.add(tid, where)
        if all(c in rec for c in _GPQA_COLUMNS):
            question = text_field(rec, ("Question",), where)
            options = [text_field(rec, (c,), where) for c in _GPQA_COLUMNS[1:]]
            order = list(range(4))
            _stable_rng(shuffle_seed, tid).shuffle(order)
            choices = [options[k].strip() for k in order]
            letter = LETTERS[order.index(0)]
            problem = _choice_problem(question, choices)
        else:
            question = text_field(rec, ("question", "problem"), where)
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
        meta = {"choices": choices, "source": where}
        tasks.append(Task(id=tid, kind="choice", problem=problem, answer=letter, meta=meta))
    return tasks


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


def grade(task: Task, text: str) -> bool:
    n = len(task.meta.get("choices") or "ABCD")
    return grade_choice(text, task.answer, LETTERS[:max(1, min(n, len(LETTERS)))])


def prompt_for(task: Task) -> str:
    return task.problem


__all__ = ["LETTERS", "load_choice", "extract_choice", "grade_choice", "grade", "prompt_for"]
