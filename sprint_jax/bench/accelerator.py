"""`sprint-jax bench accelerator`: one run for a lent GPU or TPU (random weights, no downloads):
decode bandwidth of a 7B-shaped model at 1 / 8 / 32 rows against the chip's peak, the k-executor
fork step against one row, train-step MFU, Pallas against XLA attention, and the latency model
against replayed SPRINT / RFT schedules; one table, one JSON (--out). --tiny runs on a CPU.

Sections (each a few points; all on one device):
  decode     the engine's decode step of a 7B-shaped model (r1-distill-qwen-7b's shape, random
             bf16 weights) at 1 / 8 / 32 rows, each row at --context tokens. Reported: step time
             and the bytes one step must read at least (every weight once, the embedding only at
             the rows' ids; each row's K and V up to its position, at the timed steps' mean
             position) per second, against the chip's published HBM bandwidth (plan/chips.py).
  fork       one row forked into k executors by the engine's shared-prefix decode (`Engine.fork`,
             what `bench decode`'s shared mode runs): the k-executor step against the one-row step
             at the same context. SPRINT's speed-up rests on this ratio staying near 1 while a
             step is bound by reading the weights.
  train      the SFT train step (train/step.py: fp32 master weights and AdamW, bf16 compute, flash
             attention) on a few 7B-width layers: model FLOPs (6 x matmul weights x tokens + causal
             attention; `bench train`'s formula) per second, and MFU against the chip's dense bf16 peak.
  attention  the Pallas shared-prefix decode kernel against the XLA shared-prefix path at the 7B's
             heads (`bench kernels`' points): time per call, bytes/s, largest output difference.
  replay     a SPRINT schedule and its RFT twin (synthetic records: planner calls, a fork of
             executors, merge joins; RFT decodes the same tokens in one call) replayed on the
             engine (`bench replay`'s walk), next to the latency model's prediction
             (plan/records.py) for the same schedules on the chip's published figures.
A device the chip tables do not know (a CPU, a part not listed) gets no ratio to a peak; its
replay prediction uses this device's rates measured in the run (a matmul's FLOP/s, a
matrix-vector product's bytes/s), as `bench replay` does.

Timing. Decode and fork points are timed as `bench decode` times them: each call once with N =
--new-tokens and once with N = 1 (same compiled shapes), step = (wall(N) - wall(1)) / (steps(N)
- steps(1)), the best (minimum) wall of --repeats after one untimed call (compiles); between
calls the rows are truncated back to the context. The train step: the median of its timed steps
after the first (compile). Replays: the best of --repeats per mode, SPRINT and RFT alternating.

--tiny: tiny widths (hidden 64, 2 layers, vocab 256, float32) for a CPU; the tests run it. Its
figures are a CPU's overheads, not a chip's. Figures for a GPU or TPU come from running the full
mode on one (docs/benchmarks.md).

Run:
    sprint-jax bench accelerator --out accel.json          # on the lent GPU / TPU (sized for < 8 min on one H100)
    sprint-jax bench accelerator --tiny --out tiny.json    # CPU, the code path only
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

DESCRIPTION = __doc__
SECTIONS = ("decode", "fork", "train", "attention", "replay")

TINY_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                  tie_word_embeddings=False)
FULL = dict(preset="r1-distill-qwen-7b", dtype="bfloat16", rows=(1, 8, 32), context=1024, new_tokens=64,
            decode_chunk=32, forks=(2, 4, 8), train_layers=4, train_batch=1, train_seq=4096,
            attn_branches=(8, 32), attn_prefix=4096, attn_suffix=256, attn_repeats=20,
            schedule=dict(prompt=256, stages=((64, 4, 4, 128), (32, 4, 4, 96)), final=64))
TINY = dict(preset=None, dtype="float32", rows=(1, 8, 32), context=24, new_tokens=8, decode_chunk=4,
            forks=(2, 4), train_layers=2, train_batch=2, train_seq=64, attn_branches=(4,), attn_prefix=40,
            attn_suffix=8, attn_repeats=3, schedule=dict(prompt=8, stages=((4, 3, 2, 6),), final=4))


def add_accelerator_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `sprint-jax bench accelerator`."""
    p.add_argument("--tiny", action="store_true", help="tiny widths in float32 (a CPU; what the tests run)")
    p.add_argument("--out", metavar="FILE.json", help="write the results here as JSON")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default all; fork needs decode)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per point, best kept (default 3)")
    p.add_argument("--context", type=int, help="tokens per row before decoding (default 1024; tiny 24)")
    p.add_argument("--new-tokens", type=int, help="decode steps per timed call (default 64; tiny 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and token ids")


def _user_error(message: str) -> Exception:
    from sprint_jax.errors import UserError
    return UserError(message)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The mode's defaults with the flags applied; one-line errors for bad values."""
    s = dict(TINY if args.tiny else FULL)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = sorted(set(sections) - set(SECTIONS))
    if bad or not sections:
        raise _user_error(f"--sections: unknown {bad or sections}; choose from {','.join(SECTIONS)}")
    if "fork" in sections and "decode" not in sections:
        raise _user_error("--sections: fork is measured against decode's one-row step; add decode")
    s["sections"] = [x for x in SECTIONS if x in sections]
    for flag, key in (("--repeats", "repeats"), ("--context", "context"), ("--new-tokens", "new_tokens")):
        v = getattr(args, key)
        if v is not None:
            if v < 1 or (key == "new_tokens" and v < 2):
                raise _user_error(f"{flag} must be >= {2 if key == 'new_tokens' else 1}, got {v}")
            s[key] = v
    s["seed"] = args.seed
    return s


# ---------------------------------------------------------------------------------------------
# the chip: published figures by device kind
# ---------------------------------------------------------------------------------------------
_TPU_KINDS = {"tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5p": "v5p", "tpu v5": "v5p",
              "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def chip_of(device_kind: str) -> dict[str, Any] | None:
    """Published figures (plan/chips.py) of a jax `device_kind`, or None for a part the tables
    do not list (a CPU; a PCIe board, whose figures differ from the SXM part's)."""
    from sprint_jax.plan import chips

    kind = device_kind.strip().lower()
    if kind in _TPU_KINDS:
        c = chips.CHIPS[_TPU_KINDS[kind]]
        return {"name": c.name, "peak_flops": c.peak_flops, "hbm_bandwidth": c.hbm_bandwidth, "source": "plan/chips.py"}
    for g in getattr(chips, "GPUS", {}).values():
        if g.product.lower() == kind:
            return {"name": g.name, "peak_flops": g.peak_flops, "hbm_bandwidth": g.hbm_bandwidth, "source": g.source}
    return None


# ---------------------------------------------------------------------------------------------
# byte and FLOP counts
# ---------------------------------------------------------------------------------------------
def kv_bytes_per_token(config) -> int:
    """K and V of one token over all layers."""
    from sprint_jax.dtypes import dtype_of
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * np.dtype(
        dtype_of(config.dtype)).itemsize


def weight_bytes_per_step(config, rows: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, in the compute dtype
    (the engine casts at use; random weights are held in it), except an untied embedding table,
    of which only the `rows` looked-up rows are read."""
    from sprint_jax.dtypes import dtype_of
    from sprint_jax.model import qwen2

    item = np.dtype(dtype_of(config.dtype)).itemsize
    total = 0
    for spec in qwen2.param_specs(config):
        n = int(np.prod(spec.full_shape(config)))
        if spec.path == ("embed_tokens",) and not config.tie_word_embeddings:
            n = rows * config.hidden_size
        total += n
    return total * item


def decode_bytes_per_step(config, rows: int, context: int, new_tokens: int) -> dict[str, float]:
    """The bytes a decode step of `rows` rows must read: weights (`weight_bytes_per_step`) and
    each row's KV at the timed steps' mean length, context + new_tokens / 2."""
    w = weight_bytes_per_step(config, rows)
    kv = rows * (context + new_tokens / 2) * kv_bytes_per_token(config)
    return {"weight_bytes": w, "kv_bytes": kv, "bytes": w + kv}


def fork_bytes_per_step(config, k: int, context: int, new_tokens: int) -> dict[str, float]:
    """The bytes a k-executor shared-prefix step must read: weights, the parent's context KV once,
    and each child's own KV (its forced token and, on average, new_tokens / 2 generated)."""
    w = weight_bytes_per_step(config, k)
    kv = (context + k * (1 + new_tokens / 2)) * kv_bytes_per_token(config)
    return {"weight_bytes": w, "kv_bytes": kv, "bytes": w + kv}


def step_seconds(wall_n: float, wall_1: float, steps_n: int, steps_1: int) -> float | None:
    """(wall(N) - wall(1)) / (steps(N) - steps(1)); None when noise swamps it."""
    if steps_n <= steps_1 or wall_n <= wall_1:
        return None
    return (wall_n - wall_1) / (steps_n - steps_1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# ---------------------------------------------------------------------------------------------
# the model and the engine
# ---------------------------------------------------------------------------------------------
def model_config(s: dict[str, Any], **overrides):
    from sprint_jax.model import Qwen2Config

    dt = s["dtype"]
    if s["preset"] is None:
        return Qwen2Config(**{**TINY_MODEL, **overrides}, param_dtype=dt, dtype=dt)
    return Qwen2Config.preset(s["preset"], param_dtype=dt, dtype=dt, **overrides)


def schedules(s: dict[str, Any]) -> tuple[dict, dict]:
    """A SPRINT record (prompt; per stage: planner tokens, then k executors with f forced and t
    generated tokens each, joined by merge; a final call) and its RFT twin: the same prompt and
    every generated token in one sequential call."""
    sch = s["schedule"]
    stages, decoded = [], 0
    for planner, k, forced, tokens in sch["stages"]:
        stages.append({"planner_tokens": planner, "executor_mode": "shared", "join": "merge", "sync_tokens": 0,
                       "executions": [{"forced_tokens": forced, "tokens": tokens} for _ in range(k)]})
        decoded += planner + k * (forced + tokens)
    sprint = {"id": "synthetic", "mode": "parallel", "prompt_tokens": sch["prompt"], "final_tokens": sch["final"],
              "stages": stages}
    rft = {"id": "synthetic", "mode": "sequential", "prompt_tokens": sch["prompt"],
           "final_tokens": decoded + sch["final"], "stages": []}
    return sprint, rft


def make_engine(config, params, s: dict[str, Any], recs: list[dict]):
    """One engine for every section: slots for the most rows, children for the widest fork,
    capacities for the decode points and the replayed schedules."""
    from sprint_jax.bench.decode import synthetic_tokenizer
    from sprint_jax.bench.replay import capacities
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model import Qwen2

    cap = capacities(recs)
    n = s["new_tokens"]
    return Engine(Qwen2(config, params=params), synthetic_tokenizer(config.vocab_size), max_seqs=max(s["rows"]),
                  max_children=max(max(s["forks"]), cap["max_children"]),
                  max_seq_len=max(s["context"] + n + 8, cap["max_seq_len"]),
                  max_branch_tokens=max(n + 8, cap["max_branch_tokens"]), decode_chunk=s["decode_chunk"],
                  prefill_chunk=256, eos_token_ids=[])


def _progress(msg: str) -> None:
    print(f"accelerator: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------
def bench_decode(engine, s: dict[str, Any], rng, chip) -> tuple[list[dict], list]:
    """Decode steps at each row count (module docstring); returns the rows and the open seqs."""
    cfg, p, n = engine.config, s["context"], s["new_tokens"]
    ops = [engine.open([int(x) for x in rng.integers(2, cfg.vocab_size, p)]) for _ in range(max(s["rows"]))]
    engine.run(ops)
    seqs = [op.seq for op in ops]

    def call(r: int, m: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        gens = [engine.generate(q, m) for q in seqs[:r]]
        engine.run(gens)
        wall = time.perf_counter() - t0
        for q in seqs[:r]:
            engine.truncate(q, p)
        return wall, max(g.result.steps for g in gens)

    keys = [(r, m) for r in s["rows"] for m in (n, 1)]
    for k in keys:
        _progress(f"decode {k[0]} rows x {k[1]} tokens (compile)")
        call(*k)
    runs: dict = {k: [] for k in keys}
    for _ in range(s["repeats"]):
        for k in keys:
            runs[k].append(call(*k))
    out = []
    for r in s["rows"]:
        (wn, sn), (w1, s1) = min(runs[(r, n)]), min(runs[(r, 1)])
        step = step_seconds(wn, w1, sn, s1)
        b = decode_bytes_per_step(cfg, r, p, n)
        bw = _ratio(b["bytes"], step)
        out.append({"rows": r, "context": p, "new_tokens": n, "wall_n_s": wn, "wall_1_s": w1, "steps_n": sn,
                    "steps_1": s1, "step_s": step, **b, "bytes_per_s": bw,
                    "tokens_per_s": _ratio(r, step),
                    "fraction_of_peak_bandwidth": _ratio(bw, chip and chip["hbm_bandwidth"]),
                    "wall_n_samples": [w for w, _ in runs[(r, n)]], "wall_1_samples": [w for w, _ in runs[(r, 1)]]})
        _progress(f"decode {r} rows: step {_fmt(step, 1e3, '.2f')} ms, {_fmt(bw, 1e-9, '.1f')} GB/s")
    return out, seqs


def bench_fork(engine, seq, s: dict[str, Any], rng, one_row: dict) -> list[dict]:
    """k executors forked from one row at the context, decoded together (the shared-prefix step)."""
    cfg, p, n = engine.config, s["context"], s["new_tokens"]

    def call(k: int, m: int) -> tuple[float, int]:
        prefixes = [[int(rng.integers(2, cfg.vocab_size))] for _ in range(k)]
        t0 = time.perf_counter()
        op = engine.fork(seq, prefixes, m)
        engine.run([op])
        wall = time.perf_counter() - t0
        return wall, max(g.steps for g in op.result)

    keys = [(k, m) for k in s["forks"] for m in (n, 1)]
    for key in keys:
        _progress(f"fork {key[0]} executors x {key[1]} tokens (compile)")
        call(*key)
    runs: dict = {key: [] for key in keys}
    for _ in range(s["repeats"]):
        for key in keys:
            runs[key].append(call(*key))
    out = []
    for k in s["forks"]:
        (wn, sn), (w1, s1) = min(runs[(k, n)]), min(runs[(k, 1)])
        step = step_seconds(wn, w1, sn, s1)
        b = fork_bytes_per_step(cfg, k, p, n)
        out.append({"executors": k, "context": p, "new_tokens": n, "wall_n_s": wn, "wall_1_s": w1, "steps_n": sn,
                    "steps_1": s1, "step_s": step, **b, "bytes_per_s": _ratio(b["bytes"], step),
                    "one_row_step_s": one_row["step_s"], "step_vs_one_row": _ratio(step, one_row["step_s"]),
                    "tokens_per_s": _ratio(k, step)})
        _progress(f"fork {k} executors: step {_fmt(step, 1e3, '.2f')} ms = "
                  f"{_fmt(out[-1]['step_vs_one_row'], 1, '.2f')} x one row's")
    return out


def train_flops(config, batch: int, seq_len: int) -> float:
    from sprint_jax.bench.train import train_flops_per_step
    return train_flops_per_step(config, batch, seq_len)


def bench_train(s: dict[str, Any], chip) -> dict[str, Any]:
    """The SFT step on `train_layers` layers of the model's width: rows of one example each."""
    import jax

    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.train import step as step_lib
    from sprint_jax.train.config import OptimSection

    compute = "bfloat16" if s["preset"] else s["dtype"]
    cfg = dataclasses.replace(model_config(s, num_hidden_layers=s["train_layers"]), param_dtype="float32",
                              dtype=compute)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    b, t = s["train_batch"], s["train_seq"]
    opt = OptimSection(lr=1e-5, warmup_steps=0, batch_size=b)
    setup = step_lib.build_step(cfg, opt, 100, mesh, "none", attention="flash", layout="flat", attention_layout="flat")
    state = setup.init_state(s["seed"])
    rng = np.random.default_rng(s["seed"])
    batch_np = {"tokens": rng.integers(2, cfg.vocab_size, (b, t)).astype(np.int32),
                "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
                "parents": np.tile(np.arange(-1, t - 1, dtype=np.int32), (b, 1)),
                "span_end": np.full((b, t), t, np.int32), "weights": np.ones((b, t), np.float32)}
    batch = {k: jax.device_put(v, setup.batch_shardings[k]) for k, v in batch_np.items()}
    _progress(f"train step: {cfg.num_hidden_layers} layers x width {cfg.hidden_size}, {b} x {t} tokens (compile)")
    t0 = time.perf_counter()
    state, m = setup.step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(max(s["repeats"], 3)):
        t0 = time.perf_counter()
        state, m = setup.step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    flops = train_flops(cfg, b, t)
    out = {"layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
           "batch": b, "seq_len": t, "compute_dtype": compute, "remat": "none", "flops": flops, "step_s": step,
           "step_samples": times, "compile_and_first_s": compile_s, "flops_per_s": flops / step,
           "mfu": _ratio(flops / step, chip and chip["peak_flops"]), "loss": float(m["loss"])}
    _progress(f"train: {step * 1e3:.1f} ms per step, {flops / step / 1e12:.3g} TFLOP/s")
    return out


def bench_attention(s: dict[str, Any], cfg) -> list[dict]:
    """Pallas vs XLA shared-prefix attention at the model's heads (`bench kernels`' point)."""
    import jax

    from sprint_jax.bench.kernels import bench_point

    ks = {"dtype": s["dtype"], "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
          "head_dim": cfg.head_dim, "suffix_len": s["attn_suffix"], "methods": ["pallas", "xla"],
          "warmup": 1, "repeats": s["attn_repeats"]}
    interpret = jax.default_backend() == "cpu"
    out = []
    for n in s["attn_branches"]:
        _progress(f"attention: {n} branches x prefix {s['attn_prefix']} (pallas{' interpreted' if interpret else ''}, xla)")
        rows = {r["method"]: r for r in bench_point(n, s["attn_prefix"], ks, interpret, s["seed"])}
        pl, xl = rows["pallas"], rows["xla"]
        out.append({"branches": n, "prefix_len": s["attn_prefix"], "suffix_len": s["attn_suffix"],
                    "heads": ks["heads"], "kv_heads": ks["kv_heads"], "head_dim": ks["head_dim"],
                    "interpret": interpret, "bytes": pl["bytes"], "pallas_s": pl["ms_per_call"] / 1e3,
                    "xla_s": xl["ms_per_call"] / 1e3, "pallas_bytes_per_s": pl["bytes_per_s"],
                    "xla_bytes_per_s": xl["bytes_per_s"], "xla_over_pallas": xl["ms_per_call"] / pl["ms_per_call"],
                    "max_abs_diff": pl["max_abs_diff_vs_xla"]})
    return out


def bench_replay(engine, s: dict[str, Any], chip, rng) -> dict[str, Any]:
    """The synthetic SPRINT and RFT schedules replayed on the engine vs the latency model."""
    from sprint_jax.bench import replay as rp
    from sprint_jax.plan import records

    sprint, rft = schedules(s)
    recs = {"sprint": sprint, "rft": rft}
    for label, rec in recs.items():
        _progress(f"replay {label} (compile)")
        rp.replay(engine, rec, rng)
    times: dict[str, list[float]] = {"sprint": [], "rft": []}
    for i in range(s["repeats"]):
        for label in (("sprint", "rft") if i % 2 == 0 else ("rft", "sprint")):
            t0 = time.perf_counter()
            rp.replay(engine, recs[label], rng)
            times[label].append(time.perf_counter() - t0)
    measured = {k: min(v) for k, v in times.items()}
    probe = None
    if chip is None:
        _progress("replay: measuring this device's FLOP/s and bytes/s for the latency model")
        probe = (rp.measure_cpu(s["repeats"], 256, 1024) if s["preset"] is None else rp.measure_cpu(s["repeats"]))
        model_chip = rp.MeasuredChip("measured", probe["flops_per_s"], probe["matvec_bytes_per_s"])
    else:
        model_chip = rp.MeasuredChip(chip["name"], chip["peak_flops"], chip["hbm_bandwidth"])
    pred = records.predict({"sprint": {"synthetic": sprint}, "rft": {"synthetic": rft}}, engine.config, model_chip,
                           1, s["decode_chunk"])
    predicted = {k: pred["total"][k]["latency_s"] for k in ("sprint", "rft")}
    out = {"records": recs, "measured_s": measured, "samples_s": times, "predicted_s": predicted,
           "model_chip": dataclasses.asdict(model_chip), "probe": probe,
           "decode_steps": {k: pred["total"][k]["decode_steps"] for k in ("sprint", "rft")},
           "measured_ratio": measured["sprint"] / measured["rft"], "predicted_ratio": pred["ratio"],
           "predicted_over_measured": {k: predicted[k] / measured[k] for k in predicted}}
    _progress(f"replay: SPRINT / RFT measured {out['measured_ratio']:.2f}, predicted {out['predicted_ratio']:.2f}")
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _fmt(x: float | None, scale: float = 1.0, spec: str = ".3g") -> str:
    return "-" if x is None else format(x * scale, spec)


def _pct(x: float | None, what: str) -> str:
    if x is None:
        return "no chip peak"
    return f"MFU {100 * x:.0f}%" if what == "MFU" else f"{100 * x:.0f}% {what}"


def table(r: dict[str, Any]) -> list[str]:
    """The one table: section, point, time, the figure, and its ratio."""
    rows = [("section", "point", "ms", "figure", "ratio")]
    for d in r.get("decode", []):
        rows.append(("decode", f"{d['rows']} rows @ {d['context']}", _fmt(d["step_s"], 1e3, ".2f"),
                     f"{_fmt(d['bytes_per_s'], 1e-9, '.1f')} GB/s", _pct(d["fraction_of_peak_bandwidth"], "of peak")))
    for d in r.get("fork", []):
        rows.append(("fork", f"{d['executors']} executors @ {d['context']}", _fmt(d["step_s"], 1e3, ".2f"),
                     f"{_fmt(d['bytes_per_s'], 1e-9, '.1f')} GB/s", f"{_fmt(d['step_vs_one_row'], 1, '.2f')} x one row"))
    if "train" in r:
        d = r["train"]
        rows.append(("train", f"{d['layers']} layers x {d['hidden_size']}, {d['batch']}x{d['seq_len']}",
                     _fmt(d["step_s"], 1e3, ".1f"), f"{_fmt(d['flops_per_s'], 1e-12, '.3g')} TFLOP/s",
                     _pct(d["mfu"], "MFU")))
    for d in r.get("attention", []):
        rows.append(("attention", f"{d['branches']} branches @ {d['prefix_len']}",
                     f"{_fmt(d['pallas_s'], 1e3, '.3f')} / {_fmt(d['xla_s'], 1e3, '.3f')}",
                     f"pallas {_fmt(d['pallas_bytes_per_s'], 1e-9, '.1f')} GB/s",
                     f"xla / pallas {_fmt(d['xla_over_pallas'], 1, '.2f')}" + (" (interpreted)" if d["interpret"] else "")))
    if "replay" in r:
        d = r["replay"]
        for k in ("sprint", "rft"):
            rows.append(("replay", k, _fmt(d["measured_s"][k], 1e3, ".1f"),
                         f"predicted {_fmt(d['predicted_s'][k], 1e3, '.1f')} ms",
                         f"pred / meas {_fmt(d['predicted_over_measured'][k], 1, '.2f')}"))
        rows.append(("replay", "SPRINT / RFT", "", f"measured {d['measured_ratio']:.2f}",
                     f"predicted {_fmt(d['predicted_ratio'], 1, '.2f')}"))
    widths = [max(len(str(x[i])) for x in rows) for i in range(5)]
    lines = ["  ".join(str(x[i]).ljust(widths[i]) for i in range(5)).rstrip() for x in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def run_accelerator_bench(args: argparse.Namespace) -> int:
    import jax

    from sprint_jax.model import qwen2

    s = settings(args)
    dev = jax.devices()[0]
    chip = chip_of(dev.device_kind)
    cfg = model_config(s)
    t_start = time.perf_counter()
    _progress(f"{dev.device_kind} ({jax.default_backend()}); chip figures: "
              f"{chip['name'] if chip else 'none (not in plan/chips.py: no ratios to a peak)'}; "
              f"model {s['preset'] or 'tiny'} {s['dtype']}; sections {','.join(s['sections'])}")
    result: dict[str, Any] = {
        "bench": "accelerator", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__, "device": {"kind": dev.device_kind, "platform": jax.default_backend(),
                                           "count": jax.device_count()},
        "chip": chip, "mode": "tiny" if args.tiny else "full",
        "settings": {k: v for k, v in s.items() if k != "schedule"} | {"schedule": s["schedule"]},
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "head_dim", "dtype")}}
    rng = np.random.default_rng(s["seed"])
    if any(x in s["sections"] for x in ("decode", "replay")):
        _progress(f"random weights: {qwen2.param_count(cfg) / 1e9:.3g}B parameters in {s['dtype']}")
        params = jax.jit(qwen2.init_params, static_argnums=0)(cfg, jax.random.key(s["seed"]))
        engine = make_engine(cfg, params, s, list(schedules(s)))
        if "decode" in s["sections"]:
            result["decode"], seqs = bench_decode(engine, s, rng, chip)
            if "fork" in s["sections"]:
                result["fork"] = bench_fork(engine, seqs[0], s, rng, result["decode"][0] if s["rows"][0] == 1 else
                                            {"step_s": None})
            for q in seqs:
                engine.close(q)
        if "replay" in s["sections"]:
            result["replay"] = bench_replay(engine, s, chip, rng)
        del engine, params
    if "attention" in s["sections"]:
        result["attention"] = bench_attention(s, cfg)
    if "train" in s["sections"]:
        result["train"] = bench_train(s, chip)
    result["wall_s"] = time.perf_counter() - t_start
    print(f"bench accelerator: {dev.device_kind}, model {s['preset'] or 'tiny'} ({s['dtype']}), "
          f"{result['wall_s']:.0f} s")
    for line in table(result):
        print(line)
    if chip is None:
        print("no chip figures for this device kind: bandwidth and FLOP/s without a ratio to a peak")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sprint-jax bench accelerator", description=DESCRIPTION.split("\n\n")[0])
    add_accelerator_arguments(p)
    return run_accelerator_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
