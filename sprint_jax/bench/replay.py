"""`sprint-jax bench replay`: eval records' decode schedules replayed on this CPU's engine, SPRINT
next to RFT, and the latency model (`plan.records`) fed this CPU's measured rates.

Why. `plan engine --records` predicts SPRINT's and RFT's latency on a TPU chip from the step counts
of an eval; nothing there was ever timed. This benchmark holds that model against a real machine:
the same schedules run on this CPU with a model big enough that a decode step is bound by reading
its weights (random weights: a step's cost does not depend on their values), and the model,
given this CPU's measured FLOP rate and bytes/s as its chip, predicts both.

The replay (per record, the same walk as `plan.records.record_latency`), one sequence on an
`Engine` with max_seqs=1 (concurrency 1), eos_token_ids=[] and no stop strings, so every call
decodes exactly the recorded count (random token ids stand in for the text):
  * the prompt: `open` of prompt_tokens ids;
  * each stage: the planner call, `generate(max_new_tokens=planner_tokens)`; executors run shared
    or serial: one `fork` with the recorded width, each child forced its forced_tokens and
    decoding its tokens (a join="merge" stage forks with join=True); the sync: `merge` of the
    branches (merge stages) or `extend` by sync_tokens ids (re-prefill); inline / none executors
    run nothing of their own (their tokens were the planner's);
  * the final call: `generate(max_new_tokens=final_tokens)`; an RFT record is its prompt and this
    one sequential call.
Each problem's SPRINT and RFT replays run next to each other (their order alternating per
repeat); every problem is replayed once untimed first (compiles). Reported: the best (minimum)
wall clock per problem and mode over --repeats (load on a shared machine only adds time), the
totals and SPRINT / RFT.

This CPU as the model's chip, measured in the same run (best of --probe-repeats, jitted):
  FLOP/s   a [N x N] @ [N x N] fp32 matmul (N = 2048): 2 N^3 / time;
  bytes/s  a matrix-vector product over a [8192 x 8192] fp32 matrix (256 MiB, 8x the L3 here):
           matrix bytes / time: the weights-streaming access of a one-row decode step. A plain
           reduction over the same bytes (jnp.sum) is reported alongside, not used.
  rows     the model's matmul weights alone at 1 row and at each fork width the records use:
           time, and the bytes/s and FLOP/s it means (is a k-row step a one-row step's weight
           read, as the roofline takes it when memory-bound, or k times the matmul work?).
`plan.records.predict` then gives each record's latency on that chip (accelerator side only: no
host round trips or sampling), printed next to the measured figures with predicted / measured.

Models (`--model-size`; Qwen2 layout, random normal(0.02) weights, untied lm_head, vocab 8192):
  100M   hidden 768, 12 layers, 12 heads / 4 KV heads, SwiGLU 2560: 102M parameters, 384 MiB
         of fp32 matmul weights per step (default)
  300M   hidden 1024, 16 layers, 16 heads / 4 KV heads, SwiGLU 4096: 266M parameters
  tiny   hidden 64, 2 layers (tests: overhead-bound, not a latency figure)
fp32 by default: XLA's CPU matmuls compute bf16 through fp32 conversions, which add traffic and
work the roofline does not count (--dtype bfloat16 is there to see it). The engine runs the
per-layer weight copy (`per_layer_weights`; --stacked-weights for the stacked form, whose layer
scan on XLA CPU copies each layer's weights out of the stack every step).

Run:
    sprint-jax bench replay --records EVAL_DIR [--model-size 100M] [--problems N] [--json FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

DESCRIPTION = __doc__

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256),
    "100M": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2560, vocab_size=8192),
    "300M": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=4096, vocab_size=8192),
}
MATMUL_N = 2048           # FLOP/s probe: [N x N] @ [N x N]
STREAM_ROWS = 8192        # bytes/s probe: [R x R] fp32 matrix-vector product (256 MiB)


@dataclasses.dataclass(frozen=True)
class MeasuredChip:
    """This machine as `plan.records` reads a chip: a name, FLOP/s and bytes/s."""
    name: str
    peak_flops: float
    hbm_bandwidth: float


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `sprint-jax bench replay`."""
    p.add_argument("--records", required=True, metavar="DIR",
                   help="a directory holding a SPRINT eval's and its RFT baseline's records.jsonl")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="100M",
                   help="random Qwen2 model replayed on (default 100M)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights, activations and KV cache (default float32)")
    p.add_argument("--problems", type=int, help="replay the first N problems both modes have (default all)")
    p.add_argument("--repeats", type=int, default=2, help="timed replays per problem and mode, best kept (default 2)")
    p.add_argument("--probe-repeats", type=int, default=5, help="timed FLOP/s and bytes/s probes, best kept")
    p.add_argument("--decode-chunk", type=int, default=16, help="engine decode steps per host round trip")
    p.add_argument("--stacked-weights", action="store_true",
                   help="run the engine on the stacked layer weights instead of the per-layer copy")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and token ids")
    p.add_argument("--json", metavar="FILE", help="write the results here as JSON")


# ---------------------------------------------------------------------------------------------
# records -> schedules
# ---------------------------------------------------------------------------------------------
def _user_error(message: str) -> Exception:
    from sprint_jax.errors import UserError
    return UserError(message)


def paired(records: dict[str, dict[str, dict]], problems: int | None) -> list[str]:
    """Problem keys both modes have, in sorted order, the first `problems` of them."""
    both = sorted(set(records["sprint"]) & set(records["rft"]))
    if not both:
        raise _user_error(f"no problem has both a SPRINT record ({len(records['sprint'])} found) and an RFT "
                          f"record ({len(records['rft'])} found): replay needs an eval and its baseline")
    if problems is not None:
        if problems < 1:
            raise _user_error(f"--problems must be >= 1, got {problems}")
        both = both[:problems]
    return both


def _executors_run(stage: dict) -> bool:
    return bool(stage.get("executions")) and stage.get("executor_mode", "none") in ("shared", "serial")


def capacities(recs: list[dict]) -> dict[str, int]:
    """Engine capacities that hold every record's replay: context (planner) tokens, executors
    per stage, tokens per executor (forced + generated + the token it continues from)."""
    ctx, width, branch = 1, 1, 1
    for rec in recs:
        n = rec["prompt_tokens"]
        for st in rec["stages"]:
            n += st["planner_tokens"]
            if _executors_run(st):
                runs = st["executions"]
                width = max(width, len(runs))
                branch = max(branch, max(e["forced_tokens"] + max(e["tokens"], 1) + 1 for e in runs))
                n += (sum(e["forced_tokens"] + max(e["tokens"], 1) for e in runs) if st.get("join") == "merge"
                      else st.get("sync_tokens", 0))
            ctx = max(ctx, n)
        ctx = max(ctx, n + rec["final_tokens"])
    return {"max_seq_len": ctx + 8, "max_children": width, "max_branch_tokens": branch + 8}


def replay(engine, rec: dict[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
    """One record's schedule on `engine` (module docstring), to the end of its last call (the
    cache ready); the sequence is closed after. Returns the calls made: {'call': prefill |
    planner | fork | merge | extend | final, 'tokens': tokens that call decoded or wrote (a fork:
    one count per child; merge: the branch tokens joined)}."""
    import jax

    from sprint_jax.infer.requests import EngineError

    vocab = engine.config.vocab_size

    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.integers(2, vocab, n)]

    calls: list[dict[str, Any]] = []
    try:
        op = engine.open(ids(rec["prompt_tokens"]))
        engine.run([op])
        seq = op.seq
        calls.append({"call": "prefill", "tokens": rec["prompt_tokens"]})

        def generate(n: int, what: str) -> None:
            if n <= 0:
                return
            g = engine.generate(seq, n)
            engine.run([g])
            calls.append({"call": what, "tokens": len(g.result.tokens)})

        for st in rec["stages"]:
            generate(st["planner_tokens"], "planner")
            if not _executors_run(st):
                continue
            runs = st["executions"]
            merge = st.get("join") == "merge" and st["executor_mode"] == "shared"
            prefixes = [ids(e["forced_tokens"]) for e in runs]
            f = engine.fork(seq, prefixes, [max(e["tokens"], 1) for e in runs], serial=st["executor_mode"] == "serial",
                            join=merge)
            engine.run([f])
            gens = list(f.result)
            calls.append({"call": "fork", "tokens": [len(g.tokens) for g in gens],
                          "forced": [len(p) for p in prefixes], "serial": st["executor_mode"] == "serial"})
            if merge:
                branches = [p + g.tokens for p, g in zip(prefixes, gens)]
                engine.merge(seq, branches)
                calls.append({"call": "merge", "tokens": sum(map(len, branches))})
            elif st.get("sync_tokens", 0) > 0:
                engine.extend(seq, ids(st["sync_tokens"]))
                calls.append({"call": "extend", "tokens": st["sync_tokens"]})
        generate(rec["final_tokens"], "final")
        engine.run()                     # anything still queued (an extend with no call after it)
        jax.block_until_ready(engine.cache)
        engine.close(seq)
    except EngineError as e:
        raise _user_error(f"record {rec.get('id', '?')} ({rec.get('mode')}): cannot be replayed: {e}") from None
    return calls


# ---------------------------------------------------------------------------------------------
# this CPU's rates
# ---------------------------------------------------------------------------------------------
def _best_time(fn, arg, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn(arg))                   # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(repeats: int, matmul_n: int = MATMUL_N, stream_rows: int = STREAM_ROWS) -> dict[str, float]:
    """FLOP/s of a [n x n] fp32 matmul, bytes/s of a matrix-vector product over a [r x r] fp32
    matrix, and of a sum over the same bytes (best of `repeats` each; module docstring)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.key(1)
    a = jax.random.normal(key, (matmul_n, matmul_n), jnp.float32)
    t_mm = _best_time(jax.jit(lambda x: x @ x), a, repeats)
    del a
    w = jax.random.normal(key, (stream_rows, stream_rows), jnp.float32)
    v = jnp.ones((stream_rows,), jnp.float32)
    t_mv = _best_time(jax.jit(lambda m: m @ v), w, repeats)
    t_sum = _best_time(jax.jit(jnp.sum), w, repeats)
    nbytes = float(w.size * 4)
    del w
    return {"matmul_n": matmul_n, "matmul_s": t_mm, "flops_per_s": 2.0 * matmul_n ** 3 / t_mm,
            "stream_bytes": nbytes, "matvec_s": t_mv, "matvec_bytes_per_s": nbytes / t_mv,
            "sum_s": t_sum, "sum_bytes_per_s": nbytes / t_sum}


def weight_shapes(config) -> list[tuple[int, int]]:
    """[in, out] of every matmul weight a decode step reads: each layer's q, k, v, o, gate, up,
    down projections and the lm_head."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, config.intermediate_size), (h, config.intermediate_size),
             (config.intermediate_size, h)]
    return layer * config.num_hidden_layers + [(h, config.vocab_size)]


def measure_rows(config, rows: list[int], repeats: int) -> list[dict[str, float]]:
    """The model's matmuls alone (random weights of `weight_shapes`, in its dtype) at each row
    count: best time of `repeats`, and the bytes/s (weights once) and FLOP/s (2 x weights x rows)
    that time means. Shows whether extra rows ride on the weight read here (the roofline's
    assumption for a memory-bound step) or cost matmul time of their own."""
    import jax
    import jax.numpy as jnp

    from sprint_jax.dtypes import dtype_of

    dt = dtype_of(config.dtype)
    shapes = weight_shapes(config)
    keys = jax.random.split(jax.random.key(2), len(shapes))
    ws = [jax.random.normal(k, s, jnp.float32).astype(dt) for k, s in zip(keys, shapes)]
    n = sum(a * b for a, b in shapes)
    item = jnp.dtype(dt).itemsize
    widest = max(a for a, _ in shapes)

    @jax.jit
    def step(x, ws):
        return sum(jnp.sum(x[:, :w.shape[0]] @ w) for w in ws)

    out = []
    for r in rows:
        t = _best_time(lambda x: step(x, ws), jnp.ones((r, widest), dt), repeats)
        out.append({"rows": r, "s": t, "weights": n, "bytes_per_s": n * item / t, "flops_per_s": 2.0 * n * r / t})
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def model_config(size: str, dtype: str):
    from sprint_jax.model import Qwen2Config
    return Qwen2Config(**MODEL_SIZES[size], max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, param_dtype=dtype, dtype=dtype)


def make_engine(config, recs: list[dict], seed: int, decode_chunk: int = 16, per_layer_weights: bool = True):
    """An engine of one sequence slot sized for `recs`, on random weights of `config`."""
    import jax

    from sprint_jax.bench.decode import synthetic_tokenizer
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model import Qwen2, init_params

    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))
    return Engine(Qwen2(config, params=params), synthetic_tokenizer(config.vocab_size), max_seqs=1,
                  decode_chunk=decode_chunk, prefill_chunk=256, eos_token_ids=[],
                  per_layer_weights=per_layer_weights, **capacities(recs))


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


HEADER = (f"{'problem':<22} {'SPRINT_s':>9} {'RFT_s':>8} {'S/R':>6} {'pred SPRINT_s':>13} {'pred RFT_s':>10} "
          f"{'pred S/R':>8} {'steps S/R':>9}")


def run_replay_bench(args: argparse.Namespace) -> int:
    """Replay, measure, predict; print the tables and the targets, write --json."""
    import jax

    from sprint_jax.model import param_count
    from sprint_jax.plan.records import load_records, predict

    for flag in ("repeats", "probe_repeats", "decode_chunk"):
        if getattr(args, flag) < 1:
            raise _user_error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    records = load_records(args.records)
    keys = paired(records, args.problems)
    chosen = {m: {k: records[m][k] for k in keys} for m in ("sprint", "rft")}
    load_start = _loadavg()
    t_start = time.perf_counter()
    config = model_config(args.model_size, args.dtype)
    n_params = param_count(config)
    engine = make_engine(config, [r for m in chosen.values() for r in m.values()], args.seed, args.decode_chunk,
                         not args.stacked_weights)
    ncpu = os.cpu_count() or 1
    print(f"bench replay: {jax.devices()[0].device_kind} ({jax.default_backend()}), model {args.model_size} "
          f"({n_params / 1e6:.1f}M params, {args.dtype}, {'stacked' if args.stacked_weights else 'per-layer'} "
          f"weights), {len(keys)} problems, repeats {args.repeats}, decode_chunk {args.decode_chunk}; "
          f"load average {load_start} on {ncpu} CPUs")
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    calls = {m: {k: replay(engine, chosen[m][k], rng) for k in keys} for m in ("sprint", "rft")}
    warm_s = time.perf_counter() - t0
    print(f"untimed first replay of every problem (compiles): {warm_s:.1f} s")
    samples: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in ("sprint", "rft")}
    for r in range(args.repeats):
        for k in keys:
            for m in (("sprint", "rft") if r % 2 == 0 else ("rft", "sprint")):
                t = time.perf_counter()
                replay(engine, chosen[m][k], rng)
                samples[m][k].append(time.perf_counter() - t)
    del engine
    probe = measure_cpu(args.probe_repeats)
    widths = sorted({1} | {len(st["executions"]) for r in chosen["sprint"].values() for st in r["stages"]
                           if _executors_run(st)})
    rows_probe = measure_rows(config, widths, args.probe_repeats)
    chip = MeasuredChip(f"this CPU ({ncpu} cores)", probe["flops_per_s"], probe["matvec_bytes_per_s"])
    pred = predict(chosen, config, chip, decode_chunk=args.decode_chunk)
    load_end = _loadavg()

    best = {m: {k: min(v) for k, v in samples[m].items()} for m in samples}
    rows = []
    print(f"this CPU: {probe['flops_per_s'] / 1e9:.1f} GFLOP/s ({MATMUL_N}^3 fp32 matmul), "
          f"{probe['matvec_bytes_per_s'] / 1e9:.2f} GB/s (matrix-vector over {probe['stream_bytes'] / 2**20:.0f} MiB; "
          f"jnp.sum over it: {probe['sum_bytes_per_s'] / 1e9:.2f} GB/s, not used)")
    one = rows_probe[0]["s"]
    print("the model's matmuls alone (" + f"{rows_probe[0]['weights'] / 1e6:.0f}M weights): "
          + ", ".join(f"{p['rows']} row(s) {p['s'] * 1e3:.1f} ms ({p['s'] / one:.2f}x, "
                      f"{p['bytes_per_s'] / 1e9:.2f} GB/s, {p['flops_per_s'] / 1e9:.1f} GFLOP/s)" for p in rows_probe))
    print("measured = best wall clock of the replay; predicted = plan.records on this CPU's figures")
    print(HEADER)
    print("-" * len(HEADER))
    for k in keys:
        ps, pr = pred["per_problem"]["sprint"][k], pred["per_problem"]["rft"][k]
        row = dict(problem=k, sprint_s=best["sprint"][k], rft_s=best["rft"][k],
                   ratio=best["sprint"][k] / best["rft"][k], predicted_sprint_s=ps["latency_s"],
                   predicted_rft_s=pr["latency_s"], predicted_ratio=ps["latency_s"] / pr["latency_s"],
                   sprint_steps=ps["decode_steps"], rft_steps=pr["decode_steps"],
                   sprint_samples_s=samples["sprint"][k], rft_samples_s=samples["rft"][k],
                   sprint_calls=calls["sprint"][k], rft_calls=calls["rft"][k])
        rows.append(row)
        print(f"{k:<22} {row['sprint_s']:>9.2f} {row['rft_s']:>8.2f} {row['ratio']:>6.3f} "
              f"{row['predicted_sprint_s']:>13.2f} {row['predicted_rft_s']:>10.2f} {row['predicted_ratio']:>8.3f} "
              f"{str(row['sprint_steps']) + '/' + str(row['rft_steps']):>9}")
    total = {m: sum(best[m].values()) for m in best}
    ptotal = {m: pred["total"][m]["latency_s"] for m in ("sprint", "rft")}
    ratio = total["sprint"] / total["rft"]
    print("-" * len(HEADER))
    print(f"{'total':<22} {total['sprint']:>9.2f} {total['rft']:>8.2f} {ratio:>6.3f} {ptotal['sprint']:>13.2f} "
          f"{ptotal['rft']:>10.2f} {pred['ratio']:>8.3f}")
    print()
    print(f"{'mode':<8} {'measured_s':>10} {'predicted_s':>11} {'predicted/measured':>18}")
    within = {}
    for m, name in (("sprint", "SPRINT"), ("rft", "RFT")):
        within[m] = ptotal[m] / total[m]
        print(f"{name:<8} {total[m]:>10.2f} {ptotal[m]:>11.2f} {within[m]:>18.3f}")
    targets = [dict(name="SPRINT / RFT wall clock <= 0.80 at concurrency 1", met=ratio <= 0.80,
                    figure=round(ratio, 3)),
               dict(name="predicted within 25% of measured, SPRINT and RFT",
                    met=all(abs(w - 1) <= 0.25 for w in within.values()),
                    figure={m: round(w, 3) for m, w in within.items()})]
    print()
    for t in targets:
        print(f"  [{'MET' if t['met'] else 'NOT MET'}] {t['name']}: {json.dumps(t['figure'])}")
    total_s = time.perf_counter() - t_start
    print(f"total {total_s:.0f} s; load average start {load_start} end {load_end}")
    if args.json:
        report = dict(benchmark="replay", records=str(args.records), model_size=args.model_size, dtype=args.dtype,
                      param_count=n_params, config=dataclasses.asdict(config), cpu_count=ncpu,
                      per_layer_weights=not args.stacked_weights, decode_chunk=args.decode_chunk,
                      repeats=args.repeats, loadavg_start=load_start, loadavg_end=load_end, total_s=total_s,
                      compile_replay_s=warm_s, cpu=probe, matmul_rows=rows_probe, chip=dataclasses.asdict(chip), rows=rows,
                      total=dict(measured=total, predicted=ptotal, ratio=ratio, predicted_ratio=pred["ratio"],
                                 predicted_over_measured=within),
                      timing="best (min) wall clock over --repeats per problem and mode, SPRINT and RFT "
                             "alternating per problem; an untimed replay of every problem first",
                      targets=targets)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0
