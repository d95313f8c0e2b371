"""The 7B preset's decode call over the paged KV pool (R1-Distill-Qwen-7B, bf16) lowers and compiles
from ShapeDtypeStructs on fake 4- and 8-device tensor meshes (nothing allocated), with per-device
memory reported; at tensor=4 the weights take <= 4 GiB per device. The pool's bytes are checked by
hand, the weights against the planner's count, and the call's temporaries against a pool twice
the size (they follow the rows, not the pool)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import xla_flags

pytestmark = pytest.mark.slow   # a subprocess with 8 fake devices and two 7B compiles

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30

SCRIPT = r"""
import json
import jax
from sprint_jax.bench.serve_memory import compile_decode_step, plan_pool
from sprint_jax.infer import sharding as sh

out = {}
for spec in ("tensor=4", "tensor=8"):
    step = lambda pages: compile_decode_step("r1-distill-qwen-7b", spec, max_seqs=4, max_children=4,
                                             max_seq_len=1024, max_branch_tokens=256, decode_chunk=4,
                                             num_pages=pages)
    compiled, info, cfg, mesh = step(None)
    info["has_text"] = bool(compiled.as_text())
    info["planner_weights"] = sh.weight_bytes_per_device(cfg, mesh)
    info["double"] = step(2 * info["num_pages"])[1]
    info["plan"] = plan_pool(info, 16 * 2**30)
    out[spec] = info
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result():
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


# the Engine's default pool: 4 sequences of ceil(1028 / 16) = 65 pages and 4 executors of
# ceil(260 / 16) + 1 = 18 (a decode chunk past the last token; the page a fork copies): 137 pages a
# sequence, 548 in all; one KV head a device (tensor=4 splits the 4, tensor=8 splits 8 copies):
# 28 layers x 548 pages x 16 tokens x 128 x 2 bytes, K and V
POOL = 2 * 28 * 548 * 16 * 128 * 2


def test_7b_decode_step_compiles_at_tensor_4_and_8(result):
    for spec, n in (("tensor=4", 4), ("tensor=8", 8)):
        r = result[spec]
        assert r["params"] == 7_615_616_512 and r["has_text"] and r["mesh"]["tensor"] == n
        assert (r["pages_per_sequence"], r["num_pages"], r["page_shards"]) == (137, 548, 1)
        assert r["per_device_pool_bytes"] == POOL == 125_698_048
        mem = r["per_device"]
        # the inputs of the compiled step are the weights + the pool (+ the rows' few KiB)
        assert r["per_device_weight_bytes"] + r["per_device_pool_bytes"] <= mem["argument_size_in_bytes"]
        assert mem["argument_size_in_bytes"] - r["per_device_weight_bytes"] - r["per_device_pool_bytes"] < 2**20
        assert mem["alias_size_in_bytes"] >= r["per_device_pool_bytes"]     # the pool is donated, updated in place
        # the planner counts the same weight bytes as the compiled step's input shardings
        assert r["planner_weights"] == r["per_device_weight_bytes"]
    # 7B bf16 = 15.2 GB; tensor=4 splits heads, KV heads (4 / 4) and the MLP: <= 4 GiB per device
    t4, t8 = result["tensor=4"], result["tensor=8"]
    assert t4["per_device_weight_bytes"] <= 4 * GIB
    assert "'tensor'" in t4["in_specs"]["q_proj"] and "'tensor'" in t4["in_specs"]["pool"]
    # tensor=8 exceeds Qwen2-7B's 4 KV heads and does not divide its 28 query heads: the engine runs
    # the equivalent model with 8 KV heads (copies) and 32 query heads (4 zero pads), said in a note,
    # so heads, KV heads and the pool still split 8 ways
    assert any("KV heads copied -> 8" in n and "-> 32" in n for n in t8["sharding_notes"]), t8["sharding_notes"]
    assert "'tensor'" in t8["in_specs"]["q_proj"] and "'tensor'" in t8["in_specs"]["pool"]
    assert t8["per_device_weight_bytes"] < 0.6 * t4["per_device_weight_bytes"]


def test_decode_step_temporaries_hold_no_copy_of_the_pool(result):
    """Twice the pages, the same temporaries: the call holds nothing the size of the pool (its
    reads are the rows' pages, its writes in place). What its temporaries hold is an f32 copy of
    the bf16 weights (XLA CPU has no bf16 dot) and the rows' gathered pages."""
    for r in result.values():
        double = r["double"]
        assert double["num_pages"] == 2 * r["num_pages"]
        assert double["per_device_pool_bytes"] == 2 * r["per_device_pool_bytes"]
        grew = double["per_device"]["temp_size_in_bytes"] - r["per_device"]["temp_size_in_bytes"]
        assert abs(grew) <= 2**20, grew
        assert r["per_device"]["temp_size_in_bytes"] <= 2.2 * r["per_device_weight_bytes"] + r["per_device_pool_bytes"]


def test_the_pool_plan_fills_the_budget(result):
    """The pool that fits 16 GiB a device (90% of it) beside the weights and the call's temporaries:
    its pages' bytes fit and one more page does not; the sequences it holds at capacity, by hand."""
    for r in result.values():
        plan = r["plan"]
        page = POOL // 548
        fixed = r["per_device_weight_bytes"] + r["per_device"]["temp_size_in_bytes"]
        assert plan["pages"] >= 1 and plan["pool_bytes"] == plan["pages"] * page
        assert fixed + plan["pages"] * page <= 0.9 * 16 * GIB < fixed + (plan["pages"] + 1) * page
        assert plan["sequences_at_capacity"] == plan["pages"] // 137
