"""The device mesh (data, fsdp, tensor) and the one table from logical axes to mesh axes.

docs/design.md "Training": parameters carry logical axis names (`qwen2.logical_axes`); `RULES` maps
each to a mesh axis; every NamedSharding of parameters, optimizer state, activations and inference
KV caches is derived from it, so training, the model's attention and inference place arrays alike.
FSDP shards the model width, tensor parallelism shards heads / MLP / vocab (Megatron split), and
the batch is split over data x fsdp. A dimension whose size does not divide its mesh axis is
replicated instead (noted by `sharding_notes`), e.g. 4 KV heads on an 8-way tensor axis.
What only training needs (batch placement) is in `sprint_jax.train.mesh`.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sprint_jax.config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (None = replicated). Every logical axis the model uses must be here.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),   # activations / input rows
    "layers": None,              # the scanned layer axis stays whole on every device
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "kv_seq": None,              # the inference KV cache's token axis (infer/sharding.py)
}


def mesh_axes_of(rule) -> tuple[str, ...]:
    """The mesh axes of one rule of `RULES` (None = none, one name, or a tuple of names)."""
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def logical_to_spec(axes: Sequence[str], shape: Sequence[int] | None = None, mesh: Mesh | None = None,
                    rules: dict = RULES, notes: list[str] | None = None, name: str = "") -> P:
    """PartitionSpec for an array with these logical axes.

    Raises if a logical axis has no rule, or if two dimensions would use the same mesh axis (a
    collision makes the sharding meaningless). With `shape` and `mesh`, a dimension that does not
    divide evenly is replicated and a note is appended to `notes`.
    """
    used: dict[str, str] = {}
    out = []
    for d, ax in enumerate(axes):
        if ax not in rules:
            raise ConfigError(f"no sharding rule for logical axis {ax!r} (of {name or tuple(axes)}); "
                              f"rules: {', '.join(rules)}")
        mesh_axes = mesh_axes_of(rules[ax])
        for m in mesh_axes:
            if m not in MESH_AXES:
                raise ConfigError(f"sharding rule {ax!r} -> {m!r}: mesh axes are {MESH_AXES}")
            if m in used:
                raise ConfigError(f"sharding collision in {name or tuple(axes)}: logical axes {used[m]!r} and "
                                  f"{ax!r} both map to mesh axis {m!r}")
            used[m] = ax
        if mesh is not None:
            mesh_axes = tuple(m for m in mesh_axes if mesh.shape[m] > 1)
        if shape is not None and mesh is not None and mesh_axes:
            n = math.prod(mesh.shape[m] for m in mesh_axes)
            if shape[d] % n:
                if notes is not None:
                    notes.append(f"{name or tuple(axes)}: dim {d} ({ax}={shape[d]}) not divisible by "
                                 f"{'x'.join(mesh_axes)}={n}; replicated")
                mesh_axes = ()
        out.append(None if not mesh_axes else (mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes))
    return P(*out)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all). One size may be -1."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ConfigError(f"mesh: {len(devices)} devices are not divisible by {known} "
                              f"(data={data}, fsdp={fsdp}, tensor={tensor})")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ConfigError(f"mesh: data x fsdp x tensor = {'x'.join(map(str, sizes))} = {math.prod(sizes)} "
                          f"but there are {len(devices)} devices")
    auto = (jax.sharding.AxisType.Auto,) * 3   # GSPMD propagation, as jit with NamedShardings expects
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=auto, devices=devices)


def param_shardings(mesh: Mesh, logical: Any, abstract: Any, notes: list[str] | None = None) -> Any:
    """NamedShardings for a params tree from its logical-axes tree and abstract (shape) tree."""
    def one(path, axes, arr):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return NamedSharding(mesh, logical_to_spec(axes, arr.shape, mesh, notes=notes, name=name))
    return jax.tree_util.tree_map_with_path(one, logical, abstract, is_leaf=lambda x: isinstance(x, tuple))
