"""`sprint-jax demo`: the whole SPRINT method, in miniature but for real, on a laptop-class CPU.

1. Tasks and serial traces made by the project: the digit-chains family (tasks/chains.py),
   whose chains are genuinely independent sub-computations. Held-out test problems are excluded
   from the training set by their start digits (`chains.demo_test_set`, also `eval --data chains`).
   The real curation pipeline and SQLite store with the offline curator: steps, DAG, σ packing,
   ρ filter -> SPRINT examples; the same traces -> RFT examples.
2. A tokenizer with one token per SPRINT tag and word (VocabTokenizer), and a tiny Qwen2 trained
   from scratch with the real trainer, same data and budget: SPRINT (merge layout by default:
   every token trained once, executors side by side from the fork) and RFT;
   `--layouts trie`, `--layouts trie,merge`, `--layouts trie,flat` train the trie layout (the
   planner's context holds the executions, as the re-prefill join computes them) and the paper's
   flat layout instead or beside it, all with the same budget.
3. Evaluation with the real orchestrator and engine on held-out problems: SPRINT in `parallel`
   mode with the join its layout selects (merge: the merge join; trie: the re-prefill join, and
   `serial` mode too), RFT in `sequential` mode (and flat SPRINT in `parallel`).
4. A summary table (with training tokens per example and sync time per stage), report.json,
   plots (loss curves, sequential vs total tokens, wall clock), and the commands that run the
   trained models next (`infer`, `eval --data chains`, `serve`, with the run's budgets in
   orchestrator.yaml).

Everything is deterministic for a seed (on one machine and JAX version).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from sprint_jax.config import load_config, to_dict

DESCRIPTION = __doc__


@dataclasses.dataclass
class DemoModel:
    hidden_size: int = 128           # a ~0.4M-parameter Qwen2 (the real architecture, no extras)
    intermediate_size: int = 384
    num_hidden_layers: int = 2       # two layers suffice for the lookups; steps matter more than size
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0


@dataclasses.dataclass
class DemoConfig:
    train_problems: int = 3000       # curated into SPRINT and RFT training sets
    test_problems: int = 100         # held out: never in the training set
    chain_length: int = 12           # digit-map steps per chain
    chains: int = 4                  # sub-computations per problem
    model: DemoModel = dataclasses.field(default_factory=DemoModel)
    steps: int = 600                 # optimizer steps per model (the same budget for every model)
    batch_size: int = 16             # rows per step
    seq_len: int = 256               # tokens per packed row
    lr: float = 4e-3
    warmup_steps: int = 30
    layouts: list[str] = dataclasses.field(default_factory=lambda: ["merge"])  # SPRINT layouts to train
    max_branch_tokens: int = 24      # per executor (a chain is 13 digits + its closing tag)
    max_planner_tokens: int = 48     # per planner call
    concurrency: int = 1             # test problems run at once on the batched engine (1: latency)
    join: str | None = None          # reprefill | merge for every SPRINT evaluation; None: each model's layout's
    seed: int = 0
    out: str = "runs/demo"

    def __post_init__(self) -> None:
        # checked here, before minutes of curation, not when training or evaluation reaches them
        for name in ("train_problems", "test_problems", "chain_length", "chains", "steps", "batch_size",
                     "max_branch_tokens", "max_planner_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        bad = [x for x in self.layouts if x not in ("trie", "flat", "merge")] if self.layouts else ["(none)"]
        if bad:
            raise ValueError(f"layouts takes trie, flat and/or merge, got {bad[0]!r}")
        if self.join not in (None, "reprefill", "merge"):
            raise ValueError(f"join must be reprefill, merge or null, got {self.join!r}")
        if self.join == "merge" and "flat" in self.layouts:
            raise ValueError("join=merge cannot run a flat-layout model (it re-prefills); drop flat from layouts")


STAGES = ("tasks + curation", "training", "evaluation", "summary")   # the progress labels' [k/n]


def _say(msg: str) -> None:
    print(msg, flush=True)


def _stage(name: str) -> str:
    """The progress label of a stage, e.g. "[2/4] training"."""
    return f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name}"


def run_demo(cfg: DemoConfig, out: Path, progress: bool = True) -> dict:
    from sprint_jax.config import from_dict
    from sprint_jax.tasks import chains
    from sprint_jax.curation.config import CurateConfig
    from sprint_jax.curation.pipeline import run_pipeline
    from sprint_jax.eval.evaluate import evaluate
    from sprint_jax.infer import OrchestratorConfig
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model.convert import load_model
    from sprint_jax.model.hf import read_export_meta
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    t_start = time.perf_counter()
    from sprint_jax.model.config import Qwen2Config
    Qwen2Config.from_hf_config({"model_type": "qwen2", "vocab_size": 8, **to_dict(cfg.model)})  # before curating
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo_config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    timings: dict[str, float] = {}

    # 1. tasks, serial traces and curation --------------------------------------------------
    _say(f"{_stage('tasks + curation')}: {cfg.train_problems} digit-chains problems ({cfg.chains} chains of "
         f"{cfg.chain_length} steps), offline curator")
    t0 = time.perf_counter()
    curate = from_dict(CurateConfig, {
        "tasks": {"source": "chains", "n": cfg.train_problems, "seed": cfg.seed, "chain_length": cfg.chain_length},
        "teacher": {"kind": "programmatic"}, "extractor": {"kind": "offline"}, "dag": {"kind": "offline"},
        "merge_min_chars": 4, "min_ratio": 1.5, "seed": cfg.seed, "out": str(out / "curate")})
    curation = run_pipeline(curate, out / "curate", progress=progress)
    test_tasks = chains.demo_test_set(cfg.test_problems, cfg.seed, cfg.chains, cfg.chain_length, cfg.train_problems)
    counts = curation.get("counts", {})
    _say("      curation counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    timings["curation_s"] = time.perf_counter() - t0

    # 2. tokenizer + training -----------------------------------------------------------------
    tok = VocabTokenizer(chains.token_vocabulary(max_prompts=cfg.chains), eos_token="<eos>", pad_token="<pad>")
    vocab_size = (len(tok) + 7) // 8 * 8
    model_dict = {"model_type": "qwen2", "vocab_size": vocab_size, **to_dict(cfg.model),
                  "max_position_embeddings": cfg.seq_len, "tie_word_embeddings": False,
                  "eos_token_id": tok.eos_token_id}
    runs = {"sprint": ("sprint.jsonl", "trie" if "trie" in cfg.layouts else cfg.layouts[0]), "rft": ("rft.jsonl", "flat")}
    for extra in ("flat", "merge"):
        if extra in cfg.layouts and runs["sprint"][1] != extra:
            runs[f"sprint_{extra}"] = ("sprint.jsonl", extra)
    trained: dict[str, dict] = {}
    for i, (name, (data_file, layout)) in enumerate(runs.items()):
        _say(f"{_stage('training')} {name} ({layout} layout): {cfg.steps} steps x {cfg.batch_size} rows x "
             f"{cfg.seq_len} tokens (model {i + 1} of {len(runs)})")
        t0 = time.perf_counter()
        tc = from_dict(TrainConfig, {
            "model": {"name": model_dict, "init": "scratch", "dtype": "float32", "remat": "none",
                      "init_seed": cfg.seed},
            "data": {"train": [str(out / "curate" / data_file)], "layout": layout, "seq_len": cfg.seq_len,
                     "seed": cfg.seed},
            "optim": {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "batch_size": cfg.batch_size,
                      "weight_decay": 0.01},
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
            "checkpoint": {"every": 0, "resume": False},
            "steps": cfg.steps, "log_every": 10, "seed": cfg.seed, "tensorboard": False, "plot": True})
        run_dir = out / "train" / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        summary = train(tc, run_dir, tokenizer=tok, progress=progress)
        summary["wall_s"] = time.perf_counter() - t0
        trained[name] = summary
        timings[f"train_{name}_s"] = summary["wall_s"]

    # 3. evaluation -----------------------------------------------------------------------------
    orch = OrchestratorConfig(max_stages=3, max_prompts=cfg.chains, max_planner_tokens=cfg.max_planner_tokens,
                              max_branch_tokens=cfg.max_branch_tokens, max_total_tokens=1024)
    _write_budgets(out / ORCH_FILE, orch)      # the same budgets for the commands printed at the end
    evals = {"sprint_parallel": ("sprint", "parallel"), "sprint_serial": ("sprint", "serial"),
             "rft_sequential": ("rft", "sequential")}
    if (cfg.join or ("merge" if runs["sprint"][1] == "merge" else "reprefill")) == "merge":
        del evals["sprint_serial"]     # serial mode has no branches to merge
    for extra in ("flat", "merge"):
        if f"sprint_{extra}" in trained:
            evals[f"sprint_{extra}_parallel"] = (f"sprint_{extra}", "parallel")
    engines: dict[str, Any] = {}
    results: dict[str, dict] = {}
    for k, (run_name, (model_name, mode)) in enumerate(evals.items()):
        _say(f"{_stage('evaluation')} of {run_name} on {len(test_tasks)} held-out problems "
             f"(run {k + 1} of {len(evals)})")
        # every mode on the engine (serial: its executors one after another, as forks of one)
        key = model_name
        if key not in engines:
            model = load_model(trained[model_name]["export_dir"])
            kw = dict(max_seq_len=512, max_branch_tokens=cfg.max_branch_tokens + 8, decode_chunk=16,
                      prefill_chunk=128)
            engines[key] = Engine(model, tok, max_seqs=cfg.concurrency, max_children=cfg.chains, **kw)
        layout = read_export_meta(trained[model_name]["export_dir"]).get("layout", "flat")
        run_orch = dataclasses.replace(orch, layout=layout,
                                       join=cfg.join if model_name.startswith("sprint") else None)
        _warm(engines[key], test_tasks[: max(8, 2 * cfg.concurrency)], run_orch, mode)
        _, rep = evaluate(engines[key], test_tasks, mode, prompt_fn=chains.prompt_for,
                            orchestrator_config=run_orch, out_dir=out / "eval" / run_name, progress=progress,
                            meta={"model": model_name, "mode": mode}, overwrite=True)   # models retrained above
        # the eval's own wall clock: running, grading and recording the problems, not the weights'
        # digest before them nor the eval plots after them (the first plot imports matplotlib, ~1 s
        # on the first row only)
        entry = {"accuracy": rep["accuracy"], "mean_sequential_tokens": rep["mean_sequential_tokens"],
                 "mean_total_tokens": rep["mean_total_tokens"], "wall_s": rep["wall_clock_s"],
                 "train_tokens_per_example": trained[model_name]["data"].get("tokens_per_example"),
                 "layout": layout}
        if model_name.startswith("sprint"):
            entry["format_valid"] = rep["format_valid_rate"]
            records = out / "eval" / run_name / "records.jsonl"
            entry.update(_execution_quality(records, cfg.chain_length))
            entry.update(_sync_per_stage(records))
        results[run_name] = entry

    # 4. report ---------------------------------------------------------------------------------
    report = dict(results)
    report["elapsed_s"] = time.perf_counter() - t_start
    report["curation"] = {"counts": counts, "ratio": curation.get("ratio", {})}
    report["training"] = {k: {f: v.get(f) for f in ("final_loss", "steps", "tokens_per_s", "wall_s")}
                          for k, v in trained.items()}
    report["timings_s"] = timings
    report["train_tokens_per_example"] = _tokens_per_example(out / "curate" / "sprint.jsonl", tok, cfg.seq_len)
    report["test_problems"] = len(test_tasks)
    rft_tokens = results["rft_sequential"]["mean_sequential_tokens"]
    report["sequential_tokens_vs_rft"] = {k: (v["mean_sequential_tokens"] / rft_tokens if rft_tokens else None)
                                          for k, v in results.items()}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    _plots(out, trained, results, {name: layout for name, (_, layout) in runs.items()})
    _say(f"{_stage('summary')}\n" + _table(results, rft_tokens))
    _say("training tokens per SPRINT example by layout (same data): "
         + ", ".join(f"{k} {v:.1f}" for k, v in report["train_tokens_per_example"].items()))
    _say(f"elapsed {report['elapsed_s']:.0f} s; report: {out / 'report.json'}; plots: {out / 'plots'}")
    _say("\n".join(_next_commands(cfg, out, {name: trained[name]["export_dir"] for name in trained},
                                  chains.prompt_for(test_tasks[0]))))
    return report


ORCH_FILE = "orchestrator.yaml"
_BUDGETS = ("max_stages", "max_prompts", "max_planner_tokens", "max_branch_tokens", "max_total_tokens")


def _write_budgets(path: Path, orch) -> None:
    """The evaluation's budgets as an OrchestratorConfig YAML (`--config` of infer / eval / serve);
    the layout and join are left to each model's sprint_jax.json, as the demo's evaluation does."""
    import yaml

    path.write_text("# the budgets `sprint-jax demo` evaluated with; pass as --config to infer, eval, serve\n"
                    + yaml.safe_dump({f: getattr(orch, f) for f in _BUDGETS}, sort_keys=False))


def _next_commands(cfg: DemoConfig, out: Path, exports: dict[str, str], query: str) -> list[str]:
    """The commands that run this demo's trained models next, with the paths of this run: one query
    of the test set (given bare: the model's prompt format adds the newline), the held-out test set
    (`eval --data chains`, the demo's test set at its default task shape), the paper's table of the
    two evals (`eval compare`), and the server."""
    import shlex
    import shutil

    exe = "sprint-jax"
    if shutil.which(exe) is None:        # e.g. run through ./dev.sh: the venv is not on PATH
        local = Path(sys.executable).parent / exe
        exe = _shown_path(local) if local.exists() else f"{Path(sys.executable).name} -m sprint_jax.cli"
    budgets = f"--config {shlex.quote(_shown_path(out / ORCH_FILE))}"
    sprint, rft = shlex.quote(_shown_path(Path(exports["sprint"]))), shlex.quote(_shown_path(Path(exports["rft"])))
    q = shlex.quote(query.strip())
    defaults = DemoConfig()
    data = "--data chains" + (f" --data-seed {cfg.seed}" if cfg.seed else "")
    data += f" --limit {cfg.test_problems}" if cfg.test_problems < defaults.test_problems else ""
    lines = ["next: run the trained models yourself (the budgets of this evaluation are in "
             f"{_shown_path(out / ORCH_FILE)})",
             f"  {exe} infer --model {sprint} {budgets} {q}",
             f"  {exe} infer --model {rft} {budgets} --mode sequential {q}",
             f"  {exe} eval --model {sprint} {budgets} {data} "
             f"--out {shlex.quote(_shown_path(out / 'eval_cli' / 'sprint'))}",
             f"  {exe} eval --model {rft} {budgets} {data} --mode sequential "
             f"--out {shlex.quote(_shown_path(out / 'eval_cli' / 'rft'))}",
             f"  {exe} eval compare {shlex.quote(_shown_path(out / 'eval_cli' / 'sprint'))} "
             f"{shlex.quote(_shown_path(out / 'eval_cli' / 'rft'))}",
             f"  {exe} serve --model {sprint} {budgets}"]
    shape = [f"{f}={getattr(cfg, f)}" for f in ("train_problems", "chains", "chain_length")
             if getattr(cfg, f) != getattr(defaults, f)]
    if cfg.test_problems > defaults.test_problems:
        shape.append(f"test_problems={cfg.test_problems}")
    if shape:
        lines.append(f"  (--data chains is the test set of the demo's default task shape; this run set "
                     f"{', '.join(shape)}, so its test set differs)")
    return lines


def _shown_path(p: Path) -> str:
    """`p` relative to the working directory when it is inside it (as the user typed --out)."""
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _execution_quality(records_path: Path, length: int) -> dict:
    """Did the executors do the work? Accuracy alone cannot tell: the final answer is a function
    of the query, so a planner could shortcut the executions. Per run: the fraction of executions
    that are exactly the right chain, and of final answers equal to the max over the executions."""
    from sprint_jax.tasks import chains

    exact = total = consistent = runs = 0
    for line in records_path.read_text().splitlines():
        r = json.loads(line)
        runs += 1
        starts = [int(x) for x in r["query"].split()[1:]]
        lasts = []
        execs = r["stages"][0]["executions"] if r["stages"] else []
        for k, s in enumerate(starts):
            body = execs[k]["text"].split("</")[0].strip() if k < len(execs) else ""
            exact += body == chains.chain(s, length)
            total += 1
            lasts.append(int(body[-1]) if body[-1:].isdigit() else -1)
        consistent += bool(lasts) and str(max(lasts)) == (r.get("final_answer") or "").strip()
    return {"executions_exact": exact / max(total, 1), "answer_matches_executions": consistent / max(runs, 1)}


def _tokens_per_example(path: Path, tok, seq_len: int) -> dict:
    """Training tokens per SPRINT example in each layout, from the same curated set (merge holds
    every token once, like flat; trie repeats executions in the planner's context)."""
    from sprint_jax.train import data as D
    from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

    examples = D.read_examples([path])
    return {layout: D.build_items(examples, tok, layout, seq_len, "drop", dict(SPAN_WEIGHTS_DEFAULT))[1]
            .tokens_per_example for layout in ("flat", "trie", "merge")}


def _sync_per_stage(records_path: Path) -> dict:
    """Mean sync (join) time per stage with executors, and which join ran."""
    times, joins = [], set()
    for line in records_path.read_text().splitlines():
        for st in json.loads(line)["stages"]:
            if st.get("join"):
                times.append(st["sync_s"])
                joins.add(st["join"])
    return {"sync_ms_per_stage": 1e3 * sum(times) / len(times) if times else None,
            "join": ",".join(sorted(joins)) or None}


def _warm(engine, tasks, orch, mode) -> None:
    """Compile the engine's shapes before the timed evaluation, so that wall-clock comparisons
    measure decoding: a few problems (their outputs are discarded) meet the used-length buckets
    and row shapes the evaluation meets; one problem alone leaves SPRINT's later stages to compile
    inside the timed run. A merge join's shapes (parent / child length buckets) are compiled
    ahead as well (`Engine.warm_merge`): a few problems do not meet them all, and a compile
    would land in a stage's timed sync."""
    from sprint_jax.infer.orchestrator import run_many
    from sprint_jax.tasks import chains

    prompts = [chains.prompt_for(t) for t in tasks]
    if orch.resolved_join == "merge":          # every merge shape of a stage of `chains` executors
        engine.warm_merge()
    run_many(engine, prompts, mode, orch)


# the summary's columns: (header, width, what it means); the legend under the table is written from it
COLUMNS = (
    ("run", 22, ""),
    ("layout", 7, ""),
    ("accuracy", 9, "share of the test problems answered right"),
    ("in format", 10, "share of SPRINT runs with no format problem"),
    ("chains ok", 10, "share of executors that wrote their chain exactly"),
    ("seq tok", 9, "tokens on the critical path per problem (planner + the longest executor per stage)"),
    ("seq/RFT", 8, "sequential tokens relative to the RFT baseline's (below 1: a shorter critical path)"),
    ("total tok", 10, "tokens generated per problem, all executors counted"),
    ("wall s", 8, "seconds for the test set. On a CPU a model this small is bound by per-call overheads "
                  "(dispatch, host round trips), not by reading its weights, so the executors' extra rows are "
                  "not free there and SPRINT is not faster in wall clock; sequential tokens are the claim. Why, "
                  "and what changes on accelerators: docs/design.md"),
    ("train tok/ex", 13, "training tokens per example in the model's layout"),
    ("join", 10, "how executors rejoin the planner: merge (caches placed) or reprefill"),
    ("sync ms", 8, "mean time of a join per stage"),
)


def _table(results: dict, rft_tokens: float) -> str:
    """The summary table, then one legend line per column that needs one."""
    head = "".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w, _) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for k, v in results.items():
        rel = v["mean_sequential_tokens"] / rft_tokens if rft_tokens else None
        cells = [k, v["layout"], _num(v["accuracy"], ".2f"), _num(v.get("format_valid"), ".2f"),
                 _num(v.get("executions_exact"), ".2f"), _num(v["mean_sequential_tokens"], ".1f"), _num(rel, ".2f"),
                 _num(v["mean_total_tokens"], ".1f"), _num(v["wall_s"], ".1f"),
                 _num(v.get("train_tokens_per_example"), ".1f"), v.get("join") or "-",
                 _num(v.get("sync_ms_per_stage"), ".2f")]
        lines.append("".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                             for i, (c, (_, w, _)) in enumerate(zip(cells, COLUMNS))))
    lines += [textwrap.fill(what, 110, initial_indent=f"  {h}: ", subsequent_indent="    ")
              for h, _, what in COLUMNS if what]
    return "\n".join(lines)


def _num(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _plots(out: Path, trained: dict, results: dict, layouts: dict[str, str]) -> None:
    """Loss curves, tokens and wall clock; every model and run is labelled with its layout (and a
    SPRINT run with its join), so `sprint_parallel` of a merge-default demo and of `--layouts
    trie,merge` are told apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = out / "plots"
    d.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in trained:
        path = out / "train" / name / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=f"{name} ({layouts.get(name, '?')})")
    ax.set_xlabel("step"), ax.set_ylabel("loss (masked spans)"), ax.set_yscale("log"), ax.legend()
    ax.set_title("training loss")
    fig.tight_layout(), fig.savefig(d / "loss_curves.png", dpi=120), plt.close(fig)

    names = list(results)
    labels = [f"{n}\n({results[n]['layout']}" + (f", {results[n]['join']} join)" if results[n].get("join") else ")")
              for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [results[n]["mean_sequential_tokens"] for n in names], 0.4, label="sequential")
    ax.bar([x + 0.2 for x in xs], [results[n]["mean_total_tokens"] for n in names], 0.4, label="total")
    ax.set_xticks(list(xs), labels, fontsize=8), ax.set_ylabel("tokens per problem"), ax.legend()
    ax.set_title("sequential vs total tokens")
    fig.tight_layout(), fig.savefig(d / "tokens.png", dpi=120), plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(xs), [results[n]["wall_s"] for n in names])
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("seconds for the test set"), ax.set_title("wall clock")
    fig.tight_layout(), fig.savefig(d / "wall_clock.png", dpi=120), plt.close(fig)


def add_arguments(p) -> None:
    from sprint_jax.config import add_config_flags

    p.add_argument("--layouts", default=None,
                   help="SPRINT training layouts, comma-separated: merge (default), trie, flat, e.g. trie,merge "
                        "(every layout trains with the same budget; a merge model runs the merge join, a trie "
                        "model the re-prefill join)")
    p.add_argument("--config", default=None,
                   help="demo config (YAML); default: the embedded defaults (the same as configs/demo.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set steps=100 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_config_flags(p.add_argument_group("DemoConfig fields (flags override --config/--set)"), DemoConfig)


def run(args) -> int:
    from sprint_jax.config import flag_overrides
    from sprint_jax.errors import UserError

    overrides = list(args.set) + flag_overrides(args, DemoConfig)
    if args.layouts is not None:
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        bad = [x for x in layouts if x not in ("trie", "flat", "merge")]
        if bad or not layouts:
            raise UserError(f"--layouts takes trie, flat and/or merge, e.g. trie,merge; got {args.layouts!r}")
        overrides.append(f"layouts=[{','.join(layouts)}]")
    if args.config is not None and not Path(args.config).is_file():
        raise UserError(f"--config {args.config}: no such file")
    cfg = load_config(DemoConfig, args.config, overrides)
    run_demo(cfg, Path(cfg.out), progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    from sprint_jax.cli import main
    sys.exit(main(["demo", *sys.argv[1:]]))
