"""Shared-prefix decode attention: Pallas kernel == jnp reference == naive attention per branch.

The kernel runs in Pallas interpret mode on CPU, both bodies ("gpu": Triton-style loop with split-K;
"tpu": Mosaic-style sequential grid with scratch). The independent reference is written here:
float64 numpy softmax attention of each branch over concat(prefix[:prefix_len], suffix[b][:len_b]).
Tolerances: fp32 1e-5 (both sides accumulate in fp32); bf16 2e-2 absolute against the float64
answer on the same bf16-rounded inputs (probabilities are rounded to bf16 before the P.V product
and the output is rounded to bf16: ~3 x 2^-8 on outputs of magnitude <= ~2).
"""
from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sprint_jax.kernels import (
    BlockSizes,
    bytes_read,
    copy_fork_bytes_read,
    default_block_sizes,
    shared_prefix_attention,
    shared_prefix_attention_reference,
)

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# Small tiles so that the tiny test shapes still cross several key blocks, query blocks and splits.
SMALL = BlockSizes(block_q=8, block_k=8, block_k_suffix=4, num_splits=2)


def naive_attention(q, pk, pv, prefix_len, sk, sv, suffix_lens):
    """float64 softmax(q K^T / sqrt(D)) V per branch over its concatenated keys; also the lse."""
    q, pk, pv, sk, sv = (np.asarray(jnp.asarray(a, jnp.float32), np.float64)
                         for a in (q, pk, pv, sk, sv))
    n, h, d = q.shape
    group = h // pk.shape[1]
    outs, lses = [], []
    for b in range(n):
        k = np.concatenate([pk[:prefix_len], sk[b, :suffix_lens[b]]])        # [L, Hkv, D]
        v = np.concatenate([pv[:prefix_len], sv[b, :suffix_lens[b]]])
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)      # [L, H, D]
        logits = np.einsum("hd,lhd->hl", q[b], k) / np.sqrt(d)
        peak = logits.max(axis=1, keepdims=True)
        w = np.exp(logits - peak)
        outs.append(np.einsum("hl,lhd->hd", w / w.sum(1, keepdims=True), v))
        lses.append(peak[:, 0] + np.log(w.sum(1)))
    return np.stack(outs), np.stack(lses)


def make_inputs(seed, n, h, hkv, d, p, s, dtype):
    rng = np.random.default_rng(seed)
    shapes = [(n, h, d), (p, hkv, d), (p, hkv, d), (n, s, hkv, d), (n, s, hkv, d)]
    return [jnp.asarray(rng.standard_normal(sh, np.float32), dtype) for sh in shapes]


# (n, H, Hkv, D, P, prefix_len, S, suffix_lens): GQA ratios 4, 7 and 1, odd sizes, ragged and
# empty suffixes, one branch, prefix capacity and valid length not multiples of the key block.
CASES = {
    "gqa4_ragged": (3, 8, 2, 24, 37, 30, 11, [5, 0, 11]),
    "gqa7_one_branch": (1, 7, 1, 16, 21, 21, 5, [3]),
    "mha_short_prefix": (2, 3, 3, 8, 19, 9, 6, [6, 2]),
}


@pytest.mark.parametrize("case,platform,sizes", [
    ("gqa4_ragged", "gpu", SMALL), ("gqa4_ragged", "tpu", SMALL),
    ("gqa7_one_branch", "gpu", None), ("gqa7_one_branch", "tpu", None),  # platform defaults
    ("mha_short_prefix", "gpu", SMALL)])
def test_kernel_matches_reference_and_naive_fp32(case, platform, sizes):
    n, h, hkv, d, p, plen, s, slens = CASES[case]
    q, pk, pv, sk, sv = make_inputs(1, n, h, hkv, d, p, s, jnp.float32)
    args = (q, pk, pv, jnp.int32(plen), sk, sv, jnp.asarray(slens, jnp.int32))
    want, want_lse = naive_attention(q, pk, pv, plen, sk, sv, slens)
    got, lse = shared_prefix_attention(*args, interpret=True, platform=platform,
                                       block_sizes=sizes, return_lse=True)
    ref, ref_lse = shared_prefix_attention_reference(*args, return_lse=True)
    assert got.shape == (n, h, d) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL["float32"], rtol=0)
    np.testing.assert_allclose(np.asarray(ref), want, atol=TOL["float32"], rtol=0)
    # The lse leaves the kernel in natural-log units although the kernel works in base 2.
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ref_lse), want_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_kernel_bf16(platform):
    n, h, hkv, d, p, plen, s, slens = CASES["gqa4_ragged"]
    q, pk, pv, sk, sv = make_inputs(3, n, h, hkv, d, p, s, jnp.bfloat16)
    args = (q, pk, pv, jnp.int32(plen), sk, sv, jnp.asarray(slens, jnp.int32))
    got = shared_prefix_attention(*args, interpret=True, platform=platform, block_sizes=SMALL)
    ref = shared_prefix_attention_reference(*args)
    want, _ = naive_attention(q, pk, pv, plen, sk, sv, slens)
    assert got.dtype == jnp.bfloat16
    got32 = np.asarray(got.astype(jnp.float32))
    np.testing.assert_allclose(got32, want, atol=TOL["bfloat16"], rtol=0)
    np.testing.assert_allclose(np.asarray(ref.astype(jnp.float32)), want,
                               atol=TOL["bfloat16"], rtol=0)


def _kernel_gqa4(*args):
    """The gqa4_ragged / gpu / SMALL configuration of the fp32 test: shared compiled executable."""
    return shared_prefix_attention(*args, interpret=True, platform="gpu", block_sizes=SMALL,
                                   return_lse=True)


def test_traced_lengths_and_garbage_past_them():
    """prefix_len / suffix_lens are traced (no recompile per length), and rows past them are
    never read into the result, even when they hold inf / NaN (stale or unwritten cache)."""
    n, h, hkv, d, p, _, s, _ = CASES["gqa4_ragged"]
    q, pk, pv, sk, sv = make_inputs(4, n, h, hkv, d, p, s, jnp.float32)
    _kernel_gqa4(q, pk, pv, jnp.int32(1), sk, sv, jnp.ones((n,), jnp.int32))
    compiled = shared_prefix_attention._cache_size()
    for plen, slens in [(0, [4, 1, 11]), (23, [0, 7, 3]), (37, [11, 11, 11])]:
        poison_k = pk.at[plen:].set(jnp.nan)
        poison_v = pv.at[plen:].set(jnp.inf)
        rows = jnp.arange(s)[None, :, None, None] >= jnp.asarray(slens)[:, None, None, None]
        got, _ = _kernel_gqa4(q, poison_k, poison_v, jnp.int32(plen), jnp.where(rows, jnp.nan, sk),
                              jnp.where(rows, jnp.inf, sv), jnp.asarray(slens, jnp.int32))
        want, _ = naive_attention(q, pk, pv, plen, sk, sv, slens)
        np.testing.assert_allclose(np.asarray(got), want, atol=TOL["float32"], rtol=0)
    assert shared_prefix_attention._cache_size() == compiled


def test_branch_with_no_keys_gives_zero_and_neg_inf_lse():
    n, h, hkv, d, p, _, s, _ = CASES["gqa4_ragged"]
    q, pk, pv, sk, sv = make_inputs(5, n, h, hkv, d, p, s, jnp.float32)
    args = (q, pk, pv, jnp.int32(0), sk, sv, jnp.asarray([0, 3, 11], jnp.int32))
    got, lse = _kernel_gqa4(*args)
    ref, ref_lse = shared_prefix_attention_reference(*args, return_lse=True)
    assert np.all(np.asarray(got[0]) == 0) and np.all(np.asarray(lse[0]) <= -1e29)
    want, want_lse = naive_attention(q[1:], pk, pv, 0, sk[1:], sv[1:], [3, 11])
    np.testing.assert_allclose(np.asarray(got[1:]), want, atol=TOL["float32"], rtol=0)
    np.testing.assert_allclose(np.asarray(lse[1:]), want_lse, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(got), atol=TOL["float32"], rtol=0)


VIEW_OPS = {"stablehlo.reshape", "stablehlo.broadcast_in_dim", "stablehlo.custom_call", "call",
            "func.func", "return"}


def test_lowers_for_triton_and_mosaic_at_qwen2_7b_shapes():
    """The real (non-interpret) lowerings, which this CPU machine can produce but not run:
    64 branches over a 16k prefix with Qwen2-7B heads (28 / 4 x 128), bf16 and fp32, and cache
    capacities that are not multiples of any block."""
    from jax import export
    for (n, h, hkv, d, p, s), dtype in [((64, 28, 4, 128, 16384, 256), jnp.bfloat16),
                                        ((64, 28, 4, 128, 16384, 256), jnp.float32),
                                        ((5, 28, 4, 128, 1000, 100), jnp.bfloat16)]:
        spec = [jax.ShapeDtypeStruct(sh, dtype)
                for sh in [(n, h, d), (p, hkv, d), (p, hkv, d)]]
        spec += [jax.ShapeDtypeStruct((), jnp.int32)]
        spec += [jax.ShapeDtypeStruct((n, s, hkv, d), dtype)] * 2
        spec += [jax.ShapeDtypeStruct((n,), jnp.int32)]
        for platform, target, marker in [("gpu", "cuda", "__gpu$xla.gpu.triton"),
                                         ("tpu", "tpu", "tpu_custom_call")]:
            fn = jax.jit(lambda *a, _p=platform: shared_prefix_attention(*a, platform=_p))
            exported = export.export(
                fn, platforms=[target],
                disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
            )(*spec)
            text = exported.mlir_module()
            assert text.count(marker) >= 2, (platform, dtype)  # prefix pass + suffix pass
            # The caches reach the kernels through views only: no pad, copy or transpose.
            cache = (f"tensor<{p}x", f"tensor<1x{p}x", f"tensor<{n}x{s}x")
            for line in text.splitlines():
                if any(c in line for c in cache):
                    op = re.search(r"=\s*([\w.]+)", line)
                    op = op.group(1) if op else line.split()[0]
                    assert op in VIEW_OPS, (platform, line.strip()[:200])


def test_default_block_sizes_per_backend():
    gpu = default_block_sizes("gpu", 64, 28, 4, 16384, 256)
    assert (gpu.block_q, gpu.block_k, gpu.block_k_suffix) == (128, 64, 64)
    assert gpu.num_splits * 4 * (448 // 128 + 1) >= 200          # split-K fills ~2 programs/SM
    tpu = default_block_sizes("tpu", 64, 28, 4, 16384, 256)
    assert tpu.block_q == 448 and tpu.block_k == 512           # all 448 queries: prefix read once
    assert default_block_sizes("gpu", 1, 7, 1, 20, 3).block_q == 16  # Triton's minimum dot size


def test_bad_inputs_name_the_argument():
    n, h, hkv, d, p, plen, s, slens = CASES["gqa4_ragged"]
    q, pk, pv, sk, sv = make_inputs(6, n, h, hkv, d, p, s, jnp.float32)
    good = dict(q=q, prefix_k=pk, prefix_v=pv, prefix_len=jnp.int32(plen), suffix_k=sk,
                suffix_v=sv, suffix_lens=jnp.asarray(slens))
    bad = [({"q": q[0]}, "q must be"), ({"prefix_v": pv[:-1]}, "prefix_k and prefix_v"),
           ({"suffix_k": sk[:, :, :1]}, "suffix_k and suffix_v"),
           ({"suffix_lens": jnp.asarray(slens[:2])}, "suffix_lens"),
           ({"q": q[:, :7]}, "multiple of KV heads"),
           ({"q": q.astype(jnp.bfloat16)}, "one dtype")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            shared_prefix_attention_reference(**{**good, **change})
        with pytest.raises(ValueError, match=message):
            shared_prefix_attention(**{**good, **change}, interpret=True)
    with pytest.raises(ValueError, match="interpret=True"):
        shared_prefix_attention(**good)
    with pytest.raises(ValueError, match="block_sizes.block_k"):
        shared_prefix_attention(**good, interpret=True, block_sizes=BlockSizes(block_k=0))
    with pytest.raises(ValueError, match="power of two"):
        jax.eval_shape(lambda: shared_prefix_attention(
            **good, platform="gpu", block_sizes=BlockSizes(block_k=24)))


def test_bytes_read_counts_prefix_once():
    # 2 branches, P=10, S=3, H=4, Hkv=2, D=8, bf16: K+V row = 2*2*8*2 = 64 bytes; q = 2*4*8*2.
    assert bytes_read(2, 10, 3, 4, 2, 8, jnp.bfloat16) == 10 * 64 + 2 * 3 * 64 + 128
    assert copy_fork_bytes_read(2, 10, 3, 4, 2, 8, jnp.bfloat16) == 2 * 13 * 64 + 128


def test_bench_kernels_quick_point(tmp_path):
    from sprint_jax.bench.kernels import add_kernels_arguments, run_kernels_bench
    parser = argparse.ArgumentParser()
    add_kernels_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--quick", "--branches", "3", "--prefix-lens", "24", "--suffix-len",
                              "5", "--dtype", "float32", "--repeats", "1", "--out", str(out)])
    assert run_kernels_bench(args) == 0
    report = json.loads(out.read_text())
    assert report["interpret"] is True and report["timings_meaningful"] is False
    assert [r["method"] for r in report["results"]] == ["pallas", "xla", "copy_fork"]
    for r in report["results"]:
        assert r["ms_per_call"] > 0 and r["max_abs_diff_vs_xla"] < 1e-5
    assert report["results"][0]["bytes"] == bytes_read(3, 24, 5, 4, 2, 32, jnp.float32)
    assert report["results"][2]["bytes"] == copy_fork_bytes_read(3, 24, 5, 4, 2, 32, jnp.float32)
    # the grouped table (batched engine step): 2 groups of 1 + 3 rows, used lengths 24 and 18
    from sprint_jax.kernels import group_bytes_read
    grouped = report["grouped_results"]
    assert [r["method"] for r in grouped] == ["grouped_pallas", "grouped_xla"]
    for r in grouped:
        assert r["ms_per_call"] > 0 and r["max_abs_diff_vs_xla"] < 1e-5 and r["groups"] == 2
        assert r["bytes"] == group_bytes_read([24, 18], 4, 4, 2, 32, jnp.float32)
    from sprint_jax.errors import UserError
    with pytest.raises(UserError, match="--kv-heads"):
        run_kernels_bench(parser.parse_args(["--quick", "--heads", "5", "--kv-heads", "2"]))
