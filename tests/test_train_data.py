"""Training data: span-label loss masks, inference-call units, and packing (flat and trie) checked
against independent references: the format module's spans, and the model run on each example or
each unit alone as a plain causal sequence."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sprint_jax import format as fmt
from sprint_jax.schema import Example
from sprint_jax.model import Qwen2Config, forward, init_params
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

DATA = Path(__file__).parent / "data"
W = dict(SPAN_WEIGHTS_DEFAULT)


@pytest.fixture(scope="module")
def tok():
    return D.byte_tokenizer()


def _examples(name: str) -> list[Example]:
    return D.read_examples([DATA / name])


def _traj() -> fmt.Trajectory:
    return fmt.Trajectory("Q: 7*(2+3)?", [
        fmt.Stage(1, ["Split.", fmt.Prompt("2+3"), fmt.Prompt("note 7")], ["2+3=5", "7"]),
        fmt.Stage(2, ["Think."], []),                                   # plan-only stage
        fmt.Stage(3, ["Multiply 7 by 5."], ["7*5=35"]),                 # implicit prompt
    ], "35")


def _example(traj: fmt.Trajectory | None = None, eid: str = "x") -> Example:
    traj = traj or _traj()
    return Example(eid, "sprint", traj.query + "\n", fmt.render_completion(traj))


# ---------------------------------------------------------------------------------------------
# loss mask
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["sft_tiny_sprint.jsonl", "sft_tiny_rft.jsonl"])
def test_flat_labels_match_format_spans(tok, name):
    """Byte tokens are characters here, so token labels must equal the format's character spans;
    weights follow the span table, and the query is never in the loss."""
    for ex in _examples(name):
        item = D.layout_example(tok, ex, "flat", W)
        chars = fmt.span_labels(ex.prompt, ex.completion)
        labels = [fmt.SPAN_KINDS[i] for i in item.labels]
        assert labels[:-1] == chars and labels[-1] == "tag"
        assert item.tokens[-1] == tok.eos_token_id
        n_prompt = len(ex.prompt)
        assert not item.weights[:n_prompt].any()                      # query never in the loss
        assert (item.weights[n_prompt:] == 1).all()                    # every written token is
        assert tok.decode(item.tokens[n_prompt:-1].tolist()) == ex.completion


def test_span_weights_and_bpe_tokenizer():
    """Per-kind weights; with the real Qwen2 BPE (merges across span boundaries) the query still
    never enters the loss and single-kind tokens keep their kind."""
    from sprint_jax.model.tokenizer import qwen2_tokenizer

    bpe = qwen2_tokenizer()
    weights = {**W, "execution": 0.5, "tag": 0.0, "plan": 2.0}
    for ex in _examples("sft_tiny_sprint.jsonl")[:6]:
        item = D.layout_flat(bpe, ex, weights)
        chars = fmt.span_labels(ex.prompt, ex.completion)
        ids, offsets = D.encode_with_offsets(bpe, ex.prompt)
        assert not item.weights[:len(ids)].any()
        _, c_off = D.encode_with_offsets(bpe, ex.completion)
        for k, (a, b) in enumerate(c_off):
            kinds = set(chars[len(ex.prompt) + a: len(ex.prompt) + b])
            got = fmt.SPAN_KINDS[item.labels[len(ids) + k]]
            if len(kinds) == 1:
                assert got == kinds.pop()
            assert item.weights[len(ids) + k] == weights[got]


def test_trie_loss_is_exactly_the_unit_completions(tok):
    """Trie: every unit's completion is trained once, forced `<execution_k.j>` openings and all
    context never."""
    ex = _example()
    traj, _ = D.check_example(ex)
    pieces = D.split_pieces(ex.prompt, ex.completion, traj)
    item = D.layout_trie(tok, ex, pieces, W)
    trained = item.tokens[item.weights > 0]
    expected = sum(len(tok(pieces.texts[u[-1]])["input_ids"]) for u in pieces.units) + 1   # + EOS
    assert len(trained) == expected
    text = tok.decode(trained.tolist())
    for i, j in ((1, 1), (1, 2), (3, 1)):
        assert fmt.execution_open(i, j) not in text
        assert fmt.execution_close(i, j) in text
    assert ex.prompt.strip() not in text


# ---------------------------------------------------------------------------------------------
# units = the orchestrator's calls (paper §10)
# ---------------------------------------------------------------------------------------------
def test_units_are_the_inference_calls():
    ex = _example()
    traj, why = D.check_example(ex)
    assert why is None
    p = D.split_pieces(ex.prompt, ex.completion, traj)
    kinds = p.unit_kinds
    assert kinds == ["planner", "executor", "executor", "planner", "planner", "executor", "planner"]
    # (context, completion) text of each unit: all pieces of its path but the last, and the last
    units = [("".join(p.texts[i] for i in path[:-1]), p.texts[path[-1]]) for path in p.units]
    plan1 = units[0][1]
    assert units[0][0] == ex.prompt and plan1.startswith(fmt.plan_open(1)) and plan1.endswith(fmt.plan_close(1))
    # executor 1.2 sees the plan and its own opening, never its sibling's execution
    ctx, comp = units[2]
    assert ctx == ex.prompt + plan1 + "\n" + fmt.execution_open(1, 2)
    assert comp == " 7 " + fmt.execution_close(1, 2)
    assert "2+3=5" not in ctx
    # planner 2 sees both executions in prompt order (after sync)
    ctx2 = units[3][0]
    assert ctx2 == (ex.prompt + plan1 + "\n" + fmt.execution_open(1, 1) + " 2+3=5 " + fmt.execution_close(1, 1)
                    + "\n" + fmt.execution_open(1, 2) + " 7 " + fmt.execution_close(1, 2))
    assert units[3][1].strip() == f"{fmt.plan_open(2)} Think. {fmt.plan_close(2)}"
    # the implicit-prompt executor of stage 3, then the final answer call
    assert units[5][0].endswith(fmt.plan_close(3) + "\n" + fmt.execution_open(3, 1))
    assert units[6][1].strip().startswith(fmt.FINAL_OPEN) and units[6][1].endswith(fmt.FINAL_CLOSE)
    assert "".join(units[6]) == ex.prompt + ex.completion          # the last call holds everything


# ---------------------------------------------------------------------------------------------
# skipped / overlong / bad input
# ---------------------------------------------------------------------------------------------
def test_unparsable_and_overlong_are_counted(tok, tmp_path):
    good = _examples("sft_tiny_sprint.jsonl")[:3]
    bad = Example("bad", "sprint", "Q\n", "<Plan_1> open <prompt_1.1> x </Plan_1>\n<Final Answer> 1 </Final Answer>")
    rft_bad = Example("rb", "rft", "Q\n", "just text, no final answer")
    items, stats = D.build_items(good + [bad, rft_bad], tok, "flat", 4096, "drop", W)
    assert (stats.read, stats.used, stats.skipped_unparsable) == (5, 3, 2)
    assert any(r.startswith("bad:") for r in stats.first_skip_reasons)
    n = min(len(it) for it in items)
    _, s_drop = D.build_items(good, tok, "trie", n - 1, "drop", W)
    assert s_drop.dropped_overlong == 3 and s_drop.used == 0
    t_items, s_trunc = D.build_items(good, tok, "trie", n - 1, "truncate", W)
    assert s_trunc.truncated == 3 and all(len(it) == n - 1 for it in t_items)
    assert all((it.span_end <= n - 1).all() and (it.parents < np.arange(n - 1)).all() for it in t_items)
    with pytest.raises(D.DataError, match="token id"):
        D.build_items(good, tok, "flat", 4096, "drop", W, vocab_size=100)


def test_bad_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"id": "a", "kind": "sprint", "prompt": "p", "completion": "c"}) + "\n{oops\n")
    with pytest.raises(D.DataError, match=r"x\.jsonl:2: not valid JSON"):
        D.read_examples([f])
    f.write_text(json.dumps({"id": "a", "kind": "other", "prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(D.DataError, match=r"x\.jsonl:1: kind"):
        D.read_examples([f])
    with pytest.raises(D.DataError, match="not found"):
        D.read_examples([tmp_path / "missing.jsonl"])


def test_stream_is_deterministic_and_covers_every_item(tok):
    items, _ = D.build_items(_examples("sft_tiny_sprint.jsonl"), tok, "flat", 1024, "drop", W)
    a = D.RowStream(items, 1024, seed=3, pad_token=0)
    b = D.RowStream(items, 1024, seed=3, pad_token=0)
    c = D.RowStream(items, 1024, seed=4, pad_token=0)
    rows = [a.row_items(r) for r in range(40)]
    assert rows == [b.row_items(r) for r in range(40)]
    assert rows != [c.row_items(r) for r in range(40)]
    first_epoch = [i for r in range(len(a.epoch_rows(0))) for i in a.row_items(r)]
    assert sorted(first_epoch) == list(range(len(items)))
    assert all(sum(len(items[i]) for i in a.row_items(r)) <= 1024 for r in range(40))
    # jumping straight to a row (resume) gives the same row as walking there
    fresh = D.RowStream(items, 1024, seed=3, pad_token=0)
    assert fresh.row_items(37) == rows[37]
    np.testing.assert_array_equal(fresh.rows([37]).tokens, a.rows([37]).tokens)


# ---------------------------------------------------------------------------------------------
# packing == running alone (independent reference: a plain causal forward per sequence)
# ---------------------------------------------------------------------------------------------
CFG = Qwen2Config.preset("tiny")
FAMILY_CFGS = {"qwen2": CFG, "qwen3": Qwen2Config.preset("tiny-qwen3")}  # one tiny shape per family
L = 640   # one padded length for every "alone" run: a single compiled shape


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0), std=0.2)


@pytest.fixture(scope="module", params=list(FAMILY_CFGS))
def family_params(request):
    """(config, params) of each family: packing must not depend on the layer internals."""
    cfg = FAMILY_CFGS[request.param]
    return cfg, init_params(cfg, jax.random.key(0), std=0.2)


@functools.partial(jax.jit, static_argnums=0)
def _packed_logits(cfg, params, rows):
    """The packed row through flash attention on span_end (what the train step runs)."""
    return forward(params, cfg, rows["tokens"], rows["positions"], span_end=rows["span_end"])


@functools.partial(jax.jit, static_argnums=0)
def _plain_logits(cfg, params, tokens):
    return forward(params, cfg, tokens)       # default positions 0..L-1, plain causal mask


def _alone(cfg, params, seqs: list[list[int]]) -> np.ndarray:
    """Each sequence alone, right-padded to L (causal: padding never reaches earlier positions)."""
    toks = np.zeros((len(seqs), L), np.int32)
    for r, s in enumerate(seqs):
        assert len(s) <= L
        toks[r, :len(s)] = s
    return np.asarray(_plain_logits(cfg, params, jnp.asarray(toks)))


def _pack_row(items: list[D.Item], seq_len: int) -> tuple[dict, list[int]]:
    """Row 0 of the stream holding every item; returns its arrays and the item order in it."""
    stream = D.RowStream(items, seq_len, seed=0, pad_token=0, open_rows=1)
    order = stream.row_items(0)
    assert sorted(order) == list(range(len(items))), "all items must share row 0"
    return stream.rows([0]).as_dict(), order


def _tensors(rows):
    return {k: jnp.asarray(v) for k, v in rows.items()}


def test_flat_packed_row_equals_each_example_alone(tok, family_params):
    cfg, params = family_params
    exs = _examples("sft_tiny_sprint.jsonl")[:2] + _examples("sft_tiny_rft.jsonl")[:2]
    items = [D.layout_example(tok, ex, "flat", W) for ex in exs]
    seq_len = sum(len(it) for it in items) + 7          # some padding at the end
    rows, order = _pack_row(items, seq_len)
    packed = np.asarray(_packed_logits(cfg, params, _tensors(rows)))[0]
    alone = _alone(cfg, params, [it.tokens.tolist() for it in items])
    off = 0
    for k in order:
        n = len(items[k])
        np.testing.assert_allclose(packed[off:off + n], alone[k, :n], rtol=1e-4, atol=1e-4)
        off += n
    assert np.abs(packed).max() > 1.0                     # logits are not trivially small


def test_trie_row_equals_every_unit_alone(tok, family_params):
    """For every unit (planner or executor call) and every completion token: the packed trie row's
    logits at that token's parent == the unit run alone as a plain sequence (context +
    completion, positions 0..n-1). Also: every trained row is some unit's completion token."""
    cfg, params = family_params
    exs = [_example(), _examples("sft_tiny_sprint.jsonl")[0], _examples("sft_tiny_rft.jsonl")[1]]
    items, unit_seqs = [], []
    for ex in exs:
        traj, _ = D.check_example(ex)
        pieces = D.split_pieces(ex.prompt, ex.completion, traj)
        items.append(D.layout_trie(tok, ex, pieces, W))
        piece_ids = [tok(t)["input_ids"] for t in pieces.texts]
        piece_ids[pieces.units[-1][-1]] = piece_ids[pieces.units[-1][-1]] + [tok.eos_token_id]
        for path in pieces.units:
            ctx = [t for i in path[:-1] for t in piece_ids[i]]
            unit_seqs.append((ctx, piece_ids[path[-1]]))
    seq_len = sum(len(it) for it in items) + 5
    rows, _ = _pack_row(items, seq_len)
    packed = np.asarray(_packed_logits(cfg, params, _tensors(rows)))[0]

    tokens, parents, weights = rows["tokens"][0], rows["parents"][0], rows["weights"][0]
    chain_of: dict[tuple, int] = {}                       # ancestor token chain -> row
    for i in range(seq_len):
        chain, j = [], i
        while j >= 0:
            chain.append(int(tokens[j]))
            j = int(parents[j])
        chain_of.setdefault(tuple(reversed(chain)), i)
    alone = _alone(cfg, params, [c + p for c, p in unit_seqs])
    matched = set()
    for u, (ctx, comp) in enumerate(unit_seqs):
        seq = ctx + comp
        for c in range(len(comp)):
            n = len(ctx) + c + 1
            row = chain_of.get(tuple(seq[:n]))
            assert row is not None, f"unit {u}: completion token {c} not in the trie"
            assert weights[row] > 0
            assert rows["positions"][0][row] == n - 1            # position = depth
            np.testing.assert_allclose(packed[parents[row]], alone[u, n - 2], rtol=1e-4, atol=1e-4)
            matched.add(row)
    assert matched == set(np.flatnonzero(weights > 0).tolist())


def test_chunked_loss_equals_whole_row_loss(tok, params):
    """The vocab projection in sequence chunks (under jax.checkpoint), with every layer
    rematerialised, gives the loss and gradients of the plain whole-row pass (fp32 reassociation
    only: measured <= 2e-6 of each leaf's largest gradient)."""
    from sprint_jax.train.step import weighted_loss_sum

    items = [D.layout_example(tok, ex, "trie", W) for ex in _examples("sft_tiny_sprint.jsonl")[:1]]
    rows, _ = _pack_row(items, 512)
    batch = _tensors(rows)
    f = jax.jit(jax.value_and_grad(weighted_loss_sum, argnums=0), static_argnums=(1, 3, 4))
    l0, g0 = f(params, CFG, batch, "none", 0)
    l1, g1 = f(params, CFG, batch, "full", 128)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5 * float(np.abs(a).max()))


# ---------------------------------------------------------------------------------------------
# SPRINT and RFT on the same problems (paired over-long filtering)
# ---------------------------------------------------------------------------------------------
def test_paired_sets_drop_a_problem_overlong_in_either(tok, tmp_path):
    sprint = _examples("sft_tiny_sprint.jsonl")[:4]
    rft = _examples("sft_tiny_rft.jsonl")[:4]
    assert [e.id for e in sprint] == [e.id for e in rft] == ["t0", "t1", "t2", "t3"]
    seq_len = max(len(D.layout_example(tok, e, lay, W)) for e, lay in
                  [(e, "trie") for e in sprint] + [(e, "flat") for e in rft])
    long = rft[1]
    rft[1] = Example(long.id, "rft", long.prompt, "x" * seq_len + "\n<Final Answer> 137 </Final Answer>")
    alone, s_alone = D.build_items(sprint, tok, "trie", seq_len, "drop", W)
    assert s_alone.used == 4                      # filtered alone, SPRINT would keep t1
    s_items, s_stats = D.build_items(sprint, tok, "trie", seq_len, "drop", W,
                                     paired=D.Paired(rft, "flat", files=["rft.jsonl"]))
    r_items, r_stats = D.build_items(rft, tok, "flat", seq_len, "drop", W, paired=D.Paired(sprint, "trie"))
    assert (s_stats.used, s_stats.dropped_paired, s_stats.dropped_overlong) == (3, 1, 0)
    assert (r_stats.used, r_stats.dropped_paired, r_stats.dropped_overlong) == (3, 0, 1)
    assert s_stats.used_prompts == r_stats.used_prompts == [sprint[k].prompt for k in (0, 2, 3)]
    d = s_stats.as_dict()
    assert d["dropped_paired"] == 1 and d["paired_with"] == ["rft.jsonl"] and "used_prompts" not in d
    # a problem missing from the partner set is dropped too
    _, s_missing = D.build_items(sprint, tok, "trie", seq_len, "drop", W, paired=D.Paired(rft[:2], "flat"))
    assert s_missing.used == 1 and s_missing.dropped_paired == 3


def test_both_7b_configs_name_each_other_as_pairs():
    from sprint_jax.config import CONFIG_DIR
    from sprint_jax.train.config import load_train_config
    a = load_train_config(CONFIG_DIR / "sft_r1_distill_7b_sprint.yaml").data
    b = load_train_config(CONFIG_DIR / "sft_r1_distill_7b_rft.yaml").data
    assert a.paired.train == b.train and b.paired.train == a.train
    assert a.paired.layout == b.layout and b.paired.layout == a.layout and a.seq_len == b.seq_len
    assert not any("math500" in f for f in a.train + b.train)


# ---------------------------------------------------------------------------------------------
# the whole trajectory as one more trie unit (ThreadWeaver)
# ---------------------------------------------------------------------------------------------
def test_trie_whole_trajectory_unit_is_the_flat_example(tok, params):
    ex = _example()            # implicit prompt, plan-only stage, two executors
    flat = D.layout_example(tok, ex, "flat", W)
    trie = D.layout_example(tok, ex, "trie", W)
    whole = D.layout_example(tok, ex, "trie", W, whole_trajectory=True)
    n_prompt, k = len(tok(ex.prompt)["input_ids"]), len(trie)
    for f in ("tokens", "positions", "parents", "weights", "labels"):   # the orchestrator's units unchanged
        np.testing.assert_array_equal(getattr(whole, f)[:k], getattr(trie, f)[:k])
    tail = slice(k, len(whole))
    assert len(whole) - k == len(flat) - n_prompt
    np.testing.assert_array_equal(np.concatenate([whole.tokens[:n_prompt], whole.tokens[tail]]), flat.tokens)
    for f in ("positions", "labels", "weights"):
        np.testing.assert_array_equal(getattr(whole, f)[tail], getattr(flat, f)[n_prompt:])
    assert whole.parents[k] == n_prompt - 1 and (whole.parents[k + 1:] == np.arange(k, len(whole) - 1)).all()
    # what the model computes on the extra unit == the flat example run alone
    rows, _ = _pack_row([whole], 1024)
    packed = np.asarray(_packed_logits(CFG, params, _tensors(rows)))[0]
    alone = _alone(CFG, params, [flat.tokens.tolist()])[0]
    np.testing.assert_allclose(packed[k:len(whole)], alone[n_prompt:len(flat)], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(packed[:n_prompt], alone[:n_prompt], rtol=1e-4, atol=1e-4)
    # a serial (RFT) example is one unit already: nothing is added
    rft = _examples("sft_tiny_rft.jsonl")[0]
    a, b = (D.layout_example(tok, rft, "trie", W, whole_trajectory=w) for w in (False, True))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # off by default, and on through the config
    _, s_off = D.build_items([ex], tok, "trie", 2048, "drop", W)
    _, s_on = D.build_items([ex], tok, "trie", 2048, "drop", W, whole_trajectory=True)
    assert s_on.tokens == s_off.tokens + len(flat) - n_prompt
