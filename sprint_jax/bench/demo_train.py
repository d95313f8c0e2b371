"""Demo training throughput of this checkout vs an older one, interleaved on one machine.

`sprint-jax bench demo-train --baseline-tree PATH`: the demo's training (its model, seq_len, batch,
lr; curated digit-chains data, `sprint_jax.demo`) for a few steps, in one fresh process per run,
alternating between an older checkout (PATH: the directory holding its `sprint_jax/` package, e.g.
`git worktree add /tmp/old <commit>` or `git archive <commit> | tar -x -C /tmp/old`) and this one:
A B A B ... for `--reps` rounds and each `--layouts` entry (trie = the demo's SPRINT run, flat = its
RFT run). Each run reads its own tree's `DemoConfig` (so a changed demo config is part of what is
compared); `--seq-len` / `--batch-size` force the same values on both sides for a code-only ratio.

Per run it records, over the steps after `--skip` (compilation and warm-up excluded), the training
tokens/s of real (non-padding) tokens by wall clock, and the same tokens per second of the run's
process CPU time (`time.process_time`: all its threads), which a loaded machine disturbs much less
than wall time, plus the load average at the start and end. The table gives per tree and layout the
median and best of each, and the ratios this / baseline. Both trees' runs train on the same curated
files (made once with this checkout's pipeline, cached in `--work`), with the interpreter running
this command (the baseline must import with the installed dependencies).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUT_DATA = {"trie": "sprint.jsonl", "flat": "rft.jsonl"}


def add_demo_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline-tree", required=True,
                   help="an older checkout: the directory that holds its sprint_jax/ package")
    p.add_argument("--reps", type=int, default=3, help="rounds of (baseline, this) per layout (default 3)")
    p.add_argument("--layouts", default="trie,flat", help="comma-separated: trie (SPRINT run), flat (RFT run)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--skip", type=int, default=10,
                   help="steps excluded from the window (compilation, warm-up); a multiple of 5 (default 10)")
    p.add_argument("--problems", type=int, default=600, help="digit-chains problems to curate (default 600)")
    p.add_argument("--seq-len", type=int, help="force this seq_len on both trees (default: each tree's demo config)")
    p.add_argument("--batch-size", type=int, help="force this batch size on both trees")
    p.add_argument("--work", default="runs/bench_demo_train",
                   help="scratch directory: curated data (reused) and run directories (removed)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as failed")
    p.add_argument("--out", help="write the JSON result here")


def _curate(work: Path, problems: int) -> Path:
    """Curated SPRINT + RFT files for `problems` demo problems (cached under work/curate_N)."""
    from sprint_jax.config import from_dict
    from sprint_jax.curation.config import CurateConfig
    from sprint_jax.curation.pipeline import run_pipeline
    from sprint_jax.demo import DemoConfig

    cfg = DemoConfig()
    cur = work / f"curate_{problems}"
    if all((cur / f).exists() for f in LAYOUT_DATA.values()):
        return cur
    c = from_dict(CurateConfig, {
        "tasks": {"source": "chains", "n": problems, "seed": cfg.seed, "chain_length": cfg.chain_length},
        "teacher": {"kind": "programmatic"}, "extractor": {"kind": "offline"}, "dag": {"kind": "offline"},
        "merge_min_chars": 4, "min_ratio": 1.5, "seed": cfg.seed, "out": str(cur)})
    run_pipeline(c, cur, progress=False)
    return cur


def _run_child(tree: Path, spec: dict, timeout: float) -> dict:
    """One training run in a fresh interpreter whose `sprint_jax` comes from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    # -P: this file's directory is not put on sys.path (it would shadow top-level names)
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    load0 = os.getloadavg()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=spec["run_dir"])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "load_start": load0[0], "load_end": os.getloadavg()[0]}
    lines = [l for l in r.stdout.splitlines() if l.startswith("CHILD ")]
    if r.returncode or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {r.returncode}: " + " | ".join(tail), "load_start": load0[0],
                "load_end": os.getloadavg()[0]}
    res = json.loads(lines[-1][len("CHILD "):])
    res.update(load_start=load0[0], load_end=os.getloadavg()[0])
    return res


def _child(spec: dict) -> None:
    """Runs in the child process: one demo-config training, timed by a step callback."""
    import sprint_jax

    code = Path(sprint_jax.__file__).resolve().parent
    if code.parent != Path(spec["tree"]).resolve():
        raise SystemExit(f"imported sprint_jax from {code}, not from {spec['tree']}")
    from sprint_jax.config import from_dict, to_dict
    from sprint_jax.demo import DemoConfig
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    cfg = DemoConfig()
    seq_len = spec["seq_len"] or cfg.seq_len
    batch = spec["batch_size"] or cfg.batch_size
    tok = VocabTokenizer(token_vocabulary(max_prompts=cfg.chains), eos_token="<eos>", pad_token="<pad>")
    vocab_size = (len(tok) + 7) // 8 * 8
    model = {"model_type": "qwen2", "vocab_size": vocab_size, **to_dict(cfg.model),
             "max_position_embeddings": seq_len, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "init_seed": cfg.seed},
        "data": {"train": [spec["data"]], "layout": spec["layout"], "seq_len": seq_len, "seed": cfg.seed},
        "optim": {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "batch_size": batch, "weight_decay": 0.01},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "export": {"enabled": False},
        "steps": spec["steps"], "log_every": 5, "seed": cfg.seed, "tensorboard": False, "plot": False})
    marks: dict[int, tuple[float, float, int]] = {}

    def mark(ev) -> None:
        # logged steps only: their metrics were fetched to the host, so the step has finished
        if ev.metrics is not None:
            marks[ev.step] = (time.perf_counter(), time.process_time(), int(ev.metrics["tokens"]))

    summary = train(tc, Path(spec["run_dir"]) / "run", tokenizer=tok, progress=False, callbacks=[mark])
    (w0, c0, n0), (w1, c1, n1) = marks[spec["skip"]], marks[spec["steps"]]
    print("CHILD " + json.dumps({
        "code": str(code), "seq_len": seq_len, "batch_size": batch, "window_tokens": n1 - n0,
        "tokens_per_s": (n1 - n0) / (w1 - w0), "tokens_per_cpu_s": (n1 - n0) / (c1 - c0),
        "window_wall_s": w1 - w0, "window_cpu_s": c1 - c0, "final_loss": summary.get("final_loss"),
        "fill": (n1 - n0) / ((spec["steps"] - spec["skip"]) * batch * seq_len)}), flush=True)


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "best": max(xs), "n": len(xs)} if xs else {}


def run_demo_train_bench(args) -> int:
    import shutil

    from sprint_jax.errors import UserError

    base = Path(args.baseline_tree).resolve()
    if not (base / "sprint_jax" / "__init__.py").exists():
        raise UserError(f"--baseline-tree: {base} has no sprint_jax/__init__.py (give the checkout's root)")
    this = Path(__file__).resolve().parents[2]
    if base == this:
        raise UserError("--baseline-tree is this checkout; give an older one")
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUT_DATA for x in layouts):
        raise UserError(f"--layouts takes trie and/or flat, got {args.layouts!r}")
    if args.reps < 1 or args.skip < 5 or args.skip % 5 or args.steps <= args.skip or args.steps % 5:
        raise UserError("need --reps >= 1, --skip a positive multiple of 5, --steps > --skip and a multiple of 5")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cur = _curate(work, args.problems)
    trees = {"baseline": base, "this": this}
    runs: list[dict] = []
    print(f"baseline {base}\nthis     {this}\ndata     {cur}", flush=True)
    print(f"{'rep':>3} {'layout':6} {'tree':8} {'load':>11} {'tok/s':>8} {'tok/cpu-s':>9} {'fill':>5} {'loss@end':>9}")
    for rep in range(args.reps):
        for layout in layouts:
            for name, tree in trees.items():
                run_dir = work / f"run_{os.getpid()}_{rep}_{layout}_{name}"
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
                spec = {"tree": str(tree), "layout": layout, "data": str(cur / LAYOUT_DATA[layout]),
                        "steps": args.steps, "skip": args.skip, "seq_len": args.seq_len,
                        "batch_size": args.batch_size, "run_dir": str(run_dir)}
                r = _run_child(tree, spec, args.timeout)
                shutil.rmtree(run_dir, ignore_errors=True)
                r.update(rep=rep, layout=layout, tree=name, at=time.strftime("%H:%M:%S"))
                runs.append(r)
                load = f"{r['load_start']:.1f}->{r['load_end']:.1f}"
                if "error" in r:
                    print(f"{rep:>3} {layout:6} {name:8} {load:>11} FAILED {r['error']}", flush=True)
                    continue
                print(f"{rep:>3} {layout:6} {name:8} {load:>11} {r['tokens_per_s']:8.0f} {r['tokens_per_cpu_s']:9.0f} "
                      f"{r['fill']:5.3f} {r['final_loss']:9.5f}", flush=True)
    summary: dict = {}
    print(f"\n{'layout':6} {'tree':8} {'tok/s median':>12} {'best':>7} {'tok/cpu-s median':>16} {'best':>7}")
    for layout in layouts:
        summary[layout] = {}
        for name in trees:
            ok = [r for r in runs if r["layout"] == layout and r["tree"] == name and "error" not in r]
            summary[layout][name] = {"wall": _stats([r["tokens_per_s"] for r in ok]),
                                     "cpu": _stats([r["tokens_per_cpu_s"] for r in ok])}
            s = summary[layout][name]
            if ok:
                print(f"{layout:6} {name:8} {s['wall']['median']:12.0f} {s['wall']['best']:7.0f} "
                      f"{s['cpu']['median']:16.0f} {s['cpu']['best']:7.0f}")
        b, t = summary[layout]["baseline"], summary[layout]["this"]
        if b["wall"] and t["wall"]:
            ratio = {f"{k}_{m}": t[k][m] / b[k][m] for k in ("wall", "cpu") for m in ("median", "best")}
            summary[layout]["ratio_this_over_baseline"] = ratio
            print(f"{layout:6} this/baseline: tokens/s {ratio['wall_median']:.2f}x median, {ratio['wall_best']:.2f}x "
                  f"best; per CPU second {ratio['cpu_median']:.2f}x median, {ratio['cpu_best']:.2f}x best")
    result = {"baseline_tree": str(base), "this_tree": str(this), "data": str(cur), "steps": args.steps,
              "skip": args.skip, "reps": args.reps, "forced_seq_len": args.seq_len,
              "forced_batch_size": args.batch_size, "runs": runs, "summary": summary}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    failed = sum("error" in r for r in runs)
    return 1 if failed else 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    _child(json.loads(sys.argv[2]))
