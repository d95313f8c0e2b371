"""Multi-process training: 2 processes on 127.0.0.1 joined by jax.distributed (gloo CPU
collectives), each loading only its half of every batch, train to the same losses and weights as
1 process on the whole batch. Checkpoints are written by both processes together (orbax)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import xla_flags
from sprint_jax.model.hf import SafetensorsFile

pytestmark = pytest.mark.slow   # runs subprocesses (the `slow` marker: pyproject.toml)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"

CHILD = r"""
import sys
from sprint_jax.train.config import load_train_config
from sprint_jax.train.trainer import train

out, data, port, nproc, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dist = ({"coordinator": f"127.0.0.1:{port}", "num_processes": nproc, "process_id": pid} if nproc > 1 else {})
cfg = load_train_config(data={
    "model": {"name": "tiny", "dtype": "float32", "remat": "full"},
    "data": {"train": [data], "layout": "flat", "seq_len": 256, "overlong": "truncate", "tokenizer": "bytes"},
    "optim": {"lr": 3e-3, "warmup_steps": 1, "batch_size": 2},
    "mesh": {"data": -1, "fsdp": 1, "tensor": 1},
    "checkpoint": {"every": 2, "keep": 2},
    "distributed": dist, "steps": 3, "log_every": 1, "plot": False, "tensorboard": False,
})
s = train(cfg, out, progress=False)
print("DONE", s["processes"], s["devices"], s["final_loss"])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(out: Path, port: int, nproc: int, pid: int) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}     # one real CPU device each
    return subprocess.Popen([sys.executable, "-c", CHILD, str(out), str(DATA), str(port), str(nproc), str(pid)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _finish(p: subprocess.Popen) -> str:
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    assert p.returncode == 0, err[-3000:]
    return out


def _weights(path: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path / "model.safetensors")
    return {k: np.array(f.get(k)) for k in f.keys()}


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    multi, single = tmp_path / "multi", tmp_path / "single"
    procs = [_spawn(multi, port, 2, i) for i in range(2)] + [_spawn(single, 0, 1, 0)]
    outs = [_finish(p) for p in procs]
    assert "DONE 2 2" in outs[0] and "DONE 2 2" in outs[1] and "DONE 1 1" in outs[2]

    def losses(d):
        return [json.loads(l)["loss"] for l in (d / "metrics.jsonl").read_text().splitlines()]

    lm, ls = losses(multi), losses(single)
    assert len(lm) == len(ls) == 3
    np.testing.assert_allclose(lm, ls, rtol=1e-6)           # fp32; only the reduction order differs
    assert lm[2] < lm[0]
    wm, ws = _weights(multi / "hf"), _weights(single / "hf")
    assert wm.keys() == ws.keys()
    for k in ws:
        np.testing.assert_allclose(wm[k], ws[k], atol=1e-5, err_msg=k)
    assert sorted(d.name for d in (multi / "checkpoints").iterdir() if d.name.isdigit()) == ["2", "3"]
