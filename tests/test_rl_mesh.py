"""P-GRPO on a (data, fsdp, tensor) = (2, 2, 2) mesh of 8 fake CPU devices equals the same run on
one device: the rollout engine runs on the trainer's mesh (its slots over data x fsdp, KV heads
over tensor, the trainer's weights as they are placed), so the step's rollouts, rewards and
held-out evaluations are the one-device run's, and the update's loss and new weights agree to
fp32 reduction order. The rollouts sample runs of different lengths in different slot shards with
the vocabulary split over tensor, so the sampling branch holds a collective: the case where the
engine's shards must keep the same control flow (before they did, this run hung on CPU).

The 8 devices are faked with XLA_FLAGS in a subprocess, so the rest of the suite keeps 1 device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import test_rl_run as base
from conftest import xla_flags

sft_model = base.sft_model          # the tiny SPRINT model the RL run tests train (a module fixture here)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2

SCRIPT = r"""
import json, sys
import jax
from sprint_jax.config import CONFIG_DIR
from sprint_jax.rl.config import load_rl_config
from sprint_jax.rl.trainer import run_rl

assert jax.device_count() == 8, jax.devices()
cfg = load_rl_config(CONFIG_DIR / "rl_tiny_cpu.yaml", json.loads(sys.argv[1]))
run_rl(cfg, sys.argv[2], progress=False)
"""

# the update's figures: reductions over devices and microbatches change fp32's summation order
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
EXACT = ("reward", "accuracy", "sequential_tokens", "total_tokens", "format_valid", "update_tokens", "adv_mean",
         "adv_abs_mean")


def _sets(model: Path, mesh: dict) -> list[str]:
    return base._sets(model) + [f"steps={STEPS}", "eval.every=0", "export.enabled=true", "export.dtype=float32",
                                "tasks.eval_n=4"] + [f"mesh.{k}={v}" for k, v in mesh.items()]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(model: Path) -> dict:
    from safetensors.numpy import load_file
    return {k: v.astype(np.float32) for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def runs(sft_model, tmp_path_factory):
    from sprint_jax.config import CONFIG_DIR
    from sprint_jax.rl.config import load_rl_config
    from sprint_jax.rl.trainer import run_rl

    root = tmp_path_factory.mktemp("rl_mesh")
    one = dict(data=1, fsdp=1, tensor=1)
    run_rl(load_rl_config(CONFIG_DIR / "rl_tiny_cpu.yaml", _sets(sft_model, one)), root / "one", progress=False)
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu"}
    sets = _sets(sft_model, dict(data=2, fsdp=2, tensor=2))
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(sets), str(root / "mesh")],
                       env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return root / "one", root / "mesh", sft_model


@pytest.mark.slow
def test_rl_on_a_mesh_equals_one_device(runs):
    """Every step's rollouts (rewards, tokens, advantages) and the held-out evaluations at the start
    and the end are the one-device run's exactly; losses and the exported weights agree to fp32."""
    one, mesh = (_records(r) for r in runs[:2])
    assert len(one) == len(mesh) == STEPS + 1                     # eval_start, then one record per step
    assert one[0]["eval_accuracy"] == mesh[0]["eval_accuracy"]
    assert one[0]["eval_sequential_tokens"] == mesh[0]["eval_sequential_tokens"]
    for a, b in zip(one[1:], mesh[1:]):
        assert {k: a[k] for k in EXACT} == {k: b[k] for k in EXACT}, (a, b)
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * max(abs(a["loss"]), 1e-3), (a["loss"], b["loss"])
    for k in ("eval_accuracy", "eval_sequential_tokens"):
        assert one[-1][k] == mesh[-1][k], (k, one[-1], mesh[-1])
    w1, w8 = (_weights(r / "hf") for r in runs[:2])
    start = _weights(runs[2])
    assert w1.keys() == w8.keys() == start.keys() and w1
    moved = max(float(np.abs(w1[k] - start[k]).max()) for k in w1)
    assert moved > 10 * PARAM_ATOL                                # the update changed the weights
    diff = max(float(np.abs(w1[k] - w8[k]).max()) for k in w1)
    assert diff <= PARAM_ATOL, diff


@pytest.mark.slow
def test_the_rollout_engine_splits_its_cache_over_the_mesh(runs):
    """The engine's KV pool per device, by hand from config.json: 8 runs (G=4 x 2 prompts) of
    160 + 16 (one decode chunk) positions (11 pages of 16), each with 2 branches of 8 + 32 (tag
    room) + 16 positions (4 pages, and a copy of the page the fork splits), fp32, 1 layer, head_dim
    16, K and V. On one device the whole pool (1 KV head); on the mesh the pages split 4 ways (data
    x fsdp) and the KV head, copied to 2 for tensor=2, one per device."""
    c = json.loads((runs[2] / "config.json").read_text())
    hd = c["hidden_size"] // c["num_attention_heads"]
    layers, kv_heads = c["num_hidden_layers"], c["num_key_value_heads"]
    assert (layers, kv_heads, hd) == (1, 1, 16)

    def cache(runs, heads):
        return 2 * 4 * layers * heads * hd * 16 * runs * (11 + 2 * (4 + 1))

    one, mesh = (json.loads((r / "summary.json").read_text())["rollout_engine"] for r in runs[:2])
    assert one == {"mesh": None, "kv_cache_bytes_per_device": cache(8, 1)}
    assert mesh == {"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "kv_cache_bytes_per_device": cache(2, 1)}

