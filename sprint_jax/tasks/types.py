"""The task types every part of the project shares: a problem (`Task`), a teacher's worked serial
solution of it (`Trace`), and the error a bad task source raises (`TaskFileError`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from sprint_jax.errors import UserError


@dataclasses.dataclass
class Task:
    """One problem. `kind` selects its prompt and grader: "math" | "countdown" | "choice" | "chains"."""
    id: str
    kind: str
    problem: str
    answer: Any                      # math: str; countdown: {"target": int, "numbers": [int]}; choice: "A".."J"
    meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Trace:
    """A serial reasoning trace from a teacher (LLM or programmatic) and its final answer text."""
    task_id: str
    text: str
    final_answer: str
    teacher: str = ""
    usage: dict = dataclasses.field(default_factory=dict)


class TaskFileError(UserError, ValueError):
    """A task source is missing or malformed; the message names the file (and line or row)."""


__all__ = ["Task", "Trace", "TaskFileError"]
