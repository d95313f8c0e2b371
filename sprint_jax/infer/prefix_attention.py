"""The engine's decode attention on the Pallas path, per shard under a mesh.

A decode step of `Engine` attends in groups (`programs.grouped_prefix`): the generate rows (each
over its own pages), each fork's children over their shared prefix pages (the group's queries
ride one query axis, so the pages are read once for the group), and each child over its own pages.
The XLA path gathers the pages (`paged_attention.paged_partial`); `pallas_paged_prefix_attention`
returns the same (out, lse) pair from `sprint_jax.kernels.paged_prefix`: one pallas_call over all
groups, reading pages in place through the page tables, blocks past each group's used pages
skipped. On a mesh the kernel runs inside `jax.shard_map`: per page shard the engine's step is
already local (`sharding.slot_local`), and the kernel gets a nested shard_map over the remaining
automatic axes, split over `tensor` like the KV heads where they are.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _paged_kernel(q, k_pool, v_pool, layer, table, lens):
    """The paged kernel on (a shard of) the pool k_pool, v_pool [L, Hkv, N, ps, D]; table: local
    page ids (out-of-range padding is clipped by the kernel and masked by lens)."""
    from sprint_jax.kernels.paged_prefix import grouped_paged_prefix_attention

    body = lambda platform, interpret: lambda *a: grouped_paged_prefix_attention(  # noqa: E731
        *a, platform=platform, interpret=interpret)
    # chosen when the step is lowered, as in `_kernel`
    backend = jax.default_backend()
    runs_on = {"gpu": backend in ("gpu", "cuda", "rocm"), "tpu": backend == "tpu"}
    d, ps = q.shape[-1], k_pool.shape[3]
    triton = all(x >= 16 and not x & (x - 1) for x in (d, ps))        # Triton: powers of two >= 16
    branches = {name: body(plat, False) for name, plat in (("cuda", "gpu"), ("rocm", "gpu"), ("tpu", "tpu"))
                if plat == "tpu" or triton or runs_on[plat]}
    return jax.lax.platform_dependent(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), table, lens,
                                      default=body("gpu", True), **branches)


def pallas_paged_prefix_attention(q, k_pool, v_pool, layer, table, lens, sharding=None):
    """q [G, W, H, D] (each group's rows); k_pool, v_pool [L, Hkv, N, ps, D] (the page pool, or
    this page shard's under `sharding.slot_local`); layer: the layer index; table [G, M]: each
    group's pages (local ids, `programs.local_pages`); lens [G, W]: tokens each row sees.
    sharding: the pool's NamedSharding on a mesh whose pages are whole on every device (None: one
    device, or traced per page shard). Returns (out [G, W, H, D], lse [G, W, H])."""
    if sharding is None:
        from sprint_jax.infer.sharding import local_head_axes
        mesh = jax.sharding.get_abstract_mesh()
        auto = frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                         if t != jax.sharding.AxisType.Manual)
        if mesh.empty or not auto:
            return _paged_kernel(q, k_pool, v_pool, layer, table, lens)
        # traced per page shard: a nested shard_map over the remaining (automatic) axes, per KV
        # head shard where the heads are split (as the slot baseline's kernel wrapper, `bench/slot_programs.py`)
        head = local_head_axes()
    else:
        mesh = sharding.mesh
        spec = tuple(sharding.spec) + (None,) * (5 - len(sharding.spec))
        if spec[2] is not None:
            raise ValueError("pallas_paged_prefix_attention: a pool split over pages runs per shard (slot_local)")
        head, auto = spec[1], frozenset(mesh.axis_names)
    axes = axes_of(head)
    if q.shape[2] % math.prod(mesh.shape[a] for a in axes):
        raise ValueError(f"{q.shape[2]} query heads do not split over {axes} like the KV heads")
    run = jax.shard_map(
        _paged_kernel, mesh=mesh, axis_names=auto,
        in_specs=(P(None, None, head, None), P(None, head, None, None, None), P(None, head, None, None, None),
                  P(), P(None, None), P(None, None)),
        out_specs=(P(None, None, head, None), P(None, None, head)), check_vma=False)
    return run(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), table, lens)
