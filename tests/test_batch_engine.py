"""The engine's batching against independent references: each request decoded alone (one at a
time, itself tested against a plain full forward and HF generate in test_engine.py; the greedy
rows here are also checked against a plain full forward directly), each fork child decoded alone
from a fresh prefill, the documented sampling key stream on a plain forward, and the compiled HLO
of the decode step."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SHARED_ENGINES, greedy_by_full_forward
from sprint_jax.bench import copy_fork
from sprint_jax.infer import programs
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.programs import CopyRows, DecodeRows
from sprint_jax.infer.requests import EngineError
from sprint_jax.infer.sampling import Sampling


@pytest.fixture
def setup(tiny_model, engine_96, alone_96):
    """(model, tokenizer, the shared 4-slot engine, single-run calls on it)."""
    return tiny_model, engine_96.tokenizer, engine_96, alone_96


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
    model, tok, engine, alone = setup
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
    got = _drive(engine, scripts)             # 6 runs on 4 slots: two wait in the queue
    for i, (prompt, steps) in enumerate(scripts):
        ref = _alone(alone, prompt, steps)
        assert _toks(got[i]) == _toks(ref), i
        assert _reasons(got[i]) == _reasons(ref), i
    assert got[0][0].stop_reason == "stop" and got[0][0].overshoot > 0
    alone.close()
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
    (seed, row, step, temperature, top_k, top_p) reaches the device where it belongs."""
    import jax

    from sprint_jax.infer.sampling import mask_padded, sample_tokens
    from sprint_jax.model.qwen2 import forward
    model, tok, engine, _ = setup
    s = Sampling(temperature=0.9, top_k=7, top_p=0.85, seed=5)
    context, prefixes, n = _ids(21, 11), [[40], [41, 42], []], 9
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
    engine.close(op.result)


def test_fork_children_equal_each_branch_decoded_alone_from_a_fresh_prefill(setup):
    model, tok, engine, _ = setup
    context = _ids(7, 23)
    prefixes = [[30], [31, 32], [33, 34, 35], []]
    limits = [6, 10, 8, 12]
    engine.reset_prefix_cache()
    engine.cache = jax.tree.map(jnp.zeros_like, engine.cache)     # the shared engine's earlier writes gone
    op = engine.open(context)
    engine.run([op])
    fork = engine.fork(op.result, prefixes, limits)
    engine.run([fork])
    for j, (p, m) in enumerate(zip(prefixes, limits)):
        assert fork.result[j].tokens == greedy_by_full_forward(model, context + p, m), j
    # What the fork holds, read off the pool (tokens written = any non-zero K): the parent's pages
    # still hold exactly the context (read-only while its children ran); every child shares the
    # parent's full page in place and holds its own copy of the partly filled one (copy on write):
    # the 6 copied tokens, then its suffix (forced prefix + one entry per decode step).
    seq, ps = op.result, engine.page_size
    p0 = len(context) - 1
    written = np.asarray(jnp.any(engine.cache.k != 0, axis=(0, 1, 4)))          # [pages, page_size]
    parent = engine.page_ids(seq)
    assert written[parent].sum() == p0 and p0 // ps == 1
    kids = [c.pages.pages for c in seq.last_fork.children]
    assert all(k[:1] == parent[:1] and k[1] != parent[1] for k in kids)
    own = [int(written[k[1:]].sum()) for k in kids]
    assert own == [p0 % ps + len(p) + m for p, m in zip(prefixes, limits)]
    assert written.sum() == p0 + sum(own)                 # no other page was touched
    engine.close(op.result)


def test_serial_fork_runs_children_one_after_another(setup):
    """`serial=True`: one child row at a time (the scheduler never holds two), each child's tokens
    those of the same fork decoded together (sampled: the same key streams). `running_rows` names
    the one decoding child, whose tokens so far are what `progress` streams."""
    model, tok, engine, alone = setup
    prompt, prefixes = _ids(9, 12), [_ids(30 + j, j) for j in range(3)]
    hot = Sampling(temperature=1.0, seed=3)
    op = engine.open(prompt)
    engine.run([op])
    seq = op.result
    fork = engine.fork(seq, prefixes, [6, 9, 7], sampling=hot, serial=True)
    live, decoding = [], []
    while not fork.done:
        engine.step()
        live.append(engine.live_rows)
        if not fork.done:
            rows = engine.running_rows(fork)
            assert len(rows) == 3 and sum(r is not None for r in rows) == 1
            j = next(j for j, r in enumerate(rows) if r is not None)
            assert rows[j].j == j and fork.result[j] is None and engine.progress(fork)[j] == rows[j].gen
            decoding.append(j)
    assert max(live) == 1 and len(live) >= 3
    assert decoding == sorted(decoding) and set(decoding) <= {0, 1, 2}
    engine.close(seq)
    ref = alone.decode_branches(alone.prefill(prompt), prefixes, [6, 9, 7], sampling=hot, mode="shared")
    assert [g.tokens for g in fork.result] == [g.tokens for g in ref]


def test_a_token_holding_the_stop_ends_the_row_on_device(setup):
    """A stop string written inside a longer token ends the row in the step that writes it
    (overshoot 0: nothing decoded past it), at the first token whose text completes it."""
    model, tok, _, alone = setup
    prompt = _ids(11, 9)
    free = greedy_by_full_forward(model, prompt, 24)
    k = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i] and len(tok.decode([t])) >= 3)
    stop = tok.decode([free[k]])[1:]                   # inside the token, never equal to it
    got = alone.generate(alone.prefill(prompt), 24, stop=[stop])
    end = next(i for i in range(1, 25) if stop in tok.decode(free[:i]))
    assert got.tokens == free[:end] and got.stop_reason == "stop"
    assert got.overshoot == 0 and len(got.tokens) <= k + 1


def test_full_pool_queues_then_serves(tiny_model, engine_224):
    model, engine = tiny_model, engine_224               # two slots
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
    res = _drive(engine, [(p, [("generate", ((6,), {}))]) for p in prompts])   # 5 on 2 slots: queued, then all
    assert [r[0].tokens for r in res] == [greedy_by_full_forward(model, p, 6) for p in prompts]
    assert engine.free_slots == 2 and not engine.busy


def test_fuzz_runs_through_the_scheduler_end_and_free_every_slot(setup):
    model, tok, engine, _ = setup
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
    array with a capacity axis; nor does a merge join's copy. The same detector finds the copy in
    the copy-fork baseline, whose layer scan carries the cache through its outputs (the prototype
    of the engine)."""
    model, tok, engine, _ = setup
    na, nf, w = 2, 2, 4                                    # generate rows + fork groups of w children
    packed, layout = DecodeRows.empty(na, nf, w, 8, 4, 2, 2).pack()
    caps = {engine.num_pages}
    assert caps == {348} and engine.num_pages not in (engine.parent_capacity, engine.child_capacity)
    # both forms of the weights: the stacked scan (deep models, meshes) and the per-layer form this
    # small model runs (`qwen2.per_layer`: a scan over the layer index, a switch picking its weights)
    assert engine.per_layer_weights and isinstance(engine._step_params["layers"], tuple)
    for params in (engine.params, engine._step_params):
        hlo = programs.decode.lower(params, engine.config, engine.cache, packed, layout=layout,
                                    chunk=8).compile().as_text()
        assert _copies_of_the_cache(hlo, caps) == []
        assert "scatter" in hlo
    join_hlo = programs.copy_join.lower(engine.cache, CopyRows.empty(4, 8, 4, 4)).compile().as_text()
    assert _copies_of_the_cache(join_hlo, caps) == []
    # the counterexample: the copy-fork baseline's decode (sprint_jax.bench.copy_fork) carries its
    # plain cache through the layer scan, so the detector must find the capacity copy there
    old_cache = copy_fork.KVCache.zeros(model.config, 1, engine.parent_capacity)
    o = lambda dt=jnp.int32: jnp.zeros(1, dt)  # noqa: E731
    old = copy_fork._decode_fn.lower(
        model.params, model.config, old_cache, o(), o(), o(bool), o(), jnp.zeros((1, 1), jnp.int32),
        jax.vmap(jax.random.key)(o()), jnp.int32(0), jnp.float32(0), jnp.int32(0), jnp.float32(1),
        chunk=8, greedy=True).compile().as_text()
    assert _copies_of_the_cache(old, {engine.parent_capacity}) != []


def test_per_layer_weights_give_the_stacked_scans_results(setup):
    """A small model's engine runs its calls on per-layer weights (`qwen2.per_layer`; no copies out
    of the stacked weights per step); `per_layer_weights=False` (and deep models, meshes) run the
    stacked layer scan. Both are the same arithmetic: the same scripts (generate, fork, extend,
    sampling, stops) give the same tokens and stop reasons, and the same logits to the bit.
    Setting `params` renews the per-layer copy."""
    from sprint_jax.model.qwen2 import per_layer

    model, tok, shared, _ = setup
    s_hot = Sampling(temperature=1.0, seed=5)
    scripts = [
        (_ids(11, 13), [("generate", ((14,), {}))]),
        (_ids(12, 40), [("fork", (([[7], [8, 9], []], [6, 9, 4]), dict(sampling=s_hot))),
                        ("extend", (([50, 51],), {})), ("generate", ((7,), {}))]),
        (_ids(13, 8), [("generate", ((9,), dict(sampling=s_hot)))]),
    ]
    stacked = Engine(model, tok, **SHARED_ENGINES["engine_96"], per_layer_weights=False)
    runs = {}
    for name, engine in (("per_layer", shared), ("stacked", stacked)):
        assert isinstance(engine._step_params["layers"], tuple) == (name == "per_layer")
        assert not isinstance(engine.params["layers"], tuple)          # `params` stays stacked
        out = _drive(engine, scripts)
        op = engine.open(_ids(14, 21))
        engine.run([op])
        logits = [engine.forced_logits(op.result, [5, 6]), *engine.fork_logits(op.result, [[9], [10, 11]])]
        engine.close(op.result)
        runs[name] = (_toks(sum(out, [])), _reasons(sum(out, [])), logits)
    a, b = runs["per_layer"], runs["stacked"]
    assert a[0] == b[0] and a[1] == b[1]
    for x, y in zip(a[2], b[2]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    old = shared.params
    scaled = jax.tree.map(lambda x: x * 2, old)
    try:
        shared.params = scaled
        lay = shared._step_params["layers"]
        assert isinstance(lay, tuple) and len(lay) == model.config.num_hidden_layers
        np.testing.assert_array_equal(np.asarray(lay[1]["q_proj"]["kernel"]),
                                      np.asarray(scaled["layers"]["q_proj"]["kernel"][1]))
        assert per_layer(shared._step_params) is shared._step_params     # already per layer: as is
    finally:
        shared.params = old


def test_errors_name_the_limit(setup):
    model, tok, engine, _ = setup
    with pytest.raises(EngineError, match="empty"):
        engine.open([])
    with pytest.raises(EngineError, match="max_seq_len"):
        engine.open(list(range(3, 100)))
    op = engine.open(_ids(1, 5))
    engine.run([op])
    with pytest.raises(EngineError, match="max_children"):
        engine.fork(op.result, [[1]] * 17, 4)
    with pytest.raises(EngineError, match="max_branch_tokens"):
        engine.fork(op.result, [[1] * 40], 20)
    with pytest.raises(EngineError, match="max_seq_len"):
        engine.generate(op.result, 95)
    engine.close(op.result)
    with pytest.raises(EngineError, match="closed"):
        engine.generate(op.result, 2)
