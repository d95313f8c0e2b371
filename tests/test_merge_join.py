"""Merge join: the executors' KV placed after the planner's prefix without re-running
the model. The reference is independent of both engines: one plain full forward of the merged
sequence with a dense mask and positions built here from the merge join's definition (executor
j sees the context before the fork plus its own tokens, never its siblings; all executors start at
the fork; the planner continues at fork + the longest and sees every executor), returning every
layer's K/V and every row's logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_vocab_tokenizer
from sprint_jax.infer import programs
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.requests import EngineError
from sprint_jax.infer.single import SingleRun
from sprint_jax.infer.pages import KVPages
from sprint_jax.infer.programs import CopyRows
from sprint_jax.model.qwen2 import attend_partial, decoder, embed, unembed

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def engine(model):
    """Single-run calls on a one-sequence engine."""
    return SingleRun(Engine(model, tiny_vocab_tokenizer(), max_seqs=1, max_children=4, max_seq_len=128,
                            max_branch_tokens=40, decode_chunk=4, prefill_chunk=16, eos_token_ids=[]))


def _slot_kv(engine: Engine, seq, n: int):
    """The K and V of the sequence's first n tokens, read through its page table, [L, n, Hkv, D]
    (the reference's layout)."""
    ids = np.asarray(engine.page_ids(seq))

    def read(a):
        a = np.asarray(a)[:, :, ids]                                   # [L, Hkv, M, ps, D]
        return a.reshape(a.shape[:2] + (-1, a.shape[-1]))[:, :, :n].swapaxes(1, 2)
    return tuple(read(a) for a in (engine.cache.k, engine.cache.v))


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]


def merged_layout(segments: list[tuple[str, list]]):
    """Tokens, positions and the dense mask of a merged sequence from its semantics.

    segments: ("planner", tokens) or ("stage", [branch tokens, ...]) in order. Row i sees j iff
    j <= i and (j is planner text, or j's stage is earlier than i's, or i and j are in the same
    branch); the branches of a stage all start at the position after the planner text before them;
    planner text after a stage continues at that start + the longest branch."""
    toks, pos, stage, branch = [], [], [], []
    p, s = 0, 0
    for kind, content in segments:
        if kind == "planner":
            toks += content
            pos += list(range(p, p + len(content)))
            stage += [s] * len(content)
            branch += [-1] * len(content)
            p += len(content)
        else:
            s += 1
            for j, b in enumerate(content):
                toks += b
                pos += list(range(p, p + len(b)))
                stage += [s] * len(b)
                branch += [j] * len(b)
            p += max(len(b) for b in content)
            s += 1                          # planner text after the join is a later stage
    n = len(toks)
    stage, branch = np.asarray(stage), np.asarray(branch)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(i + 1):
            mask[i, j] = branch[j] < 0 or stage[j] < stage[i] or (branch[j] == branch[i] and stage[j] == stage[i])
    return toks, pos, mask


def reference(model, toks, pos, mask):
    """(logits [T, V], k [L, T, Hkv, D], v [L, T, Hkv, D]): a plain dense pass that also returns
    every layer's K/V (after RoPE), which is what a cache holds."""
    params, config = model.params, model.config

    def attend(q, k, v, layer):
        return attend_partial(q, k, v, jnp.asarray(mask)[None])[0], (k, v)

    x = embed(params, config, jnp.asarray([toks]))
    x, (k, v) = decoder(params, config, x, jnp.asarray([pos]), attend, jnp.arange(config.num_hidden_layers))
    return np.asarray(unembed(params, config, x))[0], np.asarray(k)[:, 0], np.asarray(v)[:, 0]


def test_merged_planner_cache_equals_a_dense_forward_with_the_merge_mask(model, engine, mode="shared"):
    """Two stages: a fork of 3 branches of different lengths (one with a forced repair token the
    branch never decoded), merge, the planner writes, a second fork of 2, merge, the planner
    writes. The planner's cache, the join logits and every later planner logit equal the dense
    reference; the state's positions continue at fork + the longest branch."""
    ctx = _ids(0, 11)
    state = engine.prefill(ctx)
    segments = [("planner", ctx)]
    logits_after: list[np.ndarray] = []
    for stage, (prefixes, limits, plan) in enumerate([
            ([_ids(1, 2), _ids(2, 3), _ids(3, 1)], [5, 2, 7], _ids(4, 6)),
            ([_ids(5, 2), _ids(6, 2)], [3, 6], _ids(7, 4))]):
        gens = engine.decode_branches(state, prefixes, limits, mode=mode)
        branches = [p + g.tokens for p, g in zip(prefixes, gens)]
        branches[0] = branches[0] + _ids(8 + stage, 2)          # a repair: never computed in its branch
        engine.merge(state, branches)
        segments.append(("stage", branches))
        logits_after.append(engine.extend_logits(state, plan))
        segments.append(("planner", plan))
    toks, pos, mask = merged_layout(segments)
    assert state.tokens == toks
    ref_logits, ref_k, ref_v = reference(model, toks, pos, mask)
    n = state.length
    k, v = _slot_kv(engine.engine, state, n)
    np.testing.assert_allclose(k, ref_k[:, :n], atol=TOL, rtol=0)
    np.testing.assert_allclose(v, ref_v[:, :n], atol=TOL, rtol=0)
    # row t of extend_logits predicts plan[t]: the reference rows just before each plan token
    ends = [i for i in range(1, len(segments)) if segments[i][0] == "planner"]
    starts = np.cumsum([0] + [len(s[1]) if s[0] == "planner" else sum(len(b) for b in s[1]) for s in segments])
    for got, seg in zip(logits_after, ends):
        a = int(starts[seg])
        np.testing.assert_allclose(got, ref_logits[a - 1: a - 1 + len(got)], atol=TOL, rtol=0)
    # positions: the next token sits at the last planner position + 1 (fork + longest, twice)
    assert state.length + state.pos_offset == pos[-1]
    # greedy generation continues from the reference's last row
    g = engine.generate(state, 1)
    assert g.tokens == [int(np.argmax(ref_logits[-1]))]


def test_join_logits_sample_the_first_planner_token_and_rollback_is_bounded(engine):
    state = engine.prefill(_ids(10, 9))
    gens = engine.decode_branches(state, [_ids(11, 2), _ids(12, 2)], [3, 4])
    branches = [p + g.tokens for p, g in zip([_ids(11, 2), _ids(12, 2)], gens)]
    with pytest.raises(EngineError, match="merge of 1 branches"):
        engine.merge(state, branches[:1])
    engine.merge(state, branches)
    joined = len(state.tokens)
    assert state.joined == joined and state.after_join
    with pytest.raises(EngineError, match="right after a merge join"):
        engine.decode_branches(state, [[5]], 2)
    first = engine.step_logits(state)
    g = engine.generate(state, 3)
    assert g.tokens[0] == int(np.argmax(first))
    engine.truncate(state, joined)              # back to the join: its logits are the pending ones again
    assert state.after_join and engine.generate(state, 3).tokens == g.tokens
    with pytest.raises(EngineError, match="fixed by a merge join"):
        engine.truncate(state, joined - 1)
    with pytest.raises(EngineError, match="fork just finished"):
        engine.merge(state, branches)


def test_batched_merge_is_one_call_compiled_ahead_and_long_tails_run_in_chunks(model):
    """Engine.merge: after `warm_merge` a merge of the warmed shape compiles nothing and is one
    call (tails + copy fused); the warm-up's padding rows write nothing; a tail longer than
    prefill_chunk runs its leading chunks first. Reference: the dense merge-mask forward."""
    _merge = programs.merge
    batch = Engine(model, tiny_vocab_tokenizer(), max_seqs=1, max_children=4, max_seq_len=48,
                        max_branch_tokens=12, decode_chunk=4, prefill_chunk=4, eos_token_ids=[], min_bucket=16)
    # (tables of 1, 2 pages) x window 16 x (tail 1, and the copy alone)
    assert batch.warm_merge(children=3, max_parent_len=30, tails=(1,)) == 2 * (1 + 1)
    for a in (batch.cache.k, batch.cache.v):
        assert not np.asarray(a).any()
    compiled = _merge._cache_size()
    ctx, plan = _ids(30, 11), _ids(34, 3)
    op = batch.open(ctx)
    batch.run([op])
    seq = op.result
    prefixes = [_ids(31, 2), _ids(32, 1), _ids(33, 3)]
    op = batch.fork(seq, prefixes, 3)
    batch.run([op])
    first = [p + g.tokens for p, g in zip(prefixes, op.result)]
    calls = batch.stats["prefill_calls"]
    batch.merge(seq, first)
    assert batch.stats["prefill_calls"] == calls + 1 and batch.last_join_tokens == 3
    assert _merge._cache_size() == compiled                           # warmed: no compile in the sync
    batch.extend(seq, plan)
    batch.run()
    prefixes = [_ids(35, 1), _ids(36, 2)]
    op = batch.fork(seq, prefixes, 2)
    batch.run([op])
    second = [p + g.tokens for p, g in zip(prefixes, op.result)]
    second[1] = second[1] + _ids(37, 6)                               # a 7-token tail: chunks 4 + 3
    calls = batch.stats["prefill_calls"]
    batch.merge(seq, second)
    assert batch.stats["prefill_calls"] == calls + 2 and batch.last_join_tokens == 1 + 7
    toks, pos, mask = merged_layout([("planner", ctx), ("stage", first), ("planner", plan), ("stage", second)])
    logits, ref_k, ref_v = reference(model, toks, pos, mask)
    n = len(toks)
    assert seq.tokens == toks and seq.after_join and seq.length == n - 1     # every slot written
    np.testing.assert_allclose(_slot_kv(batch, seq, n)[0], ref_k, atol=TOL, rtol=0)
    np.testing.assert_allclose(_slot_kv(batch, seq, n)[1], ref_v, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(seq.join_logits), logits[-1], atol=TOL, rtol=0)
    assert np.abs(logits[-1]).max() > 1e-2
    with pytest.raises(EngineError, match="children must be in"):
        batch.warm_merge(children=5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_join_copy_places_each_childs_tokens_and_writes_nothing_else(dtype):
    """`copy_join` (the merge join's copy) against numpy indexing through the page tables: child
    j's tokens at positions p0 + t (child 0's from t = 0, the parent's pending token; the others'
    from t = 1) land at the parent's p0 + len_0 + .. + len_{j-1} + t, in child order, across page
    boundaries; padding positions and rows copy nothing, and no other page changes (the
    children's pages included). bf16 moves exactly."""
    _copy_join = programs.copy_join
    rng = np.random.default_rng(0)
    n_layers, hkv, n_pages, ps, d = 2, 2, 12, 4, 4
    pool0 = [np.asarray(jnp.asarray(rng.standard_normal((n_layers, hkv, n_pages, ps, d)).astype(np.float32), dtype))
             for _ in range(2)]
    p0, lens = 9, [3, 2, 4]
    parent = [7, 2, 10, 5, 0]                                   # the parent's pages, shuffled
    kids = [[7, 2, 3, 11], [7, 2, 6, 1], [7, 2, 8, 4]]          # each shares the two full pages
    copy = CopyRows.empty(4, 8, 5, 5)                           # one padding row
    want = [a.copy() for a in pool0]
    off = 0
    for j, n in enumerate(lens):
        t = np.arange(0 if j == 0 else 1, n + 1)
        copy.src_table[j, :4], copy.dst_table[j] = kids[j], parent
        copy.src_pos[j, : len(t)], copy.dst_pos[j, : len(t)] = p0 + t, p0 + off + t
        for x in t:
            src, dst = p0 + x, p0 + off + x
            for w, a in zip(want, pool0):
                w[:, :, parent[dst // ps], dst % ps] = a[:, :, kids[j][src // ps], src % ps]
        off += n
    got = _copy_join(KVPages(*(jnp.array(a, copy=True) for a in pool0)), copy)
    for a, b in zip((got.k, got.v), want):
        assert a.dtype == jnp.dtype(dtype) and np.array_equal(np.asarray(a), b)
    assert not np.array_equal(want[0], pool0[0])
    got = _copy_join(KVPages(*(jnp.array(a, copy=True) for a in pool0)), CopyRows.empty(4, 8, 5, 5))   # nothing
    for a, b in zip((got.k, got.v), pool0):
        assert np.array_equal(np.asarray(a), b)


def test_a_join_fork_runs_its_last_tokens_so_the_merge_runs_no_model_call(model):
    """fork(join=True): a child that ends on device runs one more step feeding its last token (mid
    chunk, at the chunk's last step: a step past the chunk, or in a later call), so the merge of what
    the children generated is the copy alone: no model call, nothing compiled after `warm_merge`.
    The join logits are the last child's, kept on device from its decode. A repair still runs (only
    the repair: the token before it was fed), on the last child too (the join logits then come from
    that run). Tokens equal a plain fork's; K/V and every join's logits == the dense merge-mask
    forward (`merged_layout` + `reference`), 1e-4."""
    _copy_join, _merge = programs.copy_join, programs.merge
    batch = Engine(model, tiny_vocab_tokenizer(), max_seqs=1, max_children=4, max_seq_len=48,
                        max_branch_tokens=12, decode_chunk=4, prefill_chunk=4, eos_token_ids=[], min_bucket=16)
    batch.warm_merge(children=3, max_parent_len=30, tails=(1,))
    compiled = (_merge._cache_size(), _copy_join._cache_size())
    ctx = _ids(50, 11)
    op = batch.open(ctx)
    batch.run([op])
    seq = op.result
    segments, joins = [("planner", ctx)], []

    def stage(prefixes, limits, repair: dict[int, list[int]], ran: int):
        plain = batch.fork(seq, prefixes, limits)                   # no join: the same tokens
        batch.run([plain])
        op = batch.fork(seq, prefixes, limits, join=True)
        batch.run([op])
        assert [g.tokens for g in op.result] == [g.tokens for g in plain.result]
        branches = [p + g.tokens + repair.get(j, []) for j, (p, g) in enumerate(zip(prefixes, op.result))]
        calls = batch.stats["prefill_calls"]
        batch.merge(seq, branches)
        assert batch.last_join_tokens == ran and batch.stats["prefill_calls"] == calls + (ran > 0)
        segments.append(("stage", branches))
        joins.append((sum(len(x[1]) if x[0] == "planner" else sum(map(len, x[1])) for x in segments) - 1,
                      np.asarray(seq.join_logits)))

    # child 0 ends at the chunk's last step (its feed runs past the chunk), child 1 in the second
    # decode call, child 2 (the last: its logits are the join's) mid chunk in the first call
    stage([_ids(51, 1), _ids(52, 2), _ids(53, 1)], [3, 5, 1], {}, 0)
    assert compiled == (_merge._cache_size(), _copy_join._cache_size())   # warmed: no compile
    for k, (prefixes, limits, repair, ran) in enumerate([
            ([_ids(54, 1), _ids(55, 1)], [2, 2], {0: _ids(56, 2)}, 2),     # a repair on child 0 only
            ([_ids(57, 1), _ids(58, 1)], [1, 2], {1: _ids(59, 1)}, 1)]):   # on the last child
        plan = _ids(60 + k, 3)
        batch.extend(seq, plan)
        batch.run()
        segments.append(("planner", plan))
        stage(prefixes, limits, repair, ran)
    toks, pos, mask = merged_layout(segments)
    logits, ref_k, ref_v = reference(model, toks, pos, mask)
    n = len(toks)
    assert seq.tokens == toks and seq.after_join and seq.length == n - 1
    np.testing.assert_allclose(_slot_kv(batch, seq, n)[0], ref_k, atol=TOL, rtol=0)
    np.testing.assert_allclose(_slot_kv(batch, seq, n)[1], ref_v, atol=TOL, rtol=0)
    for row, got in joins:
        np.testing.assert_allclose(got, logits[row], atol=TOL, rtol=0)
    assert np.abs(logits[-1]).max() > 1e-2
    op = batch.generate(seq, 1)
    batch.run([op])
    assert op.result.tokens == [int(np.argmax(logits[-1]))]


def test_flush_writes_a_sync_now_only_when_nothing_else_is_in_flight(model):
    """Engine.flush_sync (the end of the orchestrator's sync, so that sync_s holds the join's
    cost): a queued extend of more than a decode chunk is written at once, the same K/V as the
    step that would write it; with another sequence live, or a short extend (it rides the next
    decode chunk), nothing happens."""
    def engine():
        return Engine(model, tiny_vocab_tokenizer(), max_seqs=2, max_children=1, max_seq_len=64,
                           max_branch_tokens=8, decode_chunk=4, prefill_chunk=8, eos_token_ids=[], min_bucket=16)

    a, b = engine(), engine()
    seqs = []
    for e in (a, b):
        op = e.open(_ids(40, 9))
        e.run()                                                     # the prompt written
        seqs.append(op.result)
        e.extend(op.result, _ids(41, 3))
    assert not a.flush_sync(seqs[0]) and a._prefill_work                 # 3 tokens: left to the decode chunk
    a.run()
    b.run()
    for e, seq in zip((a, b), seqs):
        e.extend(seq, _ids(42, 13))
    other = a.open(_ids(43, 5))                                     # another sequence queued: no flush
    assert not a.flush_sync(seqs[0])
    a.run()
    a.close(other.result)
    a.extend(seqs[0], _ids(44, 6))
    b.run()
    b.extend(seqs[1], _ids(44, 6))
    calls = b.stats["prefill_calls"]
    assert b.flush_sync(seqs[1]) and not b._prefill_work and b.stats["prefill_calls"] == calls + 1
    a.run()
    n = seqs[0].length
    assert n == seqs[1].length == 9 + 3 + 13 + 6 - 1
    for x, y in zip(_slot_kv(a, seqs[0], n), _slot_kv(b, seqs[1], n)):
        np.testing.assert_allclose(x, y, atol=TOL, rtol=0)


def test_a_sampled_generate_right_after_a_join_follows_the_join_logits(model, engine):
    """The first token after a merge join is sampled from the join logits, every later one from
    the planner's own logits, with the documented key stream (fold_in(fold_in(key(seed), 0), step)):
    each token == sample_tokens of the dense merge-mask forward's row before it."""
    from sprint_jax.infer.sampling import Sampling, mask_padded, sample_tokens

    ctx = _ids(20, 7)
    state = engine.prefill(ctx)
    prefixes = [_ids(21, 2), _ids(22, 3)]
    gens = engine.decode_branches(state, prefixes, 3)
    branches = [p + g.tokens for p, g in zip(prefixes, gens)]
    engine.merge(state, branches)
    with pytest.raises(EngineError, match="right after a merge join"):
        engine.decode_branches(state, [[3]], 2)
    s = Sampling(temperature=1.0, seed=7)
    got = engine.generate(state, 5, sampling=s).tokens
    toks, pos, mask = merged_layout([("planner", ctx), ("stage", branches), ("planner", got)])
    logits, _, _ = reference(model, toks, pos, mask)
    first = len(ctx) + sum(map(len, branches)) - 1            # the row that predicts the first planner token
    for k, t in enumerate(got):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s.seed), 0), k)
        row = mask_padded(jnp.asarray(logits[first + k]), engine.n_valid)
        assert t == int(sample_tokens(row[None], key[None], s.temperature, s.top_k, s.top_p, False)[0]), k


# ---------------------------------------------------------------------------------------------
# Exactness against the merge training layout (train/data.py layout_merge, the training forward)
# ---------------------------------------------------------------------------------------------
def test_engine_through_fork_branches_and_merge_gives_the_merge_layout_logits():
    """For a trajectory (three executors of unequal length, a plan-only stage, an implicit-prompt
    stage): every token's logits from the training forward of its merge-layout example (flash
    attention under the (stage, branch) rule, logits of the token's parent row) == the logits the
    engine gives that token when it runs the trajectory teacher-forced: planner pieces by
    extend, each stage with prompts as a shared fork (fork_logits) and a merge join, the first
    planner token after a join from the join logits, fp32 <= 1e-4."""
    from sprint_jax import format as fmt
    from sprint_jax.schema import Example
    from sprint_jax.model import Qwen2, Qwen2Config, forward, init_params
    from sprint_jax.train import data as D
    from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

    tok = D.byte_tokenizer()
    cfg = Qwen2Config(vocab_size=263, hidden_size=40, intermediate_size=88, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    params = init_params(cfg, jax.random.key(1), std=0.2)
    traj = fmt.Trajectory("Q: 7*(2+3)?", [
        fmt.Stage(1, ["Split.", fmt.Prompt("2+3"), fmt.Prompt("note 7"), fmt.Prompt("x")],
                  ["2+3=5", "7", "a longer third execution"]),
        fmt.Stage(2, ["Think."], []),
        fmt.Stage(3, ["Multiply 7 by 5."], ["7*5=35"]),
    ], "35")
    ex = Example("x", "sprint", traj.query + "\n", fmt.render_completion(traj))
    item = D.layout_example(tok, ex, "merge", dict(SPAN_WEIGHTS_DEFAULT))
    rows = D.RowStream([item], len(item), seed=0, pad_token=0).rows([0])
    train = np.asarray(forward(params, cfg, jnp.asarray(rows.tokens), jnp.asarray(rows.positions),
                               span_end=jnp.asarray(rows.span_end), stage=jnp.asarray(rows.stage),
                               branch=jnp.asarray(rows.branch), attention_impl="xla"))[0]

    pieces = D.split_pieces(ex.prompt, ex.completion, traj)
    ptoks = [t.ids for t in D.tokenize_pieces(tok, ex, pieces)]
    assert [t for p in ptoks for t in p] == item.tokens.tolist()
    with_prompts = {s.index for s in traj.stages if any(isinstance(x, fmt.Prompt) for x in s.plan)}
    engine = SingleRun(Engine(Qwen2(cfg, params=params), tok, max_seqs=1, max_seq_len=512, max_children=4,
                              max_branch_tokens=64, decode_chunk=4, prefill_chunk=32, eos_token_ids=[]))
    got = np.full((len(item), cfg.vocab_size), np.nan, np.float32)   # logits predicting token t
    state = engine.prefill(ptoks[0][:1])
    got[1: len(ptoks[0])] = engine.extend_logits(state, ptoks[0][1:])
    at, i = len(ptoks[0]), 1
    while i < len(ptoks):
        st, br = pieces.stage[i], pieces.branch[i]
        if br == 0 or st not in with_prompts:               # planner text, or an inline execution
            got[at: at + len(ptoks[i])] = engine.extend_logits(state, ptoks[i])
            at, i = at + len(ptoks[i]), i + 1
            continue
        group = [k for k in range(i, len(ptoks)) if pieces.stage[k] == st and pieces.branch[k] > 0]
        branches: dict[int, list[int]] = {}
        for k in group:
            branches.setdefault(pieces.branch[k], []).extend(ptoks[k])
        outs = engine.fork_logits(state, list(branches.values()))
        for out in outs:                                    # branches lie in text order in the item
            got[at: at + len(out)] = out
            at += len(out)
        engine.merge(state, list(branches.values()))
        assert state.after_join
        i = group[-1] + 1
    assert at == len(item)
    predicted = item.parents >= 0
    assert predicted.sum() == len(item) - 1
    ref = train[item.parents[predicted]]
    np.testing.assert_allclose(got[predicted], ref, atol=TOL, rtol=0)
    assert np.abs(ref).max() > 1.0                          # the comparison is not between zeros


# ---------------------------------------------------------------------------------------------
# The orchestrator's join
# ---------------------------------------------------------------------------------------------
def test_merge_and_reprefill_give_identical_records_when_every_stage_has_one_executor(model):
    """With one executor per stage the merged planner state is the re-prefilled one (the executor
    saw exactly the planner's context, at the planner's positions), so the two joins give the
    same record: same executions (one truncated and repaired), same unscripted final planner call
    decoded by the real engine. Only `join` and the tokens the sync ran differ. With more executors
    per stage the two joins are different computations (a merged executor never saw its siblings)
    and records are not expected to match."""
    from test_orchestrator import ForcedPlanner, _untimed
    from sprint_jax.infer.orchestrator import OrchestratorConfig, run_query

    engine = Engine(model, tiny_vocab_tokenizer(), max_seqs=1, max_seq_len=320, max_children=2,
                    max_branch_tokens=40, decode_chunk=8, prefill_chunk=32, eos_token_ids=[])
    planner = ["<Plan_1> first <prompt_1.1> a </prompt_1.1> </Plan_1>",
               "\n<Plan_2> then <prompt_2.1> b </prompt_2.1> </Plan_2>"]
    recs = {}
    for join in ("reprefill", "merge"):
        cfg = OrchestratorConfig(max_branch_tokens=6, max_planner_tokens=64, layout="trie", join=join)
        recs[join] = run_query(ForcedPlanner(engine, planner), "Q: 2+3=?", "parallel", cfg)
    rep, mer = recs["reprefill"], recs["merge"]
    assert rep.join == "reprefill" and mer.join == "merge"
    assert [s.join for s in mer.stages] == ["merge", "merge", ""]        # the last call writes no plan
    assert all(e.repaired for s in mer.stages for e in s.executions)      # 6-token limit: closed by the sync
    assert rep.termination == mer.termination == "planner_token_limit"   # the final call is the model's own
    a, b = _untimed(rep), _untimed(mer)
    for d in (a, b):
        d.pop("join"), d["config"].pop("join")
        for s in d["stages"]:
            s.pop("join"), s.pop("sync_tokens")
    assert a == b
    # the merge ran only the tokens its branch never computed (the last one and the repair)
    for r, m in zip(rep.stages[:2], mer.stages[:2]):
        assert 0 < m.sync_tokens < r.sync_tokens


def test_join_config_defaults_from_the_layout_and_rejects_what_cannot_merge():
    from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig

    assert OrchestratorConfig(layout="merge").resolved_join == "merge"
    assert OrchestratorConfig(layout="trie").resolved_join == "reprefill"
    assert OrchestratorConfig(layout="merge", join="reprefill").resolved_join == "reprefill"
    assert OrchestratorConfig(layout="trie", join="merge").resolved_join == "merge"
    with pytest.raises(ValueError, match="join='merge' needs"):
        OrchestratorConfig(layout="flat", join="merge")
    with pytest.raises(ValueError, match="join must be one of"):
        OrchestratorConfig(join="copy")
    with pytest.raises(ValueError, match="no branches to merge"):
        Orchestrator(None, OrchestratorConfig(layout="merge")).run("q", "serial")
