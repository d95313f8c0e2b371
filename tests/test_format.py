"""The SPRINT tag grammar: round trip, a total parser (fuzzed), span labels."""
from __future__ import annotations

import re
import sys

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sprint_jax import format as sf
from sprint_jax.format import Prompt, Stage, Trajectory

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

_FRAGMENTS = ["<", ">", "/", "</", "Plan_", "prompt_1.1", "<Plan_1", "execution_2.1>", "Final", " Answer>",
              "<Final", "<Plan_0>", "<Plan_01>", "<prompt_1.1 >", "\n", "\n\n", " ", "\t", "x", "= 42", "é", "λ",
              "\u200b", "\x00", "$\\frac{1}{2}$", "<think>", "<answer> 3 </answer>"]

content = (st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=6)), max_size=5)
           .map("".join).filter(lambda s: not sf.contains_tag(s)))


@st.composite
def stages_(draw, index: int) -> Stage:
    pieces = draw(st.lists(st.one_of(content, content.map(Prompt)), max_size=4))
    n_prompts = sum(isinstance(p, Prompt) for p in pieces)
    n_exec = n_prompts if n_prompts else draw(st.integers(0, 1))
    stage = Stage(index, pieces, [draw(content) for _ in range(n_exec)])
    # adjacent free-text pieces are joined into one (Stage normalises them): '<Final' and ' Answer>'
    # make a tag, which render refuses by design
    assume(not any(isinstance(p, str) and sf.contains_tag(p) for p in stage.plan))
    return stage


@st.composite
def trajectories(draw, final: bool | None = None) -> Trajectory:
    n = draw(st.integers(0, 3))
    stages = [draw(stages_(i)) for i in range(1, n + 1)]
    has_final = draw(st.booleans()) if final is None else final
    return Trajectory(draw(content), stages, draw(content) if has_final else None)


# ---------------------------------------------------------------------------------------------
# an independent grammar check and an independent labeller (test-local, written from
# docs/design.md "The SPRINT format")
# ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"(<(?:/?)(?:Plan_[1-9][0-9]{0,8}|prompt_[1-9][0-9]{0,8}\.[1-9][0-9]{0,8}|"
                    r"execution_[1-9][0-9]{0,8}\.[1-9][0-9]{0,8}|Final Answer)>)")


def grammar_ok(completion: str) -> bool:
    toks = [t for t in _TOKEN.split(completion) if t != ""]
    pos = 0

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def skip_ws() -> None:
        nonlocal pos
        while pos < len(toks) and not _TOKEN.fullmatch(toks[pos]) and not toks[pos].strip():
            pos += 1

    def block(open_tag: str, close_tag: str) -> bool:
        nonlocal pos
        if peek() != open_tag:
            return False
        pos += 1
        if peek() is not None and not _TOKEN.fullmatch(peek()):
            pos += 1
        if peek() != close_tag:
            return False
        pos += 1
        return True

    stage = 0
    while True:
        skip_ws()
        tok = peek()
        if tok == f"<Plan_{stage + 1}>":
            stage += 1
            pos += 1
            prompts = 0
            while True:
                tok = peek()
                if tok is None:
                    return False
                if tok == f"</Plan_{stage}>":
                    pos += 1
                    break
                if tok == f"<prompt_{stage}.{prompts + 1}>":
                    if not block(tok, f"</prompt_{stage}.{prompts + 1}>"):
                        return False
                    prompts += 1
                elif _TOKEN.fullmatch(tok):
                    return False
                else:
                    pos += 1
            executions = 0
            while True:
                skip_ws()
                tok = f"<execution_{stage}.{executions + 1}>"
                if peek() != tok:
                    break
                if not block(tok, f"</execution_{stage}.{executions + 1}>"):
                    return False
                executions += 1
            if not (executions == prompts or (prompts == 0 and executions == 1)):
                return False
        elif tok == "<Final Answer>":
            if not block("<Final Answer>", "</Final Answer>"):
                return False
            skip_ws()
            return peek() is None
        else:
            return False


def labelled_render(traj: Trajectory) -> list[tuple[str, str]]:
    """(text, label) chunks of the canonical completion, built from the structure."""
    out: list[tuple[str, str]] = []

    def block(open_tag: str, text: str, close_tag: str, label: str) -> None:
        out.append((open_tag, "tag"))
        out.append((f" {text} " if text else " ", label))
        out.append((close_tag, "tag"))

    for n, stage in enumerate(traj.stages):
        if n:
            out.append(("\n", "plan"))
        i = stage.index
        out.append((f"<Plan_{i}>", "tag"))
        out.append((" ", "plan"))
        j = 0
        for piece in stage.plan:
            if isinstance(piece, Prompt):
                j += 1
                block(f"<prompt_{i}.{j}>", piece.text, f"</prompt_{i}.{j}>", "prompt")
            else:
                out.append((piece, "plan"))
            out.append((" ", "plan"))
        out.append((f"</Plan_{i}>", "tag"))
        for j, e in enumerate(stage.executions, 1):
            out.append(("\n", "plan"))
            block(f"<execution_{i}.{j}>", e, f"</execution_{i}.{j}>", "execution")
    if traj.final_answer is not None:
        if traj.stages:
            out.append(("\n", "plan"))
        block("<Final Answer>", traj.final_answer, "</Final Answer>", "answer")
    return out


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

def example() -> Trajectory:
    return Trajectory(
        "What is 2 + 3 + 4?",
        [Stage(1, ["Split the sum.", Prompt("Compute 2 + 3."), Prompt("Note 4.")], ["2 + 3 = 5", "4"]),
         Stage(2, ["Add the parts."], ["5 + 4 = 9"]),
         Stage(3, ["The sum is 9."])],
        "9")


def test_canonical_render_is_exact():
    assert sf.render(example()) == (
        "What is 2 + 3 + 4?\n"
        "<Plan_1> Split the sum. <prompt_1.1> Compute 2 + 3. </prompt_1.1> <prompt_1.2> Note 4. </prompt_1.2> </Plan_1>\n"
        "<execution_1.1> 2 + 3 = 5 </execution_1.1>\n"
        "<execution_1.2> 4 </execution_1.2>\n"
        "<Plan_2> Add the parts. </Plan_2>\n"
        "<execution_2.1> 5 + 4 = 9 </execution_2.1>\n"
        "<Plan_3> The sum is 9. </Plan_3>\n"
        "<Final Answer> 9 </Final Answer>")
    assert sf.render_completion(example()).startswith("<Plan_1>")
    traj, problems = sf.parse(sf.render(example()))
    assert traj == example() and problems == []
    assert traj.stages[0].prompts == ["Compute 2 + 3.", "Note 4."]
    assert traj.stages[1].prompts == [] and traj.stages[1].plan_text == "Add the parts."


def test_tag_helpers_and_vocabulary():
    assert sf.plan_open(2) == "<Plan_2>" and sf.plan_close(2) == "</Plan_2>"
    assert sf.prompt_open(2, 3) == "<prompt_2.3>" and sf.execution_close(1, 4) == "</execution_1.4>"
    assert sf.planner_stop_strings(3) == ["</Plan_3>", "</Final Answer>"]
    vocab = sf.tag_vocabulary(2, 3)
    assert len(vocab) == len(set(vocab)) == 2 + 2 * (2 + 4 * 3)
    assert all(sf.TAG_PATTERN.fullmatch(t) for t in vocab)
    assert set(sf.find_tags(sf.render_completion(example()))) <= set(sf.tag_vocabulary(3, 2))
    assert sf.SPAN_KINDS == ("query", "plan", "prompt", "execution", "answer", "tag")


def test_normalisation_and_render_refuses_tags():
    s = Stage(1, ["  a ", "", "b", Prompt("  p  "), "  "], ["  e \n"])
    assert s.plan == ["a b", Prompt("p")] and s.executions == ["e"]
    assert Stage(2, " lone text ").plan == ["lone text"]
    with pytest.raises(ValueError, match="execution 1.1"):
        sf.render(Trajectory("q", [Stage(1, [Prompt("p")], ["x </execution_1.1> y"])], "1"))
    with pytest.raises(ValueError, match="query"):
        sf.render(Trajectory("look: <Final Answer>", [], "1"))
    with pytest.raises(ValueError, match="index"):
        Stage(0)


@pytest.mark.parametrize("text, expected", [
    ("<Plan_1> a <prompt_1.1> b </Plan_1>", ["unclosed <prompt_1.1>", "has no <execution_1.1>", "missing"]),
    ("<Plan_2> a </Plan_2>\n<Final Answer> 1 </Final Answer>", ["out of order"]),
    ("<Plan_1> a </Plan_1> <Plan_1> b </Plan_1> <Final Answer> 1 </Final Answer>", ["duplicate <Plan_1>"]),
    ("<Plan_1> <prompt_1.2> a </prompt_1.2> </Plan_1> <execution_1.1> x </execution_1.1>"
     "<Final Answer>1</Final Answer>", ["<prompt_1.2> out of order"]),
    ("<Plan_1> a </Plan_1> <execution_1.1> x </execution_1.1> <execution_1.2> y </execution_1.2>"
     "<Final Answer>1</Final Answer>", ["no matching prompt"]),
    ("<Plan_1> <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> </Plan_1>"
     "<execution_1.1> x </execution_1.1><Final Answer>1</Final Answer>", ["<prompt_1.2> has no <execution_1.2>"]),
    ("<Plan_1> a </Plan_1><Final Answer> 1 </Final Answer> trailing", ["text after </Final Answer>"]),
    ("<Plan_1> a </Plan_1><Final Answer> 1 </Final Answer><Final Answer> 2 </Final Answer>",
     ["text after </Final Answer>"]),
    ("<Plan_1> a </Plan_1>", ["missing <Final Answer>"]),
    ("<execution_1.1> x </execution_1.1><Final Answer>1</Final Answer>", ["before any plan"]),
    ("<Plan_1> a </Plan_2><Final Answer>1</Final Answer>", ["does not match"]),
    ("</prompt_1.1><Plan_1> a </Plan_1><Final Answer>1</Final Answer>", ["stray </prompt_1.1>"]),
    ("<Plan_1> a </Plan_1> loose words <Final Answer>1</Final Answer>", ["untagged text between blocks"]),
    ("<Plan_1> a </Plan_1><execution_2.1> x </execution_2.1><Final Answer>1</Final Answer>",
     ["after <Plan_1>"]),
    ("<Plan_1> a <execution_1.1> x </execution_1.1><Final Answer>1</Final Answer>", ["unclosed <Plan_1>"]),
])
def test_problems_are_named(text, expected):
    traj, problems = sf.parse(text)
    assert problems, text
    for needle in expected:
        assert any(needle in p for p in problems), (needle, problems)


def test_problem_structure_is_kept():
    traj, problems = sf.parse_completion("<Plan_1> think <prompt_1.1> sub")
    assert traj.stages[0].plan == ["think", Prompt("sub")] and traj.final_answer is None
    traj, problems = sf.parse("Q?\n<Plan_1> x </Plan_1>\n<Final Answer> 42")
    assert traj.query == "Q?" and traj.final_answer == "42"
    assert any("unclosed <Final Answer>" in p for p in problems)
    # an RFT completion: no SPRINT structure, but the final answer is found
    traj, problems = sf.parse_completion("serial trace\n<Final Answer> 7 </Final Answer>")
    assert traj.final_answer == "7" and traj.stages == []
    assert problems == ["untagged text before the first tag: 'serial trace' at char 0"]
    # the implicit single prompt (paper's examples): plan with no prompt and one execution
    traj, problems = sf.parse_completion("<Plan_1> do it </Plan_1>\n<execution_1.1> done </execution_1.1>\n"
                                         "<Final Answer> 1 </Final Answer>")
    assert problems == [] and traj.stages[0].executions == ["done"]


def test_parse_plan():
    pieces, prompts, problems = sf.parse_plan(
        "<Plan_2> think <prompt_2.1> a </prompt_2.1> more <prompt_2.2> b </prompt_2.2> </Plan_2>", 2)
    assert pieces == ["think", Prompt("a"), "more", Prompt("b")] and prompts == ["a", "b"] and problems == []
    pieces, prompts, problems = sf.parse_plan(" only text ", 5)
    assert pieces == ["only text"] and prompts == [] and problems == []
    _, prompts, problems = sf.parse_plan("x <prompt_1.1> a </prompt_1.1> <prompt_3.3> b", 3)
    assert prompts == ["a", "b"] and any("inside <Plan_3>" in p for p in problems)
    _, _, problems = sf.parse_plan("x </Plan_1> <execution_1.1>", 1)
    assert any("text after </Plan_1>" in p for p in problems)
    _, _, problems = sf.parse_plan("x <execution_1.1> y", 1)
    assert any("unexpected <execution_1.1>" in p for p in problems)
    assert sf.parse_plan("x", "nope")[2]


@SETTINGS
@given(trajectories())
def test_round_trip_identity(traj):
    text = sf.render(traj)
    parsed, problems = sf.parse(text)
    assert parsed == traj
    assert problems == ([] if traj.final_answer is not None else ["missing <Final Answer>"])
    body = sf.render_completion(traj)
    parsed_c, problems_c = sf.parse_completion(body)
    assert parsed_c == Trajectory("", traj.stages, traj.final_answer)
    assert grammar_ok(body) == (traj.final_answer is not None)


@SETTINGS
@given(trajectories(final=True))
def test_every_truncation_is_total_and_flagged(traj):
    text = sf.render(traj)
    for cut in range(len(text)):
        parsed, problems = sf.parse(text[:cut])
        assert problems, repr(text[:cut])
        assert isinstance(parsed, Trajectory)
        assert len(sf.span_labels("", text[:cut])) == cut


@SETTINGS
@given(st.text(max_size=300))
def test_random_text_never_raises(text):
    for fn in (sf.parse, sf.parse_completion):
        traj, problems = fn(text)
        assert isinstance(traj, Trajectory) and all(isinstance(p, str) for p in problems)
    pieces, prompts, problems = sf.parse_plan(text, 1)
    assert len(sf.span_labels(text, text)) == 2 * len(text)


_SOUP = st.lists(st.one_of(
    st.sampled_from(sf.tag_vocabulary(3, 3)),
    st.sampled_from(["", " ", "\n", "x", "a b", "</Plan_", "<", "λ"])), max_size=25).map("".join)


@st.composite
def mutated(draw) -> str:
    tokens = [t for t in _TOKEN.split(sf.render_completion(draw(trajectories(final=True)))) if t]
    op = draw(st.sampled_from(["delete", "duplicate", "swap", "insert"]))
    if tokens:
        k = draw(st.integers(0, len(tokens) - 1))
        if op == "delete":
            del tokens[k]
        elif op == "duplicate":
            tokens.insert(k, tokens[k])
        elif op == "swap" and len(tokens) > 1:
            m = draw(st.integers(0, len(tokens) - 1))
            tokens[k], tokens[m] = tokens[m], tokens[k]
        else:
            tokens.insert(k, draw(st.sampled_from(sf.tag_vocabulary(3, 3) + ["junk"])))
    return "".join(tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_SOUP, mutated()))
def test_tag_soup_problems_match_an_independent_grammar(text):
    traj, problems = sf.parse_completion(text)
    assert (problems == []) == grammar_ok(text), (text, problems)
    if not problems:
        assert sf.parse_completion(sf.render_completion(traj)) == (traj, [])


@SETTINGS
@given(trajectories(), content)
def test_span_labels_match_structure(traj, prompt):
    completion = sf.render_completion(traj)
    chunks = labelled_render(traj)
    assert "".join(t for t, _ in chunks) == completion
    expected = ["query"] * len(prompt) + [label for text, label in chunks for _ in text]
    assert sf.span_labels(prompt, completion) == expected
    assert set(expected) <= set(sf.SPAN_KINDS)


def test_span_labels_by_hand():
    completion = ("<Plan_1> @ <prompt_1.1> # </prompt_1.1> </Plan_1>\n"
                  "<execution_1.1> % </execution_1.1>\n<Final Answer> & </Final Answer>")
    labels = sf.span_labels("Q: ", completion)
    text = "Q: " + completion
    assert len(labels) == len(text)
    by_char = {ch: labels[text.index(ch)] for ch in "Q@#%&"}
    assert by_char == {"Q": "query", "@": "plan", "#": "prompt", "%": "execution", "&": "answer"}
    tag_chars = {k for m in sf.TAG_PATTERN.finditer(text) for k in range(m.start(), m.end())}
    assert [k for k, lab in enumerate(labels) if lab == "tag"] == sorted(tag_chars)
    assert set(sf.span_labels("", "an RFT trace, no tags")) == {"plan"}


def test_token_labels_rule():
    chars = ["query"] * 2 + ["tag"] * 3 + ["plan"] * 3 + ["prompt"] * 2
    assert sf.token_labels(chars, [(0, 3), (2, 6), (5, 7), (6, 10), (4, 4), (0, 0)]) == \
        ["query", "tag", "plan", "plan", "tag", "query"]
    assert sf.token_labels(["plan", "prompt", "prompt"], [(0, 3)]) == ["prompt"]
    assert sf.token_labels(["plan", "prompt"], [(0, 2)]) == ["plan"]   # tie: the earliest


# ---------------------------------------------------------------------------------------------
# adversarial sizes: parsing is linear in the input
# ---------------------------------------------------------------------------------------------

def _many_prompts(n: int) -> str:
    prompts = " ".join(f"{sf.prompt_open(1, j)} p {sf.prompt_close(1, j)}" for j in range(1, n + 1))
    execs = "\n".join(f"{sf.execution_open(1, j)} e {sf.execution_close(1, j)}" for j in range(1, n + 1))
    return f"{sf.plan_open(1)} {prompts} {sf.plan_close(1)}\n{execs}\n{sf.FINAL_OPEN} 1 {sf.FINAL_CLOSE}"


def _many_stages(n: int) -> str:
    return "\n".join(f"{sf.plan_open(i)} t {sf.prompt_open(i, 1)} p {sf.prompt_close(i, 1)} {sf.plan_close(i)}\n"
                     f"{sf.execution_open(i, 1)} e {sf.execution_close(i, 1)}" for i in range(1, n + 1))


def _lines_run(fn, *args) -> int:
    """Python lines executed by fn(*args) (sys.settrace): a count of the work, the same on any
    machine at any load."""
    n = 0

    def tracer(frame, event, arg):
        nonlocal n
        if event == "line":
            n += 1
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(old)
    return n


@pytest.mark.parametrize("make", [_many_prompts, _many_stages], ids=["prompts_in_one_plan", "stages"])
def test_parse_completion_is_linear(make):
    """4x the input must cost 4x the work, not 16x (the old parser recounted prompts and rescanned
    stages on every tag: 8,000 prompts took seconds). The work is counted, not timed: Python lines
    executed, measured 3.99x here for both shapes; any per-tag pass over what came before (a
    quadratic term of even 5% at the small size) puts the ratio past 4.4."""
    small, large = make(500), make(2000)
    assert len(sf.parse_completion(large)[0].stages) >= 1
    ratio = _lines_run(sf.parse_completion, large) / _lines_run(sf.parse_completion, small)
    assert ratio < 4.4, f"4x input ran {ratio:.2f}x the Python lines: parsing is not linear"
