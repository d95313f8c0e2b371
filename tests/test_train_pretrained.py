"""Fine-tuning from an HF checkpoint: `train()` with init=pretrained starts from the checkpoint's
weights, and its first logged loss equals HF transformers' own loss (Qwen2ForCausalLM or
Qwen3ForCausalLM with labels, query tokens ignored) on the same examples: an independent reference
for the loading path, the span mask and the loss normalisation together."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sprint_jax.model.tokenizer import pad_id
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT, load_train_config
from sprint_jax.train.trainer import train

from conftest import load_hf

DATA = Path(__file__).parent / "data" / "sft_tiny_rft.jsonl"


@pytest.mark.parametrize("fixture", ["hf_untied", "hf_qwen3_tied"])
def test_first_loss_equals_hf_loss(fixture, request, tmp_path):
    hf_dir = request.getfixturevalue(fixture)
    cfg = load_train_config(data={
        "model": {"name": str(hf_dir), "init": "pretrained", "dtype": "float32", "remat": "none",
                  "loss_chunk": 0},
        "data": {"train": [str(DATA)], "layout": "flat", "seq_len": 96, "overlong": "drop", "tokenizer": "bytes"},
        "optim": {"lr": 1e-4, "batch_size": 2},
        "checkpoint": {"every": 0}, "export": {"enabled": False},
        "steps": 1, "log_every": 1, "plot": False, "tensorboard": False,
    })
    summary = train(cfg, tmp_path / "run", progress=False)
    loss = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert summary["final_loss"] == loss and summary["data"]["dropped_overlong"] > 0

    # the same two rows, rebuilt independently of the trainer: one example per row at this length
    tok = D.byte_tokenizer()
    items, _ = D.build_items(D.read_examples([DATA]), tok, "flat", 96, "drop", SPAN_WEIGHTS_DEFAULT)
    stream = D.RowStream(items, 96, seed=cfg.data.seed, pad_token=pad_id(tok))
    rows = [stream.row_items(r) for r in range(2)]
    assert all(len(r) == 1 for r in rows)
    model = load_hf(hf_dir)
    nll_sum, count = 0.0, 0
    for (i,) in rows:
        ids = torch.tensor(items[i].tokens[None].astype(np.int64))
        labels = ids.clone()
        labels[0, torch.from_numpy(items[i].weights == 0)] = -100     # query tokens are not learnt
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
        n = int((labels[0, 1:] != -100).sum())
        nll_sum += float(out.loss) * n
        count += n
    np.testing.assert_allclose(loss, nll_sum / count, rtol=1e-5)
