"""The engine's parent-prefix attention on the Pallas path, per shard under a mesh.

A decode step of `Engine` attends in groups: a generate row alone (over its own parent slot),
or a fork's children (over their parent slot up to the fork point). The XLA path
(`programs.parent_prefix_attention`) gathers the used slots of each group and runs
`attend_partial_heads` (the slot cache is heads-first, [L, P, Hkv, S, D]) with the group's queries
on the query axis. `pallas_parent_prefix_attention` returns the same
(out, lse) pair from `sprint_jax.kernels.grouped_prefix_attention`: one pallas_call over all
groups, reading each parent's prefix in place (no gather) once for all its rows, skipping key
blocks past each group's used length.

Under a mesh (parent slots over `data`, KV heads over `tensor`: `sharding.kv_sharding`) the kernel
runs inside `jax.shard_map`: each device attends over the slots and KV heads it holds. The queries
of every group reach every slot shard (replicated over the slot axes, split over heads like the
KV heads); a group whose parent slot lives on another shard reads nothing and gives out 0 and lse
NEG_INF there, so a sum over the slot axes of the outputs and a max of the lse are exact.
(With slots over data the engine's step itself already runs per slot shard, `sharding.slot_local`,
and calls this with kv=None on its shard's slots; the kernel gets a nested shard_map over the
mesh axes still automatic there, split over `tensor` like the KV heads where they are.)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _kernel(q, pk, pv, layer, pslot, plen, slot_axes: tuple[str, ...] = ()):
    """The kernel on (a shard of) the parent cache pk, pv [L, P, Hkv, S, D]."""
    from sprint_jax.kernels.parent_prefix import grouped_prefix_attention, lowers_for

    n_layers, slots = pk.shape[:2]
    if slot_axes:   # this shard holds slots [index * slots, (index + 1) * slots)
        local = pslot - jax.lax.axis_index(slot_axes) * slots
        here = (local >= 0) & (local < slots)
        plen = jnp.where(here[:, None], plen, 0)
        pslot = jnp.clip(local, 0, slots - 1)
    rows = layer * slots + jnp.clip(pslot, 0, slots - 1)
    flat = (n_layers * slots,) + pk.shape[2:]                      # a view: [L*P, Hkv, S, D]
    body = lambda platform, interpret: lambda *a: grouped_prefix_attention(  # noqa: E731
        *a, platform=platform, interpret=interpret, heads_first=True)
    # Chosen when the step is lowered: Triton on GPUs, Mosaic on TPUs, the interpreter elsewhere,
    # so one jitted step also lowers (e.g. under jax.export) for a platform it does not run on.
    # A platform whose kernel does not take this head layout is left out unless it is the one we
    # run on (there the kernel's own error names the problem; no silent interpreter on a GPU).
    backend = jax.default_backend()
    runs_on = {"gpu": backend in ("gpu", "cuda", "rocm"), "tpu": backend == "tpu"}
    d, hkv = q.shape[-1], pk.shape[2]
    branches = {name: body(plat, False) for name, plat in (("cuda", "gpu"), ("rocm", "gpu"), ("tpu", "tpu"))
                if lowers_for(plat, d, hkv, heads_first=True) or runs_on[plat]}
    o, lse = jax.lax.platform_dependent(q, pk.reshape(flat), pv.reshape(flat), rows, plen,
                                        default=body("gpu", True), **branches)
    if slot_axes:
        o = jax.lax.psum(o.astype(jnp.float32), slot_axes).astype(q.dtype)
        lse = jax.lax.pmax(lse, slot_axes)
    return o, lse


def pallas_parent_prefix_attention(q, pk, pv, layer, pslot, plen, kv=None):
    """q [Rg, W, H, D] (the rows of each group); pk, pv [L, P, Hkv, S, D] (the parent cache);
    layer: the layer index; pslot [Rg]: each group's parent slot (out of range = a padding group,
    with plen 0); plen [Rg, W]: keys each row sees. kv: the engine's (parent, child)
    NamedShardings on a mesh (None: one device). Returns (out [Rg, W, H, D], lse [Rg, W, H])."""
    if kv is None:
        from sprint_jax.infer.sharding import local_head_axes
        mesh = jax.sharding.get_abstract_mesh()
        auto = frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                         if t != jax.sharding.AxisType.Manual)
        if mesh.empty or not auto:
            return _kernel(q, pk, pv, layer, pslot, plen)
        # Traced per slot shard (`sharding.slot_local`, the slot axes manual): the other mesh
        # axes are still automatic there, and a Mosaic kernel must sit fully inside a shard_map
        # (one XLA would partition is refused, and the interpreter's loops would hold
        # collectives). So a nested shard_map over every remaining axis: per KV head shard
        # where the heads are split (`local_head_axes`), a replicated call on each device else.
        head = local_head_axes()
        axes = _axes(head)
        if q.shape[2] % math.prod(mesh.shape[a] for a in axes):
            raise ValueError(f"{q.shape[2]} query heads do not split over {axes} like the KV heads")
        run = jax.shard_map(
            lambda q, pk, pv, layer, pslot, plen: _kernel(q, pk, pv, layer, pslot, plen),
            mesh=mesh, axis_names=auto,
            in_specs=(P(None, None, head, None), P(None, None, head, None, None), P(None, None, head, None, None),
                      P(), P(None), P(None, None)),
            out_specs=(P(None, None, head, None), P(None, None, head)), check_vma=False)
        return run(q, pk, pv, jnp.asarray(layer, jnp.int32), pslot, plen)
    sharding = kv[0]
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (5 - len(sharding.spec))
    slot_axes = _axes(spec[1])
    head_axes = _axes(spec[2])
    heads = math.prod(mesh.shape[a] for a in head_axes)
    hq = head_axes if head_axes and q.shape[2] % heads == 0 else ()
    if head_axes and not hq:
        raise ValueError(f"{q.shape[2]} query heads do not split over {head_axes} like the KV heads")
    head = (hq if len(hq) > 1 else hq[0]) if hq else None
    run = jax.shard_map(
        lambda q, pk, pv, layer, pslot, plen: _kernel(q, pk, pv, layer, pslot, plen, slot_axes),
        mesh=mesh,
        in_specs=(P(None, None, head, None), P(*spec), P(*spec), P(), P(None), P(None, None)),
        out_specs=(P(None, None, head, None), P(None, None, head)), check_vma=False)
    return run(q, pk, pv, jnp.asarray(layer, jnp.int32), pslot, plen)


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
        # head shard where the heads are split (see `pallas_parent_prefix_attention`)
        head = local_head_axes()
    else:
        mesh = sharding.mesh
        spec = tuple(sharding.spec) + (None,) * (5 - len(sharding.spec))
        if spec[2] is not None:
            raise ValueError("pallas_paged_prefix_attention: a pool split over pages runs per shard (slot_local)")
        head, auto = spec[1], frozenset(mesh.axis_names)
    axes = _axes(head)
    if q.shape[2] % math.prod(mesh.shape[a] for a in axes):
        raise ValueError(f"{q.shape[2]} query heads do not split over {axes} like the KV heads")
    run = jax.shard_map(
        _paged_kernel, mesh=mesh, axis_names=auto,
        in_specs=(P(None, None, head, None), P(None, head, None, None, None), P(None, head, None, None, None),
                  P(), P(None, None), P(None, None)),
        out_specs=(P(None, None, head, None), P(None, None, head)), check_vma=False)
    return run(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), table, lens)
