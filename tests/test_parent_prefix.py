"""The many-parents shared-prefix kernel (Pallas path; per shard under a mesh).

References: a float64 numpy softmax attention written here (each row over the first lens[g, w]
keys of its group's cache row), and the batched engine's XLA path
(`grouped_prefix_attention_reference`: gather + `attend_partial`). Both kernel bodies run in
Pallas interpret mode on CPU; the real lowerings for Triton and Mosaic are produced (not run) at
Qwen2-7B sizes. `Engine(attention_impl="pallas")` must give the XLA engine's tokens, on one
device and (8 fake CPU devices, a subprocess) on a tensor x data mesh.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_vocab_tokenizer, xla_flags
from sprint_jax.kernels import BlockSizes
from sprint_jax.kernels.parent_prefix import (default_group_block_sizes, group_bytes_read,
                                              grouped_prefix_attention,
                                              grouped_prefix_attention_reference)
from sprint_jax.eval.report import untimed
from sprint_jax.model.attention import NEG_INF

ROOT = Path(__file__).resolve().parents[1]
# fp32: both sides accumulate in fp32 (kernel logits in base 2); bf16 vs the float64 answer on the
# same bf16 inputs (probabilities rounded to bf16 before P.V, output rounded to bf16).
TOL = {"float32": 2e-5, "bfloat16": 3e-2}
SMALL = BlockSizes(block_q=8, block_k=8, num_splits=2)   # many key blocks, query blocks, splits


def naive(q, kc, vc, rows, lens):
    """float64: row (g, w) attends over the first lens[g, w] keys of cache row rows[g]."""
    q, kc, vc = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, kc, vc))
    gr, w, h, d = q.shape
    rep = h // kc.shape[2]
    out, lse = np.zeros((gr, w, h, d)), np.full((gr, w, h), NEG_INF)
    for g in range(gr):
        for j in range(w):
            n = int(lens[g][j])
            if n == 0:
                continue
            k = np.repeat(kc[rows[g], :n], rep, axis=1)                     # [n, H, D]
            v = np.repeat(vc[rows[g], :n], rep, axis=1)
            logits = np.einsum("hd,nhd->hn", q[g, j], k) / np.sqrt(d)
            peak = logits.max(1, keepdims=True)
            e = np.exp(logits - peak)
            out[g, j] = np.einsum("hn,nhd->hd", e / e.sum(1, keepdims=True), v)
            lse[g, j] = peak[:, 0] + np.log(e.sum(1))
    return out, lse


def make_case(seed, gr, w, h, hkv, d, n, s, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((gr, w, h, d), np.float32), dtype)
    kc = jnp.asarray(rng.standard_normal((n, s, hkv, d), np.float32), dtype)
    vc = jnp.asarray(rng.standard_normal((n, s, hkv, d), np.float32), dtype)
    rows = rng.permutation(n)[:gr].astype(np.int32)
    lens = rng.integers(0, s + 1, (gr, w)).astype(np.int32)
    lens[0] = 0                               # a group with nothing used
    lens[1, 0], lens[1, 1:] = s, 11           # the whole capacity; 11: no block multiple
    return q, kc, vc, rows, lens


# (groups, W, H, Hkv, D, cache rows N, capacity S): GQA 4, 7 and 1; odd sizes
CASES = {"gqa4": (4, 3, 8, 2, 16, 6, 37), "gqa7": (3, 4, 7, 1, 16, 5, 29),
         "gqa1": (3, 2, 3, 3, 8, 4, 21)}


def heads_first_cache(c):
    """[N, S, Hkv, D] -> [N, Hkv, S, D] (the batched engine's slot cache layout)."""
    return jnp.swapaxes(c, 1, 2)


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_engine_xla_path_and_naive_attention(platform, case, heads_first):
    gr, w, h, hkv, d, n, s = CASES[case]
    q, kc, vc, rows, lens = make_case(len(case), gr, w, h, hkv, d, n, s, jnp.float32)
    want_o, want_l = naive(q, kc, vc, rows, lens)
    if heads_first:
        kc, vc = heads_first_cache(kc), heads_first_cache(vc)
    ref_o, ref_l = grouped_prefix_attention_reference(q, kc, vc, rows, lens, heads_first=heads_first)
    np.testing.assert_allclose(ref_o, want_o, atol=TOL["float32"])
    for sizes in (SMALL, None):               # tiny tiles, then the platform defaults
        o, lse = grouped_prefix_attention(q, kc, vc, rows, lens, interpret=True, platform=platform,
                                          block_sizes=sizes, heads_first=heads_first)
        assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (gr, w, h)
        np.testing.assert_allclose(o, want_o, atol=TOL["float32"])
        np.testing.assert_allclose(o, ref_o, atol=TOL["float32"])
        seen = lens[:, :, None].repeat(h, 2) > 0
        np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, want_l, 0), atol=TOL["float32"])
        np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, ref_l, 0), atol=TOL["float32"])
        assert (np.asarray(lse)[~seen] == NEG_INF).all() and (np.asarray(o)[~seen] == 0).all()


@pytest.mark.parametrize("heads_first", [False, True])
@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_bf16_and_garbage_past_the_used_length(platform, heads_first):
    """bf16; every cache entry no row may see is NaN (stale or never written slots, the rest of
    the capacity, other cache rows), and a padding group points past the cache: still exact."""
    gr, w, h, hkv, d, n, s = 3, 5, 8, 2, 16, 4, 45
    q, kc, vc, rows, lens = make_case(7, gr, w, h, hkv, d, n, s, jnp.bfloat16)
    rows[2] = n + 3                            # the engine's padding group: out of range, lens 0
    lens[2] = 0
    used = np.zeros((n, s), bool)
    for g in range(gr):
        if rows[g] < n:
            used[rows[g], : lens[g].max()] = True
    kc = jnp.where(jnp.asarray(used)[:, :, None, None], kc, jnp.nan).astype(jnp.bfloat16)
    vc = jnp.where(jnp.asarray(used)[:, :, None, None], vc, jnp.nan).astype(jnp.bfloat16)
    o, lse = grouped_prefix_attention(*((q, heads_first_cache(kc), heads_first_cache(vc)) if heads_first else
                                        (q, kc, vc)), rows, lens, interpret=True, platform=platform,
                                      block_sizes=SMALL, heads_first=heads_first)
    want_o, want_l = naive(q, kc, vc, np.minimum(rows, n - 1), lens)
    assert np.isfinite(np.asarray(o, np.float32)).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), want_o, atol=TOL["bfloat16"])
    seen = lens[:, :, None].repeat(h, 2) > 0
    np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, want_l, 0), atol=1e-2)


VIEW_OPS = {"stablehlo.reshape", "stablehlo.custom_call", "call", "func.func", "return"}


def test_lowers_for_triton_and_mosaic_at_qwen2_7b_sizes():
    """16 groups of 1 parent + 8 children over a prefix cache of capacity 8192 (+16) for 28 layers
    x 16 slots, Qwen2-7B heads (28 / 4 x 128), bf16: one kernel per call for each platform, and
    the cache reaches it only through views (no gather, pad or copy of the prefix)."""
    from jax import export
    gr, w, h, hkv, d, s = 16, 9, 28, 4, 128, 8192 + 16
    n = 28 * 16
    spec = [jax.ShapeDtypeStruct((gr, w, h, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, s, hkv, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, s, hkv, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((gr,), jnp.int32), jax.ShapeDtypeStruct((gr, w), jnp.int32)]
    for platform, target, marker in [("gpu", "cuda", "__gpu$xla.gpu.triton"),
                                     ("tpu", "tpu", "tpu_custom_call")]:
        fn = jax.jit(lambda *a, _p=platform: grouped_prefix_attention(*a, platform=_p))
        text = export.export(
            fn, platforms=[target],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*spec).mlir_module()
        assert text.count(marker) == 1, platform
        for line in text.splitlines():
            if f"x{s}x" in line:
                op = re.search(r"=\s*([\w.]+)", line)
                op = op.group(1) if op else line.split()[0]
                assert op in VIEW_OPS, (platform, line.strip()[:200])


def _decode_7b_text(target: str, attention_impl: str) -> str:
    """The batched engine's whole decode step (chunk 16, 28 layers) for the Qwen2-7B preset with 16
    sequences of 8192 + 16 tokens and 8 children of 1024 + 16 each (the pool of 16,656 pages of 16
    tokens such an engine sizes by default), lowered (not run) for `target`."""
    from jax import export

    from sprint_jax.infer.pages import KVPages
    from sprint_jax.infer.programs import DecodeRows, decode
    from sprint_jax.model.config import Qwen2Config
    from sprint_jax.model.qwen2 import abstract_params
    cfg = Qwen2Config.preset("r1-distill-qwen-7b", dtype="bfloat16")
    slots, g = 16, 8
    na, nf = slots, slots                        # every generate row and fork group of the 16 sequences
    pool = jax.eval_shape(lambda: KVPages.zeros(cfg, 16656, 16))
    packed, layout = DecodeRows.empty(na, nf, g, 16, 513, 513, 66).pack()
    args = (abstract_params(cfg), pool, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in packed))
    fn = jax.jit(lambda p, c, r: decode(p, cfg, c, r, layout=layout, chunk=16, attention_impl=attention_impl))
    return export.export(fn, platforms=[target], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()


def test_batched_decode_step_lowers_with_the_kernel_at_7b_sizes():
    """Engine(attention_impl="pallas")'s decode step at 7B sizes lowers for GPU and TPU with
    the kernel (three calls in the layer scan: the generate rows' pages, the fork children's
    shared prefixes in groups of w and each child's own pages, as the engine packs them), and the page pool [28, 4, 16656,
    16, 128] reaches it only through a view: never gathered, sliced or copied. The same detector
    finds the XLA path's gather of the used pages (so it can fail)."""
    pk = "28x4x16656x16x128"

    def touches(text, ops):
        return [ln.strip()[:160] for ln in text.splitlines() if pk in ln and any(o in ln for o in ops)]

    reads = ("stablehlo.gather", "dynamic_slice", "stablehlo.slice", "stablehlo.transpose", "stablehlo.copy")
    for target, marker in (("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")):
        text = _decode_7b_text(target, "pallas")
        assert text.count(marker) == 3, target
        assert not touches(text, reads), (target, touches(text, reads))
    assert touches(_decode_7b_text("tpu", "xla"), reads)


def test_block_sizes_bytes_and_bad_inputs():
    gpu = default_group_block_sizes("gpu", 16, 9, 28, 4, 8192)
    assert (gpu.block_q, gpu.block_k) == (64, 128) and gpu.num_splits * 16 * 4 >= 200
    tpu = default_group_block_sizes("tpu", 16, 9, 28, 4, 8192)
    assert (tpu.block_q, tpu.block_k, tpu.num_splits) == (64, 512, 1)   # a group's 63 rows: one block
    # each group's prefix once (K and V), whatever its children: 2 groups of 100 and 7 keys
    assert group_bytes_read([100, 7], 9, 4, 2, 8, jnp.bfloat16) == 107 * 2 * 2 * 8 * 2 + 2 * 9 * 4 * 8 * 2
    q, kc, vc, rows, lens = make_case(1, *CASES["gqa4"], jnp.float32)
    bad = [((q[0], kc, vc, rows, lens), "q must be"), ((q, kc, vc[:1], rows, lens), "k_cache and v_cache"),
           ((q[:, :, :7], kc, vc, rows, lens), "multiple of KV heads"),
           ((q, kc, vc, rows[:2], lens), "kv_rows"), ((q, kc, vc, rows, lens[:, :2]), "lens"),
           ((q.astype(jnp.bfloat16), kc, vc, rows, lens), "one dtype")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            grouped_prefix_attention(*args, interpret=True)
    with pytest.raises(ValueError, match="interpret=True"):
        grouped_prefix_attention(q, kc, vc, rows, lens)
    with pytest.raises(ValueError, match="powers of two"):
        jax.eval_shape(lambda: grouped_prefix_attention(q, kc, vc, rows, lens, platform="gpu",
                                                        block_sizes=BlockSizes(block_k=24)))


# ---------------------------------------------------------------------------------------------
# The batched engine on the kernel
# ---------------------------------------------------------------------------------------------
CAPS = dict(max_seq_len=96, max_branch_tokens=48, decode_chunk=8, prefill_chunk=32, eos_token_ids=[])


def _ids(seed, n):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 307, n)]


def _drive(engine):
    """A mixed batch: plain generates (one sampled), a fork of 3 children with forced prefixes
    and per-child limits, an extend then generate, and an n=2 fork, on 3 slots (one queues)."""
    from sprint_jax.infer.sampling import Sampling
    hot = Sampling(temperature=1.0, seed=5)
    a, b, c, e = (engine.open(_ids(s, n)) for s, n in ((1, 21), (2, 40), (3, 9), (4, 14)))
    engine.run([a, b, c])
    ops = [engine.generate(a.result, 20),
           engine.fork(b.result, [_ids(5, 3), [], _ids(6, 7)], [12, 17, 9]),
           engine.extend(c.result, _ids(7, 13))]
    engine.run(ops)
    last = engine.generate(c.result, 11, sampling=hot)
    engine.run([last])
    for seq in (a.result, b.result, c.result):
        engine.close(seq)
    engine.run([e])
    n2 = engine.fork(e.result, [[], []], 10, sampling=hot)
    engine.run([n2])
    return [ops[0].result.tokens, [g.tokens for g in ops[1].result], last.result.tokens,
            [g.tokens for g in n2.result]]


def test_engine_on_the_kernel_gives_the_xla_engines_tokens(tiny_model):
    from sprint_jax.infer.engine import Engine
    model, tok = tiny_model, tiny_vocab_tokenizer()
    got = {impl: _drive(Engine(model, tok, max_seqs=3, max_children=4, attention_impl=impl, **CAPS))
           for impl in ("xla", "pallas")}
    assert sum(len(t) for t in got["xla"][1]) + len(got["xla"][0]) > 50
    assert got["pallas"] == got["xla"]
    from sprint_jax.infer.requests import EngineError
    with pytest.raises(EngineError, match="attention_impl"):
        Engine(model, tok, attention_impl="cuda", **CAPS)


@pytest.mark.slow
def test_eval_attention_impl_pallas_gives_the_xla_results(hf_untied, tmp_path):
    """`eval --attention-impl pallas` (formerly refused on the batched engine) writes the
    results.jsonl of the XLA path, timings aside."""
    import shutil

    from sprint_jax.cli import main
    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{k}", "problem": f"What is {k}+{k}?", "answer": str(2 * k)}) + "\n"
                             for k in range(3)))
    caps = ["--max-seq-len", "128", "--decode-chunk", "8", "--prefill-chunk", "32", "--max-prompts", "2",
            "--max-branch-tokens", "8", "--max-planner-tokens", "6", "--max-total-tokens", "14",
            "--concurrency", "2", "--mode", "parallel", "--no-progress"]
    rows = {}
    for impl in ("xla", "pallas"):
        out = tmp_path / impl
        assert main(["eval", "--model", str(model), "--data", str(tasks), "--out", str(out),
                     "--attention-impl", impl, *caps]) == 0
        rows[impl] = [untimed(json.loads(x)) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows["xla"]) == 3 and all(r["total_tokens"] > 0 for r in rows["xla"])
    assert rows["pallas"] == rows["xla"]


SHARDED = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[3])
import jax
from conftest import tiny_vocab_tokenizer
from test_parent_prefix import CAPS, _drive
from sprint_jax.infer import sharding as sh
from sprint_jax.infer.engine import Engine
from sprint_jax.model import from_pretrained

assert jax.device_count() == 8
tok = tiny_vocab_tokenizer()
model = from_pretrained(sys.argv[1])
ref = _drive(Engine(model, tok, max_seqs=4, max_children=4, **CAPS))   # one device, XLA
out = {}
# tensor=4 x data=2 only: the kernel's shard_map over slots (data) and KV heads (tensor) is the same
# at tensor=2 (the XLA engine's tensor=2 x data=2 is test_infer_sharded's); here the heads are copied too.
for spec, n in (("tensor=4,data=2", 8),):
    mesh = sh.mesh_from_flag(spec, devices=jax.devices()[:n])
    eng = Engine(model, tok, max_seqs=4, max_children=4, mesh=mesh, attention_impl="pallas", **CAPS)
    got = _drive(eng)
    from sprint_jax.infer import programs
    packed, layout = programs.DecodeRows.empty(2, 2, 4, 4, 4, 2, 2).pack()
    jaxpr = str(programs.decode.trace(eng._step_params, eng.config, eng.cache, packed, layout=layout, chunk=4,
                                      kv=eng._kv, attention_impl="pallas").jaxpr)
    out[spec] = {"same": got == ref, "shard_map": "shard_map" in jaxpr and "pallas_call" in jaxpr, "pk_spec": [None if x is None else str(x) for x in eng.cache.k.sharding.spec]}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_kernel_per_shard_on_a_mesh_gives_the_tokens_of_one_device(hf_untied):
    """8 fake CPU devices, tensor=4 x data=2 (KV heads copied to 4 by the engine's head layout):
    the kernel inside shard_map over slots (data) and KV heads (tensor) gives the same tokens as
    the XLA engine on one device."""
    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SHARDED, str(hf_untied), str(ROOT / "tests"), str(ROOT)],
                       env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert list(res) == ["tensor=4,data=2"]
    for spec, r in res.items():
        assert r["pk_spec"][2] == "data" and r["pk_spec"][1] == "tensor", (spec, r)    # [L, Hkv, pages, ps, D]
        assert r["shard_map"], spec               # the kernel runs per shard
        assert r["same"], spec
