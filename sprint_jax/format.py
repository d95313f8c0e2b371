"""The SPRINT tag grammar: data types, render, a total parser, and per-character span labels.

Paper §5 and §11 (Biju et al., 2025). A SPRINT body alternates planning and parallel execution:

    <Plan_1> free text <prompt_1.1> subtask </prompt_1.1> <prompt_1.2> ... </prompt_1.2> </Plan_1>
    <execution_1.1> ... </execution_1.1>
    <execution_1.2> ... </execution_1.2>
    <Plan_2> ... </Plan_2>
    <Final Answer> ... </Final Answer>

A plan with k prompts is followed by k executions in prompt order. A plan with no prompt may be
followed by one `<execution_i.1>` (the plan text is then the implicit prompt, as in the paper's
examples). A plan with neither is plan-only.

Every SPRINT tag string is defined in this module and nowhere else.

Canonical whitespace (what `render` writes; `parse(render(t)) == t` for every normalised `t`):
  * each block is `OPEN content CLOSE` with exactly one space on each side of the content, or
    `OPEN CLOSE` when the content is empty;
  * inside a plan, free-text pieces and `<prompt_i.j> ... </prompt_i.j>` blocks are joined by one
    space;
  * blocks (each plan, each execution, the final answer) are separated by one newline;
  * `render` puts the query first, then one newline, then the body (body alone if the query is
    empty).
All content is stripped on construction (`str.strip`), adjacent free-text plan pieces are merged
with one space and empty ones dropped, so the parser (which strips every content span) returns
exactly the object that was rendered. Content may not contain a SPRINT tag: `render` raises
ValueError rather than write text that would parse back differently.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from typing import Iterable, Literal, Union

SPAN_KINDS: tuple[str, ...] = ("query", "plan", "prompt", "execution", "answer", "tag")

FINAL_OPEN = "<Final Answer>"
FINAL_CLOSE = "</Final Answer>"

# How training lays a rendered example out (train/data.py): `flat`, the paper's one causal sequence;
# `trie`, one unit per planner / executor call; `merge`, every token once with executors of a stage
# side by side from the fork position (docs/design.md "Layouts: flat, trie, merge"). Inference
# tokenizes its contexts the same way, and the layout written into an export picks the
# orchestrator's join.
Layout = Literal["flat", "trie", "merge"]
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)
# Layouts that tokenize the text as the pieces of train/data.py `split_pieces`, each on its own (the
# calls' boundaries: planner output, forced openings, execution bodies); `flat` tokenizes the query
# and the whole completion as two strings.
PIECEWISE_LAYOUTS: tuple[str, ...] = ("trie", "merge")

# Canonical whitespace, used by `render` and by the orchestrator's forced text (one place per fact).
BLOCK_GAP = "\n"      # between blocks (plans, executions, the final answer) and after the query
CLOSE_GAP = " "       # between a tag and the content it opens or closes


def plan_open(i: int) -> str:
    return f"<Plan_{i}>"


def plan_close(i: int) -> str:
    return f"</Plan_{i}>"


def prompt_open(i: int, j: int) -> str:
    return f"<prompt_{i}.{j}>"


def prompt_close(i: int, j: int) -> str:
    return f"</prompt_{i}.{j}>"


def execution_open(i: int, j: int) -> str:
    return f"<execution_{i}.{j}>"


def execution_close(i: int, j: int) -> str:
    return f"</execution_{i}.{j}>"


def planner_stop_strings(i: int) -> list[str]:
    """Where the planner's decode for stage i stops (paper §10): its plan closes, or it answers."""
    return [plan_close(i), FINAL_CLOSE]


def tag_vocabulary(max_stages: int, max_prompts: int) -> list[str]:
    """Every tag string up to `max_stages` plans of `max_prompts` prompts (for a demo tokenizer that
    makes each tag a single token). Order: final-answer tags, then per stage its plan, prompt and
    execution tags."""
    tags = [FINAL_OPEN, FINAL_CLOSE]
    for i in range(1, max_stages + 1):
        tags += [plan_open(i), plan_close(i)]
        for j in range(1, max_prompts + 1):
            tags += [prompt_open(i, j), prompt_close(i, j), execution_open(i, j), execution_close(i, j)]
    return tags


# Numbers are ASCII, no leading zero, at most 9 digits: "<Plan_0>", "<Plan_01>" and absurdly long
# numbers are plain text, and int() never sees a string it would refuse.
_NUM = r"([1-9][0-9]{0,8})"
TAG_PATTERN = re.compile(
    rf"<(/?)(?:Plan_{_NUM}|prompt_{_NUM}\.{_NUM}|execution_{_NUM}\.{_NUM}|(Final Answer))>")
_MAX_INDEX = 999_999_999


def find_tags(text: str) -> list[str]:
    """Every SPRINT tag in `text`, in order."""
    return [m.group(0) for m in TAG_PATTERN.finditer(text)]


def contains_tag(text: str) -> bool:
    return TAG_PATTERN.search(text) is not None


# ---------------------------------------------------------------------------------------------
# Data types
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prompt:
    """A subtask handed to one executor: `<prompt_i.j> text </prompt_i.j>` inside Plan_i."""
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", str(self.text).strip())


PlanPiece = Union[str, Prompt]


def _normalise_pieces(pieces: Iterable[PlanPiece] | str) -> list[PlanPiece]:
    if isinstance(pieces, (str, Prompt)):
        pieces = [pieces]
    out: list[PlanPiece] = []
    for piece in pieces:
        if isinstance(piece, Prompt):
            out.append(piece)
            continue
        text = str(piece).strip()
        if not text:
            continue
        if out and isinstance(out[-1], str):
            out[-1] = out[-1] + " " + text
        else:
            out.append(text)
    return out


@dataclasses.dataclass
class Stage:
    """One plan (ordered free text and prompts) and the executions that follow it (paper §5).

    `index` is the i of `<Plan_i>`; `executions[j-1]` is the content of `<execution_i.j>`.
    """
    index: int
    plan: list[PlanPiece] = dataclasses.field(default_factory=list)
    executions: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or not 1 <= self.index <= _MAX_INDEX:
            raise ValueError(f"Stage.index must be an int in 1..{_MAX_INDEX}, got {self.index!r}")
        self.plan = _normalise_pieces(self.plan)
        self.executions = [str(e).strip() for e in self.executions]

    @property
    def prompts(self) -> list[str]:
        return [p.text for p in self.plan if isinstance(p, Prompt)]

    @property
    def plan_text(self) -> str:
        """The free planning text of this stage (prompts left out)."""
        return " ".join(p for p in self.plan if isinstance(p, str))


@dataclasses.dataclass
class Trajectory:
    """A query and its SPRINT body. `final_answer is None` means no `<Final Answer>` block."""
    query: str = ""
    stages: list[Stage] = dataclasses.field(default_factory=list)
    final_answer: str | None = None

    def __post_init__(self) -> None:
        self.query = str(self.query).strip()
        self.stages = list(self.stages)
        if self.final_answer is not None:
            self.final_answer = str(self.final_answer).strip()


# ---------------------------------------------------------------------------------------------
# Render
# ---------------------------------------------------------------------------------------------

def _block(open_tag: str, content: str, close_tag: str) -> str:
    inner = CLOSE_GAP + content + CLOSE_GAP if content else CLOSE_GAP
    return open_tag + inner + close_tag


def _checked(content: str, where: str) -> str:
    m = TAG_PATTERN.search(content)
    if m:
        raise ValueError(f"{where} contains the SPRINT tag {m.group(0)!r}; it would not parse back")
    return content


def render_completion(traj: Trajectory) -> str:
    """The tagged body only (what the model writes after the prompt); starts at `<Plan_1>`."""
    lines: list[str] = []
    for stage in traj.stages:
        i = stage.index
        parts: list[str] = []
        j = 0
        for piece in _normalise_pieces(stage.plan):
            if isinstance(piece, Prompt):
                j += 1
                parts.append(_block(prompt_open(i, j), _checked(piece.text, f"prompt {i}.{j}"),
                                    prompt_close(i, j)))
            else:
                parts.append(_checked(piece, f"plan {i} text"))
        lines.append(_block(plan_open(i), " ".join(parts), plan_close(i)))
        for j, execution in enumerate(stage.executions, start=1):
            content = _checked(execution.strip(), f"execution {i}.{j}")
            lines.append(_block(execution_open(i, j), content, execution_close(i, j)))
    if traj.final_answer is not None:
        lines.append(_block(FINAL_OPEN, _checked(traj.final_answer.strip(), "final answer"), FINAL_CLOSE))
    return BLOCK_GAP.join(lines)


def render(traj: Trajectory) -> str:
    """Query, one newline, then the body (see the module docstring for the exact whitespace)."""
    body = render_completion(traj)
    query = _checked(traj.query.strip(), "query")
    if not query:
        return body
    return query + BLOCK_GAP + body if body else query


# ---------------------------------------------------------------------------------------------
# Parse (total: never raises, reports problems)
# ---------------------------------------------------------------------------------------------

_KIND_LABEL = {"plan": "plan", "prompt": "prompt", "execution": "execution", "answer": "answer",
               "stray_prompt": "prompt", "stray_execution": "execution"}


@dataclasses.dataclass
class _Tag:
    closing: bool
    kind: str            # "plan" | "prompt" | "execution" | "answer"
    i: int = 0
    j: int = 0

    @classmethod
    def of(cls, m: re.Match) -> "_Tag":
        closing = m.group(1) == "/"
        if m.group(2):
            return cls(closing, "plan", int(m.group(2)))
        if m.group(3):
            return cls(closing, "prompt", int(m.group(3)), int(m.group(4)))
        if m.group(5):
            return cls(closing, "execution", int(m.group(5)), int(m.group(6)))
        return cls(closing, "answer")

    def text(self, closing: bool | None = None) -> str:
        c = self.closing if closing is None else closing
        if self.kind == "plan":
            return plan_close(self.i) if c else plan_open(self.i)
        if self.kind == "prompt":
            return prompt_close(self.i, self.j) if c else prompt_open(self.i, self.j)
        if self.kind == "execution":
            return execution_close(self.i, self.j) if c else execution_open(self.i, self.j)
        return FINAL_CLOSE if c else FINAL_OPEN


@dataclasses.dataclass
class _StageBuilder:
    index: int
    pieces: list[PlanPiece] = dataclasses.field(default_factory=list)
    executions: list[str] = dataclasses.field(default_factory=list)
    checked: bool = False            # "prompt without execution" already reported (or not needed)
    n_prompts: int = 0               # Prompt pieces so far (counted, not recounted: parsing stays linear)


@dataclasses.dataclass
class _Open:
    kind: str            # "plan" | "prompt" | "execution" | "answer" | "stray_prompt" | "stray_execution"
    tag: _Tag
    at: int
    parts: list[str] = dataclasses.field(default_factory=list)
    stage: _StageBuilder | None = None


def _short(s: str, n: int = 40) -> str:
    s = " ".join(s.split())
    return repr(s if len(s) <= n else s[: n - 3] + "...")


class _Scanner:
    """One pass over the text: SPRINT tags drive a small block stack. Any tag that cannot start
    where it stands closes what is open (reported as unclosed) instead of failing, so every input
    yields a structure, the problems found, and a label for every character."""

    def __init__(self, text: str, mode: str, plan_index: int = 1):
        self.text = text
        self.mode = mode                     # "document" | "completion" | "plan"
        self.problems: list[str] = []
        self.segments: list[tuple[int, int, str]] = []
        self.stages: list[_StageBuilder] = []
        self.stage_indices: set[int] = set()     # plan numbers seen (a set: duplicate checks stay O(1))
        self.stack: list[_Open] = []
        self.query = ""
        self.final: str | None = None
        self.ended: str | None = None        # why everything from here on is "text after ..."
        self.ended_reported = False
        self.seen_tag = False
        if mode == "plan":
            stage = _StageBuilder(plan_index)
            self.stages.append(stage)
            self.stage_indices.add(plan_index)
            self.stack.append(_Open("plan", _Tag(False, "plan", plan_index), 0, stage=stage))

    # -- helpers ------------------------------------------------------------------------------
    def _label(self, start: int, end: int, label: str) -> None:
        if end > start:
            self.segments.append((start, end, label))

    def _close_top(self) -> None:
        block = self.stack.pop()
        content = "".join(block.parts).strip()
        if block.kind == "plan":
            assert block.stage is not None
            block.stage.pieces.append(content)
            if self.mode == "plan":
                self.ended = f"text after {block.tag.text(True)}"
        elif block.kind == "prompt":
            assert block.stage is not None
            block.stage.pieces.append(Prompt(content))
            block.stage.n_prompts += 1
        elif block.kind == "execution":
            assert block.stage is not None
            block.stage.executions.append(content)
        elif block.kind == "answer":
            self.final = content
            self.ended = f"text after {FINAL_CLOSE}"

    def _close_all_unclosed(self, before: str) -> None:
        while self.stack:
            top = self.stack[-1]
            self.problems.append(f"unclosed {top.tag.text(False)} (opened at char {top.at}) before {before}")
            self._close_top()

    def _check_executions_complete(self) -> None:
        if not self.stages:
            return
        stage = self.stages[-1]
        if stage.checked:
            return
        stage.checked = True
        for j in range(len(stage.executions) + 1, stage.n_prompts + 1):
            self.problems.append(f"{prompt_open(stage.index, j)} has no {execution_open(stage.index, j)}")

    # -- events -------------------------------------------------------------------------------
    def text_span(self, start: int, end: int) -> None:
        if end <= start:
            return
        seg = self.text[start:end]
        if self.ended is not None:
            if seg.strip() and not self.ended_reported:
                self.problems.append(f"{self.ended}: {_short(seg)} at char {start}")
                self.ended_reported = True
            self._label(start, end, "plan")
            return
        if self.stack:
            top = self.stack[-1]
            top.parts.append(seg)   # a plan's free text is flushed as a piece when a prompt opens
            self._label(start, end, _KIND_LABEL[top.kind])
            return
        if self.mode == "document" and not self.seen_tag:
            self.query = seg.strip()
            self._label(start, end, "query")
            return
        if seg.strip():
            where = "before the first tag" if not self.seen_tag else "between blocks"
            self.problems.append(f"untagged text {where}: {_short(seg)} at char {start}")
        self._label(start, end, "plan")

    def tag(self, m: re.Match) -> None:
        self._label(m.start(), m.end(), "tag")
        tag = _Tag.of(m)
        first_tag = not self.seen_tag
        self.seen_tag = True
        if self.ended is not None:
            if not self.ended_reported:
                self.problems.append(f"{self.ended}: {tag.text()} at char {m.start()}")
                self.ended_reported = True
            return
        if self.mode == "plan":
            self._tag_in_plan_mode(tag, m, first_tag)
            return
        if tag.closing:
            self._closing(tag, m.start())
            return
        if not (tag.kind == "prompt" and self.stack and self.stack[-1].kind in ("plan", "prompt")):
            self._close_all_unclosed(tag.text())
            if self.ended is not None:   # that closed the final answer: nothing may follow it
                self.problems.append(f"{self.ended}: {tag.text()} at char {m.start()}")
                self.ended_reported = True
                return
        if tag.kind == "plan":
            self._open_plan(tag, m.start())
        elif tag.kind == "prompt":
            self._open_prompt(tag, m.start())
        elif tag.kind == "execution":
            self._open_execution(tag, m.start())
        else:
            self._open_answer(tag, m.start())

    def _tag_in_plan_mode(self, tag: _Tag, m: re.Match, first_tag: bool) -> None:
        plan = self.stack[0]
        if (first_tag and not tag.closing and tag.kind == "plan" and tag.i == plan.tag.i
                and not "".join(plan.parts).strip() and len(self.stack) == 1):
            return  # a leading <Plan_i> in front of the plan's inside
        if tag.kind == "prompt" or (tag.closing and tag.kind == "plan"):
            if tag.closing:
                self._closing(tag, m.start())
            else:
                self._open_prompt(tag, m.start())
            return
        self.problems.append(f"unexpected {tag.text()} inside {plan.tag.text(False)} at char {m.start()}")

    def _open_plan(self, tag: _Tag, at: int) -> None:
        self._check_executions_complete()
        expected = self.stages[-1].index + 1 if self.stages else 1
        if tag.i in self.stage_indices:
            self.problems.append(f"duplicate {tag.text()} at char {at}")
        elif tag.i != expected:
            self.problems.append(f"{tag.text()} out of order at char {at}: expected {plan_open(expected)}")
        stage = _StageBuilder(tag.i)
        self.stages.append(stage)
        self.stage_indices.add(tag.i)
        self.stack.append(_Open("plan", tag, at, stage=stage))

    def _open_prompt(self, tag: _Tag, at: int) -> None:
        if self.stack and self.stack[-1].kind == "prompt":
            top = self.stack[-1]
            self.problems.append(f"unclosed {top.tag.text(False)} (opened at char {top.at}) before {tag.text()}")
            self._close_top()
        if self.stack and self.stack[-1].kind == "plan":
            plan = self.stack[-1]
            stage = plan.stage
            assert stage is not None
            expected = stage.n_prompts + 1
            if tag.i != stage.index:
                self.problems.append(f"{tag.text()} inside {plan.tag.text(False)} at char {at}")
            elif tag.j != expected:
                self.problems.append(
                    f"{tag.text()} out of order at char {at}: expected {prompt_open(stage.index, expected)}")
            stage.pieces.append("".join(plan.parts))
            plan.parts = []
            self.stack.append(_Open("prompt", tag, at, stage=stage))
            return
        self.problems.append(f"{tag.text()} outside any plan at char {at} (ignored)")
        self.stack.append(_Open("stray_prompt", tag, at))

    def _open_execution(self, tag: _Tag, at: int) -> None:
        if not self.stages:
            self.problems.append(f"{tag.text()} before any plan at char {at} (ignored)")
            self.stack.append(_Open("stray_execution", tag, at))
            return
        stage = self.stages[-1]
        expected = len(stage.executions) + 1
        if tag.i != stage.index:
            self.problems.append(f"{tag.text()} after {plan_open(stage.index)} at char {at}: "
                                 f"expected {execution_open(stage.index, expected)}")
        elif tag.j != expected:
            self.problems.append(
                f"{tag.text()} out of order at char {at}: expected {execution_open(stage.index, expected)}")
        if len(stage.executions) >= max(1, stage.n_prompts):
            self.problems.append(f"{tag.text()} at char {at} has no matching prompt in {plan_open(stage.index)}")
        self.stack.append(_Open("execution", tag, at, stage=stage))

    def _open_answer(self, tag: _Tag, at: int) -> None:
        self._check_executions_complete()
        self.stack.append(_Open("answer", tag, at))

    def _closing(self, tag: _Tag, at: int) -> None:
        for depth in range(len(self.stack) - 1, -1, -1):
            block = self.stack[depth]
            if block.tag.kind == tag.kind and block.tag.i == tag.i and block.tag.j == tag.j:
                while len(self.stack) > depth + 1:
                    top = self.stack[-1]
                    self.problems.append(
                        f"unclosed {top.tag.text(False)} (opened at char {top.at}) before {tag.text()}")
                    self._close_top()
                self._close_top()
                return
        if self.stack and self.stack[-1].tag.kind == tag.kind:
            top = self.stack[-1]
            self.problems.append(f"{tag.text()} at char {at} does not match {top.tag.text(False)}")
            self._close_top()
            return
        self.problems.append(f"stray {tag.text()} at char {at} with no open {tag.text(False)} (ignored)")

    def finish(self) -> None:
        while self.stack:
            top = self.stack[-1]
            if not (self.mode == "plan" and len(self.stack) == 1):
                self.problems.append(f"unclosed {top.tag.text(False)} (opened at char {top.at}): text ended")
            self._close_top()
        if self.mode != "plan":
            self._check_executions_complete()
            if self.final is None:
                self.problems.append(f"missing {FINAL_OPEN}")

    def run(self) -> "_Scanner":
        pos = 0
        for m in TAG_PATTERN.finditer(self.text):
            self.text_span(pos, m.start())
            self.tag(m)
            pos = m.end()
        self.text_span(pos, len(self.text))
        self.finish()
        return self

    def trajectory(self) -> Trajectory:
        stages = [Stage(index=s.index, plan=s.pieces, executions=s.executions) for s in self.stages]
        return Trajectory(query=self.query, stages=stages, final_answer=self.final)


def _scan(text: object, mode: str, plan_index: int = 1) -> _Scanner:
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    return _Scanner(text, mode, plan_index).run()


def parse(text: str) -> tuple[Trajectory, list[str]]:
    """Query + body -> (Trajectory, problems). Total: never raises; an empty problem list means
    the text is a well-formed SPRINT document. Leading untagged text is the query."""
    s = _scan(text, "document")
    return s.trajectory(), s.problems


def parse_completion(text: str) -> tuple[Trajectory, list[str]]:
    """Like `parse`, for model output with no query: leading untagged text (an RFT serial trace,
    say) is reported and kept out of the structure; the final answer is still found."""
    s = _scan(text, "completion")
    return s.trajectory(), s.problems


def parse_plan(text: str, index: int) -> tuple[list[PlanPiece], list[str], list[str]]:
    """The inside of `<Plan_index> ... </Plan_index>` -> (pieces, prompt texts, problems).

    For the orchestrator (paper §10) after the planner stops at `</Plan_index>`: a leading
    `<Plan_index>` and the closing tag are accepted; anything after the closing tag, or any tag
    other than this plan's prompts, is reported. A missing closing tag is not a problem here.
    """
    try:
        s = _scan(text, "plan", int(index))
    except (TypeError, ValueError) as e:
        return [], [], [f"bad plan index {index!r}: {e}"]
    stage = s.stages[0]
    pieces = _normalise_pieces(stage.pieces)
    return pieces, [p.text for p in pieces if isinstance(p, Prompt)], s.problems


def span_labels(prompt: str, completion: str) -> list[str]:
    """One label from SPAN_KINDS per character of `prompt + completion`.

    Prompt characters are "query". In the completion every character of a tag token `<...>` is
    "tag"; content takes the kind of its innermost block (plan, prompt, execution, answer); text
    outside any block (an RFT serial trace, newlines between blocks) is "plan". Uses the same
    scanner as `parse_completion`, so labels and structure never disagree.
    """
    s = _scan(completion, "completion")
    labels = ["query"] * len(prompt) + ["plan"] * len(completion)
    off = len(prompt)
    for start, end, label in s.segments:
        labels[off + start: off + end] = [label] * (end - start)
    return labels


_TOKEN_PRIORITY = ("query", "tag")


def token_labels(char_labels: list[str], offsets: list[tuple[int, int]]) -> list[str]:
    """Label tokens from character labels and `(start, end)` character offsets per token.

    Rule for a token spanning several labels: "query" if any of its characters is query (a token
    the model never writes stays out of the loss), else "tag" if any character is a tag character
    (the whole tag must be learnt, stop strings depend on it), else the most frequent label among
    its characters (ties: the earliest). A token with an empty span takes the label of the
    character before it ("query" at position 0).
    """
    out: list[str] = []
    for start, end in offsets:
        chars = char_labels[start:end]
        if not chars:
            out.append(char_labels[start - 1] if 0 < start <= len(char_labels) else "query")
            continue
        for label in _TOKEN_PRIORITY:
            if label in chars:
                out.append(label)
                break
        else:
            counts: dict[str, int] = {}
            for c in chars:
                counts[c] = counts.get(c, 0) + 1
            best = max(counts.values())
            out.append(next(c for c in chars if counts[c] == best))
    return out


__all__ = [
    "SPAN_KINDS", "LAYOUTS", "PIECEWISE_LAYOUTS", "FINAL_OPEN", "FINAL_CLOSE", "TAG_PATTERN", "Prompt", "PlanPiece", "Stage", "Trajectory",
    "plan_open", "plan_close", "prompt_open", "prompt_close", "execution_open", "execution_close",
    "planner_stop_strings", "tag_vocabulary", "find_tags", "contains_tag", "render", "render_completion",
    "parse", "parse_completion", "parse_plan", "span_labels", "token_labels",
]
