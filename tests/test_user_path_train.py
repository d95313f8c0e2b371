"""`sprint-jax train` on a user's path: Ctrl-C at any moment (a real process, a real SIGINT) ends
with one line and exit code 130 saying what a rerun does; a rerun with another config is
refused instead of "resuming" a run it is not; --new-run starts over."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from sprint_jax.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"

CONFIG = {
    "model": {"name": "tiny", "dtype": "float32", "remat": "none", "loss_chunk": 0},
    "data": {"train": [str(DATA)], "layout": "trie", "seq_len": 256, "overlong": "truncate", "tokenizer": "bytes"},
    "optim": {"lr": 3e-3, "warmup_steps": 2, "batch_size": 2},
    "checkpoint": {"every": 3, "keep": 2},
    "steps": 6, "log_every": 1, "tensorboard": False, "plot": False,
}


def _config(tmp_path: Path, **changes) -> Path:
    cfg = {**CONFIG, **changes}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(cfg: Path, out: Path, *extra: str, code: str | None = None) -> subprocess.Popen:
    """`sprint-jax train` as its own process (the program's entry point, as the console script runs it)."""
    argv = ["train", "--config", str(cfg), "--out", str(out), "--no-progress", *extra]
    if code is None:
        cmd = [sys.executable, "-m", "sprint_jax.cli", *argv]
    else:
        cmd = [sys.executable, "-c", code, *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"train ended before {path} appeared: {proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.05)


def _wait_for_library(proc: subprocess.Popen, name: str, timeout: float = 120) -> None:
    """Until the process has mapped a shared library whose path holds `name` (jaxlib: it is
    importing JAX); 1 s where /proc cannot tell."""
    maps = Path(f"/proc/{proc.pid}/maps")
    if not maps.exists():
        time.sleep(1.0)
        return
    t0 = time.time()
    while name not in maps.read_text(errors="replace"):
        assert proc.poll() is None, f"train ended before loading {name}: {proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < timeout, f"{name} was not loaded"
        time.sleep(0.02)


def _interrupted_line(proc: subprocess.Popen) -> str:
    """The process's one line after the SIGINT: exit 130, nothing else of ours, no crash."""
    _, err = proc.communicate(timeout=300)
    assert "Fatal Python error" not in err and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    ours = [line for line in err.splitlines() if line.startswith("sprint-jax")]
    assert len(ours) == 1 and ours[0] == err.strip().splitlines()[-1], err[-3000:]
    assert ours[0].startswith("sprint-jax train: interrupted; "), ours
    return ours[0]


def test_ctrl_c_while_importing_or_compiling_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C while the first step compiled crashed the interpreter's exit (segmentation fault,
    rc 139) in 4 of 6 tries; during jax's import it aborted (SIGABRT) or printed a traceback.
    Interrupted while importing JAX and at three moments after the data is read (setup,
    init and first-step compiles), each process ends cleanly and says a rerun starts from step 0."""
    cfg = _config(tmp_path)
    for i, (after, delay) in enumerate((("jaxlib", 0.2), ("data_stats.json", 0.3), ("data_stats.json", 1.5),
                                        ("data_stats.json", 3.0))):
        out = tmp_path / f"run{i}"
        proc = _start(cfg, out)
        if after == "jaxlib":
            _wait_for_library(proc, after)
        else:
            _wait_for(out / after, proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        line = _interrupted_line(proc)
        steps = sorted(int(p.name) for p in (out / "checkpoints").glob("[0-9]*")) if (out / "checkpoints").exists() else []
        if steps:          # a loaded machine can reach a checkpoint within the delay
            assert f"resume from step {steps[-1]}" in line, line
        else:
            assert "starts from step 0" in line, line


def test_ctrl_c_mid_training_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
    cfg = _config(tmp_path, steps=40)
    out = tmp_path / "run"
    proc = _start(cfg, out)
    _wait_for(out / "checkpoints" / "3", proc)
    proc.send_signal(signal.SIGINT)
    line = _interrupted_line(proc)
    steps = sorted(int(p.name) for p in (out / "checkpoints").glob("[0-9]*"))
    assert steps and steps[-1] < 40
    assert f"resume from step {steps[-1]} (checkpoint {out / 'checkpoints' / str(steps[-1])})" in line, line


# A SIGINT delivered while a gc callback runs: Python prints "Exception ignored" and drops the
# KeyboardInterrupt, and the run used to go on to the end (exit 0). Here the gc callback raises
# the signal itself once training has logged a step, so the drop is certain.
DROPPED = r"""
import gc, os, signal, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
fired = []
def cb(phase, info):
    if not fired and phase == "start" and (out / "metrics.jsonl").exists():
        fired.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))                # the handler runs here, inside the callback
gc.callbacks.append(cb)
sys.argv = ["sprint-jax"] + sys.argv[1:]
from sprint_jax.cli import main
sys.exit(main())
"""


def test_ctrl_c_dropped_by_a_gc_callback_still_stops_training(tmp_path):
    cfg = _config(tmp_path, steps=40, checkpoint={"every": 2, "keep": 2})
    out = tmp_path / "run"
    proc = _start(cfg, out, code=DROPPED)
    line = _interrupted_line(proc)
    assert not (out / "hf").exists() and not (out / "summary.json").exists()
    steps = sorted(int(p.name) for p in (out / "checkpoints").glob("[0-9]*"))
    assert steps[-1] < 40 if steps else "starts from step 0" in line


# ---- a rerun is the same run, or a new one asked for ---------------------------------------------

def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_rerun_with_another_schedule_is_refused_naming_the_fields(tmp_path, capsys):
    """A finished 100-step run rerun with `--set steps=30` printed "resumed from step 100", wrote
    checkpoints/30 and overwrote config.yaml. Here: 4 steps, then reruns."""
    cfg = _config(tmp_path, steps=4, checkpoint={"every": 0})
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    saved = (out / "config.yaml").read_text()
    ckpts = lambda: sorted(int(p.name) for p in (out / "checkpoints").glob("[0-9]*"))  # noqa: E731
    assert ckpts() == [4]

    for changes, named in ((["steps=2"], "steps 4 -> 2"), (["steps=8"], "steps 4 -> 8"),
                           (["optim.lr=0.001", "data.seed=3"], "data.seed 0 -> 3; optim.lr 0.003 -> 0.001")):
        argv = ["train", "--config", str(cfg), "--out", str(out), "--no-progress"]
        assert main(argv + [a for c in changes for a in ("--set", c)]) == 2
        line = _err_line(capsys)
        assert named in line and "--new-run" in line and "checkpoints up to step 4" in line, line
        assert ckpts() == [4] and (out / "config.yaml").read_text() == saved

    # checkpoint.resume false: the directory's checkpoints are refused as before
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--set",
                 "checkpoint.resume=false"]) == 2
    assert "checkpoint.resume is false" in _err_line(capsys)

    # without the saved config.yaml the checkpoint itself says the run is longer than asked
    (out / "config.yaml").unlink()
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--set", "steps=2"]) == 2
    assert "step 4, past steps = 2" in _err_line(capsys)
    assert ckpts() == [4]
    (out / "config.yaml").write_text(saved)

    # how it is logged or saved may change: the run resumes (and has nothing left to do)
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--set", "log_every=2",
                 "--set", "checkpoint.keep=1", "--set", "checkpoint.resume=true"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed"] and summary["start_step"] == 4 and ckpts() == [4]

    # --new-run: a new run from step 0, nothing of the old one left
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--set", "steps=2",
                 "--new-run"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["resumed"] and summary["start_step"] == 0 and summary["steps"] == 2
    assert ckpts() == [2]
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 2


def test_new_run_is_in_the_help():
    p = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "train", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and "--new-run" in text and "DELETES its checkpoints" in text

