"""`data.trim_rows`: a batch whose rows all end in padding is cut to a narrower width (the longest
row rounded up to a quarter of seq_len). Reference: the same rows at full width. The cut columns
are pure padding; training with the cut gives the losses, gradient norms and final weights of the
same run at full width (fp32; only the summation order over the padding differs).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sprint_jax.model.tokenizer import pad_id
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT, load_train_config

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"
SEQ = 704           # trie items here are 176-447 tokens; with one open row for packing the first
OPEN = 1            # batches (2 rows) are 440 + 432 tokens wide (cut to 576), then ~620 (704)


def test_trim_bucket_is_a_quarter_of_seq_len_rounded_to_the_loss_chunk():
    assert D.trim_bucket(256) == 64 and D.trim_bucket(256, 1024) == 64          # the demo
    assert D.trim_bucket(704) == 192 and D.trim_bucket(101) == 64
    assert D.trim_bucket(8192, 1024) == 2048 and D.trim_bucket(16384, 1024) == 4096
    assert D.trim_bucket(2048, 1024) == 1024           # a chunk multiple: the chunked loss stays chunked
    assert D.trim_bucket(4608, 1536) == 1536           # a quarter (1152) rounded up to the chunk
    assert D.trim_bucket(4096, 768) == 1024            # 768 does not divide 4096: no chunking, 64s


def test_cut_rows_are_the_full_rows_without_trailing_padding():
    tok = D.byte_tokenizer()
    items, _ = D.build_items(D.read_examples([DATA]), tok, "trie", SEQ, "drop", SPAN_WEIGHTS_DEFAULT)
    stream = D.RowStream(items, SEQ, seed=0, pad_token=pad_id(tok), open_rows=OPEN)
    bucket = D.trim_bucket(SEQ)
    widths = set()
    for first in range(0, 40, 2):
        ids = list(range(first, first + 2))
        longest = max(sum(len(items[i]) for i in stream.row_items(r)) for r in ids)   # from the items
        w = stream.width(ids, bucket)
        assert w == min(SEQ, -(-longest // bucket) * bucket) and w >= longest
        widths.add(w)
        full, cut = stream.rows(ids).as_dict(), stream.rows(ids, w).as_dict()
        for k in full:
            np.testing.assert_array_equal(cut[k], full[k][:, :w], err_msg=k)
        # what was cut is padding: no loss, nothing predicts from it, it sees only itself
        assert not full["weights"][:, w:].any() and (full["parents"][:, w:] == -1).all()
        np.testing.assert_array_equal(full["span_end"][:, w:], np.broadcast_to(np.arange(w, SEQ) + 1, (2, SEQ - w)))
        assert stream.width(ids, 0) == SEQ
    assert len(widths) >= 2 and min(widths) < SEQ, widths        # the data exercises a cut and a full row
    with pytest.raises(ValueError, match="more than width"):
        stream.rows([0], 64)


def _train(tmp: Path, trim: bool) -> tuple[list[dict], dict]:
    from safetensors.numpy import load_file

    from sprint_jax.train.trainer import train

    cfg = load_train_config(data={
        "model": {"name": "tiny", "dtype": "float32", "remat": "none"},
        "data": {"train": [str(DATA)], "layout": "trie", "seq_len": SEQ, "tokenizer": "bytes", "trim_rows": trim,
                 "pack_open_rows": OPEN},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "batch_size": 2, "weight_decay": 0.01},
        "checkpoint": {"every": 0, "resume": False}, "export": {"enabled": True, "dtype": "float32"},
        "steps": 3, "log_every": 1, "tensorboard": False, "plot": False})
    out = tmp / ("trim" if trim else "full")
    train(cfg, out, progress=False)
    import json
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {}
    for f in sorted((out / "hf").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return recs, weights


def test_training_on_cut_rows_equals_training_at_full_width(tmp_path):
    full, w_full = _train(tmp_path, trim=False)
    cut, w_cut = _train(tmp_path, trim=True)
    assert [r["row_width"] for r in full] == [SEQ] * 3
    assert [r["row_width"] for r in cut] == [576, SEQ, SEQ]      # a cut step, then full-width ones
    for a, b in zip(full, cut):
        assert a["tokens"] == b["tokens"] and a["loss_tokens"] == b["loss_tokens"]
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)
    assert w_full.keys() == w_cut.keys() and w_full
    for k in w_full:
        np.testing.assert_allclose(w_cut[k], w_full[k], rtol=1e-4, atol=1e-5, err_msg=k)
