"""The data types of the curation stages in one place: tasks and traces (`sprint_jax.tasks.types`,
shared with evaluation) and steps and examples (`sprint_jax.schema`, shared with training)."""
from __future__ import annotations

from sprint_jax.schema import Example, Step
from sprint_jax.tasks.types import Task, Trace

__all__ = ["Task", "Trace", "Step", "Example"]
