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
