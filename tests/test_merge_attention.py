"""Flash attention in the (stage, branch) form (the merge layout) == the dense reference,
forward and backward, every body; and its tile skipping.

Reference: `attend_partial` (dense [T, S] scores) under `span_mask(span_end, stage=, branch=)`,
differentiated by JAX's autodiff; the flash side uses its custom_vjp. Masks: merge rows from the real
data builder (random trajectories laid out by train/data.py's `layout_merge`, packed by its
RowStream) and random
(stage, branch) tags over random segments with fully masked rows. Tolerances as in
test_flash_attention.py: fp32 out / lse 2e-5, grads 2e-4 x the largest |grad|; bf16 out 3e-2,
lse 1e-2, grads 5e-2 x the largest |grad|.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import xla_flags
from sprint_jax.model.attention import (NEG_INF, FlashConfig, _xla_backward, _xla_forward, attend_partial,
                                        flash_attention, span_mask)
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

DATA = Path(__file__).parent / "data"
T = 101                                       # not a multiple of any block below
TOL = {"float32": (2e-5, 2e-5, 2e-4), "bfloat16": (3e-2, 1e-2, 5e-2)}   # out, lse, grad (rel.)


def _tag_tokenizer():
    """One token per SPRINT tag and per character: short merge rows with real structure."""
    from sprint_jax import format as fmt
    from sprint_jax.model.tokenizer import VocabTokenizer

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 \n?.")
    return VocabTokenizer(["<pad>", "<eos>"] + chars + fmt.tag_vocabulary(max_stages=4, max_prompts=3))


def merge_rows(b: int, t: int, seed: int = 0):
    """(span_end, stage, branch) [b, t] of merge rows from the real data builder: random SPRINT
    trajectories (1-3 stages of 1-3 prompts, random content lengths) laid out by layout_merge with a
    tag-per-token tokenizer, packed by RowStream (several examples per row, then padding)."""
    from sprint_jax import format as fmt
    from sprint_jax.schema import Example

    rng = np.random.default_rng(seed)
    word = lambda: "".join(rng.choice(list("abcxyz12 "), int(rng.integers(1, 6))))  # noqa: E731
    tok, items = _tag_tokenizer(), []
    for e in range(6 * b):
        stages = [fmt.Stage(i, [word()] + [fmt.Prompt(word()) for _ in range(n)], [word() for _ in range(n)])
                  for i, n in enumerate(rng.integers(1, 4, size=int(rng.integers(1, 4))), start=1)]
        traj = fmt.Trajectory("q" + word(), stages, word())
        ex = Example(str(e), "sprint", traj.query + "\n", fmt.render_completion(traj))
        item = D.layout_example(tok, ex, "merge", dict(SPAN_WEIGHTS_DEFAULT))
        items.append(item.truncate(int(rng.integers(t // 3, 2 * t // 3))))    # odd lengths, packed
    rows = D.RowStream(items, t, seed=seed, pad_token=0, open_rows=8).rows(list(range(b)))
    assert (rows.branch > 1).any(), "a merge row must hold sibling executors"
    return rows.span_end, rows.stage, rows.branch


def random_tags(rng, b: int, t: int):
    """Random segments (some first tokens hidden from everyone: fully masked rows), each a random
    sequence of planner runs and stages of 1-3 executors with random lengths."""
    se = np.zeros((b, t), np.int32)
    stage = np.zeros((b, t), np.int32)
    branch = np.zeros((b, t), np.int32)
    for r in range(b):
        cuts = sorted(rng.choice(np.arange(1, t), 3, replace=False).tolist()) + [t]
        start = 0
        for c in cuts:
            se[r, start:c] = c
            if rng.random() < 0.5:
                se[r, start] = start
            i, k = start, 1
            while i < c:
                n = int(rng.integers(1, 9))
                stage[r, i:i + n], i = k, i + n                      # planner run (branch 0)
                for j in range(1, int(rng.integers(1, 4)) + 1):
                    n = int(rng.integers(1, 12))
                    stage[r, i:i + n], branch[r, i:i + n] = k, j
                    i += n
                k += 1
            start = c
    return se, stage, branch


def inputs(seed, b, t, h, hkv, d, dtype):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)  # noqa: E731
    return mk(b, t, h, d), mk(b, t, hkv, d), mk(b, t, hkv, d), mk(b, t, h, d), mk(b, t, h)


def _loss(attn, q, k, v, wo, wl):
    o, lse = attn(q, k, v)
    live = lse > NEG_INF / 2
    return jnp.sum(o.astype(jnp.float32) * wo.astype(jnp.float32)) + \
        jnp.sum(jnp.where(live, lse * wl.astype(jnp.float32), 0.0))


def check(tags, h, hkv, d, dtype, seed=0, **flash_kw):
    se, stage, branch = (jnp.asarray(x) for x in tags)
    b, t = se.shape
    q, k, v, wo, wl = inputs(seed, b, t, h, hkv, d, dtype)
    mask = span_mask(se, stage=stage, branch=branch)
    dense = lambda q, k, v: attend_partial(q, k, v, mask)                                    # noqa
    flash = lambda q, k, v: flash_attention(q, k, v, se, stage=stage, branch=branch,        # noqa
                                            return_lse=True, **flash_kw)
    o_ref, l_ref = jax.jit(dense)(q, k, v)
    o, lse = jax.jit(flash)(q, k, v)
    tol_o, tol_l, tol_g = TOL[jnp.dtype(dtype).name]
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=tol_o)
    np.testing.assert_allclose(lse, l_ref, atol=tol_l, rtol=0)
    dead = np.asarray(l_ref) <= NEG_INF / 2
    np.testing.assert_array_equal(np.asarray(lse) <= NEG_INF / 2, dead)
    grad = jax.jit(jax.grad(_loss, argnums=(1, 2, 3)), static_argnums=0)
    for name, a, r in zip("qkv", grad(flash, q, k, v, wo, wl), grad(dense, q, k, v, wo, wl)):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        scale = float(np.abs(r).max())
        assert scale > 0, name
        np.testing.assert_allclose(a, r, atol=tol_g * scale, rtol=0, err_msg=f"d{name}")
    return dead


@pytest.mark.parametrize("h,hkv,blocks", [(4, 1, (16, 16)), (6, 3, (32, 16)), (3, 3, (16, 48))])
def test_xla_body_merge_rows_fp32(h, hkv, blocks):
    """Real packed merge rows and random tags (with fully masked rows), GQA 4 / 2 / 1, odd T."""
    check(merge_rows(2, T), h, hkv, 8, jnp.float32, impl="xla", block_q=blocks[0], block_k=blocks[1])
    dead = check(random_tags(np.random.default_rng(h), 2, T), h, hkv, 8, jnp.float32, impl="xla",
                 block_q=blocks[0], block_k=blocks[1])
    assert dead.any(), "the case must contain fully masked rows"


def test_xla_body_merge_bf16_default_blocks():
    check(merge_rows(2, T), 8, 2, 16, jnp.bfloat16, impl="xla")
    check(random_tags(np.random.default_rng(7), 1, T), 4, 1, 16, jnp.bfloat16, impl="xla",
          block_q=16, block_k=32)


def test_merge_queries_at_an_offset_into_the_keys():
    """The engine's form (a chunk of T queries at per-row offsets into S keys): each query row takes
    the (stage, branch) of its key row q_offset + t; == the dense mask built the same way."""
    b, s, t, h, hkv, d = 2, 83, 29, 4, 2, 8
    se, stage, branch = (jnp.asarray(x) for x in random_tags(np.random.default_rng(11), b, s))
    q, k, v, _, _ = inputs(1, b, s, h, hkv, d, jnp.float32)
    q = q[:, :t]
    off = jnp.asarray([0, 41], jnp.int32)
    o, lse = flash_attention(q, k, v, se, stage=stage, branch=branch, q_offset=off, impl="xla",
                             block_q=16, block_k=16, return_lse=True)
    o_ref, l_ref = attend_partial(q, k, v, span_mask(se, t, off, stage, branch))
    np.testing.assert_allclose(o, o_ref, atol=2e-5)
    np.testing.assert_allclose(lse, l_ref, atol=2e-5)


@pytest.mark.parametrize("impl", ["gpu", "tpu"])
def test_pallas_bodies_merge_interpret(impl):
    """Both Pallas bodies in the interpreter: real merge rows fp32 (GQA 4), random tags bf16."""
    check(merge_rows(2, 75), 4, 1, 16, jnp.float32, impl=impl, block_q=16, block_k=32,
          interpret=True)
    check(random_tags(np.random.default_rng(3), 1, 53), 7, 1, 16, jnp.bfloat16, impl=impl,
          block_q=32, block_k=16, interpret=True)


# ---------------------------------------------------------------------------------------------
# tile skipping
# ---------------------------------------------------------------------------------------------
def _long_branch_rows():
    """One real example with long executions (3 x ~90 tokens), packed after a short one: the
    shape where the merge rule empties whole tiles (a branch's queries vs a sibling's keys)."""
    from sprint_jax import format as fmt
    from sprint_jax.schema import Example

    tok = D.byte_tokenizer()
    execs = [f"step {j}: " + " ".join(f"{j * n}" for n in range(1, 30)) for j in (1, 2, 3)]
    traj = fmt.Trajectory("Sum three series.", [
        fmt.Stage(1, ["Three independent sums."] + [fmt.Prompt(f"series {j}") for j in (1, 2, 3)], execs),
        fmt.Stage(2, ["Add them."], ["done"])], "42")
    long_ex = Example("l", "sprint", traj.query + "\n", fmt.render_completion(traj))
    short_ex = D.read_examples([DATA / "sft_tiny_sprint.jsonl"])[2]
    items = [D.layout_example(tok, ex, "merge", dict(SPAN_WEIGHTS_DEFAULT)) for ex in (short_ex, long_ex)]
    t = sum(len(it) for it in items) + 5
    rows = D.RowStream(items, t, seed=0, pad_token=0, open_rows=1).rows([0])
    return rows.span_end, rows.stage, rows.branch


def _rule_count(se, stage, branch, bq, bk):
    """The documented tile test (model/attention.py docstring), evaluated in numpy per tile from
    the token arrays: (span test) and (plan or smin < smax or code ranges overlap)."""
    t = se.shape[0]
    code = np.clip(stage, 0, 2 ** 15 - 1) * 2 ** 16 + np.clip(branch, 1, 2 ** 16 - 1)
    n = 0
    for q0 in range(0, t, bq):
        rq = slice(q0, min(q0 + bq, t))
        qex = branch[rq] != 0
        for k0 in range(0, min(q0 + bq, t), bk):
            rk = np.arange(k0, min(k0 + bk, t))
            if se[rk].max() <= q0:
                continue
            valid = se[rk] > rk
            kex = valid & (branch[rk] != 0)
            plan = (valid & (branch[rk] == 0)).any()
            smin = stage[rk][kex].min() if kex.any() else np.inf
            overlap = kex.any() and qex.any() and code[rk][kex].min() <= code[rq][qex].max() \
                and code[rq][qex].min() <= code[rk][kex].max()
            n += bool(plan or smin < stage[rq].max() or overlap)
    return n


def test_tile_skipping_skips_exactly_the_documented_tiles():
    """The XLA body counts the tiles it computes (forward and backward). On a packed merge row with
    long branches: both counts == the documented rule evaluated tile by tile in numpy; >= the
    brute-force count of tiles holding a visible pair (no visible tile is skipped; the numbers
    below show how tight the bound is); and < the span rule alone (sibling tiles are skipped)."""
    se, stage, branch = _long_branch_rows()
    b, t = se.shape
    q, k, v, _, _ = inputs(0, b, t, 2, 1, 8, jnp.float32)
    tags = jnp.stack([jnp.asarray(stage), jnp.asarray(branch)], axis=1)
    off = jnp.zeros((b,), jnp.int32)
    mask = np.asarray(span_mask(jnp.asarray(se), stage=jnp.asarray(stage), branch=jnp.asarray(branch)))[0]
    for bq, bk in ((16, 16), (32, 16)):
        cfg = FlashConfig("xla", bq, bk)
        o, lse, n_fwd = _xla_forward(q, k, v, jnp.asarray(se), off, tags, cfg)
        n_span = int(_xla_forward(q, k, v, jnp.asarray(se), off, None, cfg)[2])
        n_bwd = int(_xla_backward(q, k, v, jnp.asarray(se), off, tags, o, lse, jnp.ones_like(o),
                                  jnp.zeros_like(lse), cfg)[3])
        exact = sum(mask[i:i + bq, j:j + bk].any() for i in range(0, t, bq) for j in range(0, t, bk))
        rule = _rule_count(se[0], stage[0], branch[0], bq, bk)
        print(f"T={t} blocks {bq}x{bk}: computed {int(n_fwd)} (bwd {n_bwd}), rule {rule}, "
              f"non-empty {exact}, span rule alone {n_span}")
        assert int(n_fwd) == n_bwd == rule
        assert exact <= rule < n_span
        assert rule - exact <= 0.1 * exact


@pytest.mark.parametrize("impl,kw", [("xla", {}), ("gpu", {"interpret": True}),
                                     ("tpu", {"interpret": True})])
def test_sibling_tiles_are_never_computed(impl, kw):
    """Rows 0-15 planner, 16-31 executor 1.1, 32-47 executor 1.2 (one example), 48-63 another
    example. Executor 1.1's keys and values are NaN: the tile (1.2's queries, 1.1's keys) is empty
    only by the merge rule, and computing it at all, even masked, would make 1.2's outputs and
    gradients NaN (0 * NaN). Rows 0-15, 32-63 must stay finite, and equal the dense reference."""
    b, t, h, hkv, d, blk = 1, 64, 2, 1, 16, 16
    q, k, v, wo, wl = inputs(2, b, t, h, hkv, d, jnp.float32)
    se = jnp.asarray(np.repeat([[48, 48, 48, 64]], 16, axis=1), jnp.int32)
    stage = jnp.asarray(np.repeat([[1, 1, 1, 1]], 16, axis=1), jnp.int32)
    branch = jnp.asarray(np.repeat([[0, 1, 2, 0]], 16, axis=1), jnp.int32)
    k = k.at[:, 16:32].set(jnp.nan)
    v = v.at[:, 16:32].set(jnp.nan)
    fn = lambda q, k, v: flash_attention(q, k, v, se, stage=stage, branch=branch, impl=impl,  # noqa
                                         block_q=blk, block_k=blk, return_lse=True, **kw)
    o, lse = fn(q, k, v)
    ok = np.r_[0:16, 32:64]
    assert np.isfinite(np.asarray(o)[:, ok]).all() and np.isfinite(np.asarray(lse)[:, ok]).all()
    o_ref, _ = attend_partial(q, jnp.nan_to_num(k), jnp.nan_to_num(v), span_mask(se, stage=stage, branch=branch))
    np.testing.assert_allclose(np.asarray(o)[:, ok], np.asarray(o_ref)[:, ok], atol=2e-5)
    dq, dk, dv = jax.grad(_loss, argnums=(1, 2, 3))(fn, q, k, v, wo, wl)
    assert np.isfinite(np.asarray(dq)[:, 32:]).all()
    assert np.isfinite(np.asarray(dk)[:, 32:]).all() and np.isfinite(np.asarray(dv)[:, 32:]).all()


def test_pallas_merge_bodies_lower_for_gpu_and_tpu_at_7b_sizes():
    """Forward + backward (three kernels each) in the merge form lower for Triton and Mosaic at
    Qwen2-7B heads (28 / 4 x 128), one 8192-token row, bf16: what this CPU can produce, not run."""
    from jax import export

    def loss(q, k, v, se, st, br, impl):
        return jnp.sum(flash_attention(q, k, v, se, stage=st, branch=br, impl=impl).astype(jnp.float32))

    t = 8192
    spec = [jax.ShapeDtypeStruct((1, t, 28, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16)] + [jax.ShapeDtypeStruct((1, t), jnp.int32)] * 3
    for impl, target, marker in [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")]:
        fn = jax.jit(jax.value_and_grad(lambda *a, _i=impl: loss(*a, _i), argnums=(0, 1, 2)))
        text = export.export(fn, platforms=[target], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*spec).mlir_module()
        assert text.count(marker) == 3, impl
        assert f"x{t}x{t}x" not in text


def test_bad_merge_inputs_name_the_problem():
    q, k, v, _, _ = inputs(0, 1, 8, 4, 2, 8, jnp.float32)
    se = jnp.full((1, 8), 8, jnp.int32)
    with pytest.raises(ValueError, match="both stage and branch"):
        flash_attention(q, k, v, se, stage=jnp.zeros((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="stage and branch must be"):
        flash_attention(q, k, v, se, stage=jnp.zeros((1, 7), jnp.int32), branch=jnp.zeros((1, 8), jnp.int32))


def test_train_loss_and_grads_on_merge_rows_equal_the_dense_step():
    """The train step's loss and parameter gradients on packed merge rows: flash attention (XLA
    body) under remat none and full == the dense-mask reference step (fp32)."""
    from sprint_jax.model import Qwen2Config, init_params
    from sprint_jax.train.step import weighted_loss_sum

    cfg = Qwen2Config(vocab_size=307, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    tok = D.byte_tokenizer()
    items = [D.layout_example(tok, ex, "merge", dict(SPAN_WEIGHTS_DEFAULT)).truncate(60 + 9 * i)
             for i, ex in enumerate(D.read_examples([DATA / "sft_tiny_sprint.jsonl"])[:4])]
    batch = {k: jnp.asarray(v) for k, v in
             D.RowStream(items, 131, seed=0, pad_token=0, open_rows=2).rows([0, 1]).as_dict().items()}
    assert set(batch) >= {"stage", "branch"}
    f = jax.jit(jax.value_and_grad(weighted_loss_sum), static_argnums=(1, 3, 4, 5))
    l_ref, g_ref = f(params, cfg, batch, "none", 0, "dense")
    for remat in ("none", "full"):
        l, g = f(params, cfg, batch, remat, 0, "flash")
        np.testing.assert_allclose(l, l_ref, rtol=1e-5)
        for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(a, r, rtol=0, atol=1e-4 * float(np.abs(r).max()), err_msg=remat)


MESH_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from sprint_jax.model.attention import attend_partial, flash_attention, span_mask
from sprint_jax.model import sharding as M
rng = np.random.default_rng(0)
b, t, h, hkv, d = 2, 40, 4, 2, 16
q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
k = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
v = jnp.asarray(rng.standard_normal((b, t, hkv, d)), jnp.float32)
se = jnp.full((b, t), t, jnp.int32)
st = jnp.asarray(np.repeat([[0, 1, 1, 1, 2]], 8, axis=1).repeat(2, 0), jnp.int32)
br = jnp.asarray(np.repeat([[0, 1, 2, 3, 0]], 8, axis=1).repeat(2, 0), jnp.int32)
mesh = M.make_mesh(1, 2, 2)
def loss(q, k, v, impl):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        o = flash_attention(q, k, v, se, stage=st, branch=br, impl=impl, block_q=16, block_k=16, interpret=True)
    return jnp.sum(o * o), o
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", None, "tensor", None)))
out = {}
for impl in ("gpu", "tpu"):
    f = jax.jit(jax.value_and_grad(lambda *a, _i=impl: loss(*a, _i), argnums=(0, 1, 2), has_aux=True))
    assert "shard_map" in str(jax.make_jaxpr(f)(put(q), put(k), put(v)))
    (_, o), g = f(put(q), put(k), put(v))
    ref = lambda q, k, v: attend_partial(q, k, v, span_mask(se, stage=st, branch=br))[0]
    g_ref = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    out[impl] = [float(jnp.abs(o - ref(q, k, v)).max())] + [float(jnp.abs(a - r).max() / jnp.abs(r).max()) for a, r in zip(g, g_ref)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_pallas_merge_bodies_run_per_shard_under_a_mesh():
    """Under a (data, fsdp, tensor) = (1, 2, 2) mesh of 4 fake CPU devices (rows over fsdp, heads
    over tensor) the Pallas bodies in the merge form run inside shard_map (the tags sharded with the
    rows) and equal the dense reference, outputs and gradients. Fake devices need a new process."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"))
    res = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-3000:]
    for impl, (out_err, *grad_errs) in json.loads(res.stdout.strip().splitlines()[-1]).items():
        assert out_err < 2e-5 and max(grad_errs) < 2e-4, (impl, out_err, grad_errs)
