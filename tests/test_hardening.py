"""What a hostile user broke (issue 12), each checked through the real command or loader: one
line and exit code 2 for a mistake, never a traceback, never a silent wrong result."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sprint_jax.cli import main
from sprint_jax.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# ---- YAML numbers ---------------------------------------------------------------------------

def test_yaml_numbers_without_a_dot_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `2e-5` and `1.0e6` as strings, so the README's own
    `--set optim.lr=2e-5` was refused. A number field takes what the text spells."""
    from sprint_jax.train.config import TrainConfig

    f = tmp_path / "c.yaml"
    f.write_text("data: {train: [x.jsonl]}\noptim: {lr: 2e-5, eps: 1.0e-8}\n")
    cfg = load_config(TrainConfig, f, ["optim.b2=1e-1", "steps=1e3", "data.seq_len=4096"])
    assert cfg.optim.lr == 2e-5 and cfg.optim.eps == 1e-8 and cfg.optim.b2 == 0.1
    assert cfg.steps == 1000 and isinstance(cfg.steps, int)
    with pytest.raises(ConfigError, match=r"^steps: expected an integer, got 2.5"):
        load_config(TrainConfig, f, ["steps=2.5"])
    with pytest.raises(ConfigError, match=r"optim.lr: expected a finite number"):
        load_config(TrainConfig, f, ["optim.lr=.nan"])
    with pytest.raises(ConfigError, match=r"optim.lr: expected a number, got 'fast'"):
        load_config(TrainConfig, f, ["optim.lr=fast"])


# ---- demo ------------------------------------------------------------------------------------

def test_demo_rejects_bad_settings_before_curating(tmp_path, capsys):
    t0 = time.time()
    assert main(["demo", "--set", "steps=-1", "--out", str(tmp_path / "d"), "--no-progress"]) == 2
    assert "steps must be >= 1, got -1" in _err_line(capsys)
    assert main(["demo", "--set", "model.num_attention_heads=3", "--out", str(tmp_path / "d"), "--no-progress"]) == 2
    assert "num_attention_heads (3) must be a multiple" in _err_line(capsys)
    assert not (tmp_path / "d").exists() and time.time() - t0 < 30      # no curation happened
