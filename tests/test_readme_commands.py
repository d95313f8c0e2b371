"""Every command line README.md shows is run by a test, as written, or is mapped here to the test
that runs the same command, or (the few whose run takes minutes to hours, keys or a 7B model) is
checked cheaply here; `CONCRETE` says which for each, so a command added to the README without a
test fails `test_every_readme_command_is_accounted_for`.

What counts as a command line: a line of a ```bash block (its `$B`-style variables expanded), or an
inline code span, that starts with `sprint-jax SUB ...`, `./dev.sh` or `python -m sprint_jax`.
Three kinds:
  * a name (`sprint-jax train`, `./dev.sh`): the command exists;
  * a synopsis (placeholders such as DIR or FILE, `[optional]` parts, `a\\|b` alternatives, `*`
    globs): the subcommand exists and takes every flag it shows; the plan engine synopsis's
    required part also goes through the CLI up to the TPU compile (`test_readme_plan_engine_...`);
  * a concrete command: an entry of CONCRETE.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sprint_jax.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
STARTS = ("sprint-jax ", "./dev.sh", "python -m sprint_jax", "SPRINT_JAX_TEST_FULL_OPT=1 ./dev.sh")

DEMO_NEXT = "tests/test_readme_commands.py::test_the_demos_next_commands_run_as_written"
DEV_SH = "tests/test_readme_commands.py::test_dev_sh_commands_run_as_written"
HERE = "tests/test_readme_commands.py::test_cheap_commands_run_as_written"
# command -> (how it is tested, where / why). how: "run" (a test runs exactly this), "same" (a test
# runs the same command with the differences said), "checked" (parsed and its inputs validated
# here; not run: the reason is given).
CONCRETE: dict[str, tuple[str, str]] = {
    "./dev.sh demo": ("same", "tests/test_demo.py::test_scaled_down_demo_produces_every_artifact (the demo with a "
                              "tiny budget; the full one is ~7 minutes) and " + DEV_SH + " (dev.sh's dispatch)"),
    "./dev.sh test": ("run", DEV_SH + " (against a stand-in venv; CI runs the real one)"),
    "./dev.sh test --fast": ("run", DEV_SH),
    "SPRINT_JAX_TEST_FULL_OPT=1 ./dev.sh test": ("run", DEV_SH),
    'sprint-jax infer --model runs/demo/train/sprint/hf --config runs/demo/orchestrator.yaml "Q: 8 5 2 1"':
        ("run", DEMO_NEXT),
    "sprint-jax eval --model runs/demo/train/sprint/hf --config runs/demo/orchestrator.yaml --data chains "
    "--out runs/eval_sprint": ("run", DEMO_NEXT),
    "sprint-jax eval --model runs/demo/train/rft/hf --config runs/demo/orchestrator.yaml --data chains "
    "--mode sequential --out runs/eval_rft": ("run", DEMO_NEXT),
    "sprint-jax eval compare runs/eval_sprint runs/eval_rft": ("run", DEMO_NEXT),
    "sprint-jax serve --model runs/demo/train/sprint/hf --config runs/demo/orchestrator.yaml":
        ("checked", DEMO_NEXT + " parses it and loads its config; it listens on :8000 until stopped, which a shared "
                                "test machine cannot promise free: serving is run by tests/test_serve*.py"),
    "sprint-jax serve --model runs/sft_sprint/hf --port 8000":
        ("checked", "test_synopses_and_flags_exist parses it; runs/sft_sprint is the reader's own run"),
    "sprint-jax train --config configs/sft_tiny_cpu.yaml --out runs/tiny":
        ("same", "tests/test_eval_analysis.py::test_train_writes_the_fingerprint_and_eval_refuses_overlap (this "
                 "config, 1 step instead of 100); tests/test_shipped_configs.py reads its data from an installed copy"),
    "sprint-jax eval --help": ("run", HERE),
    "sprint-jax recipe run configs/recipe_tiny_cpu.yaml --out runs/recipe_tiny":
        ("same", "tests/test_recipe.py::test_tiny_recipe_end_to_end_rerun_and_one_change (this config, shrunk "
                 "problem counts; ~6 minutes as written)"),
    "python -m sprint_jax.rl.keyed --out runs/keyed_sft":
        ("checked", HERE + " runs its --help; training both models takes ~10 minutes"),
    "sprint-jax rl --config configs/rl_keyed_cpu.yaml --out runs/rl_keyed":
        ("checked", "test_synopses_and_flags_exist parses it and loads the config; its policy is the previous "
                    "command's model"),
}


def readme_commands() -> list[str]:
    """The README's command lines (module docstring), whitespace normalised, in order."""
    text = README.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        env = {}
        for line in block.splitlines():
            line = re.split(r"\s+#", line)[0].strip()
            m = re.match(r'^([A-Z]+)="(.*)"$', line)
            if m:
                env[m.group(1)] = m.group(2)
                continue
            for k, v in env.items():
                line = line.replace("$" + k, v)
            if line.startswith(STARTS):
                found.append(" ".join(line.split()))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose) if " ".join(s.split()).startswith(STARTS)]
    return found


def kind_of(command: str) -> str:
    words = command.split()
    if command.startswith("sprint-jax ") and len(words) == 2 or command == "./dev.sh":
        return "name"
    placeholder = re.compile(r"^[A-Z][A-Z_]*(\.\.\.|\.jsonl)?$")
    if any(t in command for t in ("[", "\\|", "*")) or any(placeholder.match(w) for w in words[1:]):
        return "synopsis"
    return "concrete"


def test_every_readme_command_is_accounted_for():
    commands = readme_commands()
    assert len(commands) > 30                                  # not an empty parse
    concrete = {c for c in commands if kind_of(c) == "concrete"}
    assert concrete == set(CONCRETE), {"in the README, not here": sorted(concrete - set(CONCRETE)),
                                       "here, not in the README": sorted(set(CONCRETE) - concrete)}
    for command, (how, where) in CONCRETE.items():
        assert how in ("run", "same", "checked"), command
        for node in re.findall(r"(tests/test_\w+\.py)::(\w+)", where):     # each named test exists
            assert f"def {node[1]}(" in (ROOT / node[0]).read_text(), node


def _parser(sub: str) -> argparse.ArgumentParser:
    module = importlib.import_module(COMMANDS[sub][0])
    p = argparse.ArgumentParser(prog=f"sprint-jax {sub}")
    module.add_arguments(p)
    return p


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def test_synopses_and_flags_exist():
    """Each command named, shown as a synopsis or concrete: its subcommand exists and takes every
    --flag it shows; a concrete sprint-jax line parses as written."""
    from sprint_jax.bench.cli import BENCHES

    for command in readme_commands():
        if not command.startswith("sprint-jax "):
            continue
        words = command.split()
        sub = words[1]
        assert sub in COMMANDS, command
        if sub == "bench" and len(words) > 2:
            assert set(words[2].split("\\|")) <= set(BENCHES), command
            continue
        if len(words) == 2:
            continue
        p = _parser(sub)
        flags = {w.split("=")[0] for w in re.findall(r"--[a-z][a-z-]*", command)}
        assert flags <= _flags(p), (command, sorted(flags - _flags(p)))
        if kind_of(command) == "concrete" and "--help" not in words:
            p.parse_args(shlex.split(command)[2:])


def test_cheap_commands_run_as_written(capsys):
    """`sprint-jax eval --help` and the keyed-chains trainer's --help (its run: ~10 minutes); the RL
    config the README runs after it loads (its policy is that run's model)."""
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0 and "--samples" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "-m", "sprint_jax.rl.keyed", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "--out" in r.stdout, r.stderr[-1000:]
    from sprint_jax.config import load_config
    from sprint_jax.rl.config import RLConfig

    cfg = load_config(RLConfig, "configs/rl_keyed_cpu.yaml")     # every field known and well typed
    assert cfg.policy.path == "runs/keyed_sft/sprint/hf"       # what the keyed trainer writes


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "sprint-jax", "ruff", "pytest"):
        exe = venv / "bin" / name
        exe.write_text(f'#!/bin/sh\necho "{name} FULL_OPT=${{SPRINT_JAX_TEST_FULL_OPT-}} $*" >> "{log}"\n')
        exe.chmod(0o755)
    return venv, log


def test_dev_sh_commands_run_as_written(tmp_path):
    """`./dev.sh test`, `./dev.sh test --fast`, `SPRINT_JAX_TEST_FULL_OPT=1 ./dev.sh test` and `./dev.sh
    demo`, each as the README writes it, against a venv whose tools log their arguments: ruff, then
    the suite (the fast tier without the slow tests); the demo command in the same environment."""
    venv, log = _fake_venv(tmp_path)
    base = dict(os.environ, SPRINT_JAX_VENV=str(venv))
    base.pop("SPRINT_JAX_TEST_FULL_OPT", None)

    def run(line: str) -> list[str]:
        log.write_text("")
        words = shlex.split(line)
        env = dict(base)
        while "=" in words[0]:
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        assert words[0] == "./dev.sh"
        r = subprocess.run(["bash", str(ROOT / "dev.sh"), *words[1:]], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return [c for c in log.read_text().splitlines() if not c.startswith("python ")]

    full = run("./dev.sh test")
    assert full[0].startswith("ruff FULL_OPT= check") and full[1].startswith("pytest FULL_OPT= tests")
    assert "not slow" not in full[1]
    fast = run("./dev.sh test --fast")
    assert fast[1].startswith("pytest FULL_OPT= tests") and fast[1].endswith("-m not slow")
    assert run("SPRINT_JAX_TEST_FULL_OPT=1 ./dev.sh test")[1].startswith("pytest FULL_OPT=1 tests")
    assert run("./dev.sh demo") == ["sprint-jax FULL_OPT= demo"]


def test_readme_plan_engine_command_fits_and_reaches_the_compile(monkeypatch, capsys):
    """The plan engine synopsis's required part, as written, goes through the CLI (flags, model,
    mesh, the planner's fit check) up to the TPU compile, which is stopped here (minutes of compile
    on a CPU host; tests/test_plan_engine.py compiles engine programs for v5e). Without a --mesh it
    does not fit by the estimate (275.4 GiB per chip: 32 runs do not split over data=64, so every
    chip holds the whole 252.5 GiB KV pool)."""
    from sprint_jax.plan import engine as pe

    (synopsis,) = [c for c in readme_commands() if c.startswith("sprint-jax plan engine")]
    required = re.sub(r"\s*\[[^]]*\]", "", synopsis)
    argv = shlex.split(required)[1:]

    class Reached(Exception):
        pass

    seen = []

    def stop(shape, where, *a, **k):
        seen.append((shape, where))
        raise Reached

    monkeypatch.setattr(pe, "engine_rows", stop)
    monkeypatch.setattr("sprint_jax.plan.compile.compiler_available", lambda slices: None, raising=False)
    with pytest.raises(Reached):
        main(argv)
    (shape, where), = seen
    assert where.chips == 64 and shape.mesh == (32, 1, 2)
    assert pe.fits(shape, where.chip.hbm_bytes, fill=1.0)
    without_mesh = [a for a in argv if a not in ("--mesh", "tensor=2")]
    capsys.readouterr()
    assert main(without_mesh) == 2                             # the command as the README wrote it before
    assert "275.4 GiB per chip by the planner's estimate" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demos_next_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The Quickstart's block after the demo, line by line as written, in a directory holding a demo
    run (a tiny budget: the models are the demo's architecture scaled down, so their scores are
    not the README's): infer, both evals of the 100 held-out problems, eval compare; serve is
    parsed and its config loaded (it would listen until stopped)."""
    from sprint_jax.config import from_dict
    from sprint_jax.demo import DemoConfig, run_demo

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "demo"
    cfg = from_dict(DemoConfig, {
        "train_problems": 24, "test_problems": 3, "steps": 3, "batch_size": 4, "seq_len": 256, "warmup_steps": 1,
        "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1}, "out": str(out)})
    run_demo(cfg, out, progress=False)
    capsys.readouterr()
    block = [c for c in readme_commands() if "runs/demo/" in c or c.startswith("sprint-jax eval compare runs/")]
    assert len(block) == 5 and block[-1].startswith("sprint-jax serve")
    for command in block[:-1]:
        argv = shlex.split(command)[1:]
        if argv[0] == "eval" and argv[1] != "compare":
            argv.append("--no-progress")           # the progress bar only (stderr)
        assert main(argv) == 0, (command, capsys.readouterr().err[-2000:])
        printed = capsys.readouterr().out
        assert printed.strip(), command
    for run in ("runs/eval_sprint", "runs/eval_rft"):
        report = json.loads((tmp_path / run / "report.json").read_text())
        assert report["n"] == 100, run
    assert "accuracy" in printed                    # eval compare's table
    serve = shlex.split(block[-1])[1:]
    args = _parser("serve").parse_args(serve[1:])
    from sprint_jax.infer.infer_cli import config_from_args

    assert config_from_args(args).max_total_tokens > 0
