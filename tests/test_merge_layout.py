"""The merge layout (docs/design.md "Layouts: flat, trie, merge"): every token once, executors of a
stage side by side from the fork position, and the (stage, branch) attention rule, checked against
independent references: the flat layout's tokens, the mask rule evaluated by hand on the laid-out
rows, the model run on each example alone, the model run on each first-stage call as a plain causal
sequence, and the dense-mask step; plus a real `sprint-jax train` run in the merge layout."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from sprint_jax import format as fmt
from sprint_jax.schema import Example
from sprint_jax.model import Qwen2Config, forward, init_params
from sprint_jax.model.attention import span_mask
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
W = dict(SPAN_WEIGHTS_DEFAULT)
CFG = Qwen2Config(vocab_size=263, hidden_size=40, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tok():
    return D.byte_tokenizer()


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(1), std=0.2)


def _traj() -> fmt.Trajectory:
    """Three executors of unequal length, a plan-only stage, an implicit-prompt stage."""
    return fmt.Trajectory("Q: 7*(2+3)?", [
        fmt.Stage(1, ["Split.", fmt.Prompt("2+3"), fmt.Prompt("note 7"), fmt.Prompt("x")],
                  ["2+3=5", "7", "a longer third execution"]),
        fmt.Stage(2, ["Think."], []),
        fmt.Stage(3, ["Multiply 7 by 5."], ["7*5=35"]),
    ], "35")


def _examples() -> list[Example]:
    t = _traj()
    return [Example("x", "sprint", t.query + "\n", fmt.render_completion(t))] + \
        D.read_examples([DATA / "sft_tiny_sprint.jsonl"])


def test_merge_holds_every_token_once_like_flat(tok):
    """Byte tokens: the merge layout's tokens are exactly the flat layout's (same count, same
    order); its loss is the trie's (what a call writes), and data stats count tokens per example
    (merge == flat < trie, which repeats executions in the planner's context)."""
    exs = _examples()
    for ex in exs:
        m, f = (D.layout_example(tok, ex, lay, W) for lay in ("merge", "flat"))
        t = D.layout_example(tok, ex, "trie", W)
        np.testing.assert_array_equal(m.tokens, f.tokens)
        assert (m.weights > 0).sum() == (t.weights > 0).sum()
        assert sorted(m.tokens[m.weights > 0].tolist()) == sorted(t.tokens[t.weights > 0].tolist())
    stats = {lay: D.build_items(exs, tok, lay, 4096, "drop", W)[1] for lay in ("flat", "merge", "trie")}
    assert stats["merge"].tokens_per_example == stats["flat"].tokens_per_example
    assert stats["trie"].tokens_per_example > stats["merge"].tokens_per_example
    assert stats["merge"].as_dict()["tokens_per_example"] == stats["merge"].tokens / len(exs)


def test_positions_tags_and_parents_of_a_fork(tok):
    """Stage 1 of `_traj`: its three executors all start at the fork position (after </Plan_1>),
    the next planner text resumes at fork + the longest executor; each executor's first token is
    predicted from the fork row; openings carry no loss; one example = one span."""
    ex = _examples()[0]
    it = D.layout_example(tok, ex, "merge", W)
    text = lambda a: bytes(int(x) for x in a if x < 256).decode()  # noqa: E731
    b1 = np.flatnonzero((it.stage == 1) & (it.branch > 0))
    fork_row = b1[0] - 1
    assert text(it.tokens[:fork_row + 1]).endswith(fmt.plan_close(1))
    fork = it.positions[fork_row] + 1
    lengths = []
    for j in (1, 2, 3):
        rows = np.flatnonzero((it.stage == 1) & (it.branch == j))
        assert text(it.tokens[rows]) == "\n" + fmt.execution_open(1, j) + " " + \
            _traj().stages[0].executions[j - 1] + " " + fmt.execution_close(1, j)
        np.testing.assert_array_equal(it.positions[rows], fork + np.arange(len(rows)))
        assert it.parents[rows[0]] == fork_row
        opening = len("\n" + fmt.execution_open(1, j))
        assert (it.weights[rows[:opening]] == 0).all() and (it.weights[rows[opening:]] > 0).all()
        lengths.append(len(rows))
    after = b1[-1] + 1                                   # Plan_2's first token
    assert it.branch[after] == 0 and it.stage[after] == 2
    assert it.positions[after] == fork + max(lengths) and it.parents[after] == after - 1
    assert (it.span_end == len(it)).all()
    assert it.branch[-1] == 0 and it.stage[-1] == 4      # the final answer: stage last + 1


def _row(tok, n_examples: int, pad: int):
    """Row 0 holding the first n examples and `pad` padding tokens."""
    items = [D.layout_example(tok, ex, "merge", W) for ex in _examples()[:n_examples]]
    seq_len = sum(len(it) for it in items) + pad
    stream = D.RowStream(items, seq_len, seed=0, pad_token=0, open_rows=1)
    order = stream.row_items(0)
    assert sorted(order) == list(range(len(items))), "all items must share row 0"
    return items, order, stream.rows([0])


def test_dense_mask_executors_never_see_siblings_and_the_join_sees_all(tok):
    """The mask of a packed merge row, checked token by token against the rule written out here:
    an executor token sees its own branch and the planner text before it, never a sibling; a planner
    token after the join sees every executor of the stage; an executor of a later stage sees the
    earlier stage's executors; packed examples never see each other; padding sees only itself."""
    items, order, rows = _row(tok, 3, 9)
    mask = np.asarray(span_mask(jnp.asarray(rows.span_end), stage=jnp.asarray(rows.stage),
                                branch=jnp.asarray(rows.branch)))[0]
    n_used = sum(len(it) for it in items)
    ex_of = np.full(mask.shape[0], -1)
    off = 0
    for k in order:
        ex_of[off:off + len(items[k])] = k
        off += len(items[k])
    st, br = rows.stage[0], rows.branch[0]
    i, j = np.nonzero(np.tril(np.ones_like(mask)))
    same = ex_of[i] == ex_of[j]
    want = same & (i < n_used) & ((br[j] == 0) | (st[j] < st[i]) | ((st[j] == st[i]) & (br[j] == br[i])))
    want |= (i == j)                                       # padding rows see themselves
    assert (mask[i, j] == want).all() and not np.triu(mask, 1).any()
    # the named cases, on the first example of the row (every example here forks >= 2 executors)
    first = items[order[0]]
    sib = [np.flatnonzero((first.stage == 1) & (first.branch == b)) for b in (1, 2)]
    assert not mask[np.ix_(sib[1], sib[0])].any()          # executor 1.2 never sees 1.1
    assert mask[np.ix_(sib[1], sib[1])][np.tril_indices(len(sib[1]))].all()
    execs = np.flatnonzero((first.stage == 1) & (first.branch > 0))
    join = execs[-1] + 1                                   # Plan_2's first token
    assert first.branch[join] == 0 and mask[join, execs].all()   # sees every executor of stage 1
    later = np.flatnonzero((first.stage == 2) & (first.branch > 0))
    assert len(later) and mask[np.ix_(later, execs)].all()  # a stage-2 executor sees stage 1's
    assert not mask[len(first):n_used, :len(first)].any()   # the next example sees nothing of it


@functools.partial(jax.jit, static_argnums=(0, 3))
def _logits(cfg, params, rows, attention="flash"):
    kw = {k: rows[k] for k in ("stage", "branch")}
    if attention == "dense":
        return forward(params, cfg, rows["tokens"], rows["positions"],
                       attention_mask=span_mask(rows["span_end"], **kw))
    return forward(params, cfg, rows["tokens"], rows["positions"], span_end=rows["span_end"],
                   attention_impl="xla", **kw)


def _tensors(rows):
    return {k: jnp.asarray(v) for k, v in rows.as_dict().items()}


def test_packed_merge_rows_equal_each_example_alone(tok, params):
    """Logits and loss of a packed row of merge examples == each example alone in its own row
    (fp32, 1e-4), with flash attention (XLA body), and == the dense-mask reference."""
    from sprint_jax.train.step import weighted_loss_sum

    items, order, rows = _row(tok, 3, 9)
    batch = _tensors(rows)
    packed = np.asarray(_logits(CFG, params, batch))[0]
    np.testing.assert_allclose(packed, np.asarray(_logits(CFG, params, batch, "dense"))[0],
                               rtol=1e-4, atol=1e-4)
    off, loss_alone = 0, 0.0
    for k in order:
        n = len(items[k])
        alone_rows = D.RowStream([items[k]], n, seed=0, pad_token=0).rows([0])
        alone = _tensors(alone_rows)
        np.testing.assert_allclose(packed[off:off + n], np.asarray(_logits(CFG, params, alone))[0],
                                   rtol=1e-4, atol=1e-4)
        loss_alone += float(weighted_loss_sum(params, CFG, alone))
        off += n
    np.testing.assert_allclose(float(weighted_loss_sum(params, CFG, batch)), loss_alone, rtol=1e-5)
    assert np.abs(packed).max() > 1.0


def test_first_stage_rows_equal_each_call_as_a_plain_sequence(tok, params):
    """Up to the first join the merge layout is the trie: executor j of stage 1 sees exactly the
    prompt, Plan_1 and its own tokens at positions 0..n-1. So its rows' logits == the model on that
    call as a plain causal sequence (no packing, no span / stage / branch arrays at all)."""
    ex = _examples()[0]
    it = D.layout_example(tok, ex, "merge", W)
    rows = D.RowStream([it], len(it), seed=0, pad_token=0).rows([0])
    merged = np.asarray(_logits(CFG, params, _tensors(rows)))[0]
    fork_rows = np.flatnonzero(it.branch == 0)
    fork_rows = fork_rows[fork_rows < np.flatnonzero(it.branch > 0)[0]]
    for j in (1, 2, 3):
        mine = np.flatnonzero((it.stage == 1) & (it.branch == j))
        seq = np.concatenate([it.tokens[fork_rows], it.tokens[mine]])
        plain = np.asarray(forward(params, CFG, jnp.asarray(seq)[None]))[0]
        np.testing.assert_allclose(merged[mine], plain[len(fork_rows):], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(merged[fork_rows], plain[:len(fork_rows)], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_train_merge_layout_end_to_end(tmp_path):
    """`sprint-jax train --set data.layout=merge`: a real run on the tiny model; the export names
    the layout (for the orchestrator's join), data stats report tokens per example == flat's."""
    cfg = {"model": {"name": "tiny", "dtype": "float32", "remat": "none"},
           "data": {"train": [str(DATA / "sft_tiny_sprint.jsonl")], "layout": "trie", "seq_len": 512,
                    "tokenizer": "bytes"},
           "optim": {"lr": 3e-3, "batch_size": 2}, "checkpoint": {"every": 0},
           "export": {"enabled": True, "dtype": "float32"},
           "steps": 3, "log_every": 1, "tensorboard": False, "plot": False}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    per_example = {}
    for layout in ("merge", "flat"):
        out = tmp_path / layout
        p = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "train", "--config", str(tmp_path / "c.yaml"),
                            "--set", f"data.layout={layout}", "--set", f"steps={3 if layout == 'merge' else 1}",
                            "--out", str(out), "--no-progress"],
                           env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        per_example[layout] = json.loads((out / "data_stats.json").read_text())["tokens_per_example"]
        if layout == "merge":
            assert json.loads((out / "hf" / "sprint_jax.json").read_text())["layout"] == "merge"
            losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
            assert len(losses) == 3 and all(np.isfinite(losses))
    assert per_example["merge"] == per_example["flat"] > 0
