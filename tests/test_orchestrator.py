"""The SPRINT orchestrator (paper §10; docs/design.md "The orchestrator and its accounting"):
control flow and accounting on a scripted test double of the engine, fuzzing of malformed output,
and the real engine on a tiny real checkpoint (parallel == serial under greedy; counts equal an
independent decode)."""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Sequence

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from sprint_jax import format as fmt
from sprint_jax.config import ConfigError, load_config
from sprint_jax.infer.requests import EngineError, Generation
from sprint_jax.infer.orchestrator import TERMINATIONS, OrchestratorConfig, execution_opening, run_query


# ---------------------------------------------------------------------------------------------
# A scripted stand-in for the engine (also used by test_eval.py)
# ---------------------------------------------------------------------------------------------
# It offers the engine's public interface (operations that are done when submitted, so `run_many`
# never steps it) and applies the real engine's rules: stop strings cut the output after the token
# that completes them, token limits, EOS, the same capacity checks (raising the real EngineError). Tokenization is easy to count by hand: a SPRINT tag is one token,
# `<eos>` is EOS, each whitespace character is one token, every other maximal run of characters
# without whitespace or `<` is one token, a lone `<` is one token.
EOS = "<eos>"
_PIECE = re.compile(r"<eos>|\s|[^\s<]+|<")


class WordTokenizer:
    def __init__(self):
        self.vocab: list[str] = [EOS]
        self.ids: dict[str, int] = {EOS: 0}
        self.eos_token_id = 0

    def _id(self, piece: str) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.vocab)
            self.vocab.append(piece)
        return self.ids[piece]

    def pieces(self, text: str) -> list[str]:
        out, pos = [], 0
        for m in fmt.TAG_PATTERN.finditer(text):
            out += _PIECE.findall(text[pos:m.start()]) + [m.group(0)]
            pos = m.end()
        return out + _PIECE.findall(text[pos:])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self._id(p) for p in self.pieces(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


@dataclasses.dataclass
class State:
    tokens: list[int]
    closed: bool = False


@dataclasses.dataclass
class Done:
    """An engine operation finished when it was submitted."""
    kind: str
    seq: object
    result: object
    done: bool = True


class ScriptedEngine:
    """Planner outputs are taken in order from `planner` (after they run out: EOS); executor
    outputs from `executors[(i, j)]` keyed by the forced `<execution_i.j>` (default: EOS)."""

    def __init__(self, planner: Sequence[str] = (), executors: dict[tuple[int, int], str] | None = None,
                 max_seq_len: int = 4096, max_branches: int = 8, max_branch_tokens: int = 512):
        self.tokenizer = WordTokenizer()
        self.planner = list(planner)
        self.executors = dict(executors or {})
        self.max_seq_len = max_seq_len
        self.max_branches = max_branches
        self.max_branch_tokens = max_branch_tokens
        self.max_seqs = 1                  # one run at a time, as a one-slot engine
        self.eos_token_ids = [0]
        self.calls: list[dict] = []        # what each call saw (for assertions)
        self.generated = 0                 # every token any call generated

    # -- public interface ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def open(self, ids: Sequence[int], tag=None) -> Done:
        if not ids:
            raise EngineError("open needs at least one token (got an empty input)")
        if len(ids) > self.max_seq_len:
            raise EngineError("input exceeds max_seq_len")
        self.calls.append({"kind": "prefill", "tokens": len(ids)})
        state = State(list(ids))
        return Done("open", state, state)

    def extend(self, state: State, ids: Sequence[int], tag=None) -> Done:
        if len(state.tokens) + len(ids) > self.max_seq_len:
            raise EngineError("extend exceeds max_seq_len")
        self.calls.append({"kind": "extend", "text": self.decode_text(ids)})
        state.tokens = state.tokens + list(ids)
        return Done("extend", state, state)

    def close(self, state: State) -> None:
        state.closed = True

    def step(self) -> bool:
        return False                       # every operation is done when submitted

    def truncate(self, state: State, n: int) -> State:
        if not 1 <= n <= len(state.tokens):
            raise EngineError(f"truncate to {n} of {len(state.tokens)} tokens")
        self.calls.append({"kind": "truncate", "keep": n})
        state.tokens = state.tokens[:n]
        return state

    def _emit(self, script: str, limit: int, stops: Sequence[str]) -> Generation:
        tokens = self.encode(script) if script else [0]
        out: list[int] = []
        reason = "length"
        for t in tokens:
            out.append(t)
            if t == 0:
                reason = "eos"
                break
            if any(s in self.decode_text(out) for s in stops):
                reason = "stop"
                break
            if len(out) >= limit:
                break
        else:
            if len(out) < limit:        # the script ran out before its limit: the model ends
                out.append(0)
                reason = "eos"
        self.generated += len(out)
        return Generation(tokens=out, text=self.decode_text(out), stop_reason=reason, steps=len(out))

    def generate(self, state: State, max_new_tokens: int, stop: Sequence[str] = (), sampling=None, tag=None) -> Done:
        if max_new_tokens <= 0:
            raise EngineError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(state.tokens) + max_new_tokens > self.max_seq_len:
            raise EngineError("generate would exceed max_seq_len")
        script = self.planner.pop(0) if self.planner else ""
        self.calls.append({"kind": "generate", "context": self.decode_text(state.tokens), "limit": max_new_tokens,
                           "stop": list(stop), "seed": getattr(sampling, "seed", None)})
        g = self._emit(script, max_new_tokens, stop)
        state.tokens = state.tokens + g.tokens
        return Done("generate", state, g)

    def fork(self, state: State, prefixes: Sequence[Sequence[int]], max_new_tokens, stop=(), sampling=None,
             tag=None, serial: bool = False, join: bool = False) -> Done:
        n = len(prefixes)
        mode = "serial" if serial else "shared"
        if n == 0 or n > self.max_branches:
            raise EngineError(f"{n} branches (max_branches={self.max_branches})")
        limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        stops = [list(s) for s in stop]
        if len(limits) != n or len(stops) != n:
            raise EngineError("per-branch lists of the wrong length")
        gens = []
        for p, m, stop_ids in zip(prefixes, limits, stops):
            if m <= 0 or len(p) + 1 + m > self.max_branch_tokens:
                raise EngineError("branch exceeds max_branch_tokens")
            if len(state.tokens) + len(p) + m > self.max_seq_len:
                raise EngineError("branch exceeds max_seq_len")
            tags = fmt.find_tags(self.decode_text(p))
            m_ij = re.fullmatch(r"<execution_(\d+)\.(\d+)>", tags[-1]) if tags else None
            key = (int(m_ij.group(1)), int(m_ij.group(2))) if m_ij else (0, 0)
            gens.append(self._emit(self.executors.get(key, ""), m, stop_ids))
        self.calls.append({"kind": "branches", "mode": mode, "context": self.decode_text(state.tokens),
                           "prefixes": [self.decode_text(p) for p in prefixes], "limits": limits,
                           "stop": stops, "seed": getattr(sampling, "seed", None)})
        return Done("fork", state, gens)


# ---------------------------------------------------------------------------------------------
# The paper's 3-stage drug-discovery shape (§12): one plan + execution, three parallel executors,
# a combining stage, then the final answer.
# ---------------------------------------------------------------------------------------------
QUERY = "Propose a small-molecule lead that inhibits kinase K."
DRUG_PLANNER = [
    # 14 words/tags + 13 spaces = 27 tokens
    "<Plan_1> First identify the binding site. <prompt_1.1> Find the ATP pocket residues. </prompt_1.1> </Plan_1>",
    # newline + 19 words/tags + 18 spaces = 38 tokens
    "\n<Plan_2> Screen three scaffolds in parallel. <prompt_2.1> Score quinazoline. </prompt_2.1> "
    "<prompt_2.2> Score pyrimidine. </prompt_2.2> <prompt_2.3> Score indole. </prompt_2.3> </Plan_2>",
    # newline + 15 + 14 = 30 tokens
    "\n<Plan_3> Combine the results. <prompt_3.1> Pick the best scaffold and check its toxicity. </prompt_3.1> "
    "</Plan_3>",
    # newline + 5 + 4 = 10 tokens
    "\n<Final Answer> A quinazoline lead. </Final Answer>",
]
DRUG_EXECUTORS = {
    (1, 1): " The pocket has Lys33 and Glu51. </execution_1.1>",                  # 7 words + 7 spaces = 14
    (2, 1): " Quinazoline binds with -9.1 kcal/mol. </execution_2.1>",            # 6 + 6 = 12
    (2, 2): " Pyrimidine scores -7.4. </execution_2.2>",                          # 4 + 4 = 8
    (2, 3): " Indole scores -6.8 kcal/mol with a clash. </execution_2.3>",        # 8 + 8 = 16
    (3, 1): " Quinazoline is best and shows no toxic alerts. </execution_3.1>",   # 9 + 9 = 18
}
DRUG_TRAJECTORY = fmt.Trajectory(query=QUERY, stages=[
    fmt.Stage(1, ["First identify the binding site.", fmt.Prompt("Find the ATP pocket residues.")],
              ["The pocket has Lys33 and Glu51."]),
    fmt.Stage(2, ["Screen three scaffolds in parallel.", fmt.Prompt("Score quinazoline."),
                  fmt.Prompt("Score pyrimidine."), fmt.Prompt("Score indole.")],
              ["Quinazoline binds with -9.1 kcal/mol.", "Pyrimidine scores -7.4.",
               "Indole scores -6.8 kcal/mol with a clash."]),
    fmt.Stage(3, ["Combine the results.", fmt.Prompt("Pick the best scaffold and check its toxicity.")],
              ["Quinazoline is best and shows no toxic alerts."]),
], final_answer="A quinazoline lead.")


# The scripts are what a trie-trained model writes: every planner call starts with its own block
# gap. A flat-trained model is handed that gap by the sync (see the Qwen2 token-boundary tests).
TRIE = OrchestratorConfig(layout="trie")


def drug_engine(**kw) -> ScriptedEngine:
    return ScriptedEngine(DRUG_PLANNER, DRUG_EXECUTORS, **kw)


def _untimed(record) -> dict:
    d = record.to_json()
    d.pop("wall_s")
    d.pop("final_s")
    for s in d["stages"]:
        for k in ("planner_s", "executors_s", "sync_s", "branch_cache_bytes", "executor_mode"):
            s.pop(k)
    return d


def test_drug_discovery_trajectory_stages_and_exact_accounting():
    engine = drug_engine()
    events = []
    rec = run_query(engine, QUERY, "parallel", TRIE,
                    on_event=lambda e: events.append((e.kind, e.stage and e.stage.index)))
    assert rec.termination == "final_answer" and rec.problems == [] and rec.format_valid
    assert [s.index for s in rec.stages] == [1, 2, 3]
    assert [len(s.executions) for s in rec.stages] == [1, 3, 1]
    assert rec.stages[1].prompts == ["Score quinazoline.", "Score pyrimidine.", "Score indole."]
    assert [s.planner_tokens for s in rec.stages] == [27, 38, 30] and rec.final_tokens == 10
    assert [s.executor_tokens for s in rec.stages] == [[14], [12, 8, 16], [18]]
    # by hand: (27 + 14) + (38 + max(12, 8, 16)) + (30 + 18) + 10; total adds every executor
    assert rec.sequential_tokens == 153
    assert rec.total_tokens == 173
    assert engine.generated == rec.total_tokens
    assert rec.final_answer == "A quinazoline lead."
    # the planner holds exactly the rendered training text
    assert rec.text == fmt.render_completion(DRUG_TRAJECTORY)
    assert QUERY + "\n" + rec.text == fmt.render(DRUG_TRAJECTORY)
    # every executor of stage 2 ran in one batched call over the planner context after </Plan_2>
    branches = [c for c in engine.calls if c["kind"] == "branches"]
    assert [c["mode"] for c in branches] == ["shared"] * 3
    assert branches[1]["prefixes"] == ["\n<execution_2.1>", "\n<execution_2.2>", "\n<execution_2.3>"]
    assert branches[1]["stop"] == [["</execution_2.1>"], ["</execution_2.2>"], ["</execution_2.3>"]]
    assert branches[1]["context"] == QUERY + DRUG_PLANNER[0] + "\n<execution_1.1>" + DRUG_EXECUTORS[1, 1] + DRUG_PLANNER[1]
    # sync prefilled only the openings and executions, in prompt order
    syncs = [c["text"] for c in engine.calls if c["kind"] == "extend"]
    assert syncs[1] == "".join(f"\n<execution_2.{j}>" + DRUG_EXECUTORS[2, j] for j in (1, 2, 3))
    planner_calls = [c for c in engine.calls if c["kind"] == "generate"]
    assert planner_calls[3]["context"] == QUERY + fmt.render_completion(
        dataclasses.replace(DRUG_TRAJECTORY, final_answer=None))
    assert planner_calls[0]["stop"] == fmt.planner_stop_strings(1)
    assert len({c["seed"] for c in planner_calls + branches}) == len(planner_calls + branches)
    assert events[0] == ("start", None) and events[-1] == ("end", None)
    assert ("executors", 2) in events and ("sync", 2) in events and ("final", None) in events
    json.dumps(rec.to_json())


def test_serial_mode_gives_the_same_record_as_parallel():
    par = run_query(drug_engine(), QUERY, "parallel")
    eng = drug_engine()
    ser = run_query(eng, QUERY, "serial")
    assert [c["mode"] for c in eng.calls if c["kind"] == "branches"] == ["serial"] * 3
    a, b = _untimed(par), _untimed(ser)
    a.pop("mode"), b.pop("mode")
    assert a == b


def test_sequential_mode_counts_generated_tokens():
    text = "Think about it. <Final Answer> 7 </Final Answer>"     # 6 words/tags + 5 spaces = 11 tokens
    engine = ScriptedEngine([text + " trailing"])
    rec = run_query(engine, "Q", "sequential")
    assert rec.termination == "final_answer" and rec.final_answer == "7"
    assert rec.sequential_tokens == rec.total_tokens == 11 == engine.generated
    assert rec.stages == [] and rec.format_valid and rec.text == text
    assert engine.calls[1]["stop"] == [fmt.FINAL_CLOSE]
    # a SPRINT model run as an ordinary model: one call, its stages are not orchestrated
    engine = drug_engine()
    engine.planner = ["".join([DRUG_PLANNER[0], "\n<execution_1.1>", DRUG_EXECUTORS[1, 1], DRUG_PLANNER[3]])]
    rec = run_query(engine, QUERY, "sequential")
    assert rec.sequential_tokens == rec.total_tokens == 27 + 2 + 14 + 10   # the opening is newline + tag
    assert rec.final_answer == "A quinazoline lead." and rec.problems == []
    assert [c["kind"] for c in engine.calls] == ["prefill", "generate"]
    # no answer within the budget
    rec = run_query(ScriptedEngine(["a b c d e f"]), "Q", "sequential", OrchestratorConfig(max_total_tokens=4))
    assert rec.termination == "token_budget" and rec.total_tokens == 4 and not rec.format_valid


# ---------------------------------------------------------------------------------------------
# Policies for malformed output and budgets
# ---------------------------------------------------------------------------------------------
def test_truncated_and_eos_executions_are_closed_by_the_orchestrator():
    planner = ["<Plan_1> <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> </Plan_1>",
               "\n<Final Answer> 1 </Final Answer>"]
    engine = ScriptedEngine(planner, {(1, 1): " one two three four five six", (1, 2): " x<eos>"})
    rec = run_query(engine, "Q", "parallel", OrchestratorConfig(max_branch_tokens=5, layout="trie"))
    ex = rec.stages[0].executions
    assert [e.stop_reason for e in ex] == ["length", "eos"]
    assert [e.tokens for e in ex] == [5, 3]            # the EOS was decoded, so it counts
    assert ex[0].repaired and ex[1].repaired and ex[1].text == " x"
    sync = [c["text"] for c in engine.calls if c["kind"] == "extend"][0]
    # 5 tokens end in a space, so the repair adds the tag alone; after " x" it adds " " + tag
    assert sync == "\n<execution_1.1> one two </execution_1.1>\n<execution_1.2> x </execution_1.2>"
    assert rec.termination == "final_answer" and rec.final_answer == "1"
    assert len(rec.problems) == 2 and not rec.format_valid
    assert "1.1 reached its 5-token limit" in rec.problems[0] and "1.2 ended (EOS)" in rec.problems[1]
    assert rec.sequential_tokens == rec.stages[0].planner_tokens + 5 + rec.final_tokens


def test_more_prompts_than_branches_runs_the_first_ones():
    planner = ["<Plan_1> " + " ".join(f"<prompt_1.{j}> p{j} </prompt_1.{j}>" for j in range(1, 5)) + " </Plan_1>",
               "\n<Final Answer> 1 </Final Answer>"]
    execs = {(1, j): f" e{j} </execution_1.{j}>" for j in range(1, 5)}
    engine = ScriptedEngine(planner, execs, max_branches=3)
    rec = run_query(engine, "Q", "parallel", OrchestratorConfig(max_prompts=8))
    assert len(rec.stages[0].prompts) == 4 and len(rec.stages[0].executions) == 3
    assert "only the first 3 run" in rec.problems[0]
    assert any("has no <execution_1.4>" in p for p in rec.problems)
    assert rec.termination == "final_answer"


def test_prompts_out_of_order_are_numbered_by_position():
    planner = ["<Plan_1> <prompt_1.2> b </prompt_1.2> <prompt_1.2> c </prompt_1.2> </Plan_1>",
               "\n<Final Answer> 1 </Final Answer>"]
    engine = ScriptedEngine(planner, {(1, 1): " B </execution_1.1>", (1, 2): " C </execution_1.2>"})
    rec = run_query(engine, "Q", "parallel")
    assert rec.stages[0].prompts == ["b", "c"]
    assert [e.text for e in rec.stages[0].executions] == [" B </execution_1.1>", " C </execution_1.2>"]
    assert any("out of order" in p for p in rec.stages[0].problems)
    assert rec.termination == "final_answer" and not rec.format_valid


def test_prompt_less_plans_plan_only_and_implicit_execution():
    planner = ["<Plan_1> Just think. </Plan_1>",                    # plan-only: the planner keeps the turn
               "\n<Plan_2> Compute 2+2. </Plan_2>",                 # prompt-less with an implicit execution
               "\n<execution_2.1> 4 </execution_2.1>",
               "\n<Final Answer> 4 </Final Answer>"]
    engine = ScriptedEngine(planner)
    rec = run_query(engine, "Q", "parallel")
    assert rec.termination == "final_answer" and rec.problems == [] and rec.format_valid
    assert [len(s.executions) for s in rec.stages] == [0, 1]
    assert rec.stages[1].executor_mode == "inline" and rec.stages[1].executions[0].tokens == 6
    assert not [c for c in engine.calls if c["kind"] in ("branches", "extend")]
    gen = [c for c in engine.calls if c["kind"] == "generate"]
    assert gen[1]["stop"] == fmt.planner_stop_strings(2) + [fmt.execution_close(1, 1)]
    assert gen[2]["stop"] == fmt.planner_stop_strings(3) + [fmt.execution_close(2, 1)]
    assert rec.sequential_tokens == rec.total_tokens == engine.generated
    assert rec.text == "".join(planner)
    parsed, problems = fmt.parse_completion(rec.text)
    assert problems == [] and rec.text == fmt.render_completion(parsed)


@pytest.mark.parametrize("planner, termination", [
    (["<Plan_1> I will never close"], "eos"),
    (["<Plan_1> " + "word " * 50], "planner_token_limit"),
    (["</execution_1.1>"], "eos"),                   # not a stop here: the script then ends
    (["<Plan_1> think </Plan_1>", "\n<Plan_2> x </execution_1.1>"], "malformed"),
    (["</Final Answer>"], "malformed"),
    ([], "eos"),
])
def test_planner_failures_end_the_run_with_a_reason(planner, termination):
    rec = run_query(ScriptedEngine(planner), "Q", "parallel", OrchestratorConfig(max_planner_tokens=20))
    assert rec.termination == termination and rec.problems and not rec.format_valid
    assert rec.total_tokens == rec.sequential_tokens <= 20


def test_budgets_end_runs():
    # max_stages: plan 2 is written but not run
    rec = run_query(drug_engine(), QUERY, "parallel", OrchestratorConfig(max_stages=1))
    assert rec.termination == "max_stages" and len(rec.stages) == 2 and rec.stages[1].executions == []
    # total budget: executors share what is left; the next planner call has nothing left
    engine = drug_engine()
    rec = run_query(engine, QUERY, "parallel", OrchestratorConfig(max_total_tokens=27 + 14 + 38 + 6))
    limits = [c["limits"] for c in engine.calls if c["kind"] == "branches"]
    assert limits == [[58], [2, 2, 2]]     # 85 - 27 = 58 for stage 1; 85 - 79 = 6 shared by 3 branches
    assert rec.termination == "token_budget" and rec.total_tokens == 27 + 14 + 38 + 6 == engine.generated
    # context full: the engine's max_seq_len bounds the planner
    rec = run_query(drug_engine(max_seq_len=60), QUERY, "parallel")
    assert rec.termination == "context_full"
    # wall clock (checked between calls)
    rec = run_query(drug_engine(), QUERY, "parallel", OrchestratorConfig(time_limit_s=1e-9))
    assert rec.termination == "wall_clock" and rec.total_tokens == 0
    # a query longer than the context
    rec = run_query(drug_engine(max_seq_len=5), QUERY, "parallel")
    assert rec.termination == "context_full" and rec.text == ""


def test_config_loads_and_rejects_bad_values():
    cfg = load_config(OrchestratorConfig, overrides=["max_stages=3", "temperature=0.7", "time_limit_s=2.5"])
    assert cfg.max_stages == 3 and cfg.sampling(1).temperature == 0.7
    with pytest.raises(ConfigError, match="max_prompts"):
        load_config(OrchestratorConfig, overrides=["max_prompts=0"])
    with pytest.raises(ConfigError, match="top_p"):
        load_config(OrchestratorConfig, overrides=["top_p=0"])
    with pytest.raises(ValueError, match="mode"):
        run_query(drug_engine(), QUERY, "batched")


@pytest.mark.parametrize("layout", ["trie", "flat"])
def test_text_events_commit_the_completion_in_order_with_each_executors_index(layout):
    pieces = []
    rec = run_query(drug_engine(), QUERY, "parallel", OrchestratorConfig(layout=layout),
                    on_event=lambda e: pieces.append((e.text, e.stage.index, e.executor)) if e.kind == "text" else None)
    committed = "".join(t for t, _, _ in pieces)
    # the reference: the planner's context, decoded once at the end (record.text); what follows
    # the committed pieces is the last planner call's output
    assert committed + rec.final_text == rec.text
    assert [(t, i, j) for t, i, j in pieces if j is not None] == [
        (f"\n<execution_{i}.{j}>" + DRUG_EXECUTORS[i, j], i, j) for i, j in sorted(DRUG_EXECUTORS)]


def test_forced_text_the_tokenizer_cannot_encode_ends_the_run_as_malformed():
    """A planner that writes more prompts than the tokenizer has execution tags for (a sampled
    demo model): the third opening cannot be encoded. The run ends with a reason, never raises."""
    engine = drug_engine()
    encode = engine.encode

    def small_vocabulary(text: str) -> list[int]:
        if "<execution_2.3>" in text:
            raise ValueError("character '<' at offset 1 is not in the tokenizer's vocabulary")
        return encode(text)

    engine.encode = small_vocabulary
    rec = run_query(engine, QUERY, "parallel", TRIE)
    assert rec.termination == "malformed" and [s.index for s in rec.stages] == [1, 2]
    assert any("cannot encode '\\n<execution_2.3>'" in p for p in rec.problems), rec.problems
    assert rec.stages[1].executions == [] and rec.text.endswith("</Plan_2>")


def test_forced_text_is_the_canonical_whitespace():
    """The forced opening is what the canonical format puts before an execution's content (one
    newline between blocks, one space inside: docs/design.md "The SPRINT format"; test_format
    checks render against the same literal text)."""
    assert execution_opening(2, 3) == "\n<execution_2.3>"
    assert (fmt.BLOCK_GAP, fmt.CLOSE_GAP) == ("\n", " ")


# ---------------------------------------------------------------------------------------------
# Fuzz: random and truncated outputs never crash or hang and always end with a reason
# ---------------------------------------------------------------------------------------------
_WORDS = ["a", "b", "42", " ", " ", "\n", "<", ">", "<eos>"]


def _tags(max_i: int = 3, max_j: int = 3) -> st.SearchStrategy[str]:
    i, j = st.integers(1, max_i), st.integers(1, max_j)
    return st.one_of(
        st.builds(fmt.plan_open, i), st.builds(fmt.plan_close, i), st.builds(fmt.prompt_open, i, j),
        st.builds(fmt.prompt_close, i, j), st.builds(fmt.execution_open, i, j),
        st.builds(fmt.execution_close, i, j), st.just(fmt.FINAL_OPEN), st.just(fmt.FINAL_CLOSE))


_piece = st.one_of(_tags(), st.sampled_from(_WORDS))
_text = st.lists(_piece, max_size=25).map("".join)


@st.composite
def _well_formed_prefix(draw) -> str:
    """A canonical trajectory text cut at a random point (a truncated good output)."""
    n_stages = draw(st.integers(1, 3))
    stages = []
    for i in range(1, n_stages + 1):
        k = draw(st.integers(0, 3))
        stages.append(fmt.Stage(i, ["plan"] + [fmt.Prompt(f"p{j}") for j in range(k)], [f"e{j}" for j in range(k)]))
    text = fmt.render_completion(fmt.Trajectory(stages=stages, final_answer="x"))
    return text[: draw(st.integers(0, len(text)))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner=st.lists(st.one_of(_text, _well_formed_prefix()), max_size=6),
       executors=st.dictionaries(st.tuples(st.integers(1, 3), st.integers(1, 3)), st.one_of(_text, _well_formed_prefix()),
                                 max_size=6),
       mode=st.sampled_from(["parallel", "serial", "sequential"]), layout=st.sampled_from(["flat", "trie"]),
       budgets=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 30), st.integers(1, 30),
                         st.integers(1, 120)),
       capacity=st.tuples(st.integers(8, 200), st.integers(1, 4), st.integers(2, 40)))
def test_fuzz_never_crashes_and_always_terminates(planner, executors, mode, layout, budgets, capacity):
    stages, prompts, ptok, btok, total = budgets
    engine = ScriptedEngine(planner, executors, max_seq_len=capacity[0], max_branches=capacity[1],
                            max_branch_tokens=capacity[2])
    cfg = OrchestratorConfig(max_stages=stages, max_prompts=prompts, max_planner_tokens=ptok,
                             max_branch_tokens=btok, max_total_tokens=total, layout=layout)
    rec = run_query(engine, "Query text", mode, cfg)
    assert rec.termination in TERMINATIONS and rec.termination != "engine_error", rec.problems
    assert rec.total_tokens == engine.generated <= total
    assert rec.sequential_tokens <= rec.total_tokens
    assert len(rec.stages) <= stages + 1 + len(planner)
    if rec.termination != "final_answer":
        assert not rec.format_valid
    if mode == "sequential":
        assert rec.sequential_tokens == rec.total_tokens
    json.dumps(rec.to_json())


# ---------------------------------------------------------------------------------------------
# The real engine on a tiny real checkpoint
# ---------------------------------------------------------------------------------------------
class ForcedPlanner:
    """The real engine, except that scripted planner calls are forced (prefilled with extend and
    returned as a Generation): a random model never writes tags, so this makes it run stages.
    Executors are decoded by the real engine; unscripted planner calls are real too."""

    def __init__(self, engine, scripts: Sequence[str], spell: Sequence[str] = ()):
        self.engine = engine
        self.scripts = list(scripts)
        self.spell = list(spell)           # strings the "model" writes one character per token
        self.contexts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _encode(self, text: str) -> list[int]:
        for word in self.spell:
            if word in text:
                a, b = text.split(word, 1)
                return self._encode(a) + [t for ch in word for t in self.engine.encode(ch)] + self._encode(b)
        return self.engine.encode(text)

    def generate(self, state, max_new_tokens, stop=(), sampling=None, tag=None):
        self.contexts.append(list(state.tokens))
        if not self.scripts:
            return self.engine.generate(state, max_new_tokens, stop, sampling)
        ids = self._encode(self.scripts.pop(0))[:max_new_tokens]
        self.engine.extend(state, ids)
        text = self.engine.decode_text(ids)
        return Done("generate", state, Generation(ids, text, "stop" if any(s in text for s in stop) else "length"))


@pytest.fixture
def real_engine(engine_224, alone_224):
    """The shared engine (runs) and single-run calls on it (references): two sequence slots."""
    return engine_224, alone_224


REAL_QUERY = "Q: 2+3=?"
REAL_PLANNER = ["<Plan_1> split <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> </Plan_1>",
                "\n<Final Answer> 5 </Final Answer>"]


def test_real_engine_parallel_equals_serial_and_counts_match_an_independent_decode(real_engine):
    real_engine, alone = real_engine
    cfg = OrchestratorConfig(max_branch_tokens=9)
    par = run_query(ForcedPlanner(real_engine, REAL_PLANNER), REAL_QUERY, "parallel", cfg)
    ser = run_query(ForcedPlanner(real_engine, REAL_PLANNER), REAL_QUERY, "serial", cfg)
    assert par.termination == ser.termination == "final_answer"
    assert [s.executor_mode for s in par.stages] == ["shared"] and [s.executor_mode for s in ser.stages] == ["serial"]
    a, b = _untimed(par), _untimed(ser)
    a.pop("mode"), b.pop("mode")
    assert a == b
    # reference: each executor decoded alone from a fresh prefill of its full context
    context = real_engine.encode(REAL_QUERY + REAL_PLANNER[0])
    for j, ex in enumerate(par.stages[0].executions, start=1):
        opening = real_engine.encode(execution_opening(1, j))
        ref = alone.generate(alone.prefill(context + opening), 9, stop=[fmt.execution_close(1, j)])
        assert ex.text == ref.text and ex.tokens == len(ref.tokens) and ex.stop_reason == ref.stop_reason
        assert ex.forced_tokens == len(opening) + (len(real_engine.encode(" " + fmt.execution_close(1, j)))
                                                   if ex.repaired else 0)
    planner_tokens = [len(real_engine.encode(t)) for t in REAL_PLANNER]
    assert par.sequential_tokens == planner_tokens[0] + max(e.tokens for e in par.stages[0].executions) + planner_tokens[1]
    assert par.total_tokens == sum(planner_tokens) + sum(e.tokens for e in par.stages[0].executions)
    # flat (the default layout): the sync also prefills the block gap that follows the last execution
    assert par.stages[0].sync_tokens == sum(e.forced_tokens + e.tokens for e in par.stages[0].executions) + \
        len(real_engine.encode(fmt.BLOCK_GAP))


@pytest.mark.parametrize("mode", ["parallel", "serial"])
def test_real_engine_rolls_back_to_the_layout_tokens_at_fork_and_sync(real_engine, mode):
    """The planner writes `<t5>` as four character tokens where the tokenizer has one token: the
    fork rolls the real engine's state back to before it, every executor starts from the flat
    tokenization of its context (checked against a decode alone from a fresh prefill of exactly
    that), and the planner holds the flat tokenization after the sync."""
    real_engine, alone = real_engine
    planner = ["<Plan_1> <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> see <t5> </Plan_1>",
               "<Final Answer> 5 </Final Answer>"]
    forced = ForcedPlanner(real_engine, planner, spell=["<t5>"])
    assert len(forced._encode(planner[0])) == len(real_engine.encode(planner[0])) + 3
    rec = run_query(forced, REAL_QUERY, mode, OrchestratorConfig(max_branch_tokens=6, layout="flat"))
    assert rec.termination == "final_answer" and rec.final_answer == "5"
    enc = real_engine.encode
    for j, ex in enumerate(rec.stages[0].executions, start=1):
        context = enc(REAL_QUERY) + enc(planner[0] + execution_opening(1, j))
        ref = alone.generate(alone.prefill(context), 6, stop=[fmt.execution_close(1, j)])
        assert ex.tokens == len(ref.tokens) and ex.text == ref.text[:len(ex.text)]
    after_sync = forced.contexts[1]
    assert after_sync == enc(REAL_QUERY) + enc(real_engine.decode_text(after_sync[len(enc(REAL_QUERY)):]))
    assert real_engine.decode_text(after_sync).endswith(fmt.BLOCK_GAP)


def test_real_engine_truncate_then_extend_equals_a_fresh_prefill(real_engine):
    """The orchestrator's roll-back at a token boundary: keep a prefix, prefill a different tail;
    the next-token logits are those of a fresh prefill of the same tokens."""
    _, alone = real_engine
    ids = alone.encode(REAL_QUERY + REAL_PLANNER[0])
    state = alone.prefill(ids)
    alone.truncate(state, len(ids) - 5)
    tail = alone.encode(" x y")
    alone.extend(state, tail)
    got = alone.step_logits(state)
    with pytest.raises(EngineError, match="truncate"):
        alone.truncate(state, 0)
    ref = alone.prefill(ids[:-5] + tail)
    assert state.tokens == ref.tokens
    np.testing.assert_allclose(got, alone.step_logits(ref), rtol=1e-5, atol=1e-5)


def test_real_engine_unscripted_planner_ends_on_its_budget(real_engine):
    real_engine, alone = real_engine
    cfg = OrchestratorConfig(max_planner_tokens=12)
    rec = run_query(real_engine, REAL_QUERY, "parallel", cfg)
    ref = alone.generate(alone.prefill(alone.encode(REAL_QUERY)), 12, stop=fmt.planner_stop_strings(1))
    assert rec.termination == "planner_token_limit"
    assert rec.stages[0].planner_text == ref.text == rec.text and rec.total_tokens == len(ref.tokens) == 12
    seq = run_query(real_engine, REAL_QUERY, "sequential", OrchestratorConfig(max_total_tokens=12))
    assert seq.termination == "token_budget" and seq.text == ref.text
    assert seq.sequential_tokens == seq.total_tokens == 12
