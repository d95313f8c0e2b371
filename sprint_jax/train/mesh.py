"""Where a training batch lives on the device mesh: rows over data x fsdp, the sequence whole.

The mesh and the rules table from logical axes to mesh axes are the model's
(`sprint_jax.model.sharding`): parameters, optimizer state and activations are placed by it alike.
"""
from __future__ import annotations

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sprint_jax.model.sharding import RULES, logical_to_spec, mesh_axes_of


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over data x fsdp, the sequence whole."""
    return NamedSharding(mesh, logical_to_spec(("batch",), None, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
    """Rows of a (micro)batch must be a multiple of this."""
    return int(np.prod([mesh.shape[m] for m in mesh_axes_of(RULES["batch"])]))
