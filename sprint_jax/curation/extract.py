"""Step extraction (paper §4): a serial trace -> steps S_i = (P_i, E_i), E_i possibly empty.

The extractor is a prompted LLM, never trained: it returns JSON under a JSON schema
(`response_format` json_schema, generated from the pydantic model below), validated with pydantic;
a reply that fails validation gets one repair turn carrying the error, after which the trace is
recorded as failed. Then executions shorter than `merge_min_chars` merge into their plan and the
step becomes plan-only (E_i := ∅), as in the paper: a tiny execution is not worth its own
executor. `offline.extract_steps` is the endpoint-free heuristic alternative.
"""
from __future__ import annotations

import pydantic

from sprint_jax.curation.llm import CachedChat, Discarded, structured
from sprint_jax.schema import Step

SCHEMA_NAME = "reasoning_steps"

SYSTEM_PROMPT = (
    "You split a reasoning trace into steps for parallel execution. Each step has:\n"
    "- plan: one or two sentences saying what this step sets out to do and why (the intent, "
    "written as an instruction someone else could carry out);\n"
    "- execution: the detailed work that carries the plan out (calculations, case checks, "
    "derivations), copied from the trace with its original wording; use \"\" when the step is only "
    "planning, reflection or a decision with no separate work.\n"
    "Cover the whole trace in its original order, never invent reasoning that is not in the trace, "
    "and do not repeat the final answer statement as a step. Reply with a JSON object "
    "{\"steps\": [{\"plan\": ..., \"execution\": ...}, ...]}."
)


class StepModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    plan: str = pydantic.Field(description="what this step sets out to do and why (P_i)")
    execution: str = pydantic.Field(description="the work carrying the plan out (E_i); empty if planning only")


class StepList(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    steps: list[StepModel]


class ExtractFailed(Discarded):
    """A discard of this stage (`Discarded`)."""


def extract_messages(problem: str, trace_text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Problem:\n{problem}\n\nReasoning trace:\n{trace_text}"}]


def _check(value: StepList) -> str:
    if not value.steps:
        return "steps is empty: the trace must become at least one step"
    for i, s in enumerate(value.steps, 1):
        if not s.plan.strip():
            return f"steps[{i}].plan is empty: every step needs a plan"
    return ""


def extract_llm(chat: CachedChat, problem: str, trace_text: str) -> list[Step]:
    """Steps from the LLM extractor; ExtractFailed("invalid_json", error) after the repair turn."""
    result = structured(chat, extract_messages(problem, trace_text), StepList, SCHEMA_NAME, check=_check)
    if result.value is None:
        raise ExtractFailed("invalid_json", result.error)
    return [Step(plan=s.plan.strip(), execution=s.execution.strip()) for s in result.value.steps]


def extract_offline(trace_text: str) -> list[Step]:
    from sprint_jax.curation import offline
    steps = offline.extract_steps(trace_text)
    if not steps:
        raise ExtractFailed("no_steps", "the offline extractor found no steps")
    return steps


def merge_short(steps: list[Step], min_chars: int) -> list[Step]:
    from sprint_jax.curation import offline
    return offline.merge_short(steps, min_chars)
