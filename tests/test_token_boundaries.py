"""Token boundaries at fork and sync, with the real Qwen2 BPE, where `>\\n` is one
token. The engine is a stand-in for a model that learnt its training data exactly: shown a context
its layout trained on, it writes the trained continuation token for token; shown anything else,
it writes EOS. The references are train/data.py's own layouts of the same trajectory
(`layout_flat`, and `split_pieces` + `layout_trie` for the trie units), never the orchestrator."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import pytest

from sprint_jax import format as fmt
from sprint_jax.schema import Example
from sprint_jax.infer.requests import EngineError, Generation
from sprint_jax.infer.orchestrator import OrchestratorConfig, run_query
from sprint_jax.train import data as D

PROMPT = "What is 17 + 25 + 8 + 9?\n"
TRAJ = fmt.Trajectory(stages=[
    fmt.Stage(1, ["Two independent sums.", fmt.Prompt("Add 17 and 25."), fmt.Prompt("Add 8 and 9.")],
              ["17 + 25 = 42.", "8 + 9 = 17."]),
    fmt.Stage(2, ["Both parts are known."]),                       # plan-only: the planner keeps the turn
    fmt.Stage(3, ["Combine them.", fmt.Prompt("Add 42 and 17.")], ["42 + 17 = 59."]),
], final_answer="59")
COMPLETION = fmt.render_completion(TRAJ)
WEIGHTS = {k: 1.0 for k in fmt.SPAN_KINDS}


@pytest.fixture(scope="module")
def tok():
    from sprint_jax.model.tokenizer import qwen2_tokenizer
    return qwen2_tokenizer()


def _encode(tok, text: str) -> list[int]:
    return D.encode_with_offsets(tok, text)[0]


@dataclasses.dataclass
class State:
    tokens: list[int]
    closed: bool = False


@dataclasses.dataclass
class Done:
    """An engine operation finished when it was submitted."""
    kind: str
    seq: State
    result: object
    done: bool = True


class TrainedModel:
    """The engine interface over `continue_from(context) -> tokens or None` (None: a context the
    model never saw). `closing` rewrites how the model writes the last token of a stop string:
    "as_trained", "bare" (`>` alone where training had `>\\n`, after a plan with prompts or an
    execution) or "with_newline" (`>\\n` where training had `>`), so the orchestrator must mend
    both kinds of boundary. The final answer is always written as trained."""

    def __init__(self, tok, continue_from: Callable[[list[int]], list[int] | None], closing: str = "as_trained"):
        self.tokenizer = tok
        self.continue_from = continue_from
        self.closing = closing
        self.max_seq_len, self.max_branches, self.max_branch_tokens, self.max_seqs = 4096, 8, 512, 1
        self.eos = tok.eos_token_id
        self.contexts: list[tuple[str, list[int]]] = []     # ("planner" | "executor", tokens) per call
        self.unseen: list[str] = []                          # contexts the model never saw

    def encode(self, text: str) -> list[int]:
        return _encode(self.tokenizer, text)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def open(self, ids, tag=None):
        state = State(list(ids))
        return Done("open", state, state)

    def extend(self, state, ids, tag=None):
        state.tokens = state.tokens + list(ids)
        return Done("extend", state, state)

    def close(self, state):
        state.closed = True

    def truncate(self, state, n):
        if not 1 <= n <= len(state.tokens):
            raise EngineError(f"truncate to {n} of {len(state.tokens)}")
        state.tokens = state.tokens[:n]
        return state

    def _write(self, context: list[int], limit: int, stops: Sequence[str], executor: bool) -> Generation:
        cont = self.continue_from(context)
        if cont is None:
            self.unseen.append(self.decode_text(context)[-60:])
            cont = [self.eos]
        out: list[int] = []
        for t in cont[:limit]:
            out.append(t)
            if t == self.eos:
                return Generation(out, self.decode_text(out), "eos")
            text = self.decode_text(out)
            hit = [s for s in stops if s in text]
            if hit:
                forced_next = executor or any(st.prompts for st in fmt.parse_completion(text)[0].stages)
                if hit[0] != fmt.FINAL_CLOSE and (forced_next or self.closing != "bare"):
                    out = out[:-1] + self._closing(self.decode_text([t]))
                return Generation(out, self.decode_text(out), "stop")
        return Generation(out, self.decode_text(out), "length")

    def _closing(self, last: str) -> list[int]:
        if self.closing == "bare" and last.endswith(">\n"):
            return self.encode(last[:-1])
        if self.closing == "with_newline" and last.endswith(">"):
            return self.encode(last + "\n")
        return self.encode(last)

    def generate(self, state, max_new_tokens, stop=(), sampling=None, tag=None):
        self.contexts.append(("planner", list(state.tokens)))
        g = self._write(list(state.tokens), max_new_tokens, stop, False)
        state.tokens = state.tokens + g.tokens
        return Done("generate", state, g)

    def fork(self, state, prefixes, max_new_tokens, stop=(), sampling=None, tag=None, serial=False, join=False):
        limits = [max_new_tokens] * len(prefixes) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        gens = []
        for p, m, st in zip(prefixes, limits, stop):
            context = list(state.tokens) + list(p)
            self.contexts.append(("executor", context))
            gens.append(self._write(context, m, st, True))
        return Done("fork", state, gens)


def _flat_documents(tok) -> list[list[int]]:
    """What the flat layout trains: the whole example as one chain (train/data.py layout_flat), and
    with that stage cut after `</Plan_i>` + its own execution: the context it runs with."""
    ex = Example("t", "sprint", PROMPT, COMPLETION)
    docs = [D.layout_flat(tok, ex, WEIGHTS).tokens.tolist()]
    for stage in TRAJ.stages:
        i = stage.index
        upto = COMPLETION[:COMPLETION.index(fmt.plan_close(i)) + len(fmt.plan_close(i))]
        for j, e in enumerate(stage.executions[1:], start=2):
            text = (upto + fmt.BLOCK_GAP + fmt.execution_open(i, j) + fmt.CLOSE_GAP + e + fmt.CLOSE_GAP
                    + fmt.execution_close(i, j) + fmt.BLOCK_GAP + "<")
            docs.append(D.layout_flat(tok, Example("t", "sprint", PROMPT, text), WEIGHTS).tokens.tolist()[:-1])
    return docs


def _trie_units(tok) -> tuple[list[tuple[str, list[int], list[int]]], np.ndarray]:
    """(kind, context tokens, completion tokens) of every unit, from train/data.py's pieces, and the
    trie item train/data.py builds from them."""
    ex = Example("t", "sprint", PROMPT, COMPLETION)
    pieces = D.split_pieces(PROMPT, COMPLETION, TRAJ)
    ptoks = [_encode(tok, t) for t in pieces.texts]
    units = [(kind, [t for i in path[:-1] for t in ptoks[i]], ptoks[path[-1]])
             for kind, path in zip(pieces.unit_kinds, pieces.units)]
    units[-1][2].append(tok.eos_token_id)
    return units, D.layout_trie(tok, ex, pieces, WEIGHTS)


def _chain(item, row: int) -> list[int]:
    """The tokens a trie row attends to: its ancestors (the parents chain) and itself."""
    out = []
    while row >= 0:
        out.append(int(item.tokens[row]))
        row = int(item.parents[row])
    return out[::-1]


def test_reference_trie_units_are_the_trained_trie(tok):
    """The unit contexts used below are the ancestor chains train/data.py's trie layout trains."""
    units, item = _trie_units(tok)
    chains = {tuple(_chain(item, r)) for r in range(len(item))}
    for _, context, completion in units:
        assert tuple(context + completion) in chains


@pytest.mark.parametrize("closing", ["as_trained", "bare"])
def test_flat_contexts_are_prefixes_of_the_flat_tokenization(tok, closing):
    docs = _flat_documents(tok)
    full = docs[0]
    gt = _encode(tok, "</Plan_1>\n<")
    assert tok.decode(gt[-2:]) == ">\n<"            # the boundary this is about: `>\n` is one token

    def continue_from(context):
        for d in docs:
            if d[:len(context)] == context and len(d) > len(context):
                return d[len(context):]
        return None

    model = TrainedModel(tok, continue_from, closing)
    rec = run_query(model, PROMPT, "parallel", OrchestratorConfig(layout="flat"))
    assert model.unseen == []
    assert rec.termination == "final_answer" and rec.final_answer == "59" and rec.problems == []
    assert rec.text == COMPLETION
    planner = [c for k, c in model.contexts if k == "planner"]
    executors = [c for k, c in model.contexts if k == "executor"]
    assert len(planner) == 4 and len(executors) == 3          # plans 1, 2, 3 and the answer
    for c in planner:                                          # after the prompt, every sync, plan 2
        assert c == full[:len(c)]
    # every executor context is the flat tokenization of its text, and ends at its forced opening
    for c, (i, j) in zip(executors, [(1, 1), (1, 2), (3, 1)]):
        assert any(c == d[:len(c)] for d in docs)
        assert tok.decode(c).endswith(fmt.execution_open(i, j))
    # the sync leaves the block gap in the planner: it ends on the one `>\n` token training had
    assert tok.decode(planner[1][-1:]) == ">\n" and tok.decode(planner[3][-1:]) == ">\n"


@pytest.mark.parametrize("closing", ["as_trained", "with_newline"])
def test_trie_contexts_are_the_unit_contexts(tok, closing):
    units, _ = _trie_units(tok)
    by_context = {tuple(c): comp for _, c, comp in units}
    model = TrainedModel(tok, lambda context: by_context.get(tuple(context)), closing)
    rec = run_query(model, PROMPT, "parallel", OrchestratorConfig(layout="trie"))
    assert model.unseen == []
    assert rec.termination == "final_answer" and rec.final_answer == "59" and rec.problems == []
    assert rec.text == COMPLETION
    # every call's context is its unit's context, in inference order
    assert [(k, c) for k, c in model.contexts] == [(k, c) for k, c, _ in units]
