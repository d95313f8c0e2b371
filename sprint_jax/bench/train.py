"""Training benchmarks: our sharded train step vs an HF PyTorch step, and the 7B step's memory.

`sprint-jax bench train`: tokens/s and step time of `train.step` for a small Qwen2 / Qwen3 on the
local devices, side by side with transformers' `Qwen2ForCausalLM` / `Qwen3ForCausalLM` +
`torch.optim.AdamW` on the same config, the same weights and the same batch, in one run (DESIGN.md
performance contract: ratios in one run, never timed tests). The first-step losses of both are printed too: an independent
check of our loss. On GPU/TPU the MFU of our step is reported against a peak-FLOPs table.

`sprint-jax bench train-memory`: the 7B preset's train step lowered and compiled from
ShapeDtypeStructs (nothing allocated) on a fake 8-device CPU mesh; prints the per-device memory
XLA plans for it (`compiled.memory_analysis()`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sprint_jax.dtypes import DTYPE_NAMES

# Dense bf16 peak FLOP/s per device (vendor datasheets), matched by substring of device_kind.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
    "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
}


def peak_flops(device_kind: str) -> float | None:
    for key, value in PEAK_FLOPS.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def train_flops_per_step(config, batch: int, seq_len: int) -> float:
    """6 x matmul params x tokens + causal attention (QK and PV: 6 x B x T^2 x H x D per layer)."""
    c = config
    attn = c.hidden_size * c.head_dim * (c.num_attention_heads * 2 + c.num_key_value_heads * 2)
    mlp = 3 * c.hidden_size * c.intermediate_size
    matmul_params = c.num_hidden_layers * (attn + mlp) + c.hidden_size * c.vocab_size
    tokens = batch * seq_len
    return 6.0 * matmul_params * tokens + 6.0 * c.num_hidden_layers * batch * seq_len ** 2 * \
        c.num_attention_heads * c.head_dim


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="model preset / HF config path (default: tiny)")
    p.add_argument("--hidden", type=int, help="override hidden_size (and intermediate = 8/3 x hidden)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers")
    p.add_argument("--heads", type=int, help="override num_attention_heads (kv heads = heads / 3 if divisible)")
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per row")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after one warm-up step)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--dtype", choices=("auto",) + DTYPE_NAMES, default="auto",
                   help="compute dtype; parameters stay float32 master weights, as in training "
                        "(auto: float32 on CPU, bfloat16 on accelerators)")
    p.add_argument("--remat", choices=("none", "full", "dots"), default="none")
    p.add_argument("--no-torch", action="store_true", help="skip the HF PyTorch step")
    p.add_argument("--out", help="write the JSON result here")


def _jax_bench(cfg, batch_np, steps: int, remat: str, lr: float):
    import jax

    from sprint_jax.train import mesh as mesh_lib
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    b = batch_np["tokens"].shape[0]
    mesh = mesh_lib.make_mesh(1, -1, 1)
    if b % mesh_lib.batch_divisor(mesh):
        raise SystemExit(f"--batch {b} must be a multiple of the device count {mesh_lib.batch_divisor(mesh)}")
    opt = OptimSection(lr=lr, warmup_steps=0, min_lr_ratio=1.0, clip_norm=0.0, batch_size=b, b2=0.999)
    setup = step_lib.build_step(cfg, opt, steps + 1, mesh, remat)
    state = setup.init_state(0)
    params0 = jax.tree.map(lambda x: jax.device_get(x), state["params"])
    batch = {k: jax.device_put(v, setup.batch_shardings[k]) for k, v in batch_np.items()}
    t = time.perf_counter()
    state, m = setup.step(state, batch)
    first_loss = float(m["loss"])
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, m = setup.step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return params0, first_loss, compile_s, times


def _torch_bench(cfg, params0, tokens, steps: int, lr: float, threads: int = 0):
    import torch
    import transformers

    from sprint_jax.model import save_params

    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        save_params(cfg.replace(param_dtype="float32"), params0, d)
        hf_class = getattr(transformers, cfg.family.architecture)  # Qwen2ForCausalLM / Qwen3ForCausalLM
        model = hf_class.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    x = torch.as_tensor(tokens, dtype=torch.long)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    t = time.perf_counter()
    first_loss = step()
    warm_s = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return first_loss, warm_s, times


def run_train_bench(args: argparse.Namespace) -> int:
    import jax
    import numpy as np

    from sprint_jax.model.config import resolve_model_config
    from sprint_jax.model.qwen2 import param_count

    backend = jax.default_backend()
    dtype = args.dtype if args.dtype != "auto" else ("float32" if backend == "cpu" else "bfloat16")
    cfg = resolve_model_config(args.model).replace(param_dtype="float32", dtype=dtype)
    if args.hidden:
        cfg = cfg.replace(hidden_size=args.hidden, intermediate_size=(8 * args.hidden // 3 + 7) // 8 * 8, head_dim=0)
    if args.heads:
        kv = args.heads // 3 if args.heads % 3 == 0 else args.heads
        cfg = cfg.replace(num_attention_heads=args.heads, num_key_value_heads=kv, head_dim=0)
    if args.layers:
        cfg = cfg.replace(num_hidden_layers=args.layers)
    b, t = args.batch, args.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    batch_np = {"tokens": tokens, "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
                "parents": np.tile(np.arange(-1, t - 1, dtype=np.int32), (b, 1)),
                "span_end": np.full((b, t), t, np.int32), "weights": np.ones((b, t), np.float32)}
    lr = 1e-3
    params0, jax_loss, compile_s, jax_times = _jax_bench(cfg, batch_np, args.steps, args.remat, lr)
    jax_step = statistics.median(jax_times)
    dev = jax.devices()[0]
    result = {
        "model": args.model, "config": cfg.to_hf_config(), "params": param_count(cfg), "batch": b, "seq_len": t, "dtype": dtype,
        "remat": args.remat, "backend": backend, "device_kind": dev.device_kind, "devices": jax.device_count(),
        "jax": {"step_s": jax_step, "tokens_per_s": b * t / jax_step, "first_loss": jax_loss,
                "compile_and_first_step_s": compile_s, "step_times_s": jax_times},
    }
    peak = peak_flops(dev.device_kind) if backend != "cpu" else None
    flops = train_flops_per_step(cfg, b, t)
    result["jax"]["model_flops_per_step"] = flops
    result["jax"]["mfu"] = flops / jax_step / (peak * jax.device_count()) if peak else None
    want_torch = not args.no_torch and (backend == "cpu" or dtype == "float32")
    if want_torch:
        try:
            torch_loss, warm_s, torch_times = _torch_bench(cfg, params0, tokens, args.steps, lr, args.torch_threads)
        except ImportError as e:
            print(f"(torch step skipped: {e})", file=sys.stderr)
        else:
            ts = statistics.median(torch_times)
            import torch
            result["torch"] = {"step_s": ts, "tokens_per_s": b * t / ts, "first_loss": torch_loss,
                               "first_step_s": warm_s, "step_times_s": torch_times,
                               "threads": torch.get_num_threads()}
            result["speedup_jax_over_torch"] = ts / jax_step
            result["first_loss_abs_diff"] = abs(torch_loss - jax_loss)

    print(f"train step: {args.model} ({result['params'] / 1e6:.2f}M params: hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, "
          f"vocab {cfg.vocab_size}), batch {b} x {t} tokens, "
          f"{dtype}, remat={args.remat}, {backend} ({dev.device_kind}) x{jax.device_count()}")
    print("step times are medians over the timed steps (this machine may be shared: compare ratios)")
    header = f"{'impl':<26}{'step ms':>10}{'min ms':>10}{'tokens/s':>12}{'first loss':>12}"
    print(header)
    print("-" * len(header))
    rows = [("sprint-jax (jit, sharded)", result["jax"])]
    if "torch" in result:
        rows.append((f"HF torch + AdamW ({result['torch']['threads']} thr)", result["torch"]))
    for name, r in rows:
        print(f"{name:<26}{r['step_s'] * 1e3:>10.1f}{min(r['step_times_s']) * 1e3:>10.1f}"
              f"{r['tokens_per_s']:>12.0f}{r['first_loss']:>12.5f}")
    if "torch" in result:
        print(f"speed-up (torch step / jax step): {result['speedup_jax_over_torch']:.2f}x; "
              f"|first loss difference|: {result['first_loss_abs_diff']:.2e}")
    if result["jax"]["mfu"] is not None:
        print(f"MFU: {result['jax']['mfu'] * 100:.1f}% of {peak / 1e12:.0f} TFLOP/s per device")
    elif backend != "cpu":
        print(f"MFU: no peak-FLOPs entry for {dev.device_kind!r}")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


# ---------------------------------------------------------------------------------------------
# train-memory
# ---------------------------------------------------------------------------------------------
def add_train_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="r1-distill-qwen-7b", help="model preset (default: r1-distill-qwen-7b)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices in the mesh")
    p.add_argument("--data", type=int, default=1, help="mesh data size")
    p.add_argument("--tensor", type=int, default=1, help="mesh tensor size (fsdp takes the rest)")
    p.add_argument("--batch", type=int, default=8, help="rows per step (global)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--remat", choices=("none", "full", "dots"), default="full")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                   help="compute dtype; parameters stay float32 master weights, as in training")
    p.add_argument("--loss-chunk", type=int, default=1024, help="tokens per vocab-projection chunk (0 = off)")
    p.add_argument("--out", help="write the JSON result here")


def compile_train_step(model: str, devices: int, data: int, tensor: int, batch: int, seq_len: int,
                       grad_accum: int = 1, remat: str = "full", dtype: str = "bfloat16", loss_chunk: int = 1024):
    """Lower + compile the train step from abstract inputs on `devices` CPU devices.
    Returns (compiled, lower_s, compile_s, setup)."""
    import jax

    from sprint_jax.model.config import resolve_model_config
    from sprint_jax.train import mesh as mesh_lib
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        raise SystemExit(f"only {len(cpus)} CPU devices; run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} in a fresh process")
    cfg = resolve_model_config(model).replace(param_dtype="float32", dtype=dtype)
    mesh = mesh_lib.make_mesh(data, -1, tensor, devices=cpus[:devices])
    opt = OptimSection(lr=1e-5, batch_size=batch, grad_accum=grad_accum)
    setup = step_lib.build_step(cfg, opt, 1000, mesh, remat, loss_chunk)
    t = time.perf_counter()
    lowered = setup.step.lower(setup.abstract_state(), setup.abstract_batch(batch, seq_len))
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    return compiled, lower_s, time.perf_counter() - t, setup


def run_train_memory_bench(args: argparse.Namespace) -> int:
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax

    from sprint_jax.model.qwen2 import param_count

    compiled, lower_s, compile_s, setup = compile_train_step(
        args.model, args.devices, args.data, args.tensor, args.batch, args.seq_len, args.grad_accum,
        args.remat, args.dtype, args.loss_chunk)
    ma = compiled.memory_analysis()
    gib = 2 ** 30
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    mem = {f: int(getattr(ma, f, 0) or 0) for f in fields}
    peak = mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"] + \
        mem["temp_size_in_bytes"]
    result = {"model": args.model, "params": param_count(setup.config), "mesh": dict(setup.mesh.shape),
              "batch": args.batch, "seq_len": args.seq_len, "grad_accum": args.grad_accum, "remat": args.remat,
              "dtype": args.dtype, "loss_chunk": args.loss_chunk, "lower_s": lower_s, "compile_s": compile_s, "per_device": mem,
              "per_device_peak_bytes": peak, "sharding_notes": setup.sharding_notes}
    print(f"train step memory: {args.model} ({result['params'] / 1e9:.2f}B params), mesh {result['mesh']}, "
          f"batch {args.batch} x {args.seq_len}, grad_accum {args.grad_accum}, {args.dtype} compute, "
          f"fp32 master + AdamW, remat={args.remat}, loss_chunk={args.loss_chunk}")
    print(f"lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s (XLA CPU; a GPU/TPU compile plans differently)")
    for f in fields:
        print(f"  {f.replace('_in_bytes', ''):<28}{mem[f] / gib:>10.2f} GiB per device")
    print(f"  {'peak (args + out - alias + temp)':<28}{peak / gib:>10.2f} GiB per device")
    for note in setup.sharding_notes:
        print(f"  note: {note}")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sprint_jax.bench.train [memory] ...` (the CLI is `sprint-jax bench train[-memory]`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser()
    if argv and argv[0] == "memory":
        add_train_memory_arguments(p)
        return run_train_memory_bench(p.parse_args(argv[1:]))
    add_train_arguments(p)
    return run_train_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
