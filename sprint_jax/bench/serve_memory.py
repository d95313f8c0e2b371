"""`sprint-jax bench serve-memory`: per-device memory of the engine's decode call on a mesh.

The decode call (`sprint_jax.infer.programs.decode` over the paged KV pool: every sequence's
planner row and every fork's executors decoding at once, page tables as wide as the capacities)
is lowered and compiled from ShapeDtypeStructs carrying the engine's NamedShardings (parameters by
the trainer's rules table, the pool's pages over data like the sequence slots, KV heads over
tensor: `sharding.pool_sharding`) on fake CPU devices: nothing is allocated, so the 7B preset's
step is planned on a laptop. Printed per device: the weights and the KV pool (from the compiled
step's input shardings), XLA's argument / output / temporary bytes, and, with --hbm, the pool that
fits beside the weights and this call's temporaries (which follow the rows and the page-table
widths, not the pool's size): its pages, and the runs it holds with every run at its capacities.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

from sprint_jax.dtypes import DTYPE_NAMES

GIB = 2 ** 30


def add_serve_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="r1-distill-qwen-7b", help="model preset (default: r1-distill-qwen-7b)")
    p.add_argument("--mesh", default="tensor=4", help="mesh, e.g. tensor=4 or tensor=4,data=2 (default tensor=4)")
    p.add_argument("--max-seqs", type=int, default=8, help="sequences decoding at once (default 8)")
    p.add_argument("--max-children", type=int, default=8, help="executors per fork (default 8)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--max-branch-tokens", type=int, default=1024, help="tokens per executor (default 1024)")
    p.add_argument("--decode-chunk", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page of the KV pool (default 16)")
    p.add_argument("--pages", type=int, default=None, help="pages in the pool (default: the Engine's, every "
                   "sequence and executor at its capacity)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="parameter, compute and KV dtype")
    p.add_argument("--hbm", default=None, help="per-device HBM budget (e.g. 16GB, 80GB): print the pool that fits "
                   "beside the weights and the call's temporaries (10%% kept free)")
    p.add_argument("--out", help="write the JSON result here")


def _mesh_devices(spec: str) -> int:
    from sprint_jax.infer.sharding import parse_mesh
    sizes = parse_mesh(spec)
    if -1 in sizes.values():
        from sprint_jax.config import ConfigError
        raise ConfigError(f"--mesh {spec!r}: give every size (no -1) for a planned mesh")
    return math.prod(sizes.values())


def compile_decode_step(preset: str, mesh_spec: str, max_seqs: int, max_children: int, max_seq_len: int,
                        max_branch_tokens: int, decode_chunk: int = 16, dtype: str = "bfloat16",
                        page_size: int = 16, num_pages: int | None = None):
    """Lower + compile the engine's decode call (every sequence's planner row and every fork of
    `max_children` executors, page tables at the capacities) over a pool of `num_pages` pages
    (default the Engine's: `EngineConfig.pool_pages`) from abstract inputs on fake CPU devices.
    Returns (compiled, info, serving config, mesh)."""
    import jax
    from jax import ShapeDtypeStruct as SDS

    from sprint_jax.infer import sharding as sh
    from sprint_jax.infer.engine_config import EngineConfig
    from sprint_jax.infer.pages import KVPages
    from sprint_jax.infer.programs import DecodeRows, decode
    from sprint_jax.model.config import resolve_model_config
    from sprint_jax.model.qwen2 import abstract_params, param_count
    from sprint_jax.plan.engine import EngineShape

    n = _mesh_devices(mesh_spec)
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise SystemExit(f"only {len(cpus)} CPU devices; run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n} in a fresh process")
    cfg = resolve_model_config(preset).replace(param_dtype=dtype, dtype=dtype)
    n_params = param_count(cfg)
    mesh = sh.mesh_from_flag(mesh_spec, devices=cpus[:n])
    notes: list[str] = []
    cfg = sh.serving_config(cfg, mesh, notes)     # the heads as the engine lays them out on this mesh
    pshard = sh.param_shardings(cfg, mesh, notes)
    params = jax.tree.map(lambda a, s: SDS(a.shape, a.dtype, sharding=s), abstract_params(cfg), pshard)
    # as `Engine.__init__` places the pool: pages over data like the sequence slots, KV heads over tensor
    slots = sh.kv_sharding(cfg, mesh, max_seqs, notes, "sequence slots")
    parts = sh.slot_parts((slots,))
    engine = EngineConfig(max_seqs=max_seqs, max_children=max_children, max_seq_len=max_seq_len,
                          max_branch_tokens=max_branch_tokens, decode_chunk=decode_chunk, page_size=page_size,
                          num_pages=num_pages)
    per_seq, pages = engine.pages_per_seq, engine.pool_pages(parts)
    kv = (sh.pool_sharding(cfg, mesh, slots, pages, page_size, notes),)
    pool = jax.eval_shape(lambda: KVPages.zeros(cfg, pages, page_size))
    pool = KVPages(SDS(pool.k.shape, pool.k.dtype, sharding=kv[0]), SDS(pool.v.shape, pool.v.dtype, sharding=kv[0]))
    # the largest row set the scheduler builds: every sequence a planner row and a fork of
    # max_children executors, page tables as wide as the capacities (`plan.engine`'s widths)
    widths = EngineShape(cfg, max_seqs, max_children, max_seq_len, max_branch_tokens, decode_chunk=decode_chunk,
                         page_size=page_size).table_widths
    _, na = sh.slot_blocks(list(range(max_seqs)), max_seqs, parts)
    packed, layout = DecodeRows.empty(na, na, max_children, decode_chunk, widths["parent"], widths["shared"],
                                      widths["child"]).pack()
    rows = tuple(SDS(a.shape, a.dtype) for a in packed)
    t = time.perf_counter()
    lowered = decode.lower(params, cfg, pool, rows, layout=layout, chunk=decode_chunk, kv=kv)
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t

    # per-device bytes of weights and pool, from the shardings the compiled step takes its inputs in
    flat_params = jax.tree.leaves(params)
    flat_pool = jax.tree.leaves(pool)
    n_p, n_c = len(flat_params), len(flat_pool)
    in_shardings = jax.tree.leaves(compiled.input_shardings[0])

    def dev_bytes(arrs, shards):
        return int(sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(arrs, shards)))

    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    q_index = next(i for i, k in enumerate(paths) if "q_proj" in k and "kernel" in k)
    weights = dev_bytes(flat_params, in_shardings[:n_p])
    pool_b = dev_bytes(flat_pool, in_shardings[n_p:n_p + n_c])
    ma = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    mem = {f: int(getattr(ma, f, 0) or 0) for f in fields}
    info = {"preset": preset, "params": n_params, "dtype": dtype, "mesh": dict(mesh.shape),
            "max_seqs": max_seqs, "max_children": max_children, "max_seq_len": max_seq_len,
            "max_branch_tokens": max_branch_tokens, "decode_chunk": decode_chunk, "page_size": page_size,
            "num_pages": pages, "page_shards": parts, "pages_per_sequence": per_seq, "table_widths": widths,
            "lower_s": lower_s, "compile_s": compile_s,
            "per_device_weight_bytes": weights, "per_device_pool_bytes": pool_b, "per_device": mem,
            "per_device_peak_bytes": mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
            - mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"],
            "in_specs": {"q_proj": str(in_shardings[q_index].spec), "pool": str(in_shardings[n_p].spec)},
            "sharding_notes": list(dict.fromkeys(notes))}
    return compiled, info, cfg, mesh


def plan_pool(info: dict, hbm_bytes: int, reserve: float = 0.1) -> dict:
    """The pool that fits `hbm_bytes` per device beside the weights and the decode call's
    temporaries (`info` from `compile_decode_step`; the temporaries follow the rows and the
    page-table widths, not the pool's size), keeping `reserve` free: pages (a multiple of the page
    shards) and the sequences it holds at their capacities (`EngineConfig.pages_per_seq` each)."""
    mem = info["per_device"]
    page_bytes = info["per_device_pool_bytes"] / (info["num_pages"] / info["page_shards"])   # one shard's page
    free = int(hbm_bytes * (1 - reserve)) - info["per_device_weight_bytes"] - mem["temp_size_in_bytes"]
    local = max(0, int(free // page_bytes))
    pages = local * info["page_shards"]
    return {"budget_bytes": hbm_bytes, "pages": pages, "pool_bytes": local * page_bytes,
            "sequences_at_capacity": pages // info["pages_per_sequence"] // info["page_shards"] * info["page_shards"],
            "weight_bytes": info["per_device_weight_bytes"], "temp_bytes": mem["temp_size_in_bytes"]}


def run_serve_memory_bench(args: argparse.Namespace) -> int:
    n = _mesh_devices(args.mesh)
    flag = f"--xla_force_host_platform_device_count={max(n, 8)}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    from sprint_jax.config import ConfigError
    from sprint_jax.model.hf import parse_size

    for name in ("max_seqs", "max_children", "max_seq_len", "max_branch_tokens", "decode_chunk", "page_size",
                 "pages"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    budget = parse_size(args.hbm) if args.hbm else None
    _, info, cfg, mesh = compile_decode_step(args.preset, args.mesh, args.max_seqs, args.max_children,
                                             args.max_seq_len, args.max_branch_tokens, args.decode_chunk,
                                             args.dtype, args.page_size, args.pages)
    print(f"serve decode call memory: {args.preset} ({info['params'] / 1e9:.2f}B params, {args.dtype}), "
          f"mesh {info['mesh']}, {args.max_seqs} sequences of {args.max_seq_len} tokens, forks of "
          f"{args.max_children} executors of {args.max_branch_tokens}, chunk {args.decode_chunk}; a pool of "
          f"{info['num_pages']:,} pages of {args.page_size} tokens ({info['pages_per_sequence']} a sequence at its "
          f"capacities) over {info['page_shards']} page shard(s)")
    print(f"lowered in {info['lower_s']:.1f} s, compiled in {info['compile_s']:.1f} s "
          f"(XLA CPU; a GPU/TPU compile plans temporaries differently)")
    print(f"  {'weights':<28}{info['per_device_weight_bytes'] / GIB:>10.2f} GiB per device")
    print(f"  {'KV pool':<28}{info['per_device_pool_bytes'] / GIB:>10.2f} GiB per device")
    for f, v in info["per_device"].items():
        print(f"  {f.replace('_in_bytes', ''):<28}{v / GIB:>10.2f} GiB per device")
    print(f"  {'peak (args + out - alias + temp)':<28}{info['per_device_peak_bytes'] / GIB:>10.2f} GiB per device")
    for note in info["sharding_notes"]:
        print(f"  note: {note}")
    if budget:
        plan = plan_pool(info, budget)
        info["plan"] = plan
        print(f"plan for {budget / GIB:.1f} GiB per device (10% kept free): weights {plan['weight_bytes'] / GIB:.2f} "
              f"GiB + this call's temporaries {plan['temp_bytes'] / GIB:.2f} GiB + a pool of {plan['pages']:,} pages "
              f"({plan['pool_bytes'] / GIB:.2f} GiB per device): {plan['sequences_at_capacity']} sequences with "
              f"every one and its executors at their capacities (more when runs are shorter: "
              f"sprint-jax plan engine --lengths)")
    print(json.dumps(info))
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=2))
    return 0
