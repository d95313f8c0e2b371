"""`plan train`: the SFT step compiled for TPU slices or GPU nodes, one row per (slice, mesh).

A row holds the compiler's verdict (compiled or not, per-chip bytes from `memory_analysis()`),
the chip's HBM and the headroom left, the planner's own memory estimate beside it, and our FLOPs,
HBM traffic and roofline step time. `--search` walks a generation's slices from the smallest host
upward: on each, meshes from the least tensor parallelism up, each first held against the
planner's estimate, and the first one the estimate fits is compiled; the compiler has the last
word (a refused candidate moves the search on).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from sprint_jax.errors import UserError
from sprint_jax.plan import estimate as est
from sprint_jax.plan.chips import GIB, Slice, ladder
from sprint_jax.plan.estimate import StepShape

# A candidate is compiled in a search only if the estimate leaves this share of HBM free: the
# estimate is within 20% of the compiler's figure, and an over-full chip fails to compile.
SEARCH_FILL = 0.9
MAX_SEARCH_COMPILES = 4


def parse_mesh(text: str | None) -> dict[str, int]:
    """`fsdp=8,tensor=1` -> {'data': 1, 'fsdp': 8, 'tensor': 1}; unnamed axes: data 1, fsdp -1
    (the rest of the chips), tensor 1. At most one size may be -1."""
    sizes = {"data": 1, "fsdp": -1, "tensor": 1}
    if not text:
        return sizes
    given = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in sizes:
            raise UserError(f"--mesh {text!r}: write AXIS=SIZE pairs with axes data, fsdp, tensor "
                            "(e.g. fsdp=8,tensor=1)")
        try:
            n = int(value)
        except ValueError:
            raise UserError(f"--mesh {text!r}: {key}={value.strip()!r} is not an integer") from None
        if n == 0 or n < -1:
            raise UserError(f"--mesh {text!r}: {key} must be a positive size (or -1 for the rest)")
        given[key] = n
    sizes.update(given)
    if "fsdp" not in given and -1 in (sizes["data"], sizes["tensor"]):
        sizes["fsdp"] = 1
    if sum(v == -1 for v in sizes.values()) > 1:
        raise UserError(f"--mesh {text!r}: at most one axis may be -1")
    return sizes


def resolve_mesh(sizes: dict[str, int], chips: int, where: str) -> tuple[int, int, int]:
    """Mesh sizes for a slice of `chips` chips: the -1 axis takes the rest."""
    known = math.prod(v for v in sizes.values() if v != -1)
    out = dict(sizes)
    for k, v in sizes.items():
        if v == -1:
            if chips % known:
                raise UserError(f"mesh {_mesh_text(sizes)} does not divide the {chips} chips of {where}")
            out[k] = chips // known
    if math.prod(out.values()) != chips:
        raise UserError(f"mesh {_mesh_text(out)} uses {math.prod(out.values())} chips but {where} has {chips}")
    node = node_size(where)
    if node and (out["tensor"] > node or node % out["tensor"]):
        raise UserError(f"mesh {_mesh_text(out)} on {where}: tensor parallelism stays inside one node of {node} GPUs "
                        f"(tensor a divisor of {node}); put the other GPUs in fsdp or data")
    return out["data"], out["fsdp"], out["tensor"]


def node_size(where) -> int | None:
    """GPUs per node of GPU nodes (a `Slice` or its name); None for a TPU slice."""
    from sprint_jax.plan.chips import parse_slice
    if isinstance(where, str):
        try:
            where = parse_slice(where)
        except UserError:
            return None
    return where.shape[1] if where.platform == "gpu" else None


def _mesh_text(sizes) -> str:
    if isinstance(sizes, tuple):
        sizes = dict(zip(est.MESH_AXES, sizes))
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def check_divisible(shape: StepShape, where: str) -> None:
    """The trainer's batch rules: batch % grad_accum == 0 and a microbatch's rows split evenly
    over data x fsdp."""
    if shape.batch % shape.grad_accum:
        raise UserError(f"--batch {shape.batch} is not a multiple of --grad-accum {shape.grad_accum}")
    micro = shape.batch // shape.grad_accum
    rows = shape.mesh[0] * shape.mesh[1]
    if micro % rows:
        raise UserError(f"a microbatch of {micro} rows does not split over data x fsdp = {rows} on {where} "
                        f"(mesh {_mesh_text(shape.mesh)}); give a batch / grad-accum whose microbatch is a "
                        f"multiple of {rows}, or move chips to tensor")
    if shape.loss_chunk and shape.loss_chunk < shape.seq_len and shape.seq_len % shape.loss_chunk:
        raise UserError(f"--loss-chunk {shape.loss_chunk} must divide --seq-len {shape.seq_len} (or be 0)")


def program_name(shape: StepShape, model: str) -> str:
    accum = f" accum {shape.grad_accum}" if shape.grad_accum > 1 else ""
    return f"train {model} {shape.layout} {shape.batch}x{shape.seq_len}{accum} remat {shape.remat}"


def figures(shape: StepShape, where: Slice) -> dict[str, Any]:
    """The planner's own figures for a row: memory estimate, FLOPs, traffic, roofline."""
    memory = est.memory_estimate(shape)
    roof = est.roofline(shape, where.chip.peak_flops, where.chip.hbm_bandwidth)
    return {"estimate_bytes": memory["total"], "estimate": memory, **roof}


def state_bytes(shape: StepShape) -> float:
    """Per-chip bytes of what the step holds whatever its temporaries (exact sizes): fp32 weights,
    AdamW moments, gradients and the batch."""
    memory = est.memory_estimate(shape)
    return sum(memory[k] for k in ("params", "adam", "grads", "batch"))


def plan_row(shape: StepShape, where: Slice, model: str,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Compile one (step, slice, mesh) and return its row (module docstring)."""
    from sprint_jax.plan.compile import compile_step

    from sprint_jax.plan.compile import Compiled

    name = program_name(shape, model)
    state = state_bytes(shape)
    if where.platform == "gpu" and state > where.chip.hbm_bytes:
        # XLA's GPU compiler does not check the device's memory: a step whose weights, AdamW state and
        # gradients alone (exact sizes) exceed it is refused here rather than compiled for minutes
        result = Compiled(False, error=f"the fp32 weights, AdamW moments and gradients alone need "
                                       f"{state / GIB:.1f} GiB per GPU of {where.chip.hbm_gib:g} GiB")
    else:
        if progress:
            progress(f"compiling {name} for {where.name} ({where.booking}), mesh {_mesh_text(shape.mesh)}")
        result = compile_step(shape, where, progress)
    row = {"program": name, "topology": where.name, "accelerator_type": where.booking,
           "chips": where.chips, "mesh": shape.mesh_dict, "compiled": result.compiled,
           "compile_s": round(result.compile_s, 2), "lower_s": round(result.lower_s, 2),
           "per_chip_bytes": None, "hbm_bytes": where.chip.hbm_bytes, "headroom": None,
           "kernels": sorted(set(result.kernels)), "tpu_custom_calls": result.custom_calls,
           "error": result.error, "compiler_oom": result.oom, "sharding_notes": result.sharding_notes,
           "state_bytes": state, **figures(shape, where)}
    if result.memory is not None:
        mem = {k: result.memory[k] for k in ("arguments", "outputs", "temp", "alias", "total")}
        row["per_chip_bytes"] = mem
        row["headroom"] = 1.0 - mem["total"] / where.chip.hbm_bytes
    row["fits"] = bool(result.compiled and row["headroom"] is not None and row["headroom"] >= 0)
    if progress:
        if result.compiled:
            progress(f"compiled in {result.compile_s:.0f} s: {row['per_chip_bytes']['total'] / GIB:.2f} GiB "
                     f"per chip of {where.chip.hbm_gib:g} GiB")
        else:
            progress(f"not compiled after {result.lower_s + result.compile_s:.0f} s: {result.error}")
    return row


# ---------------------------------------------------------------------------------------------
# Does not fit: by how much, and a way out
# ---------------------------------------------------------------------------------------------
def meshes(chips: int, shape: StepShape) -> list[tuple[int, int, int]]:
    """Meshes on `chips` chips from the least tensor parallelism up (data stays 1: it only adds
    copies of the weights), keeping a microbatch's rows divisible over fsdp and the KV heads over
    tensor where possible."""
    c = shape.config
    micro = shape.batch // shape.grad_accum
    out = []
    for tensor in (1, 2, 4, 8):       # at most 8: a GPU node's NVLink domain
        if chips % tensor or (tensor > 1 and c.num_key_value_heads % tensor and c.num_attention_heads % tensor):
            continue
        fsdp = chips // tensor
        if micro % fsdp == 0:
            out.append((1, fsdp, tensor))
    return out


def way_out(shape: StepShape, where: Slice) -> str:
    """One concrete change that makes the step fit by the planner's estimate (several when
    cheap to name), in the CLI's own flags."""
    options: list[tuple[str, float]] = []

    def consider(label: str, s: StepShape, on: Slice = where):
        try:
            check_divisible(s, on.name)
        except UserError:
            return
        total = est.memory_estimate(s)["total"]
        if total <= on.chip.hbm_bytes * SEARCH_FILL:
            options.append((label, total))

    if shape.remat != "full":
        consider("--remat full", dataclasses.replace(shape, remat="full"))
    a = shape.grad_accum * 2
    while a <= shape.batch:
        if shape.batch % a == 0:
            consider(f"--grad-accum {a}", dataclasses.replace(shape, grad_accum=a))
        if options and options[-1][0].startswith("--grad-accum"):
            break
        a *= 2
    for mesh in meshes(where.chips, shape):
        if mesh[2] > shape.mesh[2]:
            consider(f"--mesh fsdp={mesh[1]},tensor={mesh[2]}", dataclasses.replace(shape, mesh=mesh))
            if options and options[-1][0].startswith("--mesh"):
                break
    for bigger in ladder_above(where):
        for mesh in meshes(bigger.chips, shape):
            consider(f"--topology {bigger.name} ({bigger.booking}) --mesh fsdp={mesh[1]},tensor={mesh[2]}",
                     dataclasses.replace(shape, mesh=mesh), bigger)
            if options and options[-1][0].startswith("--topology"):
                break
        if options and options[-1][0].startswith("--topology"):
            break
    b = shape.batch // 2
    while b >= shape.grad_accum and b >= 1:
        consider(f"--batch {b}", dataclasses.replace(shape, batch=b))
        if options and options[-1][0].startswith("--batch"):
            break
        b //= 2
    if not options:
        return ("way out: none of --remat full, more --grad-accum, tensor parallelism, a larger slice or "
                "a smaller batch fits by the planner's estimate")
    shown = options[:3]
    return "way out: " + " or ".join(f"{label} (estimate {total / GIB:.1f} GiB)" for label, total in shown)


def ladder_above(where: Slice) -> list[Slice]:
    from sprint_jax.plan.chips import shapes
    return [Slice(where.chip, s) for n, s in shapes(where.chip).items() if n > where.chips]


def not_fit_line(row: dict, shape: StepShape, where: Slice) -> str:
    """The one line for a row that does not fit: what, by how much, a way out."""
    oom = row.get("compiler_oom")
    mesh = _mesh_text(shape.mesh)
    head = f"{row['program']} on {where.name} ({where.booking}, mesh {mesh})"
    state, limit = row.get("state_bytes") or 0.0, where.chip.hbm_bytes
    if not row["compiled"] and not oom and state > limit:
        what = (f"does not fit: the fp32 weights, AdamW moments and gradients alone need {state / GIB:.1f} GiB per "
                f"{'GPU' if where.platform == 'gpu' else 'chip'}, {(state - limit) / GIB:.1f} GiB over its "
                f"{limit / GIB:g} GiB (not compiled)")
    elif row["compiled"] and row["per_chip_bytes"]:
        used, limit = row["per_chip_bytes"]["total"], where.chip.hbm_bytes
        what = (f"needs {used / GIB:.1f} GiB per chip, {(used - limit) / GIB:.1f} GiB over the chip's "
                f"{limit / GIB:g} GiB")
    elif oom and "temp" in oom:                  # the compiler counted its temporaries alone
        held = sum(row["estimate"][k] for k in ("params", "adam", "batch"))    # exact sizes
        need = oom["temp"] + held
        what = (f"does not fit: the TPU compiler needs {oom['temp'] / GIB:.1f} GiB of temporaries beside "
                f"{held / GIB:.1f} GiB of weights, AdamW state and batch, with {oom['limit'] / GIB:.2f} GiB of HBM "
                f"per chip (over by {(need - oom['limit']) / GIB:.1f} GiB)")
    elif oom and oom["used"] == oom["used"]:      # not NaN: the compiler gave its figures
        used, limit = oom["used"], oom["limit"]
        what = (f"does not fit: the TPU compiler needs {used / GIB:.1f} GiB per chip of {limit / GIB:.1f} GiB "
                f"(over by {oom['over'] / GIB:.1f} GiB)")
    else:
        used = row["estimate_bytes"]
        what = (f"does not fit: the compiler ran out of HBM (planner's estimate {used / GIB:.1f} GiB per chip "
                f"of {where.chip.hbm_gib:g} GiB)")
    return f"{head} {what}; {way_out(shape, where)}"


# ---------------------------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------------------------
def search(shape: StepShape, top: Slice, model: str,
           progress: Callable[[str], None] | None = None) -> tuple[dict | None, list[dict]]:
    """The smallest slice of `top`'s generation (up to `top`) and the least-tensor mesh on it
    that the compiler accepts. Returns (the accepted row or None, every row compiled)."""
    tried: list[dict] = []
    compiles = 0
    for where in ladder(top):
        for mesh in meshes(where.chips, shape):
            candidate = dataclasses.replace(shape, mesh=mesh)
            total = est.memory_estimate(candidate)["total"]
            if total > where.chip.hbm_bytes * SEARCH_FILL:
                if progress:
                    progress(f"search: {where.name} mesh {_mesh_text(mesh)}: estimate {total / GIB:.1f} GiB "
                             f"per chip > {SEARCH_FILL:.0%} of {where.chip.hbm_gib:g} GiB, skipped")
                continue
            row = plan_row(candidate, where, model, progress)
            row["search"] = True
            tried.append(row)
            compiles += 1
            if row["fits"]:
                return row, tried
            if compiles >= MAX_SEARCH_COMPILES:
                return None, tried
    return None, tried
