"""Exact resume ("Resume is exact", docs/design.md "Training"): 6 steps straight == 3 steps, the
process SIGKILLed after step 4, then resumed from the step-3 checkpoint for 3 more: the same
losses and the same final weights, bitwise on CPU. A corrupt latest checkpoint is detected, moved
aside loudly, and the previous one used (again ending bit-identical).

Every run is a real `python` subprocess: the straight run through `sprint-jax train`, the killed
and resumed ones through the `train()` API (a step callback does the SIGKILL).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"

CONFIG = {
    "model": {"name": "tiny", "dtype": "float32", "remat": "none"},
    "data": {"train": [str(DATA)], "layout": "trie", "seq_len": 256, "overlong": "truncate", "tokenizer": "bytes"},
    "optim": {"lr": 3e-3, "warmup_steps": 2, "batch_size": 2, "weight_decay": 0.01},
    "checkpoint": {"every": 3, "keep": 2},
    "steps": 6, "log_every": 1,
}

CHILD = r"""
import json, os, signal, sys
from sprint_jax.train.config import load_train_config
from sprint_jax.train.trainer import train

out, kill_after = sys.argv[1], int(sys.argv[2])
cfg = load_train_config(data=json.loads(sys.argv[3]))

def preempt(ev):
    if ev.step == kill_after:
        ev.checkpointer.wait()                      # the step-3 save has landed on disk
        os.kill(os.getpid(), signal.SIGKILL)

train(cfg, out, progress=True, callbacks=[preempt])
"""


def _run(out: Path, kill_after: int = 0, cache: Path | None = None, cli: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if cache is not None:     # same executables in every run: faster, and still independent processes
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if cli:
        cfg = out.parent / "straight.yaml"
        cfg.write_text(yaml.safe_dump(CONFIG))
        cmd = [sys.executable, "-m", "sprint_jax.cli", "train", "--config", str(cfg), "--out", str(out)]
    else:
        cmd = [sys.executable, "-c", CHILD, str(out), str(kill_after), json.dumps(CONFIG)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _losses(out: Path) -> dict[int, tuple[float, float, int]]:
    """step -> (loss, lr, tokens seen so far) from metrics.jsonl."""
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs]
    assert steps == sorted(set(steps)), f"metrics.jsonl has repeated or unordered steps: {steps}"
    return {r["step"]: (r["loss"], r["lr"], r["tokens"]) for r in recs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    cache = tmp / "jax_cache"
    straight, resumed = tmp / "straight", tmp / "resumed"
    p = _run(straight, cache=cache, cli=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["steps"] == 6              # the CLI prints the summary as JSON
    k = _run(resumed, kill_after=4, cache=cache)
    assert k.returncode == -signal.SIGKILL, (k.returncode, k.stderr[-3000:])
    assert sorted(int(d.name) for d in (resumed / "checkpoints").iterdir() if d.name.isdigit()) == [3]
    assert max(_losses(resumed)) == 4                      # step 4 was logged before the kill
    r = _run(resumed, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    return {"tmp": tmp, "cache": cache, "straight": straight, "resumed": resumed, "resume_log": r.stderr}


@pytest.mark.slow
def test_resume_after_kill_is_bitwise(runs):
    straight, resumed = runs["straight"], runs["resumed"]
    assert "resumed from step 3" in runs["resume_log"]
    assert "attention: xla body (trie layout on cpu" in runs["resume_log"]   # which body ran
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b                                           # float equality, every step
    assert a[6][0] < a[1][0]
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((resumed / "summary.json").read_text())
    assert sb["resumed"] and sb["start_step"] == 3 and not sa["resumed"]
    wa = (straight / "hf" / "model.safetensors").read_bytes()
    wb = (resumed / "hf" / "model.safetensors").read_bytes()
    assert wa == wb                                         # final weights bit-identical
    assert (straight / "loss.png").stat().st_size > 1000 and (resumed / "loss.png").exists()
    assert any((straight / "tb").iterdir())


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_loudly(runs):
    straight = runs["straight"]
    final_weights = (straight / "hf" / "model.safetensors").read_bytes()
    ckpt6 = straight / "checkpoints" / "6"
    files = [f for f in (ckpt6 / "state").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files
    for f in files:                                         # silent damage: bytes overwritten, sizes kept
        b = bytearray(f.read_bytes())
        n = max(1, len(b) // 10)
        b[len(b) // 3: len(b) // 3 + n] = b"Z" * n
        f.write_bytes(bytes(b))
    p = _run(straight, cache=runs["cache"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "WARNING" in p.stderr and "corrupt or incomplete" in p.stderr and "checkpoints/6" in p.stderr
    assert "resumed from OLDER checkpoint step 3" in p.stderr
    assert list((straight / "checkpoints_quarantine").iterdir())
    assert (straight / "hf" / "model.safetensors").read_bytes() == final_weights
    assert sorted(_losses(straight)) == [1, 2, 3, 4, 5, 6]


def test_fingerprint_mismatch_is_detected(tmp_path, capsys):
    """Arrays that read fine but differ from what was saved (the fingerprint written at save time)
    are rejected too: the previous checkpoint is used and the bad one quarantined."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sprint_jax.train.checkpoint import Checkpointer, NoValidCheckpoint

    def state(step):
        return {"step": jnp.int32(step), "params": {"w": jnp.full((3, 5), float(step))}}

    ck = Checkpointer(tmp_path / "checkpoints", keep=3, async_save=False)
    ck.save(1, state(1), {"rows": 10})
    ck.save(2, state(2), {"rows": 20})
    ck.close()
    meta = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
    m = json.loads(meta.read_text())
    m["fingerprint"][0][0] += 1.0                            # as if one weight changed on disk
    meta.write_text(json.dumps(m))
    abstract = jax.eval_shape(lambda: state(0))
    restored, got = Checkpointer(tmp_path / "checkpoints").restore_latest(abstract)
    assert got["rows"] == 10 and int(restored["step"]) == 1
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.ones((3, 5)))
    err = capsys.readouterr().err
    assert "do not match the fingerprint" in err and "OLDER checkpoint step 1" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    # nothing valid left at all: a clear error, not a silent fresh start
    for f in (tmp_path / "checkpoints" / "1" / "meta").iterdir():
        f.write_text("{not json")
    with pytest.raises(NoValidCheckpoint):
        Checkpointer(tmp_path / "checkpoints").restore_latest(abstract)


@pytest.mark.parametrize("damage", ["swapped_values", "nan"])
def test_silently_changed_arrays_are_detected(tmp_path, capsys, damage):
    """Data that reads fine but is not what was saved. Two values swapped keep every
    per-leaf sum (the old fingerprint passed them), and a NaN compares false with everything (it
    passed too, and training resumed into NaN). The bits' checksum written at save time and the
    finiteness check catch both; the checkpoint is quarantined and the previous one used."""
    import shutil

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sprint_jax.train.checkpoint import Checkpointer

    w = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)

    def state(step, arr):
        return {"step": jnp.int32(step), "params": {"w": jnp.asarray(arr)}}

    bad = w.copy()
    if damage == "swapped_values":
        bad[0, 0], bad[3, 2] = w[3, 2], w[0, 0]
    else:
        bad[2, 1] = np.nan
    ck = Checkpointer(tmp_path / "checkpoints", keep=3, async_save=False)
    ck.save(1, state(1, w - 1), {"rows": 10})
    ck.save(2, state(2, w), {"rows": 20})
    ck.close()
    # the same step written from the damaged arrays, unchecked, stands in for damage on disk
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as other:
        other.save(tmp_path / "other", state(2, bad))
        other.wait_until_finished()
    target = tmp_path / "checkpoints" / "2" / "state"
    shutil.rmtree(target)
    shutil.copytree(tmp_path / "other", target)
    abstract = jax.eval_shape(lambda: state(0, w))
    restored, got = Checkpointer(tmp_path / "checkpoints").restore_latest(abstract)
    assert got["rows"] == 10 and int(restored["step"]) == 1
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), w - 1)
    err = capsys.readouterr().err
    assert "OLDER checkpoint step 1" in err
    assert ("checksum" in err) if damage == "swapped_values" else ("non-finite" in err)
    assert list((tmp_path / "checkpoints_quarantine").iterdir())


def test_non_finite_state_is_never_saved(tmp_path):
    import jax.numpy as jnp

    from sprint_jax.train.checkpoint import Checkpointer, NonFiniteState

    ck = Checkpointer(tmp_path / "checkpoints", keep=3, async_save=False)
    with pytest.raises(NonFiniteState, match=r"params.*w"):
        ck.save(1, {"step": jnp.int32(1), "params": {"w": jnp.array([1.0, jnp.inf])}}, {"rows": 1})
    ck.close()
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


def test_flipped_bytes_in_a_data_file_are_caught(tmp_path, capsys):
    """A reported failure, reproduced: 300 bytes inverted inside the latest checkpoint's largest
    data file. orbax reads it without complaint (random float32 data is stored nearly raw), the
    values come back changed, some NaN; the old fingerprint passed them and training resumed into
    NaN."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sprint_jax.train.checkpoint import Checkpointer

    w = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)

    def state(step, arr):
        return {"step": jnp.int32(step), "params": {"w": jnp.asarray(arr)}}

    ck = Checkpointer(tmp_path / "checkpoints", keep=3, async_save=False)
    ck.save(1, state(1, w - 1), {"rows": 10})
    ck.save(2, state(2, w), {"rows": 20})
    ck.close()
    data = max((f for f in (tmp_path / "checkpoints" / "2" / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
               key=lambda f: f.stat().st_size)
    b = bytearray(data.read_bytes())
    at = int(np.random.default_rng(1).integers(len(b) // 4, 3 * len(b) // 4))   # a spot that decodes to NaN
    b[at: at + 300] = bytes(x ^ 0xFF for x in b[at: at + 300])
    data.write_bytes(bytes(b))
    restored, meta = Checkpointer(tmp_path / "checkpoints").restore_latest(jax.eval_shape(lambda: state(0, w)))
    assert int(restored["step"]) == 1 and meta["rows"] == 10
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), w - 1)
    assert "OLDER checkpoint step 1" in capsys.readouterr().err
