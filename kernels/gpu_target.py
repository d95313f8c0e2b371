"""The GPU a Triton kernel is built for: its shared memory, and block sizes that fit it.

Why. Triton keeps a kernel's tiles in shared memory, and a block whose tiles exceed what one
thread block may opt in to is refused at compile time ("Shared memory size limit exceeded").
That limit depends on the GPU (compute capability), and a tile's bytes on the dtype, the head dim
and the block sizes: the flash kernels' 128 x 128 blocks fit an A100 and an H100 in bf16, but in
fp32 they ask for 320 KiB. Every Pallas GPU kernel here therefore picks its blocks with
`fits(...)` against `shared_memory()` of the target.

The target is the local GPU (its compute capability, as jax reports it) unless `target(cc)`
names one: the planner compiles for GPUs that are not here. With neither (a CPU process running a
GPU body in the interpreter) it is taken to be 9.0, the largest of the table.

Shared memory models. Per kernel, the bytes Triton asked for were read off XLA's GPU compiler
(its refusal names the bytes requested) at head dims 64, 128 and 256, bf16 and fp32, blocks
16..128; the formulas below bound every reading (tests/test_kernels_gpu_compile.py holds them
against the compiler and compiles the chosen blocks for compute capability 8.0 and 9.0):
  * flash forward / backward (`flash_smem`): itemsize x Dp x 2 (bq + bk) + itemsize x bq x bk,
    exactly what the dK/dV kernel asks (q, dO, K and V tiles and one [bq, bk] product); the
    forward and dQ kernels ask less;
  * decode kernels (`decode_smem`): itemsize x Dp x (bq + 3 bk) + 4 x bq x bk + 8 bq, the
    grouped-prefix kernel's fp32 reading within 0.2% (q, K and V blocks and a staged copy, the fp32
    scores); the shared-prefix kernel asks less.
"""
from __future__ import annotations

import contextlib
import contextvars

# Shared memory one thread block may opt in to, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): 163 KB on 8.0 / 8.7, 99 KB on 8.6 / 8.9 /
# 12.x, 227 KB on 9.0 and 10.x.
KIB = 1024
SHARED_MEMORY = {(8, 0): 163 * KIB, (8, 6): 99 * KIB, (8, 7): 163 * KIB, (8, 9): 99 * KIB,
                 (9, 0): 227 * KIB, (10, 0): 227 * KIB, (10, 3): 227 * KIB, (12, 0): 99 * KIB,
                 (12, 1): 99 * KIB}
DEFAULT_CC = (9, 0)

_TARGET: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("gpu_target", default=None)


@contextlib.contextmanager
def target(cc: tuple[int, int] | None):
    """Within the block, GPU kernels choose blocks for compute capability `cc` (None: no change)."""
    if cc is None:
        yield
        return
    token = _TARGET.set(tuple(cc))
    try:
        yield
    finally:
        _TARGET.reset(token)


def compute_capability() -> tuple[int, int]:
    """The target's compute capability: `target(...)`'s, else the local GPU's, else DEFAULT_CC."""
    cc = _TARGET.get()
    if cc is not None:
        return cc
    import jax
    try:
        if jax.default_backend() == "gpu":
            major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
            return int(major), int(minor)
    except (RuntimeError, AttributeError, ValueError):    # no GPU client, or no such attribute
        pass
    return DEFAULT_CC


def shared_memory(cc: tuple[int, int] | None = None) -> int:
    """Bytes of shared memory a thread block may use on compute capability `cc` (default: the
    target's); an unlisted capability gets its major version's smallest, else the table's least."""
    cc = tuple(cc) if cc is not None else compute_capability()
    if cc in SHARED_MEMORY:
        return SHARED_MEMORY[cc]
    same = [v for k, v in SHARED_MEMORY.items() if k[0] == cc[0]]
    return min(same) if same else min(SHARED_MEMORY.values())


def itemsize(dtype) -> int:
    import jax.numpy as jnp
    return jnp.dtype(dtype).itemsize


def flash_smem(block_q: int, block_k: int, head_dim: int, dtype) -> int:
    """Bound on the bytes of shared memory the flash forward / backward kernels ask for (module doc);
    `head_dim` is the padded one (a power of two >= 16)."""
    item = itemsize(dtype)
    return item * head_dim * 2 * (block_q + block_k) + item * block_q * block_k


def decode_smem(block_q: int, block_k: int, head_dim: int, dtype) -> int:
    """Bound on the bytes of shared memory a decode (shared- / grouped-prefix) kernel asks for."""
    return itemsize(dtype) * head_dim * (block_q + 3 * block_k) + 4 * block_q * block_k + 8 * block_q
