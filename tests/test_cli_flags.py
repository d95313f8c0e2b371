"""One flag name per option across commands, with one meaning: `--dtype`, `--tokenizer`,
`--attention-impl`, and the OrchestratorConfig flags derived from the dataclass."""
from __future__ import annotations

import argparse
import dataclasses
import importlib

import pytest

from sprint_jax.bench.cli import BENCHES
from sprint_jax.cli import COMMANDS
from sprint_jax.dtypes import DTYPE_NAMES
from sprint_jax.infer.orchestrator import OrchestratorConfig


def _parser(command: str, bench: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    if bench:
        module, add, _, _ = BENCHES[bench]
        getattr(importlib.import_module(module), add)(p)
    else:
        importlib.import_module(COMMANDS[command][0]).add_arguments(p)
    return p


def _option(p: argparse.ArgumentParser, flag: str):
    found = [a for a in p._actions if flag in a.option_strings]
    return found[0] if found else None


RUNTIME = [("generate", None), ("infer", None), ("eval", None), ("bench", "decode")]


@pytest.mark.parametrize("command, bench", RUNTIME + [("convert", None), ("bench", "kernels")])
def test_dtype_flag_is_spelled_the_same(command, bench):
    a = _option(_parser(command, bench), "--dtype")
    assert a is not None and tuple(a.choices) == DTYPE_NAMES
    if (command, bench) in RUNTIME:           # where a model runs, it sets parameters and compute
        assert "parameter and compute dtype" in a.help


@pytest.mark.parametrize("command", ["generate", "infer", "eval"])
def test_tokenizer_flag_is_spelled_the_same(command):
    a = _option(_parser(command), "--tokenizer")
    assert a is not None and a.metavar == "qwen2|DIR"
    assert all(_option(_parser(command), f) is None for f in ("--qwen2-tokenizer", "--attention"))


@pytest.mark.parametrize("command, bench", [("infer", None), ("eval", None), ("bench", "decode")])
def test_attention_impl_flag_is_spelled_the_same(command, bench):
    a = _option(_parser(command, bench), "--attention-impl")
    assert a is not None and tuple(a.choices) == ("xla", "pallas")


@pytest.mark.parametrize("command", ["infer", "eval"])
def test_every_orchestrator_field_has_its_flag(command):
    p = _parser(command)
    for f in dataclasses.fields(OrchestratorConfig):
        a = _option(p, "--" + f.name.replace("_", "-"))
        assert a is not None and a.dest == f.name, f.name


def test_demo_flags_are_derived_from_its_config():
    from sprint_jax.config import flag_overrides, load_config
    from sprint_jax.demo import DemoConfig

    p = _parser("demo")
    for f in dataclasses.fields(DemoConfig):
        if f.type in ("int", "float", "str"):
            assert _option(p, "--" + f.name.replace("_", "-")) is not None, f.name
    args = p.parse_args(["--steps", "7", "--lr", "0.01", "--out", "x/y"])
    cfg = load_config(DemoConfig, None, flag_overrides(args, DemoConfig))
    assert (cfg.steps, cfg.lr, cfg.out, cfg.seed) == (7, 0.01, "x/y", 0)
