"""Multi-host training: jax.distributed start-up and process-local batches
(docs/design.md "Training").

`initialize` must run before any other JAX call of the process. It uses, in order: explicit
coordinator / process count / process id (config or `--coordinator/--num-processes/--process-id`),
then JAX's own environment variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
then cluster detection (SLURM with several tasks, multi-host Cloud TPU), and otherwise stays single
process. On CPU, cross-process collectives go through gloo.

Each process materialises only the rows of the global batch that land on its own devices and
hands them to `jax.make_array_from_process_local_data`.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from sprint_jax.train.config import DistributedSection


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def detect_cluster() -> str | None:
    """The multi-process environment we are in, if any: "slurm", "tpu" or "jax-env"."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and (_int_env("JAX_NUM_PROCESSES") or 0) > 1:
        return "jax-env"
    if "SLURM_JOB_ID" in os.environ and (_int_env("SLURM_NTASKS") or _int_env("SLURM_NPROCS") or 1) > 1:
        return "slurm"
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def initialize(section: DistributedSection | None = None) -> str:
    """Start jax.distributed if this is a multi-process run; returns how ("single" if not)."""
    section = section or DistributedSection()
    if jax.distributed.is_initialized():
        return "already"
    if section.coordinator is not None:
        if section.num_processes == 1:
            return "single"
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(section.coordinator, num_processes=section.num_processes,
                                   process_id=section.process_id)
        return "explicit"
    how = detect_cluster() if section.auto else None
    if how is None:
        return "single"
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if how == "jax-env":
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=_int_env("JAX_NUM_PROCESSES"),
                                   process_id=_int_env("JAX_PROCESS_ID"))
    else:
        jax.distributed.initialize()       # JAX's own SLURM / Cloud TPU detection fills everything
    return how


def _local_row_slices(sharding: NamedSharding, global_shape: Sequence[int]) -> list[tuple[int, int]]:
    out = set()
    for idx in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        s = idx[0]
        out.add((s.start or 0, global_shape[0] if s.stop is None else s.stop))
    return sorted(out)


def local_row_range(sharding: NamedSharding, global_shape: Sequence[int]) -> tuple[int, int] | None:
    """[start, stop) of the batch rows this process's devices hold, or None if not one block."""
    slices = _local_row_slices(sharding, global_shape)
    lo, hi = slices[0][0], max(b for _, b in slices)
    covered = np.zeros(hi - lo, bool)
    for a, b in slices:
        covered[a - lo:b - lo] = True
    return (lo, hi) if covered.all() else None


def put_batch(make_rows: Callable[[Sequence[int]], dict[str, np.ndarray]], first_row: int, rows: int,
              seq_len: int, shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """Global batch of stream rows [first_row, first_row + rows) as sharded arrays; only this
    process's rows are built (`make_rows(row_ids)` -> dict of [n, seq_len] numpy arrays).

    The usual case (each process owns one block of rows) goes through
    `jax.make_array_from_process_local_data`; a mesh whose device order interleaves processes
    along the batch axis falls back to `jax.make_array_from_callback` over the same local rows.
    """
    shape = (rows, seq_len)
    any_sharding = next(iter(shardings.values()))
    block = local_row_range(any_sharding, shape)
    if block is not None:
        lo, hi = block
        local = make_rows(list(range(first_row + lo, first_row + hi)))
        return {k: jax.make_array_from_process_local_data(shardings[k], v, shape) for k, v in local.items()}
    needed = sorted({r for a, b in _local_row_slices(any_sharding, shape) for r in range(a, b)})
    local = make_rows([first_row + r for r in needed])
    where = {r: i for i, r in enumerate(needed)}

    def build(k: str) -> jax.Array:
        def cb(idx):
            s = idx[0]
            ids = range(s.start or 0, rows if s.stop is None else s.stop)
            return local[k][[where[r] for r in ids]][:, idx[1]]
        return jax.make_array_from_callback(shape, shardings[k], cb)

    return {k: build(k) for k in local}


def gather_to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-host) sharded array, on every process."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
