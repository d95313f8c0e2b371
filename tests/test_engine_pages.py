"""The engine on the paged pool: prefixes reused across sequences (radix tree), forks nested to any
depth (`split`), admission and eviction by pages, against independent references (a plain full
forward, a cold prefill of the same tokens, hand-counted pages)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import greedy_by_full_forward, tiny_vocab_tokenizer
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.requests import EngineError
from sprint_jax.model.qwen2 import forward

CAPS = dict(max_children=4, max_seq_len=96, max_branch_tokens=40, decode_chunk=8, prefill_chunk=32,
            eos_token_ids=[])


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]


def _next_logits(model, tokens) -> np.ndarray:
    """The next token's logits by one plain causal forward (no cache)."""
    import jax.numpy as jnp
    return np.asarray(forward(model.params, model.config, jnp.asarray([tokens], jnp.int32)))[0, -1]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _open(engine, tokens):
    op = engine.open(tokens)
    engine.run([op])
    engine.flush(op.result)
    return op.result


def test_a_prefix_hit_prefills_only_the_rest_and_gives_the_cold_logits(model):
    """A sequence that starts with a closed sequence's tokens takes its full pages from the radix
    tree: only the rest is prefilled (prefix_hit_tokens counts whole pages), and the next token's
    logits equal a cold engine's and a plain forward's (fp32, 1e-5); the greedy tokens too."""
    tok = tiny_vocab_tokenizer()
    warm, cold = Engine(model, tok, max_seqs=2, **CAPS), Engine(model, tok, max_seqs=2, **CAPS)
    system = _ids(1, 37)                           # 2 whole pages of 16 + 5 tokens
    first = _open(warm, system + _ids(2, 6))
    first_ids = warm.page_ids(first)
    warm.close(first)
    assert warm.page_stats()["prefix_hit_tokens"] == 0
    prompt = system + _ids(3, 9)
    calls = warm.stats["prefill_calls"]
    seq = _open(warm, prompt)
    stats = warm.page_stats()
    assert stats["prefix_hit_tokens"] == 32 and seq.pages.length == len(prompt) - 1
    assert warm.page_ids(seq)[:2] == first_ids[:2]                       # the closed sequence's own pages
    assert warm.stats["prefill_calls"] == calls + 1                      # the 13 tokens after the hit
    got = warm.forced_logits(seq)[0]
    ref = cold.forced_logits(_open(cold, prompt))[0]
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, _next_logits(model, prompt), atol=1e-5, rtol=0)
    op = warm.generate(seq, 10)
    warm.run([op])
    assert op.result.tokens == greedy_by_full_forward(model, prompt, 10)
    # a prompt that is all cached still runs its last token (its logits are the request's)
    warm.close(seq)
    again = _open(warm, prompt[:33])
    assert warm.page_stats()["prefix_hit_tokens"] == 32 + 32 and again.pages.length == 32
    np.testing.assert_allclose(warm.forced_logits(again)[0], _next_logits(model, prompt[:33]), atol=1e-5, rtol=0)
    warm.close(again)


def test_split_nests_forks_three_levels_deep_each_branch_as_alone(model):
    """split() gives sequences that share their parent's pages; splitting a split and forking
    there is a fork three levels deep: every branch's greedy tokens equal a plain forward of that
    branch alone. Level one shares the root's full pages in place (the same page ids); the partly
    filled page is copied on first write (a new id)."""
    engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=6, **CAPS)
    root_toks = _ids(10, 21)                         # 20 written: one full page + 4 tokens
    root = _open(engine, root_toks)
    a, b = engine.split(root, 2)
    assert engine.page_ids(a) == engine.page_ids(b) == engine.page_ids(root)[:2]
    ext = {id(a): _ids(11, 5), id(b): _ids(12, 19)}
    for s in (a, b):
        engine.extend(s, ext[id(s)])
    engine.run()
    for s in (a, b):
        engine.flush(s)
    assert engine.page_ids(a)[0] == engine.page_ids(root)[0] != engine.page_ids(b)[1] != engine.page_ids(a)[1]
    a1, a2 = engine.split(a, 2)
    deep = {id(a1): _ids(13, 3), id(a2): _ids(14, 12)}
    for s in (a1, a2):
        engine.extend(s, deep[id(s)])
    prefixes = [_ids(15, 2), [], _ids(16, 4)]
    fork = engine.fork(a1, prefixes, [6, 9, 5])
    gens = [engine.generate(s, 7) for s in (a2, b, root)]
    engine.run([fork, *gens])
    a1_toks = root_toks + ext[id(a)] + deep[id(a1)]
    for j, (p, m) in enumerate(zip(prefixes, [6, 9, 5])):
        assert fork.result[j].tokens == greedy_by_full_forward(model, a1_toks + p, m), j
    for s, op, toks in ((a2, gens[0], root_toks + ext[id(a)] + deep[id(a2)]), (b, gens[1], root_toks + ext[id(b)]),
                        (root, gens[2], root_toks)):
        assert op.result.tokens == greedy_by_full_forward(model, toks, 7)
    for s in (a1, a2, a, b, root):
        engine.close(s)
    engine.reset_prefix_cache()
    assert engine.page_stats()["pages_free"] == engine.num_pages             # nothing leaked
    with pytest.raises(EngineError, match="free slot"):
        engine.split(_open(engine, root_toks), 6)


def test_a_small_pool_admits_by_pages_evicts_the_cache_and_never_fails_a_request(model):
    """num_pages below the capacities: opens wait while live sequences hold the pages, cached
    prefixes are evicted (least recently used first) to admit new ones, and every request's
    tokens are those of a plain forward."""
    engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=3, num_pages=8, **CAPS)
    prompts = [_ids(20 + k, 40) for k in range(4)]            # 39 tokens to write: 3 pages each
    ops = [engine.open(p) for p in prompts]
    assert [o.done for o in ops] == [True, True, False, False]          # 2 x 3 pages of 8; the third waits
    gens = []
    for o, p in zip(ops[:2], prompts):
        engine.run([o])
        gens.append(engine.generate(o.result, 6))
    engine.run(gens)
    for g, p in zip(gens, prompts):
        assert g.result.tokens == greedy_by_full_forward(model, p, 6)
    engine.close(ops[0].result)                     # its 2 full pages stay cached
    assert engine.page_stats()["pages_cached"] == 2
    engine.run([ops[2]])                            # admitted: its pages evict the cached ones
    assert engine.page_stats()["evicted_pages"] >= 1
    g = engine.generate(ops[2].result, 6)
    engine.run([g])
    assert g.result.tokens == greedy_by_full_forward(model, prompts[2], 6)
    with pytest.raises(EngineError, match="KV pool"):
        engine.run([ops[3]])                        # every page held by live sequences: no progress
    for o in ops[1:3]:
        engine.close(o.result)
    engine.run([ops[3]])
    engine.close(ops[3].result)


def test_new_weights_forget_the_cached_prefixes(model):
    """Setting params (the RL trainer's update) drops the prefix cache: the next sequence with
    the same tokens prefills them all, with the new weights' logits."""
    import jax
    engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=2, **CAPS)
    toks = _ids(30, 40)
    engine.close(_open(engine, toks))
    assert engine.page_stats()["pages_cached"] == 2
    old = engine.params
    engine.params = jax.tree.map(lambda x: x * 1.01, old)
    assert engine.page_stats()["pages_cached"] == 0
    seq = _open(engine, toks)
    assert seq.pages.length == 39 and engine.page_stats()["prefix_hit_tokens"] == 0
    scaled = type(model)(model.config, params=engine.params)
    np.testing.assert_allclose(engine.forced_logits(seq)[0], _next_logits(scaled, toks), atol=1e-5, rtol=0)
    engine.close(seq)
    engine.params = old


def test_runs_that_outgrow_the_pool_are_preempted_and_give_their_own_tokens(model):
    """Three runs whose outputs do not fit the pool together: the youngest decoding run gives its
    pages back (cached in the radix tree) and is requeued, resumed from what is still cached or
    recomputed, and decodes on with its own key stream: every run's tokens (greedy and sampled)
    equal an engine with room for all, greedy ones a plain forward's too. (An idle sequence keeps
    its pages: one that blocks every other is a clear error, `test_a_small_pool_...`.)"""
    from sprint_jax.infer.sampling import Sampling

    prompts = [_ids(40 + k, 20) for k in range(3)]
    samplings = [None, Sampling(temperature=1.0, seed=5), None]

    def run(num_pages):
        engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=3, num_pages=num_pages, **CAPS)
        opens = [engine.open(p) for p in prompts]
        engine.run(opens)
        gens = [engine.generate(o.result, 44, sampling=s) for o, s in zip(opens, samplings)]
        while not all(o.result.closed for o in opens):      # each run closed when it ends (a server's way)
            assert engine.step()
            for o, g in zip(opens, gens):
                if g.done and not o.result.closed:
                    engine.close(o.result)
        return [g.result.tokens for g in gens], engine

    roomy, _ = run(None)
    tight, engine = run(9)                  # each run ends at 63 tokens + a chunk: 5 pages; 9 for three
    assert engine.stats["preemptions"] >= 1
    assert tight == roomy
    for k in (0, 2):
        assert tight[k] == greedy_by_full_forward(model, prompts[k], 44)
    assert engine.page_stats()["pages_used"] == 0


def test_forks_that_outgrow_the_pool_start_again_and_give_their_own_tokens(model):
    """Two runs fork three children each; the pool holds one fork's pages, not both: the youngest
    fork gives its pages back (children and parent) and starts again once the older one has what
    it needs, so every child's tokens (greedy and sampled) equal an engine with room for all, the
    greedy ones each branch alone by a plain forward."""
    from sprint_jax.infer.sampling import Sampling

    prompts = [_ids(60 + k, 20) for k in range(2)]                  # 2 pages each (16 + 4)
    prefixes = [[_ids(70 + 3 * k + j, 2) for j in range(3)] for k in range(2)]
    samplings = [None, Sampling(temperature=1.0, seed=9)]

    def run(num_pages):
        engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=2, num_pages=num_pages, **CAPS)
        opens = [engine.open(p) for p in prompts]
        engine.run(opens)
        forks = [engine.fork(o.result, pre, 30, sampling=s) for o, pre, s in zip(opens, prefixes, samplings)]
        while not all(o.result.closed for o in opens):             # each run closed when it ends
            engine.step_or_raise()
            for o, f in zip(opens, forks):
                if f.done and not o.result.closed:
                    engine.close(o.result)
        return [[g.tokens for g in f.result] for f in forks], engine

    roomy, _ = run(None)
    tight, engine = run(14)        # a fork: its parent's 2 pages + 3 x (the copied page + 2 more)
    assert engine.stats["preemptions"] >= 1
    assert tight == roomy
    for pre, toks in zip(prefixes[0], tight[0]):
        assert toks == greedy_by_full_forward(model, prompts[0] + pre, 30)
    assert engine.page_stats()["pages_used"] == 0


def test_a_merge_join_short_of_pages_preempts_a_younger_run_and_both_give_their_own_tokens(model):
    """A merge join needs pages for the joined branches now (it cannot wait for a later step): on
    a full pool the youngest decoding run gives its pages back (requeued, as a step would), the
    join goes through, and both the joined planner's next tokens and the preempted run's equal an
    engine with room for all (the join's logits too)."""
    prompts = [_ids(80, 20), _ids(81, 20)]
    prefixes = [_ids(82 + j, 2) for j in range(3)]

    def run(num_pages):
        engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=2, num_pages=num_pages, **CAPS)
        a, b = (_open(engine, p) for p in prompts)
        fork = engine.fork(a, prefixes, 12, join=True)
        gen = engine.generate(b, 40)
        engine.run([fork])
        engine.merge(a, [p + g.tokens for p, g in zip(prefixes, fork.result)])
        logits = np.asarray(a.join_logits)
        after = engine.generate(a, 6)
        engine.run([after, gen])
        return logits, after.result.tokens, gen.result.tokens, engine

    roomy = run(None)
    tight = run(11)
    assert tight[3].stats["preemptions"] >= 1
    np.testing.assert_allclose(tight[0], roomy[0], atol=1e-5, rtol=0)
    assert tight[1:3] == roomy[1:3]
    assert tight[2] == greedy_by_full_forward(model, prompts[1], 40)


@pytest.mark.slow
def test_eval_on_a_small_pool_gives_the_default_pools_results(hf_untied, tmp_path, capsys):
    """`eval --kv-pages N`: a pool far below what the capacities reserve serves the same problems
    to the same results (timings aside), with runs preempted when their pages run out; a pool of
    0 pages or a page size of 0 is one line naming the flag, exit 2, and so is a pool no run fits
    (the engine can make no progress: more --kv-pages or a lower --concurrency)."""
    import json
    import shutil

    from sprint_jax.cli import main
    from sprint_jax.eval.report import untimed

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{k}", "problem": f"What is {k}+{k}?" * (k + 1), "answer": str(2 * k)})
                             + "\n" for k in range(4)))
    caps = ["--max-seq-len", "128", "--decode-chunk", "8", "--prefill-chunk", "32", "--max-prompts", "2",
            "--max-branch-tokens", "8", "--max-planner-tokens", "12", "--max-total-tokens", "30",
            "--concurrency", "4", "--mode", "parallel", "--no-progress"]
    rows = {}
    for name, extra in (("default", []), ("small", ["--kv-pages", "12"])):
        out = tmp_path / name
        assert main(["eval", "--model", str(model), "--data", str(tasks), "--out", str(out), *caps, *extra]) == 0
        rows[name] = [untimed(json.loads(x)) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows["default"]) == 4 and rows["small"] == rows["default"]
    pool = json.loads((tmp_path / "small" / "report.json").read_text())["engine_pool"]
    assert pool["pages_total"] == 12
    capsys.readouterr()
    for flag, value in (("--kv-pages", "0"), ("--page-size", "0"), ("--kv-pages", "1")):   # 1: no prompt fits
        assert main(["eval", "--model", str(model), "--data", str(tasks), "--out", str(tmp_path / "bad"), *caps,
                     flag, value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err
