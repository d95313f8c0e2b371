"""Every Pallas GPU kernel compiled by XLA's GPU compiler (Triton included) for the GPUs users own,
from this CPU host: compute capability 8.0 (A100) and 9.0 (H100), bf16 and fp32, at the head
layouts of R1-Distill-Qwen-7B and Qwen3-8B, with the block sizes the kernels choose for that GPU.

jax's CUDA plugin builds compile-only devices from a target config (`plan.chips.target_config`);
Triton refuses a kernel whose tiles exceed the GPU's shared memory ("Shared memory size limit
exceeded"), so a compile here is the check a first train step on the GPU would be. Sequence
lengths are short (the blocks are the full-length choice; a Triton kernel's code does not depend on
the grid), so each compile is of the kernels alone. fp32 Triton kernels compile several times slower
than bf16 (minutes on a loaded 2-core host), so fp32 compiles at the 7B's head layout alone: the
Qwen3-8B's flash kernels take the same blocks (head_dim 128), and its decode blocks are smaller
ones under the same shared-memory bound, which `test_shared_memory_bounds_hold_against_the_compiler`
holds against the compiler. Skipped only without the plugin.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from sprint_jax.kernels import gpu_target
from sprint_jax.model.config import resolve_model_config
from sprint_jax.plan.compile import cuda_plugin_available

needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="compiling for GPUs needs jax's CUDA plugin "
                                         "(pip install 'jax-cuda12-plugin==<the jax version>')")
TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
GPUS = {(8, 0): "a100-80g:1", (9, 0): "h100:1"}
MODELS = ("r1-distill-qwen-7b", "qwen3-8b")


def _device(cc):
    from sprint_jax.plan.compile import slice_devices
    return slice_devices(GPUS[cc])[0]


def _heads(model: str) -> tuple[int, int, int]:
    c = resolve_model_config(model)
    return c.num_attention_heads, c.num_key_value_heads, c.head_dim


def _every_kernel(dtype, sharding, models=MODELS):
    """(function, abstract args) running each Pallas GPU kernel once per model: flash forward and
    backward without and with merge tags (flat / trie, merge), the grouped-prefix decode kernel in
    both cache layouts and the shared-prefix decode kernel, all with their default block sizes."""
    from sprint_jax.kernels import grouped_prefix_attention, shared_prefix_attention
    from sprint_jax.model.attention import flash_attention

    def s(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    t, slots, cap, width, n, suffix = 512, 2, 512, 8, 8, 128
    args = []
    for model in models:
        h, hkv, d = _heads(model)
        q, kv, se, tags = s((1, t, h, d)), s((1, t, hkv, d)), s((1, t), jnp.int32), s((1, t), jnp.int32)
        gq, cache, cache_hf = s((slots, width, h, d)), s((slots, cap, hkv, d)), s((slots, hkv, cap, d))
        rows, lens = s((slots,), jnp.int32), s((slots, width), jnp.int32)
        sq, pk, sk = s((n, h, d)), s((cap, hkv, d)), s((n, suffix, hkv, d))
        args += [q, kv, se, tags, gq, cache, cache_hf, rows, lens, sq, pk, sk, s((), jnp.int32), s((n,), jnp.int32)]

    def f(*a):
        out = []
        for i in range(len(models)):
            q, kv, se, tags, gq, cache, cache_hf, rows, lens, sq, pk, sk, plen, slens = a[14 * i:14 * i + 14]
            for stage in (None, tags):          # trie / flat, then merge (stage and branch tags)
                def loss(q, k, v, stage=stage):
                    o = flash_attention(q, k, v, se, stage=stage, branch=stage, impl="gpu", layout="trie")
                    return jnp.sum(o.astype(jnp.float32))
                out.append(jax.grad(loss, argnums=(0, 1, 2))(q, kv, kv))
            out.append(grouped_prefix_attention(gq, cache, cache, rows, lens, platform="gpu"))
            out.append(grouped_prefix_attention(gq, cache_hf, cache_hf, rows, lens, platform="gpu", heads_first=True))
            out.append(shared_prefix_attention(sq, pk, pk, plen, sk, sk, slens, platform="gpu"))
        return out
    return f, args


# kernels per model: flash fwd, dq, dkdv without and with tags (6), grouped prefix x 2 layouts,
# shared prefix (its prefix and suffix parts); at least these many Triton calls must be compiled
TRITON_CALLS_PER_MODEL = 6 + 2 + 1


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("cc", sorted(GPUS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_kernel_compiles_for_the_gpu(cc, dtype):
    from jax.sharding import SingleDeviceSharding

    sharding = SingleDeviceSharding(_device(cc))
    models = MODELS if dtype == "bfloat16" else MODELS[:1]
    with gpu_target.target(cc):
        f, args = _every_kernel(jnp.dtype(dtype), sharding, models)
        lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    compiled = lowered.compile()          # raises "Shared memory size limit exceeded" if a block is too big
    assert compiled.as_text().count(TRITON) >= len(models) * TRITON_CALLS_PER_MODEL


@pytest.mark.parametrize("cc, dtype, blocks", [
    ((9, 0), "bfloat16", (128, 128)), ((8, 0), "bfloat16", (128, 128)),
    ((9, 0), "float32", (128, 64)), ((8, 0), "float32", (64, 64)), ((8, 6), "float32", (32, 32)),
    ((8, 6), "bfloat16", (64, 64))])
def test_flash_blocks_per_dtype_and_gpu(cc, dtype, blocks):
    """The flash blocks the GPU body takes at head_dim 128: 128 x 128 in bf16 on A100 / H100; in
    fp32 the largest whose tiles fit (128 x 128 would ask 320 KiB)."""
    from sprint_jax.kernels.flash_attention import gpu_blocks
    from sprint_jax.model.attention import default_blocks

    with gpu_target.target(cc):
        assert default_blocks("gpu", 8192, 8192, 128, jnp.dtype(dtype)) == blocks
    assert gpu_target.flash_smem(*blocks, 128, dtype) <= gpu_target.shared_memory(cc)
    assert gpu_blocks(40, 40, 128, jnp.bfloat16, gpu_target.shared_memory(cc)) == (64, 64)   # powers of two


@needs_plugin
@pytest.mark.slow
def test_shared_memory_bounds_hold_against_the_compiler():
    """The kernels' shared-memory bounds (`gpu_target.flash_smem` / `decode_smem`) against the bytes
    Triton asks for, read off the compiler's refusal on a GPU that offers 1 KiB: never more than
    the bound, and the flash backward at the bound (its dK/dV kernel holds every tile it counts)."""
    import dataclasses

    from sprint_jax.kernels import flash_attention as fa
    from sprint_jax.kernels import grouped_prefix_attention
    from sprint_jax.kernels.shared_prefix import BlockSizes
    from sprint_jax.plan import chips
    from sprint_jax.plan.compile import _quiet_stderr

    from jax.experimental import topologies
    tiny = dataclasses.replace(chips.GPUS["a100-80g"], smem_per_block=1024)
    with _quiet_stderr():
        dev = topologies.get_topology_desc(platform="cuda", target_config=chips.target_config(tiny),
                                           topology="1x1x1").devices[0]
    sh = jax.sharding.SingleDeviceSharding(dev)

    def asked(f, *args) -> int:
        with pytest.raises(Exception) as e:
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).compile()
        m = re.search(r"requested (\d+), available", str(e.value))
        assert m, str(e.value)[:300]
        return int(m.group(1))

    h, hkv, t = 8, 2, 256
    for dtype, d, bq, bk in [(jnp.bfloat16, 128, 128, 128), (jnp.float32, 128, 128, 64), (jnp.float32, 64, 64, 32)]:
        s = lambda shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
        q, kv, se, off, lse = s((1, t, h, d)), s((1, t, hkv, d)), s((1, t), jnp.int32), s((1,), jnp.int32), \
            s((1, t, h), jnp.float32)
        kw = dict(platform="gpu", block_q=bq, block_k=bk)
        fwd = asked(lambda q, k, se, off: fa.flash_forward(q, k, k, se, off, None, **kw), q, kv, se, off)
        dkdv = asked(lambda q, k, se, off, lse: fa.flash_backward(q, k, k, se, off, None, q, lse, q, lse, **kw)[1],
                     q, kv, se, off, lse)
        dq = asked(lambda q, k, se, off, lse: fa.flash_backward(q, k, k, se, off, None, q, lse, q, lse, **kw)[0],
                   q, kv, se, off, lse)
        bound = gpu_target.flash_smem(bq, bk, d, dtype)
        assert max(fwd, dq) <= bound and dkdv == bound, (dtype, d, bq, bk, fwd, dq, dkdv, bound)
        gq, cache = s((2, 8, h, d)), s((2, hkv, 512, d))
        sizes = BlockSizes(block_q=64, block_k=64, num_splits=1)
        dec = asked(lambda q, c, r, ln: grouped_prefix_attention(q, c, c, r, ln, platform="gpu", heads_first=True,
                                                                 block_sizes=sizes)[0],
                    gq, cache, s((2,), jnp.int32), s((2, 8), jnp.int32))
        assert dec <= gpu_target.decode_smem(64, 64, d, dtype), (dtype, d, dec)
