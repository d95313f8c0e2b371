"""The flat layout on TPU through jax's splash attention == the dense reference; the selection.

Reference: `attend_partial` (dense [T, T] scores) under `span_mask(span_end)`, differentiated by
JAX's autodiff; the splash side runs jax's splash kernels in interpret mode (their own custom_vjp).
Rows: random contiguous segments (every row sees itself, as in the flat layout) and real flat rows
(`layout_flat` items packed by RowStream, padding included), lengths that are not block multiples
(padded to whole blocks), GQA 1/4/7. Tolerances: fp32 out 2e-5, grads 2e-4 x the largest |grad|;
bf16 out 3e-2, grads 5e-2 x the largest |grad| (splash also rounds q * 1/sqrt(D) to bf16).
Selection: `resolve_impl` per backend and layout, and the Mosaic kernels in the TPU lowering
(splash_mha_* for the flat layout, our flash_span_* for the trie) at Qwen2-7B heads and 8192 /
16384 tokens, and through the train loss.
"""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import xla_flags
from sprint_jax.model.attention import attend_partial, flash_attention, resolve_impl, span_mask
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

DATA = Path(__file__).parent / "data"
TOL = {"float32": (2e-5, 2e-4), "bfloat16": (3e-2, 5e-2)}                    # out, grad (rel.)


def segments(rng, b, t, n=5) -> np.ndarray:
    """Random contiguous segments: span_end = the end of j's segment (> j)."""
    se = np.zeros((b, t), np.int32)
    for r in range(b):
        start = 0
        for c in sorted(rng.choice(np.arange(1, t), n, replace=False).tolist()) + [t]:
            se[r, start:c] = c
            start = c
    return se


def flat_rows(b, t) -> np.ndarray:
    """span_end of real flat rows: SPRINT examples laid out flat, cut short, packed with padding."""
    tok = D.byte_tokenizer()
    exs = D.read_examples([DATA / "sft_tiny_sprint.jsonl"])
    items = [D.layout_example(tok, ex, "flat", dict(SPAN_WEIGHTS_DEFAULT)).truncate(41 + 13 * i)
             for i, ex in enumerate(exs[:5])]
    se = D.RowStream(items, t, seed=0, pad_token=0, open_rows=2).rows(list(range(b))).span_end
    assert (se == np.arange(1, t + 1)[None]).any(), "the rows should hold padding too"
    return se


def check(span_end, h, hkv, d, dtype, block=None, seed=0):
    b, t = span_end.shape
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)  # noqa: E731
    q, k, v, w = mk(b, t, h, d), mk(b, t, hkv, d), mk(b, t, hkv, d), mk(b, t, h, d)
    se = jnp.asarray(span_end)
    mask = span_mask(se)
    dense = lambda q, k, v: attend_partial(q, k, v, mask)[0]                      # noqa: E731
    splash = lambda q, k, v: flash_attention(q, k, v, se, impl="splash", layout="flat",  # noqa: E731
                                             interpret=True, block_q=block)
    tol_o, tol_g = TOL[jnp.dtype(dtype).name]
    o_ref, o = jax.jit(dense)(q, k, v), jax.jit(splash)(q, k, v)
    assert o.dtype == q.dtype and o.shape == q.shape
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=tol_o)
    loss = lambda f, q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    for name, a, r in zip("qkv", grad(splash, q, k, v), grad(dense, q, k, v)):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        scale = float(np.abs(r).max())
        assert scale > 0, name
        np.testing.assert_allclose(a, r, atol=tol_g * scale, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 1), (7, 1)])
def test_splash_packed_segments_fp32(h, hkv):
    """T = 300 with 128-blocks: padded to 384, three query / key blocks, segments across them."""
    check(segments(np.random.default_rng(h * 10 + hkv), 2, 300), h, hkv, 32, jnp.float32, block=128)


def test_splash_real_flat_rows_with_padding():
    check(flat_rows(2, 203), 8, 2, 64, jnp.float32)        # default block 256 (203 -> 256)


def test_splash_bf16():
    check(segments(np.random.default_rng(3), 1, 256), 4, 2, 64, jnp.bfloat16, block=128)


def test_splash_only_where_exact():
    q = k = v = jnp.zeros((1, 128, 2, 128), jnp.float32)
    se = jnp.full((1, 128), 128, jnp.int32)
    for kw in [{}, {"layout": "trie"}, {"layout": "merge"}, {"layout": "flat", "return_lse": True},
               {"layout": "flat", "q_offset": 0}]:
        with pytest.raises(ValueError, match="splash"):
            flash_attention(q, k, v, se, impl="splash", **kw)
    with pytest.raises(ValueError, match="layout"):
        flash_attention(q, k, v, se, layout="packed")


def test_resolve_impl_per_backend_and_layout():
    assert resolve_impl(None, "flat", backend="tpu") == "splash"
    for layout in (None, "trie", "merge"):
        assert resolve_impl(None, layout, backend="tpu") == "tpu"
    assert resolve_impl(None, "flat", splash_ok=False, backend="tpu") == "tpu"   # lse / offset / tags
    assert resolve_impl(None, "flat", backend="gpu") == "gpu"                      # cuDNN: not wired
    assert resolve_impl(None, "flat", backend="cpu") == "xla"
    assert resolve_impl("tpu", "flat", backend="tpu") == "tpu"                     # explicit kept


def _kernels(text: str) -> set[str]:
    return set(re.findall(r'kernel_name = "([A-Za-z0-9_]+)"', text))


def _export_tpu(fn, *spec) -> str:
    from jax import export
    return export.export(jax.jit(fn), platforms=["tpu"])(*spec).mlir_module()


def test_default_choice_lowers_splash_for_flat_and_ours_for_trie_at_7b_sizes(monkeypatch):
    """impl=None with a TPU default backend (this CPU host stands in: jax.default_backend patched,
    the lowering itself is for TPU): flat -> splash's three Mosaic kernels (fwd, dq, dkv), trie ->
    our three; Qwen2-7B heads (28 / 4 x 128), one 8192- and one 16384-token row, bf16, forward +
    backward."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    cases = [(t, layout, want) for t in (8192, 16384) for layout, want in
             [("flat", {"splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"}),
              ("trie", {"flash_span_fwd", "flash_span_dq", "flash_span_dkdv"})]]
    for t, layout, want in cases:
        spec = [jax.ShapeDtypeStruct((1, t, 28, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16),
                jax.ShapeDtypeStruct((1, t), jnp.int32)]
        def loss(q, k, v, se, _l=layout):
            return jnp.sum(flash_attention(q, k, v, se, layout=_l).astype(jnp.float32))
        text = _export_tpu(jax.value_and_grad(loss, argnums=(0, 1, 2)), *spec)
        names = _kernels(text)
        assert all(any(n.startswith(w) for n in names) for w in want), (t, layout, names)
        other = "flash_span_" if layout == "flat" else "splash_"
        assert not any(n.startswith(other) for n in names), (layout, names)
        assert text.count("tpu_custom_call") == 3, layout
        assert f"x{t}x{t}x" not in text                                          # no [T, T]


def test_train_loss_threads_the_layout(monkeypatch):
    """The train loss (train/step.py) passes its rows' layout to attention: on a TPU backend a
    flat-layout step lowers to splash, a trie-layout step and one without a layout to ours."""
    from sprint_jax.model import Qwen2Config, init_params
    from sprint_jax.train.step import weighted_loss_sum

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    b, t = 2, 256
    batch = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "weights" else jnp.int32)
             for k in ("tokens", "positions", "parents", "span_end", "weights")}
    for layout, prefix in [("flat", "splash_mha_"), ("trie", "flash_span_"), (None, "flash_span_")]:
        fn = jax.grad(lambda p, bt, _l=layout: weighted_loss_sum(p, cfg, bt, "none", 0, "flash", _l))
        names = _kernels(_export_tpu(fn, params, batch))
        assert names and all(n.startswith(prefix) for n in names), (layout, names)


MESH_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sprint_jax.model.attention import attend_partial, flash_attention, span_mask
from sprint_jax.model import sharding as M

assert jax.device_count() == 4
rng = np.random.default_rng(0)
b, t, h, hkv, d = 2, 130, 4, 2, 32
q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, hkv, hkv))
se = np.full((b, t), t, np.int32); se[0, :17] = 17; se[1, :64] = 64; se[1, 64:99] = 99
se = jnp.asarray(se)
mesh = M.make_mesh(1, 2, 2)

def loss(q, k, v):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        o = flash_attention(q, k, v, se, impl="splash", layout="flat", interpret=True)
    return jnp.sum(o * o), o

put = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", None, "tensor", None)))
f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
qs, ks, vs = put(q), put(k), put(v)
assert "shard_map" in str(jax.make_jaxpr(f)(qs, ks, vs))
(_, o), g = f(qs, ks, vs)
ref = lambda q, k, v: attend_partial(q, k, v, span_mask(se))[0]
g_ref = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
print(json.dumps([float(jnp.abs(o - ref(q, k, v)).max())] +
                 [float(jnp.abs(a - r).max() / jnp.abs(r).max()) for a, r in zip(g, g_ref)]))
"""


def test_splash_runs_per_shard_under_a_mesh():
    """Under a (data, fsdp, tensor) = (1, 2, 2) mesh of 4 fake CPU devices (rows over fsdp, heads
    over tensor) splash runs inside shard_map and still equals the dense reference (out, grads).
    Fake devices need a fresh process."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"))
    res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    out_err, *grad_errs = json.loads(res.stdout.strip().splitlines()[-1])
    assert out_err < 2e-5
    assert max(grad_errs) < 2e-4, grad_errs
