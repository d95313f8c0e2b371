"""`recipe run` killed with SIGKILL takes its stage process with it, and an immediate rerun works.

Before stages were tied to the runner, the stage (a `sprint-jax` subprocess) lived on with parent
PID 1: it kept its output directory's lock, so the rerun's same stage failed ("in use"), and it
went on writing into the log the rerun had just truncated.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sprint_jax.config import CONFIG_DIR

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie has exited: it only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait(cond, timeout: float, what: str):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _start(cfg: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sprint_jax.cli", "recipe", "run", str(cfg), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stage_of(runner: subprocess.Popen, out: Path, stage: str) -> int:
    """The pid of `stage`'s process once the runner has started it."""
    def started():
        state = out / "state.json"
        if not state.exists():
            return None
        try:
            rec = json.loads(state.read_text())["stages"].get(stage) or {}
        except ValueError:
            return None
        kids = _children(runner.pid)
        return kids[0] if rec.get("status") == "running" and kids else None
    return _wait(started, 120, f"stage {stage} to start")


def _kill(runner: subprocess.Popen, stage: int | None) -> None:
    """Leave nothing behind, whatever failed (a stage outliving its runner is this test's failure)."""
    for pid in ([runner.pid] if runner.poll() is None else []) + ([stage] if stage and _alive(stage) else []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    runner.wait(timeout=10)


def test_a_killed_runner_takes_its_stage_along_and_a_rerun_starts(tmp_path):
    d = yaml.safe_load((CONFIG_DIR / "recipe_tiny_cpu.yaml").read_text())
    d["curate"]["tasks"]["n"] = 40
    cfg, out = tmp_path / "recipe.yaml", tmp_path / "run"
    cfg.write_text(yaml.safe_dump(d))

    runner, stage = _start(cfg, out), None
    try:
        stage = _stage_of(runner, out, "curate")
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(timeout=10)
        _wait(lambda: not _alive(stage), 5, f"the curate stage (pid {stage}) to die with its runner")
    finally:
        _kill(runner, stage)

    # the immediate rerun resumes curate (its lock is free) and goes on to the next stage
    rerun, stage = _start(cfg, out), None
    try:
        stage = _stage_of(rerun, out, "train_sprint")
        state = json.loads((out / "state.json").read_text())["stages"]
        assert state["curate"]["status"] == "done", state["curate"]
        assert "in use" not in (out / "curate" / "log.txt").read_text()
        os.kill(rerun.pid, signal.SIGKILL)
        rerun.wait(timeout=10)
        _wait(lambda: not _alive(stage), 5, f"the train_sprint stage (pid {stage}) to die with its runner")
    finally:
        _kill(rerun, stage)
    said = rerun.stdout.read()
    assert "curate: running (resuming after running)" in said, said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_stage_side_of_the_tie_keeps_it_from_grandchildren_and_refuses_an_orphan():
    """A stage takes the runner's pid out of its environment (a process it starts is no stage)
    and exits at once when its runner is already gone (the pid named is not its parent)."""
    probe = ("import os, sys; from sprint_jax.interrupt import DIE_WITH_ENV, die_with_parent_from_env; "
             "die_with_parent_from_env(); print(DIE_WITH_ENV in os.environ)")
    from sprint_jax.interrupt import DIE_WITH_ENV
    mine = subprocess.run([sys.executable, "-c", probe], env={**os.environ, DIE_WITH_ENV: str(os.getpid())},
                          capture_output=True, text=True, timeout=60)
    assert mine.returncode == 0 and mine.stdout.strip() == "False", mine.stderr
    orphan = subprocess.run([sys.executable, "-c", probe], env={**os.environ, DIE_WITH_ENV: "1"},
                            capture_output=True, text=True, timeout=60)
    assert orphan.returncode == 1 and orphan.stdout == ""
