"""`sprint-jax plan train|engine|rl ...`: compile the SFT step, the inference engine's programs or
an RL config's policy-gradient update for TPU slices or NVIDIA GPU nodes from this host, and print what each chip
would hold, its headroom, and the roofline (engine: also the capacity that fits and, from eval
records, SPRINT's and RFT's latency).
"""
from __future__ import annotations

import os

# Planning compiles for TPU chips that are not here; the process itself runs on the CPU. With
# libtpu installed and JAX_PLATFORMS unset, JAX would first probe for a local TPU (seconds, and
# warnings) before falling back. Set before jax is imported; a value the user set is kept.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from sprint_jax.errors import UserError  # noqa: E402

DESCRIPTION = """Plan a run on TPU slices or NVIDIA GPU nodes from this (CPU) host: the step is
compiled by XLA's TPU or GPU compiler for the named slice (compile-only topologies; nothing is
allocated), and each row shows whether it compiled, the bytes one chip holds (memory_analysis), the chip's HBM and the
headroom, the planner's own estimate, and FLOPs, HBM traffic and the roofline step time.

Slices: libtpu topology names (v5p:2x2x2, v5e:2x4, v6e:4x4) or the accelerator types Cloud TPU
books (v5p-16 = 8 chips: v5p counts TensorCores, two per chip; v5litepod-8 and v6e-8 = 8 chips).
Needs libtpu: pip install -e '.[tpu]'. GPUs: h100:8 (one node of 8), h100:2x8 (two nodes), h100:1,
h200:8, a100-80g:8, b200:8; tensor parallelism stays inside a node. Needs jax's CUDA plugin (no
GPU, driver or CUDA): pip install 'jax-cuda12-plugin==<the jax version>'.

A step that does not fit exits 2 with one line on stderr: what does not fit, by how much, and a
change that fits by the planner's estimate.

`plan engine` compiles the engine's own programs over its paged KV pool (a prefill chunk, a decode
call of C planner rows, one of C runs x K executors, a merge join's copy) at the capacities an
Engine(max_seqs=C, max_children=K, max_seq_len=S, page_size=ps, num_pages=P) holds, sets the
planner's estimate (weights under tensor parallelism + the pool's pages over data and heads over
tensor + temporaries) beside the compiler's bytes, and gives the roofline ms per decode step at 1
row, K executors and C runs x K, the largest concurrency and executor width that fit, and with
--records DIR the predicted SPRINT and RFT latency of a directory of eval records on that chip.
With --lengths (eval records, or `synthetic`) it reports how many runs of that length distribution
one slice holds: the paged engine (the pool is what the chips hold beside the weights and the
programs' temporaries; N runs fit when N runs drawn from the distribution overflow the pool with
probability < 1%, by a seeded Monte Carlo) against the slot engine (every run reserves
max_seq_len + K x max_branch_tokens), and compiles the programs at the paged engine's fit
(--concurrency, when given, instead).

`plan rl CONFIG` compiles an RL config's update as the RL trainer builds it: the grad step of one
microbatch (loss.rows_per_micro x loss.seq_len, with the old / reference log-prob inputs the
config asks for), the log-prob forward when they are needed, and the AdamW apply step, on the
config's mesh; a grad row's headroom also counts the AdamW moments, the running gradient sum and
the reference weights the chip holds beside it. Under the table: the rollout engine's estimate and
the `plan engine` command that compiles its programs.

examples:
  sprint-jax plan engine --model r1-distill-qwen-7b --concurrency 32 --executors 8 --capacity 16384 --topology v5p-8,v5litepod-16 --search
  sprint-jax plan engine --model r1-distill-qwen-7b --concurrency 8 --executors 8 --capacity 8192 --mesh tensor=4 --topology v5e:2x2 --records runs/eval
  sprint-jax plan engine --model r1-distill-qwen-7b --executors 8 --capacity 32768 --branch-capacity 4096 --prefill-chunk 64 --lengths synthetic --topology v5p-8
  sprint-jax plan train --model r1-distill-qwen-7b --batch 8 --seq-len 8192 --mesh fsdp=8 --topology v5p:2x2x2
  sprint-jax plan train --model r1-distill-qwen-7b --batch 8 --seq-len 8192 --layout trie --topology h100:8
  sprint-jax plan train --config configs/sft_r1_distill_7b_sprint.yaml --topology v5p-16
  sprint-jax plan train --model qwen3-8b --batch 8 --seq-len 32768 --topology v5p:4x4x4 --search
  sprint-jax plan rl configs/rl_r1_distill_7b.yaml --model r1-distill-qwen-7b --topology v5p-16
"""

PROGRAMS = ("train", "engine", "rl")


def fit_text() -> str:
    from sprint_jax.plan.fit import SYNTHETIC_TEXT
    return SYNTHETIC_TEXT.replace("%", "%%")


_MEMORY_COLS = [("program", "<"), ("topology", "<"), ("mesh", "<"), ("compiled", "<"), ("compile s", ">"),
                ("GiB/chip", ">"), ("HBM GiB", ">"), ("headroom", ">"), ("est GiB", ">")]


def _memory_cells(r: dict) -> list[str]:
    """A row's cells under _MEMORY_COLS: what was compiled where, and its per-chip memory."""
    total = r["per_chip_bytes"]["total"] if r["per_chip_bytes"] else None
    return [r["program"], f"{r['topology']} ({r['accelerator_type']})",
            ",".join(f"{k}={v}" for k, v in r["mesh"].items()), "yes" if r["compiled"] else "no",
            f"{r['compile_s']:.0f}", _gib(total), f"{r['hbm_bytes'] / 2 ** 30:.0f}",
            "-" if r["headroom"] is None else f"{r['headroom'] * 100:.0f}%", _gib(r["estimate_bytes"])]


def chip_line(chip) -> str:
    """The published figures of a TPU chip or a GPU, one line."""
    if chip.platform == "gpu":
        cc = ".".join(map(str, chip.compute_capability))
        return (f"{chip.name}: {chip.product}, {chip.hbm_gib:g} GiB HBM at {chip.hbm_bandwidth / 1e9:g} GB/s, "
                f"{chip.peak_flops / 1e12:g} TFLOP/s bf16 dense, NVLink {chip.nvlink_bandwidth / 1e9:g} GB/s, "
                f"{chip.internode_bandwidth / 1e9:g} GB/s between nodes, {chip.smem_per_block // 1024} KiB shared "
                f"memory per block, compute capability {cc} ({chip.source}); a JAX process takes 75% of a GPU's "
                f"memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says more (e.g. 0.95)")
    return (f"{chip.name}: {chip.hbm_gib:g} GiB HBM, {chip.peak_flops / 1e12:g} TFLOP/s bf16, "
            f"{chip.hbm_bandwidth / 1e9:g} GB/s per chip (published figures)")


def _print_table(cols: list[tuple[str, str]], cells: list[list[str]]) -> None:
    """A header, a rule and one line per row; `cols` is [(name, format alignment)], cells are strings."""
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _) in enumerate(cols)]

    def line(values):
        return "  ".join(f"{v:{align}{w}}" for v, (_, align), w in zip(values, cols, widths)).rstrip()

    print(line([name for name, _ in cols]))
    print("-" * sum(w + 2 for w in widths))
    for c in cells:
        print(line(c))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", choices=PROGRAMS, help="what to plan (train: the SFT step; engine: the inference "
                                                     "engine's programs; rl: an RL config's update)")
    p.add_argument("rl_config", nargs="?", metavar="CONFIG",
                   help="plan rl: the RL run config (configs/rl_*.yaml); --set overrides it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="plan rl: override a field of the RL config (e.g. loss.rows_per_micro=8)")
    p.add_argument("--config", help="an SFT run config (configs/sft_*.yaml): model, batch, seq_len, layout, "
                                    "remat, grad_accum and mesh from it; flags override")
    p.add_argument("--model", help="model preset or HF config path (default: the config's model)")
    p.add_argument("--batch", type=int, help="rows per optimizer step (global)")
    p.add_argument("--seq-len", type=int, help="tokens per row")
    p.add_argument("--layout", choices=("flat", "trie", "merge"),
                   help="data layout: flat runs splash attention, trie and merge our Mosaic kernel (default flat)")
    p.add_argument("--remat", choices=("none", "full", "dots"), help="rematerialisation policy (default full)")
    p.add_argument("--grad-accum", type=int, help="microbatches per step (default 1)")
    p.add_argument("--loss-chunk", type=int, help="tokens per vocab-projection chunk (default 1024; 0 = off)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default bfloat16)")
    p.add_argument("--mesh", help="mesh sizes, e.g. fsdp=8,tensor=1 (default: fsdp takes every chip)")
    p.add_argument("--topology", "--chips", dest="topology", required=True,
                   help="slice(s), comma-separated: v5p:2x2x2, v5e:2x4, v5p-16, v5litepod-8, v6e-8, or GPU "
                        "nodes h100:8, h100:2x8, h200:8, a100-80g:8, b200:8")
    p.add_argument("--search", action="store_true",
                   help="find the smallest slice (up to each named one) and mesh that the compiler accepts")
    p.add_argument("--json", dest="json_out", help="write the rows as a JSON list to this file")
    e = p.add_argument_group("plan engine")
    e.add_argument("--concurrency", type=int, help="runs held at once: the engine's max_seqs (parent slots)")
    e.add_argument("--executors", type=int, help="executors per run: the engine's max_children (child slots)")
    e.add_argument("--capacity", type=int, help="tokens a run's context holds: the engine's max_seq_len")
    e.add_argument("--branch-capacity", type=int,
                   help="tokens an executor holds after its fork: max_branch_tokens (default: --capacity)")
    e.add_argument("--decode-chunk", type=int, default=16, help="decode steps per call (default 16)")
    e.add_argument("--prefill-chunk", type=int, default=256, help="tokens per prefill call (default 256)")
    e.add_argument("--attention", choices=("pallas", "xla"), default="pallas",
                   help="the decode step's parent-prefix attention: pallas (the Mosaic kernel) or xla (default pallas)")
    e.add_argument("--weights-dtype", choices=("bfloat16", "float32"),
                   help="the weights' dtype when not the compute dtype (default: the compute dtype); float32 is "
                        "the RL trainer's rollout engine, which reads the trainer's fp32 master weights")
    e.add_argument("--set-mesh", action="store_true",
                   help="no effect, the default: the programs are traced under the mesh as the active mesh, as the "
                        "engine traces them (kept so that older command lines still run)")
    e.add_argument("--programs", help="compile only these, comma-separated: decode_stage, decode_planner, prefill, "
                                      "join_copy (default all)")
    e.add_argument("--records", help="a directory of eval records (records.jsonl of a SPRINT eval and of its RFT "
                                     "baseline, anywhere under it): predict each problem's latency on the chip")
    e.add_argument("--page-size", type=int, default=16, help="tokens per page of the KV pool (default 16)")
    e.add_argument("--pages", type=int, help="pages in the KV pool (default: the Engine's, every run at its "
                                            "capacity; with --lengths: what the chips hold at the fit)")
    e.add_argument("--lengths", metavar="RECORDS|synthetic",
                   help="a length distribution of SPRINT runs: eval records (a records.jsonl or a directory of "
                        "them; each run's prompt, planner and executor tokens) or 'synthetic': "
                        + fit_text() + ". Prints the runs that fit the slice, paged vs slot engine")


def _request(args: argparse.Namespace) -> tuple[str, dict]:
    """(model name as shown, step fields) from --config and the flags."""
    fields = {"batch": None, "seq_len": None, "layout": "flat", "remat": "full", "grad_accum": 1,
              "loss_chunk": 1024, "dtype": "bfloat16", "mesh": None, "overrides": {}}
    model = None
    if args.config:
        from sprint_jax.train.config import load_train_config
        cfg = load_train_config(args.config)
        model = cfg.model.name
        fields.update(batch=cfg.optim.batch_size, seq_len=cfg.data.seq_len, layout=cfg.data.layout,
                      remat=cfg.model.remat, grad_accum=cfg.optim.grad_accum, loss_chunk=cfg.model.loss_chunk,
                      dtype=cfg.model.dtype, overrides=dict(cfg.model.overrides),
                      mesh={"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor})
    for key in ("batch", "seq_len", "layout", "remat", "grad_accum", "loss_chunk", "dtype"):
        value = getattr(args, key)
        if value is not None:
            fields[key] = value
    if args.model:
        model = args.model
    if model is None:
        raise UserError("name a model: --model PRESET (or --config configs/sft_*.yaml)")
    for key, flag in (("batch", "--batch"), ("seq_len", "--seq-len")):
        if fields[key] is None:
            raise UserError(f"{flag} is required (or --config)")
        if fields[key] < 1:
            raise UserError(f"{flag} must be >= 1, got {fields[key]}")
    if fields["grad_accum"] < 1:
        raise UserError(f"--grad-accum must be >= 1, got {fields['grad_accum']}")
    if fields["loss_chunk"] < 0:
        raise UserError(f"--loss-chunk must be >= 0, got {fields['loss_chunk']}")
    return model, fields


def _model_config(model, overrides: dict, dtype: str, progress):
    """The model's config; a checkpoint directory that is not on this host is planned as the
    preset its name ends with (a config written for the TPU host names its local checkpoint)."""
    from sprint_jax.config import CONFIG_DIR, ConfigError
    from sprint_jax.model.config import resolve_model_config

    label = "config"
    if isinstance(model, str):      # a checkpoint directory or config file is named by its own name
        path = Path(model)
        label = (path.parent.name if path.name == "config.json" else path.stem) if path.exists() else model
    try:
        cfg = resolve_model_config(model, **overrides)
    except ConfigError:
        if not isinstance(model, str) or Path(model).exists():
            raise
        presets = sorted((p.stem[len("model_"):] for p in CONFIG_DIR.glob("model_*.json")), key=len, reverse=True)
        base = Path(model).name.lower()
        match = next((p for p in presets if base == p or base.endswith("-" + p) or base.endswith(p)), None)
        if match is None:
            raise UserError(f"model {model!r} is neither a preset nor a checkpoint directory on this host; "
                            f"pass --model PRESET (presets: {', '.join(sorted(presets))})") from None
        progress(f"model {model} is not on this host: planning the preset {match}")
        cfg, label = resolve_model_config(match, **overrides), match
    return cfg.replace(param_dtype="float32", dtype=dtype), label


def _progress(msg: str) -> None:
    print(f"plan: {msg}", file=sys.stderr, flush=True)


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2 ** 30:.2f}"


def print_table(rows: list[dict], chips_used: list) -> None:
    """The rows as one table (columns as wide as their widest cell), the chip figures under it."""
    cols = _MEMORY_COLS + [("TFLOP/step", ">"), ("HBM GB/chip", ">"), ("roofline s", ">"), ("MFU bound", ">"),
                           ("tokens/s", ">")]
    cells = []
    for r in rows:
        cells.append(_memory_cells(r) + [
            f"{r['flops'] / 1e12:.1f}", f"{r['hbm_traffic_bytes'] / 1e9:.1f}", f"{r['roofline_s']:.3f}",
            f"{r['mfu_bound'] * 100:.0f}%", f"{r['tokens_per_s']:.0f}"])
    _print_table(cols, cells)
    for chip in chips_used:
        print(chip_line(chip))
    print("GiB/chip: XLA's memory_analysis (arguments + outputs - aliased + temp); est: the planner's own "
          "estimate; TFLOP/step: model FLOPs (6 x weights x tokens + causal attention); roofline: max of "
          "compute (with remat's recompute) and HBM time per chip, communication not included")


def run(args: argparse.Namespace) -> int:
    if args.program == "rl":
        return run_rl(args)
    if args.rl_config or args.overrides:
        raise UserError(f"plan {args.program} takes no CONFIG argument or --set (plan train reads --config)")
    if args.program == "engine":
        return run_engine(args)
    from sprint_jax.plan import train as plan_train
    from sprint_jax.plan.chips import parse_slices
    from sprint_jax.plan.compile import compiler_available
    from sprint_jax.plan.estimate import StepShape

    slices = parse_slices(args.topology)
    model, f = _request(args)
    sizes = plan_train.parse_mesh(args.mesh) if args.mesh else (f["mesh"] or plan_train.parse_mesh(None))
    if sum(v == -1 for v in sizes.values()) > 1:
        raise UserError(f"mesh {sizes}: at most one axis may be -1")
    cfg, label = _model_config(model, f["overrides"], f["dtype"], _progress)
    if f["seq_len"] > cfg.max_position_embeddings:
        raise UserError(f"--seq-len {f['seq_len']} is past the model's max_position_embeddings "
                        f"({cfg.max_position_embeddings}); the trainer refuses it too")
    compiler_available(slices)
    rows, failures = [], []
    for where in slices:
        base = StepShape(cfg, f["batch"], f["seq_len"], f["grad_accum"], (1, 1, 1), f["remat"],
                         f["loss_chunk"], f["layout"])
        if args.search:
            found, tried = plan_train.search(base, where, label, _progress)
            rows.extend(tried)
            if found is None:
                biggest = dataclasses.replace(base, mesh=(1, where.chips, 1))
                failures.append(f"search: no {where.chip.name} slice up to {where.name} ({where.booking}) and "
                                f"no mesh on it fits {plan_train.program_name(base, label)}; "
                                f"{plan_train.way_out(biggest, where)}")
            else:
                _progress(f"search: {found['topology']} ({found['accelerator_type']}) mesh "
                          f"{','.join(f'{k}={v}' for k, v in found['mesh'].items())} fits "
                          f"({found['headroom'] * 100:.0f}% headroom)")
            continue
        mesh = plan_train.resolve_mesh(sizes, where.chips, where.name)
        shape = StepShape(cfg, f["batch"], f["seq_len"], f["grad_accum"], mesh, f["remat"], f["loss_chunk"],
                          f["layout"])
        plan_train.check_divisible(shape, where.name)
        row = plan_train.plan_row(shape, where, label, _progress)
        rows.append(row)
        if not row["fits"]:
            if row["compiled"] or row["compiler_oom"] or row["state_bytes"] > where.chip.hbm_bytes:
                failures.append(plan_train.not_fit_line(row, shape, where))
            else:
                failures.append(f"{row['program']} on {where.name} mesh "
                                f"{','.join(f'{k}={v}' for k, v in row['mesh'].items())}: {row['error']}")
    if rows:
        print_table(rows, sorted({s.chip for s in slices}, key=lambda c: c.name))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    for line in failures:
        print(f"sprint-jax plan: error: {line}", file=sys.stderr)
    return 2 if failures else 0


# ---------------------------------------------------------------------------------------------
# plan engine
# ---------------------------------------------------------------------------------------------
def parse_engine_mesh(text: str | None) -> dict[str, int]:
    """`tensor=4` -> {'data': -1, 'fsdp': 1, 'tensor': 4}: the engine splits runs over data (the
    rest of the chips unless given) and heads over tensor."""
    sizes = {"data": -1, "fsdp": 1, "tensor": 1}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in sizes:
            raise UserError(f"--mesh {text!r}: write AXIS=SIZE pairs with axes data, fsdp, tensor (e.g. tensor=4)")
        try:
            n = int(value)
        except ValueError:
            raise UserError(f"--mesh {text!r}: {key}={value.strip()!r} is not an integer") from None
        if n < 1:
            raise UserError(f"--mesh {text!r}: {key} must be >= 1")
        sizes[key] = n
    return sizes


def _engine_shape_args(args):
    needed = (("--executors", args.executors), ("--capacity", args.capacity))
    if not args.lengths:        # with --lengths the runs that fit set it
        needed = (("--concurrency", args.concurrency),) + needed
    for flag, value in needed:
        if value is None:
            raise UserError(f"plan engine needs {flag}")
    for flag, value in (("--concurrency", args.concurrency), ("--executors", args.executors),
                        ("--capacity", args.capacity), ("--branch-capacity", args.branch_capacity),
                        ("--decode-chunk", args.decode_chunk), ("--prefill-chunk", args.prefill_chunk),
                        ("--page-size", args.page_size), ("--pages", args.pages)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")


def print_engine_table(rows: list[dict], chips_used: list) -> None:
    """The engine rows as one table, the decode roofline and chip figures under it."""
    cols = _MEMORY_COLS + [("GFLOP", ">"), ("HBM GB/chip", ">"), ("roofline ms", ">")]
    cells = []
    for r in rows:
        cells.append(_memory_cells(r) + [
            f"{r['flops'] / 1e9:.1f}", f"{r['hbm_traffic_bytes'] / 1e9:.2f}", f"{r['roofline_s'] * 1e3:.2f}"])
    _print_table(cols, cells)
    seen = set()
    for r in rows:
        key = (r["engine"], r["topology"], tuple(r["mesh"].values()))
        if "decode_ms" in r and key not in seen:
            seen.add(key)
            ms = ", ".join(f"{k} {v:.2f} ms" for k, v in r["decode_ms"].items())
            cap = r.get("capacity") or {}
            print(f"{r['engine']} on {r['topology']} mesh {','.join(f'{k}={v}' for k, v in r['mesh'].items())}: "
                  f"decode step at full context: {ms}; fits by the estimate: up to {cap.get('max_concurrency')} "
                  f"runs at this width, up to {cap.get('max_executors')} executors at this concurrency")
    for chip in chips_used:
        print(chip_line(chip))
    print("GiB/chip: XLA's memory_analysis (arguments + outputs - aliased + temp); est: the planner's own "
          "estimate; GFLOP, HBM GB and roofline: per chip for one call of the program at full context (a decode "
          "program: one step), max of compute and HBM time, communication not included")


def run_engine(args: argparse.Namespace) -> int:
    from sprint_jax.plan import engine as pe
    from sprint_jax.plan.chips import parse_slices
    from sprint_jax.plan.compile import compiler_available
    from sprint_jax.plan.train import resolve_mesh

    slices = parse_slices(args.topology)
    if args.model is None:
        raise UserError("plan engine needs --model PRESET (or a HF config path)")
    _engine_shape_args(args)
    sizes = parse_engine_mesh(args.mesh)
    cfg, label = _model_config(args.model, {}, args.dtype or "bfloat16", _progress)
    branch = args.branch_capacity or args.capacity
    if args.capacity + args.decode_chunk > cfg.max_position_embeddings:
        raise UserError(f"--capacity {args.capacity} (+ a decode chunk of {args.decode_chunk}) is past the model's "
                        f"max_position_embeddings ({cfg.max_position_embeddings})")
    records = None
    if args.records:
        from sprint_jax.plan.records import load_records
        records = load_records(args.records)
    kinds = None
    if args.programs:
        kinds = tuple(k.strip() for k in args.programs.split(",") if k.strip())
        if kinds == ("none",) and args.lengths:
            kinds = ()
        unknown = sorted(set(kinds) - set(pe.KINDS))
        if unknown or (not kinds and not args.lengths):
            raise UserError(f"--programs {args.programs!r}: unknown {', '.join(unknown) or 'empty'}; "
                            f"known: {', '.join(pe.KINDS)} (and none, with --lengths)")
    runs = _lengths(args, branch) if args.lengths else None
    if args.lengths and args.search:
        raise UserError("--lengths fits runs on the named slices and meshes: drop --search")
    if kinds != ():
        compiler_available(slices)
    weights = args.weights_dtype if args.weights_dtype not in (None, cfg.dtype) else None
    base = pe.EngineShape(cfg, args.concurrency or 1, args.executors, args.capacity, branch, (1, 1, 1),
                          args.decode_chunk, args.prefill_chunk, args.attention, weights, args.page_size, args.pages)
    rows, failures, accepted = [], [], []
    for where in slices:
        if runs is not None:
            shape, fit_row = _fit_slice(base, where, sizes, runs, args, label)
            rows.append(fit_row)
            if shape is None:
                failures.append(f"{pe.shape_label(base, label)} on {where.name}: not one run of --lengths "
                                f"{args.lengths} fits the chips beside the weights and the programs' temporaries")
                continue
            if kinds == ():
                continue
            rows_here = pe.engine_rows(shape, where, label, _progress, kinds=kinds)
            rows.extend(rows_here)
            accepted.extend(r for r in rows_here if r["fits"])
            bad = next((r for r in rows_here if not r["fits"]), None)
            if bad is not None:
                failures.append(pe.not_fit_line(shape, where, label, rows_here) if bad["compiled"] or bad["compiler_oom"]
                                else f"{bad['program']} ({bad['engine']}) on {where.name} mesh "
                                     f"{pe.mesh_text(shape.mesh)}: {bad['error']}")
            continue
        if args.search:
            found, tried = pe.search(base, where, label, _progress, kinds)
            rows.extend(tried)
            if found is None:
                top = dataclasses.replace(base, mesh=(where.chips, 1, 1))
                broken = [r for r in tried if not r["compiled"] and not r["compiler_oom"]]
                if broken:
                    failures.append(f"search: {broken[0]['program']} on {broken[0]['topology']} mesh "
                                    f"{pe.mesh_text(tuple(broken[0]['mesh'].values()))} did not compile: "
                                    f"{broken[0]['error']}")
                else:
                    failures.append(f"search: no {where.chip.name} slice up to {where.name} ({where.booking}) and no "
                                    f"mesh on it holds {pe.shape_label(base, label)}; {pe.way_out(top, where)}")
            else:
                accepted.extend(found)
                _progress(f"search: {found[0]['topology']} ({found[0]['accelerator_type']}) mesh "
                          f"{','.join(f'{k}={v}' for k, v in found[0]['mesh'].items())} holds "
                          f"{pe.shape_label(base, label)} (least headroom "
                          f"{min(r['headroom'] for r in found) * 100:.0f}%)")
            continue
        data, fsdp, tensor = resolve_mesh(sizes, where.chips, where.name)
        shape = dataclasses.replace(base, mesh=(data, fsdp, tensor))
        if not pe.fits(shape, where.chip.hbm_bytes, fill=1.0):
            failures.append(pe.not_fit_line(shape, where, label))
            continue
        rows_here = pe.engine_rows(shape, where, label, _progress, kinds=kinds)
        rows.extend(rows_here)
        if all(r["fits"] for r in rows_here):
            accepted.extend(rows_here)
        elif any(r["compiled"] or r["compiler_oom"] for r in rows_here if not r["fits"]) and \
                all(r["compiled"] or r["compiler_oom"] for r in rows_here):
            failures.append(pe.not_fit_line(shape, where, label, rows_here))
        else:
            bad = next(r for r in rows_here if not r["compiled"])
            failures.append(f"{bad['program']} ({bad['engine']}) on {where.name} mesh "
                            f"{pe.mesh_text(shape.mesh)}: {bad['error']}")
    for r in rows:
        if r.get("kind", "").startswith("decode"):
            shape = dataclasses.replace(base, mesh=tuple(r["mesh"].values()), concurrency=r["concurrency"],
                                        num_pages=r["pool_pages"])
            r["capacity"] = pe.capacity(shape, r["hbm_bytes"])
    if records is not None:
        from sprint_jax.plan.records import predict
        for where in slices:
            # the tensor parallelism of the mesh accepted on this slice, else the one asked for
            held = next((r for r in accepted if r["topology"] == where.name), None)
            tensor = held["mesh"]["tensor"] if held else (sizes["tensor"] if not args.search else 1)
            pred = predict(records, cfg, where.chip, tensor, args.decode_chunk)
            rows.append({"program": "latency from records", "topology": where.name,
                         "accelerator_type": where.booking, "records": args.records, **pred})
            _print_prediction(pred, where, tensor)
    program_rows = [r for r in rows if "kind" in r]
    if program_rows:
        print_engine_table(program_rows, sorted({s.chip for s in slices}, key=lambda c: c.name))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    for line in failures:
        print(f"sprint-jax plan: error: {line}", file=sys.stderr)
    return 2 if failures else 0


def _lengths(args: argparse.Namespace, branch: int) -> list:
    """The runs of --lengths: eval records or the synthetic distribution."""
    from sprint_jax.plan import fit

    if args.lengths == "synthetic":
        runs = fit.synthetic_runs(args.executors, args.capacity, branch)
        _progress(f"lengths: synthetic, {len(runs)} runs ({fit.SYNTHETIC_TEXT})")
        return runs
    runs = fit.runs_from_records(args.lengths)
    wide = max(r.widest for r in runs)
    if wide > args.executors:
        raise UserError(f"--lengths {args.lengths}: a run forks {wide} executors, more than --executors "
                        f"{args.executors}")
    return runs


def _fit_slice(base, where, sizes: dict, runs: list, args: argparse.Namespace, label: str):
    """The runs of `runs` that `where` holds (`plan.fit.fit`), printed; returns (the shape to
    compile: --concurrency, else the paged engine's fit, with the pool that fits beside it; or
    None when no run fits) and the row for --json."""
    from sprint_jax.plan import engine as pe
    from sprint_jax.plan import fit as pf
    from sprint_jax.plan.train import resolve_mesh

    mesh = resolve_mesh(sizes, where.chips, where.name)
    shape = dataclasses.replace(base, mesh=mesh)
    f = pf.fit(shape, where.chip.hbm_bytes, runs)
    tr, pg = f["trace_tokens"], f["run_pages"]
    print(f"lengths {args.lengths}: {f['runs']} runs, trace tokens mean {tr['mean']:.0f}, median {tr['median']:.0f}, "
          f"p99 {tr['p99']:.0f}, max {tr['max']}; pages a run holds at its peak (of {shape.page_size} tokens) "
          f"mean {pg['mean']:.0f}, p99 {pg['p99']:.0f}, max {pg['max']}")
    ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}"
    print(f"runs that fit {where.name} ({where.booking}, mesh {pe.mesh_text(mesh)}, {f['chips']} chips, "
          f"{where.chip.hbm_gib:g} GiB each, {f['fill']:.0%} used): paged engine {f['paged_runs']} "
          f"({f['paged_runs_per_chip']:.1f} a chip; a pool of {f['pool_pages']:,} pages, P(overflow) "
          f"{(f['exceed_probability'] or 0) * 100:.2f}% < {f['p_exceed']:.0%} by {f['trials']} draws); slot engine "
          f"{f['slot_runs']} ({f['slot_runs_per_chip']:.1f} a chip; {f['slot_tokens_per_run']:,} tokens reserved a "
          f"run); paged / slot {ratio}")
    row = {"program": "runs that fit", "topology": where.name, "accelerator_type": where.booking,
           "mesh": shape.mesh_dict, "engine": pe.shape_label(shape, label), "lengths": args.lengths, **f}
    n = args.concurrency or f["paged_runs"]
    if not n:
        return None, row
    pages = args.pages or (f["pool_pages"] if not args.concurrency else
                           pf.pool_pages_for(dataclasses.replace(shape, concurrency=n), where.chip.hbm_bytes,
                                             pe.FILL) * dataclasses.replace(shape, concurrency=n).parts)
    return dataclasses.replace(shape, concurrency=n, num_pages=max(pages, 1)), row


def _print_prediction(pred: dict, where, tensor: int) -> None:
    total = pred["total"]
    print(f"predicted latency on {where.name} ({where.chip.name}, tensor={tensor}; one run at a time, roofline): "
          + ", ".join(f"{mode} {total[mode]['latency_s']:.3f} s over {total[mode]['problems']} problems "
                      f"({total[mode]['decode_steps']} decode steps)" for mode in sorted(total))
          + (f"; SPRINT / RFT {pred['ratio']:.3f}" if pred.get("ratio") is not None else ""))


# ---------------------------------------------------------------------------------------------
# plan rl
# ---------------------------------------------------------------------------------------------
def _rl_config(args: argparse.Namespace):
    """The RL config as the trainer reads it, without needing its policy checkpoint on this host."""
    from sprint_jax.config import ConfigError, load_config, resolve_config_path
    from sprint_jax.rl.config import RLConfig

    path = args.rl_config or args.config
    if not path:
        raise UserError("plan rl needs an RL config: sprint-jax plan rl configs/rl_*.yaml --topology ...")
    if not resolve_config_path(path).is_file():       # configs/NAME: the shipped one outside a checkout
        raise UserError(f"plan rl: no RL config file at {path}")
    for flag in ("batch", "seq_len", "layout", "grad_accum", "concurrency", "executors", "capacity",
                 "branch_capacity", "programs", "records", "weights_dtype"):
        if getattr(args, flag, None) is not None:
            raise UserError(f"plan rl takes its shapes from the RL config: --{flag.replace('_', '-')} is not "
                            f"accepted (use --set, e.g. --set loss.rows_per_micro=8)")
    try:
        return load_config(RLConfig, path, args.overrides)
    except ConfigError as e:
        raise UserError(f"{path}: {e}") from None


def run_rl(args: argparse.Namespace) -> int:
    from sprint_jax.rl import plan as prl
    from sprint_jax.plan.chips import parse_slices
    from sprint_jax.plan.compile import compiler_available
    from sprint_jax.plan.train import resolve_mesh

    slices = parse_slices(args.topology)
    if args.search:
        raise UserError("plan rl does not search: name the slice with --topology and the mesh in the config or --mesh")
    cfg = _rl_config(args)
    if args.remat:
        cfg.policy.remat = args.remat
    if args.loss_chunk is not None:
        if args.loss_chunk < 0:
            raise UserError(f"--loss-chunk must be >= 0, got {args.loss_chunk}")
        cfg.policy.loss_chunk = args.loss_chunk
    if not (args.model or cfg.policy.path):
        raise UserError("plan rl: the config's policy.path is empty: pass --model PRESET")
    model_cfg, label = _model_config(args.model or cfg.policy.path, {}, args.dtype or cfg.policy.dtype,
                                     _progress)
    if args.mesh:
        from sprint_jax.plan.train import parse_mesh
        sizes = parse_mesh(args.mesh)
    else:
        sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
        if sum(v == -1 for v in sizes.values()) > 1:
            raise UserError(f"mesh {sizes}: at most one axis may be -1")
    compiler_available(slices)
    rows, failures, engines = [], [], []
    for where in slices:
        shape = prl.shape_from_config(cfg, model_cfg, resolve_mesh(sizes, where.chips, where.name))
        rows_here = prl.plan_rows(shape, cfg.optim, where, label, _progress)
        rows.extend(rows_here)
        for r in rows_here:
            if not r["compiled"]:
                failures.append(f"{r['program']} on {where.name} mesh {prl.mesh_text(shape.mesh)}: {r['error']}")
            elif not r["fits"]:
                used = r["per_chip_bytes"]["total"] + sum(r["beside_bytes"].values())
                failures.append(f"{r['program']} on {where.name} ({where.booking}, mesh {prl.mesh_text(shape.mesh)}) "
                                f"needs {used / 2 ** 30:.1f} GiB per chip with what it holds beside, "
                                f"{(used - where.chip.hbm_bytes) / 2 ** 30:.1f} GiB over the chip's "
                                f"{where.chip.hbm_gib:g} GiB; more chips in fsdp, tensor parallelism, --remat full or "
                                f"a smaller loss.rows_per_micro")
        engine = prl.rollout_engine(cfg, shape, where, label, args.model or cfg.policy.path)
        engines.append(engine)
        if not engine["fits"]:
            used = max(engine["estimate_bytes_per_chip"].values()) + sum(engine["beside_bytes"].values())
            failures.append(f"the rollout engine on {where.name} (mesh {prl.mesh_text(shape.mesh)}) needs about "
                            f"{used / 2 ** 30:.1f} GiB per chip with the trainer's AdamW moments beside, "
                            f"over the chip's {where.chip.hbm_gib:g} GiB; lower rollout.concurrency (or "
                            f"prompts_per_step x group_size), rollout.max_seq_len or rollout.orchestrator.max_prompts")
        rows.append({"program": "rollout engine", "topology": where.name, "accelerator_type": where.booking,
                     **engine})
    program_rows = [r for r in rows if "kind" in r]
    if program_rows:
        print_rl_table(program_rows, sorted({s.chip for s in slices}, key=lambda c: c.name))
    for e in engines:
        est, held = e["estimate_bytes_per_chip"], e["beside_bytes"]
        print(f"rollout: {e['engine']} on the update's mesh {prl.mesh_text(tuple(e['mesh'].values()))}: KV cache "
              f"{e['cache_bytes_per_chip'] / 2 ** 30:.2f} GiB per chip; each program per chip by the plan engine "
              f"estimate (the trainer's fp32 weight shard and the compute-dtype copy a call gathers or casts): "
              + ", ".join(f"{k} {v / 2 ** 30:.2f}" for k, v in est.items())
              + f" GiB, with {sum(held.values()) / 2 ** 30:.2f} GiB beside ("
              + ", ".join(f"{k} {v / 2 ** 30:.2f}" for k, v in held.items())
              + f"), of {e['hbm_bytes'] / 2 ** 30:g} GiB: {'fits' if e['fits'] else 'DOES NOT FIT'}; "
              f"compile its programs on the slice with: {e['plan_engine_command']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2, default=str) + "\n")
    for line in failures:
        print(f"sprint-jax plan: error: {line}", file=sys.stderr)
    return 2 if failures else 0


def print_rl_table(rows: list[dict], chips_used: list) -> None:
    """The RL update's rows: memory as _MEMORY_COLS (GiB/chip adds what a grad row holds beside),
    then FLOPs and the roofline of one call."""
    cols = _MEMORY_COLS + [("beside GiB", ">"), ("TFLOP", ">"), ("HBM GB/chip", ">"), ("roofline s", ">")]
    cells = []
    for r in rows:
        cells.append(_memory_cells(r) + [_gib(sum(r["beside_bytes"].values())), f"{r['flops'] / 1e12:.2f}",
                                         f"{r['hbm_traffic_bytes'] / 1e9:.2f}", f"{r['roofline_s']:.3f}"])
    _print_table(cols, cells)
    for r in rows:
        if r["kind"] == "grad":
            print(f"{r['program']} on {r['topology']}: {r['flops_per_microbatch_update'] / 1e12:.2f} TFLOP per "
                  f"microbatch per batch (updates x grad + the old / reference log-prob forwards)")
    for chip in chips_used:
        print(chip_line(chip))
    print("GiB/chip: XLA's memory_analysis (arguments + outputs - aliased + temp); beside: AdamW moments, the "
          "running gradient sum and the reference weights held while the grad step runs (in the headroom); est: "
          "the planner's own estimate (with beside); TFLOP: model FLOPs of one call (grad: 6 x weights x tokens "
          "+ causal attention; logp: a third of that); roofline: max of compute and HBM time per chip, "
          "communication not included")
