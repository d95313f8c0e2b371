"""ThreadWeaver's tag format (Lian et al., 2025): data types, render, a total parser, span labels,
and conversion to and from SPRINT's format (`sprint_jax.format`).

Inside `<think>`, sequential text alternates with parallel blocks; the answer follows `</think>`:

    QUERY
    <think>
    sequential text
    <Parallel>
    <Outlines>
    <Outline>1: first subtask</Outline>
    <Outline>2: second subtask</Outline>
    </Outlines>
    <Thread>1: work on the first</Thread>
    <Thread>2: work on the second</Thread>
    </Parallel>
    more sequential text
    </think>
    the answer

A block holds one or more numbered outlines, then one thread per outline in outline order, each
numbered like its outline; blocks do not nest. Inference decodes the main sequence to
`</Outlines>`, runs the threads in one batched step (thread j forced open with `thread_opening(j)`
after one `BLOCK_GAP`, stopped at `</Thread>`), joins them in order, appends `BLOCK_GAP` +
`</Parallel>`, and the main sequence goes on. A trace with no block is ThreadWeaver's sequential
baseline. The answer has no closing tag: it runs to the end of the text (EOS at inference), so a
truncated answer cannot be told from a short one. Every ThreadWeaver tag string is defined here.

Canonical whitespace (what `render` writes; `parse(render(t)) == t` for every normalised `t`): one
tag or text per line, lines joined by `BLOCK_GAP` (one newline); an outline or thread is
`<Outline>j: text</Outline>` (`<Outline>j:</Outline>` when the text is empty); empty sequential
texts and an empty answer are left out (the answer's absence, `answer is None`, is the absence of
`</think>`); the query comes first, then one newline. Content is stripped on construction and may
not contain a ThreadWeaver tag (`render` raises ValueError).

Own types, because the mapping onto SPRINT's `Trajectory` is not onto: block k is SPRINT's
`Stage(k, [before, Prompt(outline) ...], threads)`, the text after the last block is a last
plan-only `Stage(n + 1, [after])`, the answer is the `<Final Answer>`. SPRINT structures with no
ThreadWeaver counterpart (`from_sprint` refuses them, naming why): an implicit-prompt stage (one
execution, no prompt), free plan text after a prompt, a plan-only stage that is not the last or
is empty, prompts and executions differing in number, stage numbers other than 1..n, and content
holding a ThreadWeaver tag. ThreadWeaver's outline numbers are structure, not content (SPRINT's
prompts carry none); its `<Conclusion>` block (an optional variant of the paper's data) is not
part of this grammar: the parser reports it as untagged text inside `<Parallel>`.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
from pathlib import Path
from typing import Iterable, Literal

from sprint_jax import format as sf
from sprint_jax.errors import UserError
from sprint_jax.fsutil import write_atomic
from sprint_jax.jsonl import iter_objects
from sprint_jax.schema import Example

SPAN_KINDS = sf.SPAN_KINDS
BLOCK_GAP = sf.BLOCK_GAP      # between lines (tags, sequential text, the answer) and after the query

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARALLEL_OPEN, PARALLEL_CLOSE = "<Parallel>", "</Parallel>"
OUTLINES_OPEN, OUTLINES_CLOSE = "<Outlines>", "</Outlines>"
OUTLINE_OPEN, OUTLINE_CLOSE = "<Outline>", "</Outline>"
THREAD_OPEN, THREAD_CLOSE = "<Thread>", "</Thread>"

TAG_PATTERN = re.compile(r"<(/?)(think|Parallel|Outlines|Outline|Thread)>")
# an outline's or thread's number: ASCII, no leading zero, at most 9 digits, then a colon
_NUMBER = re.compile(r"\s*([1-9][0-9]{0,8}):")

_OPEN = {"think": THINK_OPEN, "Parallel": PARALLEL_OPEN, "Outlines": OUTLINES_OPEN,
         "Outline": OUTLINE_OPEN, "Thread": THREAD_OPEN}
_CLOSE = {"think": THINK_CLOSE, "Parallel": PARALLEL_CLOSE, "Outlines": OUTLINES_CLOSE,
          "Outline": OUTLINE_CLOSE, "Thread": THREAD_CLOSE}
# the block each tag opens inside; the chain from <think> down to a kind is its ancestors
_PARENT = {"think": None, "Parallel": "think", "Outlines": "Parallel", "Outline": "Outlines", "Thread": "Parallel"}


def thread_opening(j: int) -> str:
    """The forced start of thread j (the orchestrator puts `BLOCK_GAP` before it): `<Thread>j:`."""
    return f"{THREAD_OPEN}{j}:"


def sequential_stop_strings() -> list[str]:
    """Where a main-sequence decode stops to fork: its outlines close. (The answer has no closing
    tag; a decode that writes `</think>` runs on to EOS.)"""
    return [OUTLINES_CLOSE]


def thread_stop_strings() -> list[str]:
    """Where every thread's decode stops."""
    return [THREAD_CLOSE]


def tag_vocabulary() -> list[str]:
    """Every ThreadWeaver tag string, each opening before its closing (for a tokenizer that makes
    each tag a single token). Outline and thread numbers are text, not tags."""
    return [t for kind in _OPEN for t in (_OPEN[kind], _CLOSE[kind])]


def find_tags(text: str) -> list[str]:
    """Every ThreadWeaver tag in `text`, in order."""
    return [m.group(0) for m in TAG_PATTERN.finditer(text)]


def contains_tag(text: str) -> bool:
    return TAG_PATTERN.search(text) is not None


# ---------------------------------------------------------------------------------------------
# Data types
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ParallelBlock:
    """One `<Parallel>` block and the sequential text just before it. `outlines[j-1]` and
    `threads[j-1]` are the texts of outline and thread j, numbers left out."""
    before: str = ""
    outlines: list[str] = dataclasses.field(default_factory=list)
    threads: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.before = str(self.before).strip()
        self.outlines = [str(o).strip() for o in self.outlines]
        self.threads = [str(t).strip() for t in self.threads]


@dataclasses.dataclass
class TWTrajectory:
    """A query and its ThreadWeaver body. `after` is the sequential text after the last block;
    `answer is None` means no `</think>`."""
    query: str = ""
    blocks: list[ParallelBlock] = dataclasses.field(default_factory=list)
    after: str = ""
    answer: str | None = None

    def __post_init__(self) -> None:
        self.query = str(self.query).strip()
        self.blocks = list(self.blocks)
        self.after = str(self.after).strip()
        if self.answer is not None:
            self.answer = str(self.answer).strip()


# ---------------------------------------------------------------------------------------------
# Render
# ---------------------------------------------------------------------------------------------

def _checked(content: str, where: str) -> str:
    m = TAG_PATTERN.search(content)
    if m:
        raise ValueError(f"{where} contains the ThreadWeaver tag {m.group(0)!r}; it would not parse back")
    return content


def _numbered(open_tag: str, j: int, text: str, close_tag: str) -> str:
    return f"{open_tag}{j}:{' ' + text if text else ''}{close_tag}"


def render_completion(traj: TWTrajectory) -> str:
    """The body only (what the model writes after the prompt); starts at `<think>`."""
    lines = [THINK_OPEN]
    for k, block in enumerate(traj.blocks, start=1):
        if block.before:
            lines.append(_checked(block.before, f"text before block {k}"))
        lines += [PARALLEL_OPEN, OUTLINES_OPEN]
        lines += [_numbered(OUTLINE_OPEN, j, _checked(o.strip(), f"outline {k}.{j}"), OUTLINE_CLOSE)
                  for j, o in enumerate(block.outlines, start=1)]
        lines.append(OUTLINES_CLOSE)
        lines += [_numbered(THREAD_OPEN, j, _checked(t.strip(), f"thread {k}.{j}"), THREAD_CLOSE)
                  for j, t in enumerate(block.threads, start=1)]
        lines.append(PARALLEL_CLOSE)
    if traj.after.strip():
        lines.append(_checked(traj.after.strip(), "text after the last block"))
    if traj.answer is not None:
        lines.append(THINK_CLOSE)
        if traj.answer.strip():
            lines.append(_checked(traj.answer.strip(), "answer"))
    return BLOCK_GAP.join(lines)


def render(traj: TWTrajectory) -> str:
    """Query, one newline, then the body (the body alone if the query is empty)."""
    body = render_completion(traj)
    query = _checked(traj.query.strip(), "query")
    return query + BLOCK_GAP + body if query else body


# ---------------------------------------------------------------------------------------------
# Parse (total: never raises, reports problems)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _BlockBuilder:
    at: int
    before: str
    outlines: list[str] = dataclasses.field(default_factory=list)
    threads: list[str] = dataclasses.field(default_factory=list)
    outlines_opened: bool = False


@dataclasses.dataclass
class _Open:
    kind: str                  # "think" | "Parallel" | "Outlines" | "Outline" | "Thread"
    at: int
    block: _BlockBuilder | None = None
    parts: list[str] = dataclasses.field(default_factory=list)
    started: bool = False      # Outline / Thread: its number was looked for (at its first text)
    number: int | None = None
    implicit: bool = False     # opened for a tag that needed it; its missing opening is reported


_CONTENT_LABEL = {"Outline": "prompt", "Thread": "execution"}


def _short(s: str, n: int = 40) -> str:
    s = " ".join(s.split())
    return repr(s if len(s) <= n else s[: n - 3] + "...")


class _Scanner:
    """One pass over the text: tags drive a stack of open blocks. A tag that cannot stand where it
    is closes the blocks that do not contain it (reported as unclosed) or opens the missing ones
    (reported as missing), so every input yields a structure, its problems, and a label for every
    character."""

    def __init__(self, text: str, mode: str):
        self.text = text
        self.mode = mode                   # "document" | "completion"
        self.problems: list[str] = []
        self.segments: list[tuple[int, int, str]] = []
        self.stack: list[_Open] = []
        self.blocks: list[_BlockBuilder] = []
        self.sequential: list[str] = []    # think-level text since the last block
        self.query = ""
        self.after = ""
        self.answer: list[str] | None = None
        self.think_seen = False
        self.ended = False                 # a tag followed </think>: reported once, the rest is not read
        self.seen_tag = False

    def _label(self, start: int, end: int, label: str) -> None:
        if end > start:
            self.segments.append((start, end, label))

    # -- text ---------------------------------------------------------------------------------
    def text_span(self, start: int, end: int) -> None:
        if end <= start:
            return
        seg = self.text[start:end]
        if self.ended:
            self._label(start, end, "plan")
        elif self.answer is not None:
            self.answer.append(seg)
            self._label(start, end, "answer")
        elif not self.stack:
            if self.mode == "document" and not self.seen_tag:
                self.query = seg.strip()
                self._label(start, end, "query")
                return
            if seg.strip():
                self.problems.append(f"untagged text before {THINK_OPEN}: {_short(seg)} at char {start}")
            self._label(start, end, "plan")
        else:
            top = self.stack[-1]
            if top.kind == "think":
                self.sequential.append(seg)
                self._label(start, end, "plan")
            elif top.kind in _CONTENT_LABEL:
                if not top.started:
                    top.started = True
                    m = _NUMBER.match(seg)
                    if m:
                        top.number = int(m.group(1))
                        self._label(start, start + m.end(), "tag")
                        start, seg = start + m.end(), seg[m.end():]
                top.parts.append(seg)
                self._label(start, end, _CONTENT_LABEL[top.kind])
            else:
                if seg.strip():
                    self.problems.append(f"untagged text inside {_OPEN[top.kind]}: {_short(seg)} at char {start}")
                self._label(start, end, "plan")

    # -- tags ---------------------------------------------------------------------------------
    def tag(self, m: re.Match) -> None:
        self._label(m.start(), m.end(), "tag")
        closing, kind, at = m.group(1) == "/", m.group(2), m.start()
        self.seen_tag = True
        if self.stack and self.stack[-1].kind in _CONTENT_LABEL:
            self.stack[-1].started = True      # a number must come first, before any tag
        if self.ended:
            return
        if self.answer is not None:
            self.ended = True
            self.problems.append(f"{m.group(0)} after {THINK_CLOSE} at char {at}")
            return
        if closing:
            self._closing(kind, at)
        else:
            self._opening(kind, at)

    def _opening(self, kind: str, at: int) -> None:
        if kind == "think":
            if self.think_seen:
                self.problems.append(f"duplicate {THINK_OPEN} at char {at} (ignored)")
                return
            self.think_seen = True
            self.stack.append(_Open("think", at))
            return
        chain = self._chain(_PARENT[kind])
        kinds = [o.kind for o in self.stack]
        keep = 0
        while keep < min(len(kinds), len(chain)) and kinds[keep] == chain[keep]:
            keep += 1
        while len(self.stack) > keep:
            self._close_top(f" before {_OPEN[kind]}")
        if keep < len(chain):
            self.problems.append(f"missing {_OPEN[chain[keep]]} before {_OPEN[kind]} at char {at}")
            for missing in chain[keep:]:
                self._push(missing, at)
                self.stack[-1].implicit = True
        self._push(kind, at)

    @staticmethod
    def _chain(kind: str) -> list[str]:
        out = [kind]
        while _PARENT[out[-1]] is not None:
            out.append(_PARENT[out[-1]])
        return out[::-1]

    def _push(self, kind: str, at: int) -> None:
        if kind == "think":
            self.think_seen = True
            self.stack.append(_Open("think", at))
            return
        block = self.stack[-1].block if kind != "Parallel" else None
        if kind == "Parallel":
            block = _BlockBuilder(at, "".join(self.sequential).strip())
            self.sequential = []
            self.blocks.append(block)
        elif kind == "Outlines":
            if block.threads:
                self.problems.append(f"{OUTLINES_OPEN} after {THREAD_OPEN} at char {at}")
            elif block.outlines_opened:
                self.problems.append(f"second {OUTLINES_OPEN} in {PARALLEL_OPEN} (opened at char {block.at}) "
                                     f"at char {at}")
            block.outlines_opened = True
        elif kind == "Thread" and len(block.threads) >= len(block.outlines):
            self.problems.append(f"{THREAD_OPEN} at char {at} has no matching {OUTLINE_OPEN} "
                                 f"({len(block.outlines)} in its {PARALLEL_OPEN})")
        self.stack.append(_Open(kind, at, block))

    def _closing(self, kind: str, at: int) -> None:
        depth = next((d for d in range(len(self.stack) - 1, -1, -1) if self.stack[d].kind == kind), None)
        if depth is None:
            if kind == "think" and not self.think_seen:
                self.problems.append(f"missing {THINK_OPEN} before {THINK_CLOSE} at char {at}")
                self.think_seen = True
                self.answer = []
                return
            self.problems.append(f"stray {_CLOSE[kind]} at char {at} with no open {_OPEN[kind]} (ignored)")
            return
        while len(self.stack) > depth + 1:
            self._close_top(f" before {_CLOSE[kind]}")
        self._pop()

    def _close_top(self, when: str) -> None:
        top = self.stack[-1]
        if not top.implicit:
            self.problems.append(f"unclosed {_OPEN[top.kind]} (opened at char {top.at}){when}")
        self._pop()

    def _pop(self) -> None:
        top = self.stack.pop()
        block = top.block
        if top.kind == "think":
            self.after = "".join(self.sequential).strip()
            self.sequential = []
            self.answer = []
        elif top.kind == "Parallel":
            if not block.outlines:
                self.problems.append(f"{PARALLEL_OPEN} at char {top.at} has no {OUTLINE_OPEN}")
            for j in range(len(block.threads) + 1, len(block.outlines) + 1):
                self.problems.append(f"outline {j} of {PARALLEL_OPEN} at char {top.at} has no {THREAD_OPEN}")
        elif top.kind in _CONTENT_LABEL:
            items = block.outlines if top.kind == "Outline" else block.threads
            j = len(items) + 1
            if top.number is None:
                self.problems.append(f"{_OPEN[top.kind]} at char {top.at} does not start with its number '{j}:'")
            elif top.number != j:
                self.problems.append(f"{_OPEN[top.kind]} at char {top.at} is numbered {top.number}: expected {j}")
            items.append("".join(top.parts).strip())

    def finish(self) -> None:
        while self.stack:
            if self.stack[-1].kind == "think":
                self.after = "".join(self.sequential).strip()
                self.stack.pop()
            else:
                self._close_top(": text ended")
        if not self.think_seen:
            self.problems.append(f"missing {THINK_OPEN}")
        if self.answer is None:
            self.problems.append(f"missing {THINK_CLOSE}")

    def run(self) -> "_Scanner":
        pos = 0
        for m in TAG_PATTERN.finditer(self.text):
            self.text_span(pos, m.start())
            self.tag(m)
            pos = m.end()
        self.text_span(pos, len(self.text))
        self.finish()
        return self

    def trajectory(self) -> TWTrajectory:
        blocks = [ParallelBlock(b.before, b.outlines, b.threads) for b in self.blocks]
        answer = None if self.answer is None else "".join(self.answer)
        return TWTrajectory(self.query, blocks, self.after, answer)


def _scan(text: object, mode: str) -> _Scanner:
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    return _Scanner(text, mode).run()


def parse(text: str) -> tuple[TWTrajectory, list[str]]:
    """Query + body -> (TWTrajectory, problems). Total: never raises; an empty problem list means
    a well-formed ThreadWeaver document. Leading untagged text is the query."""
    s = _scan(text, "document")
    return s.trajectory(), s.problems


def parse_completion(text: str) -> tuple[TWTrajectory, list[str]]:
    """Like `parse`, for model output with no query: leading untagged text is reported and kept out
    of the structure. The orchestrator can read the outlines of a decode stopped at `</Outlines>`
    as `parse_completion(text)[0].blocks[-1].outlines` (the open block is reported as unclosed)."""
    s = _scan(text, "completion")
    return s.trajectory(), s.problems


def span_labels(prompt: str, completion: str) -> list[str]:
    """One label from SPAN_KINDS per character of `prompt + completion` (the trainer's loss masks
    take them unchanged). Prompt characters are "query". In the completion the tags and the
    `j:` numbers opening an outline or thread are "tag"; outline text is "prompt", thread text
    "execution", everything after `</think>` "answer"; sequential text, whitespace between blocks
    and untagged text are "plan". Uses the scanner of `parse_completion`."""
    s = _scan(completion, "completion")
    labels = ["query"] * len(prompt) + ["plan"] * len(completion)
    off = len(prompt)
    for start, end, label in s.segments:
        labels[off + start: off + end] = [label] * (end - start)
    return labels


# ---------------------------------------------------------------------------------------------
# Conversion to and from SPRINT
# ---------------------------------------------------------------------------------------------

class ConversionError(ValueError):
    """A trajectory the other format cannot express. `reason` is a short fixed phrase (for counts);
    the message names the stage, block or field."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _no_foreign_tags(texts: Iterable[tuple[str, str]], find, fmt_name: str) -> None:
    for where, text in texts:
        tags = find(text)
        if tags:
            raise ConversionError(f"content holds a {fmt_name} tag", f"{where} contains {tags[0]!r}")


def to_sprint(source: str | TWTrajectory) -> sf.Trajectory:
    """A well-formed ThreadWeaver document (text, parsed with `parse`) or trajectory as SPRINT's
    Trajectory: block k -> `Stage(k, [before, Prompt(outline) ...], threads)`, the text after the
    last block -> a last plan-only stage, the answer -> the final answer. Raises ConversionError."""
    if isinstance(source, TWTrajectory):
        traj = source
    else:
        traj, problems = parse(source)
        if problems:
            raise ConversionError("malformed ThreadWeaver text", problems[0])
    for k, b in enumerate(traj.blocks, start=1):
        if not b.outlines:
            raise ConversionError("a parallel block with no outline", f"block {k}")
        if len(b.threads) != len(b.outlines):
            raise ConversionError("outlines and threads differ in number",
                                  f"block {k} has {len(b.outlines)} outlines and {len(b.threads)} threads")
    texts = [("query", traj.query), ("text after the last block", traj.after), ("answer", traj.answer or "")]
    for k, b in enumerate(traj.blocks, start=1):
        texts += [(f"text before block {k}", b.before)]
        texts += [(f"outline {k}.{j}", o) for j, o in enumerate(b.outlines, 1)]
        texts += [(f"thread {k}.{j}", t) for j, t in enumerate(b.threads, 1)]
    _no_foreign_tags(texts, sf.find_tags, "SPRINT")
    stages = [sf.Stage(k, [b.before] + [sf.Prompt(o) for o in b.outlines], b.threads)
              for k, b in enumerate(traj.blocks, start=1)]
    if traj.after:
        stages.append(sf.Stage(len(stages) + 1, [traj.after]))
    return sf.Trajectory(traj.query, stages, traj.answer)


def from_sprint(source: str | sf.Trajectory) -> TWTrajectory:
    """A well-formed SPRINT document (text, parsed with `format.parse`) or trajectory as a
    TWTrajectory, the inverse of `to_sprint`. Raises ConversionError naming the first stage
    ThreadWeaver cannot express (see the module docstring)."""
    if isinstance(source, sf.Trajectory):
        traj = source
    else:
        traj, problems = sf.parse(source)
        if problems:
            raise ConversionError("malformed SPRINT text", problems[0])
    blocks: list[ParallelBlock] = []
    after = ""
    n = len(traj.stages)
    for pos, stage in enumerate(traj.stages, start=1):
        i = stage.index
        plan = sf.plan_open(i)
        if i != pos:
            raise ConversionError("plans not numbered 1..n", f"plan {pos} is {plan}")
        prompts = stage.prompts
        if not prompts and stage.executions:
            raise ConversionError("an implicit prompt",
                                  f"{plan} has {len(stage.executions)} execution(s) and no prompt: "
                                  "a ThreadWeaver thread needs its outline")
        if prompts:
            first = next(x for x, p in enumerate(stage.plan) if isinstance(p, sf.Prompt))
            if any(isinstance(p, str) for p in stage.plan[first:]):
                raise ConversionError("plan text after a prompt",
                                      f"{plan} has free text after {sf.prompt_open(i, 1)}: "
                                      "ThreadWeaver's outlines block holds outlines only")
            if len(stage.executions) != len(prompts):
                raise ConversionError("prompts and executions differ in number",
                                      f"{plan} has {len(prompts)} prompts and {len(stage.executions)} executions")
            blocks.append(ParallelBlock(stage.plan_text, prompts, stage.executions))
            continue
        if pos != n:
            raise ConversionError("a plan-only plan before another plan",
                                  f"{plan} has no prompt and {sf.plan_open(i + 1)} follows: ThreadWeaver "
                                  "cannot mark where one plan ends without a parallel block")
        if not stage.plan_text:
            raise ConversionError("an empty plan-only plan", f"{plan} is empty")
        after = stage.plan_text
    out = TWTrajectory(traj.query, blocks, after, traj.final_answer)
    texts = [("query", out.query), (f"{sf.plan_open(n)}", out.after), ("final answer", out.answer or "")]
    for k, b in enumerate(blocks, start=1):
        texts += [(sf.plan_open(k), b.before)]
        texts += [(f"prompt {k}.{j}", o) for j, o in enumerate(b.outlines, 1)]
        texts += [(f"execution {k}.{j}", t) for j, t in enumerate(b.threads, 1)]
    _no_foreign_tags(texts, find_tags, "ThreadWeaver")
    return out


# ---------------------------------------------------------------------------------------------
# Training files: SPRINT <-> ThreadWeaver
# ---------------------------------------------------------------------------------------------

Format = Literal["sprint", "threadweaver"]
FORMATS: tuple[str, ...] = ("sprint", "threadweaver")
FORMAT_META_KEY = "format"     # Example.meta key a converted ThreadWeaver example carries


class ConvertInputError(UserError):
    """A training file that cannot be read as examples: names the file and line."""


@dataclasses.dataclass
class ConvertStats:
    """What `convert_examples` did: examples read and written, skipped ones counted by reason,
    with the first skipped example of each reason as `file:line: message`."""
    read: int = 0
    written: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    first_skip: dict[str, str] = dataclasses.field(default_factory=dict)


def _rft_to_threadweaver(completion: str) -> str:
    """An RFT completion (serial trace, then `<Final Answer>`) as a ThreadWeaver trace with no
    block: the trace is the sequential text, the answer follows `</think>`."""
    m = sf.TAG_PATTERN.search(completion)
    trace = completion[:m.start()] if m else completion
    traj, problems = sf.parse_completion(completion[len(trace):])
    if problems or traj.stages:
        raise ConversionError("malformed RFT text", problems[0] if problems else "it has SPRINT stages")
    tw = TWTrajectory(after=trace, answer=traj.final_answer)
    _no_foreign_tags([("trace", tw.after), ("final answer", tw.answer)], find_tags, "ThreadWeaver")
    return render_completion(tw)


def _threadweaver_to_rft(completion: str) -> str:
    traj, problems = parse_completion(completion)
    if problems:
        raise ConversionError("malformed ThreadWeaver text", problems[0])
    if traj.blocks:
        raise ConversionError("an RFT example with parallel blocks", f"{len(traj.blocks)} block(s)")
    _no_foreign_tags([("trace", traj.after), ("answer", traj.answer)], sf.find_tags, "SPRINT")
    answer = sf.render_completion(sf.Trajectory(final_answer=traj.answer))
    return traj.after + BLOCK_GAP + answer if traj.after else answer


def convert_example(ex: Example, to: Format) -> Example:
    """`ex` with its completion in format `to` (the prompt, id, kind and answer unchanged).
    A "sprint" example converts through `from_sprint` / `to_sprint`; an "rft" one (a serial
    trace) is a ThreadWeaver trace with no block. Raises ConversionError (ValueError for an
    unknown `to`)."""
    if to not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {to!r}")
    find_foreign = find_tags if to == "threadweaver" else sf.find_tags
    tags = find_foreign(ex.prompt)
    if tags:
        raise ConversionError("the prompt holds a tag of the target format", f"prompt contains {tags[0]!r}")
    meta = {k: v for k, v in (ex.meta or {}).items() if k != FORMAT_META_KEY}
    if to == "threadweaver":
        meta[FORMAT_META_KEY] = "threadweaver"
        if ex.kind == "rft":
            completion = _rft_to_threadweaver(ex.completion)
        else:
            traj, problems = sf.parse_completion(ex.completion)
            if problems:
                raise ConversionError("malformed SPRINT text", problems[0])
            completion = render_completion(from_sprint(traj))
    elif ex.kind == "rft":
        completion = _threadweaver_to_rft(ex.completion)
    else:
        traj, problems = parse_completion(ex.completion)
        if problems:
            raise ConversionError("malformed ThreadWeaver text", problems[0])
        completion = sf.render_completion(to_sprint(traj))
    return dataclasses.replace(ex, completion=completion, meta=meta)


def convert_examples(src: str | Path, dst: str | Path, to: str) -> ConvertStats:
    """Convert a jsonl file of training examples (`schema.Example`: id, kind, prompt, completion)
    to format `to` ("sprint" or "threadweaver") and write the converted ones to `dst` (atomically).
    Examples the target format cannot express are skipped and counted by reason; an unreadable
    file or record raises ConvertInputError naming file and line."""
    if to not in FORMATS:
        raise ConvertInputError(f"format must be one of {', '.join(FORMATS)}, got {to!r}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise ConvertInputError(f"{dst}: the output would overwrite the input")
    stats = ConvertStats()
    skipped: collections.Counter[str] = collections.Counter()
    lines: list[str] = []
    for n, d in iter_objects(src, ConvertInputError):
        where = f"{src}:{n}"
        ex = Example.from_record(d, where, ConvertInputError)
        stats.read += 1
        try:
            out = convert_example(ex, to)  # type: ignore[arg-type]
        except ConversionError as e:
            skipped[e.reason] += 1
            stats.first_skip.setdefault(e.reason, f"{where}: {e}")
            continue
        lines.append(json.dumps(out.to_json(), ensure_ascii=False) + "\n")
        stats.written += 1
    write_atomic(dst, "".join(lines))
    stats.skipped = dict(skipped.most_common())
    return stats


__all__ = [
    "SPAN_KINDS", "BLOCK_GAP", "THINK_OPEN", "THINK_CLOSE", "PARALLEL_OPEN", "PARALLEL_CLOSE", "OUTLINES_OPEN",
    "OUTLINES_CLOSE", "OUTLINE_OPEN", "OUTLINE_CLOSE", "THREAD_OPEN", "THREAD_CLOSE", "TAG_PATTERN",
    "thread_opening", "sequential_stop_strings", "thread_stop_strings", "tag_vocabulary", "find_tags",
    "contains_tag", "ParallelBlock", "TWTrajectory", "render", "render_completion", "parse", "parse_completion",
    "span_labels", "ConversionError", "to_sprint", "from_sprint", "Format", "FORMATS", "FORMAT_META_KEY",
    "ConvertInputError", "ConvertStats", "convert_example", "convert_examples",
]
