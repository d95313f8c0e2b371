"""Compile the train step for TPU chips or NVIDIA GPUs that are not here.

libtpu builds compile-only devices for a named slice, and jax's CUDA plugin for GPU nodes from a
target config (`chips.target_config`), both through `jax.experimental.topologies`; the step is
traced from ShapeDtypeStructs (nothing allocated), lowered for the "tpu" or "cuda" platform on a
mesh of those devices, and compiled by XLA's TPU or GPU compiler (Triton included), whose
`memory_analysis()` is what one chip would hold. The process itself runs with JAX_PLATFORMS=cpu:
the attention dispatch (`model.attention.resolve_impl`) would pick its CPU body, so while tracing
it is told the backend is "tpu" (splash for the flat layout, our Mosaic kernel for trie and
merge, as the trainer on a TPU runs them) or "gpu" (our Triton kernels, their block sizes chosen
for the target's shared memory), and each Pallas call's name, block sizes and shapes are recorded
so that a kernel that fails to lower or compile is named with them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable

from sprint_jax.errors import UserError
from sprint_jax.plan.chips import Slice, parse_slice, target_config
from sprint_jax.plan.estimate import StepShape

# Names of the Mosaic kernels in the compiled HLO (the pallas_call names, in op_name metadata).
KERNEL_NAME = re.compile(r"(flash_span_(?:fwd|dq|dkdv)|splash_mha_\w+?|grouped_prefix_attention|"
                         r"grouped_paged_prefix_attention|shared_prefix_ragged_attention)(?:[\"_)/.]|$)")


@functools.lru_cache(maxsize=None)
def slice_devices(name: str) -> tuple:
    """The compile-only devices of a topology name (cached per process): a libtpu name, or GPU nodes
    (`h100:8`, `h100:2x8`). libtpu and the CUDA plugin write start-up warnings about the missing
    hardware to the process's stderr; they are held back and shown only in the error if the
    topology cannot be made."""
    where = parse_slice(name)
    if where.platform == "gpu":
        return _gpu_devices(where)
    # libtpu takes a host-wide lock for the TPU chips it would drive; a compile-only topology
    # drives none, and without this a second planning process (or test run) is refused
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies
    except ImportError as e:   # pragma: no cover - jax is a dependency
        raise UserError(f"jax.experimental.topologies is missing: {e}") from None
    with _quiet_stderr() as held:
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
        except Exception as e:  # noqa: BLE001 - libtpu missing or the name refused: one line
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "libtpu" in text.lower() or "no such" in text.lower() or "not found" in text.lower():
                from sprint_jax import install_command
                raise UserError(f"cannot make TPU topology {name}: {text}; install libtpu: "
                                f"{install_command('tpu')}") from None
            raise UserError(f"cannot make TPU topology {name}: {text}") from None
    del held
    return tuple(topo.devices)


def _gpu_devices(where: Slice) -> tuple:
    """Compile-only CUDA devices for GPU nodes, from the GPU's target config."""
    if not cuda_plugin_available():
        raise UserError(f"planning {where.name} compiles with XLA's GPU compiler, which comes with jax's CUDA "
                        f"plugin: pip install 'jax-cuda12-plugin==<the jax version>' (no GPU or CUDA needed)")
    from jax.experimental import topologies
    with _quiet_stderr():
        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(where.chip),
                                                topology=where.topology)
        except Exception as e:  # noqa: BLE001 - the plugin refused: one line
            raise UserError(f"cannot make GPU topology {where.name}: {_first_line(e)}") from None
    return tuple(topo.devices)


def cuda_plugin_available() -> bool:
    """jax's CUDA PJRT plugin is installed (the GPU compiler that compile-only GPU topologies need)."""
    import importlib.util
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):   # no jax_plugins package at all: find_spec of a submodule raises
        return False


def compiler_available(slices) -> None:
    """Raise UserError naming the package to install when a slice's compiler is missing."""
    if any(s.platform == "tpu" for s in slices) and not libtpu_available():
        from sprint_jax import install_command
        raise UserError("plan compiles for TPUs with XLA's TPU compiler, which comes with libtpu: "
                        f"{install_command('tpu')}")
    if any(s.platform == "gpu" for s in slices) and not cuda_plugin_available():
        from importlib.metadata import version
        raise UserError("plan compiles for GPUs with XLA's GPU compiler, which comes with jax's CUDA plugin: "
                        f"pip install 'jax-cuda12-plugin=={version('jax')}' (no GPU, driver or CUDA needed)")


def libtpu_available() -> bool:
    """libtpu is installed (the TPU compiler that compile-only topologies need)."""
    import importlib.util
    return importlib.util.find_spec("libtpu") is not None


@contextlib.contextmanager
def _quiet_stderr():
    """Redirect file descriptor 2 to a temporary file for the block (C++ logging bypasses
    sys.stderr); yields the file, restored afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield held
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@dataclasses.dataclass
class KernelCall:
    """One Pallas call traced into the step: its kernel, block sizes and operand shapes."""
    kernel: str
    blocks: str
    shapes: str

    def describe(self) -> str:
        return f"{self.kernel} ({self.blocks}; {self.shapes})"


@contextlib.contextmanager
def tpu_attention(calls: list[KernelCall], where: Slice | None = None):
    """While tracing: attention resolves its body as on the target's backend ("tpu" unless `where`
    is GPU nodes: "gpu", with the Triton kernels' block sizes chosen for that GPU's shared memory),
    and every Pallas attention call is appended to `calls` (kernel, blocks, shapes of one shard)."""
    from sprint_jax.kernels import flash_attention as kernel
    from sprint_jax.kernels import gpu_target, splash
    from sprint_jax.model import attention

    target = "gpu" if where is not None and where.platform == "gpu" else "tpu"
    resolve, fwd, bwd, spl = (attention.resolve_impl, kernel.flash_forward, kernel.flash_backward,
                              splash.splash_attention)

    def shapes(q, k, extra=""):
        return f"q {list(q.shape)} {q.dtype}, k/v {list(k.shape)}{extra}"

    def resolve_target(impl, layout=None, *, splash_ok=True, backend=None):
        return resolve(impl, layout, splash_ok=splash_ok, backend=target)

    def record_fwd(q, k, v, span_end, q_offset, tags=None, **kw):
        calls.append(KernelCall("flash_span_fwd", f"block_q={kw.get('block_q')}, block_k={kw.get('block_k')}",
                                shapes(q, k, "" if tags is None else ", merge tags")))
        return fwd(q, k, v, span_end, q_offset, tags, **kw)

    def record_bwd(q, k, v, span_end, q_offset, tags, *rest, **kw):
        calls.append(KernelCall("flash_span_dq/flash_span_dkdv",
                                f"block_q={kw.get('block_q')}, block_k={kw.get('block_k')}",
                                shapes(q, k, "" if tags is None else ", merge tags")))
        return bwd(q, k, v, span_end, q_offset, tags, *rest, **kw)

    def record_splash(q, k, v, span_end, *, block=None, interpret=False):
        calls.append(KernelCall("splash_mha", f"block={block or splash.splash_block(q.shape[1])}",
                                shapes(q, k)))
        return spl(q, k, v, span_end, block=block, interpret=interpret)

    attention.resolve_impl, kernel.flash_forward, kernel.flash_backward = resolve_target, record_fwd, record_bwd
    splash.splash_attention = record_splash
    cc = where.chip.compute_capability if target == "gpu" else None
    try:
        with gpu_target.target(cc):
            yield calls
    finally:
        attention.resolve_impl, kernel.flash_forward, kernel.flash_backward = resolve, fwd, bwd
        splash.splash_attention = spl


@contextlib.contextmanager
def as_tpu(calls: list[KernelCall], where: Slice | None = None):
    """While tracing an engine program: the process reads as the target's backend ("tpu", or "gpu"
    for GPU nodes) to every body that asks `jax.default_backend()` (attention dispatch, the slot
    cache's gathers, the Pallas parent-prefix kernel), and each parent-prefix kernel call is
    appended to `calls`."""
    import jax

    from sprint_jax.kernels import parent_prefix

    platform = "gpu" if where is not None and where.platform == "gpu" else "tpu"
    backend, grouped = jax.default_backend, parent_prefix.grouped_prefix_attention

    def record(q, k_cache, v_cache, kv_rows, lens, **kw):
        g, w, h, d = q.shape
        heads_first = kw.get("heads_first", False)
        hkv = k_cache.shape[1] if heads_first else k_cache.shape[2]
        s = k_cache.shape[2] if heads_first else k_cache.shape[1]
        sizes = parent_prefix.default_group_block_sizes(kw.get("platform") or platform, g, w, h, hkv, s,
                                                        dtype=q.dtype, head_dim=d)
        if not kw.get("interpret"):
            calls.append(KernelCall("grouped_prefix_attention", f"block_q={sizes.block_q}, block_k={sizes.block_k}",
                                    f"q {list(q.shape)} {q.dtype}, k/v {list(k_cache.shape)}"))
        return grouped(q, k_cache, v_cache, kv_rows, lens, **kw)

    jax.default_backend, parent_prefix.grouped_prefix_attention = (lambda: platform), record
    try:
        with tpu_attention(calls, where):
            yield calls
    finally:
        jax.default_backend, parent_prefix.grouped_prefix_attention = backend, grouped


@dataclasses.dataclass
class Compiled:
    """What compiling one step for one slice gave."""
    compiled: bool
    compile_s: float = 0.0
    lower_s: float = 0.0
    memory: dict[str, int] | None = None         # arguments, outputs, temp, alias, total (per chip)
    kernels: list[str] = dataclasses.field(default_factory=list)   # Mosaic kernels in the HLO
    custom_calls: int = 0                        # tpu_custom_call instructions in the HLO
    error: str | None = None                     # why it did not compile (one line)
    oom: dict[str, float] | None = None          # the compiler's memory verdict: used, limit, over
    sharding_notes: list[str] = dataclasses.field(default_factory=list)


_BYTES = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _size(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([KMGT]?)i?B?", text.strip())
    return float(m.group(1)) * _BYTES[m.group(2)] if m else float("nan")


def parse_oom(message: str) -> dict[str, float] | None:
    """The TPU compiler's out-of-memory verdict, or None if `message` is not one. Two forms:
    "Used 113.20G of 95.74G hbm. Exceeded hbm capacity by 17.46G." -> {'used', 'limit', 'over'}
    (everything the program holds), and "the total memory required for HLO temporaries (23.13G)
    exceeds available HBM (15.75G)" -> {'temp', 'limit'} (temporaries alone). Bytes; NaN where
    the message gave no figure."""
    m = re.search(r"Used\s+([\d.]+\s*[KMGT]?i?B?)\s+of\s+([\d.]+\s*[KMGT]?i?B?)\s+hbm", message)
    if m:
        used, limit = _size(m.group(1)), _size(m.group(2))
        o = re.search(r"Exceeded hbm capacity by\s+([\d.]+\s*[KMGT]?i?B?)", message)
        return {"used": used, "limit": limit, "over": _size(o.group(1)) if o else used - limit}
    m = re.search(r"temporaries\s*\(([\d.]+\s*[KMGT]?i?B?)\)\s*exceeds available HBM\s*\(([\d.]+\s*[KMGT]?i?B?)\)",
                  message)
    if m:
        return {"temp": _size(m.group(1)), "limit": _size(m.group(2))}
    if "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message:
        return {"used": float("nan"), "limit": float("nan"), "over": float("nan")}
    return None


def _first_line(e: BaseException) -> str:
    """The error's first line; with the next one when the first only announces it ("... errors:")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else type(e).__name__


def kernel_error(e: BaseException, calls: list[KernelCall]) -> str | None:
    """A one-line description of a Pallas / Mosaic failure naming the kernel, its blocks and
    shapes; None if `e` is not one."""
    import traceback

    text = str(e) + "".join(traceback.format_exception(e))
    mosaic = any(w in text for w in ("Mosaic", "mosaic", "pallas", "Pallas", "tpu_custom_call",
                                     "flash_span_", "splash", "Triton", "triton", "Shared memory size limit"))
    if not mosaic:
        return None
    named = KERNEL_NAME.search(str(e))
    call = None
    if named:
        base = named.group(1).split("_fwd")[0] if named.group(1).startswith("splash") else named.group(1)
        call = next((c for c in reversed(calls) if base.split("/")[0] in c.kernel or
                     c.kernel.startswith(base[:10])), None)
    call = call or (calls[-1] if calls else None)
    what = call.describe() if call else (named.group(1) if named else "a Pallas kernel")
    kind = "Triton" if any(w in text for w in ("Triton", "triton", "Shared memory")) else "Mosaic"
    return f"{kind} kernel {what} failed to lower: {_first_line(e)}"


def shared_memory_error(e: BaseException, calls: list[KernelCall]) -> str | None:
    """One line for Triton's refusal of a kernel whose tiles exceed the GPU's shared memory (XLA
    reports it as RESOURCE_EXHAUSTED without naming the kernel: the step's Pallas calls are listed),
    None for any other error."""
    m = re.search(r"Shared memory size limit exceeded: requested (\d+), available: (\d+)", str(e))
    if not m:
        return None
    seen = list(dict.fromkeys(c.describe() for c in calls))
    return (f"a Triton kernel asks {int(m.group(1)):,} bytes of shared memory per block, the GPU has "
            f"{int(m.group(2)):,}; the step's kernels: {'; '.join(seen) or 'none recorded'}")


def memory_of(compiled) -> dict[str, int]:
    """Per-chip bytes from XLA's memory analysis; total = arguments + outputs - alias + temp."""
    ma = compiled.memory_analysis()
    get = lambda f: int(getattr(ma, f, 0) or 0)  # noqa: E731
    mem = {"arguments": get("argument_size_in_bytes"), "outputs": get("output_size_in_bytes"),
           "temp": get("temp_size_in_bytes"), "alias": get("alias_size_in_bytes"),
           "generated_code": get("generated_code_size_in_bytes")}
    mem["total"] = mem["arguments"] + mem["outputs"] - mem["alias"] + mem["temp"]
    return mem


_RESULTS: dict[tuple[StepShape, Slice], Compiled] = {}


def compile_step(shape: StepShape, where: Slice, progress: Callable[[str], None] | None = None) -> Compiled:
    """Trace, lower and compile the train step of `shape` for the slice `where` (its mesh from
    `shape.mesh`, which must use all the slice's chips). Never raises for a step the compiler
    refuses: the result says why. A (step, slice) compiled before in this process is not
    compiled again (a search and the rows it reports share compiles)."""
    key = (shape, where)
    if key not in _RESULTS:
        _RESULTS[key] = _compile_step(shape, where, progress)
    elif progress:
        progress("compiled before in this process: its result reused")
    return _RESULTS[key]


def _compile_step(shape: StepShape, where: Slice, progress: Callable[[str], None] | None) -> Compiled:
    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    devices = slice_devices(where.name)
    data, fsdp, tensor = shape.mesh
    if data * fsdp * tensor != len(devices):
        raise UserError(f"mesh data={data}, fsdp={fsdp}, tensor={tensor} uses {data * fsdp * tensor} "
                        f"chips but {where.name} has {len(devices)}")
    mesh = make_mesh(data, fsdp, tensor, devices=devices)
    cfg = shape.config
    opt = OptimSection(lr=1e-5, batch_size=shape.batch, grad_accum=shape.grad_accum)
    setup = step_lib.build_step(cfg, opt, 1000, mesh, shape.remat, shape.loss_chunk, "flash",
                                layout=shape.layout, attention_layout=shape.layout)
    calls: list[KernelCall] = []

    def trace():
        with tpu_attention(calls, where):
            return setup.step.trace(setup.abstract_state(), setup.abstract_batch(shape.batch, shape.seq_len))
    return compile_traced(trace, calls, setup.sharding_notes, progress, where)


# The custom call a Pallas kernel compiles to, per platform (Mosaic on TPU, Triton on GPU).
_KERNEL_TARGET = {"tpu": 'custom_call_target="tpu_custom_call"', "gpu": 'custom_call_target="__gpu$xla.gpu.triton"'}


def compile_traced(trace: Callable[[], Any], calls: list[KernelCall], notes: list[str] = (),
                   progress: Callable[[str], None] | None = None, where: Slice | None = None) -> Compiled:
    """Trace (`trace()` returns a `jax.stages.Traced`; it appends its Pallas calls to `calls`),
    lower for the target's platform ("tpu", or "cuda" for GPU nodes `where`) and compile; the
    result holds the compiler's per-chip memory and the Pallas kernels of the compiled HLO, or why
    it did not compile (never raises for that)."""
    import jax

    gpu = where is not None and where.platform == "gpu"
    out = Compiled(False, sharding_notes=list(notes))
    t = time.perf_counter()
    try:
        traced = trace()
        lowered = traced.lower(lowering_platforms=("cuda" if gpu else "tpu",))
    except Exception as e:  # noqa: BLE001 - a refused program is a result, not a crash
        out.lower_s = time.perf_counter() - t
        out.error = kernel_error(e, calls) or f"lowering failed: {_first_line(e)}"
        return out
    out.lower_s = time.perf_counter() - t
    if progress:
        progress(f"lowered in {out.lower_s:.1f} s; compiling (XLA's {'GPU' if gpu else 'TPU'} compiler: "
                 f"minutes for a 7B program)")
    t = time.perf_counter()
    log = ""
    try:
        with _quiet_stderr() as held:
            try:
                compiled = lowered.compile()
            finally:
                held.seek(0)
                log = held.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001
        out.compile_s = time.perf_counter() - t
        smem = shared_memory_error(e, calls)
        out.oom = None if smem else parse_oom(str(e))
        if smem:
            out.error = smem
        elif out.oom is not None:
            out.error = "out of memory: " + _first_line(e)
        else:
            out.error = kernel_error(e, calls) or f"compile failed: {_first_line(e)}"
            hint = _log_hint(log)
            if hint:
                out.error += f" ({hint})"
        return out
    out.compile_s = time.perf_counter() - t
    out.compiled = True
    out.memory = memory_of(compiled)
    hlo = compiled.as_text()
    target = _KERNEL_TARGET["gpu" if gpu else "tpu"]
    custom = [ln for ln in hlo.splitlines() if target in ln]
    out.custom_calls = len(custom)
    names = []
    for ln in custom:
        m = re.search(r'op_name="([^"]*)"', ln)
        k = KERNEL_NAME.search(m.group(1) if m else ln)
        names.append(k.group(1) if k else "unnamed")
    out.kernels = names
    del compiled, lowered, traced
    jax.clear_caches()
    return out


def _log_hint(log: str) -> str:
    """The last error line libtpu logged while compiling, if any."""
    lines = [ln for ln in log.splitlines() if ln.startswith(("E", "F")) and "]" in ln]
    return lines[-1].split("]", 1)[1].strip()[:300] if lines else ""


def kernel_names(result: Compiled) -> list[str]:
    """The distinct Mosaic kernels of a compiled step, sorted."""
    return sorted(set(result.kernels))


def as_dict(result: Compiled) -> dict[str, Any]:
    return dataclasses.asdict(result)
