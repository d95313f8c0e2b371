"""Plain data types shared by the curation stages (tasks, traces, steps, examples)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Task:
    """One problem. `kind` selects the grader: "math" | "countdown" | "choice"."""
    id: str
    kind: str
    problem: str
    answer: Any                      # math: str; countdown: {"target": int, "numbers": [int]}; choice: "A".."D"
    meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Trace:
    """A serial reasoning trace from a teacher (LLM or programmatic) and its final answer text."""
    task_id: str
    text: str
    final_answer: str
    teacher: str = ""
    usage: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Step:
    """S_i = (P_i, E_i) (paper §4): a plan and an execution; execution == "" means plan-only."""
    plan: str
    execution: str = ""

    @property
    def plan_only(self) -> bool:
        return not self.execution.strip()


@dataclasses.dataclass
class Example:
    """One SFT example as written to sprint.jsonl / rft.jsonl.

    `prompt` is the query as the model sees it; `completion` is what the model must write (the
    tagged SPRINT body, or the serial RFT trace + final answer). The trainer labels prompt tokens
    "query" and derives every other label from sprint_jax.format.span_labels(completion).
    """
    id: str
    kind: str                        # "sprint" | "rft"
    prompt: str
    completion: str
    answer: Any = None
    meta: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Example":
        return cls(**d)
