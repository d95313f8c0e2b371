"""TPU chips and slices: the one table of chip figures, and slice names -> compile-only topologies.

A slice is named two ways. libtpu's topology names (`v5p:2x2x2`, `v5e:2x4`) give the chip grid.
Cloud TPU's accelerator types (what users book: `v5p-16`, `v5litepod-8`, `v6e-8`) give a count
that is TensorCores for v5p and v4 (two per chip) and chips for v5e and v6e, so `v5p-16` is the
8-chip `v5p:2x2x2` and `v5litepod-8` the 8-chip `v5e:2x4`. JAX runs one device per chip on all
three (a v5p chip's two cores run as one "megacore" device).

libtpu builds a compile-only topology only for whole hosts (4 chips at least), and for v4 it makes
one device per TensorCore, which is not how JAX runs a v4 chip: v4 is refused rather than planned
on the wrong device count.
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

# Slice shapes by chip count (Cloud TPU's documented shapes; the smallest is one 4-chip host).
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16),
              6144: (16, 16, 24)}
_SHAPES_2D = {4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Slice:
    """One TPU slice: its chip generation and grid; `name` is libtpu's topology name."""
    chip: Chip
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def booking(self) -> str:
        """The accelerator type Cloud TPU books this slice as (`v5p-16`, `v5litepod-8`)."""
        return f"{self.chip.booking}-{self.chips * self.chip.cores_per_chip}"


def _chip(gen: str, text: str) -> Chip:
    gen = _ALIASES.get(gen.lower(), gen.lower())
    if gen == "v4":
        raise UserError(f"topology {text!r}: v4 is not planned (libtpu's compile-only v4 topology runs "
                        "one device per TensorCore, JAX runs one per chip); plan on v5p, v5e or v6e")
    if gen not in CHIPS:
        raise UserError(f"topology {text!r}: unknown TPU generation {gen!r}; known: "
                        f"{', '.join(CHIPS)} (also v5litepod)")
    return CHIPS[gen]


def shapes(chip: Chip) -> dict[int, tuple[int, ...]]:
    """Chip count -> slice shape, smallest first, for one generation."""
    return dict(_SHAPES_3D if chip.dims == 3 else _SHAPES_2D)


def parse_slice(text: str) -> Slice:
    """`v5p:2x2x2` (libtpu topology) or `v5p-16` / `v5litepod-8` / `v6e-8` (accelerator type).
    Raises UserError naming what is wrong."""
    t = text.strip()
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
    raise UserError(f"topology {t!r}: write a libtpu topology (v5p:2x2x2, v5e:2x4) or an accelerator "
                    "type (v5p-16, v5litepod-8, v6e-8)")


def parse_slices(text: str) -> list[Slice]:
    """A comma-separated list of `parse_slice` names."""
    names = [s for s in text.split(",") if s.strip()]
    if not names:
        raise UserError("--topology is empty: name at least one slice (v5p:2x2x2, v5p-16, ...)")
    return [parse_slice(s) for s in names]


def ladder(top: Slice) -> list[Slice]:
    """The slices of `top`'s generation from the smallest host up to `top` itself."""
    out = [Slice(top.chip, s) for n, s in shapes(top.chip).items() if n < top.chips]
    return out + [top]
