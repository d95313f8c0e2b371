"""Training guards: a diverged run stops and exports nothing; one run per --out.

Every run is a real `sprint-jax train` subprocess on the tiny model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"

CONFIG = {
    "model": {"name": "tiny", "dtype": "float32", "remat": "none"},
    "data": {"train": [str(DATA)], "layout": "trie", "seq_len": 256, "overlong": "truncate", "tokenizer": "bytes"},
    "optim": {"lr": 3e-3, "batch_size": 2},
    "checkpoint": {"every": 2},
    "steps": 4, "log_every": 1, "tensorboard": False, "plot": False,
}


def _train(tmp: Path, out: Path, config: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    cfg = tmp / f"cfg_{out.name}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "sprint_jax.cli", "train", "--config", str(cfg), "--out", str(out),
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_diverged_training_stops_and_exports_nothing(tmp_path):
    """lr 1e30 without clipping: the loss is NaN from step 2. The run used to go on, save NaN
    checkpoints and export NaN weights with exit 0; now it stops with one line and exit 2, before
    any NaN state is written."""
    cfg = {**CONFIG, "optim": {"lr": 1e30, "clip_norm": 0.0, "batch_size": 2}}
    out = tmp_path / "run"
    p = _train(tmp_path, out, cfg)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("sprint-jax train: error: training diverged at step") and "nan" in last, last
    assert "Traceback" not in p.stderr
    assert not (out / "hf").exists() and not (out / "summary.json").exists()
    assert not [d for d in (out / "checkpoints").iterdir() if d.name.isdigit()]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] == losses[0] and losses[-1] != losses[-1]     # finite first, NaN last


def test_second_run_into_a_locked_out_exits_2_naming_the_holder(tmp_path):
    """Two runs into one --out interleaved metrics and raced on checkpoints. The holder here is a
    real process holding the directory's lock; the second `train` must stop before doing any work.
    When the holder dies (SIGKILL), its lock goes with it."""
    out = tmp_path / "run"
    from conftest import start_lock_holder
    holder = start_lock_holder(out)
    try:
        p = _train(tmp_path, out, CONFIG, timeout=120)
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        last = p.stderr.strip().splitlines()[-1]
        assert "is in use by another run" in last and f"pid {holder.pid}" in last, last
        assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    from sprint_jax import outlock
    with outlock.locked(out):            # a dead holder's lock is no lock
        info = json.loads((out / outlock.LOCK_FILE).read_text())
        assert info["pid"] == os.getpid()


def test_disk_full_at_export_is_one_line(tmp_path):
    """A write that finds no space (a real ENOSPC from the kernel: the export's temporary file is
    /dev/full) ends with one line and exit 2, not a traceback; the final checkpoint is on disk,
    so a rerun after freeing space only exports."""
    out = tmp_path / "run"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "_shard0.safetensors.tmp").symlink_to("/dev/full")
    p = _train(tmp_path, out, {**CONFIG, "checkpoint": {"every": 0}, "steps": 2})
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("sprint-jax train: error: out of disk space") and "rerun" in last, last
    assert (out / "checkpoints" / "2").is_dir()


def test_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path):
    """A real small file system (an 8 MiB tmpfs; needs root to mount, skipped otherwise): the first
    checkpoint does not fit, and the run says so in one line before orbax writes anything."""
    import pytest

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = mnt / "run"
        p = _train(tmp_path, out, {**CONFIG, "checkpoint": {"every": 1}, "steps": 2})
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        assert "Traceback" not in p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert "not enough disk space for checkpoint step 1" in last and "MiB are free" in last, last
        assert not [d for d in (out / "checkpoints").iterdir() if d.name.isdigit()]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
