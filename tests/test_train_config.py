"""Every configs/sft_*.yaml loads; bad configs and bad data end in one clear line naming the field
(exit code 2 from `sprint-jax train`), never a traceback."""
from __future__ import annotations

from pathlib import Path

import pytest

from sprint_jax.cli import main
from sprint_jax.config import CONFIG_DIR, ConfigError
from sprint_jax.model.config import resolve_model_config
from sprint_jax.train.config import TrainConfig, load_train_config

SFT_CONFIGS = sorted(CONFIG_DIR.glob("sft_*.yaml"))


def test_the_expected_configs_exist():
    names = {p.name for p in SFT_CONFIGS}
    assert {"sft_tiny_cpu.yaml", "sft_r1_distill_7b_sprint.yaml", "sft_r1_distill_7b_rft.yaml",
            "sft_multihost_example.yaml"} <= names


@pytest.mark.parametrize("path", SFT_CONFIGS, ids=lambda p: p.name)
def test_every_sft_config_loads(path):
    cfg = load_train_config(path)
    assert isinstance(cfg, TrainConfig) and cfg.data.train
    if cfg.model.init == "scratch":
        resolve_model_config(cfg.model.name)


def test_sprint_and_rft_7b_differ_only_in_data():
    a = load_train_config(CONFIG_DIR / "sft_r1_distill_7b_sprint.yaml").to_dict()
    b = load_train_config(CONFIG_DIR / "sft_r1_distill_7b_rft.yaml").to_dict()
    assert a["data"].pop("train") != b["data"].pop("train")
    assert a["data"].pop("paired") != b["data"].pop("paired")     # each names the other (test_train_data)
    assert a == b


@pytest.mark.parametrize("overrides, match", [
    (["optim.lrr=1"], "unknown config field optim.lrr"),
    (["optim.batch_size=6", "optim.grad_accum=4"], "batch_size .6. must be a multiple of grad_accum"),
    (["data.span_weights.thinking=1"], "span_weights.thinking is not a span kind"),
    (["data.layout=tree"], r"data.layout: 'tree' is not one of \['flat', 'trie', 'merge'\]"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "at most one of data / fsdp / tensor may be -1"),
    (["distributed.coordinator=h:1"], "must be given together"),
    (["steps=zero"], "steps: expected an integer"),
])
def test_bad_fields_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(CONFIG_DIR / "sft_tiny_cpu.yaml", overrides)


def _cli(tmp_path: Path, *sets: str) -> int:
    args = ["train", "--config", str(CONFIG_DIR / "sft_tiny_cpu.yaml"), "--out", str(tmp_path / "out")]
    for s in sets:
        args += ["--set", s]
    return main(args + ["--no-progress"])


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert _cli(tmp_path, "optim.lr=-1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sprint-jax train: error: optim: lr must be > 0"]
    assert _cli(tmp_path, f"data.train=[{tmp_path / 'nope.jsonl'}]") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training data file not found" in err[0] and "nope.jsonl" in err[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "kind": "sprint", "prompt": "p"}\n')
    assert _cli(tmp_path, f"data.train=[{bad}]") == 2
    assert "bad.jsonl:1: missing field 'completion'" in capsys.readouterr().err
    # the Qwen2 tokenizer (151k tokens) cannot feed the 307-token tiny model
    assert _cli(tmp_path, "data.tokenizer=qwen2") == 2
    assert "vocab_size is 307" in capsys.readouterr().err


def test_steps_for_epochs_by_hand():
    from sprint_jax.train.config import steps_for_epochs

    # 10 rows per epoch at 4 rows per step: 2.5 steps per epoch; 3 epochs -> 7.5 -> 8 steps
    one = {"512": {"examples": 10, "rows_per_epoch": 10, "rows_per_step": 4}}
    assert steps_for_epochs(3, one) == 8 and steps_for_epochs(0.1, one) == 1
    # two buckets: 6 rows at 8 per step + 10 rows at 4 per step = 0.75 + 2.5 = 3.25 steps per epoch
    two = {"128": {"examples": 6, "rows_per_epoch": 6, "rows_per_step": 8}, **one,
           "256": {"examples": 0, "rows_per_epoch": 0, "rows_per_step": 4}}
    assert steps_for_epochs(2, two) == 7 and steps_for_epochs(4, two) == 13


def _one_row_examples(path: Path, n_short: int, n_long: int) -> None:
    """RFT examples of known byte-token lengths: prompt 2 + body + 34 (newline, answer block, eos):
    a short one 116 tokens (one per 128 row, two per 256 row), a long one 216 (one per 256 row)."""
    import json
    lines = []
    for i in range(n_short + n_long):
        body = "x" * (80 if i < n_short else 180)
        lines.append(json.dumps({"id": f"e{i}", "kind": "rft", "prompt": "P\n", "answer": "1",
                                 "completion": f"{body}\n<Final Answer> 1 </Final Answer>", "meta": {}}))
    path.write_text("\n".join(lines) + "\n")


def test_epochs_derive_steps_from_the_data(tmp_path):
    data = tmp_path / "rft.jsonl"
    _one_row_examples(data, 6, 10)
    base = ["model.name=tiny", f"data.train=[{data}]", "data.tokenizer=bytes", "data.layout=flat",
            "data.seq_len=256", "optim.batch_size=4", "steps=999"]
    # one bucket of 256: 3 rows of two short ones + 10 rows of one long one = 13 rows; 13 / 4 rows
    # per step = 3.25 steps per epoch; 1.5 epochs -> 4.875 -> 5 steps
    cfg = load_train_config(None, base + ["epochs=1.5"])
    assert cfg.steps == 5 and cfg.epochs == 1.5
    # buckets 128 / 256: 6 rows of 128 at 8 per step + 10 rows of 256 at 4 per step = 3.25 per epoch
    cfg = load_train_config(None, base + ["data.buckets=[128,256]", "epochs=2"])
    assert cfg.steps == 7
    assert load_train_config(None, base).steps == 999          # no epochs: steps as given
    with pytest.raises(ConfigError, match="epochs must be > 0"):
        load_train_config(None, base + ["epochs=0"])


def test_train_derives_steps_from_epochs_for_a_config_built_in_python(tmp_path):
    """`train()` on a TrainConfig that did not pass through load_train_config (the demo, the
    recipe's Python callers) trains the epochs too, not the `steps` placeholder."""
    from sprint_jax.config import from_dict
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    data = tmp_path / "rft.jsonl"
    _one_row_examples(data, 6, 10)
    cfg = from_dict(TrainConfig, {
        "model": {"name": "tiny", "dtype": "float32", "remat": "none", "loss_chunk": 0},
        "data": {"train": [str(data)], "tokenizer": "bytes", "layout": "flat", "seq_len": 256},
        "optim": {"batch_size": 4}, "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
        "checkpoint": {"every": 0, "resume": False}, "export": {"enabled": False},
        "steps": 999, "epochs": 1.5, "tensorboard": False, "plot": False})
    summary = train(cfg, tmp_path / "out", progress=False)
    assert summary["steps"] == 5                      # 13 rows / 4 per step x 1.5 epochs, as above
    assert "steps: 5\n" in (tmp_path / "out" / "config.yaml").read_text()
