"""Tasks: per task kind, its loader, its prompt and its grader, in one place for curation and eval.

Kinds (`Task.kind`):
  math       MATH-style {problem, answer} records (jsonl / parquet / arrow / HF dataset); math-verify
  choice     multiple choice (GPQA-style); the chosen letter
  countdown  generated Countdown instances (TinyZero's prompt and rules)
  chains     the demo's digit chains (generated)
Curation (teacher prompts, the correctness filter) and evaluation (prompts, grading) both call
`task_prompt`, `final_answer_of` and `grade_result` here, so the two can never disagree.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import unicodedata
from pathlib import Path
from typing import Callable

from sprint_jax.tasks import chains, choice, countdown, math
from sprint_jax.tasks.answers import EXTRACTION_MODES, extract_answer, extract_boxed
from sprint_jax.tasks.sources import first_record, read_file_records, read_hf_records
from sprint_jax.tasks.types import Task, TaskFileError, Trace

log = logging.getLogger("sprint_jax.tasks")

_GRADERS: dict[str, Callable[[Task, str], bool]] = {
    "math": lambda task, text: math.grade_math(text, task.answer),
    "choice": choice.grade,
    "countdown": countdown.grade,
    "chains": chains.grade,
}
_PROMPTS: dict[str, Callable[[Task], str]] = {
    "math": math.prompt_for, "choice": choice.prompt_for, "countdown": countdown.prompt_for,
    "chains": chains.prompt_for,
}
KINDS = tuple(_GRADERS)
FILE_KINDS = ("math", "choice")          # kinds read from files / datasets


def task_prompt(task: Task) -> str:
    """The query as both the teacher and the fine-tuned model see it."""
    if task.kind not in _PROMPTS:
        raise ValueError(f"no prompt for task kind {task.kind!r}; expected one of {', '.join(KINDS)}")
    return _PROMPTS[task.kind](task)


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def final_answer_of(task: Task, text: str) -> str:
    """A teacher trace's final answer: its last \\boxed{...} (for Countdown also a last
    <answer>...</answer>, the format the Countdown prompt asks for); "" when there is none."""
    if task.kind == "countdown":
        tagged = _ANSWER_TAG.findall(text)
        if tagged:
            return tagged[-1].strip()
    return (extract_boxed(text) or "").strip()


def grade(task: Task, final_answer_text: str) -> bool:
    """Grade a final answer against `task.answer` by `task.kind`. A grader failure raises."""
    kind = getattr(task, "kind", None)
    if kind not in _GRADERS:
        raise ValueError(f"no grader for task kind {kind!r}; expected one of {', '.join(KINDS)}")
    return _GRADERS[kind](task, final_answer_text)


@dataclasses.dataclass
class Grade:
    correct: bool
    error: str | None = None      # "ExceptionType: message" when the grader itself failed


def grade_result(task: Task, final_answer_text: str | None) -> Grade:
    """`grade`, with a grader failure caught, logged and returned as `error` (not graded "wrong"
    silently: evaluation counts these in its report, curation records them as discards)."""
    if final_answer_text is None:
        return Grade(False)
    try:
        return Grade(bool(grade(task, final_answer_text)))
    except Exception as e:   # noqa: BLE001 - any grader failure is reported, never a dead run
        error = f"{type(e).__name__}: {e}"
        log.warning("grader error on task %s (%s): %s", getattr(task, "id", "?"), getattr(task, "kind", "?"), error)
        return Grade(False, error)


# ---------------------------------------------------------------------------------------------
# Loading task files
# ---------------------------------------------------------------------------------------------
def sniff_kind(path: str | Path) -> str:
    """`--task-kind auto`: multiple choice when the first record has "choices" / "options" or the
    GPQA columns, else math."""
    first = first_record(path)
    if isinstance(first, dict) and ({"choices", "options", "Correct Answer"} & set(first)):
        return "choice"
    return "math"


def load_records(records, kind: str, stem: str, limit: int | None = None) -> list[Task]:
    if kind == "math":
        return math.load_math(records, stem, limit)
    if kind == "choice":
        return choice.load_choice(records, stem, limit)
    raise TaskFileError(f"task kind {kind!r} is not read from files; use one of {', '.join(FILE_KINDS)}")


def load_task_file(path: str | Path, kind: str = "auto", limit: int | None = None, split: str | None = None) -> list[Task]:
    """Tasks from a local file (.jsonl / .parquet / .arrow) or a `save_to_disk` directory."""
    if kind == "auto":
        kind = sniff_kind(path)
    return load_records(read_file_records(path, split), kind, Path(path).stem, limit)


def load_hf_dataset(path: str, kind: str = "math", split: str = "train", name: str | None = None,
                    limit: int | None = None) -> list[Task]:
    """Tasks from a Hugging Face dataset (a hub name or a `save_to_disk` directory)."""
    return load_records(read_hf_records(path, split, name), kind, Path(path).name or path, limit)


def load_math500(limit: int | None = None) -> list[Task]:
    """MATH-500, as the package carries it (an evaluation set: never train on it)."""
    path = math.math500_path()
    return math.load_math(read_file_records(path), path.stem, limit)


def load_tasks(data: str, limit: int | None = None, task_kind: str = "auto", countdown_n: int = 100,
               data_seed: int = 0) -> list[Task]:
    """Tasks named by a `--data` value: "math500" (the shipped MATH-500), "countdown" (`countdown_n`
    generated with `data_seed`), "chains" (the demo's held-out test set for `data_seed`), or a task
    file (`load_task_file` with `task_kind`); at most `limit`. UserError names a bad value."""
    from sprint_jax.errors import UserError

    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    if data == "math500":
        return load_math500(limit)
    if data == "countdown":
        n = countdown_n if limit is None else min(limit, countdown_n)
        if n < 1:
            raise UserError(f"--countdown-n must be >= 1, got {countdown_n}")
        return countdown.generate(n, data_seed)
    if data == "chains":
        tasks = chains.demo_test_set(seed=data_seed)
        return tasks if limit is None else tasks[:limit]
    path = Path(data)
    if not path.exists():
        raise UserError(f"--data {data!r} is not math500, countdown, chains, or an existing file")
    return load_task_file(path, task_kind, limit)


# ---------------------------------------------------------------------------------------------
# Problem fingerprints (the contamination guard between `train` and `eval`)
# ---------------------------------------------------------------------------------------------
def normalize_problem(text: str) -> str:
    """Unicode NFKC, lower case, whitespace collapsed: two copies of a problem that differ only in
    spacing or case hash alike."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def problem_hash(text: str) -> str:
    """The first 16 hex digits of sha256 of the normalised problem text."""
    return hashlib.sha256(normalize_problem(text).encode("utf-8")).hexdigest()[:16]


__all__ = ["Task", "Trace", "TaskFileError", "KINDS", "FILE_KINDS", "EXTRACTION_MODES", "extract_answer",
           "extract_boxed", "task_prompt", "final_answer_of", "grade", "Grade", "grade_result", "sniff_kind",
           "load_records", "load_task_file", "load_hf_dataset", "load_math500", "load_tasks", "normalize_problem",
           "problem_hash"]
