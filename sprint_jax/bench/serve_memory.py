"""`sprint-jax bench serve-memory`: per-device memory of the batched engine's decode step on a mesh.

The decode step (`sprint_jax.infer.programs.decode`: every parent and child slot decoding at once,
attention over the full capacity) is lowered and compiled from ShapeDtypeStructs carrying the
engine's NamedShardings (parameters by the trainer's rules table, KV slots over data / KV heads
over tensor) on fake CPU devices: nothing is allocated, so the 7B preset's step is planned on a
laptop. Printed per device: the weights and the KV cache (from the compiled step's input
shardings), XLA's argument / output / temporary bytes, and, with --hbm, the memory planner's
answer (`sprint_jax.infer.sharding.plan_slots`): how many parent slots of this capacity fit, with
the temporaries split into a fixed part and a part per slot by a second compile with half the slots.
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
    p.add_argument("--max-seqs", type=int, default=8, help="parent slots (default 8)")
    p.add_argument("--max-children", type=int, default=8, help="child slots per parent (default 8)")
    p.add_argument("--max-seq-len", type=int, default=4096, help="tokens per parent slot (default 4096)")
    p.add_argument("--max-branch-tokens", type=int, default=1024, help="tokens per child slot (default 1024)")
    p.add_argument("--decode-chunk", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="parameter, compute and KV dtype")
    p.add_argument("--hbm", default=None, help="per-device HBM budget (e.g. 16GB, 80GB): print the slot plan "
                   "(compiles the step a second time with half the slots to split the temporaries)")
    p.add_argument("--out", help="write the JSON result here")


def _mesh_devices(spec: str) -> int:
    from sprint_jax.infer.sharding import parse_mesh
    sizes = parse_mesh(spec)
    if -1 in sizes.values():
        from sprint_jax.config import ConfigError
        raise ConfigError(f"--mesh {spec!r}: give every size (no -1) for a planned mesh")
    return math.prod(sizes.values())


def compile_decode_step(preset: str, mesh_spec: str, max_seqs: int, max_children: int, max_seq_len: int,
                        max_branch_tokens: int, decode_chunk: int = 16, dtype: str = "bfloat16"):
    """Lower + compile the batched decode step (all rows, full capacity) from abstract inputs on
    fake CPU devices. Returns (compiled, info dict)."""
    import jax
    import jax.numpy as jnp
    from jax import ShapeDtypeStruct as SDS

    from sprint_jax.infer import sharding as sh
    from sprint_jax.infer.programs import DecodeRows, decode
    from sprint_jax.infer.slot_cache import SlotCache
    from sprint_jax.model.config import resolve_model_config
    from sprint_jax.model.qwen2 import abstract_params, param_count

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
    pc, cc = max_seq_len + decode_chunk, max_branch_tokens + decode_chunk
    kvp = sh.kv_sharding(cfg, mesh, max_seqs, notes, "parent slots")
    kvc = sh.kv_sharding(cfg, mesh, max_seqs * max_children, notes, "child slots")
    kv_dt = jnp.dtype(cfg.dtype)
    hkv, d = cfg.num_key_value_heads, cfg.head_dim          # the SlotCache layout [L, N, Hkv, S, D]
    p_shape = (cfg.num_hidden_layers, max_seqs, hkv, pc, d)
    c_shape = (cfg.num_hidden_layers, max_seqs * max_children, hkv, cc, d)
    cache = SlotCache(SDS(p_shape, kv_dt, sharding=kvp), SDS(p_shape, kv_dt, sharding=kvp),
                      SDS(c_shape, kv_dt, sharding=kvc), SDS(c_shape, kv_dt, sharding=kvc))
    # the largest row set the scheduler can build: every bucket full (generate rows and fork groups)
    na, nf, w = max_seqs, max_seqs, max_children
    # the per-row arrays as the engine builds them, abstract
    packed, layout = DecodeRows.empty(na, nf, w, decode_chunk, 0, 0).pack()
    rows = tuple(SDS(a.shape, a.dtype) for a in packed)
    t = time.perf_counter()
    lowered = decode.lower(params, cfg, cache, rows, layout=layout, chunk=decode_chunk, s_b=pc, c_b=cc,
                           kv=(kvp, kvc))
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t

    # per-device bytes of weights and cache, from the shardings the compiled step takes its inputs in
    flat_params = jax.tree.leaves(params)
    flat_cache = jax.tree.leaves(cache)
    n_p, n_c = len(flat_params), len(flat_cache)
    in_shardings = jax.tree.leaves(compiled.input_shardings[0])

    def dev_bytes(arrs, shards):
        return int(sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(arrs, shards)))

    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    q_index = next(i for i, k in enumerate(paths) if "q_proj" in k and "kernel" in k)
    weights = dev_bytes(flat_params, in_shardings[:n_p])
    cache_b = dev_bytes(flat_cache, in_shardings[n_p:n_p + n_c])
    ma = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    mem = {f: int(getattr(ma, f, 0) or 0) for f in fields}
    info = {"preset": preset, "params": n_params, "dtype": dtype, "mesh": dict(mesh.shape),
            "max_seqs": max_seqs, "max_children": max_children, "parent_capacity": pc, "child_capacity": cc,
            "decode_chunk": decode_chunk, "lower_s": lower_s, "compile_s": compile_s,
            "per_device_weight_bytes": weights, "per_device_cache_bytes": cache_b, "per_device": mem,
            "per_device_peak_bytes": mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
            - mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"],
            "in_specs": {"q_proj": str(in_shardings[q_index].spec), "parent_kv": str(in_shardings[n_p].spec), "child_kv": str(in_shardings[n_p + 2].spec)},
            "sharding_notes": list(dict.fromkeys(notes))}
    return compiled, info, cfg, mesh


def split_temp(small: dict, large: dict) -> tuple[int, int]:
    """(fixed, per parent slot held on a device) parts of the step's temporaries, from two compiles
    that differ only in the slots: what does not grow with the slots (on XLA CPU mostly an f32 copy
    of the bf16 weights: it has no bf16 dot) is counted once by the planner, not per slot."""
    per_dev = lambda i: i["max_seqs"] // (i["mesh"]["data"] * i["mesh"]["fsdp"])   # noqa: E731
    t_s, t_l = small["per_device"]["temp_size_in_bytes"], large["per_device"]["temp_size_in_bytes"]
    per_slot = max(0, t_l - t_s) // max(1, per_dev(large) - per_dev(small))
    return max(0, t_l - per_slot * per_dev(large)), per_slot


def run_serve_memory_bench(args: argparse.Namespace) -> int:
    n = _mesh_devices(args.mesh)
    flag = f"--xla_force_host_platform_device_count={max(n, 8)}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    from sprint_jax.config import ConfigError
    from sprint_jax.infer.sharding import parse_mesh, plan_slots
    from sprint_jax.model.hf import parse_size

    sizes = parse_mesh(args.mesh)
    parts = sizes["data"] * sizes["fsdp"]          # the slots split over these
    if args.hbm and args.max_seqs // 2 < parts:
        raise ConfigError(f"--hbm needs --max-seqs >= {2 * parts} on mesh {args.mesh} (a second compile "
                          f"with half the slots splits the temporaries)")

    _, info, cfg, mesh = compile_decode_step(args.preset, args.mesh, args.max_seqs, args.max_children,
                                             args.max_seq_len, args.max_branch_tokens, args.decode_chunk,
                                             args.dtype)
    print(f"serve decode step memory: {args.preset} ({info['params'] / 1e9:.2f}B params, {args.dtype}), "
          f"mesh {info['mesh']}, {args.max_seqs} parent slots x {info['parent_capacity']} tokens, "
          f"{args.max_children} children each x {info['child_capacity']} tokens, chunk {args.decode_chunk}")
    print(f"lowered in {info['lower_s']:.1f} s, compiled in {info['compile_s']:.1f} s "
          f"(XLA CPU; a GPU/TPU compile plans temporaries differently)")
    print(f"  {'weights':<28}{info['per_device_weight_bytes'] / GIB:>10.2f} GiB per device")
    print(f"  {'KV cache (parents+children)':<28}{info['per_device_cache_bytes'] / GIB:>10.2f} GiB per device")
    for f, v in info["per_device"].items():
        print(f"  {f.replace('_in_bytes', ''):<28}{v / GIB:>10.2f} GiB per device")
    print(f"  {'peak (args + out - alias + temp)':<28}{info['per_device_peak_bytes'] / GIB:>10.2f} GiB per device")
    for note in info["sharding_notes"]:
        print(f"  note: {note}")
    if args.hbm:
        budget = parse_size(args.hbm)
        # the step's temporaries split into a fixed part and a part per parent slot held on a device,
        # from a second compile with half the slots
        half = args.max_seqs // 2 // parts * parts
        _, small, _, _ = compile_decode_step(args.preset, args.mesh, half, args.max_children, args.max_seq_len,
                                             args.max_branch_tokens, args.decode_chunk, args.dtype)
        temp_fixed, temp_per_slot = split_temp(small, info)
        info["temp_fixed_bytes"], info["temp_per_slot_bytes"] = temp_fixed, temp_per_slot
        plan = plan_slots(cfg, mesh, budget, args.max_children, args.max_seq_len, args.max_branch_tokens,
                          args.decode_chunk, temp_bytes_per_slot=temp_per_slot, temp_fixed_bytes=temp_fixed)
        info["plan"] = plan.to_json()
        print(f"plan for {budget / GIB:.1f} GiB per device (10% kept free; step temporaries "
              f"{temp_fixed / GIB:.2f} GiB + {temp_per_slot / GIB:.2f} GiB per slot, measured by compiles "
              f"with {half} and {args.max_seqs} slots): {plan.max_seqs} parent "
              f"slots x {plan.parent_capacity} tokens, {plan.max_children} children each x "
              f"{plan.child_capacity} tokens; weights {plan.weight_bytes / GIB:.2f} GiB + cache "
              f"{plan.cache_bytes / GIB:.2f} GiB per device")
    print(json.dumps(info))
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=2))
    return 0
