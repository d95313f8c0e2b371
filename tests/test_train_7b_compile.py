"""The real 7B train step (R1-Distill-Qwen-7B preset: bf16 compute, fp32 master weights + AdamW,
remat per layer) lowers and compiles from ShapeDtypeStructs on a fake 8-device fsdp mesh: every
sharding in the rules table is consistent at full size, and nothing is allocated. Memory is
printed by `sprint-jax bench train-memory`, not asserted here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import xla_flags

pytestmark = pytest.mark.slow   # runs subprocesses (the `slow` marker: pyproject.toml)

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json
import jax
from jax.sharding import PartitionSpec as P
from sprint_jax.bench.train import compile_train_step

compiled, lower_s, compile_s, setup = compile_train_step(
    "r1-distill-qwen-7b", devices=8, data=1, tensor=1, batch=8, seq_len=512, remat="full", dtype="bfloat16")
st = setup.abstract_state()
q = st["params"]["layers"]["q_proj"]["kernel"]
mu = st["opt_state"][1][0].mu["layers"]["down_proj"]["kernel"]
print("RESULT " + json.dumps({
    "params": sum(x.size for x in jax.tree.leaves(st["params"])),
    "q_shape": list(q.shape), "q_spec": str(q.sharding.spec), "mu_spec": str(mu.sharding.spec),
    "param_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(st["params"])}),
    "mesh": dict(setup.mesh.shape), "has_text": bool(compiled.as_text()),
    "lower_s": lower_s, "compile_s": compile_s}))
"""


def test_7b_train_step_compiles_on_fake_fsdp_mesh():
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert r["params"] == 7_615_616_512                        # R1-Distill-Qwen-7B
    assert r["q_shape"] == [28, 3584, 28, 128]
    assert r["q_spec"] == "P(None, 'fsdp', None, None)"   # tensor=1: heads unsharded
    assert r["mu_spec"] == "P(None, None, 'fsdp')"       # Adam moments sharded like params
    assert r["param_dtypes"] == ["float32"]                    # fp32 master weights
    assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and r["has_text"]
