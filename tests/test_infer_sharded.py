"""Inference over a mesh (issue 15) == one device: on 8 fake CPU devices, the batched engine on
tensor=2 x data=2, tensor=4 x data=2 and tensor=8 meshes gives the same greedy tokens (generate,
fork with forced prefixes, extend, the scheduler with several sequences at once) as the same
engine on one device, and the single-run Engine's prefill logits on a mesh match one device
within fp32 tolerance. The parameters are loaded straight into their shardings.

The 8 devices are faked with XLA_FLAGS in a subprocess, so the rest of the suite keeps 1 device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sprint_jax.config import ConfigError
from sprint_jax.infer import sharding as sh

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import jax, numpy as np
from conftest import tiny_vocab_tokenizer
from sprint_jax.infer import Engine
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.batch import BatchEngine
from sprint_jax.model import from_pretrained

assert jax.device_count() == 8, jax.devices()
path = sys.argv[1]
tok = tiny_vocab_tokenizer()
CAPS = dict(max_seq_len=96, max_branch_tokens=48, decode_chunk=8, prefill_chunk=32, eos_token_ids=[])
ids = lambda seed, n: [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]

def drive(engine):
    # three sequences at once: a plain generate; a fork of 3 children with forced prefixes; extend + generate
    a = engine.open(ids(1, 21)); b = engine.open(ids(2, 40)); c = engine.open(ids(3, 9))
    engine.run([a, b, c])
    ops = [engine.generate(a.result, 20),
           engine.fork(b.result, [ids(4, 3), [], ids(5, 7)], [12, 17, 9]),
           engine.extend(c.result, ids(6, 13))]
    engine.run(ops)
    last = engine.generate(c.result, 15)
    engine.run([last])
    return [ops[0].result.tokens, [g.tokens for g in ops[1].result], last.result.tokens]

ref_model = from_pretrained(path)
ref = drive(BatchEngine(ref_model, tok, max_seqs=4, max_children=4, **CAPS))
eng1 = Engine(ref_model, tok, **CAPS)
prompt = ids(7, 33)
ref_logits = eng1.step_logits(eng1.prefill(prompt))

out = {}
norm = lambda spec, n: [x if x is None or isinstance(x, str) else list(x) for x in tuple(spec) + (None,) * (n - len(spec))]
config = ref_model.config
for spec, n in (("tensor=2,data=2", 4), ("tensor=4,data=2", 8), ("tensor=8", 8)):
    mesh = sh.mesh_from_flag(spec, devices=jax.devices()[:n])
    notes = []
    model = from_pretrained(path, shardings=sh.param_shardings(config, mesh, notes))   # loaded into the sharding
    q = model.params["layers"]["q_proj"]["kernel"]
    eng = BatchEngine(model, tok, max_seqs=4, max_children=4, mesh=mesh, **CAPS)
    got = drive(eng)
    one = Engine(model, tok, mesh=mesh, **CAPS)
    logits = one.step_logits(one.prefill(prompt))
    out[spec] = {"same_tokens": got == ref, "max_logit_diff": float(np.abs(logits - ref_logits).max()),
                 "q_spec": norm(q.sharding.spec, 4), "pk_spec": norm(eng.cache.pk.sharding.spec, 5),
                 "ck_spec": norm(eng.cache.ck.sharding.spec, 5),
                 "pk_shard": list(eng.cache.pk.addressable_shards[0].data.shape),
                 "notes": eng.sharding_notes, "n_tokens": sum(len(t) for t in ref[1]) + len(ref[0]) + len(ref[2])}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def sharded(hf_untied):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(hf_untied), str(ROOT / "tests")], env=env,
                       capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])


@pytest.mark.parametrize("spec", ["tensor=2,data=2", "tensor=4,data=2", "tensor=8"])
def test_mesh_gives_the_tokens_and_logits_of_one_device(sharded, spec):
    r = sharded[spec]
    assert r["n_tokens"] > 60                    # the comparison covers real decoding
    assert r["same_tokens"], spec
    assert r["max_logit_diff"] < 1e-4, r["max_logit_diff"]


def test_shardings_follow_the_rules_table(sharded):
    r = sharded["tensor=2,data=2"]
    # [L, embed, heads, D]: heads over tensor (6 heads / 2)
    assert r["q_spec"] == [None, None, "tensor", None]
    # KV slots: slots over data, KV heads over tensor; each device holds 2 of 4 slots, 1 of 2 heads
    assert r["pk_spec"] == r["ck_spec"] == [None, "data", None, "tensor", None]
    assert r["pk_shard"][1] == 2 and r["pk_shard"][3] == 1
    # tensor=4 and 8 exceed the tiny model's 2 KV heads and do not divide its 6 query heads: the
    # engine copies KV heads and pads query heads (an equivalent model; the tokens above are the
    # same), so the cache still splits over tensor; a note says so
    r4, r8 = sharded["tensor=4,data=2"], sharded["tensor=8"]
    assert r4["pk_spec"] == [None, "data", None, "tensor", None]
    assert r8["pk_spec"] == [None, None, None, "tensor", None]
    assert any("KV heads copied -> 4" in n and "-> 8" in n for n in r4["notes"]), r4["notes"]
    assert any("KV heads copied -> 8" in n and "-> 8" in n for n in r8["notes"]), r8["notes"]


def test_parse_mesh_flag():
    assert sh.parse_mesh("tensor=4,data=2") == {"data": 2, "fsdp": 1, "tensor": 4}
    assert sh.parse_mesh("data=-1") == {"data": -1, "fsdp": 1, "tensor": 1}
    assert sh.mesh_from_flag("") is None
    for bad in ("tensor=4,model=2", "tensor", "tensor=x", "tensor=0", "data=2,data=2", "data=-1,tensor=-1"):
        with pytest.raises(ConfigError):
            sh.parse_mesh(bad)


def test_copied_kv_heads_and_padded_query_heads_are_the_same_model():
    """head_layout's model (tiny at tensor=4: 2 -> 4 KV heads, 6 -> 8 query heads) gives the
    original's logits (a plain full forward, one device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sprint_jax.model import qwen2 as Q
    from sprint_jax.model.config import Qwen2Config

    cfg = Qwen2Config.preset("tiny")
    assert sh.head_layout(cfg, 2) is None                   # 6 heads, 2 KV heads split 2 ways as they are
    new, src, r = sh.head_layout(cfg, 4)
    assert (new.num_attention_heads, new.num_key_value_heads, r) == (8, 4, 2)
    assert src.tolist() == [0, 1, 2, -1, 3, 4, 5, -1]       # each KV head's 3 query heads over its 2 copies
    params = Q.init_params(cfg, jax.random.key(0), std=0.1)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 307, (2, 11)), jnp.int32)
    ref = Q.forward(params, cfg, toks)
    got = Q.forward(sh.expand_heads(params, src, r), new, toks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


ORBAX_SCRIPT = r"""
import json, sys
import jax, numpy as np
from sprint_jax.infer import sharding as sh
from sprint_jax.model.convert import load_model, load_orbax

assert jax.device_count() == 8, jax.devices()
_, ref = load_orbax(sys.argv[1])                                  # unsharded, one device
out = {}
for path, spec, dtype in ((sys.argv[1], "tensor=2,fsdp=2,data=2", None), (sys.argv[1], "tensor=4,fsdp=2", "bfloat16"),
                          (sys.argv[2], "tensor=2,fsdp=2,data=2", None)):
    mesh = sh.mesh_from_flag(spec)
    want = {}
    # no device-to-device copy allowed: the params must not land on one device and move after
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        model = load_model(path, param_dtype=dtype,
                           shardings_fn=lambda c: want.setdefault("s", sh.param_shardings(c, mesh)))
    flat, _ = jax.tree_util.tree_flatten_with_path(model.params)
    wants = jax.tree.leaves(want["s"])
    refs = jax.tree.leaves(ref)
    out[path[-5:] + " " + spec] = {
        "n": len(flat),
        "same_sharding": [jax.tree_util.keystr(k) for (k, a), s in zip(flat, wants) if a.sharding != s],
        "split": sum(a.addressable_shards[0].data.size < a.size for _, a in flat),
        "dtype": sorted({str(a.dtype) for _, a in flat}),
        "max_diff": max(float(np.abs(np.asarray(a, np.float32) - np.asarray(r.astype(a.dtype), np.float32)).max())
                        for (_, a), r in zip(flat, refs)),
    }
print("RESULT " + json.dumps(out))
"""


def test_checkpoints_load_straight_into_the_rules_table_sharding(hf_untied, tmp_path):
    """An orbax model directory restored with the rules table's shardings as its target (and an HF
    directory read with them): with device-to-device copies forbidden, every leaf arrives with
    that sharding (each device holding its slice) and equals the unsharded restore."""
    from sprint_jax.model.convert import save_orbax
    from sprint_jax.model.hf import load_params

    config, params = load_params(hf_untied)
    save_orbax(config, params, tmp_path / "orbax")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", ORBAX_SCRIPT, str(tmp_path / "orbax"), str(hf_untied)], env=env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    for spec, r in out.items():
        assert r["n"] > 5 and r["same_sharding"] == [], (spec, r)
        assert r["split"] >= r["n"] // 2, (spec, r)       # most leaves really split (norms stay whole)
        assert r["max_diff"] == 0.0, (spec, r)
    assert len(out) == 3 and out["orbax tensor=4,fsdp=2"]["dtype"] == ["bfloat16"]
