"""The grouped paged-prefix kernel (kernels/paged_prefix.py): each group's pages of the KV pool read
once for all its rows.

Reference: a float64 numpy softmax attention written here (row (g, w) over the first lens[g, w]
tokens of its group's pages, token t at page table[g, t // ps], slot t % ps, of the pool's layer).
Both kernel bodies run in Pallas interpret mode on CPU; the real bodies are compiled (not run) for
GPUs (compute capability 8.0 and 9.0, jax's CUDA plugin) and TPUs (v5e, v5p, libtpu's compile-only
topologies) at R1-Distill-Qwen-7B decode shapes.
"""
from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sprint_jax.kernels import BlockSizes, gpu_target
from sprint_jax.kernels.paged_prefix import (default_paged_block_sizes, grouped_paged_prefix_attention,
                                             grouped_paged_prefix_attention_reference,
                                             paged_group_bytes_read, tpu_page_slot)
from sprint_jax.model.attention import NEG_INF
from sprint_jax.plan.compile import cuda_plugin_available

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="compiling for GPUs needs jax's CUDA plugin "
                                         "(pip install 'jax-cuda12-plugin==<the jax version>')")
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="compiling for TPU needs libtpu (pip install -e '.[tpu]')")
# fp32: both sides accumulate in fp32 (kernel logits in base 2); bf16 vs the float64 answer on the
# same bf16 inputs (probabilities rounded to bf16 before P.V, output rounded to bf16).
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def naive(q, k_pool, v_pool, layer, table, lens):
    """float64: row (g, w) attends over the first lens[g, w] tokens of group g's pages."""
    q, kp, vp = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k_pool, v_pool))
    gr, w, h, d = q.shape
    hkv, ps = kp.shape[1], kp.shape[3]
    rep = h // hkv
    out, lse = np.zeros((gr, w, h, d)), np.full((gr, w, h), NEG_INF)
    for g in range(gr):
        for j in range(w):
            n = int(lens[g][j])
            if n == 0:
                continue
            pages = [table[g][t // ps] for t in range(n)]
            slots = [t % ps for t in range(n)]
            k = np.repeat(kp[layer][:, pages, slots], rep, axis=0)         # [H, n, D]
            v = np.repeat(vp[layer][:, pages, slots], rep, axis=0)
            logits = np.einsum("hd,hnd->hn", q[g, j], k) / np.sqrt(d)
            peak = logits.max(1, keepdims=True)
            e = np.exp(logits - peak)
            out[g, j] = np.einsum("hn,hnd->hd", e / e.sum(1, keepdims=True), v)
            lse[g, j] = peak[:, 0] + np.log(e.sum(1))
    return out, lse


def make_case(seed, gr, w, h, hkv, d, ps, m, dtype, layers=3):
    """A pool with more pages than the groups use; each group's pages a random (shuffled) subset,
    table entries past a group's longest row out of range; every pool entry no row may see is NaN
    (other layers, unused pages, the tail of a group's last page). Group 0 sees nothing, group 1
    has a row at the full table and one at 11 tokens (no page multiple), all rows ragged."""
    rng = np.random.default_rng(seed)
    n = gr * m + 5
    q = rng.standard_normal((gr, w, h, d), np.float32)
    kp = rng.standard_normal((layers, hkv, n, ps, d), np.float32)
    vp = rng.standard_normal((layers, hkv, n, ps, d), np.float32)
    table = rng.permutation(n)[:gr * m].reshape(gr, m).astype(np.int32)
    lens = rng.integers(0, m * ps + 1, (gr, w)).astype(np.int32)
    lens[0] = 0
    lens[1, 0] = m * ps
    if w > 1:
        lens[1, 1] = 11
    layer = int(rng.integers(1, layers))        # never 0: a kernel that ignores the layer fails
    seen = np.zeros((layers, n, ps), bool)
    for g in range(gr):
        used = int(lens[g].max())
        for t in range(used):
            seen[layer, table[g, t // ps], t % ps] = True
        table[g, -(-used // ps):] = rng.choice([-7, n, n + 100, 2 ** 30], m - -(-used // ps))
    mask = seen[:, None, :, :, None]
    kp, vp = np.where(mask, kp, np.nan), np.where(mask, vp, np.nan)
    return (jnp.asarray(q, dtype), jnp.asarray(kp, dtype), jnp.asarray(vp, dtype), layer,
            table, lens)


# (groups, W, H, Hkv, D, page_size, table width M, dtype): W 1, 3, 8; GQA 1, 4, 7, 3; both page
# sizes; both dtypes
CASES = {"w1-gqa1-ps16-f32": (3, 1, 4, 4, 16, 16, 5, "float32"),
         "w3-gqa4-ps32-bf16": (3, 3, 8, 2, 16, 32, 4, "bfloat16"),
         "w8-gqa7-ps16-bf16": (3, 8, 7, 1, 16, 16, 6, "bfloat16"),
         "w3-gqa3-ps32-f32": (4, 3, 6, 2, 32, 32, 3, "float32")}


def small_blocks(platform, ps):
    """Tiny tiles: several query blocks, and on TPU key blocks of 2 pages, on GPU 2 splits."""
    return BlockSizes(block_q=16, block_k=2 * ps if platform == "tpu" else ps, num_splits=2)


def check(o, lse, want_o, want_l, lens, tol):
    h = o.shape[2]
    o = np.asarray(jnp.asarray(o, jnp.float32))
    assert np.isfinite(o).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(o, want_o, atol=tol)
    seen = lens[:, :, None].repeat(h, 2) > 0
    np.testing.assert_allclose(np.where(seen, lse, 0), np.where(seen, want_l, 0), atol=min(tol, 1e-2))
    assert (np.asarray(lse)[~seen] == NEG_INF).all() and (o[~seen] == 0).all()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_float64_attention_over_the_pages(platform, case):
    gr, w, h, hkv, d, ps, m, dtype = CASES[case]
    q, kp, vp, layer, table, lens = make_case(len(case), gr, w, h, hkv, d, ps, m, jnp.dtype(dtype))
    want_o, want_l = naive(q, kp, vp, layer, table, lens)
    for sizes in (small_blocks(platform, ps), None):       # tiny tiles, then the platform defaults
        o, lse = grouped_paged_prefix_attention(q, kp, vp, jnp.int32(layer), table, lens, interpret=True,
                                                platform=platform, block_sizes=sizes)
        assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (gr, w, h)
        assert lse.dtype == jnp.float32
        check(o, lse, want_o, want_l, lens, TOL[dtype])


@pytest.mark.parametrize("case", list(CASES)[:2])
def test_jnp_reference_equals_float64_attention(case):
    """The in-file jnp reference (the engine's XLA path: gather the pages, attend under a mask)."""
    gr, w, h, hkv, d, ps, m, dtype = CASES[case]
    q, kp, vp, layer, table, lens = make_case(3, gr, w, h, hkv, d, ps, m, jnp.float32)
    # the jnp reference reads whole pages (masked by the length), so the tails hold numbers here
    kp, vp = jnp.nan_to_num(kp), jnp.nan_to_num(vp)
    o, lse = grouped_paged_prefix_attention_reference(q, kp, vp, layer, table, lens)
    check(o, lse, *naive(q, kp, vp, layer, table, lens), lens, TOL["float32"])


def test_the_merge_by_lse_of_two_page_ranges_is_attention_over_both():
    """The kernel's lse is the natural-log normaliser: the first 3 pages of a row and its last 2,
    merged by log-sum-exp, give attention over all 5 (what the engine does with the partials)."""
    from sprint_jax.kernels.reference import merge_partials
    gr, w, h, hkv, d, ps, m = 2, 3, 4, 2, 16, 16, 5
    q, kp, vp, layer, table, _ = make_case(5, gr, w, h, hkv, d, ps, m, jnp.float32)
    kp, vp = jnp.nan_to_num(kp), jnp.nan_to_num(vp)
    table = np.arange(gr * m, dtype=np.int32).reshape(gr, m)
    full = np.full((gr, w), m * ps, np.int32)
    a = grouped_paged_prefix_attention(q, kp, vp, layer, table[:, :3], full * 3 // m, interpret=True, platform="tpu")
    b = grouped_paged_prefix_attention(q, kp, vp, layer, table[:, 3:], full * 2 // m, interpret=True, platform="gpu")
    o, lse = merge_partials([a, b])
    check(o, lse, *naive(q, kp, vp, layer, table, full), full, TOL["float32"])


def test_tpu_groups_beyond_the_smem_budget_run_as_several_calls(monkeypatch):
    """Page tables over the SMEM budget: the groups run in balanced calls (5 groups of 7 pages at
    2 groups a call: 3 calls, the last padded), same answer; a table too wide for one group is a
    clear error."""
    from sprint_jax.kernels import paged_prefix
    gr, w, h, hkv, d, ps, m = 5, 2, 4, 2, 16, 16, 7          # shapes no other test traces
    q, kp, vp, layer, table, lens = make_case(9, gr, w, h, hkv, d, ps, m, jnp.float32)
    monkeypatch.setattr(paged_prefix, "TPU_SMEM_TABLE_BYTES", 2 * 4 * m + 4)
    run = lambda *a: grouped_paged_prefix_attention(*a, interpret=True, platform="tpu")  # noqa: E731
    assert str(jax.make_jaxpr(run)(q, kp, vp, layer, table, lens)).count("pallas_call[") == 3
    check(*run(q, kp, vp, layer, table, lens), *naive(q, kp, vp, layer, table, lens), lens, TOL["float32"])
    with pytest.raises(ValueError, match="SMEM budget"):
        run(q, kp, vp, layer, np.zeros((gr, 3 * m), np.int32), lens)


def test_tpu_page_slots_read_only_used_pages_and_repeat_past_the_last_block():
    """The TPU index maps' page slots (page i of key block kb, a group of `used` pages): every slot
    is a used page and every used page is read; past the last used block, and in its slots past
    the last used page, a slot is the one it had the step before (the pipeline issues no DMA)."""
    for ppb in (1, 3, 4):
        for used in range(0, 14):
            slots = np.array([[int(tpu_page_slot(kb, i, used, ppb)) for i in range(ppb)] for kb in range(16)])
            assert (slots >= 0).all() and (slots < max(used, 1)).all(), (ppb, used)
            last = max(-(-used // ppb) - 1, 0)
            assert set(slots[:last + 1].ravel()) == set(range(max(used, 1))), (ppb, used)
            for kb in range(last + 1):
                for i in range(ppb):
                    if kb * ppb + i < used:
                        assert slots[kb, i] == kb * ppb + i
                    elif kb > 0:
                        assert slots[kb, i] == slots[kb - 1, i], (ppb, used, kb, i)
            assert (slots[last:] == slots[last]).all(), (ppb, used)


def test_block_sizes_bytes_and_bad_inputs():
    with gpu_target.target((9, 0)):
        gpu = default_paged_block_sizes("gpu", 8, 8, 28, 4, 1024, 16)
    assert (gpu.block_q, gpu.block_k) == (64, 16) and gpu.num_splits * 8 * 4 >= 264
    tpu = default_paged_block_sizes("tpu", 8, 8, 28, 4, 1024, 16)
    assert (tpu.block_q, tpu.block_k, tpu.num_splits) == (64, 256, 1)     # a group's 56 rows: one block
    assert default_paged_block_sizes("tpu", 8, 8, 28, 4, 3, 32).block_k == 96   # at most the table
    # each group's pages once (K and V, whole pages), whatever its rows: groups of 100 and 7
    # tokens in pages of 16 hold 7 and 1 pages
    assert paged_group_bytes_read([100, 7], 9, 4, 2, 8, 16, jnp.bfloat16) == \
        (7 + 1) * 2 * 2 * 16 * 8 * 2 + 2 * 9 * 4 * 8 * 2
    q, kp, vp, layer, table, lens = make_case(1, 3, 3, 8, 2, 16, 16, 4, jnp.float32)
    bad = [((q[0], kp, vp, layer, table, lens), "q must be"), ((q, kp, vp[:1], layer, table, lens), "k_pool and v_pool"),
           ((q[:, :, :7], kp, vp, layer, table, lens), "multiple of KV heads"),
           ((q, kp, vp, np.zeros(2, np.int32), table, lens), "layer must be"),
           ((q, kp, vp, layer, table[:2], lens), "page_table"), ((q, kp, vp, layer, table, lens[:, :2]), "lens"),
           ((q.astype(jnp.bfloat16), kp, vp, layer, table, lens), "one dtype")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            grouped_paged_prefix_attention(*args, interpret=True)
    with pytest.raises(ValueError, match="interpret=True"):
        grouped_paged_prefix_attention(q, kp, vp, layer, table, lens)
    with pytest.raises(ValueError, match="multiple of the page size"):
        grouped_paged_prefix_attention(q, kp, vp, layer, table, lens, interpret=True, platform="tpu",
                                       block_sizes=BlockSizes(block_k=24))
    with pytest.raises(ValueError, match="page size 16 on GPU"):
        grouped_paged_prefix_attention(q, kp, vp, layer, table, lens, interpret=True, platform="gpu",
                                       block_sizes=BlockSizes(block_k=32))
    with pytest.raises(ValueError, match="page_size a power of two"):
        jax.eval_shape(lambda: grouped_paged_prefix_attention(q, kp[..., :12, :], vp[..., :12, :], layer, table,
                                                              lens, platform="gpu"))


# ---------------------------------------------------------------------------------------------
# The real bodies at R1-Distill-Qwen-7B decode shapes: 8 groups of 8 rows, 28 / 4 heads x 128, bf16,
# 28 layers x 2048 pages of 16 tokens (or 1024 of 32), tables of 1024 (512) pages
# ---------------------------------------------------------------------------------------------
G, W, H, HKV, D, LAYERS = 8, 8, 28, 4, 128, 28


def _specs(ps, dtype=jnp.bfloat16, sharding=None):
    n, m = 2048 * 16 // ps, 1024 * 16 // ps
    s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    pool = s((LAYERS, HKV, n, ps, D))
    return [s((G, W, H, D)), pool, pool, s((), jnp.int32), s((G, m), jnp.int32), s((G, W), jnp.int32)]


VIEW_OPS = {"stablehlo.reshape", "stablehlo.custom_call", "call", "func.func", "return"}


def test_lowers_for_triton_and_mosaic_with_the_pool_only_viewed():
    """One kernel call per platform, and the pool reaches it only through views: no gather, slice
    or copy of the layer's pages (the detector finds the jnp reference's gather, so it can fail)."""
    from jax import export
    pool = f"{LAYERS}x{HKV}x2048x16x{D}"

    def pool_ops(fn, target):
        text = export.export(jax.jit(fn), platforms=[target], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*_specs(16)).mlir_module()
        ops = set()
        for line in text.splitlines():
            if pool in line and "=" in line:
                op = re.search(r"=\s*([\w.]+)", line)
                ops.add(op.group(1) if op else line.split()[0])
        return text, ops

    for platform, target, marker in [("gpu", "cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")]:
        text, ops = pool_ops(lambda *a, _p=platform: grouped_paged_prefix_attention(*a, platform=_p), target)
        assert text.count(marker) == 1, platform
        assert ops and ops <= VIEW_OPS, (platform, ops)
    _, ops = pool_ops(grouped_paged_prefix_attention_reference, "tpu")
    assert not ops <= VIEW_OPS


GPUS = {(8, 0): "a100-80g:1", (9, 0): "h100:1"}


@needs_plugin
@pytest.mark.parametrize("cc", sorted(GPUS))
def test_compiles_for_the_gpu_at_7b_shapes(cc):
    """XLA's GPU compiler (Triton) compiles the body for A100 and H100 from this host, bf16 with
    pages of 16 and 32 tokens and fp32 with pages of 16, with the blocks the code picks for that
    GPU (a block over its shared memory would be refused)."""
    from sprint_jax.plan.compile import slice_devices
    sharding = jax.sharding.SingleDeviceSharding(slice_devices(GPUS[cc])[0])
    for ps, dtype in ((16, jnp.bfloat16), (32, jnp.bfloat16), (16, jnp.float32)):
        with gpu_target.target(cc):
            lowered = jax.jit(lambda *a: grouped_paged_prefix_attention(*a, platform="gpu")).trace(
                *_specs(ps, dtype, sharding)).lower(lowering_platforms=("cuda",))
        compiled = lowered.compile()
        assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') == 1


@needs_plugin
def test_shared_memory_bound_holds_against_the_compiler():
    """The bytes Triton asks for this kernel, read off its refusal on a GPU offering 1 KiB, are
    within `gpu_target.decode_smem` (what the block choice fits to the GPU) at D 64 and 128."""
    import dataclasses

    from jax.experimental import topologies

    from sprint_jax.plan import chips
    from sprint_jax.plan.compile import _quiet_stderr
    tiny = dataclasses.replace(chips.GPUS["a100-80g"], smem_per_block=1024)
    with _quiet_stderr():
        dev = topologies.get_topology_desc(platform="cuda", target_config=chips.target_config(tiny),
                                           topology="1x1x1").devices[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    for dtype, d, bq, ps in [(jnp.bfloat16, 128, 64, 16), (jnp.float32, 128, 128, 32), (jnp.float32, 64, 64, 16)]:
        s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
        args = (s((2, 8, 8, d)), s((2, 2, 64, ps, d)), s((2, 2, 64, ps, d)), s((), jnp.int32),
                s((2, 16), jnp.int32), s((2, 8), jnp.int32))
        sizes = BlockSizes(block_q=bq, block_k=ps, num_splits=1)
        with pytest.raises(Exception) as e:
            jax.jit(lambda *a: grouped_paged_prefix_attention(*a, platform="gpu", block_sizes=sizes)).trace(
                *args).lower(lowering_platforms=("cuda",)).compile()
        asked = re.search(r"requested (\d+), available", str(e.value))
        assert asked, str(e.value)[:300]
        assert int(asked.group(1)) <= gpu_target.decode_smem(bq, ps, d, dtype), (dtype, d, bq, ps, asked.group(1))


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_compiles_for_tpu_at_7b_shapes(topology):
    """Mosaic compiles the body for v5e and v5p from this host (libtpu's compile-only topology):
    bf16 with pages of 16 and 32 tokens (16 and 8 pages a key block), fp32 with pages of 16."""
    from sprint_jax.plan.compile import slice_devices
    sharding = jax.sharding.SingleDeviceSharding(slice_devices(topology)[0])
    for ps, dtype in ((16, jnp.bfloat16), (32, jnp.bfloat16), (16, jnp.float32)):
        compiled = jax.jit(lambda *a: grouped_paged_prefix_attention(*a, platform="tpu")).trace(
            *_specs(ps, dtype, sharding)).lower(lowering_platforms=("tpu",)).compile()
        assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1


@needs_libtpu
def test_a_page_table_over_tpu_smem_compiles_as_two_calls():
    """128 groups x 2048 pages: a 1 MiB page table, which one call cannot hold (v5e's SMEM is 1 MiB:
    "Ran out of memory in memory space smem"), compiles as two calls of 64 groups."""
    from sprint_jax.plan.compile import slice_devices
    sh = jax.sharding.SingleDeviceSharding(slice_devices("v5e:2x2")[0])
    s = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    pool = s((LAYERS, HKV, 8192, 16, D))
    args = (s((128, W, H, D)), pool, pool, s((), jnp.int32), s((128, 2048), jnp.int32), s((128, W), jnp.int32))
    compiled = jax.jit(lambda *a: grouped_paged_prefix_attention(*a, platform="tpu")).trace(
        *args).lower(lowering_platforms=("tpu",)).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2
