"""The `rewrite` restructuring path (config `restructure: rewrite`), as ThreadWeaver makes its data:
a strong LLM is given a correct serial trace and rewrites it directly into SPRINT form, instead of
step extraction -> dependency DAG -> σ packing.

Every reply is checked before it becomes an example; a rejected one is a discard at stage
`rewrite` with one of these reasons:
  truncated            the reply hit the rewriter's max_tokens
  malformed            `format.parse_completion` reports a problem, or a prompt / execution is empty
  no_parallelism       no stage has two or more executions
  sibling_dependency   an execution uses a number that its context does not give but a sibling
                       execution of the same stage derives (`sibling_dependencies`)
  answer_wrong         the task's grader rejects the rewrite's final answer
  answer_changed       graded correct, but not the serial trace's final answer (e.g. 45.0 for 45)
  grader_error:<type>  the grader failed on it (counted, never graded "wrong")
An accepted rewrite is re-rendered canonically with the trace's own final answer, like the `dag`
path's examples. What is *not* checked: that the rewrite keeps all of the trace's work, and any
dependency the number test below cannot see.
"""
from __future__ import annotations

import dataclasses
import re

from sprint_jax import format as fmt
from sprint_jax.curation.llm import Discarded
from sprint_jax.tasks import final_answer_of, grade_result, task_prompt
from sprint_jax.tasks.types import Task, Trace

REASONS = ("truncated", "malformed", "no_parallelism", "sibling_dependency", "answer_wrong", "answer_changed")


def _example() -> str:
    """The system prompt's worked example, rendered by `format` (every tag string lives there)."""
    traj = fmt.Trajectory(stages=[
        fmt.Stage(1, ["The two factors do not depend on each other.",
                      fmt.Prompt("Compute 2+3, the first factor."),
                      fmt.Prompt("Compute 4+5, the second factor.")],
                  ["2 + 3 = 5, so the first factor is 5.", "4 + 5 = 9, so the second factor is 9."]),
        fmt.Stage(2, [fmt.Prompt("Multiply the two factors, 5 and 9.")], ["5 * 9 = 45."]),
    ], final_answer="45")
    return fmt.render_completion(traj)


_P1, _P2 = fmt.plan_open(1), fmt.plan_close(1)
SYSTEM_PROMPT = f"""\
You restructure a correct step-by-step solution into the SPRINT format, in which a planner hands \
independent subtasks to executors that run at the same time. Keep the solution's reasoning and \
its final answer; only reorganise the work.

Format, with exactly these tags:
{_P1} planning text {fmt.prompt_open(1, 1)} subtask {fmt.prompt_close(1, 1)} \
{fmt.prompt_open(1, 2)} subtask {fmt.prompt_close(1, 2)} {_P2}
{fmt.execution_open(1, 1)} the work for subtask 1.1 {fmt.execution_close(1, 1)}
{fmt.execution_open(1, 2)} the work for subtask 1.2 {fmt.execution_close(1, 2)}
{fmt.plan_open(2)} ... {fmt.plan_close(2)}
...
{fmt.FINAL_OPEN} the final answer {fmt.FINAL_CLOSE}

Rules:
- Plans are numbered 1, 2, 3, ... A plan with k prompts, numbered i.1 to i.k, is followed by \
exactly k executions i.1 to i.k in the same order. A plan with no prompt has no execution.
- The executions of one plan run in parallel. Each sees only the problem, the plans so far \
(all prompts of its own plan included) and the executions of earlier plans, never another \
execution of its own plan. Work that needs a sibling's result belongs to a later plan; a value an \
executor needs must be in the problem, a plan, or an earlier execution.
- Run independent parts (cases, sub-computations, checks) in parallel: at least one plan must \
have two or more prompts.
- Copy the work from the solution; add no new reasoning and change no result.
- End with {fmt.FINAL_OPEN} the solution's final answer, unchanged {fmt.FINAL_CLOSE}. Write \
nothing before {_P1} or after {fmt.FINAL_CLOSE}, and no other tags.

Example. Problem: Compute (2+3)*(4+5). Solution: 2+3 = 5. 4+5 = 9. 5*9 = 45. So the answer is 45.
Your reply:
{_example()}"""


def rewrite_messages(task: Task, trace: Trace) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Problem:\n{task_prompt(task)}\n\nSolution:\n{trace.text}\n\n"
                                        f"Final answer: {trace.final_answer}"}]


class RewriteRejected(Discarded):
    """A discard of this stage (`Discarded`)."""


@dataclasses.dataclass
class Accepted:
    completion: str                  # canonical SPRINT body (format.render_completion)
    widths: list[int]                # executions per stage


# ---- the sibling-dependency check ---------------------------------------------------------------

# A number: ASCII digits, optional thousands commas and decimals, not glued to a letter (x2, t1).
_NUMBER = re.compile(r"(?<![A-Za-z_0-9.])\d+(?:,\d{3})*(?:\.\d+)?(?![0-9])")
# What, written just before a number, marks it as a result derived there ("= 13", "is 13",
# "= \boxed{13}"); openers and a minus sign may stand between.
_DERIVED = re.compile(
    r"(?:=|≈|→|->|\\approx|\\to|\\Rightarrow|\\implies|\b(?:is|are|equals|gives|get|gets|yields|makes|becomes))"
    r"(?:\s|\$|\(|\{|\[|-|\\boxed|\\[dt]?frac)*$")


def _norm(number: str) -> str:
    n = number.replace(",", "")
    return n.rstrip("0").rstrip(".") if "." in n else n


def numbers(text: str) -> set[str]:
    """The numbers in `text`, normalised (1,000 -> 1000, 45.0 -> 45)."""
    return {_norm(m.group(0)) for m in _NUMBER.finditer(text)}


def first_uses(text: str) -> dict[str, bool]:
    """{number: derived} for each number's first occurrence in `text`: derived when a result marker
    (`=`, `is`, `gives`, ...) comes just before it, else the number is used there as an input."""
    out: dict[str, bool] = {}
    for m in _NUMBER.finditer(text):
        n = _norm(m.group(0))
        if n not in out:
            out[n] = _DERIVED.search(text[max(0, m.start() - 40): m.start()]) is not None
    return out


def _plan_text(stage: fmt.Stage) -> str:
    return " ".join(p.text if isinstance(p, fmt.Prompt) else p for p in stage.plan)


def sibling_dependencies(query: str, traj: fmt.Trajectory) -> list[tuple[int, int, str, int]]:
    """(stage, j, number, j') for each number that execution j of a stage uses as an input (first
    occurrence not a derivation) although its context does not give it, while sibling j' derives it.

    An executor's context is the query, the plans of its own and earlier stages (all prompts
    included) and the executions of earlier stages. Caught: an executor that quotes a number a
    sibling computes. Missed: dependencies that are not numbers (a symbolic result, "x is even"),
    numbers that are also in the context (small integers of the query), results a sibling states
    without a marker ("the sum: 13"), words for numbers, references like "twice that". A constant
    both siblings only use (180 for a triangle) is no one's result and passes; one that a sibling
    happens to derive and the other cites from memory is a false alarm."""
    found = []
    context = query
    for stage in traj.stages:
        context += "\n" + _plan_text(stage)
        given = numbers(context)
        uses = [{n: d for n, d in first_uses(e).items() if n not in given} for e in stage.executions]
        for j, mine in enumerate(uses, 1):
            for n, derived in mine.items():
                if derived:
                    continue
                source = next((k for k, theirs in enumerate(uses, 1) if k != j and theirs.get(n)), None)
                if source is not None:
                    found.append((stage.index, j, n, source))
        context += "\n" + "\n".join(stage.executions)
    return found


# ---- the whole check ----------------------------------------------------------------------------

_FENCE = re.compile(r"\A\s*```[\w-]*[ \t]*\n(.*?)\n\s*```\s*\Z", re.S)
_THINK = re.compile(r"\A\s*<think>.*?</think>", re.S)


def answer_problem(task: Task, trace: Trace, written: str | None) -> tuple[str, str] | None:
    """(reason, detail) when a rewrite's final answer `written` is not the trace's: the grader
    failed, the answer is wrong, or it is right but changed from the trace's; None when it is
    the trace's answer."""
    written = written or ""
    answer = final_answer_of(task, written) or written.strip()
    grade = grade_result(task, answer)
    if grade.error is not None:
        return f"grader_error:{grade.error.split(':', 1)[0]}", grade.error
    if not grade.correct:
        return "answer_wrong", f"final answer {answer!r}"
    if " ".join(answer.split()) != " ".join(trace.final_answer.split()):
        return "answer_changed", f"{answer!r} instead of {trace.final_answer!r}"
    return None


def check_reply(task: Task, trace: Trace, content: str, finish_reason: str | None) -> Accepted:
    """Accept the rewriter's reply for a correct `trace`, or raise RewriteRejected(reason, detail).

    A leading <think> block and one enclosing ``` fence are removed first; nothing else is repaired."""
    if finish_reason == "length":
        raise RewriteRejected("truncated", "the reply hit rewriter.max_tokens")
    text = _THINK.sub("", content)
    fenced = _FENCE.match(text)
    text = fenced.group(1) if fenced else text
    traj, problems = fmt.parse_completion(text.strip())
    if not problems:
        for stage in traj.stages:
            if any(not p for p in stage.prompts) or any(not e for e in stage.executions):
                problems.append(f"an empty prompt or execution in plan {stage.index}")
    if problems:
        raise RewriteRejected("malformed", "; ".join(problems[:5]))
    widths = [len(s.executions) for s in traj.stages]
    if max(widths, default=0) < 2:
        raise RewriteRejected("no_parallelism", f"executions per stage {widths}")
    deps = sibling_dependencies(task_prompt(task), traj)
    if deps:
        raise RewriteRejected("sibling_dependency", "; ".join(
            f"execution {k}.{j} uses {n}, a result of execution {k}.{s}" for k, j, n, s in deps[:5]))
    wrong = answer_problem(task, trace, traj.final_answer)
    if wrong:
        raise RewriteRejected(*wrong)
    traj.final_answer = trace.final_answer
    return Accepted(fmt.render_completion(traj), widths)


__all__ = ["SYSTEM_PROMPT", "REASONS", "rewrite_messages", "RewriteRejected", "Accepted", "numbers",
           "first_uses", "sibling_dependencies", "check_reply"]
