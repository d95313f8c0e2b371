"""Flash attention under the span rule == the dense reference, forward and backward, every body.

Reference: `attend_partial` (dense [T, S] scores) under the explicit mask `span_mask(span_end)`,
differentiated by JAX's own autodiff; the flash side uses its custom_vjp (recomputed tiles).
Masks: packed segments (random cut points) and real tries (items from train/data.py's
`layout_trie`, packed by its RowStream), lengths not multiples of any block, fully masked rows,
GQA ratios 1, 4 and 7. Bodies: the XLA body (several tile shapes) and both Pallas bodies in
interpret mode. Tolerances: fp32 out / lse 2e-5 and grads 2e-4 x the largest |grad| (both sides
accumulate in fp32; only the summation order differs); bf16 (inputs, output and the P.V / dS
products in bf16 on both sides) out 3e-2, lse 1e-2, grads 5e-2 x the largest |grad|.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import xla_flags
from sprint_jax.model.attention import NEG_INF, attend_partial, flash_attention, span_mask
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

DATA = Path(__file__).parent / "data"
T = 101                                       # not a multiple of any block below
TOL = {"float32": (2e-5, 2e-5, 2e-4), "bfloat16": (3e-2, 1e-2, 5e-2)}   # out, lse, grad (rel.)


def packed_segments(rng, b, t, fully_masked=True) -> np.ndarray:
    """Random contiguous segments (span_end = end of j's segment); optionally the first token of
    some segments is hidden from everyone, itself included (span_end[j] = j): a fully masked row."""
    se = np.zeros((b, t), np.int32)
    for r in range(b):
        cuts = sorted(rng.choice(np.arange(1, t), 6, replace=False).tolist()) + [t]
        start = 0
        for c in cuts:
            se[r, start:c] = c
            if fully_masked and rng.random() < 0.5:
                se[r, start] = start
            start = c
    return se


def trie_rows(b, t) -> np.ndarray:
    """span_end of real trie rows: SPRINT examples laid out by layout_trie, cut short, packed."""
    tok = D.byte_tokenizer()
    exs = D.read_examples([DATA / "sft_tiny_sprint.jsonl"])
    items = []
    for i, ex in enumerate(exs[:6]):
        it = D.layout_example(tok, ex, "trie", dict(SPAN_WEIGHTS_DEFAULT))
        items.append(it.truncate(37 + 11 * i))
    stream = D.RowStream(items, t, seed=0, pad_token=0, open_rows=2)
    se = stream.rows(list(range(b))).span_end
    assert (se[:, :-1] > np.arange(1, t)[None]).any(), "a trie row must have long spans"
    return se


def inputs(seed, b, t, h, hkv, d, dtype):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)  # noqa: E731
    return mk(b, t, h, d), mk(b, t, hkv, d), mk(b, t, hkv, d), mk(b, t, h, d), mk(b, t, h)


def _loss(attn, q, k, v, wo, wl):
    """A scalar that sends cotangents into both outputs (out and lse)."""
    o, lse = attn(q, k, v)
    live = lse > NEG_INF / 2
    return jnp.sum(o.astype(jnp.float32) * wo.astype(jnp.float32)) + \
        jnp.sum(jnp.where(live, lse * wl.astype(jnp.float32), 0.0))


def check(span_end, h, hkv, d, dtype, seed=0, q_offset=None, **flash_kw):
    b, t = span_end.shape
    q, k, v, wo, wl = inputs(seed, b, t, h, hkv, d, dtype)
    se = jnp.asarray(span_end)
    off = 0 if q_offset is None else q_offset
    mask = span_mask(se, t, off)
    dense = lambda q, k, v: attend_partial(q, k, v, mask)                           # noqa: E731
    flash = lambda q, k, v: flash_attention(q, k, v, se, q_offset=q_offset,         # noqa: E731
                                            return_lse=True, **flash_kw)
    o_ref, l_ref = jax.jit(dense)(q, k, v)
    o, lse = jax.jit(flash)(q, k, v)
    tol_o, tol_l, tol_g = TOL[jnp.dtype(dtype).name]
    assert o.dtype == q.dtype and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=tol_o)
    np.testing.assert_allclose(lse, l_ref, atol=tol_l, rtol=0)
    dead = np.asarray(l_ref) <= NEG_INF / 2                                       # [B, T, H]
    np.testing.assert_array_equal(np.asarray(lse) <= NEG_INF / 2, dead)
    assert np.all(np.asarray(o, np.float32)[dead] == 0)
    grad = jax.jit(jax.grad(_loss, argnums=(1, 2, 3)), static_argnums=0)
    g_ref = grad(dense, q, k, v, wo, wl)
    g = grad(flash, q, k, v, wo, wl)
    for name, a, r in zip("qkv", g, g_ref):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        assert a.dtype == r.dtype
        scale = float(np.abs(r).max())
        assert scale > 0, name
        np.testing.assert_allclose(a, r, atol=tol_g * scale, rtol=0, err_msg=f"d{name}")
    return dead


@pytest.mark.parametrize("h,hkv,blocks", [(3, 3, (16, 16)), (8, 2, (32, 16)), (7, 1, (16, 48)),
                                          (4, 2, (64, 32))])
def test_xla_body_packed_segments_fp32(h, hkv, blocks):
    """Blocks (64, 32) give 2 x 4 tiles: the XLA body's unrolled tile loops (FlashConfig.unroll_tiles);
    the others its lax loops."""
    se = packed_segments(np.random.default_rng(h), 2, T)
    dead = check(se, h, hkv, 8, jnp.float32, impl="xla", block_q=blocks[0], block_k=blocks[1])
    assert dead.any(), "the case must contain fully masked rows"


@pytest.mark.parametrize("h,hkv", [(8, 2), (7, 1)])
def test_xla_body_real_tries(h, hkv):
    check(trie_rows(3, T), h, hkv, 16, jnp.float32, impl="xla", block_q=16, block_k=32)


def test_xla_body_bf16_and_default_blocks():
    se = packed_segments(np.random.default_rng(5), 2, T)
    check(se, 8, 2, 16, jnp.bfloat16, impl="xla")
    check(trie_rows(2, T), 4, 1, 16, jnp.bfloat16, impl="xla", block_q=32, block_k=16)


def test_xla_body_unrolled_tile_loops_compute_the_same_tiles():
    """Short rows run the XLA body's tile loops unrolled (FlashConfig.unroll_tiles): the same
    tiles are computed (the counts both bodies return) in the same order, so out, lse and the
    gradients equal the lax loops' to the bit; real trie rows, with and without query offsets."""
    from sprint_jax.model.attention import FlashConfig, _xla_backward, _xla_forward
    b, t, h, hkv, d = 2, 80, 4, 2, 8
    q, k, v, do, dlse = inputs(4, b, t, h, hkv, d, jnp.float32)
    se, off = jnp.asarray(trie_rows(b, t)), jnp.asarray([0, 3], jnp.int32)
    zero = jnp.zeros((b,), jnp.int32)
    # (unroll_tiles, no_offset, q_offset); 16-blocks: 5 x 5 tiles. no_offset (flash_attention
    # without q_offset) also leaves the tiles past the causal limit out of the unrolled loops.
    for cases in [((0, False, off), (25, False, off)), ((0, False, zero), (25, True, zero))]:
        runs = []
        for unroll_tiles, no_offset, q_off in cases:
            cfg = FlashConfig("xla", 16, 16, unroll_tiles=unroll_tiles, no_offset=no_offset)
            o, lse, n_f = jax.jit(_xla_forward, static_argnums=6)(q, k, v, se, q_off, None, cfg)
            *grads, n_b = jax.jit(_xla_backward, static_argnums=10)(q, k, v, se, q_off, None, o, lse,
                                                                     do, dlse, cfg)
            runs.append((o, lse, *grads, n_f, n_b))
        for a, r in zip(*runs):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
        assert 0 < int(runs[0][-2]) < 25 and 0 < int(runs[0][-1]) < 25, "some tiles skipped, some computed"


def test_queries_at_an_offset_into_the_keys():
    """The engine's prefill: a chunk of T queries at per-row offsets into S >= T cached keys."""
    b, s, t, h, hkv, d = 2, 83, 29, 4, 2, 8
    rng = np.random.default_rng(3)
    q, k, v, _, _ = inputs(1, b, s, h, hkv, d, jnp.float32)
    q = q[:, :t]
    off = jnp.asarray([0, 41], jnp.int32)
    se = jnp.full((b, s), s + t, jnp.int32).at[1, 5].set(int(rng.integers(0, 40)))
    o, lse = flash_attention(q, k, v, se, q_offset=off, impl="xla", block_q=16, block_k=16,
                             return_lse=True)
    o_ref, l_ref = attend_partial(q, k, v, span_mask(se, t, off))
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_allclose(lse, l_ref, atol=2e-5)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_pallas_bodies_interpret(impl):
    """Both Pallas bodies in the interpreter: a trie with GQA 4, fp32 and (smaller) bf16."""
    check(trie_rows(2, 75), 4, 1, 16, jnp.float32, impl=impl, block_q=16, block_k=32,
          interpret=True)
    se = packed_segments(np.random.default_rng(9), 1, 53)
    dead = check(se, 7, 1, 16, jnp.bfloat16, impl=impl, block_q=32, block_k=16, interpret=True)
    assert dead.any()


@pytest.mark.parametrize("impl,blk,kw", [("xla", 16, {}), ("xla", 8, {}), ("gpu", 16, {"interpret": True}),
                                         ("tpu", 16, {"interpret": True})])
def test_empty_tiles_are_never_computed(impl, blk, kw):
    """Keys no row may see (span_end[j] = 16 <= j) filling keys 16..31 (key block 1 at blocks of
    16, blocks 2 and 3 at 8) hold NaN: their tiles are empty by the rule (kmax 16 <= every later
    query block's first row; earlier query blocks end before it), and any computation of such a
    tile, even masked, would turn the output or a gradient NaN (0 * NaN). The XLA body runs its
    unrolled tile loops at blocks of 16 (4 x 4 tiles) and its lax loops at 8 (8 x 8)."""
    b, t, h, hkv, d = 1, 64, 2, 1, 16
    q, k, v, wo, wl = inputs(2, b, t, h, hkv, d, jnp.float32)
    se = np.full((b, t), t, np.int32)
    se[:, 16:32] = 16                             # key block 1: hidden from everyone
    k = k.at[:, 16:32].set(jnp.nan)
    v = v.at[:, 16:32].set(jnp.nan)
    fn = lambda q, k, v: flash_attention(q, k, v, jnp.asarray(se), impl=impl, block_q=blk,  # noqa
                                         block_k=blk, return_lse=True, **kw)
    o, lse = fn(q, k, v)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(lse)).all()
    dq, dk, dv = jax.grad(_loss, argnums=(1, 2, 3))(fn, q, k, v, wo, wl)
    assert np.isfinite(np.asarray(dq)).all()
    assert np.isfinite(np.asarray(dk)[:, 32:]).all() and np.isfinite(np.asarray(dv)[:, 32:]).all()
    mask = span_mask(jnp.asarray(se))
    o_ref, _ = attend_partial(q, jnp.nan_to_num(k), jnp.nan_to_num(v), mask)
    np.testing.assert_allclose(o, o_ref, atol=2e-5)


def test_pallas_bodies_lower_for_gpu_and_tpu_at_7b_sizes():
    """Forward + backward (three kernels each) lower for Triton and Mosaic at Qwen2-7B heads
    (28 / 4 x 128), one 8192- and one 16384-token row, bf16: what this CPU can produce, not run."""
    from jax import export

    def loss(q, k, v, se, impl):
        return jnp.sum(flash_attention(q, k, v, se, impl=impl).astype(jnp.float32))

    for t in (8192, 16384):
        spec = [jax.ShapeDtypeStruct((1, t, 28, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t), jnp.int32)]
        for impl, target, marker in [("gpu", "cuda", "__gpu$xla.gpu.triton"),
                                     ("tpu", "tpu", "tpu_custom_call")]:
            fn = jax.jit(jax.value_and_grad(lambda *a, _i=impl: loss(*a, _i), argnums=(0, 1, 2)))
            exported = export.export(
                fn, platforms=[target],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(*spec)
            text = exported.mlir_module()
            assert text.count(marker) == 3, (impl, t)       # forward, dk/dv, dq
            assert f"tensor<1x{t}x{t}x" not in text and f"x{t}x{t}x" not in text  # no [T, T]


def test_bad_inputs_name_the_problem():
    q, k, v, _, _ = inputs(0, 1, 8, 4, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="span_end"):
        flash_attention(q, k, v, jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="H % Hkv"):
        flash_attention(q[:, :, :3], k, v, jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        flash_attention(q, k, v, jnp.zeros((1, 8), jnp.int32), impl="cuda")


MESH_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sprint_jax.model.attention import attend_partial, flash_attention, span_mask
from sprint_jax.model import sharding as M

assert jax.device_count() == 4
rng = np.random.default_rng(0)
b, t, h, hkv, d = 2, 40, 4, 2, 16
q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
k = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
v = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
se = np.full((b, t), t, np.int32); se[0, :17] = 17; se[1, 5:9] = 30
se = jnp.asarray(se)
mesh = M.make_mesh(1, 2, 2)

def loss(q, k, v, impl):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        o = flash_attention(q, k, v, se, impl=impl, block_q=16, block_k=16, interpret=True)
    return jnp.sum(o * o), o

put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
qs, ks = put(q, P("fsdp", None, "tensor", None)), put(k, P("fsdp", None, "tensor", None))
vs = put(v, P("fsdp", None, "tensor", None))
out = {}
for impl in ("gpu", "tpu"):
    f = jax.jit(jax.value_and_grad(lambda *a, _i=impl: loss(*a, _i), argnums=(0, 1, 2), has_aux=True))
    assert "shard_map" in str(jax.make_jaxpr(f)(qs, ks, vs))
    (_, o), g = f(qs, ks, vs)
    ref = lambda q, k, v: attend_partial(q, k, v, span_mask(se))[0]
    g_ref = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    out[impl] = [float(jnp.abs(o - ref(q, k, v)).max())] + \
        [float(jnp.abs(a - r).max() / jnp.abs(r).max()) for a, r in zip(g, g_ref)]
print(json.dumps(out))
"""


def test_pallas_bodies_run_per_shard_under_a_mesh():
    """Under a (data, fsdp, tensor) = (1, 2, 2) mesh of 4 fake CPU devices, with rows over fsdp and
    heads over tensor, the Pallas bodies run inside shard_map and still equal the dense reference
    (outputs and gradients). Fake devices need a fresh process."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"))
    res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    errs = json.loads(res.stdout.strip().splitlines()[-1])
    for impl, (out_err, *grad_errs) in errs.items():
        assert out_err < 2e-5, impl
        assert max(grad_errs) < 2e-4, (impl, grad_errs)


def test_train_loss_and_grads_every_remat_policy_equal_the_dense_step():
    """The train step's loss and parameter gradients on packed trie rows: flash attention under
    remat none / full / dots == the dense-mask reference step (fp32; measured ~1e-6 relative)."""
    from sprint_jax.model import Qwen2Config, init_params
    from sprint_jax.train.step import weighted_loss_sum

    cfg = Qwen2Config(vocab_size=307, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    tok = D.byte_tokenizer()
    items = [D.layout_example(tok, ex, "trie", dict(SPAN_WEIGHTS_DEFAULT)).truncate(60 + 9 * i)
             for i, ex in enumerate(D.read_examples([DATA / "sft_tiny_sprint.jsonl"])[:4])]
    batch = {k: jnp.asarray(v) for k, v in
             D.RowStream(items, 131, seed=0, pad_token=0, open_rows=2).rows([0, 1]).as_dict().items()}
    f = jax.jit(jax.value_and_grad(weighted_loss_sum), static_argnums=(1, 3, 4, 5))
    l_ref, g_ref = f(params, cfg, batch, "none", 0, "dense")
    for remat in ("none", "full", "dots"):
        l, g = f(params, cfg, batch, remat, 0, "flash")
        np.testing.assert_allclose(l, l_ref, rtol=1e-5)
        for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(a, r, rtol=0, atol=1e-4 * float(np.abs(r).max()), err_msg=remat)
