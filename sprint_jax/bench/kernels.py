"""`sprint-jax bench kernels`: the Pallas shared-prefix kernel vs XLA shared-fork vs copy-fork.

Why. SPRINT's executors (paper §10) decode together over the planner's cache; how fast one such
step runs depends on how often the shared prefix is read from HBM. Three attention paths for one
decode step of n branches over a P-token shared prefix plus an S-token suffix each:
  pallas     `sprint_jax.kernels.shared_prefix_attention` (prefix read once per query block),
  xla        the engine's jnp path: prefix attention for all branches at once + per-branch suffix
             + lse merge (`shared_prefix_attention_reference`),
  copy_fork  the prefix materialised into every branch: attention over [n, P + S] keys (the
             copy is made before timing: a copy-fork pays it once per fork, not per step).
A second table times the batched engine's decode-step attention over many parents:
G groups of 1 parent + C children, each group over its own slot of a parent cache (capacity
max prefix + 16, used lengths from P down to ~P/2 across the groups):
  grouped_pallas  `sprint_jax.kernels.grouped_prefix_attention` (all groups in one call, each
                  prefix read in place once, key blocks past a group's length skipped),
  grouped_xla     the engine's XLA path, its own code (`batch.parent_prefix_attention`): gather
                  each group's first S_b slots (S_b = the power-of-two bucket of the longest
                  length) + `attend_partial_heads` under a mask.
Both on the engine's heads-first cache [N, Hkv, S, D] (`batch.SlotCache`).
Each point reports the median time per call after warm-up (block_until_ready, time.perf_counter;
compile time excluded and reported separately), the bytes the method must read (`bytes_read` /
`copy_fork_bytes_read`) divided by that time, and the fraction of the device's HBM bandwidth
where the device is in a small table of known peaks. max|diff| vs xla checks every point.

Run on a GPU (jax[cuda12] installed, e.g. `pip install -e '.[cuda]'`; one command; the full
sweep is 28 points, a few minutes, mostly compiles):
    sprint-jax bench kernels --out bench_kernels.json
    python -m sprint_jax.bench.kernels --out bench_kernels.json      # same, without the CLI
With --dtype float32 the kernel's products are IEEE fp32 (exact) while XLA's default fp32 matmul
on recent GPUs may use TF32: compare bfloat16 (the engine's dtype) for speed.
`--quick` runs fewer points (branches 1,8,64 x prefixes 1024,16384 on an accelerator). On CPU
Pallas runs in interpret mode: `--quick` then uses tiny shapes (< 2 min) and the output is
marked "interpret-mode timings are not meaningful" (they time the Pallas interpreter).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sprint_jax.dtypes import DTYPE_NAMES, dtype_of

DESCRIPTION = __doc__

# Peak HBM bandwidth, bytes/s, matched by substring of jax's device_kind (first match wins).
PEAK_BYTES_PER_S: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),       # H200 SXM, HBM3e
    ("H100", 3.35e12),      # H100 SXM, HBM3 (the PCIe card is 2.0e12)
    ("A100", 2.0e12),       # A100 80GB SXM (the 40GB card is 1.55e12)
    ("TPU v5p", 2.76e12),
    ("TPU v5 lite", 8.1e11),  # v5e reports itself as "TPU v5 lite"
    ("TPU v5e", 8.1e11),
)

FULL = dict(branches="1,2,4,8,16,32,64", prefix_lens="256,1024,4096,16384", heads=28, kv_heads=4,
            head_dim=128, suffix_len=256, repeats=20, warmup=3, groups="4,16", children=8)
QUICK_ACCEL = dict(FULL, branches="1,8,64", prefix_lens="1024,16384", repeats=10, groups="16")
QUICK_CPU = dict(branches="1,4", prefix_lens="40,160", heads=4, kv_heads=2, head_dim=32,
                 suffix_len=8, repeats=3, warmup=1, groups="2", children=3)
METHODS = ("pallas", "xla", "copy_fork")
INTERPRET_NOTE = ("interpret-mode timings are not meaningful "
                  "(they time the Pallas interpreter on CPU)")


def add_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `sprint-jax bench kernels`; unset ones take the --quick / full defaults."""
    parser.add_argument("--quick", action="store_true",
                        help="few points; tiny shapes on CPU (interpret mode, < 2 min)")
    parser.add_argument("--out", metavar="FILE.json", help="write the results here as JSON")
    parser.add_argument("--branches",
                        help=f"comma-separated branch counts (default {FULL['branches']})")
    parser.add_argument("--prefix-lens",
                        help=f"comma-separated prefix lengths (default {FULL['prefix_lens']})")
    parser.add_argument("--suffix-len", type=int,
                        help=f"suffix rows per branch (default {FULL['suffix_len']})")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                        help="dtype of q, K, V (the engine's compute dtype)")
    parser.add_argument("--heads", type=int,
                        help=f"query heads H (default {FULL['heads']}, Qwen2-7B)")
    parser.add_argument("--kv-heads", type=int, help=f"KV heads Hkv (default {FULL['kv_heads']})")
    parser.add_argument("--head-dim", type=int, help=f"head dim D (default {FULL['head_dim']})")
    parser.add_argument("--repeats", type=int, help="timed calls per point (median reported)")
    parser.add_argument("--warmup", type=int, help="untimed calls per point after compiling")
    parser.add_argument("--groups",
                        help=f"comma-separated parent-group counts of the grouped table (default "
                             f"{FULL['groups']}; 0 skips the table)")
    parser.add_argument("--children", type=int,
                        help=f"children per parent in the grouped table (default {FULL['children']})")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")


def _user_error(message: str) -> Exception:
    from sprint_jax.errors import UserError
    return UserError(message)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _user_error(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise _user_error(f"{flag} needs at least one value and every value >= 1, got {text!r}")
    return values


def _settings(args: argparse.Namespace, on_cpu: bool) -> dict[str, Any]:
    """Flags resolved against the --quick / full defaults, validated with one-line errors."""
    base = (QUICK_CPU if on_cpu else QUICK_ACCEL) if args.quick else FULL
    s = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    s["branches"] = _int_list(str(s["branches"]), "--branches")
    s["prefix_lens"] = _int_list(str(s["prefix_lens"]), "--prefix-lens")
    s["groups"] = [] if str(s["groups"]).strip() == "0" else _int_list(str(s["groups"]), "--groups")
    if s["children"] < 0:
        raise _user_error(f"--children must be >= 0, got {s['children']}")
    for name in ("heads", "kv_heads", "head_dim", "repeats"):
        if s[name] < 1:
            raise _user_error(f"--{name.replace('_', '-')} must be >= 1, got {s[name]}")
    if s["suffix_len"] < 0 or s["warmup"] < 0:
        raise _user_error("--suffix-len and --warmup must be >= 0")
    if s["heads"] % s["kv_heads"]:
        raise _user_error(f"--heads {s['heads']} must be a multiple of --kv-heads {s['kv_heads']}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise _user_error(f"--methods: unknown {unknown or methods}; "
                          f"choose from {','.join(METHODS)}")
    s["methods"] = methods
    s["dtype"] = args.dtype
    return s


def device_peak_bytes_per_s(device_kind: str) -> float | None:
    """Known HBM peak for a jax device_kind, or None (then only bytes/s is reported)."""
    for key, peak in PEAK_BYTES_PER_S:
        if key.lower() in device_kind.lower():
            return peak
    return None


def _time(fn: Callable, args: tuple, warmup: int, repeats: int):
    """(compile seconds, median seconds per call, output): compile excluded from the timing."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return compile_s, statistics.median(times), out


def _copy_fork_attention(q, k_full, v_full, lens):
    """Copy-fork step: every branch attends over its own [P + S] copy (one `attend_partial`)."""
    from sprint_jax.model.qwen2 import attend_partial
    mask = (jnp.arange(k_full.shape[1])[None, :] < lens[:, None])[:, None, :]     # [n, 1, P+S]
    out, _ = attend_partial(q[:, None], k_full, v_full, mask)
    return out[:, 0]


def bench_point(n: int, p: int, s: dict[str, Any], interpret: bool, seed: int) -> list[dict]:
    """One point of the shared-prefix attention benchmark: n branches over a p-token shared prefix
    (shapes, dtype and suffix length from `s`), each method timed; one row per method."""
    from sprint_jax.kernels import (bytes_read, copy_fork_bytes_read, default_block_sizes,
                                    shared_prefix_attention, shared_prefix_attention_reference)
    dtype = dtype_of(s["dtype"])
    h, hkv, d, sl = s["heads"], s["kv_heads"], s["head_dim"], s["suffix_len"]
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (n, h, d), dtype)
    pk = jax.random.normal(keys[1], (p, hkv, d), dtype)
    pv = jax.random.normal(keys[2], (p, hkv, d), dtype)
    sk = jax.random.normal(keys[3], (n, sl, hkv, d), dtype)
    sv = jax.random.normal(keys[4], (n, sl, hkv, d), dtype)
    prefix_len = jnp.int32(p)
    suffix_lens = jnp.full((n,), sl, jnp.int32)
    shared_args = (q, pk, pv, prefix_len, sk, sv, suffix_lens)
    rows, outputs = [], {}
    for method in s["methods"]:
        if method == "pallas":
            fn, args = functools.partial(shared_prefix_attention, interpret=interpret), shared_args
            nbytes = bytes_read(n, p, sl, h, hkv, d, dtype)
        elif method == "xla":
            fn, args = shared_prefix_attention_reference, shared_args
            nbytes = bytes_read(n, p, sl, h, hkv, d, dtype)
        else:
            k_full = jnp.concatenate([jnp.broadcast_to(pk, (n, p, hkv, d)), sk], axis=1)
            v_full = jnp.concatenate([jnp.broadcast_to(pv, (n, p, hkv, d)), sv], axis=1)
            fn, args = _copy_fork_attention, (q, k_full, v_full, prefix_len + suffix_lens)
            nbytes = copy_fork_bytes_read(n, p, sl, h, hkv, d, dtype)
        compile_s, sec, out = _time(fn, args, s["warmup"], s["repeats"])
        outputs[method] = out.astype(jnp.float32)
        row = dict(branches=n, prefix_len=p, suffix_len=sl, method=method,
                   ms_per_call=sec * 1e3, compile_s=compile_s, bytes=nbytes,
                   bytes_per_s=nbytes / sec)
        if method == "pallas":  # the tiles used, and how often they read the prefix
            tiles = default_block_sizes("tpu" if jax.default_backend() == "tpu" else "gpu",
                                        n, h, hkv, p, sl)
            row["block_sizes"] = dataclasses.asdict(tiles)
            row["prefix_reads"] = -(-n * (h // hkv) // tiles.block_q)
        rows.append(row)
        del args
    base = outputs.get("xla")
    copy_ms = next((r["ms_per_call"] for r in rows if r["method"] == "copy_fork"), None)
    for r in rows:
        r["max_abs_diff_vs_xla"] = (None if base is None else
                                    float(jnp.max(jnp.abs(outputs[r["method"]] - base))))
        r["speedup_vs_copy_fork"] = None if copy_ms is None else copy_ms / r["ms_per_call"]
    return rows


GROUPED_METHODS = ("grouped_pallas", "grouped_xla")


def _bucket(n: int, lo: int = 64) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


def _engine_xla_prefix(q, kc, vc, rows, lens, s_b: int):
    """The engine's XLA parent-prefix attention, its own code (`programs.parent_prefix_attention`:
    gather each group's first s_b slots of the heads-first cache kc, vc [N, Hkv, S, D], seen as
    one layer)."""
    from sprint_jax.bench.slot_programs import parent_prefix_attention
    return parent_prefix_attention(kc[None], vc[None], 0, rows, q, lens, s_b)


def _bench_grouped_point(groups: int, p: int, s: dict[str, Any], interpret: bool,
                         seed: int) -> list[dict]:
    from sprint_jax.kernels import group_bytes_read, grouped_prefix_attention
    dtype = dtype_of(s["dtype"])
    h, hkv, d, w = s["heads"], s["kv_heads"], s["head_dim"], 1 + s["children"]
    cap = p + 16
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (groups, w, h, d), dtype)
    # the batched engine's slot layout, heads first: [N, Hkv, S, D] (sprint_jax.bench.slot_cache.SlotCache)
    kc = jax.random.normal(keys[1], (groups, hkv, cap, d), dtype)
    vc = jax.random.normal(keys[2], (groups, hkv, cap, d), dtype)
    glens = [max(1, p - g * p // (2 * groups)) for g in range(groups)]
    lens = jnp.asarray([[n] * w for n in glens], jnp.int32)   # children at the fork point
    rows = jnp.arange(groups, dtype=jnp.int32)[::-1]
    s_b = min(_bucket(max(glens)), cap)
    nbytes = group_bytes_read(glens, w, h, hkv, d, dtype)
    out, results = {}, []
    for method in GROUPED_METHODS:
        if method == "grouped_pallas":
            fn = lambda *a: grouped_prefix_attention(*a, interpret=interpret, heads_first=True)  # noqa: E731
        else:
            fn = functools.partial(_engine_xla_prefix, s_b=s_b)
        compile_s, sec, o = _time(fn, (q, kc, vc, rows, lens), s["warmup"], s["repeats"])
        out[method] = o[0].astype(jnp.float32)
        results.append(dict(groups=groups, children=s["children"], prefix_len=p, method=method,
                            ms_per_call=sec * 1e3, compile_s=compile_s, bytes=nbytes,
                            bytes_per_s=nbytes / sec))
    xla_ms = results[1]["ms_per_call"]
    for r in results:
        r["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(out[r["method"]] - out["grouped_xla"])))
        r["speedup_vs_xla"] = xla_ms / r["ms_per_call"]
    return results


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run_kernels_bench(args: argparse.Namespace) -> int:
    """Run the sweep, print a table (and the interpret-mode caveat on CPU), write --out JSON."""
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    s = _settings(args, on_cpu)
    interpret = on_cpu
    device_kind = jax.devices()[0].device_kind
    peak = None if on_cpu else device_peak_bytes_per_s(device_kind)
    print(f"bench kernels: {device_kind} ({backend}), dtype {s['dtype']}, H={s['heads']} "
          f"Hkv={s['kv_heads']} D={s['head_dim']} suffix={s['suffix_len']}, peak "
          f"{_fmt(peak and peak / 1e9, '.0f')} GB/s")
    if interpret:
        print(f"NOTE: {INTERPRET_NOTE}")
        if not args.quick:
            print("NOTE: the full sweep in interpret mode takes hours; use --quick on CPU")
    header = (f"{'n':>3} {'prefix':>6} {'method':>9} {'ms/call':>9} {'compile_s':>9} "
              f"{'GB/s':>8} {'%peak':>6} {'x copy':>7} {'max|diff|':>9}")
    print(header)
    print("-" * len(header))
    results = []
    for i, p in enumerate(s["prefix_lens"]):
        for j, n in enumerate(s["branches"]):
            for r in bench_point(n, p, s, interpret, seed=1000 * i + j):
                r["fraction_of_peak"] = None if peak is None else r["bytes_per_s"] / peak
                results.append(r)
                print(f"{n:>3} {p:>6} {r['method']:>9} {r['ms_per_call']:>9.3f} "
                      f"{r['compile_s']:>9.2f} {r['bytes_per_s'] / 1e9:>8.1f} "
                      f"{_fmt(r['fraction_of_peak'] and 100 * r['fraction_of_peak'], '.1f'):>6} "
                      f"{_fmt(r['speedup_vs_copy_fork'], '.2f'):>7} "
                      f"{_fmt(r['max_abs_diff_vs_xla'], '.1e'):>9}", flush=True)
    grouped = []
    if s["groups"]:
        print(f"\ngrouped decode-step prefix attention: groups of 1 parent + {s['children']} children, "
              f"each over its own parent slot (the batched engine's step)")
        header = (f"{'groups':>6} {'prefix':>6} {'method':>14} {'ms/call':>9} {'compile_s':>9} "
                  f"{'GB/s':>8} {'%peak':>6} {'x xla':>6} {'max|diff|':>9}")
        print(header)
        print("-" * len(header))
        for i, p in enumerate(s["prefix_lens"]):
            for j, g in enumerate(s["groups"]):
                for r in _bench_grouped_point(g, p, s, interpret, seed=7000 + 100 * i + j):
                    r["fraction_of_peak"] = None if peak is None else r["bytes_per_s"] / peak
                    grouped.append(r)
                    print(f"{g:>6} {p:>6} {r['method']:>14} {r['ms_per_call']:>9.3f} "
                          f"{r['compile_s']:>9.2f} {r['bytes_per_s'] / 1e9:>8.1f} "
                          f"{_fmt(r['fraction_of_peak'] and 100 * r['fraction_of_peak'], '.1f'):>6} "
                          f"{r['speedup_vs_xla']:>6.2f} {r['max_abs_diff_vs_xla']:>9.1e}", flush=True)
    report = dict(
        benchmark="kernels.shared_prefix_attention", device_kind=device_kind, backend=backend,
        jax_version=jax.__version__, interpret=interpret, timings_meaningful=not interpret,
        note=INTERPRET_NOTE if interpret else None, peak_bytes_per_s=peak,
        config={k: v for k, v in s.items()}, results=results, grouped_results=grouped)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sprint_jax.bench.kernels",
                                     description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernels_arguments(parser)
    args = parser.parse_args(argv)
    from sprint_jax.errors import UserError
    try:
        return run_kernels_bench(args)
    except UserError as e:
        print(f"bench kernels: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
