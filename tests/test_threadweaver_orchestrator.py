"""The orchestrator running ThreadWeaver-format models (`OrchestratorConfig.format="threadweaver"`):
one `<Parallel>` block per stage, its outlines the prompts, its threads decoded in one batched fork,
the answer after `</think>` running to EOS. Control flow and accounting on the scripted engine of
test_orchestrator.py (with ThreadWeaver's tags as single tokens), malformed output, fuzzing, the
export meta's `format`, and the real engine on a tiny real checkpoint (parallel == serial)."""
from __future__ import annotations

import json
import re
from typing import Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from sprint_jax import format as fmt
from sprint_jax import threadweaver as tw
from sprint_jax.config import ConfigError, load_config
from sprint_jax.infer.orchestrator import TERMINATIONS, OrchestratorConfig, run_query
from test_orchestrator import _PIECE, Done, ForcedPlanner, ScriptedEngine, WordTokenizer, _untimed

TW = OrchestratorConfig(format="threadweaver")            # flat layout (the default)
TW_TRIE = OrchestratorConfig(format="threadweaver", layout="trie")


# ---------------------------------------------------------------------------------------------
# The scripted engine with ThreadWeaver's tags
# ---------------------------------------------------------------------------------------------
# Tokenization as in test_orchestrator.py, and a ThreadWeaver tag is one token too; a thread
# number with its colon ("1:") is one word.
_ANY_TAG = re.compile(f"{fmt.TAG_PATTERN.pattern}|{tw.TAG_PATTERN.pattern}")


class TWTokenizer(WordTokenizer):
    def pieces(self, text: str) -> list[str]:
        out, pos = [], 0
        for m in _ANY_TAG.finditer(text):
            out += _PIECE.findall(text[pos:m.start()]) + [m.group(0)]
            pos = m.end()
        return out + _PIECE.findall(text[pos:])


class TWEngine(ScriptedEngine):
    """Planner outputs in order from `planner`; thread outputs from `threads[(k, j)]`, keyed by
    the block (the number of `</Outlines>` in the branch's context) and the forced `<Thread>j:`
    (default: EOS)."""

    def __init__(self, planner: Sequence[str] = (), threads: dict[tuple[int, int], str] | None = None, **kw):
        super().__init__(planner, {}, **kw)
        self.tokenizer = TWTokenizer()
        self.threads = dict(threads or {})

    def fork(self, state, prefixes, max_new_tokens, stop=(), sampling=None, tag=None, serial=False, join=False):
        n = len(prefixes)
        if n == 0 or n > self.max_branches:
            from sprint_jax.infer.requests import EngineError
            raise EngineError(f"{n} branches (max_branches={self.max_branches})")
        context = self.decode_text(state.tokens)
        gens = []
        for p, m, s in zip(prefixes, max_new_tokens, stop):
            assert m >= 1 and len(p) + 1 + m <= self.max_branch_tokens
            assert len(state.tokens) + len(p) + m <= self.max_seq_len
            text = context + self.decode_text(p)
            j = re.findall(r"<Thread>(\d+):", text)
            key = (text.count(tw.OUTLINES_CLOSE), int(j[-1])) if j else (0, 0)
            gens.append(self._emit(self.threads.get(key, ""), m, list(s)))
        self.calls.append({"kind": "branches", "mode": "serial" if serial else "shared", "context": context,
                           "prefixes": [self.decode_text(p) for p in prefixes], "limits": list(max_new_tokens),
                           "stop": [list(s) for s in stop], "seed": getattr(sampling, "seed", None)})
        return Done("fork", state, gens)

    def merge(self, state, branches):
        """A merge join: the branches' tokens (opening + body) appended in thread order."""
        self.calls.append({"kind": "merge", "branches": [self.decode_text(b) for b in branches]})
        state.tokens = state.tokens + [t for b in branches for t in b]
        return state


# ---------------------------------------------------------------------------------------------
# A two-block run, counted by hand
# ---------------------------------------------------------------------------------------------
TW_QUERY = "Compute (2+3)*(4+5) and 7-1."
TW_PLANNER = [
    # <think> \n Split _ the _ work. \n <Parallel> \n <Outlines> \n (12)
    # + <Outline> 1: _ add _ 2+3 </Outline> \n (8) + the same for 2 (8) + </Outlines> (1) = 29 tokens
    "<think>\nSplit the work.\n<Parallel>\n<Outlines>\n<Outline>1: add 2+3</Outline>\n"
    "<Outline>2: add 4+5</Outline>\n</Outlines>",
    # Now _ multiply _ and _ subtract. \n <Parallel> \n <Outlines> \n (12) + outline 1 (8)
    # + outline 2 (8) + <Outline> 3: _ check </Outline> \n (6) + </Outlines> (1) = 35 tokens
    "Now multiply and subtract.\n<Parallel>\n<Outlines>\n<Outline>1: multiply 5*9</Outline>\n"
    "<Outline>2: subtract 7-1</Outline>\n<Outline>3: check</Outline>\n</Outlines>",
    # So _ the _ answers _ are _ 45 _ and _ 6. \n </think> \n 45 _ and _ 6 (21) + EOS = 22 tokens
    "So the answers are 45 and 6.\n</think>\n45 and 6",
]
TW_THREADS = {
    (1, 1): " So 2+3 = 5.</Thread>",                 # _ So _ 2+3 _ = _ 5. </Thread> = 9 tokens
    (1, 2): " 4+5 = 9.</Thread>",                    # 7
    (2, 1): " 5*9 = 45.</Thread>",                   # 7
    (2, 2): " 7-1 = 6.</Thread>",                    # 7
    (2, 3): " Both results are integers.</Thread>",  # 9
}
# written out by hand: what the planner holds at the end (tw.render_completion's layout)
TW_TEXT = """<think>
Split the work.
<Parallel>
<Outlines>
<Outline>1: add 2+3</Outline>
<Outline>2: add 4+5</Outline>
</Outlines>
<Thread>1: So 2+3 = 5.</Thread>
<Thread>2: 4+5 = 9.</Thread>
</Parallel>
Now multiply and subtract.
<Parallel>
<Outlines>
<Outline>1: multiply 5*9</Outline>
<Outline>2: subtract 7-1</Outline>
<Outline>3: check</Outline>
</Outlines>
<Thread>1: 5*9 = 45.</Thread>
<Thread>2: 7-1 = 6.</Thread>
<Thread>3: Both results are integers.</Thread>
</Parallel>
So the answers are 45 and 6.
</think>
45 and 6"""
TW_TRAJECTORY = tw.TWTrajectory(blocks=[
    tw.ParallelBlock("Split the work.", ["add 2+3", "add 4+5"], ["So 2+3 = 5.", "4+5 = 9."]),
    tw.ParallelBlock("Now multiply and subtract.", ["multiply 5*9", "subtract 7-1", "check"],
                     ["5*9 = 45.", "7-1 = 6.", "Both results are integers."]),
], after="So the answers are 45 and 6.", answer="45 and 6")


def tw_engine(**kw) -> TWEngine:
    return TWEngine(TW_PLANNER, TW_THREADS, **kw)


def trie_planner() -> list[str]:
    """The same run as a trie-trained model writes it: each main-sequence call after a block
    starts with its own gap (the join forced `</Parallel>` without it)."""
    return [TW_PLANNER[0]] + ["\n" + p for p in TW_PLANNER[1:]]


def test_threadweaver_two_block_run_stages_text_and_exact_accounting():
    engine = tw_engine()
    events = []
    rec = run_query(engine, TW_QUERY, "parallel", TW, on_event=lambda e: events.append(e))
    assert rec.termination == "final_answer" and rec.problems == [] and rec.format_valid
    assert rec.text == TW_TEXT == tw.render_completion(TW_TRAJECTORY)
    parsed, problems = tw.parse_completion(rec.text)
    assert problems == [] and parsed == TW_TRAJECTORY
    assert rec.final_answer == "45 and 6" and rec.final_text == TW_PLANNER[2]
    # a block is a stage: its text before is the plan, its outlines the prompts, its threads the executions
    assert [s.index for s in rec.stages] == [1, 2]
    assert [s.plan for s in rec.stages] == ["Split the work.", "Now multiply and subtract."]
    assert rec.stages[1].prompts == ["multiply 5*9", "subtract 7-1", "check"]
    assert [s.planner_stop for s in rec.stages] == ["</Outlines>"] * 2
    assert [[e.text for e in s.executions] for s in rec.stages] == [
        [TW_THREADS[1, 1], TW_THREADS[1, 2]], [TW_THREADS[2, 1], TW_THREADS[2, 2], TW_THREADS[2, 3]]]
    assert [s.planner_tokens for s in rec.stages] == [29, 35] and rec.final_tokens == 22
    assert [s.executor_tokens for s in rec.stages] == [[9, 7], [7, 7, 9]]
    # by hand: (29 + max(9, 7)) + (35 + max(7, 7, 9)) + 22; total adds every thread
    assert rec.sequential_tokens == 104
    assert rec.total_tokens == 29 + 9 + 7 + 35 + 7 + 7 + 9 + 22 == 125 == engine.generated
    # forced: "\n" "<Thread>" "j:" per thread (3 tokens), nothing repaired
    assert [e.forced_tokens for s in rec.stages for e in s.executions] == [3] * 5
    branches = [c for c in engine.calls if c["kind"] == "branches"]
    assert branches[1]["prefixes"] == ["\n<Thread>1:", "\n<Thread>2:", "\n<Thread>3:"]
    assert branches[1]["stop"] == [["</Thread>"]] * 3
    assert branches[1]["context"] == TW_QUERY + TW_TEXT[:TW_TEXT.index("<Outline>3: check")] + \
        "<Outline>3: check</Outline>\n</Outlines>"
    # the sync prefilled the threads in order, then the block's close and the gap that follows it
    syncs = [c["text"] for c in engine.calls if c["kind"] == "extend"]
    assert syncs[0] == "\n<Thread>1: So 2+3 = 5.</Thread>\n<Thread>2: 4+5 = 9.</Thread>\n</Parallel>\n"
    gens = [c for c in engine.calls if c["kind"] == "generate"]
    assert [c["stop"] for c in gens] == [["</Outlines>"]] * 3
    assert gens[2]["context"] == TW_QUERY + TW_TEXT[:TW_TEXT.index("So the answers")]
    assert len({c["seed"] for c in gens + branches}) == len(gens + branches)
    # the text events commit the completion in order; the last call's output follows them
    committed = "".join(e.text for e in events if e.kind == "text")
    assert committed + rec.final_text == rec.text
    assert [(e.text, e.stage.index, e.executor) for e in events if e.kind == "text" and e.executor] == [
        ("\n" + tw.thread_opening(j) + TW_THREADS[k, j], k, j) for k, j in sorted(TW_THREADS)]
    d = rec.to_json()
    json.dumps(d)
    assert d["config"]["format"] == "threadweaver" and d["n_stages"] == 2


def test_threadweaver_trie_model_writes_its_own_gap_after_the_block():
    engine = TWEngine(trie_planner(), TW_THREADS)
    rec = run_query(engine, TW_QUERY, "parallel", TW_TRIE)
    assert rec.termination == "final_answer" and rec.problems == [] and rec.text == TW_TEXT
    syncs = [c["text"] for c in engine.calls if c["kind"] == "extend"]
    assert syncs[0] == "\n<Thread>1: So 2+3 = 5.</Thread>\n<Thread>2: 4+5 = 9.</Thread>\n</Parallel>"
    # one more token per later call (its own gap) than the flat run
    assert [s.planner_tokens for s in rec.stages] == [29, 36] and rec.final_tokens == 23
    assert rec.sequential_tokens == 104 + 2 and rec.total_tokens == 125 + 2 == engine.generated


def test_threadweaver_merge_join_places_the_threads_then_forces_the_block_close():
    """A merge-layout model (the trie's planner: each later call writes its own gap): each block's
    threads are merged as their forced opening and body, then `\n</Parallel>` is prefilled as
    planner text; the text and accounting are the trie run's."""
    engine = TWEngine(trie_planner(), TW_THREADS)
    rec = run_query(engine, TW_QUERY, "parallel", OrchestratorConfig(format="threadweaver", layout="merge"))
    assert rec.termination == "final_answer" and rec.problems == [] and rec.text == TW_TEXT
    assert rec.join == "merge" and [s.join for s in rec.stages] == ["merge", "merge"]
    calls = [(c["kind"], c.get("branches", c.get("text"))) for c in engine.calls if c["kind"] in ("merge", "extend")]
    assert calls == [
        ("merge", ["\n<Thread>1: So 2+3 = 5.</Thread>", "\n<Thread>2: 4+5 = 9.</Thread>"]),
        ("extend", "\n</Parallel>"),
        ("merge", ["\n<Thread>1: 5*9 = 45.</Thread>", "\n<Thread>2: 7-1 = 6.</Thread>",
                   "\n<Thread>3: Both results are integers.</Thread>"]),
        ("extend", "\n</Parallel>")]
    assert [s.sync_tokens for s in rec.stages] == [2, 2]             # \n and </Parallel>: nothing else ran
    trie = run_query(TWEngine(trie_planner(), TW_THREADS), TW_QUERY, "parallel", TW_TRIE)
    assert (rec.sequential_tokens, rec.total_tokens) == (trie.sequential_tokens, trie.total_tokens) == (106, 127)
    with pytest.raises(ValueError, match="mode 'serial' runs executors on the planner's own cache"):
        run_query(TWEngine(trie_planner(), TW_THREADS), TW_QUERY, "serial",
                  OrchestratorConfig(format="threadweaver", layout="merge"))


def test_threadweaver_serial_mode_gives_the_same_record_as_parallel():
    par = run_query(tw_engine(), TW_QUERY, "parallel", TW)
    eng = tw_engine()
    ser = run_query(eng, TW_QUERY, "serial", TW)
    assert [c["mode"] for c in eng.calls if c["kind"] == "branches"] == ["serial"] * 2
    a, b = _untimed(par), _untimed(ser)
    assert a.pop("mode") == "parallel" and b.pop("mode") == "serial"
    assert a == b and a["termination"] == "final_answer"


def test_threadweaver_sequential_mode_runs_to_eos():
    engine = TWEngine(["<think>\nJust add.\n</think>\n5"])      # 9 tokens + EOS
    rec = run_query(engine, "2+3?", "sequential", TW)
    assert engine.calls[1]["stop"] == []
    assert rec.termination == "final_answer" and rec.final_answer == "5" and rec.format_valid
    assert rec.text == "<think>\nJust add.\n</think>\n5" and rec.problems == []
    assert rec.sequential_tokens == rec.total_tokens == 10 == engine.generated
    # no </think> before EOS: no answer
    rec = run_query(TWEngine(["<think>\nhmm"]), "2+3?", "sequential", TW)
    assert rec.termination == "eos" and rec.final_answer is None and not rec.format_valid
    # the budget runs out first
    rec = run_query(TWEngine(["a b c d e f"]), "Q", "sequential", OrchestratorConfig(format="threadweaver",
                                                                                  max_total_tokens=4))
    assert rec.termination == "token_budget" and rec.total_tokens == 4
    assert rec.problems[0] == "the output reached 4 tokens without ending (EOS) after </think>"
    assert "format: missing <think>" in rec.problems           # then the final parse's own findings


def test_sprint_records_are_unchanged_by_the_format_field():
    """A SPRINT run's record does not name the format (its default), so records and the eval
    resume check read as before the field existed."""
    rec = run_query(TWEngine(["<Plan_1> x </Plan_1>", "\n<Final Answer> 1 </Final Answer>"]), "Q", "parallel")
    assert "format" not in rec.config and rec.termination == "final_answer"
    assert OrchestratorConfig().to_json() == {k: v for k, v in OrchestratorConfig(format="sprint").__dict__.items()
                                              if k != "format"}


# ---------------------------------------------------------------------------------------------
# Malformed output ends or is repaired, with a reason
# ---------------------------------------------------------------------------------------------
ONE_BLOCK = "<think>\n<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n<Outline>2: b</Outline>\n</Outlines>"


def test_threadweaver_truncated_and_eos_threads_are_closed_with_the_thread_tag():
    engine = TWEngine([ONE_BLOCK, "</think>\n1"], {(1, 1): " one two three four", (1, 2): " x<eos>"})
    rec = run_query(engine, "Q", "parallel", OrchestratorConfig(format="threadweaver", max_branch_tokens=3))
    ex = rec.stages[0].executions
    assert [e.stop_reason for e in ex] == ["length", "eos"] and [e.tokens for e in ex] == [3, 3]
    assert [e.text for e in ex] == [" one ", " x"] and ex[0].repaired and ex[1].repaired
    # the repair is the close tag alone (no gap before it in ThreadWeaver's canonical text)
    assert [e.forced_tokens for e in ex] == [3 + 1, 3 + 1]
    sync = [c["text"] for c in engine.calls if c["kind"] == "extend"][0]
    assert sync == "\n<Thread>1: one </Thread>\n<Thread>2: x</Thread>\n</Parallel>\n"
    assert rec.problems == [
        "stage 1: thread 1.1 reached its 3-token limit before </Thread>; closed by the orchestrator",
        "stage 1: thread 1.2 ended (EOS) before </Thread>; closed by the orchestrator"]
    assert rec.termination == "final_answer" and rec.final_answer == "1" and not rec.format_valid
    assert tw.parse_completion(rec.text) == (tw.TWTrajectory(blocks=[tw.ParallelBlock("", ["a", "b"], ["one", "x"])],
                                                             answer="1"), [])


def test_threadweaver_more_outlines_than_branches_runs_the_first_ones():
    planner = ["<think>\n<Parallel>\n<Outlines>\n" + "\n".join(f"<Outline>{j}: p{j}</Outline>" for j in (1, 2, 3))
               + "\n</Outlines>", "</think>\n1"]
    engine = TWEngine(planner, {(1, j): f" e{j}</Thread>" for j in (1, 2, 3)}, max_branches=2)
    rec = run_query(engine, "Q", "parallel", TW)
    assert rec.stages[0].prompts == ["p1", "p2", "p3"] and len(rec.stages[0].executions) == 2
    assert rec.problems[0] == "stage 1: 3 prompts; only the first 2 run (max_prompts=8, engine max_branches=2)"
    assert rec.problems[1].startswith("format: outline 3 of <Parallel> at char 8 has no <Thread>")
    assert len(rec.problems) == 2 and rec.termination == "final_answer" and not rec.format_valid


def test_threadweaver_plan_problems_are_the_stage_problems_of_that_call():
    """Outlines numbered wrong are reported on the stage that wrote them; executors still run in
    position order and are numbered by position."""
    planner = ["<think>\n<Parallel>\n<Outlines>\n<Outline>2: b</Outline>\n<Outline>c</Outline>\n</Outlines>",
               "</think>\n1"]
    engine = TWEngine(planner, {(1, 1): " B</Thread>", (1, 2): " C</Thread>"})
    rec = run_query(engine, "Q", "parallel", TW)
    assert rec.stages[0].prompts == ["b", "c"] and [e.index for e in rec.stages[0].executions] == [1, 2]
    assert rec.stages[0].problems == ["stage 1 plan: <Outline> at char 30 is numbered 2: expected 1",
                                      "stage 1 plan: <Outline> at char 54 does not start with its number '2:'"]
    assert rec.termination == "final_answer" and not rec.format_valid


def test_threadweaver_block_with_no_outline_is_closed_without_threads():
    planner = ["<think>\n<Parallel>\n<Outlines>\n</Outlines>", "done\n</think>\n1"]
    engine = TWEngine(planner)
    rec = run_query(engine, "Q", "parallel", TW)
    assert not [c for c in engine.calls if c["kind"] == "branches"]
    assert rec.stages[0].executions == [] and rec.stages[0].sync_tokens == 3     # \n </Parallel> \n
    assert rec.stages[0].problems == ["stage 1 plan: <Parallel> at char 8 has no <Outline>",
                                      "stage 1: a block with no prompt; closed with '</Parallel>', no thread ran"]
    assert rec.problems[0] == rec.stages[0].problems[1]
    assert rec.text == "<think>\n<Parallel>\n<Outlines>\n</Outlines>\n</Parallel>\ndone\n</think>\n1"
    assert rec.termination == "final_answer" and rec.final_answer == "1" and not rec.format_valid


@pytest.mark.parametrize("planner, termination, problem", [
    # missing </Outlines>: the main sequence ends (EOS) or runs into its limit
    ([ONE_BLOCK[:-len("</Outlines>")]], "eos", "stage 1: the planner ended (EOS) without </Outlines> or </think> "
                                               "and EOS"),
    (["<think>\n" + "word " * 30], "planner_token_limit", "stage 1: the planner call reached 20 tokens without "
                                                          "</Outlines> or </think> and EOS"),
    # a </Outlines> that closes no new block
    (["<think>\n</Outlines>"], "malformed", "stage 1: the planner stopped at '</Outlines>' with no matching opening"),
    (["<think>\nx\n</think>\n<Parallel>\n<Outlines>\n</Outlines>"], "malformed",
     "stage 1: the planner stopped at '</Outlines>' with no matching opening"),
    # the answer cut by the planner's limit is not a final answer
    (["<think>\n</think>\n" + "word " * 30], "planner_token_limit", None),
    ([], "eos", None),
])
def test_threadweaver_planner_failures_end_the_run_with_a_reason(planner, termination, problem):
    rec = run_query(TWEngine(planner), "Q", "parallel", OrchestratorConfig(format="threadweaver",
                                                                           max_planner_tokens=20))
    assert rec.termination == termination and rec.problems and not rec.format_valid
    assert rec.final_answer is None and rec.total_tokens == rec.sequential_tokens <= 20
    if problem is not None:
        assert rec.problems[0] == problem


def test_threadweaver_budgets_end_runs():
    rec = run_query(tw_engine(), TW_QUERY, "parallel", OrchestratorConfig(format="threadweaver", max_stages=1))
    assert rec.termination == "max_stages" and len(rec.stages) == 2 and rec.stages[1].executions == []
    engine = tw_engine()
    rec = run_query(engine, TW_QUERY, "parallel", OrchestratorConfig(format="threadweaver",
                                                                     max_total_tokens=29 + 16 + 35 + 6))
    assert [c["limits"] for c in engine.calls if c["kind"] == "branches"] == [[28, 28], [2, 2, 2]]
    assert rec.termination == "token_budget" and rec.total_tokens == 86 == engine.generated


def test_threadweaver_config_is_validated_and_read_from_the_export_meta(tmp_path):
    cfg = load_config(OrchestratorConfig, overrides=["format=threadweaver"])
    assert cfg.format == "threadweaver" and cfg.resolved_join == "reprefill"
    with pytest.raises(ConfigError, match="format: 'tw' is not one of"):
        load_config(OrchestratorConfig, overrides=["format=tw"])
    with pytest.raises(ValueError, match=r"format must be one of \['sprint', 'threadweaver'\], got 'tw'"):
        OrchestratorConfig(format="tw")
    assert OrchestratorConfig(format="threadweaver", layout="merge").resolved_join == "merge"
    assert OrchestratorConfig(format="threadweaver", layout="trie", join="merge").resolved_join == "merge"
    with pytest.raises(ValueError, match="join='merge' needs a model trained with the trie or merge layout"):
        OrchestratorConfig(format="threadweaver", layout="flat", join="merge")
    from sprint_jax.infer.infer_cli import model_defaults
    from sprint_jax.model.hf import update_export_meta
    update_export_meta(tmp_path, layout="trie", format="threadweaver")
    assert model_defaults(str(tmp_path)) == {"layout": "trie", "format": "threadweaver"}
    cfg = load_config(OrchestratorConfig, overrides=[], data=model_defaults(str(tmp_path)))
    assert (cfg.format, cfg.layout) == ("threadweaver", "trie")
    (tmp_path / "sprint_jax.json").write_text(json.dumps({"layout": "flat"}))
    assert model_defaults(str(tmp_path)) == {"layout": "flat"}        # no key: the default, sprint


# ---------------------------------------------------------------------------------------------
# Fuzz: random and truncated outputs never crash or hang and always end with a reason
# ---------------------------------------------------------------------------------------------
_WORDS = ["a", "b", "1:", "2:", " ", " ", "\n", "<", ">", "<eos>"]
_TW_TAGS = st.sampled_from(tw.tag_vocabulary())
_piece = st.one_of(_TW_TAGS, st.sampled_from(_WORDS))
_text = st.lists(_piece, max_size=25).map("".join)


@st.composite
def _well_formed_prefix(draw) -> str:
    """A canonical ThreadWeaver text cut at a random point (a truncated good output)."""
    blocks = []
    for _ in range(draw(st.integers(0, 3))):
        k = draw(st.integers(0, 3))
        blocks.append(tw.ParallelBlock("plan", [f"p{j}" for j in range(k)], [f"e{j}" for j in range(k)]))
    text = tw.render_completion(tw.TWTrajectory(blocks=blocks, after="so", answer="x"))
    return text[: draw(st.integers(0, len(text)))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner=st.lists(st.one_of(_text, _well_formed_prefix()), max_size=6),
       threads=st.dictionaries(st.tuples(st.integers(1, 3), st.integers(1, 3)),
                               st.one_of(_text, _well_formed_prefix()), max_size=6),
       mode=st.sampled_from(["parallel", "serial", "sequential"]), layout=st.sampled_from(["flat", "trie", "merge"]),
       budgets=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 30), st.integers(1, 30),
                         st.integers(1, 120)),
       capacity=st.tuples(st.integers(8, 200), st.integers(1, 4), st.integers(2, 40)))
def test_threadweaver_fuzz_never_crashes_and_always_terminates(planner, threads, mode, layout, budgets, capacity):
    stages, prompts, ptok, btok, total = budgets
    if layout == "merge" and mode == "serial":
        mode = "parallel"                   # a merge join has no serial mode (refused, tested above)
    engine = TWEngine(planner, threads, max_seq_len=capacity[0], max_branches=capacity[1],
                      max_branch_tokens=capacity[2])
    cfg = OrchestratorConfig(max_stages=stages, max_prompts=prompts, max_planner_tokens=ptok,
                             max_branch_tokens=btok, max_total_tokens=total, layout=layout, format="threadweaver")
    rec = run_query(engine, "Query text", mode, cfg)
    assert rec.termination in TERMINATIONS and rec.termination != "engine_error", rec.problems
    assert rec.total_tokens == engine.generated <= total
    assert rec.sequential_tokens <= rec.total_tokens
    assert len(rec.stages) <= stages + 1
    if rec.termination == "final_answer":
        assert rec.final_answer is not None and tw.THINK_CLOSE in rec.text
    else:
        assert not rec.format_valid
    if mode == "sequential":
        assert rec.sequential_tokens == rec.total_tokens
    json.dumps(rec.to_json())


# ---------------------------------------------------------------------------------------------
# The real engine on a tiny real checkpoint
# ---------------------------------------------------------------------------------------------
REAL_QUERY = "Q: 2+3=?"
REAL_PLANNER = ["<think>\nsplit\n<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n<Outline>2: b</Outline>\n"
                "</Outlines>", "ok"]


@pytest.mark.slow      # ~145 s on 2 CPU cores (compiles the fork, serial and alone shapes), plus the fixture
def test_threadweaver_real_engine_parallel_equals_serial_and_threads_match_a_decode_alone(engine_224, alone_224):
    """The main sequence forced (block 1, then two tokens that end on the context's room), the
    threads decoded by the real engine (greedy). Each thread equals a decode alone from a fresh
    prefill of its flat context (a character tokenizer: one token per character)."""
    cfg = OrchestratorConfig(format="threadweaver", max_branch_tokens=6, max_planner_tokens=100)
    par = run_query(ForcedPlanner(engine_224, REAL_PLANNER), REAL_QUERY, "parallel", cfg)
    ser = run_query(ForcedPlanner(engine_224, REAL_PLANNER), REAL_QUERY, "serial", cfg)
    # 8 + 95 + 2 x 17 context tokens leave the second call 224 - 137 = 87 < 100: its room binds
    assert par.termination == ser.termination == "context_full"
    a, b = _untimed(par), _untimed(ser)
    a.pop("mode"), b.pop("mode")
    assert a == b
    enc = engine_224.encode
    for j, ex in enumerate(par.stages[0].executions, start=1):
        context = enc(REAL_QUERY) + enc(REAL_PLANNER[0] + "\n" + tw.thread_opening(j))
        ref = alone_224.generate(alone_224.prefill(context), 6, stop=[tw.THREAD_CLOSE])
        assert ex.tokens == len(ref.tokens) and ex.text == ref.text[:len(ex.text)]
    assert [s.planner_tokens for s in par.stages] == [len(REAL_PLANNER[0]), 2]
    assert [e.tokens for e in par.stages[0].executions] == [6, 6]       # no </Thread> from a random model
    assert par.sequential_tokens == len(REAL_PLANNER[0]) + 6 + 2 and par.total_tokens == len(REAL_PLANNER[0]) + 12 + 2
    # the sync re-prefilled each thread's opening, body and repair, then "\n</Parallel>\n"
    assert par.stages[0].sync_tokens == sum(e.forced_tokens + e.tokens for e in par.stages[0].executions) + \
        len("\n</Parallel>\n")
