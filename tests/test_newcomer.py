"""What a new user meets first: timings that say what they measure, one list of benchmarks,
and a dev.sh whose environment runs every README command."""
from __future__ import annotations

import io
import os
import re
import subprocess
import time
from pathlib import Path

from sprint_jax.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fixed_clock(ago: list[tuple[float, float]]):
    """A CompileClock holding compilation spans given as seconds before now, (start, end)."""
    from sprint_jax.eval.evaluate import CompileClock

    clock = CompileClock()
    now = time.time()
    clock.spans = [(now - a, now - b) for a, b in ago]
    return clock


def test_split_seconds_takes_the_compilation_of_the_timing_just_ended():
    from sprint_jax.infer.infer_cli import split_seconds

    clock = _fixed_clock([(90.0, 80.0),                   # before the timing
                          (30.0, 20.0), (25.0, 15.0)])    # inside it, overlapping: 15 s together
    assert split_seconds(50.0, clock) == "35.00 s + 15.00 s compiling"
    assert split_seconds(50.0, None) == "50.00 s"
    assert split_seconds(0.002, _fixed_clock([]), 1000, "ms", ".1f") == "2.0 ms"


def test_infer_and_generate_start_the_clock_that_sees_a_first_call_compile():
    """The clock infer and generate use collects JAX's compile spans while started, none after."""
    import jax
    import jax.numpy as jnp

    from sprint_jax.eval.evaluate import CompileClock

    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + x[::-1])
    x = jnp.arange(7.0)
    x.block_until_ready()
    clock = CompileClock().start()
    try:
        f(x).block_until_ready()
        n = len(clock.spans)
        f(x).block_until_ready()          # cached: nothing compiles
        assert len(clock.spans) == n
    finally:
        clock.stop()
    now = time.time()
    assert n > 0 and clock.within(now - 60, now) > 0
    f(x + 1).block_until_ready()          # after stop: the listener is gone
    assert len(clock.spans) == n


def test_live_display_prints_compilation_apart_from_the_stage_times():
    """A sync that took 20 s, 10 s of it compiling, is not shown as a 20000 ms sync."""
    from sprint_jax.infer.infer_cli import LiveDisplay
    from sprint_jax.infer.orchestrator import Event, RunRecord, StageRecord

    clock = _fixed_clock([(15.0, 5.0)])
    out = io.StringIO()
    display = LiveDisplay(out, width=100, compile_clock=clock)
    rec = RunRecord(query="Q", mode="parallel", config={}, wall_s=20.0)
    display(Event("sync", rec, StageRecord(1, "", 0, "", join="reprefill", sync_tokens=0, sync_s=20.0)))
    display(Event("sync", rec, StageRecord(2, "", 0, "", join="merge", sync_tokens=3, sync_s=20.0)))
    display(Event("end", rec))
    text = out.getvalue()
    assert "sync: 0 tokens prefilled onto the planner (reprefill join) in 10000.0 ms + 10000.0 ms compiling" in text
    assert "(merge join), 3 tokens run, in 10000.0 ms + 10000.0 ms compiling" in text
    assert "wall clock:         10.00 s + 10.00 s compiling" in text


def test_generate_prints_its_time_split_into_running_and_compiling(hf_untied, capsys):
    assert main(["generate", "--model", str(hf_untied), "--token-ids", "5,17,101", "--max-new-tokens", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"stop: length, \d+\.\d\d s \+ \d+\.\d\d s compiling; ids: \[", last), last
    assert "incl. compile" not in last


def test_top_level_and_bench_help_list_the_same_benchmarks(capsys, monkeypatch):
    from sprint_jax.bench.cli import BENCHES

    monkeypatch.setenv("COLUMNS", "400")          # argparse wraps help at the terminal width
    assert main(["--help"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("bench ")]
    top_names = {n.strip() for n in line.split("benchmarks:")[1].split(",")}
    try:
        main(["bench", "--help"])
    except SystemExit as e:
        assert e.code == 0
    bench_names = set(re.findall(r"sprint-jax bench ([a-z-]+) ", capsys.readouterr().out))
    assert top_names == bench_names == set(BENCHES)
    assert {"decode", "kernels", "replay", "serve", "train"} <= top_names     # not an empty parse


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv stand-in whose python and sprint-jax only log their arguments (no network, no pip)."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "sprint-jax"):
        exe = venv / "bin" / name
        exe.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        exe.chmod(0o755)
    return venv, log


def test_dev_sh_installs_the_serve_extra_for_sprint_jax_commands_once(tmp_path):
    venv, log = _fake_venv(tmp_path)
    env = dict(os.environ, SPRINT_JAX_VENV=str(venv))

    def dev(*args) -> list[str]:
        log.write_text("")
        r = subprocess.run(["bash", str(ROOT / "dev.sh"), *args], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return log.read_text().splitlines()

    first = dev("sprint-jax", "serve", "--help")
    installs = [c for c in first if c.startswith("python -m pip install")]
    assert len(installs) == 1 and "[serve]" in installs[0].split()[-1], first
    assert first[-1] == "sprint-jax serve --help"
    assert dev("sprint-jax", "serve", "--help") == ["sprint-jax serve --help"]     # stamped: no reinstall
    assert dev("demo", "--steps", "5") == ["sprint-jax demo --steps 5"]             # the same environment


def test_the_demos_next_commands_compare_the_two_evals_they_write(tmp_path, monkeypatch):
    """The demo's closing `next:` list ends its two evals with the paper's table of them: an `eval
    compare` of exactly the directories those evals write."""
    import shlex

    from sprint_jax.demo import DemoConfig, _next_commands

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "demo"
    lines = _next_commands(DemoConfig(), out, {"sprint": str(out / "train/sprint/hf"),
                                               "rft": str(out / "train/rft/hf")}, "Q: 8 5 2 1\n")
    argvs = [shlex.split(x) for x in lines[1:] if x.startswith("  ")]
    evals = [a for a in argvs if a[1:3] != ["eval", "compare"] and a[1] == "eval"]
    outs = [a[a.index("--out") + 1] for a in evals]
    (compare,) = [a for a in argvs if a[1:3] == ["eval", "compare"]]
    assert len(outs) == 2 and compare[3:] == outs, lines


def test_benchmarks_keep_one_row_per_command_in_each_table():
    """docs/benchmarks.md holds the current figures: a table never keeps an old row beside the new one
    for the same command (its first cell's code spans)."""
    tables, current = [], []
    for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    assert len(tables) > 5
    for table in tables:
        commands = [" ".join(re.findall(r"`([^`]+)`", row.split("|")[1])) for row in table[2:]]
        commands = [c for c in commands if c]
        assert len(commands) == len(set(commands)), (table[0], sorted(c for c in commands if commands.count(c) > 1))


def test_the_lock_holder_helper_leaves_no_pipe_open(tmp_path):
    """The suite's lock-holding process (conftest.start_lock_holder) is read once and its pipe closed:
    an open pipe left behind is a ResourceWarning in whichever test the collector runs under."""
    from conftest import start_lock_holder

    holder = start_lock_holder(tmp_path)
    try:
        assert holder.stdout.closed
    finally:
        holder.kill()
        holder.wait()
