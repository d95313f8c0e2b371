"""The flat layout on TPU through jax's splash attention (the platform library), not our kernel.

What. In the flat layout (train/data.py) span_end[j] is the end of j's example, and every token of
an example shares it, so span_end itself is a segment id and the span rule `j <= i < span_end[j]`
is exactly "causal and same segment" (padding tokens have span_end = j + 1: a segment of one).
`splash_attention` runs that with `jax.experimental.pallas.ops.tpu.splash_attention`:
`make_splash_mha` over a `CausalMask` per query head, `SegmentIds(span_end, span_end)`, grouped-
query heads in its MHA form (H % Hkv == 0, query head h uses KV head h // (H / Hkv), as ours),
vmapped over the batch rows, with splash's own custom_vjp backward (dq and dk/dv kernels). The
trie's ancestor mask and the merge layout's (stage, branch) factor are not causal-segment masks:
they stay on our kernel (`kernels/flash_attention.py`).

Differences from our body, all outside what the caller sees: splash takes no softmax scale, so q
is multiplied by 1/sqrt(D) first (in q's dtype: one more bf16 rounding of q); it needs lengths that
are whole blocks (block = min(512, T rounded up to 128)), so rows are padded with segment id -1
(pad rows see only pad rows, never a real token, and are cut off again); it returns no
log-sum-exp, so callers that need lse (the engine's prefill) use our kernel. Every row sees at
least itself in the flat layout, which splash requires (no fully masked row).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _sm

_LANES = 128
MAX_BLOCK = 512            # as our TPU body: lane-dense, long DMAs, fits VMEM at D = 128
KERNEL_PREFIX = "splash_mha_"   # the Mosaic kernel names splash lowers to (fwd, dq, dkv)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def splash_block(t: int) -> int:
    """The block for a T-token row: 512, or T rounded up to a multiple of 128 when shorter."""
    return min(MAX_BLOCK, _round_up(t, _LANES))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, span_end: jax.Array, *,
                     block: int | None = None, interpret: bool = False) -> jax.Array:
    """Flat-layout attention by splash: q [B, T, H, D], k, v [B, T, Hkv, D], span_end [B, T] int
    (the end of each token's segment; queries are the keys). Returns out [B, T, H, D] in q's dtype.
    Differentiable in q, k, v (splash's custom_vjp)."""
    b, t, h, d = q.shape
    blk = block or splash_block(t)
    if blk % _LANES:
        raise ValueError(f"splash block must be a multiple of {_LANES}, got {blk}")
    tp = _round_up(t, blk)
    scale = 1.0 / math.sqrt(d)
    seg = jnp.pad(span_end.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)

    def heads_major(x):                                   # [B, T, N, D] -> [B, N, Tp, D]
        return jnp.swapaxes(jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))), 1, 2)

    qh = heads_major((q * jnp.asarray(scale, q.dtype)).astype(q.dtype))
    kh, vh = heads_major(k), heads_major(v)
    mask = _sm.MultiHeadMask([_sm.CausalMask((tp, tp))] * h)
    sizes = _sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                           block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
    kernel = _sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                 interpret=interpret)
    o = jax.vmap(lambda qq, kk, vv, s: kernel(qq, kk, vv, segment_ids=_sk.SegmentIds(s, s)))(
        qh, kh, vh, seg)                                                      # [B, H, Tp, D]
    return jnp.swapaxes(o, 1, 2)[:, :t].astype(q.dtype)
