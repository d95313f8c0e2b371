"""The batched engine against independent references: each request decoded alone on
the single-run `Engine` (a layer over this same slot core, run one request at a time, and itself
tested against a plain full forward and HF generate; the greedy rows here are also checked against
a plain full forward directly), each fork child decoded alone from a fresh prefill, and the
compiled HLO of the decode step."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import greedy_by_full_forward, tiny_vocab_tokenizer
from sprint_jax.infer import Engine, EngineError, Sampling
from sprint_jax.infer import copy_fork
from sprint_jax.infer.batch import BatchEngine, _copy_join, _decode, decode_rows
from sprint_jax.model import from_pretrained

CAPS = dict(max_seq_len=96, max_branch_tokens=48, decode_chunk=8, prefill_chunk=32, eos_token_ids=[])


@pytest.fixture(scope="module")
def setup(hf_untied):
    model = from_pretrained(hf_untied)
    tok = tiny_vocab_tokenizer()
    alone = Engine(model, tok, max_branches=16, **CAPS)
    return model, tok, alone


def _batch(model, tok, slots=4):
    return BatchEngine(model, tok, max_seqs=slots, max_children=4, **CAPS)


def _ids(seed, n):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]


def _drive(engine, scripts):
    """Run request scripts concurrently: each is a list of ("generate"|"fork"|"extend", args) after
    an open of its prompt; every op is submitted as soon as the previous one of its run is done."""
    state = [dict(prompt=p, steps=list(s), out=[], op=None, seq=None) for p, s in scripts]
    for i, st in enumerate(state):
        st["op"] = engine.open(st["prompt"], tag=i)
    while any(st["op"] is not None for st in state):
        engine.step()
        for st in state:
            op = st["op"]
            if op is None or not op.done:
                continue
            if op.kind == "open":
                st["seq"] = op.result
            elif op.kind in ("generate", "fork"):
                st["out"].append(op.result)
            if not st["steps"]:
                engine.close(st["seq"])
                st["op"] = None
                continue
            kind, args = st["steps"].pop(0)
            st["op"] = getattr(engine, kind)(st["seq"], *args[0], **args[1])
    return [st["out"] for st in state]


def _alone(engine, prompt, steps):
    """The same script on the single-run path."""
    state = engine.prefill(prompt)
    out = []
    for kind, (a, kw) in steps:
        if kind == "generate":
            out.append(engine.generate(state, *a, **kw))
        elif kind == "fork":
            out.append(engine.decode_branches(state, *a, **kw))
        else:
            engine.extend(state, *a)
    return out


def _toks(results):
    return [[g.tokens for g in r] if isinstance(r, list) else r.tokens for r in results]


def _reasons(results):
    return [[g.stop_reason for g in r] if isinstance(r, list) else r.stop_reason for r in results]


def test_mixed_batch_rows_equal_each_request_alone(setup):
    model, tok, alone = setup
    free = alone.generate(alone.prefill(_ids(1, 9)), 16).tokens
    stop_a = tok.decode(free[5:7])            # a two-token stop reached mid-chunk
    s_hot = Sampling(temperature=1.0, seed=3)
    s_topk = Sampling(temperature=0.8, top_k=5, seed=11)
    scripts = [
        (_ids(1, 9), [("generate", ((16,), dict(stop=[stop_a])))]),
        (_ids(2, 17), [("generate", ((20,), dict(sampling=s_hot)))]),
        (_ids(3, 30), [("fork", (([[7], [8, 9], [10, 11, 12]], [5, 9, 7]), {})),
                       ("extend", (([40, 41, 42],), {})), ("generate", ((6,), {}))]),
        (_ids(4, 70), [("generate", ((12,), dict(sampling=s_topk)))]),     # prefill in 3 chunks
        (_ids(5, 12), [("generate", ((5,), {})), ("fork", (([[], []], 10), dict(sampling=s_hot))),
                       ("generate", ((9,), {}))]),
        (_ids(6, 5), [("fork", (([[20, 21], [22]], [11, 4]), dict(stop=[[stop_a], []]))),
                      ("generate", ((3,), {}))]),
    ]
    engine = _batch(model, tok, slots=4)      # 6 runs on 4 slots: two wait in the queue
    got = _drive(engine, scripts)
    for i, (prompt, steps) in enumerate(scripts):
        ref = _alone(alone, prompt, steps)
        assert _toks(got[i]) == _toks(ref), i
        assert _reasons(got[i]) == _reasons(ref), i
    assert got[0][0].stop_reason == "stop" and got[0][0].overshoot > 0
    assert engine.free_slots == 4 and not engine.busy
    # engine-independent: the greedy fork children and the generate after extend of run 2 (no
    # stops, eos off: each runs to its limit) == a plain full forward, no cache
    ctx = scripts[2][0]
    assert [g.tokens for g in got[2][0]] == [greedy_by_full_forward(model, ctx + p, m)
                                             for p, m in zip([[7], [8, 9], [10, 11, 12]], [5, 9, 7])]
    assert got[2][1].tokens == greedy_by_full_forward(model, ctx + [40, 41, 42], 6)


def test_sampled_rows_follow_the_documented_key_stream_on_a_plain_forward(setup):
    """Sampling rows against an engine-independent reference: each step's token is
    sample_tokens(logits of a plain full forward, no cache, padded ids masked; key
    fold_in(fold_in(key(seed), row), step)) as sprint_jax/infer/sampling.py documents it. Row = the
    child index of a fork (0 for a generate). This checks every sampling value a decode call carries
    (seed, row, step, temperature, top_k, top_p) reaches the device where it belongs; the
    engine-vs-Engine tests cannot, both running this core."""
    import jax

    from sprint_jax.infer.sampling import mask_padded, sample_tokens
    from sprint_jax.model.qwen2 import forward
    model, tok, _ = setup
    s = Sampling(temperature=0.9, top_k=7, top_p=0.85, seed=5)
    context, prefixes, n = _ids(21, 11), [[40], [41, 42], []], 9
    engine = _batch(model, tok)
    op = engine.open(context)
    engine.run([op])
    fork = engine.fork(op.result, prefixes, n, sampling=s)
    engine.run([fork])
    gen = engine.generate(op.result, n, sampling=dataclasses.replace(s, seed=6))
    engine.run([gen])
    fwd = jax.jit(forward, static_argnums=1)

    def reference(tokens, row, seed):
        seq, out = list(tokens), []
        for step in range(n):
            x = np.zeros((1, 64), np.int32)
            x[0, : len(seq)] = seq
            logits = mask_padded(fwd(model.params, model.config, jnp.asarray(x))[0, len(seq) - 1], engine.n_valid)
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), row), step)
            t = int(sample_tokens(logits[None].astype(jnp.float32), key[None], s.temperature, s.top_k, s.top_p,
                                  False)[0])
            seq.append(t)
            out.append(t)
        return out
    for j, p in enumerate(prefixes):
        assert fork.result[j].tokens == reference(context + p, j, s.seed), j
    assert gen.result.tokens == reference(context, 0, 6)
    assert len({tuple(g.tokens) for g in fork.result}) > 1       # the streams differ per child


def test_fork_children_equal_each_branch_decoded_alone_from_a_fresh_prefill(setup):
    model, tok, alone = setup
    context = _ids(7, 23)
    prefixes = [[30], [31, 32], [33, 34, 35], []]
    limits = [6, 10, 8, 12]
    engine = _batch(model, tok)
    op = engine.open(context)
    engine.run([op])
    fork = engine.fork(op.result, prefixes, limits)
    engine.run([fork])
    for j, (p, m) in enumerate(zip(prefixes, limits)):
        ref = alone.generate(alone.prefill(context + p), m)
        assert fork.result[j].tokens == ref.tokens, j
    # What the fork holds, read off the arrays (slots written = any non-zero K): the parent slot
    # still holds exactly the context (read-only while its children ran, nothing copied out of it)
    # and child j exactly its suffix: forced prefix + one entry per decode step.
    written = lambda a: np.asarray(jnp.any(a != 0, axis=(0, 2, 4)))  # noqa: E731  [slots, positions]
    slot = op.result.slot
    parent = written(engine.cache.pk)
    assert parent[slot].sum() == len(context) - 1 and parent.sum() == len(context) - 1
    child = written(engine.cache.ck)
    per_child = [int(child[slot * engine.max_children + j].sum()) for j in range(engine.max_children)]
    assert per_child == [len(p) + m for p, m in zip(prefixes, limits)]
    assert child.sum() == sum(per_child)                   # no other slot was touched


def test_n_samples_fork_from_one_prefill(setup):
    model, tok, alone = setup
    engine = _batch(model, tok)
    prompt = _ids(8, 14)
    one = engine.generate_one(prompt, 10)
    assert one[0].tokens == alone.generate(alone.prefill(prompt), 10).tokens
    greedy4 = engine.generate_one(prompt, 10, n=4)
    assert [g.tokens for g in greedy4] == [one[0].tokens] * 4       # greedy n identical == one
    hot = Sampling(temperature=1.0, seed=5)
    a = engine.generate_one(prompt, 10, sampling=hot, n=4)
    assert len({tuple(g.tokens) for g in a}) == 4                   # each its own key stream
    assert [g.tokens for g in a] == [g.tokens for g in engine.generate_one(prompt, 10, sampling=hot, n=4)]
    ref = alone.decode_branches(alone.prefill(prompt), [[]] * 4, 10, sampling=hot)
    assert [g.tokens for g in a] == [g.tokens for g in ref]
    assert engine.free_slots == 4


def test_serial_fork_runs_children_one_after_another(setup):
    """`serial=True`: one child row at a time (the scheduler never holds two), each child's tokens
    those of the single-run engine's serial branches (sampled: the same key streams)."""
    model, tok, alone = setup
    engine = _batch(model, tok)
    prompt, prefixes = _ids(9, 12), [_ids(30 + j, j) for j in range(3)]
    hot = Sampling(temperature=1.0, seed=3)
    op = engine.open(prompt)
    engine.run([op])
    seq = op.result
    fork = engine.fork(seq, prefixes, [6, 9, 7], sampling=hot, serial=True)
    live = []
    while not fork.done:
        engine.step()
        live.append(engine.live_rows)
    assert max(live) == 1 and len(live) >= 3
    ref = alone.decode_branches(alone.prefill(prompt), prefixes, [6, 9, 7], sampling=hot, mode="serial")
    assert [g.tokens for g in fork.result] == [g.tokens for g in ref]
    engine.close(seq)


def test_a_token_holding_the_stop_ends_the_row_on_device(setup):
    """A stop string written inside a longer token ends the row in the step that writes it
    (overshoot 0: nothing decoded past it), with the single-run engine's tokens and reason."""
    model, tok, alone = setup
    engine = _batch(model, tok)
    prompt = _ids(11, 9)
    free = alone.generate(alone.prefill(prompt), 24).tokens
    k = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i] and len(tok.decode([t])) >= 3)
    stop = tok.decode([free[k]])[1:]                   # inside the token, never equal to it
    ref = alone.generate(alone.prefill(prompt), 24, stop=[stop])
    got = engine.generate_one(prompt, 24, stop=[stop])[0]
    assert (got.tokens, got.stop_reason) == (ref.tokens, ref.stop_reason) and got.stop_reason == "stop"
    assert got.overshoot == 0 and len(got.tokens) <= k + 1


def test_full_pool_queues_then_serves(setup):
    model, tok, alone = setup
    engine = _batch(model, tok, slots=2)
    prompts = [_ids(20 + i, 6 + i) for i in range(5)]
    opens = [engine.open(p) for p in prompts]
    engine.step()
    assert [o.done for o in opens] == [True, True, False, False, False] and engine.free_slots == 0
    with pytest.raises(EngineError, match="one operation at a time"):
        engine.generate(opens[2].seq, 4)
    engine.close(opens[0].result)
    engine.step()
    assert opens[2].done and not opens[3].done
    engine.close(opens[1].result)
    engine.step()                                  # opens[3] takes the freed slot; opens[4] waits
    assert opens[3].done and not opens[4].done
    with pytest.raises(EngineError, match="no progress"):   # every slot is held by an idle sequence
        engine.run([opens[4]])
    for o in (opens[2], opens[3]):
        engine.close(o.result)
    engine.run([opens[4]])
    engine.close(opens[4].result)
    res = engine.generate_many(prompts, 6)         # 5 requests on 2 slots: they queue, then all finish
    assert [r[0].tokens for r in res] == [alone.generate(alone.prefill(p), 6).tokens for p in prompts]
    assert engine.free_slots == 2 and not engine.busy


def test_fuzz_runs_through_the_scheduler_end_and_free_every_slot(setup):
    model, tok, _ = setup
    engine = _batch(model, tok, slots=4)
    rng = np.random.default_rng(0)
    scripts = []
    for _ in range(200):
        steps = []
        for _ in range(int(rng.integers(1, 4))):
            kind = rng.choice(["generate", "fork", "extend"])
            if kind == "generate":
                steps.append(("generate", ((int(rng.integers(1, 9)),), dict(stop=[tok.decode(_ids(int(rng.integers(1e6)), 1))]))))
            elif kind == "fork":
                k = int(rng.integers(1, 5))
                steps.append(("fork", (([_ids(int(rng.integers(1e6)), int(rng.integers(0, 3))) for _ in range(k)],
                                        int(rng.integers(1, 9))), {})))
            else:
                steps.append(("extend", ((_ids(int(rng.integers(1e6)), int(rng.integers(0, 6))),), {})))
        scripts.append((_ids(int(rng.integers(1e6)), int(rng.integers(1, 12))), steps))
    got = _drive(engine, scripts)
    n_results = 0
    for (prompt, steps), out in zip(scripts, got):
        assert len(out) == sum(k != "extend" for k, _ in steps)
        for r in out:
            for g in (r if isinstance(r, list) else [r]):
                assert g.stop_reason in ("stop", "eos", "length") and g.tokens
                n_results += 1
    assert n_results > 200
    assert engine.free_slots == 4 and not engine.busy and not engine._groups and not engine._prefill_work


def _copies_of_the_cache(hlo: str, capacities: set[int]) -> list[str]:
    """Instructions outside fusion bodies that produce an array with a cache-capacity axis and are
    not an in-place update (scatter / dynamic-update-slice fusion) or a view of an existing buffer."""
    comps = dict(re.findall(r"^(?:ENTRY )?%(\S+) .*?\{\n(.*?)\n\}", hlo, flags=re.S | re.M))
    called = set(re.findall(r"calls=%([\w.\-]+)", hlo))
    roots = {name: re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", body).group(1) for name, body in comps.items()
             if re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", body)}
    bad = []
    for name, body in comps.items():
        if name in called:
            continue
        for line in body.splitlines():
            m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(", line)
            if not m or not capacities & {int(d) for d in m.group(2).split(",") if d}:
                continue
            op = m.group(3)
            if op in ("parameter", "get-tuple-element", "bitcast", "scatter", "dynamic-update-slice"):
                continue
            if op == "fusion":
                callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
                if roots.get(callee) in ("scatter", "dynamic-update-slice"):
                    continue
            bad.append(line.strip()[:160])
    return bad


def test_decode_step_hlo_has_no_full_cache_copy(setup):
    """The compiled decode chunk updates the slot cache in place: nothing in it produces a fresh
    array with a capacity axis. The same detector finds the copy in the copy-fork baseline, whose
    layer scan carries the cache through its outputs (the prototype of the batched engine)."""
    model, tok, alone = setup
    engine = _batch(model, tok)
    na, nf, w = 2, 2, engine.max_children                 # generate rows + fork groups of w children
    b = na + nf * w
    z = lambda n=b, dt=jnp.int32: jnp.zeros(n, dt)  # noqa: E731
    ints, floats = (jnp.asarray(x) for x in decode_rows(b, 8)[:2])   # the packed per-row arrays
    caps = {engine.parent_capacity, engine.child_capacity}
    assert caps == {104, 56}
    # both forms of the weights: the stacked scan (deep models, meshes) and the per-layer form this
    # small model runs (`qwen2.per_layer`: a scan over the layer index, a switch picking its weights)
    assert isinstance(engine._step_params["layers"], tuple)
    for params in (engine.params, engine._step_params):
        hlo = _decode.lower(params, engine.config, engine.cache, z(na), z(nf), z(nf), z(nf * w), ints, floats, w=w,
                            chunk=8, s_b=64, c_b=32).compile().as_text()   # used-length buckets below capacity
        assert _copies_of_the_cache(hlo, caps) == []
        assert "scatter" in hlo
    # with a merge join's copy riding the call (a cond before the first step) and that copy run
    # alone: still in place
    joins = jnp.asarray(engine._no_join)
    hlo_j = _decode.lower(engine._step_params, engine.config, engine.cache, z(na), z(nf), z(nf), z(nf * w), ints,
                          floats, w=w, chunk=8, s_b=64, c_b=32, join_meta=joins,
                          join_w=engine._fused_join_w).compile().as_text()
    assert _copies_of_the_cache(hlo_j, caps) == []
    alone_hlo = _copy_join.lower(engine.cache, joins, w=engine._fused_join_w).compile().as_text()
    assert _copies_of_the_cache(alone_hlo, caps) == []
    # the counterexample: the copy-fork baseline's decode (sprint_jax.infer.copy_fork) carries its
    # plain cache through the layer scan, so the detector must find the capacity copy there
    old_cache = copy_fork.KVCache.zeros(model.config, 1, alone.seq_capacity)
    o = lambda dt=jnp.int32: jnp.zeros(1, dt)  # noqa: E731
    old = copy_fork._decode_fn.lower(
        model.params, model.config, old_cache, o(), o(), o(bool), o(), jnp.zeros((1, 1), jnp.int32),
        jax.vmap(jax.random.key)(o()), jnp.int32(0), jnp.float32(0), jnp.int32(0), jnp.float32(1),
        chunk=8, greedy=True).compile().as_text()
    assert _copies_of_the_cache(old, {alone.seq_capacity}) != []


def test_per_layer_weights_give_the_stacked_scans_results(setup, monkeypatch):
    """A small model's engine runs its calls on per-layer weights (`qwen2.per_layer`; no copies out
    of the stacked weights per step); deep models and meshes run the stacked layer scan. Both
    are the same arithmetic: the same scripts (generate, fork, extend, sampling, stops) give the
    same tokens and stop reasons, and the same logits to the bit. Setting `params` renews the
    per-layer copy."""
    from sprint_jax.infer import batch as batch_mod
    from sprint_jax.model.qwen2 import per_layer

    model, tok, _ = setup
    s_hot = Sampling(temperature=1.0, seed=5)
    scripts = [
        (_ids(11, 13), [("generate", ((14,), {}))]),
        (_ids(12, 40), [("fork", (([[7], [8, 9], []], [6, 9, 4]), dict(sampling=s_hot))),
                        ("extend", (([50, 51],), {})), ("generate", ((7,), {}))]),
        (_ids(13, 8), [("generate", ((9,), dict(sampling=s_hot)))]),
    ]
    runs = {}
    for name, limit in (("per_layer", batch_mod.UNROLL_MAX_LAYERS), ("stacked", 0)):
        monkeypatch.setattr(batch_mod, "UNROLL_MAX_LAYERS", limit)
        engine = _batch(model, tok)           # the other tests' shapes: the per-layer run reuses their compiles
        assert isinstance(engine._step_params["layers"], tuple) == (name == "per_layer")
        assert not isinstance(engine.params["layers"], tuple)          # `params` stays stacked
        out = _drive(engine, scripts)
        op = engine.open(_ids(14, 21))
        engine.run([op])
        logits = [engine.forced_logits(op.result, [5, 6]), *engine.fork_logits(op.result, [[9], [10, 11]])]
        runs[name] = (_toks(sum(out, [])), _reasons(sum(out, [])), logits, engine)
    a, b = runs["per_layer"], runs["stacked"]
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    engine = a[3]
    scaled = jax.tree.map(lambda x: x * 2, engine.params)
    engine.params = scaled
    lay = engine._step_params["layers"]
    assert isinstance(lay, tuple) and len(lay) == model.config.num_hidden_layers
    np.testing.assert_array_equal(np.asarray(lay[1]["q_proj"]["kernel"]),
                                  np.asarray(scaled["layers"]["q_proj"]["kernel"][1]))
    assert per_layer(engine._step_params) is engine._step_params     # already per layer: as is


def test_errors_name_the_limit(setup):
    model, tok, _ = setup
    engine = _batch(model, tok)
    with pytest.raises(EngineError, match="empty"):
        engine.open([])
    with pytest.raises(EngineError, match="max_seq_len"):
        engine.open(list(range(3, 100)))
    op = engine.open(_ids(1, 5))
    engine.run([op])
    with pytest.raises(EngineError, match="max_children"):
        engine.fork(op.result, [[1]] * 5, 4)
    with pytest.raises(EngineError, match="max_branch_tokens"):
        engine.fork(op.result, [[1] * 40], 20)
    with pytest.raises(EngineError, match="max_seq_len"):
        engine.generate(op.result, 95)
    engine.close(op.result)
    with pytest.raises(EngineError, match="closed"):
        engine.generate(op.result, 2)
