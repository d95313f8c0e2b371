"""Reformat: packed steps -> a SPRINT trajectory, and the same trace unrestructured -> RFT.

Paper §5: stage k's plan holds the plans of its steps in trace order; a step with an execution
contributes `<prompt_k.j> P_i </prompt_k.j>` and `<execution_k.j> E_i </execution_k.j>` (j counts
the executions of the stage), a plan-only step contributes its plan text outside any prompt. The
RFT baseline (paper §6) trains on the same correct traces as one serial completion.
"""
from __future__ import annotations

from typing import Sequence

from sprint_jax import format as sf
from sprint_jax.curation.packing import stage_numbers, stages
from sprint_jax.schema import Step


def to_sprint(task_or_query_prompt: str, steps: Sequence[Step], edges: Sequence[tuple[int, int]],
              final_answer: str) -> sf.Trajectory:
    """Steps + dependency edges -> Trajectory via σ packing. Raises ValueError for bad edges."""
    if not steps:
        raise ValueError("cannot reformat a trace with no steps")
    sigma = stage_numbers([s.plan_only for s in steps], edges)
    out: list[sf.Stage] = []
    for k, members in stages(sigma).items():
        pieces: list[sf.PlanPiece] = []
        executions: list[str] = []
        for i in members:
            step = steps[i - 1]
            if step.plan_only:
                pieces.append(step.plan)
            else:
                pieces.append(sf.Prompt(step.plan))
                executions.append(step.execution)
        out.append(sf.Stage(index=k, plan=pieces, executions=executions))
    return sf.Trajectory(query=task_or_query_prompt, stages=out, final_answer=final_answer)


def to_rft(prompt: str, trace_text: str, final_answer: str) -> str:
    """The RFT completion: the serial trace, a newline, `<Final Answer> answer </Final Answer>`.

    A trace that starts by echoing the prompt has the echo removed. Raises ValueError when the
    trace or answer contains a SPRINT tag (it would be mislabelled in training).
    """
    trace = trace_text.strip()
    if prompt.strip() and trace.startswith(prompt.strip()):
        trace = trace[len(prompt.strip()):].strip()
    for what, text in (("trace", trace), ("final answer", final_answer)):
        tags = sf.find_tags(text)
        if tags:
            raise ValueError(f"RFT {what} contains the SPRINT tag {tags[0]!r}")
    answer = final_answer.strip()
    block = f"{sf.FINAL_OPEN} {answer} {sf.FINAL_CLOSE}" if answer else f"{sf.FINAL_OPEN} {sf.FINAL_CLOSE}"
    return f"{trace}\n{block}" if trace else block


__all__ = ["to_sprint", "to_rft"]
