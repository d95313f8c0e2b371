"""`restructure: threadweaver_rewrite`: ThreadWeaver's five-step rewrite of a correct serial trace
into a ThreadWeaver-format example (`sprint_jax.threadweaver`), one LLM call per step, each reply
checked before the next step sees it (docs/design.md "Curation").

The trace is cut into numbered paragraphs (at blank lines); the steps refer to them by number:
  1 tw1_spans     which runs of paragraphs hold work that can be done in parallel (JSON)
  2 tw2_threads   how each span's paragraphs split into threads (JSON)
  3 tw3_rewrite   each thread rewritten to stand alone: no result of a sibling thread (JSON)
  4 tw4_outlines  one outline per thread, written before the thread runs (JSON)
  5 tw5_validate  the document assembled from 1-4 (text between the spans stays sequential),
                  returned by the LLM as a checked, well-formed ThreadWeaver trajectory (text)
A rejected reply is a discard at its step (the curation report counts them per step), for one of
`REASONS[step]` (plus `grader_error:<type>` at step 5, counted, never graded "wrong"):
  truncated             the reply hit rewriter.max_tokens
  malformed             not JSON of the step's schema (1-4); not ThreadWeaver text, or no
                        `</think>` (5: `threadweaver.parse_completion`'s problems)
  no_span               no span (or a trace of fewer than two paragraphs: rejected before any call)
  bad_span              a span out of the trace, reversed, overlapping another, or of one paragraph
  wrong_count           a reply with another number of blocks / threads than the steps before it
  bad_partition         a block's threads do not cover its span's paragraphs exactly once
  single_thread         a block of fewer than two threads
  empty_text            an empty thread or outline
  tag_in_text           a ThreadWeaver or SPRINT tag inside a thread or outline
  lost_result           a rewritten thread lacks a number its paragraphs derived in the trace
  sibling_dependency    a thread uses a number a sibling thread derives and its context does not
                        give (`rewrite.sibling_dependencies`, with its blind spots)
  outline_gives_result  an outline states a number a thread of its block derives
  structure_changed     step 5 returned another number of blocks, outlines or threads
  answer_wrong / answer_changed   as `rewrite`: graded wrong, or not the trace's final answer
An accepted trajectory is re-rendered canonically with the trace's own final answer after
`</think>`. Not checked: that the threads keep all of the trace's work beyond its derived numbers.
"""
from __future__ import annotations

import re

import pydantic

from sprint_jax import format as sf
from sprint_jax import threadweaver as tw
from sprint_jax.curation.llm import Discarded, json_schema_format
from sprint_jax.curation.rewrite import answer_problem, first_uses, numbers, sibling_dependencies
from sprint_jax.curation.store import TW_STEPS
from sprint_jax.tasks import task_prompt
from sprint_jax.tasks.types import Task, Trace

STEPS = TW_STEPS
_COMMON = ("truncated", "malformed")
REASONS = {
    "tw1_spans": _COMMON + ("no_span", "bad_span"),
    "tw2_threads": _COMMON + ("wrong_count", "bad_partition", "single_thread"),
    "tw3_rewrite": _COMMON + ("wrong_count", "empty_text", "tag_in_text", "lost_result", "sibling_dependency"),
    "tw4_outlines": _COMMON + ("wrong_count", "empty_text", "tag_in_text", "outline_gives_result"),
    "tw5_validate": _COMMON + ("structure_changed", "sibling_dependency", "answer_wrong", "answer_changed"),
}


class StepRejected(Discarded):
    """A discard at one of the five steps (`Discarded`)."""


# ---- replies of steps 1-4 (JSON under a schema) -------------------------------------------------

class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class Span(_Strict):
    first: int = pydantic.Field(description="number of the span's first paragraph")
    last: int = pydantic.Field(description="number of the span's last paragraph")
    reason: str = pydantic.Field(description="why the work in these paragraphs can run in parallel")


class Spans(_Strict):
    spans: list[Span]


class ThreadSplit(_Strict):
    threads: list[list[int]] = pydantic.Field(description="per thread, the numbers of its paragraphs")


class Threads(_Strict):
    blocks: list[ThreadSplit]


class RewrittenBlock(_Strict):
    threads: list[str]


class Rewritten(_Strict):
    blocks: list[RewrittenBlock]


class OutlineBlock(_Strict):
    outlines: list[str]


class Outlines(_Strict):
    blocks: list[OutlineBlock]


_MODELS = {"tw1_spans": Spans, "tw2_threads": Threads, "tw3_rewrite": Rewritten, "tw4_outlines": Outlines}


def response_format(step: str) -> dict | None:
    """The JSON-schema `response_format` of steps 1-4 (named after the step); None for step 5."""
    model = _MODELS.get(step)
    return None if model is None else json_schema_format(step, model)


# ---- prompts ------------------------------------------------------------------------------------

_FORMAT = f"""\
ThreadWeaver format: the reasoning sits inside {tw.THINK_OPEN} ... {tw.THINK_CLOSE}, the final \
answer after {tw.THINK_CLOSE}. Sequential text alternates with parallel blocks:
{tw.PARALLEL_OPEN}
{tw.OUTLINES_OPEN}
{tw.OUTLINE_OPEN}1: what thread 1 does{tw.OUTLINE_CLOSE}
{tw.OUTLINE_OPEN}2: what thread 2 does{tw.OUTLINE_CLOSE}
{tw.OUTLINES_CLOSE}
{tw.THREAD_OPEN}1: the work of thread 1{tw.THREAD_CLOSE}
{tw.THREAD_OPEN}2: the work of thread 2{tw.THREAD_CLOSE}
{tw.PARALLEL_CLOSE}
The threads of a block run at the same time: each sees the problem, the text before the block and \
the block's outlines, never another thread of its block."""

SYSTEM_PROMPTS = {
    "tw1_spans": f"""\
You prepare a correct step-by-step solution for parallel reasoning. {_FORMAT}

Step 1 of 5: identify the parallelizable spans. The solution is given in numbered paragraphs. \
Find the runs of consecutive paragraphs whose work splits into parts that do not need each other's \
results (independent cases, sub-computations, checks). Each span covers at least two paragraphs; \
spans do not overlap and come in order. Reply with JSON: \
{{"spans": [{{"first": N, "last": M, "reason": "..."}}, ...]}}; an empty list if there is none.""",
    "tw2_threads": f"""\
You prepare a correct step-by-step solution for parallel reasoning. {_FORMAT}

Step 2 of 5: define the thread boundaries. For each span (in order) split its paragraphs into two or \
more threads: every paragraph of the span in exactly one thread, a thread's paragraphs listed by \
number. A thread must not need the result of another thread of its span. Reply with JSON: \
{{"blocks": [{{"threads": [[N, ...], [M, ...]]}}, ...]}}, one block per span.""",
    "tw3_rewrite": f"""\
You prepare a correct step-by-step solution for parallel reasoning. {_FORMAT}

Step 3 of 5: rewrite each thread for independence. Each thread is given with its paragraphs. \
Rewrite its text so that it stands alone: it may use the problem and the text before its block, \
but no number or result that only another thread of its block computes. Keep its work and its \
results; add no new reasoning; write no tags. Reply with JSON: \
{{"blocks": [{{"threads": ["text of thread 1", "text of thread 2", ...]}}, ...]}} in the given order.""",
    "tw4_outlines": f"""\
You prepare a correct step-by-step solution for parallel reasoning. {_FORMAT}

Step 4 of 5: write the outlines. For each thread write one short outline: the instruction the \
thread carries out, written before it runs, so it must not state the thread's result. Write no \
tags. Reply with JSON: {{"blocks": [{{"outlines": ["outline of thread 1", ...]}}, ...]}}, one \
outline per thread, in the given order.""",
    "tw5_validate": f"""\
You prepare a correct step-by-step solution for parallel reasoning. {_FORMAT}

Step 5 of 5: validate the format. You get a trajectory assembled in the ThreadWeaver format. \
Check it and return it whole, fixing only what breaks the format or the independence of the \
threads: keep every block, outline and thread, their number and order, and the final answer. \
Reply with the trajectory only, from {tw.THINK_OPEN} to the final answer.""",
}


def paragraphs(text: str) -> list[str]:
    """The trace's paragraphs (split at blank lines, stripped, empty ones left out)."""
    return [p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip()]


def _numbered(paras: list[str]) -> str:
    return "\n\n".join(f"[{i}] {p}" for i, p in enumerate(paras, 1))


def _head(task: Task, trace: Trace) -> str:
    return f"Problem:\n{task_prompt(task)}\n\nSolution, in numbered paragraphs:\n{_numbered(paragraphs(trace.text))}"


def messages(step: str, task: Task, trace: Trace, prior: dict) -> list[dict]:
    """The request of `step` for a correct `trace`, given the checked outputs of the steps before
    it (`prior`: step -> stored value). Raises StepRejected when the step cannot be asked
    (a trace of fewer than two paragraphs: nothing to run in parallel, no call paid)."""
    if step == "tw1_spans":
        if len(paragraphs(trace.text)) < 2:
            raise StepRejected("no_span", "the trace has fewer than two paragraphs")
        user = f"{_head(task, trace)}\n\nFinal answer: {trace.final_answer}"
    elif step == "tw2_threads":
        spans = prior["tw1_spans"]["spans"]
        user = f"{_head(task, trace)}\n\nSpans: " + ", ".join(f"paragraphs {a}-{b}" for a, b in spans)
    elif step == "tw3_rewrite":
        paras = paragraphs(trace.text)
        parts = []
        for k, threads in enumerate(prior["tw2_threads"]["blocks"], 1):
            parts += [f"Block {k}, thread {j} (paragraphs {', '.join(map(str, t))}):\n{_join(paras, t)}"
                      for j, t in enumerate(threads, 1)]
        user = f"{_head(task, trace)}\n\nThreads to rewrite:\n\n" + "\n\n".join(parts)
    elif step == "tw4_outlines":
        parts = [f"Block {k}, thread {j}:\n{text}" for k, b in enumerate(prior["tw3_rewrite"]["blocks"], 1)
                 for j, text in enumerate(b, 1)]
        user = f"Problem:\n{task_prompt(task)}\n\nThreads:\n\n" + "\n\n".join(parts)
    elif step == "tw5_validate":
        user = (f"Problem:\n{task_prompt(task)}\n\nTrajectory:\n"
                f"{tw.render_completion(assemble(trace, prior))}")
    else:
        raise ValueError(f"unknown step {step!r}")
    return [{"role": "system", "content": SYSTEM_PROMPTS[step]}, {"role": "user", "content": user}]


def _join(paras: list[str], numbers_: list[int]) -> str:
    return "\n\n".join(paras[i - 1] for i in numbers_)


# ---- assembly -----------------------------------------------------------------------------------

def assemble(trace: Trace, prior: dict) -> tw.TWTrajectory:
    """The trajectory of steps 1-4: paragraphs outside the spans stay sequential text, in order;
    span k becomes block k with step 4's outlines and step 3's threads; the answer is the trace's."""
    paras = paragraphs(trace.text)
    blocks, cursor = [], 1
    for (a, b), threads, outlines in zip(prior["tw1_spans"]["spans"], prior["tw3_rewrite"]["blocks"],
                                         prior["tw4_outlines"]["blocks"]):
        blocks.append(tw.ParallelBlock("\n\n".join(paras[cursor - 1:a - 1]), outlines, threads))
        cursor = b + 1
    return tw.TWTrajectory("", blocks, "\n\n".join(paras[cursor - 1:]), trace.final_answer)


def _as_sprint(query: str, traj: tw.TWTrajectory) -> sf.Trajectory:
    """Block k as a SPRINT stage (the text before it and its outlines as the plan, its threads as
    the executions), for `rewrite.sibling_dependencies`; the text after the last block is left out."""
    return sf.Trajectory(query, [sf.Stage(k, [b.before] + [sf.Prompt(o) for o in b.outlines], list(b.threads))
                                 for k, b in enumerate(traj.blocks, 1)], traj.answer)


def _sibling_detail(deps) -> str:
    return "; ".join(f"thread {k}.{j} uses {n}, a result of thread {k}.{s}" for k, j, n, s in deps[:5])


# ---- checks -------------------------------------------------------------------------------------

_FENCE = re.compile(r"\A\s*```[\w-]*[ \t]*\n(.*?)\n\s*```\s*\Z", re.S)


def _parsed(step: str, content: str):
    try:
        return _MODELS[step].model_validate_json(content)
    except pydantic.ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())) or "(root)"
        raise StepRejected("malformed", f"{where}: {first.get('msg', str(e))}") from None


def _texts_ok(kind: str, blocks: list[list[str]]) -> None:
    for k, texts in enumerate(blocks, 1):
        for j, text in enumerate(texts, 1):
            if not text.strip():
                raise StepRejected("empty_text", f"{kind} {k}.{j} is empty")
            tags = tw.find_tags(text) + sf.find_tags(text)
            if tags:
                raise StepRejected("tag_in_text", f"{kind} {k}.{j} contains {tags[0]!r}")


def _shape_ok(blocks: list[list], want: list[int], what: str) -> None:
    got = [len(b) for b in blocks]
    if got != want:
        raise StepRejected("wrong_count", f"{what} per block {got}, expected {want}")


def check(step: str, task: Task, trace: Trace, prior: dict, content: str, finish_reason: str | None):
    """The stored value of `step` for the LLM's reply (JSON-ready), or StepRejected(reason, detail)."""
    if finish_reason == "length":
        raise StepRejected("truncated", "the reply hit rewriter.max_tokens")
    return _CHECKS[step](task, trace, prior, content)


def _check_spans(task, trace, prior, content) -> dict:
    n = len(paragraphs(trace.text))
    spans = [(s.first, s.last) for s in _parsed("tw1_spans", content).spans]
    if not spans:
        raise StepRejected("no_span", "the reply lists no span")
    end = 0
    for a, b in spans:
        if not 1 <= a <= b <= n:
            raise StepRejected("bad_span", f"paragraphs {a}-{b}: not a span of paragraphs 1-{n}")
        if a <= end:
            raise StepRejected("bad_span", f"paragraphs {a}-{b} overlap or precede the span before")
        if a == b:
            raise StepRejected("bad_span", f"paragraphs {a}-{b}: one paragraph cannot be split into threads")
        end = b
    return {"spans": [list(s) for s in spans]}


def _check_threads(task, trace, prior, content) -> dict:
    spans = prior["tw1_spans"]["spans"]
    blocks = [b.threads for b in _parsed("tw2_threads", content).blocks]
    if len(blocks) != len(spans):
        raise StepRejected("wrong_count", f"{len(blocks)} blocks for {len(spans)} spans")
    for k, ((a, b), threads) in enumerate(zip(spans, blocks), 1):
        if len(threads) < 2:
            raise StepRejected("single_thread", f"block {k} has {len(threads)} thread(s)")
        given = sorted(i for t in threads for i in t)
        if any(not t for t in threads) or given != list(range(a, b + 1)):
            raise StepRejected("bad_partition", f"block {k}: threads {threads} do not cover paragraphs {a}-{b} "
                                                f"exactly once")
    return {"blocks": [[sorted(t) for t in threads] for threads in blocks]}


def _context_before(task: Task, paras: list[str], spans: list, k: int, threads: list[list[str]]) -> str:
    """What a thread of block k sees besides its block: the query, the sequential text and the
    threads of earlier blocks."""
    out, cursor = [task_prompt(task)], 1
    for i, (a, b) in enumerate(spans[:k]):
        out.append("\n\n".join(paras[cursor - 1:a - 1]))
        if i < k - 1:
            out += threads[i]
        cursor = b + 1
    return "\n".join(out)


def _check_rewrite(task, trace, prior, content) -> dict:
    spans, split = prior["tw1_spans"]["spans"], prior["tw2_threads"]["blocks"]
    blocks = [b.threads for b in _parsed("tw3_rewrite", content).blocks]
    if len(blocks) != len(split):
        raise StepRejected("wrong_count", f"{len(blocks)} blocks, expected {len(split)}")
    _shape_ok(blocks, [len(t) for t in split], "threads")
    blocks = [[t.strip() for t in b] for b in blocks]
    _texts_ok("thread", blocks)
    paras = paragraphs(trace.text)
    for k, (threads, texts) in enumerate(zip(split, blocks), 1):
        for j, (numbers_, text) in enumerate(zip(threads, texts), 1):
            had = {n for n, derived in first_uses(_join(paras, numbers_)).items() if derived}
            lost = sorted(had - numbers(text), key=lambda s: (len(s), s))
            if lost:
                raise StepRejected("lost_result", f"thread {k}.{j} no longer has {', '.join(lost[:5])}, "
                                                  f"derived there in the trace")
    traj = tw.TWTrajectory("", [tw.ParallelBlock("\n\n".join(paras[(spans[k - 1][1] if k else 0):a - 1]), [], t)
                                for k, ((a, _), t) in enumerate(zip(spans, blocks))])
    deps = sibling_dependencies(task_prompt(task), _as_sprint("", traj))
    if deps:
        raise StepRejected("sibling_dependency", _sibling_detail(deps))
    return {"blocks": blocks}


def _check_outlines(task, trace, prior, content) -> dict:
    spans, threads = prior["tw1_spans"]["spans"], prior["tw3_rewrite"]["blocks"]
    blocks = [b.outlines for b in _parsed("tw4_outlines", content).blocks]
    if len(blocks) != len(threads):
        raise StepRejected("wrong_count", f"{len(blocks)} blocks, expected {len(threads)}")
    _shape_ok(blocks, [len(t) for t in threads], "outlines")
    blocks = [[o.strip() for o in b] for b in blocks]
    _texts_ok("outline", blocks)
    paras = paragraphs(trace.text)
    for k, (outlines, texts) in enumerate(zip(blocks, threads), 1):
        given = numbers(_context_before(task, paras, spans, k, threads))
        results = [{n for n, derived in first_uses(t).items() if derived and n not in given} for t in texts]
        for j, outline in enumerate(outlines, 1):
            for s, derived in enumerate(results, 1):
                leaked = sorted(derived & numbers(outline), key=lambda x: (len(x), x))
                if leaked:
                    raise StepRejected("outline_gives_result", f"outline {k}.{j} states {leaked[0]}, "
                                                               f"a result of thread {k}.{s}")
    return {"blocks": blocks}


def _check_validate(task, trace, prior, content) -> dict:
    fenced = _FENCE.match(content)
    text = (fenced.group(1) if fenced else content).strip()
    traj, problems = tw.parse_completion(text)
    if not problems and traj.answer is None:
        problems = [f"no {tw.THINK_CLOSE}: the trajectory has no answer"]
    if problems:
        raise StepRejected("malformed", "; ".join(problems[:5]))
    want = assemble(trace, prior)
    shape = lambda t: [(len(b.outlines), len(b.threads)) for b in t.blocks]  # noqa: E731
    if shape(traj) != shape(want):
        raise StepRejected("structure_changed", f"(outlines, threads) per block {shape(traj)}, expected {shape(want)}")
    empty = [f"{k}.{j}" for k, b in enumerate(traj.blocks, 1) for j, x in enumerate(b.outlines + b.threads, 1)
             if not x]
    if empty:
        raise StepRejected("malformed", f"an empty outline or thread in block {empty[0].split('.')[0]}")
    deps = sibling_dependencies(task_prompt(task), _as_sprint("", traj))
    if deps:
        raise StepRejected("sibling_dependency", _sibling_detail(deps))
    wrong = answer_problem(task, trace, traj.answer)
    if wrong:
        raise StepRejected(*wrong)
    traj.answer = trace.final_answer
    return {"completion": tw.render_completion(traj), "widths": [len(b.threads) for b in traj.blocks]}


_CHECKS = {"tw1_spans": _check_spans, "tw2_threads": _check_threads, "tw3_rewrite": _check_rewrite,
           "tw4_outlines": _check_outlines, "tw5_validate": _check_validate}


__all__ = ["STEPS", "REASONS", "SYSTEM_PROMPTS", "StepRejected", "response_format", "paragraphs", "messages",
           "assemble", "check"]
