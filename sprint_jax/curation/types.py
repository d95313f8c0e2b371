"""Plain data types of the curation stages: steps and examples (tasks and traces live in
`sprint_jax.tasks.types`, shared with evaluation, and are re-exported here)."""
from __future__ import annotations

import dataclasses
from typing import Any

from sprint_jax.tasks.types import Task, Trace


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


__all__ = ["Task", "Trace", "Step", "Example"]
