"""Log-probs of sampled tokens: the engine's (computed in the decode program) against an
independent forward, and the on-policy invariant of RL: the loss, laying a rollout out as the
engine decoded it (flat, trie, merge), recomputes the same log-prob for every sampled token
(importance ratio 1)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import load_hf, tiny_vocab_tokenizer

TOL = 1e-4


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]


def _torch_logits(hf, tokens: list[int]) -> np.ndarray:
    """The HF torch model's logits [T, V] of one causal forward (the reference implementation)."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].double().numpy()


def _reference_logprobs(row: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """log-probs of the distribution a token is drawn from, by hand: temperature 0 -> the model's
    own (temperature 1); else logits / temperature, ids outside the top k at -inf."""
    z = row / (temperature or 1.0)
    if temperature and top_k:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    m = z[np.isfinite(z)].max()
    return z - (m + np.log(np.sum(np.exp(z[np.isfinite(z)] - m))))


@pytest.fixture(scope="module")
def hf(hf_untied):
    return load_hf(hf_untied)


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (0.7, 5)])
def test_engine_logprobs_match_the_torch_forward(tiny_model, hf, temperature, top_k):
    """Every generated token's log-prob (planner row and fork children, several decode chunks) ==
    log softmax of the torch model's logits for the sequence before it, under the distribution it
    was drawn from; the top 3 alternatives are that distribution's top 3."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.sampling import Sampling

    engine = Engine(tiny_model, tiny_vocab_tokenizer(), max_seqs=1, max_children=2, max_seq_len=64,
                    max_branch_tokens=24, decode_chunk=4, prefill_chunk=16, eos_token_ids=[])
    s = Sampling(temperature, top_k, 1.0, seed=7)
    op = engine.open(_ids(0, 9))
    engine.run([op])
    seq = op.seq
    gen = engine.generate(seq, 10, sampling=s, top_logprobs=3)
    engine.run([gen])
    prefixes = [_ids(1, 3), _ids(2, 2)]
    fork = engine.fork(seq, prefixes, 7, sampling=s, top_logprobs=3)
    engine.run([fork])
    checked = 0
    for context, g in [(list(seq.tokens[:-10]), gen.result)] + [
            (list(seq.tokens) + p, c) for p, c in zip(prefixes, fork.result)]:
        assert len(g.logprobs) == len(g.tokens) == len(g.top_logprobs) > 0
        logits = _torch_logits(hf, context + g.tokens)
        for k, (t, lp, top) in enumerate(zip(g.tokens, g.logprobs, g.top_logprobs)):
            ref = _reference_logprobs(logits[len(context) + k - 1], temperature, top_k)
            assert abs(lp - ref[t]) < TOL, (k, lp, ref[t])
            want = np.argsort(-ref, kind="stable")[:3]
            assert [i for i, _ in top] == [int(i) for i in want]
            assert max(abs(v - ref[i]) for i, v in top) < TOL
            checked += 1
    engine.close(seq)
    assert checked == 10 + sum(len(c.tokens) for c in fork.result)


def _loss_logprobs(model, items, temperature: float, seq_len: int = 256, n_valid: int | None = None):
    """The RL loss's per-token log-probs of packed items, and the packed arrays."""
    import jax.numpy as jnp

    from sprint_jax.rl.layout import pack_items
    from sprint_jax.rl.loss import token_logprobs

    packed = pack_items(items, seq_len, 1, 0)
    assert packed.truncated_loss_tokens == 0
    out = []
    for m in range(packed.arrays["tokens"].shape[0]):
        batch = {k: jnp.asarray(v[m]) for k, v in packed.arrays.items()}
        out.append(np.asarray(token_logprobs(model.params, model.config, batch, temperature, n_valid=n_valid)))
    return np.stack(out), packed.arrays


def _gap(model, items, temperature):
    lp, arrays = _loss_logprobs(model, items, temperature)
    mask = arrays["mask"] > 0
    return float(np.max(np.abs(lp - arrays["rollout_logp"])[mask])), int(mask.sum())


@pytest.mark.slow
def test_logprob_invariant_on_scripted_joins(tiny_model):
    """A sequence as the orchestrator drives it, on the engine with traces: sampled planner calls,
    a merged fork (a repair token the child never ran, so the join runs it), a re-prefilled fork
    after a rollback, a planner call after each. The loss's log-probs of every sampled token of the
    trace layout == the engine's (within 1e-4); every sampled token is in the loss."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.sampling import Sampling
    from sprint_jax.rl.layout import layout_trace

    engine = Engine(tiny_model, tiny_vocab_tokenizer(), max_seqs=1, max_children=3, max_seq_len=128,
                    max_branch_tokens=24, decode_chunk=4, prefill_chunk=16, eos_token_ids=[], trace=True)
    s = Sampling(1.0, 0, 1.0, seed=3)
    seq = engine.open(_ids(0, 7)).seq
    sampled = 0

    def run(op):
        engine.run([op])
        return op.result

    g = run(engine.generate(seq, 6, sampling=s))
    sampled += len(g.tokens)
    prefixes = [_ids(1, 2), _ids(2, 3), _ids(3, 1)]
    kids = run(engine.fork(seq, prefixes, [5, 3, 4], sampling=s, join=True))
    sampled += sum(len(c.tokens) for c in kids)
    # the last branch gets a repair token its child never decoded: the join runs it in the branch
    branches = [p + c.tokens for p, c in zip(prefixes, kids)]
    branches[-1] = branches[-1] + [5]
    engine.merge(seq, branches)
    g = run(engine.generate(seq, 5, sampling=s))       # its first token from the join logits
    sampled += len(g.tokens)
    engine.truncate(seq, len(seq.tokens) - 2)           # a rollback, then canonical tokens
    engine.extend(seq, _ids(4, 2))
    prefixes = [_ids(5, 2), _ids(6, 2)]
    kids = run(engine.fork(seq, prefixes, 4, sampling=s))
    sampled += sum(len(c.tokens) for c in kids)
    engine.extend(seq, [t for p, c in zip(prefixes, kids) for t in p + c.tokens])   # re-prefill join
    g = run(engine.generate(seq, 6, sampling=s))
    sampled += len(g.tokens)
    engine.close(seq)
    trace = seq.trace
    assert trace.exact and trace.merges == 1
    item = layout_trace(trace, 1.0)
    gap, n = _gap(tiny_model, [item], 1.0)
    assert gap < TOL, gap
    # every sampled token is in the loss, the two rolled back too (predicted from what they saw)
    assert n == sampled
    # the merge rule is what makes it exact: the same rows without stage / branch see the siblings
    blind = layout_trace(trace, 1.0)
    blind.stage, blind.branch = None, None
    assert _gap(tiny_model, [blind], 1.0)[0] > 1e-3


CHAINS, LENGTH = 2, 2


@pytest.fixture(scope="module")
def sft_policy(tmp_path_factory):
    """A tiny SPRINT model trained enough to plan, fork and answer (trie layout), its tokenizer."""
    from sprint_jax.model import from_pretrained
    from sprint_jax.tasks import chains
    from sprint_jax.train.trainer import train
    from conftest import chains_policy_config

    root = tmp_path_factory.mktemp("logprob_sft")
    tc, tok, tasks = chains_policy_config(root, "sprint", "trie", CHAINS, LENGTH)
    export = train(tc, root / "train", tokenizer=tok, progress=False)["export_dir"]
    return from_pretrained(export), tok, [chains.prompt_for(t) for t in tasks[:4]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["flat", "trie", "merge"])
def test_logprob_invariant_per_layout(sft_policy, layout):
    """P-GRPO rollouts (temperature 1, every run of the batch at once on the engine) with the
    layout's token convention and join: the loss's log-prob of every sampled token, laid out from
    the rollout's trace, equals the one the engine sampled it with, within 1e-4 (ratio 1). The
    trie of the calls (`layout_units`: re-prefill positions, no merge rule) agrees for the
    re-prefill joins and not for the merge join, which it does not describe."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.orchestrator import OrchestratorConfig
    from sprint_jax.infer.sampling import valid_vocab
    from sprint_jax.rl.layout import layout_trace, layout_units
    from sprint_jax.rl.rollout import Rollouts

    model, tok, queries = sft_policy
    n_valid = valid_vocab(tok, model.config.vocab_size)
    assert n_valid is not None                          # padded ids: the loss must leave them out too
    engine = Engine(model, tok, max_seqs=8, max_children=CHAINS, max_seq_len=160, max_branch_tokens=24,
                    decode_chunk=4, prefill_chunk=64, trace=True)
    orch = OrchestratorConfig(max_prompts=CHAINS, max_planner_tokens=24, max_branch_tokens=8, max_total_tokens=96,
                              temperature=1.0, layout=layout)
    trajs = Rollouts(engine, orch).run(queries * 2, list(range(8)), "parallel")
    joins = {s.join for t in trajs for s in t.record.stages if s.executions}
    assert joins == {"merge" if layout == "merge" else "reprefill"}, joins
    items = [layout_trace(t.trace, 1.0) for t in trajs]
    lp, arrays = _loss_logprobs(model, items, 1.0, n_valid=n_valid)
    mask = arrays["mask"] > 0
    gap = np.abs(lp - arrays["rollout_logp"])[mask]
    assert gap.max() < TOL, gap.max()
    assert np.abs(np.exp(lp - arrays["rollout_logp"])[mask] - 1).max() < TOL
    assert int(mask.sum()) == sum(t.generated_tokens for t in trajs)
    rollout_sum = sum(x for t in trajs for x in t.trace.logprob if x is not None)
    # the run records keep the same log-probs per call (planner calls, executors, the final call)
    recorded = [x for t in trajs for x in t.record.final_logprobs + [
        y for st in t.record.stages for y in st.planner_logprobs + [z for e in st.executions for z in e.logprobs]]]
    assert len(recorded) == sum(t.record.total_tokens for t in trajs) == int(mask.sum())
    assert abs(sum(recorded) - rollout_sum) < 1e-3
    units_lp, units = _loss_logprobs(model, [layout_units(t.units, 1.0) for t in trajs], 1.0, n_valid=n_valid)
    units_gap = abs(float(np.sum(units_lp * units["mask"])) - rollout_sum)
    if layout == "merge":
        assert units_gap > 1e-2, units_gap
    else:
        assert units_gap < TOL * mask.sum(), units_gap


def test_server_logprobs_equal_the_engines(tiny_model):
    """`logprobs` (completions: alternatives per token) and `logprobs` / `top_logprobs` (chat) through
    the real openai client == the engine's own for the same request decoded alone; bad log-prob
    fields are one clear 400."""
    import openai

    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.sampling import Sampling
    from sprint_jax.infer.single import SingleRun
    from sprint_jax.serve import Server

    tok = tiny_vocab_tokenizer()
    caps = dict(max_seqs=2, max_children=2, max_seq_len=128, max_branch_tokens=24, decode_chunk=4, prefill_chunk=32,
                eos_token_ids=[])
    server = Server(Engine(tiny_model, tok, **caps), "tiny").start()
    alone = SingleRun(Engine(tiny_model, tok, **caps))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        prompt = "What is 17 * 23?"
        for temperature, seed in ((0.0, 0), (0.8, 5)):
            op = alone.engine.generate(alone.prefill(tok.encode(prompt)), 8, sampling=Sampling(temperature, 0, 1.0, seed),
                                       top_logprobs=3)
            alone.engine.run([op])
            ref = op.result
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=temperature, seed=seed,
                                          logprobs=3)
            c = r.choices[0]
            assert c.text == ref.text and "".join(c.logprobs.tokens) == c.text
            k = len(c.logprobs.tokens)
            assert k >= 1 and c.logprobs.tokens == [tok.decode([t]) for t in ref.tokens[:k]]
            assert np.allclose(c.logprobs.token_logprobs, ref.logprobs[:k], atol=1e-6, rtol=0)
            for got, want in zip(c.logprobs.top_logprobs, ref.top_logprobs):
                assert got == {tok.decode([i]): v for i, v in want}
            assert c.logprobs.text_offset == [len("".join(c.logprobs.tokens[:i])) for i in range(k)]
            ch = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=8, temperature=temperature, seed=seed, logprobs=True,
                                                top_logprobs=2)
            content = ch.choices[0].logprobs.content
            assert ch.choices[0].message.content == ref.text and [e.token for e in content] == c.logprobs.tokens
            assert np.allclose([e.logprob for e in content], ref.logprobs[:k], atol=1e-6, rtol=0)
            for e, want in zip(content, ref.top_logprobs):
                assert [(a.token, a.logprob) for a in e.top_logprobs] == [(tok.decode([i]), v) for i, v in want[:2]]
                assert e.bytes == list(e.token.encode())
            # without logprobs the field stays null
            plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
            assert plain.choices[0].logprobs is None
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           top_logprobs=2)
        with pytest.raises(openai.BadRequestError, match="logprobs must be between 0 and 5"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, logprobs=6)
    finally:
        server.stop()
        alone.close()
