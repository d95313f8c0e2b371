"""A decode step's attention on the XLA path, paged pool against slot cache, at the same used length.

One layer's cached-key attention of F fork groups of W rows each (every group reads its shared
prefix once, every row its own suffix), merged by log-sum-exp:
- slot: `programs.parent_prefix_attention` over the parent slots [L, P, Hkv, S, D] plus
  `attend_partial_heads` over the child slots (what `programs.decode` runs per layer);
- paged: `paged_attention.grouped_paged_attention` over the pool [L, Hkv, pages, ps, D].
Both are jitted alone and timed interleaved in one process (median of many calls). Prints the
time of each and the ratio paged / slot per setting.

    JAX_PLATFORMS=cpu .venv/bin/python docs/experiments/paged_vs_slot_attention.py
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax.infer.paged_attention import grouped_paged_attention
from sprint_jax.bench.slot_programs import parent_prefix_attention
from sprint_jax.bench.slot_cache import gather_rows
from sprint_jax.model.attention import attend_partial_heads
from sprint_jax.model.qwen2 import merge_partials


def slot_attention(q, pk, pv, ck, cv, pslot, cslot, plen, clen, s_b, c_b):
    f, w, h, d = q.shape
    o_p, l_p = parent_prefix_attention(pk, pv, 0, pslot, q, jnp.broadcast_to(plen[:, None], (f, w)), s_b)
    mask = jnp.arange(c_b)[None, None, :] < clen[:, None, None]
    suffix = attend_partial_heads(q.reshape(f * w, 1, h, d), gather_rows(ck, 0, cslot, c_b),
                                  gather_rows(cv, 0, cslot, c_b), mask)
    return merge_partials([(o_p.reshape(f * w, 1, h, d), l_p.reshape(f * w, 1, h)), suffix])


def paged_attention(q, kp, vp, group_table, group_len, row_table, row_len):
    return grouped_paged_attention(q, kp, vp, 0, group_table, group_len, row_table, row_len)


def timed(fn, args, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def main():
    rng = np.random.default_rng(0)
    h, hkv, d = 14, 2, 64                   # Qwen2.5-0.5B's attention shape
    print(f"backend {jax.default_backend()}, heads {h}/{hkv}, head_dim {d}")
    print(f"{'dtype':>8} {'F x W':>6} {'prefix':>6} {'suffix':>6} {'page':>4} {'slot ms':>8} {'paged ms':>8} {'ratio':>6}")
    for dtype in (jnp.float32, jnp.bfloat16):
        for f, w, prefix, suffix in ((4, 4, 1024, 128), (1, 8, 2048, 256), (16, 1, 512, 64)):
            for ps in (16, 64):
                slots = f
                q = jnp.asarray(rng.standard_normal((f, w, h, d)), dtype)
                pk = jnp.asarray(rng.standard_normal((1, slots, hkv, prefix, d)), dtype)
                pv = jnp.asarray(rng.standard_normal((1, slots, hkv, prefix, d)), dtype)
                ck = jnp.asarray(rng.standard_normal((1, slots * w, hkv, suffix, d)), dtype)
                cv = jnp.asarray(rng.standard_normal((1, slots * w, hkv, suffix, d)), dtype)
                mg, mr = prefix // ps, suffix // ps
                n_pages = f * mg + f * w * mr
                kp = jnp.asarray(rng.standard_normal((1, hkv, n_pages, ps, d)), dtype)
                vp = jnp.asarray(rng.standard_normal((1, hkv, n_pages, ps, d)), dtype)
                perm = rng.permutation(n_pages).astype(np.int32)
                group_table = jnp.asarray(perm[:f * mg].reshape(f, mg))
                row_table = jnp.asarray(perm[f * mg:].reshape(f * w, mr))
                full = lambda n, k: jnp.full((k,), n, jnp.int32)            # noqa: E731
                slot_fn = jax.jit(slot_attention, static_argnums=(9, 10))
                paged_fn = jax.jit(paged_attention)
                slot_args = (q, pk, pv, ck, cv, jnp.arange(f, dtype=jnp.int32), jnp.arange(f * w, dtype=jnp.int32),
                             full(prefix, f), full(suffix, f * w), prefix, suffix)
                paged_args = (q, kp, vp, group_table, full(prefix, f), row_table, full(suffix, f * w))
                timed(slot_fn, slot_args, 3)
                timed(paged_fn, paged_args, 3)
                ts, tp = [], []
                for _ in range(10):                         # interleaved: both see the same load
                    ts += timed(slot_fn, slot_args, 10)
                    tp += timed(paged_fn, paged_args, 10)
                s, p = statistics.median(ts) * 1e3, statistics.median(tp) * 1e3
                print(f"{jnp.dtype(dtype).name:>8} {f:>2} x {w:<2} {prefix:>6} {suffix:>6} {ps:>4} {s:>8.3f} {p:>8.3f} "
                      f"{p / s:>6.2f}")


if __name__ == "__main__":
    main()
