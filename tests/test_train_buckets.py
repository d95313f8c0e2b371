"""`data.buckets`: rows of a few lengths, each example in the smallest bucket that holds it, each
step's batch from one bucket (train/data.py BucketStream).

  * one bucket is today's stream: the same batches, bit for bit (against a digest of the
    unbucketed stream on a fixed seed, and against a RowStream walked the unbucketed way);
  * a long example trains in a long bucket's row, packed with another, with the loss it has alone
    (reference: a plain dense causal forward over the example by itself);
  * every example not trained on is counted by reason, exactly, and said in one line;
  * the stream's position (one row cursor per bucket) resumes exactly, in the stream and in a run;
  * a real 32,768-token example goes through the data path (no model);
  * bad `data.buckets` values are one clear line.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from sprint_jax.config import ConfigError
from sprint_jax.schema import Example
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT as W, load_train_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"
TINY = ROOT / "configs" / "sft_tiny_cpu.yaml"


def _synth(lengths, seed=0) -> list[D.Item]:
    """Flat-layout-shaped items of the given lengths with random tokens and weights."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        w = rng.random(n).astype(np.float32)
        w[0] = 0
        out.append(D.Item(rng.integers(1, 250, n).astype(np.int32), np.arange(n, dtype=np.int32),
                          np.arange(-1, n - 1, dtype=np.int32), np.full(n, n, np.int32), w, np.zeros(n, np.int8)))
    return out


def _walk(stream: D.BucketStream, steps: int, trims, cursors=None):
    """(bucket length, batch arrays) of `steps` batches from position `cursors` (default: start),
    materialised as the trainer does; and the position after them."""
    cur = stream.start() if cursors is None else cursors
    out = []
    for _ in range(steps):
        k, ids, cur = stream.advance(cur)
        rows = stream.streams[k]
        width = rows.width(ids, trims[k])
        out.append((stream.buckets[k], rows.rows(ids, width).as_dict()))
    return out, cur


def _long_example(ex_id: str, n_tokens: int) -> Example:
    """A SPRINT example whose flat layout under the byte tokenizer has exactly `n_tokens` tokens
    (prompt + completion bytes + EOS): one plan, one execution padded with arithmetic."""
    prompt = "Compute 3+18+8.\n"
    head = "<Plan_1> Add step by step. <prompt_1.1> Add 3, 18 and 8. </prompt_1.1> </Plan_1>\n<execution_1.1> "
    tail = "3+18=21, 21+8=29 </execution_1.1>\n<Final Answer> 29 </Final Answer>"
    fill = n_tokens - 1 - len(prompt) - len(head) - len(tail)
    assert fill >= 0
    body = ("1+1=2 " * (fill // 6 + 1))[:fill]
    return Example(id=ex_id, kind="sprint", prompt=prompt, completion=head + body + tail, answer="29")


# ---------------------------------------------------------------------------------------------
# one bucket == the unbucketed stream
# ---------------------------------------------------------------------------------------------
# sha256 of the first 30 batches (4 rows of 512, trimmed) of the unbucketed stream over _synth
# items (37 lengths drawn from default_rng(5) in [3, 400)), seed 7, 8 open rows: computed with the
# RowStream loop the trainer ran before buckets existed
UNBUCKETED_DIGEST = "3ee1e336f5b5b9538dbc5ef10a0554f95f23291a1d7b2527dc91175e4a8d89d8"


def test_one_bucket_is_the_unbucketed_stream_bit_for_bit():
    items = _synth(list(np.random.default_rng(5).integers(3, 400, 37)))
    stream = D.BucketStream(items, [512], 4, seed=7, pad_token=0, open_rows=8)
    batches, cur = _walk(stream, 30, [D.trim_bucket(512)])
    h = hashlib.sha256()
    for _, arrays in batches:
        for k, v in arrays.items():
            h.update(k.encode())
            h.update(v.tobytes())
    assert h.hexdigest() == UNBUCKETED_DIGEST
    assert cur == [120] and stream.epoch_of(cur) == stream.streams[0].epoch_of(120)


@pytest.mark.parametrize("layout", ["flat", "trie", "merge"])
def test_one_bucket_equals_a_row_stream_in_every_layout(layout):
    tok = D.byte_tokenizer()
    items, _ = D.build_items(D.read_examples([DATA]), tok, layout, 512, "drop", W)
    old = D.RowStream(items, 512, seed=3, pad_token=0, open_rows=2)
    new = D.BucketStream(items, [512], 3, seed=3, pad_token=0, open_rows=2)
    batches, _ = _walk(new, 25, [D.trim_bucket(512)])            # more than an epoch
    for step, (length, got) in enumerate(batches):
        ids = range(3 * step, 3 * step + 3)
        want = old.rows(ids, old.width(ids, D.trim_bucket(512))).as_dict()
        assert length == 512 and got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


# ---------------------------------------------------------------------------------------------
# buckets
# ---------------------------------------------------------------------------------------------
def test_items_go_to_the_smallest_bucket_and_batches_keep_the_token_budget():
    lengths = [10, 128, 129, 256, 257, 512, 3, 500, 60, 200] * 3
    items = _synth(lengths)
    stream = D.BucketStream(items, [128, 256, 512], 2, seed=0, pad_token=0)
    for k, members in enumerate(stream.members):
        lo, hi = ([0] + stream.buckets)[k], stream.buckets[k]
        assert members and all(lo < len(items[i]) <= hi for i in members)
    assert sorted(i for m in stream.members for i in m) == list(range(len(items)))
    assert stream.rows_per_step == [8, 4, 2]                    # 1024 tokens of rows per step each
    batches, cur = _walk(stream, 40, [0, 0, 0])
    assert {length for length, _ in batches} == {128, 256, 512}
    for length, arrays in batches:
        assert arrays["tokens"].shape == (1024 // length, length)
    # every bucket advances through its epochs at the same pace
    epochs = [s.epoch_of(c) for s, c in zip(stream.streams, cur)]
    assert max(epochs) - min(epochs) <= 1 and stream.epoch_of(cur) == min(epochs)


def test_every_item_is_seen_once_per_epoch_of_its_bucket():
    items = _synth([5, 40, 130, 300, 90, 250, 17, 400, 120, 8, 77, 260])
    stream = D.BucketStream(items, [128, 256, 512], 1, seed=5, pad_token=0, open_rows=1)
    for k, s in enumerate(stream.streams):
        seen = sorted(i for row in s.epoch_rows(0) for i in row)
        assert seen == list(range(len(stream.members[k])))


def test_resume_mid_epoch_gives_the_same_batches():
    items = _synth(list(np.random.default_rng(1).integers(2, 512, 60)), seed=1)
    stream = D.BucketStream(items, [128, 256, 512], 2, seed=11, pad_token=0, open_rows=4)
    trims = [D.trim_bucket(b) for b in stream.buckets]
    straight, end = _walk(stream, 30, trims)
    first, saved = _walk(stream, 13, trims)                    # mid-epoch of every bucket
    assert stream.epoch_of(saved) == 0 and all(saved)           # inside the first epoch, every bucket begun
    fresh = D.BucketStream(items, [128, 256, 512], 2, seed=11, pad_token=0, open_rows=4)   # a new process
    rest, end2 = _walk(fresh, 17, trims, cursors=json.loads(json.dumps(saved)))           # via the JSON meta
    assert end2 == end and fresh.position_after(13) == saved
    for (la, a), (lb, b) in zip(straight, first + rest):
        assert la == lb
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_a_real_32k_example_takes_the_data_path():
    tok = D.byte_tokenizer()
    buckets = [2048, 8192, 32768]
    exs = [_long_example("fits", 32768), _long_example("over", 32769), _long_example("mid", 5000),
           _long_example("short", 300)]
    items, stats = D.build_items(exs, tok, "flat", 32768, "drop", W)
    assert [len(it) for it in items] == [32768, 5000, 300]
    assert stats.dropped == {"unparsable": 0, "overlong": 1, "paired": 0, "empty": 0}
    assert stats.drop_line() == "dropped 1 of 4 examples: 1 longer than 32768 tokens"
    stream = D.BucketStream(items, buckets, 1, seed=0, pad_token=0)
    assert stream.members == [[2], [1], [0]] and stream.rows_per_step == [16, 4, 1]
    cur = stream.start()
    for _ in range(3):
        k, ids, cur = stream.advance(cur)
        if stream.buckets[k] == 32768:
            break
    rows = stream.streams[k].rows(ids)
    assert rows.tokens.shape == (1, 32768)
    it = items[0]
    np.testing.assert_array_equal(rows.tokens[0], it.tokens)
    np.testing.assert_array_equal(rows.weights[0], it.weights)
    np.testing.assert_array_equal(rows.parents[0], np.arange(-1, 32767))
    assert (rows.span_end[0] == 32768).all() and it.weights.sum() > 30000


# ---------------------------------------------------------------------------------------------
# drops: counted by reason, never silent
# ---------------------------------------------------------------------------------------------
def test_drop_counts_are_exact(monkeypatch):
    tok = D.byte_tokenizer()
    good = [_long_example(f"g{i}", n) for i, n in enumerate([200, 700, 1000, 1024])]
    over = [_long_example("o1", 1025), _long_example("o2", 3000)]
    no_plan = Example(id="u1", kind="sprint", prompt="Q\n", completion="<Final Answer> 1 </Final Answer>")
    broken = Example(id="u2", kind="sprint", prompt="Q\n", completion="<Plan_1> x </Plan_2>")
    rft_stages = Example(id="u3", kind="rft", prompt="Q\n", completion=good[0].completion)
    empty = _long_example("e1", 300)
    exs = good + over + [no_plan, broken, rft_stages, empty]

    real = D.layout_example

    def layout(tokenizer, ex, *a, **k):          # a layout that produces nothing for one example
        item = real(tokenizer, ex, *a, **k)
        return item.truncate(0) if ex.id == "e1" else item
    monkeypatch.setattr(D, "layout_example", layout)

    items, stats = D.build_items(exs, tok, "flat", 1024, "drop", W)
    assert len(items) == stats.used == 4
    assert stats.dropped == {"unparsable": 3, "overlong": 2, "paired": 0, "empty": 1}
    assert stats.drop_line() == ("dropped 6 of 10 examples: 3 unparsable, 2 longer than 1024 tokens, 1 empty")
    d = stats.as_dict()
    assert d["dropped_total"] == 6 and d["dropped"]["overlong"] == 2

    # paired: a partner missing in the other set is a reason of its own
    _, s_pair = D.build_items(good, tok, "flat", 1024, "drop", W, paired=D.Paired(good[:3], "flat"))
    assert s_pair.drop_line() == "dropped 1 of 4 examples: 1 unusable in the paired set"
    # truncation keeps the example: nothing dropped
    _, s_trunc = D.build_items(good + over, tok, "flat", 1024, "truncate", W)
    assert s_trunc.drop_line() == "dropped 0 of 6 examples" and s_trunc.truncated == 2


# ---------------------------------------------------------------------------------------------
# the loss of a long example in a bucketed row == its loss alone
# ---------------------------------------------------------------------------------------------
def test_a_long_example_trains_in_a_bucket_with_its_loss_alone():
    import jax
    import jax.numpy as jnp

    from sprint_jax.model import qwen2
    from sprint_jax.model.config import resolve_model_config
    from sprint_jax.train import step as S

    tok = D.byte_tokenizer()
    cfg = resolve_model_config("tiny").replace(param_dtype="float32", dtype="float32")
    params = qwen2.init_params(cfg, jax.random.key(0))
    # a scaled-down analogue of [2048, 8192, 32768]: two long examples share a 4096-token row
    exs = [_long_example("a", 2300), _long_example("b", 1700)] + [_long_example(f"s{i}", 190 + 30 * i)
                                                                for i in range(6)]
    items, _ = D.build_items(exs, tok, "flat", 4096, "drop", W)
    stream = D.BucketStream(items, [512, 4096], 1, seed=0, pad_token=0)
    assert stream.members[1] == [0, 1]
    cur = stream.start()
    while True:
        k, ids, cur = stream.advance(cur)
        if k == 1:
            break
    rows = stream.streams[1]
    (row,) = ids
    assert sorted(rows.row_items(row)) == [0, 1]          # packed together
    batch = {key: jnp.asarray(v) for key, v in rows.rows(ids, rows.width(ids, D.trim_bucket(4096))).as_dict().items()}
    assert batch["tokens"].shape == (1, 4096)
    nll = np.asarray(S.token_nll(params, cfg, batch, loss_chunk=0, attention="flash", layout="flat"))[0]
    w = np.where(np.asarray(batch["parents"])[0] >= 0, np.asarray(batch["weights"])[0], 0.0)
    off = 0
    for local in rows.row_items(row):
        it = rows.items[local]
        n = len(it)
        got = float((w[off:off + n] * nll[off:off + n]).sum() / w[off:off + n].sum())
        # reference: a plain forward (dense causal mask) over the example alone; token i from logits i-1
        logits = np.asarray(qwen2.forward(params, cfg, jnp.asarray(it.tokens[None])))[0]
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        ref_nll = lse[:-1] - logits[np.arange(n - 1), it.tokens[1:]]
        want = float((it.weights[1:] * ref_nll).sum() / it.weights[1:].sum())
        assert got == pytest.approx(want, rel=2e-5)
        off += n


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, match", [
    (["data.buckets=[256,128,512]"], r"data: buckets must be strictly ascending, got \[256, 128, 512\]"),
    (["data.buckets=[128,1024]"], r"the largest of buckets \(1024\) must equal data.seq_len \(512\)"),
    (["data.buckets=[100,512]"], "bucket 100 is not a multiple of 128"),
    (["data.seq_len=768", "data.buckets=[512,768]"], r"bucket 512 does not divide data.seq_len \(768\)"),
    (["data.seq_len=3072", "data.buckets=[1536,3072]", "model.loss_chunk=1024"],
     r"model.loss_chunk \(1024\) must divide every data.buckets length longer than it; 1536"),
    (["data.buckets=[x]"], r"data.buckets\[0\]: expected an integer"),
])
def test_bad_buckets_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(TINY, overrides)


def test_bad_buckets_exit_2_in_one_line(tmp_path, capsys):
    from sprint_jax.cli import main

    rc = main(["train", "--config", str(TINY), "--out", str(tmp_path / "o"), "--set", "data.buckets=[512,256]",
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "buckets must be strictly ascending" in err


def test_buckets_default_to_seq_len():
    cfg = load_train_config(TINY)
    assert cfg.data.buckets == [] and cfg.data.row_buckets == [512]
    assert load_train_config(TINY, ["data.buckets=[128,256,512]"]).data.row_buckets == [128, 256, 512]


# ---------------------------------------------------------------------------------------------
# a bucketed run: drop line, run record, metrics, exact resume
# ---------------------------------------------------------------------------------------------
def _run_cfg(data_file: Path, steps: int, **extra):
    return load_train_config(data={
        "model": {"name": "tiny", "dtype": "float32", "remat": "none", "loss_chunk": 0},
        "data": {"train": [str(data_file)], "layout": "merge", "seq_len": 512, "buckets": [128, 256, 512],
                 "tokenizer": "bytes", "pack_open_rows": 2},
        "optim": {"lr": 3e-3, "batch_size": 2, "grad_accum": 2},
        "checkpoint": {"every": 3, "keep": 3, "async_save": False},
        "export": {"enabled": False}, "tensorboard": False, "plot": False,
        "steps": steps, "log_every": 1, **extra})


def test_a_bucketed_run_records_drops_and_resumes_exactly(tmp_path, capsys):
    from sprint_jax.train.trainer import train

    exs = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    long = _long_example("long", 600)                               # over seq_len: dropped
    exs.append({"id": long.id, "kind": "sprint", "prompt": long.prompt, "completion": long.completion})
    exs.append({"id": "bad", "kind": "sprint", "prompt": "Q\n", "completion": "no tags"})
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps(e) + "\n" for e in exs))

    straight = train(_run_cfg(data_file, 6), tmp_path / "straight", progress=True)
    err = capsys.readouterr().err
    assert f"dropped 2 of {len(exs)} examples: 1 unparsable, 1 longer than 512 tokens" in err
    stats = json.loads((tmp_path / "straight" / "data_stats.json").read_text())
    assert stats["dropped"] == {"unparsable": 1, "overlong": 1, "paired": 0, "empty": 0}
    assert set(stats["buckets"]) == {"128", "256", "512"} and straight["data"]["dropped_total"] == 2
    recs = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert len({r["bucket"] for r in recs}) >= 2                    # steps from several buckets

    # the same run stopped after step 4 (its checkpoint: step 3), then run again into the same OUT:
    # it resumes at the saved cursors and gives the straight run's steps 4-6
    class Stop(Exception):
        pass

    def stop_after_4(ev):
        if ev.step == 4:
            raise Stop

    with pytest.raises(Stop):
        train(_run_cfg(data_file, 6), tmp_path / "resumed", progress=False, callbacks=[stop_after_4])
    resumed = train(_run_cfg(data_file, 6), tmp_path / "resumed", progress=False)
    assert resumed["resumed"] and resumed["start_step"] == 3
    again = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["bucket"], r["row_width"], r["loss"]) for r in again] == \
        [(r["step"], r["bucket"], r["row_width"], r["loss"]) for r in recs]
