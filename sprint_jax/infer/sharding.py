"""Inference over a device mesh: the `--mesh tensor=4,data=2` flag, where parameters and
KV slots live, and a memory planner.

Parameters are placed by the model's one rules table (`sprint_jax.model.sharding.RULES`): heads,
kv_heads and mlp (and vocab) over `tensor`, the model width over `fsdp`. The KV caches of the
engines, [L, slots, Hkv, tokens, D], carry the logical axes ("layers", "batch", "kv_heads",
"kv_seq", "head_dim"): slots over `data` (x `fsdp`), KV heads over `tensor`. Where a size does
not divide its mesh axis the table replicates that dimension, and `sharding_notes` says so; the
engines log the notes. The batched engine first makes the heads fit where it can (`head_layout`):
when `tensor` is a multiple of the KV heads it copies each KV head and pads the query heads with
zero heads, an equivalent model (Qwen2-7B at tensor=8: 8 KV and 32 query heads, each device one KV
head of every slot instead of all 4).

The jitted engine steps get these shardings explicitly (the cache is constrained to its
NamedSharding inside each step, and donated), so GSPMD inserts the collectives; only token ids
and stop codes cross to the host. Each step is traced with the engine's mesh as the active
abstract mesh (`traced_on_mesh`), so a Mosaic kernel in it (the prefill's flash attention, the
Pallas parent-prefix attention) runs per shard inside a shard_map, as a TPU requires.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import threading
from collections import Counter
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sprint_jax.config import ConfigError
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.qwen2 import abstract_params, dtype_of, logical_axes
from sprint_jax.model import sharding as mesh_lib

log = logging.getLogger(__name__)

KV_AXES = ("layers", "batch", "kv_heads", "kv_seq", "head_dim")   # [L, slots, Hkv, tokens, D]
KV_HEAD_AXIS = 2                                                    # where KV_AXES has "kv_heads"

MESH_HELP = ("device mesh as AXIS=SIZE pairs over data, fsdp, tensor, e.g. tensor=4,data=2 (unnamed axes are "
             "1; one size may be -1 = the rest of the devices; default: one device)")


def parse_mesh(spec: str) -> dict[str, int]:
    """"tensor=4,data=2" -> {"data": 2, "fsdp": 1, "tensor": 4}. ConfigError names what is wrong."""
    sizes = {"data": 1, "fsdp": 1, "tensor": 1}
    seen = set()
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in sizes:
            raise ConfigError(f"--mesh {spec!r}: expected AXIS=SIZE pairs with AXIS in data, fsdp, tensor; "
                              f"got {part!r}")
        if name in seen:
            raise ConfigError(f"--mesh {spec!r}: axis {name!r} given twice")
        seen.add(name)
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(f"--mesh {spec!r}: size of {name!r} must be an integer, got {value!r}") from None
        if n == 0 or n < -1:
            raise ConfigError(f"--mesh {spec!r}: size of {name!r} must be positive (or -1), got {n}")
        sizes[name] = n
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"--mesh {spec!r}: at most one size may be -1")
    return sizes


def mesh_from_flag(spec: str | None, devices: Sequence | None = None) -> Mesh | None:
    """The mesh of a `--mesh` flag (None/"" = no mesh: the engines' single-device path), over this
    process's own devices by default: the engines run one controller per process (token ids come
    back to its host), so one eval shard per host uses that host's chips."""
    if not spec:
        return None
    s = parse_mesh(spec)
    devices = jax.local_devices() if devices is None else devices
    return mesh_lib.make_mesh(s["data"], s["fsdp"], s["tensor"], devices=devices)


def add_mesh_argument(p) -> None:
    p.add_argument("--mesh", default=None, metavar="AXIS=N,...", help=MESH_HELP)


def param_shardings(config: Qwen2Config, mesh: Mesh, notes: list[str] | None = None) -> Any:
    """NamedShardings of the model's parameters, from the trainer's rules table."""
    abstract = abstract_params(config)
    return mesh_lib.param_shardings(mesh, logical_axes(config), abstract, notes)


def kv_sharding(config: Qwen2Config, mesh: Mesh, slots: int, notes: list[str] | None = None,
                name: str = "kv cache") -> NamedSharding:
    """The NamedSharding of a KV cache [L, slots, Hkv, tokens, D]."""
    shape = (config.num_hidden_layers, slots, config.num_key_value_heads, 1, config.head_dim)
    return NamedSharding(mesh, mesh_lib.logical_to_spec(KV_AXES, shape, mesh, notes=notes, name=name))


def pool_sharding(config: Qwen2Config, mesh: Mesh, slots: NamedSharding, num_pages: int, page_size: int,
                  notes: list[str] | None = None) -> NamedSharding:
    """The NamedSharding of the engine's page pool [L, Hkv, pages, page_size, D]: pages split over
    the mesh axes that split the sequence slots (`slots`, a `kv_sharding`: each shard's sequences
    keep their pages on it), KV heads as the slot cache's (over tensor where they divide)."""
    spec = tuple(slots.spec) + (None,) * (5 - len(slots.spec))
    if spec[1] is not None and num_pages % slot_parts((slots,)):
        raise ValueError(f"{num_pages} pages do not split over {spec[1]}")
    return NamedSharding(mesh, P(spec[0], spec[KV_HEAD_AXIS], spec[1], None, None))


def axes_size(mesh: Mesh, entry) -> int:
    """The number of shards a PartitionSpec entry (None, an axis name or a tuple of them) makes."""
    if entry is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))


def place_params(params: Any, shardings: Any) -> Any:
    """Parameters moved onto their shardings (a no-op for arrays already there)."""
    return jax.tree.map(lambda a, s: a if getattr(a, "sharding", None) == s else jax.device_put(a, s),
                        params, shardings)


def log_notes(notes: Sequence[str], what: str) -> None:
    for n in dict.fromkeys(notes):
        log.warning("%s: %s", what, n)


# ---------------------------------------------------------------------------------------------
# Memory planner
# ---------------------------------------------------------------------------------------------
def _per_device_bytes(shape: Sequence[int], itemsize: int, sharding: NamedSharding) -> int:
    shard = sharding.shard_shape(tuple(shape))
    return math.prod(shard) * itemsize


def weight_bytes_per_device(config: Qwen2Config, mesh: Mesh) -> int:
    """Bytes of the parameters on the fullest device."""
    abstract = abstract_params(config)
    shards = param_shardings(config, mesh)
    return int(sum(_per_device_bytes(a.shape, a.dtype.itemsize, s)
                   for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shards))))


@dataclasses.dataclass
class SlotPlan:
    """What fits one device: `max_seqs` parent slots of `parent_capacity` tokens, each with
    `max_children` child slots of `child_capacity` tokens."""
    max_seqs: int
    max_children: int
    parent_capacity: int
    child_capacity: int
    weight_bytes: int           # per device
    cache_bytes: int            # per device
    budget_bytes: int           # per device
    notes: list[str]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def cache_bytes_per_device(config: Qwen2Config, mesh: Mesh, max_seqs: int, max_children: int,
                           parent_capacity: int, child_capacity: int, notes: list[str] | None = None) -> int:
    """Bytes of an Engine's SlotCache (K and V, parents and children) on the fullest device."""
    item = np.dtype(dtype_of(config.dtype)).itemsize
    hkv, d = config.num_key_value_heads, config.head_dim
    L = config.num_hidden_layers
    p = (L, max_seqs, hkv, parent_capacity, d)
    c = (L, max_seqs * max_children, hkv, child_capacity, d)
    return 2 * (_per_device_bytes(p, item, kv_sharding(config, mesh, max_seqs, notes, "parent slots"))
                + _per_device_bytes(c, item, kv_sharding(config, mesh, max_seqs * max_children, notes,
                                                         "child slots")))


def plan_slots(config: Qwen2Config, mesh: Mesh, hbm_bytes: int, max_children: int, max_seq_len: int,
               max_branch_tokens: int, decode_chunk: int = 16, reserve: float = 0.1,
               temp_bytes_per_slot: int = 0, temp_fixed_bytes: int = 0) -> SlotPlan:
    """The most parent slots (each with `max_children` children) whose weights + cache + step
    temporaries (`temp_fixed_bytes` + `temp_bytes_per_slot` per parent slot on a device, as measured
    from compiled steps by `bench serve-memory`) fit in `hbm_bytes` per device, keeping `reserve` of
    it free (runtime, fragmentation). Slots are a multiple of the slot sharding (data x fsdp) so
    every device holds the same number."""
    notes: list[str] = []
    config = serving_config(config, mesh, notes)
    weights = weight_bytes_per_device(config, mesh)
    usable = int(hbm_bytes * (1 - reserve)) - weights - temp_fixed_bytes
    step = math.prod(mesh.shape[m] for m in ("data", "fsdp"))
    pc, cc = max_seq_len + decode_chunk, max_branch_tokens + decode_chunk
    per = cache_bytes_per_device(config, mesh, step, max_children, pc, cc)   # one slot per device
    per += temp_bytes_per_slot                                             # ... and its temporaries
    n = max(0, usable // per) * step if per else 0
    cache = cache_bytes_per_device(config, mesh, n, max_children, pc, cc, notes) if n else 0
    return SlotPlan(n, max_children, pc, cc, weights, cache, hbm_bytes, notes)


# ---------------------------------------------------------------------------------------------
# More tensor shards than heads: duplicate KV heads, pad query heads
# ---------------------------------------------------------------------------------------------
def head_layout(config: Qwen2Config, tensor: int) -> tuple[Qwen2Config, np.ndarray, int] | None:
    """When the heads do not divide `tensor` but `tensor` is a multiple of the KV heads K, an
    equivalent model whose heads do: each KV head copied r = tensor / K times, and the G = H / K
    query heads of each KV head spread over its r copies, ceil(G / r) per copy, padded with zero
    heads (a zero query head with zero o_proj rows adds nothing). Returns (config, src, r) with
    src[new q head] = the original q head or -1 (a pad); None when no change is needed or possible.
    Qwen2-7B at tensor=8: 4 -> 8 KV heads, 28 -> 32 query heads (4 pads), every head split 8 ways."""
    h, k = config.num_attention_heads, config.num_key_value_heads
    if tensor <= 1 or (h % tensor == 0 and k % tensor == 0) or tensor % k:
        return None
    r = tensor // k
    g = h // k
    per = -(-g // r)
    src = np.full(k * r * per, -1, np.int64)
    for kv in range(k):
        for c in range(r):
            for i in range(per):
                j = c * per + i
                if j < g:
                    src[(kv * r + c) * per + i] = kv * g + j
    return config.replace(num_attention_heads=k * r * per, num_key_value_heads=k * r), src, r


def expand_heads(params: Any, src: np.ndarray, r: int) -> Any:
    """The parameters of `head_layout`'s model (jit-able; q/k/v/o leaves only change)."""
    import jax.numpy as jnp

    idx, keep = jnp.asarray(np.maximum(src, 0)), jnp.asarray(src >= 0)

    def q_heads(a, axis):                    # gather query heads, zero the pads
        out = jnp.take(a, idx, axis=axis)
        shape = [1] * out.ndim
        shape[axis] = len(src)
        return out * keep.reshape(shape).astype(out.dtype)

    lay = dict(params["layers"])
    lay["q_proj"] = {n: q_heads(v, 2 if n == "kernel" else 1) for n, v in lay["q_proj"].items()}
    lay["o_proj"] = {n: q_heads(v, 1) for n, v in lay["o_proj"].items()}
    for name in ("k_proj", "v_proj"):
        lay[name] = {n: jnp.repeat(v, r, axis=2 if n == "kernel" else 1) for n, v in lay[name].items()}
    return {**params, "layers": lay}


def _heads_note(config: Qwen2Config, new: Qwen2Config, tensor: int) -> str:
    return (f"tensor={tensor} does not divide the heads ({config.num_attention_heads} query, "
            f"{config.num_key_value_heads} KV): KV heads copied -> {new.num_key_value_heads}, query heads "
            f"padded with zero heads -> {new.num_attention_heads}")


def serving_config(config: Qwen2Config, mesh: Mesh, notes: list[str] | None = None) -> Qwen2Config:
    """The config the engine runs on `mesh` (`head_layout`'s, where it applies)."""
    layout = head_layout(config, mesh.shape["tensor"])
    if layout is None:
        return config
    if notes is not None:
        notes.append(_heads_note(config, layout[0], mesh.shape["tensor"]))
    return layout[0]


def shard_model(config: Qwen2Config, params: Any, mesh: Mesh, notes: list[str]) -> tuple[Qwen2Config, Any]:
    """(config, params) placed on `mesh` by the rules table; where the heads do not divide the
    tensor axis but KV heads can be copied to fit (`head_layout`), the equivalent model with
    copied KV heads and padded query heads is built on the devices, and a note says so."""
    layout = head_layout(config, mesh.shape["tensor"])
    if layout is None:
        return config, place_params(params, param_shardings(config, mesh, notes))
    new, src, r = layout
    notes.append(_heads_note(config, new, mesh.shape["tensor"]))
    shards = param_shardings(new, mesh, notes)
    return new, jax.jit(lambda p: expand_heads(p, src, r), out_shardings=shards)(params)


# ---------------------------------------------------------------------------------------------
# data > 1: each data shard's slots stay on it (the engine steps run per slot shard)
# ---------------------------------------------------------------------------------------------
def slot_axes(kv, dim: int = 1) -> tuple[str, ...]:
    """The mesh axes that split the slots (axis `dim`: 1 for the slot cache [L, slots, ..], 2 for
    the page pool [L, Hkv, pages, ..]) of a tuple of KV shardings; () when they are whole on every
    device (or not split alike)."""
    if kv is None:
        return ()

    def axes(s):
        a = s.spec[dim] if len(s.spec) > dim else None
        return () if a is None else ((a,) if isinstance(a, str) else tuple(a))
    first = axes(kv[0])
    return first if all(axes(s) == first for s in kv[1:]) else ()


def whole_slots(kv: NamedSharding) -> NamedSharding:
    """A KV sharding with the slot axis whole on every device (KV heads etc. as they were)."""
    spec = tuple(kv.spec) + (None,) * (2 - len(kv.spec))
    return NamedSharding(kv.mesh, P(*(None if i == 1 else a for i, a in enumerate(spec))))


def slot_parts(kv, dim: int = 1) -> int:
    """How many blocks the slots (or pages, `slot_axes`) are split into (1: one block, the plain path)."""
    axes = slot_axes(kv, dim)
    return math.prod(kv[0].mesh.shape[a] for a in axes) if axes else 1


def slot_order(n_slots: int, parts: int) -> list[int]:
    """Free-slot order that spreads sequences over the slot shards (0, n/parts, 2n/parts, ..., 1, ...)."""
    per = n_slots // parts
    return sorted(range(n_slots), key=lambda s: (s % per, s // per))


def slot_blocks(slots: Sequence[int], n_slots: int, parts: int, cap: int | None = None) -> tuple[list[int], int]:
    """Row positions for a step whose rows use parent `slots`: with the slots split into `parts`
    blocks (one per slot shard), the rows are `parts` equal blocks and block j holds only rows of
    shard j's slots, so every shard reads and writes only its own slots. Returns (position of each
    slot's row, rows in all); the block width is a power of two (a bucket) capped at `cap` (default
    the slots per shard). parts=1: positions 0..n-1 in order, rows = the bucket of n."""
    per = n_slots // parts
    shard = [s // per for s in slots]
    count = max(Counter(shard).values(), default=1)
    width = min(1 << max(count - 1, 0).bit_length(), per if cap is None else cap)
    used = [0] * parts
    pos = []
    for j in shard:
        pos.append(j * width + used[j])
        used[j] += 1
    return pos, parts * width


_LOCAL = threading.local()


def local_head_axes():
    """Inside a step traced per slot shard (`slot_local`): the mesh axes that split the KV heads
    (still automatic there), so a manual kernel (the Pallas parent-prefix attention) can run per
    head shard in a nested shard_map; None elsewhere."""
    return getattr(_LOCAL, "heads", None)


def any_slot_shard(x: jax.Array) -> jax.Array:
    """Inside a step traced per slot shard (`slot_local`): whether the boolean scalar `x` holds on
    any slot shard; `x` elsewhere. Every control-flow predicate that depends on a shard's rows goes
    through it (the decode loop's condition, the sampling branch), so every device runs the same
    collectives: the loop body and the sampling branch hold collectives over tensor, and XLA CPU's
    collective-permute waits for every device of the program, not only its pairs, so shards that
    took different trip counts or branches hung (sampled runs of different lengths on data=4 x
    tensor=2). A shard whose rows are done runs idle steps that write and emit nothing, as finished
    rows of a shard already do; the call ends when its slowest shard ends, as before."""
    axes = getattr(_LOCAL, "slots", None)
    if not axes:
        return x
    return jax.lax.pmax(x.astype(jnp.int32), axes) > 0


def traced_on_mesh(kv):
    """The context an engine step is traced in: the mesh of `kv` (the engine's (parent, child)
    KV shardings) as the active abstract mesh, as the train step traces; a no-op for kv None (one
    device) or when a mesh is already active. The model reads it: activation constraints
    (`qwen2.constrain`) and the Pallas flash attention of a prefill, which runs per shard in a
    shard_map only under an active mesh (Mosaic refuses a kernel XLA would partition)."""
    if kv is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(kv[0].mesh.abstract_mesh)


def slot_local(rows: Sequence[str], out: Sequence[str] | str, cache_kv: Sequence[int],
               dims: tuple[int, int] = (1, KV_HEAD_AXIS)):
    """Decorator for an engine step `fn(params, config, cache, ..., kv=None)` (under jax.jit),
    traced under kv's mesh (`traced_on_mesh`). When `kv` splits the slots over mesh axes (data >
    1), `fn` runs once per slot shard (`jax.shard_map` manual over those axes; tensor stays
    automatic inside), on its own slots and its own block of rows (`slot_blocks` placed them), so no collective over data touches the
    cache or the gathered rows. Slot indices stay global: the step takes them modulo its (local)
    slot count. `rows`: the argument names with a leading row axis; `out`: per output, "cache",
    "rows" (leading row axis) or "max" (a scalar, the max over shards); `cache_kv[i]`: which
    sharding of `kv` the cache's i-th leaf carries (pinned after the shard_map). `out` may be a
    function of the bound arguments (a static flag adding an output); a row argument passed as
    None is left out of the shard_map (the step reads None). `dims`: the cache's (slot, KV head)
    axes ((2, 1) for the page pool [L, Hkv, pages, page_size, D])."""

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            with traced_on_mesh(a["kv"]):
                return run(a)

        def run(a):
            kv = a["kv"]
            axes = slot_axes(kv, dims[0])
            if not axes:
                return fn(**a)
            spec = out(a) if callable(out) else out
            single = isinstance(spec, str)
            outs = (spec,) if single else tuple(spec)
            present = tuple(n for n in rows if a[n] is not None)
            names = ("params",) * ("params" in a) + ("cache",) + present      # a copy step has no params
            arrays = [a.pop(n) for n in names]
            a["kv"] = None
            row_spec, cache_spec = P(axes), P(*(None,) * dims[0], axes)

            def local(*xs):
                spec = tuple(kv[0].spec) + (None,) * 5
                _LOCAL.heads = spec[dims[1]]   # see local_head_axes (read while fn is traced)
                _LOCAL.slots = axes                 # see any_slot_shard
                try:
                    res = fn(**a, **dict(zip(names, xs)))
                finally:
                    _LOCAL.heads = _LOCAL.slots = None
                res = (res,) if single else res
                return tuple(r[None] if kind == "max" else r for r, kind in zip(res, outs))

            cache = arrays[names.index("cache")]
            in_specs = tuple(P() if n == "params" else jax.tree.map(lambda _: cache_spec, cache) if n == "cache"
                             else row_spec for n in names)
            out_specs = tuple(jax.tree.map(lambda _: cache_spec, cache) if kind == "cache" else row_spec
                              for kind in outs)
            res = jax.shard_map(local, mesh=kv[0].mesh, in_specs=in_specs, out_specs=out_specs,
                                axis_names=frozenset(axes), check_vma=False)(*arrays)
            fixed = []
            for r, kind in zip(res, outs):
                if kind == "cache":
                    leaves, tree = jax.tree.flatten(r)
                    r = tree.unflatten([jax.lax.with_sharding_constraint(x, kv[i]) for x, i in zip(leaves, cache_kv)])
                elif kind == "max":
                    r = r.max()
                fixed.append(r)
            return fixed[0] if single else tuple(fixed)
        return wrapped
    return deco
