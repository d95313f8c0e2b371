"""A run record as a file holds it (eval's records.jsonl: `RunRecord.to_json()` with the problem's
id and sample), checked before a reader trusts it: eval's resume and `plan engine --records` read
these files back, and a line that parses but is damaged (a field of the wrong type, a count that
does not add up) must not be taken for a run."""
from __future__ import annotations

import math
from typing import Any

from sprint_jax.infer.orchestrator import MODES

EXECUTOR_MODES = ("shared", "serial", "inline", "none")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _texts(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _fields(obj: dict, spec: tuple[tuple[str, Any, str], ...], what: str) -> str | None:
    for field, ok, kind in spec:
        if field not in obj:
            return f"{what}missing field {field!r}"
        if not ok(obj[field]):
            return f"{what}field {field!r} must be {kind}"
    return None


_RECORD = (("query", _text, "a string"), ("mode", lambda v: v in MODES, f"one of {list(MODES)}"),
           ("config", lambda v: isinstance(v, dict), "an object"),
           ("prompt_tokens", _count, "a whole number >= 0"), ("final_tokens", _count, "a whole number >= 0"),
           ("final_text", _text, "a string"), ("final_answer", lambda v: v is None or isinstance(v, str),
                                                "a string or null"),
           ("text", _text, "a string"), ("termination", _text, "a string"), ("problems", _texts, "a list of strings"),
           ("wall_s", _seconds, "a number of seconds >= 0"),
           ("stages", lambda v: isinstance(v, list) and all(isinstance(s, dict) for s in v), "a list of objects"))
_STAGE = (("planner_tokens", _count, "a whole number >= 0"), ("planner_text", _text, "a string"),
          ("prompts", _texts, "a list of strings"),
          ("executor_mode", lambda v: v in EXECUTOR_MODES, f"one of {list(EXECUTOR_MODES)}"),
          ("sync_tokens", _count, "a whole number >= 0"),
          ("executions", lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v), "a list of objects"))
_EXECUTION = (("tokens", _count, "a whole number >= 0"), ("forced_tokens", _count, "a whole number >= 0"),
              ("text", _text, "a string"))


def record_problem(rec: Any) -> str | None:
    """None when `rec` is a well-formed record line, else why not, naming the field: every field a
    reader uses present and of its type, its id a string or integer, `sample` (when present) a
    whole number, and its `sequential_tokens` / `total_tokens` the sums its stages give."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    if not isinstance(rec.get("id"), (str, int)) or isinstance(rec.get("id"), bool):
        return "field 'id' must be a string or an integer"
    if "sample" in rec and not _count(rec["sample"]):
        return "field 'sample' must be a whole number >= 0"
    why = _fields(rec, _RECORD, "")
    if why:
        return why
    sequential = total = rec["final_tokens"]
    for i, st in enumerate(rec["stages"], 1):
        why = _fields(st, _STAGE, f"stage {i}: ")
        if why:
            return why
        for j, ex in enumerate(st["executions"], 1):
            why = _fields(ex, _EXECUTION, f"stage {i} execution {j}: ")
            if why:
                return why
        runs = [e["tokens"] for e in st["executions"]]
        sequential += st["planner_tokens"] + max(runs, default=0)
        total += st["planner_tokens"] + sum(runs)
    for field, value in (("sequential_tokens", sequential), ("total_tokens", total)):
        if rec.get(field) != value:
            return f"field {field!r} is {rec[field]!r} where its stages add up to {value}"
    return None
