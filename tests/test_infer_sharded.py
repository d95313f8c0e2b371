"""Inference over a mesh == one device: on 8 fake CPU devices, the batched engine on
tensor=2 x data=2, tensor=4 x data=2 and tensor=8 meshes gives the same greedy tokens (generate,
fork with forced prefixes, extend, the scheduler with several sequences at once), and the same
sampled tokens of runs of different lengths in different slot shards, as the same
engine on one device (at data=2 alone: the merge-join test's forks and generates), and the
single-run Engine (a layer over the same slot core, one slot) gives the one-device prefill logits
(fp32 tolerance), greedy generate and decode_branches on data=2, tensor=4 x data=2 and tensor=8,
with the Pallas kernel per shard at tensor=8. The parameters are loaded
straight into their shardings; data shards keep their slots local (compiled HLO checked).

The 8 devices are faked with XLA_FLAGS in a subprocess, so the rest of the suite keeps 1 device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import xla_flags
from sprint_jax.config import ConfigError
from sprint_jax.infer import sharding as sh

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import jax, numpy as np
from conftest import tiny_vocab_tokenizer
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.sampling import Sampling
from sprint_jax.infer.single import SingleRun
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
    # sampled runs (top-p) of different lengths (no EOS here), so slot shards hold rows of different lengths
    sampled = [engine.generate(x, n, sampling=Sampling(temperature=1.0, top_p=0.9, seed=k))
               for k, (x, n) in enumerate(((a.result, 20), (b.result, 3), (c.result, 9)))]
    engine.run(sampled)
    return [ops[0].result.tokens, [g.tokens for g in ops[1].result], last.result.tokens,
            [op.result.tokens for op in sampled]]

ref_model = from_pretrained(path)
ref = drive(Engine(ref_model, tok, max_seqs=4, max_children=4, **CAPS))
eng1 = SingleRun(Engine(ref_model, tok, max_seqs=1, **CAPS))
prompt = ids(7, 33)
ref_logits = eng1.step_logits(eng1.prefill(prompt))

def single(engine):      # one sequence (SingleRun): greedy generate, then three branches off the prompt
    gen = engine.generate(engine.prefill(prompt), 12).tokens
    return [gen, [g.tokens for g in engine.decode_branches(engine.prefill(prompt), [ids(8, 4), [], ids(9, 2)], 7)]]

ref_single = single(eng1)

out = {}
norm = lambda spec, n: [x if x is None or isinstance(x, str) else list(x) for x in tuple(spec) + (None,) * (n - len(spec))]
config = ref_model.config
# Per mesh, what runs there: the batched engine ("batched": drive) and a one-slot engine ("single":
# SingleRun). Each path once: slots split over data with heads over tensor (batched at
# tensor=2,data=2 and tensor=4,data=2; MERGE_SCRIPT's batched engine at data=2 alone), KV heads
# copied (tensor=4,data=2, tensor=8); one slot kept whole over data (single at data=2 and
# tensor=4,data=2), copied KV heads split over tensor (single at tensor=8), the Pallas kernel per shard.
MESHES = (("data=2", 2, ("single",)), ("tensor=2,data=2", 4, ("batched",)),
          ("tensor=4,data=2", 8, ("batched", "single")), ("tensor=8", 8, ("batched", "single")))
for spec, n, runs in MESHES:
    mesh = sh.mesh_from_flag(spec, devices=jax.devices()[:n])
    notes = []
    model = from_pretrained(path, shardings=sh.param_shardings(config, mesh, notes))   # loaded into the sharding
    q = model.params["layers"]["q_proj"]["kernel"]
    r = out[spec] = {"runs": list(runs), "q_spec": norm(q.sharding.spec, 4)}
    if "batched" in runs:
        eng = Engine(model, tok, max_seqs=4, max_children=4, mesh=mesh, **CAPS)
        got = drive(eng)
        r.update({"same_tokens": got == ref, "pk_spec": norm(eng.cache.k.sharding.spec, 5),
                  "pk_shard": list(eng.cache.k.addressable_shards[0].data.shape), "num_pages": eng.num_pages,
                  "notes": eng.sharding_notes, "n_tokens": sum(len(t) for t in ref[1]) + len(ref[0]) + len(ref[2]),
                  "n_sampled": sum(map(len, got[3]))})
    if "single" in runs:
        one = SingleRun(Engine(model, tok, max_seqs=1, mesh=mesh, **CAPS))       # one slot on the mesh
        logits = one.step_logits(one.prefill(prompt))
        r.update({"max_logit_diff": float(np.abs(logits - ref_logits).max()), "same_single": single(one) == ref_single,
                  "n_single": sum(map(len, ref_single[1])) + len(ref_single[0]), "single_notes": one.sharding_notes,
                  "single_pk_spec": norm(one.engine.cache.k.sharding.spec, 5)})
    if spec == "tensor=8":   # the Pallas parent-prefix kernel per shard, copied KV heads (interpret mode)
        pe = SingleRun(Engine(model, tok, max_seqs=1, mesh=mesh, attention_impl="pallas", **CAPS))
        pallas_single = [g.tokens for g in pe.decode_branches(pe.prefill(prompt), [ids(8, 4), [], ids(9, 2)], 7)]
        r["pallas_single"] = pallas_single == ref_single[1]
print("RESULT " + json.dumps(out))
"""


# One subprocess runs every script of this module (SCRIPT, ORBAX_SCRIPT, HLO_SCRIPT, MERGE_SCRIPT),
# each on its own argv with its stdout captured: a process with 8 fake devices costs a Python start,
# the JAX and package imports and a model load, paid once instead of four times. A script that
# fails is reported (its traceback) to the tests that read it; the others still run.
RUNNER = r"""
import contextlib, io, json, sys, traceback
sys.path.insert(0, sys.argv[1])
import test_infer_sharded as T
for name, args in json.loads(sys.argv[2]).items():
    sys.argv = ["-c", *args]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(getattr(T, name), {"__name__": "__main__"})
        res = json.loads(next(l for l in buf.getvalue().splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    except Exception:
        res = {"error": traceback.format_exc()[-4000:]}
    print("PART " + json.dumps([name, res]), flush=True)
"""


@pytest.fixture(scope="module")
def mesh_runs(hf_untied, tmp_path_factory):
    """{script name: its RESULT} of every script here, run in one 8-fake-device subprocess."""
    from sprint_jax.model.convert import save_orbax
    from sprint_jax.model.hf import load_params

    orbax = tmp_path_factory.mktemp("orbax") / "orbax"
    save_orbax(*load_params(hf_untied), orbax)
    tests = str(ROOT / "tests")
    parts = {"SCRIPT": [str(hf_untied), tests], "ORBAX_SCRIPT": [str(orbax), str(hf_untied)],
             "HLO_SCRIPT": [str(hf_untied), tests], "MERGE_SCRIPT": [str(hf_untied), tests]}
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", RUNNER, tests, json.dumps(parts)], env=env,
                       capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return dict(json.loads(line[len("PART "):]) for line in p.stdout.splitlines() if line.startswith("PART "))


def _part(mesh_runs, name: str) -> dict:
    r = mesh_runs.get(name)
    assert r is not None and "error" not in r, (name, r and r["error"])
    return r


@pytest.fixture(scope="module")
def sharded(mesh_runs):
    return _part(mesh_runs, "SCRIPT")


@pytest.mark.parametrize("spec", ["data=2", "tensor=2,data=2", "tensor=4,data=2", "tensor=8"])
def test_mesh_gives_the_tokens_and_logits_of_one_device(sharded, spec):
    r = sharded[spec]
    if "batched" in r["runs"]:                             # the batched scheduler
        assert r["n_tokens"] > 60 and r["same_tokens"], spec     # the comparison covers real decoding
        assert r["n_sampled"] == 20 + 3 + 9, spec
    if "single" in r["runs"]:                              # one sequence: greedy generate, decode_branches
        assert r["n_single"] >= 25 and r["same_single"], spec
        assert r["max_logit_diff"] < 1e-4, r["max_logit_diff"]
    assert r["runs"]


def test_shardings_follow_the_rules_table(sharded):
    r = sharded["tensor=2,data=2"]
    # [L, embed, heads, D]: heads over tensor (6 heads / 2)
    assert r["q_spec"] == [None, None, "tensor", None]
    # the page pool: pages over data (each data shard's sequences keep their pages on it), KV heads
    # over tensor; each device holds half the pages, 1 of 2 heads
    assert r["pk_spec"] == [None, "tensor", "data", None, None]                  # [L, Hkv, pages, ps, D]
    assert r["pk_shard"][1] == 1 and r["pk_shard"][2] == r["num_pages"] // 2
    # tensor=4 and 8 exceed the tiny model's 2 KV heads and do not divide its 6 query heads: the
    # engine copies KV heads and pads query heads (an equivalent model; the tokens above are the
    # same), so the cache still splits over tensor; a note says so
    r4, r8 = sharded["tensor=4,data=2"], sharded["tensor=8"]
    assert r4["pk_spec"] == [None, "tensor", "data", None, None]
    assert r8["pk_spec"] == [None, "tensor", None, None, None]
    assert any("KV heads copied -> 4" in n and "-> 8" in n for n in r4["notes"]), r4["notes"]
    assert any("KV heads copied -> 8" in n and "-> 8" in n for n in r8["notes"]), r8["notes"]



def test_a_one_slot_engine_on_a_mesh(sharded):
    """`Engine(max_seqs=1, mesh=)`: at tensor=8 (> the 2 KV heads) its KV heads are copied (logged)
    and its slots split over tensor like a many-slot engine's, and the Pallas kernel runs per shard
    (same branches as one device); at data=2 its one parent slot (and so its children) stay whole
    on each data shard, noted, with the one-device tokens (test above)."""
    r8, r2 = sharded["tensor=8"], sharded["data=2"]
    assert any("KV heads copied -> 8" in n for n in r8["single_notes"]), r8["single_notes"]
    assert r8["single_pk_spec"] == [None, "tensor", None, None, None]
    assert r8["pallas_single"] is True
    assert r2["single_pk_spec"][2] is None                                        # pages whole
    assert any("sequence slots" in n for n in r2["single_notes"]), r2["single_notes"]


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


def test_checkpoints_load_straight_into_the_rules_table_sharding(mesh_runs):
    """An orbax model directory restored with the rules table's shardings as its target (and an HF
    directory read with them): with device-to-device copies forbidden, every leaf arrives with
    that sharding (each device holding its slice) and equals the unsharded restore."""
    out = _part(mesh_runs, "ORBAX_SCRIPT")
    for spec, r in out.items():
        assert r["n"] > 5 and r["same_sharding"] == [], (spec, r)
        assert r["split"] >= r["n"] // 2, (spec, r)       # most leaves really split (norms stay whole)
        assert r["max_diff"] == 0.0, (spec, r)
    assert len(out) == 3 and out["orbax tensor=4,fsdp=2"]["dtype"] == ["bfloat16"]


HLO_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp, numpy as np
from conftest import tiny_vocab_tokenizer
from test_batch_engine import _copies_of_the_cache
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.programs import DecodeRows, PrefillRows, _decode_body, _prefill_local, decode
from sprint_jax.model import from_pretrained

assert jax.device_count() == 8, jax.devices()
model = from_pretrained(sys.argv[1])
mesh = sh.mesh_from_flag("data=2", devices=jax.devices()[:2])
eng = Engine(model, tiny_vocab_tokenizer(), max_seqs=4, max_children=4, max_seq_len=96, max_branch_tokens=48,
             decode_chunk=8, mesh=mesh)
na, nf, w = 4, 4, eng.max_children       # generate rows, fork groups, rows per group (2 blocks of each)
packed, layout = DecodeRows.empty(na, nf, w, 8, 4, 2, 2).pack()
dec = (eng.params, eng.config, eng.cache, tuple(jnp.asarray(a) for a in packed))
kw = dict(layout=layout, chunk=8, kv=eng._kv)
pre = (eng.params, eng.config, eng.cache, jax.tree.map(jnp.asarray, PrefillRows.empty(4, 32, 4)))
pkw = dict(kv=eng._kv)

def collectives(hlo):
    # (op, elements of its result) for every cross-device op of the compiled step
    out = []
    for m in re.finditer(r"= (\(.*?\)|\w+\[[\d,]*\]\S*) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo):
        n = sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in re.findall(r"\[([\d,]*)\]", m.group(1)))
        out.append((m.group(2), n))
    return out

out = {}
# the plain function: the program's body without slot_local (decode's returns its results as a tuple)
for name, fn, body, args, kws in (("decode", decode, _decode_body.__wrapped__, dec, kw),
                                  ("prefill", jax.jit(_prefill_local, static_argnames=("config", "kv"),
                                                      donate_argnames=("cache",)),
                                   _prefill_local.__wrapped__, pre, pkw)):
    comp = fn.lower(*args, **kws).compile()
    plain = jax.jit(body, static_argnames=tuple(kws) + ("config",)).lower(*args, **kws).compile()
    ma = comp.memory_analysis()
    out[name] = {"local": collectives(comp.as_text()), "plain": collectives(plain.as_text()),
                 "copies": _copies_of_the_cache(comp.as_text(), {eng.num_pages // 2, eng.num_pages}),
                 "alias": int(ma.alias_size_in_bytes), "cache_per_device": eng.cache.nbytes // 2}
print("RESULT " + json.dumps(out))
"""


def test_data_shards_keep_their_slots_local(mesh_runs):
    """data=2: the engine's decode and prefill programs run per slot shard (sharding.slot_local),
    so the compiled steps move nothing bigger than a few scalars between devices, while the same
    step left to GSPMD (the reference: the plain jit of the same function) all-reduces gathered
    cache rows. The cache is still donated and updated in place (no copy with a capacity axis)."""
    out = _part(mesh_runs, "HLO_SCRIPT")
    for name, r in out.items():
        assert all(n <= 8 for _, n in r["local"]), (name, r["local"])
        assert max(n for _, n in r["plain"]) >= 64 * 12, (name, r["plain"])    # >= a slot's gathered rows
        assert r["copies"] == [], (name, r["copies"])
        assert r["alias"] >= r["cache_per_device"], (name, r)


def test_slot_blocks_place_rows_in_their_shards_block():
    # one block (one device or tensor only): rows in order, a power-of-two bucket capped at the slots
    assert sh.slot_blocks([3, 0, 2], 4, 1) == ([0, 1, 2], 4)
    assert sh.slot_blocks([0, 1, 2], 3, 1) == ([0, 1, 2], 3)
    # 8 slots over 2 shards (0-3 | 4-7): each row lands in its slot's shard's block
    pos, n = sh.slot_blocks([5, 1, 6, 7, 2], 8, 2)
    width = n // 2
    assert n == 8 and len(set(pos)) == 5            # 3 rows on shard 1 -> blocks of 4
    assert all(p // width == s // 4 for p, s in zip(pos, [5, 1, 6, 7, 2]))
    assert sh.slot_order(8, 2) == [0, 4, 1, 5, 2, 6, 3, 7] and sh.slot_order(4, 1) == [0, 1, 2, 3]


def test_bf16_cache_moves_as_bits_on_cpu_exactly():
    """On CPU a 16-bit cache is gathered / scattered as uint16 bits (pages._on_bits: XLA CPU
    would widen the whole cache to f32 each step): the result equals numpy indexing of the same array."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sprint_jax.infer import pages
    from sprint_jax.bench import slot_cache as batch

    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((3, 5, 2, 7, 4)), jnp.bfloat16)     # [L, N, Hkv, C, D]
    assert pages._on_bits(cache) == (jax.default_backend() == "cpu")
    rows = jnp.asarray([4, 0, 4], jnp.int32)
    got = jax.jit(batch.gather_rows, static_argnums=3)(cache, 1, rows, 6)      # [R, Hkv, 6, D]
    ref = np.asarray(cache)[1][np.asarray(rows)][:, :, :6]
    assert np.array_equal(np.asarray(got), ref)
    new = jnp.asarray(rng.standard_normal((3, 2, 2, 2, 4)), jnp.float32)       # prefill: [L, R, T, Hkv, D]
    slot, pos = jnp.asarray([2, 0]), jnp.asarray([[1, 6], [3, 1 << 30]])        # the last write drops
    out = jax.jit(batch.put_slots)(cache, slot, pos, new)
    want = np.asarray(cache).copy()
    nb = np.asarray(new.astype(jnp.bfloat16))
    want[:, 2, :, 1], want[:, 2, :, 6], want[:, 0, :, 3] = nb[:, 0, 0], nb[:, 0, 1], nb[:, 1, 0]
    assert out.dtype == jnp.bfloat16 and np.array_equal(np.asarray(out), want)
    step = jax.jit(batch.put_slots)(cache, slot, pos[:, 0], new[:, :, 0])    # a decode step: [L, R, Hkv, D]
    want = np.asarray(cache).copy()
    want[:, 2, :, 1], want[:, 0, :, 3] = nb[:, 0, 0], nb[:, 1, 0]
    assert np.array_equal(np.asarray(step), want)


MERGE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import jax, numpy as np
from conftest import tiny_vocab_tokenizer
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.engine import Engine
from sprint_jax.model import from_pretrained

ids = lambda seed, n: [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]
CAPS = dict(max_seqs=4, max_children=2, max_seq_len=128, max_branch_tokens=40, decode_chunk=4, prefill_chunk=16,
            eos_token_ids=[], min_bucket=16)

def drive(engine):
    # two sequences (on data=2: one per slot shard), each: fork of 2, merge join with a repair on
    # child 0, extend the planner, a second fork as a join fork (its children feed their last token)
    # + merge (sequence 0: a repair, its tail run; sequence 1: the copy alone), greedy generate
    opens = [engine.open(ids(1, 13)), engine.open(ids(2, 9))]
    engine.run(opens)
    seqs = [o.result for o in opens]
    out = {"slots": [s.slot for s in seqs], "tokens": [], "logits": [], "kv": [], "ran": []}
    for stage in range(2):
        forks = [engine.fork(s, [ids(10 + 3 * k + stage, 2), ids(20 + k + stage, 3)], [5, 3 + k], join=stage == 1)
                 for k, s in enumerate(seqs)]
        engine.run(forks)
        for k, (s, f) in enumerate(zip(seqs, forks)):
            branches = [p + g.tokens for p, g in zip(f.prefixes, f.result)]
            if stage == 0 or k == 0:
                branches[0] = branches[0] + ids(30 + k, 2)
            engine.merge(s, branches)
            out["ran"].append(engine.last_join_tokens)
            out["logits"].append(np.asarray(s.join_logits).tolist())
        if stage == 0:
            for k, s in enumerate(seqs):
                engine.extend(s, ids(40 + k, 3))
            engine.run()
    gens = [engine.generate(s, 6) for s in seqs]
    engine.run(gens)
    for s, g in zip(seqs, gens):
        out["tokens"].append(s.tokens)
        k = np.asarray(engine.cache.k)[:, :, engine.page_ids(s)]                 # [L, Hkv, M, ps, D]
        out["kv"].append(k.reshape(k.shape[:2] + (-1, k.shape[-1]))[:, :, : s.length].tolist())
    return out

model = from_pretrained(sys.argv[1])
ref = drive(Engine(model, tiny_vocab_tokenizer(), **CAPS))
mesh = sh.mesh_from_flag("data=2", devices=jax.devices()[:2])
got = drive(Engine(model, tiny_vocab_tokenizer(), mesh=mesh, **CAPS))
res = {"slots": got["slots"], "same_tokens": got["tokens"] == ref["tokens"], "ran": got["ran"], "ran_ref": ref["ran"],
       "n_tokens": sum(map(len, ref["tokens"])),
       "logit_diff": float(np.abs(np.asarray(got["logits"]) - np.asarray(ref["logits"])).max()),
       "kv_diff": max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got["kv"], ref["kv"])),
       "kv_scale": max(float(np.abs(np.asarray(b)).max()) for b in ref["kv"])}
print("RESULT " + json.dumps(res))
"""


def test_merge_join_on_data_shards_slots_local_equals_one_device(mesh_runs):
    """data=2: the engine's merge join (the children's tail prefill and the row copy into the
    parent slot, both per slot shard; after a join fork the feed step and the copy alone) on two
    sequences in different shards gives the tokens, join logits and parent-slot K/V of the same
    engine on one device (test_merge_join checks one device against a dense reference)."""
    out = _part(mesh_runs, "MERGE_SCRIPT")
    assert out["slots"] == [0, 2]                    # one sequence per slot shard
    assert out["ran"] == out["ran_ref"] and out["ran"][2:] == [2, 0]   # join forks: the repair only; the copy alone
    assert out["same_tokens"] and out["n_tokens"] > 60
    assert out["logit_diff"] < 1e-4
    assert out["kv_scale"] > 0.1 and out["kv_diff"] < 1e-4
