"""The orchestrator as a generator: runs advanced alone (concurrency 1) and many at once, in any
interleaving, give identical RunRecords (timings aside), on scripted planners and on the real
tiny checkpoint."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sprint_jax.infer.requests import EngineError
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunRecord, run_many
from test_orchestrator import DRUG_EXECUTORS, DRUG_PLANNER, ScriptedEngine, WordTokenizer

TIMINGS = ("wall_s", "planner_s", "executors_s", "sync_s", "final_s", "branch_cache_bytes")


def _untimed(record: RunRecord) -> dict:
    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in TIMINGS}
        if isinstance(d, list):
            return [strip(v) for v in d]
        return d
    return strip(record.to_json())


@dataclasses.dataclass
class _Op:
    kind: str
    seq: object
    run: object                        # the scripted call, made when the countdown ends
    wait: int
    done: bool = False
    result: object = None


class ScriptedBatch:
    """The Engine interface over one ScriptedEngine per sequence (its script chosen by the query
    text): each operation completes after a random number of steps, so runs interleave in every
    order. Validation errors are raised at submit time, as Engine does."""

    def __init__(self, scripts: dict[str, tuple[list[str], dict]], seed: int = 0, **caps):
        self.tokenizer = WordTokenizer()
        self.scripts = scripts
        self.caps = caps
        probe = ScriptedEngine(**caps)
        self.max_seq_len, self.max_branch_tokens = probe.max_seq_len, probe.max_branch_tokens
        self.max_branches = self.max_seqs = probe.max_branches
        self.rng = np.random.default_rng(seed)
        self.ops: list[_Op] = []
        self.engines: dict[int, ScriptedEngine] = {}

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode_text(self, ids):
        return self.tokenizer.decode(ids)

    def _op(self, kind, seq, run):
        op = _Op(kind, seq, run, int(self.rng.integers(0, 4)))
        self.ops.append(op)
        return op

    def _engine(self, seq) -> ScriptedEngine:
        return self.engines[id(seq)]

    def open(self, tokens):
        planner, executors = self.scripts[self.decode_text(tokens)]
        eng = ScriptedEngine(list(planner), dict(executors), **self.caps)
        eng.tokenizer = self.tokenizer
        state = eng.open(tokens).result
        self.engines[id(state)] = eng
        return self._op("open", state, lambda: state)

    def generate(self, seq, limit, stop, sampling):
        eng = self._engine(seq)
        if len(seq.tokens) + limit > eng.max_seq_len:
            raise EngineError("generate would exceed max_seq_len")
        return self._op("generate", seq, lambda: eng.generate(seq, limit, stop, sampling).result)

    def fork(self, seq, prefixes, limits, stops, sampling, **kw):
        eng = self._engine(seq)
        return self._op("fork", seq, lambda: eng.fork(seq, prefixes, limits, stops, sampling, **kw).result)

    def extend(self, seq, tokens):
        eng = self._engine(seq)
        return self._op("extend", seq, lambda: eng.extend(seq, tokens).result)

    def truncate(self, seq, n):
        return self._engine(seq).truncate(seq, n)

    def close(self, seq):
        seq.closed = True

    def step(self):
        for op in list(self.ops):
            if op.wait > 0:
                op.wait -= 1
                continue
            op.result, op.done = op.run(), True
            self.ops.remove(op)

    def step_or_raise(self):                 # run_many's step (the engine's raises when stuck)
        self.step()


def _variant(k: int):
    """The drug-discovery script with run-specific words, and a few runs that go wrong."""
    planner = [p.replace("binding site", f"site {k}") for p in DRUG_PLANNER]
    executors = {key: v.replace("Lys33", f"Lys{k}") for key, v in DRUG_EXECUTORS.items()}
    if k % 4 == 1:
        planner = planner[:2]                                    # the planner then ends (EOS)
    if k % 4 == 2:
        executors[(2, 2)] = " runs on and on and on and on"      # closed by the orchestrator
    if k % 4 == 3:
        planner[1] = planner[1].replace("Screen", "Screen" + " x" * 40)   # the planner call runs out
    return planner, executors


@pytest.mark.parametrize("layout", ["flat", "trie"])
def test_scripted_runs_give_identical_records_in_any_interleaving(layout):
    scripts = {f"Q{k}: propose a lead.": _variant(k) for k in range(10)}
    cfg = OrchestratorConfig(layout=layout, max_planner_tokens=60, max_branch_tokens=40)
    alone = [Orchestrator(ScriptedEngine(*scripts[q]), cfg).run(q, "parallel") for q in scripts]
    for seed, concurrency in ((0, 1), (1, 3), (2, 10)):
        engine = ScriptedBatch(scripts, seed=seed)
        many = run_many(engine, list(scripts), "parallel", cfg, concurrency=concurrency)
        assert [_untimed(r) for r in many] == [_untimed(r) for r in alone], (seed, concurrency)
    assert {r.termination for r in alone} >= {"final_answer", "eos", "planner_token_limit"}


def test_real_checkpoint_runs_give_identical_records_alone_and_together(engine_96):
    single = batch = engine_96
    rng = np.random.default_rng(0)
    queries = ["".join(rng.choice(list("abcdefgh xyz")) for _ in range(int(n))) for n in rng.integers(3, 30, 5)]
    for mode in ("parallel", "serial", "sequential"):
        cfg = OrchestratorConfig(max_planner_tokens=10, max_total_tokens=14)
        alone = [Orchestrator(single, cfg).run(q, mode) for q in queries]
        many = run_many(batch, queries, mode, cfg, concurrency=3)
        assert [_untimed(r) for r in many] == [_untimed(r) for r in alone], mode
        assert all(r.total_tokens > 0 for r in many)
    assert batch.free_slots == 4 and not batch.busy
