"""report.json's `engine_pool`: the KV pool of the engine an eval ran on and what its runs took from
the prefix cache, on the tiny real checkpoint (a character-level tokenizer: a string's tokens are
its characters). Reference: the cache hits derived by hand from the prompts' token ids (whole
pages of the prefix each prompt shares with an earlier run's tokens), per invocation, and summed
over the shards of `eval merge`."""
from __future__ import annotations

import json

import pytest

from conftest import tiny_vocab_tokenizer
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.eval.shards import merge_shards, shard_meta
from sprint_jax.infer import Engine
from sprint_jax.infer.orchestrator import OrchestratorConfig
from sprint_jax.model import from_pretrained
from sprint_jax.tasks.types import Task

PAGE = 16
CAPS = dict(max_seqs=2, max_children=2, max_seq_len=512, max_branch_tokens=16, decode_chunk=4, prefill_chunk=64,
            eos_token_ids=[], page_size=PAGE)
CFG = OrchestratorConfig(max_planner_tokens=10, max_branch_tokens=8, max_total_tokens=16)
INSTR = "Solve the problem below; put the final answer in a box and show each step of the work. " * 2
# the problems differ in their first character: what two prompts share is the instruction
TASKS = [Task("a", "math", "Alpha: what is 2+2?", "4"), Task("b", "math", "Beta: what is 3+3?", "6"),
         Task("c", "math", "Gamma: 1+1?", "2")]


def _prompt(task: Task) -> str:
    return INSTR + task.problem


@pytest.fixture(scope="module")
def model_tok(hf_untied):
    return from_pretrained(hf_untied), tiny_vocab_tokenizer()


def test_eval_reports_the_pool_and_the_prefix_tokens_its_runs_took_from_the_cache(model_tok, tmp_path):
    model, tok = model_tok
    engine = Engine(model, tok, **CAPS)
    n_instr = len(tok.encode(INSTR))
    assert n_instr == len(INSTR) == 174
    lens = [len(tok.encode(_prompt(t))) for t in TASKS]
    # one run at a time: run 1 misses; runs 2 and 3 share the instruction with the runs before them,
    # 174 tokens: 10 whole pages (160 tokens)
    _, report = evaluate(engine, TASKS, "sequential", prompt_fn=_prompt, orchestrator_config=CFG,
                         out_dir=tmp_path / "first", progress=False, concurrency=1)
    pool = report["engine_pool"]
    assert pool["page_size"] == PAGE and pool["prompt_tokens"] == sum(lens)
    assert pool["prefix_hit_tokens"] == 2 * (n_instr // PAGE * PAGE) == 320
    assert pool["prompt_tokens_prefilled"] == sum(lens) - 320 and pool["evicted_pages"] == 0
    assert pool["pages_used"] == 0 and pool["pages_free"] + pool["pages_cached"] == pool["pages_total"]
    on_disk = json.loads((tmp_path / "first" / "report.json").read_text())
    assert on_disk["engine_pool"] == pool
    # the same prompts again on the same engine: each run finds its whole prompt cached (less the
    # last token, always run); the figures are this invocation's
    _, again = evaluate(engine, TASKS, "sequential", prompt_fn=_prompt, orchestrator_config=CFG,
                        out_dir=tmp_path / "again", progress=False, concurrency=1)
    assert again["engine_pool"]["prefix_hit_tokens"] == sum((n - 1) // PAGE * PAGE for n in lens)
    assert again["engine_pool"]["prompt_tokens"] == sum(lens)


def test_eval_merge_sums_the_shards_pool_counts(model_tok, tmp_path):
    model, tok = model_tok
    n_instr = len(tok.encode(INSTR))
    for i in range(2):                        # each shard on an engine of its own, as on two hosts
        sh = shard_meta(len(TASKS), i, 2)
        evaluate(Engine(model, tok, **CAPS), [TASKS[k] for k in sh["positions"]], "sequential", prompt_fn=_prompt,
                 orchestrator_config=CFG, out_dir=tmp_path / f"s{i}", progress=False, concurrency=1,
                 meta={"shard": sh})
    report = merge_shards([tmp_path / "s0", tmp_path / "s1"], tmp_path / "merged")
    pool = report["engine_pool"]
    # shard 0 runs a then c (c hits the instruction's 10 pages), shard 1 runs b alone (a miss)
    assert [s["prefix_hit_tokens"] for s in pool["shards"]] == [n_instr // PAGE * PAGE, 0]
    assert pool["prefix_hit_tokens"] == 160 and pool["evicted_pages"] == 0
    assert pool["prompt_tokens"] == sum(len(tok.encode(_prompt(t))) for t in TASKS)
