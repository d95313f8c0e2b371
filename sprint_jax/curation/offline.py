"""Offline curator: a deterministic heuristic step extractor and dependency builder.

The paper (§4) extracts steps S_i = (P_i, E_i) and their dependencies with prompted LLMs. This
module is the endpoint-free stand-in, so the pipeline runs end to end with no API. It is a
heuristic, not a model of reasoning:

* steps are paragraphs (blank-line separated; single lines when a trace has no blank lines); the
  first sentence of a paragraph is its plan P_i, the rest its execution E_i;
* a step depends on an earlier step when it uses a number that the earlier step's execution
  produced (first written right after "=") and that the query does not contain, or when its plan
  opens with a consequence word ("So", "Therefore", ...) or points back ("found above",
  "previous", ...), in which case it depends on the step just before it.

It fits traces written as independent paragraphs with explicit arithmetic, such as the
programmatic Countdown teacher's (`countdown.solve_trace`); on free-form LLM prose it mostly finds
chains. `merge_short` is shared with the LLM path.
"""
from __future__ import annotations

import re

from sprint_jax.schema import Step

_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n")
_FIRST_SENTENCE = re.compile(r"^(.*?[.!?:])(?:\s+|$)", re.S)
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:\.\d+)?(?![0-9])")
_PRODUCED = re.compile(r"(?:=|\bequals)\s*$")
# numbers so common as counts and indices that they say nothing about data flow
_IGNORED_VALUES = {"0", "1", "2"}
CONNECTIVES = ("so", "therefore", "thus", "hence", "then", "finally", "now", "using this", "with this",
               "from this", "from that", "substituting", "plugging", "combining", "putting", "this gives",
               "that gives", "this means", "that means")
BACK_REFERENCES = ("above", "previous", "earlier", "this result", "that result", "we found", "we got",
                   "so far", "the result")


def _paragraphs(text: str) -> list[str]:
    paras = [p.strip() for p in _PARAGRAPH.split(text.strip()) if p.strip()]
    if len(paras) == 1:
        lines = [ln.strip() for ln in paras[0].splitlines() if ln.strip()]
        if len(lines) >= 3:
            return lines
    return paras


def _split_step(paragraph: str) -> Step:
    m = _FIRST_SENTENCE.match(paragraph)
    if not m:
        return Step(plan=paragraph.strip(), execution="")
    return Step(plan=m.group(1).strip(), execution=paragraph[m.end():].strip())


def extract_steps(trace_text: str) -> list[Step]:
    """Paragraph -> Step(plan = first sentence, execution = the rest). No merging (see merge_short)."""
    if not isinstance(trace_text, str):
        raise TypeError(f"trace_text must be a str, got {type(trace_text).__name__}")
    return [_split_step(p) for p in _paragraphs(trace_text)]


def merge_short(steps: list[Step], min_chars: int) -> list[Step]:
    """Executions shorter than `min_chars` (stripped) fold into their plan and E_i := ∅ (paper §4:
    a trivial execution is not worth an executor call). Returns new Step objects."""
    out = []
    for step in steps:
        execution = step.execution.strip()
        if execution and len(execution) < min_chars:
            out.append(Step(plan=(step.plan.strip() + " " + execution).strip(), execution=""))
        else:
            out.append(Step(plan=step.plan.strip(), execution=execution))
    return out


def _numbers_with_role(text: str) -> list[tuple[str, bool]]:
    """(value, produced) for each number in `text`; produced = written right after "="."""
    out = []
    for m in _NUMBER.finditer(text):
        value = m.group(0)
        if "." in value:
            value = value.rstrip("0").rstrip(".")
        out.append((value, bool(_PRODUCED.search(text[max(0, m.start() - 12):m.start()]))))
    return out


def _refers_back(plan: str) -> bool:
    words = " ".join(plan.lower().split())
    if any(words == c or words.startswith(c + " ") or words.startswith(c + ",") for c in CONNECTIVES):
        return True
    return any(re.search(r"\b" + re.escape(ref) + r"\b", words) for ref in BACK_REFERENCES)


def build_edges(steps: list[Step], query: str = "") -> list[tuple[int, int]]:
    """Dependency edges (parent, child), 1-based, parent < child, sorted, no duplicates.

    Value flow: a number used (not right after "=") in step j that step j has not produced itself
    and the query does not contain makes j depend on the latest earlier step whose *execution*
    produced it (0, 1 and 2 are ignored: they are mostly counts and indices). Back references: a plan opening with a consequence word or pointing back makes
    j depend on step j-1.
    """
    query_values = {v for v, _ in _numbers_with_role(query)}
    produced_by: dict[str, int] = {}        # value -> latest step whose execution produced it
    edges: set[tuple[int, int]] = set()
    for j, step in enumerate(steps, start=1):
        if j > 1 and _refers_back(step.plan):
            edges.add((j - 1, j))
        local: set[str] = set()
        outputs: set[str] = set()
        for part, is_execution in ((step.plan, False), (step.execution, True)):
            for value, produced in _numbers_with_role(part):
                if produced:
                    local.add(value)
                    if is_execution:
                        outputs.add(value)
                    continue
                if value in local or value in query_values or value in _IGNORED_VALUES:
                    continue
                parent = produced_by.get(value)
                if parent is not None:
                    edges.add((parent, j))
        for value in outputs:
            produced_by[value] = j
    return sorted(edges)


__all__ = ["extract_steps", "merge_short", "build_edges", "CONNECTIVES", "BACK_REFERENCES"]
