"""TPU chips and NVIDIA GPU nodes: the one table of chip figures, names -> compile-only topologies.

A slice is named two ways. libtpu's topology names (`v5p:2x2x2`, `v5e:2x4`) give the chip grid.
Cloud TPU's accelerator types (what users book: `v5p-16`, `v5litepod-8`, `v6e-8`) give a count
that is TensorCores for v5p and v4 (two per chip) and chips for v5e and v6e, so `v5p-16` is the
8-chip `v5p:2x2x2` and `v5litepod-8` the 8-chip `v5e:2x4`. JAX runs one device per chip on all
three (a v5p chip's two cores run as one "megacore" device).

libtpu builds a compile-only topology only for whole hosts (4 chips at least), and for v4 it makes
one device per TensorCore, which is not how JAX runs a v4 chip: v4 is refused rather than planned
on the wrong device count.

GPUs are named by model and node shape: `h100:8` is one node of 8 GPUs, `h100:2x8` two such nodes
(`h100:1` one GPU). jax's CUDA plugin (jax-cuda12-plugin, no driver or CUDA libraries needed) builds
compile-only devices from a `GpuTargetConfigProto` text written here from the table's figures
(`target_config`), and XLA's GPU compiler, Triton included, compiles for them as for the real part.
"""
from __future__ import annotations

import dataclasses
import math
import re

from sprint_jax.errors import UserError

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures of one TPU generation."""
    name: str               # generation as libtpu names it in a topology ("v5p", "v5e", "v6e")
    hbm_gib: float          # HBM capacity per chip
    peak_flops: float       # dense bf16 FLOP/s per chip
    hbm_bandwidth: float    # HBM bytes/s per chip
    dims: int               # 3 (3-D torus: v5p) or 2 (2-D torus: v5e, v6e)
    cores_per_chip: int     # TensorCores per chip: accelerator-type names count these
    booking: str            # the accelerator-type prefix Cloud TPU uses ("v5p", "v5litepod", "v6e")

    platform = "tpu"

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * GIB)


# The one table of chip figures (per chip; bf16 peak, HBM capacity and bandwidth).
CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, HBM2e 95 GB at 2765 GBps, 2 TensorCores
    "v5p": Chip("v5p", 95.0, 459e12, 2765e9, 3, 2, "v5p"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, HBM2 16 GB at 819 GBps, 1 TensorCore
    "v5e": Chip("v5e", 16.0, 197e12, 819e9, 2, 1, "v5litepod"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, HBM 32 GB at 1638 GBps, 1 TensorCore
    "v6e": Chip("v6e", 32.0, 918e12, 1638e9, 2, 1, "v6e"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "trillium": "v6e"}

@dataclasses.dataclass(frozen=True)
class Gpu:
    """Published per-GPU figures of one NVIDIA data-centre part (the SXM board of an 8-GPU node)."""
    name: str                    # as --topology names it ("h100")
    product: str                 # the part (also the compile-only devices' device_kind)
    hbm_gib: float               # HBM capacity per GPU
    peak_flops: float            # dense bf16 tensor-core FLOP/s per GPU (no sparsity)
    hbm_bandwidth: float         # HBM bytes/s per GPU
    nvlink_bandwidth: float      # NVLink bytes/s per GPU (both directions), inside a node
    internode_bandwidth: float   # network bytes/s per GPU between nodes (one 400 / 200 Gb/s NIC per GPU)
    smem_per_block: int          # shared memory one thread block may opt in to, bytes
    compute_capability: tuple[int, int]
    sm_count: int
    l2_bytes: int
    clock_ghz: float             # boost clock
    source: str
    platform = "gpu"

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * GIB)


KIB = 1024
# The one table of GPU figures (per GPU, SXM boards as in 8-GPU HGX / DGX nodes). Shared memory per
# block (opt-in) and per SM by compute capability: CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability" (8.0: 163 / 164 KB; 9.0 and 10.0: 227 / 228 KB).
GPUS: dict[str, Gpu] = {
    # nvidia.com A100 datasheet (SXM4 80GB): 80 GB HBM2e at 2,039 GB/s, BF16 312 TFLOPS dense,
    # NVLink 600 GB/s; 108 SMs, 40 MB L2, 1.41 GHz boost; DGX A100: one 200 Gb/s HDR NIC per GPU
    "a100-80g": Gpu("a100-80g", "NVIDIA A100-SXM4-80GB", 80.0, 312e12, 2039e9, 600e9, 25e9, 163 * KIB, (8, 0),
                    108, 40 * 2 ** 20, 1.41, "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)"),
    # nvidia.com H100 datasheet (SXM): 80 GB HBM3 at 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989.5
    # dense), NVLink 900 GB/s; 132 SMs, 50 MB L2, 1.98 GHz boost; DGX H100: one 400 Gb/s NIC per GPU
    "h100": Gpu("h100", "NVIDIA H100 80GB HBM3", 80.0, 989.5e12, 3350e9, 900e9, 50e9, 227 * KIB, (9, 0),
                132, 50 * 2 ** 20, 1.98, "NVIDIA H100 Tensor Core GPU datasheet (SXM)"),
    # nvidia.com H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, BF16 1,979 TFLOPS with sparsity,
    # NVLink 900 GB/s; the H100's GH100 die (132 SMs, 50 MB L2)
    "h200": Gpu("h200", "NVIDIA H200", 141.0, 989.5e12, 4800e9, 900e9, 50e9, 227 * KIB, (9, 0),
                132, 50 * 2 ** 20, 1.98, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # nvidia.com HGX B200 / DGX B200 datasheets: 180 GB HBM3e at 8 TB/s per GPU, FP16/BF16 36 PFLOPS
    # with sparsity per 8 GPUs (2.25 dense per GPU), NVLink 1.8 TB/s; 148 SMs; one 400 Gb/s NIC per GPU
    "b200": Gpu("b200", "NVIDIA B200", 180.0, 2250e12, 8000e9, 1800e9, 50e9, 227 * KIB, (10, 0),
                148, 126 * 2 ** 20, 1.965, "NVIDIA HGX B200 / DGX B200 datasheets"),
}
_GPU_ALIASES = {"a100": "a100-80g", "a100-80gb": "a100-80g", "h100-80g": "h100", "h100-sxm": "h100",
                "h200-141g": "h200"}
GPU_NODE = 8          # GPUs per node (HGX / DGX); tensor parallelism stays inside one


def target_config(gpu: Gpu) -> str:
    """The stream_executor.GpuTargetConfigProto (text form) XLA's GPU compiler compiles for, from
    the table's figures; the fields not in the table are the same on every part listed (CUDA's
    limits per compute capability: 1024 threads a block, 2048 an SM, 64 K registers)."""
    cc = gpu.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {gpu.smem_per_block + KIB}
  threads_per_core_limit: 2048
  core_count: {gpu.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(gpu.hbm_bandwidth)}
  l2_cache_size: {gpu.l2_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.hbm_bytes}
  shared_memory_per_block_optin: {gpu.smem_per_block}
  cuda_compute_capability {{ major: {cc[0]} minor: {cc[1]} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{gpu.product}"
"""


# Slice shapes by chip count (Cloud TPU's documented shapes; the smallest is one 4-chip host).
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16),
              6144: (16, 16, 24)}
_SHAPES_2D = {4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Slice:
    """One TPU slice (its chip generation and grid; `name` is libtpu's topology name) or GPU nodes
    (shape (nodes, GPUs per node); `name` h100:8, h100:2x8)."""
    chip: Chip | Gpu
    shape: tuple[int, ...]

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def name(self) -> str:
        if self.platform == "gpu":
            nodes, per = self.shape
            return f"{self.chip.name}:{per}" if nodes == 1 else f"{self.chip.name}:{nodes}x{per}"
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def booking(self) -> str:
        """The accelerator type Cloud TPU books this slice as (`v5p-16`, `v5litepod-8`); for GPUs the
        part and the count (`8 x NVIDIA H100 80GB HBM3`, `2 nodes x 8 x ...`)."""
        if self.platform == "gpu":
            nodes, per = self.shape
            return f"{per} x {self.chip.product}" if nodes == 1 else f"{nodes} nodes x {per} x {self.chip.product}"
        return f"{self.chip.booking}-{self.chips * self.chip.cores_per_chip}"

    @property
    def topology(self) -> str:
        """The compile-only topology string: libtpu's name, or the CUDA plugin's `1xNODESxGPUS`."""
        return f"1x{self.shape[0]}x{self.shape[1]}" if self.platform == "gpu" else self.name


def _chip(gen: str, text: str) -> Chip:
    gen = _ALIASES.get(gen.lower(), gen.lower())
    if gen == "v4":
        raise UserError(f"topology {text!r}: v4 is not planned (libtpu's compile-only v4 topology runs "
                        "one device per TensorCore, JAX runs one per chip); plan on v5p, v5e or v6e")
    if gen not in CHIPS:
        raise UserError(f"topology {text!r}: unknown TPU generation or GPU {gen!r}; known: "
                        f"{', '.join(CHIPS)} (also v5litepod), GPUs {', '.join(GPUS)}")
    return CHIPS[gen]


_SHAPES_GPU = {1: (1, 1), 2: (1, 2), 4: (1, 4), 8: (1, 8), 16: (2, 8), 32: (4, 8), 64: (8, 8), 128: (16, 8),
               256: (32, 8)}


def shapes(chip: Chip | Gpu) -> dict[int, tuple[int, ...]]:
    """Chip count -> slice shape, smallest first, for one generation (GPUs: one GPU, part of a node,
    whole 8-GPU nodes)."""
    if chip.platform == "gpu":
        return dict(_SHAPES_GPU)
    return dict(_SHAPES_3D if chip.dims == 3 else _SHAPES_2D)


def _gpu(name: str) -> Gpu | None:
    name = _GPU_ALIASES.get(name.lower(), name.lower())
    return GPUS.get(name)


def parse_gpu(text: str) -> Slice | None:
    """`h100:8` (one node of 8), `h100:2x8` (nodes x GPUs per node); None if the name is not a GPU's.
    Raises UserError for a GPU name with a shape that cannot be planned."""
    t = text.strip()
    m = re.fullmatch(r"([A-Za-z0-9-]+?):(\d+)(?:x(\d+))?", t)
    if not m:
        return None
    gpu = _gpu(m.group(1))
    if gpu is None:
        return None
    nodes, per = (1, int(m.group(2))) if m.group(3) is None else (int(m.group(2)), int(m.group(3)))
    if nodes < 1 or per < 1 or per > GPU_NODE:
        raise UserError(f"topology {t!r}: a node holds 1 to {GPU_NODE} GPUs ({gpu.name}:8 is one node, "
                        f"{gpu.name}:2x8 two)")
    if nodes > 1 and per != GPU_NODE:
        raise UserError(f"topology {t!r}: several nodes are whole {GPU_NODE}-GPU nodes ({gpu.name}:{nodes}x{GPU_NODE})")
    if per & (per - 1):
        raise UserError(f"topology {t!r}: plan 1, 2, 4 or 8 GPUs of a node")
    return Slice(gpu, (nodes, per))


def parse_slice(text: str) -> Slice:
    """`v5p:2x2x2` (libtpu topology) or `v5p-16` / `v5litepod-8` / `v6e-8` (accelerator type).
    Raises UserError naming what is wrong."""
    t = text.strip()
    gpu = parse_gpu(t)
    if gpu is not None:
        return gpu
    m = re.fullmatch(r"([A-Za-z0-9]+):(\d+(?:x\d+)*)", t)
    if m:
        chip = _chip(m.group(1), t)
        shape = tuple(int(x) for x in m.group(2).split("x"))
        if chip.dims == 3 and len(shape) == 2:
            shape = shape + (1,)
        if len(shape) != chip.dims or min(shape) < 1:
            raise UserError(f"topology {t!r}: {chip.name} slices are {chip.dims}-D grids "
                            f"(e.g. {chip.name}:{'x'.join(['2'] * chip.dims)})")
        if math.prod(shape) < 4:
            raise UserError(f"topology {t!r}: the smallest slice that can be compiled for here is one "
                            f"4-chip host ({Slice(chip, shapes(chip)[4]).name})")
        return Slice(chip, shape)
    m = re.fullmatch(r"([A-Za-z0-9]+)-(\d+)", t)
    if m:
        chip = _chip(m.group(1), t)
        count = int(m.group(2))
        if count % chip.cores_per_chip:
            raise UserError(f"accelerator type {t!r}: {chip.booking} counts TensorCores, "
                            f"{chip.cores_per_chip} per chip; {count} is not a whole number of chips")
        chips = count // chip.cores_per_chip
        table = shapes(chip)
        if chips not in table:
            known = ", ".join(f"{chip.booking}-{n * chip.cores_per_chip}" for n in table)
            raise UserError(f"accelerator type {t!r} ({chips} chips) has no slice shape here; "
                            f"known: {known}")
        return Slice(chip, table[chips])
    raise UserError(f"topology {t!r}: write a libtpu topology (v5p:2x2x2, v5e:2x4), an accelerator "
                    f"type (v5p-16, v5litepod-8, v6e-8) or GPU nodes ({', '.join(GPUS)}: h100:8, h100:2x8)")


def parse_slices(text: str) -> list[Slice]:
    """A comma-separated list of `parse_slice` names."""
    names = [s for s in text.split(",") if s.strip()]
    if not names:
        raise UserError("--topology is empty: name at least one slice (v5p:2x2x2, v5p-16, h100:8, ...)")
    return [parse_slice(s) for s in names]


def ladder(top: Slice) -> list[Slice]:
    """The slices of `top`'s generation from the smallest host up to `top` itself."""
    out = [Slice(top.chip, s) for n, s in shapes(top.chip).items() if n < top.chips]
    return out + [top]
