"""Engine invariants against independent references: a plain full-sequence forward, HF generate,
and each branch decoded alone from a fresh full prefill (docs/design.md "The engine")."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import SHARED_ENGINES, greedy_by_full_forward, load_hf, tiny_vocab_tokenizer
from sprint_jax.bench.copy_fork import decode_branches_copy
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.requests import EngineError
from sprint_jax.infer.sampling import Sampling
from sprint_jax.infer.single import SingleRun
from sprint_jax.model import from_pretrained
from sprint_jax.model.qwen2 import forward


@pytest.fixture(scope="module")
def qwen3_engine(hf_qwen3_tied):
    """Qwen3 tied with head_dim 20, at the shared engine_96's capacities."""
    model = from_pretrained(hf_qwen3_tied)
    return model, Engine(model, tiny_vocab_tokenizer(), **SHARED_ENGINES["engine_96"])


@pytest.fixture
def setup(tiny_model, alone_96):
    """The Qwen2 engine (tests of engine mechanics that do not depend on the family)."""
    return tiny_model, alone_96.tokenizer, alone_96


@pytest.fixture(params=["qwen2", "qwen3"])
def family_setup(request, tiny_model, hf_untied):
    """The engine of each family (tests of numerics: cache == full forward, branches == alone)."""
    if request.param == "qwen2":
        run = SingleRun(request.getfixturevalue("engine_96"))
        model, path = tiny_model, hf_untied
    else:
        model, engine = request.getfixturevalue("qwen3_engine")
        run, path = SingleRun(engine), request.getfixturevalue("hf_qwen3_tied")
    yield model, run.tokenizer, run, path
    run.close()


def _context(seed=0, n=21):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]


def test_cached_logits_equal_full_forward_every_step(family_setup):
    model, _, engine, _ = family_setup
    seq = _context(1, 30)
    # one plain causal pass over all 30 tokens: row i-1 is the full forward of seq[:i]
    full = np.asarray(jax.jit(forward, static_argnums=1)(model.params, model.config, jnp.asarray([seq])))[0]
    state = engine.prefill(seq[:5])
    for i in range(5, 30):
        got = engine.step_logits(state)
        assert np.abs(got - full[i - 1]).max() <= 1e-4, i
        engine.extend(state, [seq[i]])
    # a multi-token extend across a bucket boundary (the orchestrator's sync)
    state = engine.prefill(seq[:3])
    engine.extend(state, seq[3:27])
    assert np.abs(engine.step_logits(state) - full[26]).max() <= 1e-4


def test_greedy_generate_matches_hf_generate(family_setup):
    _, _, engine, path = family_setup
    prompt = _context(2, 9)
    hf = load_hf(path)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=20).numpy()[0, len(prompt):]
    state = engine.prefill(prompt)
    g = engine.generate(state, 20)
    assert g.tokens == [int(t) for t in ref]
    assert g.stop_reason == "length"
    assert state.tokens == prompt + g.tokens


def _alone(engine, context, prefix, limit, stop):
    """Reference: the branch decoded alone from a fresh full prefill of context + its prefix."""
    state = engine.prefill(context + prefix)
    return engine.generate(state, limit, stop=stop)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_branch_modes_match_decoding_alone(family_setup, n):
    _, tok, engine, _ = family_setup
    context = _context(3 + n, 17)
    rng = np.random.default_rng(n)
    prefixes = [[int(x) for x in rng.integers(3, 307, 1 + j % 3)] for j in range(n)]
    limits = [6 + 3 * j for j in range(n)]
    # per-branch multi-token stop strings taken from where each branch would go anyway,
    # so branches stop at different times (some by stop, some by length)
    stops = []
    for j in range(n):
        free = _alone(engine, context, prefixes[j], limits[j], [])
        k = 2 + (j % 4)
        stops.append([tok.decode(free.tokens[k - 2:k])] if j % 2 == 0 and len(free.tokens) >= k else [])
    refs = [_alone(engine, context, prefixes[j], limits[j], stops[j]) for j in range(n)]
    state = engine.prefill(context)
    for mode in ("shared", "serial"):
        gens = engine.decode_branches(state, prefixes, limits, stop=stops, mode=mode)
        for j, (g, r) in enumerate(zip(gens, refs)):
            assert g.tokens == r.tokens, (mode, j)
            assert g.stop_reason == r.stop_reason, (mode, j)
        assert state.tokens == context  # the fork leaves the planner state as it was
    assert any(r.stop_reason == "stop" for r in refs) or n == 1
    # after the branches the planner state still continues correctly
    g = engine.generate(state, 5)
    assert g.tokens == _alone(engine, context, [], 5, []).tokens


def test_identical_branches_greedy_and_sampling(setup):
    _, _, engine = setup
    state = engine.prefill(_context(9, 11))
    same = engine.decode_branches(state, [[5, 6]] * 4, 10, mode="shared")
    assert all(g.tokens == same[0].tokens for g in same)
    s1 = Sampling(temperature=1.0, seed=7)
    a = engine.decode_branches(state, [[5, 6]] * 16, 10, sampling=s1, mode="shared")
    distinct = len({tuple(g.tokens) for g in a})
    assert distinct >= 12, distinct  # branches must not share a random stream
    b = engine.decode_branches(state, [[5, 6]] * 16, 10, sampling=s1, mode="shared")
    assert [g.tokens for g in a] == [g.tokens for g in b]
    c = engine.decode_branches(state, [[5, 6]] * 16, 10, sampling=Sampling(temperature=1.0, seed=8))
    assert [g.tokens for g in a] != [g.tokens for g in c]
    topk = engine.decode_branches(state, [[5, 6]] * 4, 6, sampling=Sampling(temperature=1.0, top_k=1, seed=3))
    assert all(g.tokens == same[0].tokens[:6] for g in topk)  # top_k=1 is greedy
    topp = engine.decode_branches(state, [[5, 6]] * 4, 6, sampling=Sampling(temperature=1.0, top_p=1e-6, seed=3))
    assert all(g.tokens == same[0].tokens[:6] for g in topp)  # tiny top_p keeps only the argmax


def test_copy_fork_baseline_same_branches_more_bytes(setup):
    """The bench's copy-fork baseline (bench/copy_fork.py) decodes the shared fork's greedy
    branches, holding the prefix once per branch instead of once."""
    model, _, engine = setup
    context = _context(10, 40)
    state = engine.prefill(context)
    n = 8
    prefixes = [[3 + j] for j in range(n)]
    shared = engine.decode_branches(state, prefixes, 4, mode="shared")
    shared_bytes = engine.last_branch_stats.cache_bytes
    copied = decode_branches_copy(engine, state, prefixes, 4)
    copy_bytes = engine.last_branch_stats.cache_bytes
    assert [g.tokens for g in copied] == [g.tokens for g in shared] == \
        [greedy_by_full_forward(model, context + p, 4) for p in prefixes]
    c = model.config
    per_tok = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # k+v, fp32
    # the shared fork: the 39 written tokens of the context in 3 pages of 16 (held once), and per
    # child its copy of the partly filled third page, where its 5 tokens (pending, prefix, 3
    # generated; a decode call reserves through position 39 + 1 + 8) also land
    ps = engine.page_size
    assert ps == 16 and shared_bytes == (3 + n * 1) * ps * per_tok
    # the copy baseline: the prefix as a step reads it (bucketed to 64 slots) once per branch
    prefix, suffix = 64, engine.child_capacity
    assert copy_bytes == n * (prefix + suffix) * per_tok and copy_bytes > 4 * shared_bytes


def test_a_closed_sequence_is_refused(setup):
    """A prefill closes the sequence the previous one opened: using it is refused (one line naming
    the sequence), and the new one decodes as a plain full forward does."""
    model, _, engine = setup
    a_ctx, b_ctx = _context(30, 12), _context(31, 15)
    a = engine.prefill(a_ctx)
    b = engine.prefill(b_ctx)
    with pytest.raises(EngineError, match="closed"):
        engine.generate(a, 2)
    assert engine.generate(b, 4).tokens == greedy_by_full_forward(model, b_ctx, 4)


def test_new_params_reach_the_engine(setup):
    """`engine.params = ...` (the RL trainer's in-process weight update) is what the next call
    decodes with: logits == a plain full forward with the new weights."""
    model, _, run = setup
    old = run.engine.params
    new = jax.tree.map(lambda x: x * 1.25, old)
    seq = _context(32, 10)
    try:
        run.engine.params = new
        got = run.step_logits(run.prefill(seq))
    finally:
        run.engine.params = old
    full = np.asarray(jax.jit(forward, static_argnums=1)(new, model.config, jnp.asarray([seq])))[0, -1]
    assert np.abs(got - full).max() <= 1e-4


def test_stop_overshoot_and_errors(setup):
    _, tok, engine = setup
    ctx = _context(11, 9)
    free = engine.generate(engine.prefill(ctx), 12)
    stop = tok.decode(free.tokens[1:3])
    g = engine.generate(engine.prefill(ctx), 12, stop=[stop])
    assert g.stop_reason == "stop" and stop in g.text and stop not in tok.decode(g.tokens[:-1])
    assert g.overshoot == min(engine.decode_chunk, 12) - len(g.tokens)
    with pytest.raises(EngineError, match="empty"):
        engine.prefill([])
    with pytest.raises(EngineError, match="max_children"):
        engine.decode_branches(engine.prefill(ctx), [[1]] * 17, 4)
    with pytest.raises(EngineError, match="max_branch_tokens"):
        engine.decode_branches(engine.prefill(ctx), [[1] * 40], 20)
    with pytest.raises(EngineError, match="max_seq_len"):
        engine.prefill(list(range(3, 100)))


def test_pallas_attention_gives_the_same_greedy_branches(setup):
    """The fork's parent-prefix attention in the Pallas kernel (interpret mode on CPU) gives the
    XLA path's branches, and both equal each branch's greedy tokens from a plain full forward
    (the logits-level kernel check is tests/test_parent_prefix.py's)."""
    model, tok, xla_engine = setup
    pallas = SingleRun(Engine(model, tok, **{**SHARED_ENGINES["engine_96"], "max_seqs": 1},
                              attention_impl="pallas"))
    context = _context(21, 19)
    prefixes = [[7], [8, 9], [10, 11, 12]]
    limits = [5, 9, 7]
    a = xla_engine.decode_branches(xla_engine.prefill(context), prefixes, limits, mode="shared")
    b = pallas.decode_branches(pallas.prefill(context), prefixes, limits, mode="shared")
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] == [greedy_by_full_forward(model, context + p, m) for p, m in zip(prefixes, limits)]
