"""Training benchmarks: our sharded train step vs an HF PyTorch step, and the 7B step's memory.

`sprint-jax bench train`: tokens/s and step time of `train.step` for a small Qwen2 / Qwen3 on the local
devices, side by side with the same step on the dense-attention reference (the [T, T] mask path
training used before flash attention) and with `transformers.Qwen2ForCausalLM` / `Qwen3ForCausalLM` +
`torch.optim.AdamW` on the same config, the same weights and the same batch, in one run
(ratios in one run, never timed tests). The first-step losses are
printed too: an independent check of our loss. On GPU/TPU the MFU of our step is reported against
a peak-FLOPs table. Beside the torch step comes the matmul floor (`step_gemms`, `time_step_gemms`,
`gemm_floor`): each matmul of the step outside attention timed alone on XLA and on torch, summed per
step, which splits both steps into matmuls and everything else and says how much of torch's step
XLA's matmuls alone already take (`--no-gemms` skips it).

`sprint-jax bench train-memory`: the 7B preset's train step lowered and compiled from
ShapeDtypeStructs (nothing allocated) on a fake 8-device CPU mesh; prints the per-device memory
XLA plans for it (`compiled.memory_analysis()`), one row per `--seq-len` (a list), for flash
attention and optionally the dense reference (`--attention flash dense`).
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


def step_gemms(config, tokens: int) -> list[dict]:
    """The matmuls of one train step outside attention, as the step runs them: every projection
    of every layer and the vocabulary projection, each forward (x @ W), input gradient (dy @ W^T)
    and weight gradient (x^T @ dy) over the step's `tokens` rows (qwen2.dense runs each as one 2-D
    matmul; autodiff gives the other two). Identical shapes are one entry with a count. Their
    FLOPs sum to the matmul part of `train_flops_per_step` (the attention's own products are not
    here: the two libraries' attentions are in the rest of each step)."""
    c = config
    e, h, kv, d, m = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    layer = [(e, h * d), (e, kv * d), (e, kv * d), (h * d, e), (e, m), (e, m), (m, e)]  # q k v o gate up down
    projections = [(i, o, c.num_hidden_layers) for i, o in layer] + [(e, c.vocab_size, 1)]
    counts: dict[tuple, int] = {}
    for i, o, n in projections:
        for kind in ("forward", "input grad", "weight grad"):
            counts[(kind, i, o)] = counts.get((kind, i, o), 0) + n
    return [{"product": kind, "tokens": tokens, "in": i, "out": o, "count": n,
             "flops": 2.0 * tokens * i * o}
            for (kind, i, o), n in counts.items()]


def _median_call_s(fn, reps: int, rounds: int) -> float:
    """Median over `rounds` of (time of `reps` back-to-back calls) / reps; fn() returns what to wait on."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = [fn() for _ in range(reps)]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times)


def time_step_gemms(gemms: list[dict], reps: int = 10, rounds: int = 7, seed: int = 0) -> list[dict]:
    """Each matmul of `step_gemms` on XLA (jitted, the form our step runs) and on torch (the form
    HF's autograd runs: torch keeps W as [out, in], so forward x @ W^T, input grad dy @ W, weight
    grad dy^T @ x), on the same random fp32 data, the two libraries taking turns per shape. Adds
    `xla_s` / `torch_s` (median seconds per call) and `max_rel_diff` (the two results, compared)."""
    import jax
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    xla_forms = {"forward": jax.jit(lambda x, w, dy: x @ w), "input grad": jax.jit(lambda x, w, dy: dy @ w.T),
                 "weight grad": jax.jit(lambda x, w, dy: x.T @ dy)}
    torch_forms = {"forward": lambda x, wt, dy: x @ wt.t(), "input grad": lambda x, wt, dy: dy @ wt,
                   "weight grad": lambda x, wt, dy: dy.t() @ x}
    out = []
    for g in gemms:
        n, i, o = g["tokens"], g["in"], g["out"]
        x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((n, i), (i, o), (n, o)))
        jx, jw, jdy = (jax.device_put(a) for a in (x, w, dy))
        tx, twt, tdy = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T)), torch.from_numpy(dy)
        fx, ft = xla_forms[g["product"]], torch_forms[g["product"]]
        xla_s = _median_call_s(lambda: fx(jx, jw, jdy), reps, rounds)
        torch_s = _median_call_s(lambda: ft(tx, twt, tdy), reps, rounds)
        a = np.asarray(fx(jx, jw, jdy))
        b = ft(tx, twt, tdy).numpy()
        b = b.T if g["product"] == "weight grad" else b          # torch's weight grad is [out, in]
        rel = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
        out.append({**g, "xla_s": xla_s, "torch_s": torch_s, "max_rel_diff": rel})
    return out


def gemm_floor(timed: list[dict], jax_step_s: float, torch_step_s: float) -> dict:
    """Per-step sums of `time_step_gemms` and what they leave: XLA's matmuls alone against torch's
    whole step is the time left for everything else of ours (attention, norms, RoPE, SwiGLU, loss,
    AdamW) if our step is to match torch's, beside what that everything else costs each side now."""
    xla = sum(g["count"] * g["xla_s"] for g in timed)
    tor = sum(g["count"] * g["torch_s"] for g in timed)
    flops = sum(g["count"] * g["flops"] for g in timed)
    r = {"xla_gemm_s": xla, "torch_gemm_s": tor, "gemm_flops": flops,
         "xla_gemm_flops_per_s": flops / xla, "torch_gemm_flops_per_s": flops / tor,
         "ours_rest_s": jax_step_s - xla, "torch_rest_s": torch_step_s - tor,
         "rest_budget_s": torch_step_s - xla, "torch_step_over_xla_gemms": torch_step_s / xla}
    return r


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
    p.add_argument("--no-dense", action="store_true",
                   help="skip the dense-attention reference step (the [T, T] mask path)")
    p.add_argument("--no-gemms", action="store_true",
                   help="skip the matmul floor (CPU, float32: each of the step's matmuls alone on XLA and on torch)")
    p.add_argument("--out", help="write the JSON result here")


def _jax_bench(cfg, batch_np, steps: int, remat: str, lr: float, attention: str = "flash"):
    import jax

    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.train import mesh as mesh_lib
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    b = batch_np["tokens"].shape[0]
    mesh = make_mesh(1, -1, 1)
    if b % mesh_lib.batch_divisor(mesh):
        raise SystemExit(f"--batch {b} must be a multiple of the device count {mesh_lib.batch_divisor(mesh)}")
    opt = OptimSection(lr=lr, warmup_steps=0, min_lr_ratio=1.0, clip_norm=0.0, batch_size=b, b2=0.999)
    setup = step_lib.build_step(cfg, opt, steps + 1, mesh, remat, attention=attention)
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
    dense = None
    if not args.no_dense:
        _, dense_loss, dense_compile_s, dense_times = _jax_bench(cfg, batch_np, args.steps, args.remat, lr,
                                                                 attention="dense")
        ds = statistics.median(dense_times)
        dense = {"step_s": ds, "tokens_per_s": b * t / ds, "first_loss": dense_loss,
                 "compile_and_first_step_s": dense_compile_s, "step_times_s": dense_times}
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
    if dense is not None:
        result["jax_dense"] = dense
        result["speedup_flash_over_dense"] = dense["step_s"] / jax_step
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
            if not args.no_gemms and backend == "cpu" and dtype == "float32":   # both on this CPU, fp32
                timed = time_step_gemms(step_gemms(cfg, b * t))
                result["gemms"] = timed
                result["gemm_floor"] = gemm_floor(timed, jax_step, ts)

    print(f"train step: {args.model} ({result['params'] / 1e6:.2f}M params: hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, "
          f"vocab {cfg.vocab_size}), batch {b} x {t} tokens, "
          f"{dtype}, remat={args.remat}, {backend} ({dev.device_kind}) x{jax.device_count()}")
    print("step times are medians over the timed steps (this machine may be shared: compare ratios)")
    header = f"{'impl':<30}{'step ms':>10}{'min ms':>10}{'tokens/s':>12}{'first loss':>12}"
    print(header)
    print("-" * len(header))
    rows = [("sprint-jax (flash attention)", result["jax"])]
    if dense is not None:
        rows.append(("sprint-jax (dense reference)", dense))
    if "torch" in result:
        rows.append((f"HF torch + AdamW ({result['torch']['threads']} thr)", result["torch"]))
    for name, r in rows:
        print(f"{name:<30}{r['step_s'] * 1e3:>10.1f}{min(r['step_times_s']) * 1e3:>10.1f}"
              f"{r['tokens_per_s']:>12.0f}{r['first_loss']:>12.5f}")
    if dense is not None:
        print(f"speed-up (dense step / flash step): {result['speedup_flash_over_dense']:.2f}x")
    if "torch" in result:
        print(f"speed-up (torch step / jax step): {result['speedup_jax_over_torch']:.2f}x; "
              f"|first loss difference|: {result['first_loss_abs_diff']:.2e}")
    if "gemm_floor" in result:
        _print_gemm_floor(result["gemms"], result["gemm_floor"])
    if result["jax"]["mfu"] is not None:
        print(f"MFU: {result['jax']['mfu'] * 100:.1f}% of {peak / 1e12:.0f} TFLOP/s per device")
    elif backend != "cpu":
        print(f"MFU: no peak-FLOPs entry for {dev.device_kind!r}")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _print_gemm_floor(timed: list[dict], f: dict) -> None:
    print("matmul floor: each of the step's matmuls outside attention alone, XLA (our step's form) vs "
          "torch (HF autograd's form), same fp32 data")
    header = f"{'product':<13}{'tokens x in x out':>20}{'x':>4}{'XLA ms':>9}{'torch ms':>10}{'XLA GF/s':>10}{'torch GF/s':>11}"
    print(header)
    print("-" * len(header))
    for g in timed:
        shape = f"{g['tokens']}x{g['in']}x{g['out']}"
        print(f"{g['product']:<13}{shape:>20}{g['count']:>4}{g['xla_s'] * 1e3:>9.3f}{g['torch_s'] * 1e3:>10.3f}"
              f"{g['flops'] / g['xla_s'] / 1e9:>10.0f}{g['flops'] / g['torch_s'] / 1e9:>11.0f}")
    print(f"per step: XLA {f['xla_gemm_s'] * 1e3:.1f} ms ({f['xla_gemm_flops_per_s'] / 1e9:.0f} GF/s), torch "
          f"{f['torch_gemm_s'] * 1e3:.1f} ms ({f['torch_gemm_flops_per_s'] / 1e9:.0f} GF/s) for "
          f"{f['gemm_flops'] / 1e9:.1f} GFLOP")
    print(f"everything else (attention, norms, RoPE, SwiGLU, loss, AdamW): ours {f['ours_rest_s'] * 1e3:.1f} ms, "
          f"torch {f['torch_rest_s'] * 1e3:.1f} ms; to match torch's step, ours may take "
          f"{f['rest_budget_s'] * 1e3:.1f} ms (torch step / XLA matmuls alone = {f['torch_step_over_xla_gemms']:.2f}x)")


# ---------------------------------------------------------------------------------------------
# train-memory
# ---------------------------------------------------------------------------------------------
def add_train_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="r1-distill-qwen-7b", help="model preset (default: r1-distill-qwen-7b)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices in the mesh")
    p.add_argument("--data", type=int, default=1, help="mesh data size")
    p.add_argument("--tensor", type=int, default=1, help="mesh tensor size (fsdp takes the rest)")
    p.add_argument("--batch", type=int, default=8, help="rows per step (global)")
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096], help="tokens per row (one or more)")
    p.add_argument("--attention", nargs="+", choices=("flash", "dense"), default=["flash"],
                   help="attention(s) to plan: flash (what training runs) and/or the dense reference")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--remat", choices=("none", "full", "dots"), default="full")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16",
                   help="compute dtype; parameters stay float32 master weights, as in training")
    p.add_argument("--loss-chunk", type=int, default=1024, help="tokens per vocab-projection chunk (0 = off)")
    p.add_argument("--out", help="write the JSON result here")


def compile_train_step(model: str, devices: int, data: int, tensor: int, batch: int, seq_len: int,
                       grad_accum: int = 1, remat: str = "full", dtype: str = "bfloat16", loss_chunk: int = 1024,
                       attention: str = "flash"):
    """Lower + compile the train step from abstract inputs on `devices` CPU devices.
    Returns (compiled, lower_s, compile_s, setup)."""
    import jax

    from sprint_jax.model.config import resolve_model_config
    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        raise SystemExit(f"only {len(cpus)} CPU devices; run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} in a fresh process")
    cfg = resolve_model_config(model).replace(param_dtype="float32", dtype=dtype)
    mesh = make_mesh(data, -1, tensor, devices=cpus[:devices])
    opt = OptimSection(lr=1e-5, batch_size=batch, grad_accum=grad_accum)
    setup = step_lib.build_step(cfg, opt, 1000, mesh, remat, loss_chunk, attention)
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

    from sprint_jax.model.qwen2 import param_count

    gib = 2 ** 30
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    rows, setup = [], None
    for seq_len in args.seq_len:
        for attention in args.attention:
            compiled, lower_s, compile_s, setup = compile_train_step(
                args.model, args.devices, args.data, args.tensor, args.batch, seq_len, args.grad_accum,
                args.remat, args.dtype, args.loss_chunk, attention)
            ma = compiled.memory_analysis()
            mem = {f: int(getattr(ma, f, 0) or 0) for f in fields}
            peak = mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - \
                mem["alias_size_in_bytes"] + mem["temp_size_in_bytes"]
            rows.append({"seq_len": seq_len, "attention": attention, "lower_s": lower_s,
                         "compile_s": compile_s, "per_device": mem, "per_device_peak_bytes": peak})
            del compiled
    result = {"model": args.model, "params": param_count(setup.config), "mesh": dict(setup.mesh.shape),
              "batch": args.batch, "grad_accum": args.grad_accum, "remat": args.remat, "dtype": args.dtype,
              "loss_chunk": args.loss_chunk, "rows": rows, "sharding_notes": setup.sharding_notes}
    print(f"train step memory: {args.model} ({result['params'] / 1e9:.2f}B params), mesh {result['mesh']}, "
          f"batch {args.batch} rows, grad_accum {args.grad_accum}, {args.dtype} compute, "
          f"fp32 master + AdamW, remat={args.remat}, loss_chunk={args.loss_chunk}")
    print("GiB per device as XLA CPU plans it (a GPU/TPU compile plans differently; there the flash "
          "attention is a Pallas kernel, here its XLA body)")
    header = f"{'seq_len':>8}  {'attention':<10}{'args':>8}{'temp':>8}{'peak':>8}{'compile s':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        m = r["per_device"]
        print(f"{r['seq_len']:>8}  {r['attention']:<10}{m['argument_size_in_bytes'] / gib:>8.2f}"
              f"{m['temp_size_in_bytes'] / gib:>8.2f}{r['per_device_peak_bytes'] / gib:>8.2f}"
              f"{r['compile_s']:>11.1f}")
    print("peak = args + out - alias + temp")
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
