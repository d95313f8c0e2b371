"""ThreadWeaver's tag format: golden text, round trip, a total parser (fuzzed against an independent
grammar), span labels, conversion to and from SPRINT, and the jsonl converter."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sprint_jax import format as sf
from sprint_jax import threadweaver as tw
from sprint_jax.format import Prompt, Stage, Trajectory
from sprint_jax.schema import Example
from sprint_jax.threadweaver import ParallelBlock, TWTrajectory

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# an independent tag regex, grammar check and labeller (test-local, written from the format as
# the module docstring states it, not from the parser)
# ---------------------------------------------------------------------------------------------

_TW_TAGS = ["<think>", "</think>", "<Parallel>", "</Parallel>", "<Outlines>", "</Outlines>",
            "<Outline>", "</Outline>", "<Thread>", "</Thread>"]
_TOKEN = re.compile("(" + "|".join(re.escape(t) for t in _TW_TAGS) + ")")
_SPRINT_TAG = re.compile(r"<(/?)(?:Plan_[1-9][0-9]{0,8}|prompt_[1-9][0-9]{0,8}\.[1-9][0-9]{0,8}|"
                         r"execution_[1-9][0-9]{0,8}\.[1-9][0-9]{0,8}|Final Answer)>")


def has_tw_tag(s: str) -> bool:
    return any(t in s for t in _TW_TAGS)


def grammar_ok(completion: str) -> bool:
    """Well-formed completion: optional whitespace, <think>, sequential text and blocks, </think>,
    then any text with no tag."""
    toks = [t for t in _TOKEN.split(completion) if t != ""]
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def is_tag(t):
        return t in _TW_TAGS

    def skip_ws():
        nonlocal pos
        while peek() is not None and not is_tag(peek()) and not peek().strip():
            pos += 1

    def numbered(open_tag, close_tag, j):
        nonlocal pos
        if peek() != open_tag:
            return False
        pos += 1
        body = peek()
        if body is None or is_tag(body) or not re.fullmatch(rf"\s*{j}:.*", body, re.S):
            return False
        pos += 1
        if peek() != close_tag:
            return False
        pos += 1
        return True

    skip_ws()
    if peek() != "<think>":
        return False
    pos += 1
    while True:
        tok = peek()
        if tok is None:
            return False
        if tok == "</think>":
            return all(not is_tag(t) for t in toks[pos + 1:])
        if not is_tag(tok):
            pos += 1
            continue
        if tok != "<Parallel>":
            return False
        pos += 1
        skip_ws()
        if peek() != "<Outlines>":
            return False
        pos += 1
        k = 0
        while True:
            skip_ws()
            if peek() == "</Outlines>":
                pos += 1
                break
            if not numbered("<Outline>", "</Outline>", k + 1):
                return False
            k += 1
        if k == 0:
            return False
        for j in range(1, k + 1):
            skip_ws()
            if not numbered("<Thread>", "</Thread>", j):
                return False
        skip_ws()
        if peek() != "</Parallel>":
            return False
        pos += 1


def labelled_render(traj: TWTrajectory) -> list[tuple[str, str]]:
    """(text, label) chunks of the canonical completion, built from the structure."""
    out = [("<think>", "tag")]

    def line(text, label):
        out.append(("\n", "plan"))
        out.append((text, label))

    def numbered(open_tag, j, text, close_tag, label):
        out.append(("\n", "plan"))
        out.append((open_tag, "tag"))
        out.append((f"{j}:", "tag"))
        if text:
            out.append((" " + text, label))
        out.append((close_tag, "tag"))

    for b in traj.blocks:
        if b.before:
            line(b.before, "plan")
        line("<Parallel>", "tag")
        line("<Outlines>", "tag")
        for j, o in enumerate(b.outlines, 1):
            numbered("<Outline>", j, o, "</Outline>", "prompt")
        line("</Outlines>", "tag")
        for j, t in enumerate(b.threads, 1):
            numbered("<Thread>", j, t, "</Thread>", "execution")
        line("</Parallel>", "tag")
    if traj.after:
        line(traj.after, "plan")
    if traj.answer is not None:
        line("</think>", "tag")
        if traj.answer:
            out.append(("\n" + traj.answer, "answer"))
    return out


def well_formed(traj: TWTrajectory) -> bool:
    return all(b.outlines and len(b.threads) == len(b.outlines) for b in traj.blocks)


def convertible(t: Trajectory) -> bool:
    """Whether ThreadWeaver can express a SPRINT trajectory (the module docstring's rule)."""
    n = len(t.stages)
    texts = [t.query, t.final_answer or ""]
    for pos, s in enumerate(t.stages, 1):
        if s.index != pos:
            return False
        kinds = ["p" if isinstance(p, Prompt) else "t" for p in s.plan]
        texts += [p.text if isinstance(p, Prompt) else p for p in s.plan] + s.executions
        if "p" in kinds:
            if "t" in kinds[kinds.index("p"):] or len(s.executions) != kinds.count("p"):
                return False
        elif s.executions or pos != n or not s.plan:
            return False
    return not any(has_tw_tag(x) for x in texts)


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

_FRAGMENTS = ["<", ">", "/", "</", "Thread", "<Thread", "Outline>", "<Outlines >", "<think", "think>",
              "<Think>", "<Conclusion>", "1:", "2:", "01:", " 1: ", "\n", "\n\n", " ", "\t", "x", "= 42", "é",
              "λ", "\u200b", "\x00", "$\\frac{1}{2}$"]
_SPRINT_FRAGMENTS = ["<Plan_1>", "</execution_1.1>", "<Final Answer>"]

_raw = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=6)), max_size=5).map("".join)
content = _raw.filter(lambda s: not has_tw_tag(s) and not _SPRINT_TAG.search(s))     # both formats
tw_content = (st.lists(st.one_of(st.sampled_from(_FRAGMENTS + _SPRINT_FRAGMENTS), st.text(max_size=6)), max_size=5)
              .map("".join).filter(lambda s: not has_tw_tag(s)))                      # ThreadWeaver only
sprint_content = (st.lists(st.one_of(st.sampled_from(_FRAGMENTS + ["<Thread>", "</think>"]), st.text(max_size=6)),
                           max_size=5).map("".join).filter(lambda s: not _SPRINT_TAG.search(s)))


@st.composite
def tw_trajectories(draw, text=tw_content, formed: bool = False, final: bool | None = None) -> TWTrajectory:
    blocks = []
    for _ in range(draw(st.integers(0, 3))):
        k = draw(st.integers(1, 3)) if formed else draw(st.integers(0, 3))
        m = k if formed else draw(st.integers(0, 4))
        blocks.append(ParallelBlock(draw(text), [draw(text) for _ in range(k)], [draw(text) for _ in range(m)]))
    has_answer = draw(st.booleans()) if final is None else final
    return TWTrajectory(draw(text), blocks, draw(text), draw(text) if has_answer else None)


@st.composite
def sprint_trajectories(draw, text=sprint_content) -> Trajectory:
    """Any SPRINT trajectory, convertible or not."""
    stages = []
    n = draw(st.integers(0, 3))
    for i in range(1, n + 1):
        pieces = draw(st.lists(st.one_of(text, text.map(Prompt)), max_size=4))
        k = sum(isinstance(p, Prompt) for p in pieces)
        m = draw(st.sampled_from([k, k, k + 1, max(k - 1, 0)])) if k else draw(st.integers(0, 1))
        index = i if draw(st.integers(0, 9)) else i + 1
        stages.append(Stage(index, pieces, [draw(text) for _ in range(m)]))
    return Trajectory(draw(text), stages, draw(st.one_of(st.none(), text)))


@st.composite
def convertible_sprint(draw) -> Trajectory:
    """SPRINT trajectories ThreadWeaver can express, by construction."""
    stages = []
    for i in range(1, draw(st.integers(0, 3)) + 1):
        k = draw(st.integers(1, 3))
        stages.append(Stage(i, [draw(content)] + [Prompt(draw(content)) for _ in range(k)],
                            [draw(content) for _ in range(k)]))
    last = draw(content)
    if last.strip() and draw(st.booleans()):
        stages.append(Stage(len(stages) + 1, [last]))
    return Trajectory(draw(content), stages, draw(st.one_of(st.none(), content)))


def example() -> TWTrajectory:
    return TWTrajectory(
        "What is 2 + 3 + 4?",
        [ParallelBlock("Split the sum.", ["Compute 2 + 3.", "Note 4."], ["2 + 3 = 5", "4"]),
         ParallelBlock("", ["Check 5 + 4."], ["9"])],
        "The sum is 9.",
        "9")


GOLDEN = (
    "What is 2 + 3 + 4?\n"
    "<think>\n"
    "Split the sum.\n"
    "<Parallel>\n"
    "<Outlines>\n"
    "<Outline>1: Compute 2 + 3.</Outline>\n"
    "<Outline>2: Note 4.</Outline>\n"
    "</Outlines>\n"
    "<Thread>1: 2 + 3 = 5</Thread>\n"
    "<Thread>2: 4</Thread>\n"
    "</Parallel>\n"
    "<Parallel>\n"
    "<Outlines>\n"
    "<Outline>1: Check 5 + 4.</Outline>\n"
    "</Outlines>\n"
    "<Thread>1: 9</Thread>\n"
    "</Parallel>\n"
    "The sum is 9.\n"
    "</think>\n"
    "9")

GOLDEN_SPRINT = (
    "What is 2 + 3 + 4?\n"
    "<Plan_1> Split the sum. <prompt_1.1> Compute 2 + 3. </prompt_1.1> <prompt_1.2> Note 4. </prompt_1.2> </Plan_1>\n"
    "<execution_1.1> 2 + 3 = 5 </execution_1.1>\n"
    "<execution_1.2> 4 </execution_1.2>\n"
    "<Plan_2> <prompt_2.1> Check 5 + 4. </prompt_2.1> </Plan_2>\n"
    "<execution_2.1> 9 </execution_2.1>\n"
    "<Plan_3> The sum is 9. </Plan_3>\n"
    "<Final Answer> 9 </Final Answer>")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

def test_threadweaver_golden_render_and_parse():
    assert tw.render(example()) == GOLDEN
    assert tw.render_completion(example()) == GOLDEN[len("What is 2 + 3 + 4?\n"):]
    assert tw.parse(GOLDEN) == (example(), [])
    assert tw.parse_completion(GOLDEN.split("\n", 1)[1]) == (TWTrajectory("", example().blocks, "The sum is 9.", "9"), [])
    # empty texts are left out; an empty answer keeps </think>; no answer, no </think>
    assert tw.render_completion(TWTrajectory(blocks=[ParallelBlock("", ["a"], [""])], answer="")) == (
        "<think>\n<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n</Outlines>\n<Thread>1:</Thread>\n"
        "</Parallel>\n</think>")
    assert tw.render(TWTrajectory("q", after="t")) == "q\n<think>\nt"
    # the sequential baseline: no block
    assert tw.parse_completion("<think>\nstep by step\n</think>\n42") == (TWTrajectory("", [], "step by step", "42"), [])


def test_threadweaver_golden_conversion():
    assert sf.render(tw.to_sprint(example())) == GOLDEN_SPRINT
    assert tw.to_sprint(GOLDEN) == sf.parse(GOLDEN_SPRINT)[0]
    assert tw.from_sprint(GOLDEN_SPRINT) == example()
    assert tw.render(tw.from_sprint(sf.parse(GOLDEN_SPRINT)[0])) == GOLDEN


def test_threadweaver_tag_helpers():
    assert tw.thread_opening(3) == "<Thread>3:"
    assert tw.sequential_stop_strings() == ["</Outlines>"]
    assert tw.thread_stop_strings() == ["</Thread>"]
    assert tw.tag_vocabulary() == _TW_TAGS
    assert tw.find_tags(GOLDEN) == [t for t in _TOKEN.findall(GOLDEN)]
    assert not tw.contains_tag("<Think> <Conclusion> <thread> <Plan_1>") and tw.contains_tag("a</Thread>")
    assert tw.SPAN_KINDS == sf.SPAN_KINDS
    # the orchestrator's forced text: gap + opening, the thread's own text, then gap + </Parallel>
    sequential = "<think>\nSplit the sum.\n<Parallel>\n<Outlines>\n<Outline>1: Compute 2 + 3.</Outline>\n" \
                 "<Outline>2: Note 4.</Outline>\n</Outlines>"
    joined = (sequential + "".join(tw.BLOCK_GAP + tw.thread_opening(j) + body for j, body in
                                   [(1, " 2 + 3 = 5</Thread>"), (2, " 4</Thread>")]) + tw.BLOCK_GAP + "</Parallel>")
    assert GOLDEN.split("\n", 1)[1].startswith(joined)
    # reading the outlines after the main sequence stopped at </Outlines>
    traj, problems = tw.parse_completion(sequential)
    assert traj.blocks[-1].outlines == ["Compute 2 + 3.", "Note 4."]
    assert problems == ["unclosed <Parallel> (opened at char 23): text ended",
                        "outline 1 of <Parallel> at char 23 has no <Thread>",
                        "outline 2 of <Parallel> at char 23 has no <Thread>", "missing </think>"]


def test_threadweaver_normalisation_and_render_refuses_tags():
    b = ParallelBlock("  a \n", [" o "], ["\tt "])
    assert (b.before, b.outlines, b.threads) == ("a", ["o"], ["t"])
    t = TWTrajectory(" q ", [b], " z ", " 1 ")
    assert (t.query, t.after, t.answer) == ("q", "z", "1")
    with pytest.raises(ValueError, match="thread 1.1"):
        tw.render(TWTrajectory("q", [ParallelBlock("", ["o"], ["x </Thread> y"])], "", "1"))
    with pytest.raises(ValueError, match="query"):
        tw.render(TWTrajectory("look: <think>", [], "", "1"))
    with pytest.raises(ValueError, match="answer"):
        tw.render(TWTrajectory("q", [], "", "a <Parallel>"))


@pytest.mark.parametrize("text, expected", [
    ("", ["missing <think>", "missing </think>"]),
    ("<think> a", ["missing </think>"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outlines></Parallel></think>",
     ["unclosed <Outline> (opened at char 27) before </Outlines>", "outline 1 of <Parallel> at char 7 has no <Thread>"]),
    ("<think><Parallel><Outlines></Outlines></Parallel></think>", ["<Parallel> at char 7 has no <Outline>"]),
    ("<think><Parallel><Outlines><Outline>a</Outline></Outlines><Thread>1: x</Thread></Parallel></think>",
     ["<Outline> at char 27 does not start with its number '1:'"]),
    ("<think><Parallel><Outlines><Outline>2: a</Outline></Outlines><Thread>1: x</Thread></Parallel></think>",
     ["<Outline> at char 27 is numbered 2: expected 1"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outline></Outlines><Thread>01: x</Thread></Parallel></think>",
     ["<Thread> at char 61 does not start with its number '1:'"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outline></Outlines><Thread>1: x</Thread><Thread>2: y</Thread>"
     "</Parallel></think>", ["<Thread> at char 82 has no matching <Outline> (1 in its <Parallel>)"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outline></Outlines><Thread>1: x</Thread><Conclusion> c "
     "</Conclusion></Parallel></think>", ["untagged text inside <Parallel>: '<Conclusion> c </Conclusion>'"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outline></Outlines><Thread>1: x<Parallel>",
     ["unclosed <Thread> (opened at char 61) before <Parallel>", "unclosed <Parallel> (opened at char 7) before "
      "<Parallel>"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outline> b </Outlines>", ["untagged text inside <Outlines>: 'b'"]),
    ("<think><Outline>1: a</Outline></think>", ["missing <Parallel> before <Outline> at char 7"]),
    ("<Parallel>", ["missing <think> before <Parallel> at char 0"]),
    ("<think><Parallel><Thread>1: x</Thread><Outlines><Outline>1: a</Outline></Outlines></Parallel></think>",
     ["has no matching <Outline>", "<Outlines> after <Thread> at char 38"]),
    ("<think><Parallel><Outlines><Outline>1: a</Outline></Outlines><Outlines>",
     ["second <Outlines> in <Parallel> (opened at char 7) at char 61"]),
    ("<think> a </Thread> b </think>", ["stray </Thread> at char 10 with no open <Thread> (ignored)"]),
    ("<think> a <think> b </think>", ["duplicate <think> at char 10 (ignored)"]),
    ("<think> a </think> 42 <Parallel> x", ["<Parallel> after </think> at char 22"]),
    ("a trace </think> 42", ["untagged text before <think>: 'a trace' at char 0", "missing <think> before </think>"]),
])
def test_threadweaver_problems_are_named(text, expected):
    traj, problems = tw.parse_completion(text)
    assert problems, text
    for needle in expected:
        assert any(needle in p for p in problems), (needle, problems)


def test_threadweaver_problem_structure_is_kept():
    traj, problems = tw.parse_completion("<think> a <Parallel><Outlines><Outline>1: o</Outline></Outlines>"
                                         "<Thread>1: cut")
    assert traj == TWTrajectory("", [ParallelBlock("a", ["o"], ["cut"])], "", None)
    # the answer is found after a stray </think> (a prompt that ended in <think>)
    traj, _ = tw.parse_completion("reasoning </think> 42")
    assert traj.answer == "42" and traj.after == ""
    traj, problems = tw.parse("Q?\n<think> a </think> 42 <Parallel> late")
    assert traj.query == "Q?" and traj.answer == "42" and traj.blocks == []
    assert problems == ["<Parallel> after </think> at char 25"]
    traj, problems = tw.parse_completion("lead <think> a </think> b")
    assert traj == TWTrajectory("", [], "a", "b") and problems == ["untagged text before <think>: 'lead' at char 0"]


@SETTINGS
@given(tw_trajectories())
def test_threadweaver_round_trip_identity(traj):
    text = tw.render(traj)
    parsed, problems = tw.parse(text)
    assert parsed == traj
    body = tw.render_completion(traj)
    assert tw.parse_completion(body)[0] == TWTrajectory("", traj.blocks, traj.after, traj.answer)
    ok = well_formed(traj) and traj.answer is not None
    assert (problems == []) == ok == grammar_ok(body)
    if well_formed(traj) and traj.answer is None:
        assert problems == ["missing </think>"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])   # a parse per character
@given(tw_trajectories(formed=True, final=True))
def test_threadweaver_every_truncation_is_total_and_flagged_before_the_answer(traj):
    text = tw.render(traj)
    answer_at = text.rindex("</think>") + len("</think>")
    for cut in range(len(text)):
        parsed, problems = tw.parse(text[:cut])
        assert isinstance(parsed, TWTrajectory)
        assert len(tw.span_labels("", text[:cut])) == cut
        if cut < answer_at:
            assert problems, repr(text[:cut])
        else:   # the answer has no closing tag: a cut answer reads as a shorter one
            assert problems == [] and parsed.answer == text[answer_at:cut].strip()


@SETTINGS
@given(st.text(max_size=300))
def test_threadweaver_random_text_never_raises(text):
    for fn in (tw.parse, tw.parse_completion):
        traj, problems = fn(text)
        assert isinstance(traj, TWTrajectory) and all(isinstance(p, str) for p in problems)
    assert len(tw.span_labels(text, text)) == 2 * len(text)


_SOUP = st.lists(st.one_of(
    st.sampled_from(_TW_TAGS),
    st.sampled_from(["", " ", "\n", "x", "1:", "2: a", " 1: b", "</Thread", "<", "λ"])), max_size=25).map("".join)


@st.composite
def mutated(draw) -> str:
    tokens = [t for t in _TOKEN.split(tw.render_completion(draw(tw_trajectories(formed=True, final=True)))) if t]
    op = draw(st.sampled_from(["delete", "duplicate", "swap", "insert"]))
    k = draw(st.integers(0, len(tokens) - 1))
    if op == "delete":
        del tokens[k]
    elif op == "duplicate":
        tokens.insert(k, tokens[k])
    elif op == "swap":
        m = draw(st.integers(0, len(tokens) - 1))
        tokens[k], tokens[m] = tokens[m], tokens[k]
    else:
        tokens.insert(k, draw(st.sampled_from(_TW_TAGS + ["junk", "3:"])))
    return "".join(tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_SOUP, mutated()))
def test_threadweaver_tag_soup_problems_match_an_independent_grammar(text):
    traj, problems = tw.parse_completion(text)
    assert (problems == []) == grammar_ok(text), (text, problems)
    if not problems:
        assert tw.parse_completion(tw.render_completion(traj)) == (traj, [])


@SETTINGS
@given(tw_trajectories(), tw_content)
def test_threadweaver_span_labels_match_structure(traj, prompt):
    completion = tw.render_completion(traj)
    chunks = labelled_render(traj)
    assert "".join(t for t, _ in chunks) == completion
    expected = ["query"] * len(prompt) + [label for text, label in chunks for _ in text]
    assert tw.span_labels(prompt, completion) == expected


def test_threadweaver_span_labels_by_hand():
    completion = ("<think>\n@\n<Parallel>\n<Outlines>\n<Outline>1: #</Outline>\n</Outlines>\n"
                  "<Thread>1: %</Thread>\n</Parallel>\n</think>\n&")
    labels = tw.span_labels("Q: ", completion)
    text = "Q: " + completion
    assert len(labels) == len(text)
    by_char = {ch: labels[text.index(ch)] for ch in "Q@#%&"}
    assert by_char == {"Q": "query", "@": "plan", "#": "prompt", "%": "execution", "&": "answer"}
    tag_chars = {k for m in _TOKEN.finditer(text) for k in range(m.start(), m.end())}
    numbers = {text.index("1: #"), text.index("1: #") + 1, text.index("1: %"), text.index("1: %") + 1}
    assert [k for k, lab in enumerate(labels) if lab == "tag"] == sorted(tag_chars | numbers)
    # the space after a number belongs to the content; the newline after </think> to the answer
    assert labels[text.index(" #")] == "prompt" and labels[text.index(" %")] == "execution"
    assert labels[text.index("\n&")] == "answer"
    assert set(tw.span_labels("", "a trace, no tags")) == {"plan"}


# ---------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------

@SETTINGS
@given(sprint_trajectories())
def test_threadweaver_from_sprint_refuses_exactly_what_it_cannot_express(traj):
    try:
        out = tw.from_sprint(traj)
    except tw.ConversionError:
        out = None
    assert (out is not None) == convertible(traj), traj
    if out is not None:
        assert tw.to_sprint(out) == traj


@SETTINGS
@given(convertible_sprint())
def test_threadweaver_round_trip_from_sprint_then_to_sprint(traj):
    out = tw.from_sprint(traj)
    assert tw.to_sprint(out) == traj
    if traj.final_answer is not None:    # as text: a document without one is not well-formed
        text = sf.render(traj)
        assert tw.to_sprint(tw.render(tw.from_sprint(text))) == sf.parse(text)[0] == traj
    problems = tw.parse(tw.render(out))[1]
    assert problems == ([] if traj.final_answer is not None else ["missing </think>"])


@SETTINGS
@given(tw_trajectories(text=content, formed=True))
def test_threadweaver_round_trip_to_sprint_then_from_sprint(traj):
    s = tw.to_sprint(traj)
    assert tw.from_sprint(s) == traj
    if traj.answer is not None:
        assert tw.from_sprint(sf.render(tw.to_sprint(tw.render(traj)))) == traj
    assert sf.parse(sf.render(s))[1] == ([] if traj.answer is not None else ["missing <Final Answer>"])


@pytest.mark.parametrize("traj, reason, detail", [
    (Trajectory("q", [Stage(1, ["do it"], ["done"])], "1"), "an implicit prompt", "<Plan_1> has 1 execution(s)"),
    (Trajectory("q", [Stage(1, ["a", Prompt("p"), "b"], ["e"])], "1"), "plan text after a prompt",
     "<Plan_1> has free text after <prompt_1.1>"),
    (Trajectory("q", [Stage(1, [Prompt("p"), Prompt("r")], ["e"])], "1"), "prompts and executions differ in number",
     "<Plan_1> has 2 prompts and 1 executions"),
    (Trajectory("q", [Stage(1, ["think"]), Stage(2, [Prompt("p")], ["e"])], "1"),
     "a plan-only plan before another plan", "<Plan_1> has no prompt and <Plan_2> follows"),
    (Trajectory("q", [Stage(1, [Prompt("p")], ["e"]), Stage(2, [])], "1"), "an empty plan-only plan",
     "<Plan_2> is empty"),
    (Trajectory("q", [Stage(2, [Prompt("p")], ["e"])], "1"), "plans not numbered 1..n", "plan 1 is <Plan_2>"),
    (Trajectory("q", [Stage(1, [Prompt("p")], ["x </Thread>"])], "1"), "content holds a ThreadWeaver tag",
     "execution 1.1 contains '</Thread>'"),
    ("<Plan_1> a </Plan_1>", "malformed SPRINT text", "missing <Final Answer>"),
])
def test_threadweaver_conversion_refusals_name_why(traj, reason, detail):
    with pytest.raises(tw.ConversionError) as e:
        tw.from_sprint(traj)
    assert e.value.reason == reason and detail in str(e.value), str(e.value)


@pytest.mark.parametrize("source, reason", [
    (TWTrajectory("q", [ParallelBlock("a", [], [])], "", "1"), "a parallel block with no outline"),
    (TWTrajectory("q", [ParallelBlock("a", ["o"], [])], "", "1"), "outlines and threads differ in number"),
    (TWTrajectory("q", [ParallelBlock("a", ["o"], ["<Final Answer>"])], "", "1"), "content holds a SPRINT tag"),
    ("<think> a", "malformed ThreadWeaver text"),
])
def test_threadweaver_to_sprint_refusals_name_why(source, reason):
    with pytest.raises(tw.ConversionError) as e:
        tw.to_sprint(source)
    assert e.value.reason == reason


# ---------------------------------------------------------------------------------------------
# the jsonl converter
# ---------------------------------------------------------------------------------------------

def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_threadweaver_convert_examples_counts_skips_and_round_trips(tmp_path):
    good = GOLDEN_SPRINT.split("\n", 1)[1]
    rows = [
        {"id": "a", "kind": "sprint", "prompt": "What is 2 + 3 + 4?\n", "completion": good, "answer": 9},
        {"id": "b", "kind": "sprint", "prompt": "p", "completion":
            "<Plan_1> do it </Plan_1>\n<execution_1.1> done </execution_1.1>\n<Final Answer> 1 </Final Answer>"},
        {"id": "c", "kind": "sprint", "prompt": "p", "completion":
            "<Plan_1> a </Plan_1>\n<Plan_2> <prompt_2.1> b </prompt_2.1> </Plan_2>\n"
            "<execution_2.1> c </execution_2.1>\n<Final Answer> 1 </Final Answer>"},
        {"id": "d", "kind": "sprint", "prompt": "p", "completion": "<Plan_1> a </Plan_1>"},
        {"id": "e", "kind": "rft", "prompt": "p", "completion": "serial trace\n<Final Answer> 7 </Final Answer>",
         "meta": {"source": "x"}},
        {"id": "f", "kind": "sprint", "prompt": "see <Thread>", "completion": good},
        {"id": "g", "kind": "sprint", "prompt": "p", "completion":
            "<Plan_1> x <prompt_1.1> y </prompt_1.1> </Plan_1>\n<execution_1.1> z </execution_1.1>\n"
            "<Final Answer> 2 </Final Answer>"},
    ]
    src, mid, back = tmp_path / "sprint.jsonl", tmp_path / "tw.jsonl", tmp_path / "back.jsonl"
    _write(src, rows)
    stats = tw.convert_examples(src, mid, "threadweaver")
    assert (stats.read, stats.written) == (7, 3)
    assert stats.skipped == {"an implicit prompt": 1, "a plan-only plan before another plan": 1,
                             "malformed SPRINT text": 1, "the prompt holds a tag of the target format": 1}
    assert stats.first_skip["an implicit prompt"].startswith(f"{src}:2: an implicit prompt: <Plan_1>")
    out = [json.loads(line) for line in mid.read_text().splitlines()]
    assert [r["id"] for r in out] == ["a", "e", "g"]
    assert out[0]["completion"] == GOLDEN.split("\n", 1)[1] and out[0]["prompt"] == "What is 2 + 3 + 4?\n"
    assert out[0]["answer"] == 9 and out[0]["meta"] == {"format": "threadweaver"}
    assert out[1]["completion"] == "<think>\nserial trace\n</think>\n7" and out[1]["kind"] == "rft"
    assert out[1]["meta"] == {"source": "x", "format": "threadweaver"}
    assert out[2]["completion"] == ("<think>\nx\n<Parallel>\n<Outlines>\n<Outline>1: y</Outline>\n</Outlines>\n"
                                    "<Thread>1: z</Thread>\n</Parallel>\n</think>\n2")
    stats = tw.convert_examples(mid, back, "sprint")
    assert (stats.read, stats.written, stats.skipped) == (3, 3, {})
    restored = [json.loads(line) for line in back.read_text().splitlines()]
    originals = {r["id"]: r for r in rows}
    for r in restored:
        o = originals[r["id"]]
        assert (r["kind"], r["prompt"], r["completion"], r["answer"]) == \
            (o["kind"], o["prompt"], o["completion"], o.get("answer"))
        assert r["meta"] == o.get("meta", {})


def test_threadweaver_convert_examples_refuses_bad_input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "kind": "sprint", "prompt": "p", "completion": "c"}\nnot json\n')
    with pytest.raises(tw.ConvertInputError, match=r"in\.jsonl:2: not valid JSON"):
        tw.convert_examples(src, tmp_path / "out.jsonl", "threadweaver")
    _write(src, [{"id": "a", "kind": "sprint", "prompt": "p"}])
    with pytest.raises(tw.ConvertInputError, match=r"in\.jsonl:1: missing field 'completion'"):
        tw.convert_examples(src, tmp_path / "out.jsonl", "threadweaver")
    _write(src, [{"id": "a", "kind": "serial", "prompt": "p", "completion": "c"}])
    with pytest.raises(tw.ConvertInputError, match="kind must be 'sprint' or 'rft'"):
        tw.convert_examples(src, tmp_path / "out.jsonl", "threadweaver")
    with pytest.raises(tw.ConvertInputError, match="format must be one of sprint, threadweaver"):
        tw.convert_examples(src, tmp_path / "out.jsonl", "tw")
    with pytest.raises(tw.ConvertInputError, match="would overwrite the input"):
        tw.convert_examples(src, src, "threadweaver")
    with pytest.raises(tw.ConvertInputError, match="no such file"):
        tw.convert_examples(tmp_path / "missing.jsonl", tmp_path / "out.jsonl", "threadweaver")
    assert not (tmp_path / "out.jsonl").exists()


def test_threadweaver_convert_example_rft_both_ways():
    rft = Example("r", "rft", "p\n", "step one\nstep two\n<Final Answer> 7 </Final Answer>", 7, {"k": 1})
    out = tw.convert_example(rft, "threadweaver")
    assert out == Example("r", "rft", "p\n", "<think>\nstep one\nstep two\n</think>\n7", 7,
                          {"k": 1, "format": "threadweaver"})
    assert tw.convert_example(out, "sprint") == rft
    with pytest.raises(ValueError, match="format must be one of sprint, threadweaver, got 'tw'"):
        tw.convert_example(rft, "tw")
    assert tw.convert_example(Example("r", "rft", "p", "<Final Answer> 7 </Final Answer>"), "threadweaver"
                              ).completion == "<think>\n</think>\n7"
    with pytest.raises(tw.ConversionError) as e:
        tw.convert_example(Example("r", "rft", "p", tw.render_completion(example())), "sprint")
    assert e.value.reason == "an RFT example with parallel blocks"
    with pytest.raises(tw.ConversionError) as e:
        tw.convert_example(Example("r", "rft", "p", "no answer here"), "threadweaver")
    assert e.value.reason == "malformed RFT text" and "missing <Final Answer>" in str(e.value)
    with pytest.raises(tw.ConversionError, match="it has SPRINT stages"):
        tw.convert_example(Example("r", "rft", "p", "t <Plan_1> a </Plan_1> <Final Answer> 1 </Final Answer>"),
                           "threadweaver")
