"""Stages, digests and state of a recipe run.

DIR holds one directory per stage (its generated config, its log.txt, its outputs under out/),
recipe.yaml (the config of the last run, which `recipe status` judges against) and state.json.

A stage's inputs digest covers its command and generated config (with DIR written as `$DIR`, so a
moved DIR keeps its digests), the output digests of the stages it reads, and the content of the
external files it reads (task files, a pretrained checkpoint, a tokenizer). A rerun skips a stage
that finished with the same inputs digest and whose outputs are as it left them (same sizes and
modification times); otherwise the stage runs again. Its old outputs are removed first when its
inputs changed; after a failure with unchanged inputs they are kept, so `train`, `eval` and
`curate` resume where they stopped (a curation's paid teacher calls are not repeated). A stage
downstream of a rerun one sees that stage's new output digest and reruns too, unless the outputs
came out identical. Content digests of external files are cached by (size, mtime) in state.json:
a 15 GB checkpoint is read once, not at every rerun.

Stages run as `sprint-jax` subprocesses (each with its own log and exit code); the report is
written in this process.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from sprint_jax.recipe.config import BUILTIN_DATA, CHAINS_TOKENIZER_PROMPTS, RecipeConfig

STATE_FILE = "state.json"
CONFIG_COPY = "recipe.yaml"
REPORT_FILE = "report.md"
TOKENIZER_DIR = "tokenizer"
DIR_TOKEN = "$DIR"


@dataclasses.dataclass
class Stage:
    """One step of the recipe. `command` is a `sprint-jax` argv, or None when `write` produces the
    outputs in-process; `config` (text) is written to DIR/name/config.yaml before it runs."""
    name: str
    after: list[str]                           # stages whose outputs this one reads
    outputs: list[Path]                        # what it must leave (files or directories)
    command: list[str] | None = None
    config: str | None = None
    files: list[Path] = dataclasses.field(default_factory=list)   # external inputs, digested by content
    write: Callable[[Path], None] | None = None                   # in-process stages: write(DIR)


def stage_dir(out: Path, name: str) -> Path:
    return out / name


def plan(cfg: RecipeConfig, out: Path) -> list[Stage]:
    """The stages of `cfg` writing into `out`, in the order they run: curate [-> convert] -> the
    parallel arm's SFT (one train stage, or a mix stage and one per curriculum phase) and the
    sequential arm's [-> selftrain_ARM] [-> rl_ARM] -> [data_SET ->] eval of both arms per set ->
    compare -> report."""
    import yaml

    out = out.resolve()
    cur = stage_dir(out, "curate") / "out"
    sprint_file, rft_file = cur / "sprint.jsonl", cur / "rft.jsonl"
    tasks = dict(cfg.curate.get("tasks") or {})
    files = []
    if tasks.get("path") and Path(tasks["path"]).exists():      # a local task file (not a hub name)
        tasks["path"] = str(Path(tasks["path"]).resolve())
        files.append(Path(tasks["path"]))
    curate = {**cfg.curate, "tasks": tasks, "out": str(cur)}
    stages = [Stage("curate", [], [sprint_file, rft_file],
                    ["curate", "--config", str(stage_dir(out, "curate") / "config.yaml"), "--no-progress"],
                    yaml.safe_dump(curate, sort_keys=False), files)]
    data_stage = "curate"
    if cfg.format == "threadweaver":
        conv = stage_dir(out, "convert") / "out"
        sprint_tw, rft_tw = conv / "sprint.jsonl", conv / "rft.jsonl"
        pairs = [(sprint_file, sprint_tw), (rft_file, rft_tw)]
        stages.append(Stage("convert", ["curate"], [sprint_tw, rft_tw], None,
                            yaml.safe_dump({"to": "threadweaver", "files": [[str(a), str(b)] for a, b in pairs]}),
                            write=lambda root, pairs=pairs: convert_to_threadweaver(pairs)))
        sprint_file, rft_file, data_stage = sprint_tw, rft_tw, "convert"

    data = dict(cfg.train.get("data") or {})
    if cfg.format == "threadweaver":
        data["format"] = "threadweaver"
    train_files = []
    if cfg.tokenizer == "chains":
        data["tokenizer"] = str(out / TOKENIZER_DIR)
        train_files.append(out / TOKENIZER_DIR / "vocab_tokenizer.json")
    elif Path(str(data.get("tokenizer", ""))).is_dir():       # a tokenizer directory
        data["tokenizer"] = str(Path(data["tokenizer"]).resolve())
        train_files.append(Path(data["tokenizer"]))
    model = dict(cfg.train.get("model") or {})
    if model.get("init") == "pretrained":
        model["name"] = str(Path(model["name"]).resolve())
        train_files.append(Path(model["name"]))

    def train_stage(name: str, after: list[str], train_file: Path, layout: str, partner=None, init=None,
                    epochs=None) -> Stage:
        d = stage_dir(out, name)
        m = model if init is None else {**model, "name": str(init), "init": "pretrained"}
        dd = {**data, "train": [str(train_file)], "layout": layout}
        if partner is not None:
            dd["paired"] = {"train": [str(partner[0])], "layout": partner[1]}
        train = {**cfg.train, "model": m, "data": dd}
        if epochs is not None:
            train["epochs"] = epochs
        return Stage(name, after, [d / "out" / "hf"],
                     ["train", "--config", str(d / "config.yaml"), "--out", str(d / "out"), "--no-progress"],
                     yaml.safe_dump(train, sort_keys=False), list(train_files))

    phases = cfg.curriculum.phases(cfg.train.get("epochs"))
    final: dict[str, tuple[str, Path]] = {}                # arm -> (stage, its model directory)
    if len(phases) == 1:
        stages.append(train_stage("train_sprint", [data_stage], sprint_file, cfg.sprint_layout,
                                  (rft_file, "flat")))
        stages.append(train_stage("train_rft", [data_stage], rft_file, "flat", (sprint_file, cfg.sprint_layout)))
    else:
        mix = stage_dir(out, "mix") / "out"
        phase_files = [mix / f"phase_{k + 1}.jsonl" for k in range(len(phases))]
        spec = {"parallel": [str(sprint_file)], "sequential": [str(rft_file)], "seed": cfg.curriculum.seed,
                "phases": [{"parallel_fraction": p, "epochs": e, "file": str(f)}
                           for (p, e), f in zip(phases, phase_files)]}
        stages.append(Stage("mix", [data_stage], [*phase_files, mix / "mix.json"], None,
                            yaml.safe_dump(spec, sort_keys=False),
                            write=lambda root, spec=spec: write_curriculum(spec, mix / "mix.json")))
        prev, init = "mix", None
        for k, ((_, epochs), f) in enumerate(zip(phases, phase_files)):
            name = f"train_sprint_{k + 1}"
            stages.append(train_stage(name, [prev], f, cfg.sprint_layout, init=init, epochs=epochs))
            prev, init = name, stage_dir(out, name) / "out" / "hf"
        final["sprint"] = (prev, init)
        stages.append(train_stage("train_rft", [data_stage], rft_file, "flat", epochs=sum(e for _, e in phases)))
    final.setdefault("sprint", ("train_sprint", stage_dir(out, "train_sprint") / "out" / "hf"))
    final["rft"] = ("train_rft", stage_dir(out, "train_rft") / "out" / "hf")

    modes = {"sprint": cfg.eval.sprint_mode, "rft": "sequential"}
    if cfg.selftrain_rounds:
        for arm in ("sprint", "rft"):
            d, (after, start) = stage_dir(out, f"selftrain_{arm}"), final[arm]
            conf = selftrain_stage_config(cfg, start, modes[arm])
            model_dir = d / "out" / f"round_{cfg.selftrain_rounds}" / "model" / "hf"
            stages.append(Stage(f"selftrain_{arm}", [after], [d / "out" / "summary.json", model_dir],
                                ["selftrain", "--config", str(d / "config.yaml"), "--out", str(d / "out"),
                                 "--no-progress"], yaml.safe_dump(conf, sort_keys=False),
                                _task_files(conf.get("train_tasks"), conf.get("heldout_tasks"))))
            final[arm] = (f"selftrain_{arm}", model_dir)
    if cfg.rl:
        for arm in ("sprint", "rft"):
            d, (after, start) = stage_dir(out, f"rl_{arm}"), final[arm]
            conf = rl_stage_config(cfg, start, modes[arm], arm == "rft")
            t = conf.get("tasks") or {}
            stages.append(Stage(f"rl_{arm}", [after], [d / "out" / "hf"],
                                ["rl", "--config", str(d / "config.yaml"), "--out", str(d / "out"), "--no-progress"],
                                yaml.safe_dump(conf, sort_keys=False),
                                [Path(p) for p in (t.get("source"), t.get("eval_source")) if p and Path(p).is_file()]))
            final[arm] = (f"rl_{arm}", d / "out" / "hf")

    orch = [a for k, v in cfg.eval.orchestrator.items() for a in ("--set", f"{k}={v}")]
    eval_files = []
    if cfg.eval.config:
        from sprint_jax.config import resolve_config_path
        eval_files.append(resolve_config_path(cfg.eval.config).resolve())
        orch = ["--config", str(eval_files[0]), *orch]           # --set fields override the file's
    compares, fetches = [], []               # fetches run first: a bad dataset name fails before any training
    for s in cfg.eval.sets:
        data_after = []
        if s.hf is not None:
            d = stage_dir(out, f"data_{s.name}")
            task_file = d / "out" / "tasks.jsonl"
            spec = {"dataset": s.hf, "split": s.split, "subset": s.subset}
            fetches.append(Stage(f"data_{s.name}", [], [task_file], None, yaml.safe_dump(spec, sort_keys=False),
                                 write=lambda root, spec=spec, path=task_file: fetch_hf_tasks(spec, path)))
            data_arg, set_files, data_after = str(task_file), list(eval_files), [f"data_{s.name}"]
        elif s.data in BUILTIN_DATA:
            data_arg, set_files = s.data, list(eval_files)
        else:
            data_arg, set_files = str(Path(s.data).resolve()), eval_files + [Path(s.data).resolve()]
        data_args = ["--data", data_arg, "--task-kind", s.task_kind] + (["--limit", str(s.limit)] if s.limit else [])
        runs = {}
        for arm, mode in (("sprint", cfg.eval.sprint_mode), ("rft", cfg.eval.rft_mode)):
            d = stage_dir(out, f"eval_{arm}_{s.name}")
            runs[arm] = d / "out"
            stages.append(Stage(f"eval_{arm}_{s.name}", [final[arm][0], *data_after], [d / "out" / "results.jsonl"],
                                ["eval", "--model", str(final[arm][1]),
                                 *data_args, "--mode", mode, "--out", str(d / "out"), "--no-progress",
                                 *orch, *cfg.eval.args, *s.args], None, set_files))
        d = stage_dir(out, f"compare_{s.name}")
        compares.append(f"compare_{s.name}")
        stages.append(Stage(f"compare_{s.name}", [f"eval_sprint_{s.name}", f"eval_rft_{s.name}"],
                            [d / "out" / "compare.json"],
                            ["eval", "compare", str(runs["sprint"]), str(runs["rft"]), "--names", cfg.compare.names,
                             "--bins", cfg.compare.bins, "--quantiles", str(cfg.compare.quantiles),
                             "--out", str(d / "out")]))

    def write_report(root: Path) -> None:
        from sprint_jax.recipe.report import write_report as write
        write(cfg, root)

    stages[:0] = fetches
    trained = sorted({s.name for s in stages if s.name.startswith(("train_", "selftrain_", "rl_"))})
    stages.append(Stage("report", [*trained, *compares], [out / REPORT_FILE], write=write_report))
    return stages


def _task_files(*task_sets) -> list[Path]:
    """The local task files a selftrain stage reads (an input of its digest)."""
    return [Path(t["data"]) for t in task_sets if t and t.get("data") and Path(str(t["data"])).is_file()]


def _deep_merge(a: dict, b: dict) -> dict:
    merged = dict(a)
    for k, v in b.items():
        merged[k] = _deep_merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def selftrain_stage_config(cfg: RecipeConfig, model: Path, mode: str) -> dict:
    """A `sprint-jax selftrain` config for one arm: the recipe's selftrain section with the arm's
    SFT model and mode. Each round's SFT takes the recipe's train settings (model compute, data
    shape, optimiser, mesh, checkpoints, export) for 1 epoch, as ThreadWeaver's self-training SFT
    does, under anything selftrain.train sets."""
    t = cfg.train
    train = {"model": {k: v for k, v in (t.get("model") or {}).items() if k in ("dtype", "remat", "loss_chunk")},
             "data": {k: v for k, v in (t.get("data") or {}).items()
                      if k in ("seq_len", "buckets", "overlong", "span_weights", "seed", "trie_whole_trajectory")},
             **{k: t[k] for k in ("optim", "mesh", "checkpoint", "export", "log_every", "seed") if k in t},
             "epochs": 1}
    own = dict(cfg.selftrain.get("train") or {})
    if "steps" in own and "epochs" not in own:
        del train["epochs"]
    tasks = {k: dict(cfg.selftrain[k]) for k in ("train_tasks", "heldout_tasks") if k in cfg.selftrain}
    for ts in tasks.values():
        if ts.get("data") and Path(str(ts["data"])).is_file():
            ts["data"] = str(Path(ts["data"]).resolve())
    return {**cfg.selftrain, **tasks, "model": str(model), "mode": mode, "train": _deep_merge(train, own)}


def rl_stage_config(cfg: RecipeConfig, model: Path, mode: str, sequential_arm: bool) -> dict:
    """A `sprint-jax rl` config for one arm: the recipe's rl section from the arm's model, with the
    arm's rollout mode; the sequential arm without the acceleration bonus (reward.rho 0: its
    rollouts have one call, so there is no parallelism to reward)."""
    conf = _deep_merge(cfg.rl, {"policy": {"path": str(model)}, "rollout": {"mode": mode}})
    if sequential_arm:
        conf = _deep_merge(conf, {"reward": {"rho": 0.0}})
    t = dict(conf.get("tasks") or {})
    for key in ("source", "eval_source"):
        if t.get(key) and Path(str(t[key])).is_file():
            t[key] = str(Path(t[key]).resolve())
    return {**conf, "tasks": t} if t else conf


def convert_to_threadweaver(pairs: list[tuple[Path, Path]]) -> None:
    """Each (SPRINT-format file, destination) in ThreadWeaver's format; an example already in it
    (a ThreadWeaver curation) is copied as it is. Examples the format cannot express are skipped
    and counted (printed into the stage's log)."""
    from sprint_jax import threadweaver as tw
    from sprint_jax.fsutil import write_atomic
    from sprint_jax.jsonl import iter_objects
    from sprint_jax.schema import Example

    for src, dst in pairs:
        lines, skipped = [], {}
        for n, d in iter_objects(src, ValueError):
            ex = Example.from_record(d, f"{src}:{n}", ValueError)
            if (ex.meta or {}).get(tw.FORMAT_META_KEY) != "threadweaver":
                try:
                    ex = tw.convert_example(ex, "threadweaver")
                except tw.ConversionError as e:
                    skipped[e.reason] = skipped.get(e.reason, 0) + 1
                    continue
            lines.append(json.dumps(ex.to_json(), ensure_ascii=False) + "\n")
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dst, "".join(lines))
        print(f"{src.name}: {len(lines)} in ThreadWeaver's format -> {dst}; skipped: {skipped or 'none'}")
        if not lines:
            raise ValueError(f"{src}: no example could be written in ThreadWeaver's format (skipped: {skipped})")


def write_curriculum(spec: dict, summary: Path) -> None:
    """The curriculum's phase files: every curated problem once per phase, in its parallel form
    with the phase's probability (numpy's default_rng((seed, phase)); else its sequential form),
    falling back to the form it has when it lacks the other. Counts per phase in `summary`."""
    import numpy as np

    from sprint_jax.fsutil import write_atomic
    from sprint_jax.jsonl import iter_objects

    def read(paths):
        return {str(d["id"]): d for p in paths for _, d in iter_objects(p, ValueError)}

    par, seq = read(spec["parallel"]), read(spec["sequential"])
    ids = list(par) + [i for i in seq if i not in par]
    counts = []
    for k, phase in enumerate(spec["phases"]):
        rng = np.random.default_rng((spec["seed"], k))
        draws = rng.random(len(ids))
        rows, n_par = [], 0
        for i, u in zip(ids, draws):
            want_par = u < phase["parallel_fraction"]
            rec = (par.get(i) if want_par else seq.get(i)) or par.get(i) or seq.get(i)
            n_par += rec is par.get(i)
            rows.append(json.dumps(rec, ensure_ascii=False) + "\n")
        Path(phase["file"]).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(phase["file"]), "".join(rows))
        counts.append({"phase": k + 1, "parallel_fraction": phase["parallel_fraction"], "epochs": phase["epochs"],
                       "parallel": n_par, "sequential": len(rows) - n_par})
        print(f"phase {k + 1}: {n_par} parallel, {len(rows) - n_par} sequential examples, {phase['epochs']} epochs")
    write_atomic(summary, json.dumps({"phases": counts}, indent=2) + "\n")


def fetch_hf_tasks(spec: dict, path: Path) -> None:
    """A Hugging Face dataset's split as a task file (one JSON record a line) for `eval --data`."""
    from sprint_jax.fsutil import write_atomic
    from sprint_jax.tasks.sources import read_hf_records

    rows = [json.dumps(r, ensure_ascii=False, default=str) + "\n"
            for _, r in read_hf_records(spec["dataset"], spec["split"], spec.get("subset"))]
    if not rows:
        raise ValueError(f"{spec['dataset']} ({spec['split']}): no records")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(rows))
    print(f"{spec['dataset']} ({spec['split']}): {len(rows)} records -> {path}")


# ---------------------------------------------------------------------------------------------
# digests
# ---------------------------------------------------------------------------------------------
def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file())


def file_sha256(path: Path, cache: dict | None = None) -> str:
    """Content digest of one file; `cache` (path -> [size, mtime_ns, sha]) skips rereading a file
    whose size and modification time are unchanged."""
    st = path.stat()
    key = str(path.resolve())
    if cache is not None and key in cache and cache[key][:2] == [st.st_size, st.st_mtime_ns]:
        return cache[key][2]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    sha = h.hexdigest()
    if cache is not None:
        cache[key] = [st.st_size, st.st_mtime_ns, sha]
    return sha


def tree_digest(path: Path, cache: dict | None = None) -> str | None:
    """Digest of a file, or of a directory's files (relative names and contents); None if missing."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    for p in _files_under(path):
        h.update(f"{p.relative_to(path) if p != path else p.name}\0{file_sha256(p, cache)}\0".encode())
    return h.hexdigest()


def stat_print(paths: list[Path]) -> str | None:
    """Sizes and modification times of every output file: the cheap check that outputs are as a
    stage left them. None when one is missing."""
    h = hashlib.sha256()
    for path in paths:
        if not path.exists():
            return None
        for p in _files_under(path):
            st = p.stat()
            name = path.name if p == path else p.relative_to(path)    # not absolute: DIR may move
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def inputs_digest(stage: Stage, out: Path, state: dict) -> str:
    """The stage's inputs: command, config, the outputs of the stages it reads, external files."""
    root = str(out.resolve())
    cache = state.setdefault("file_cache", {})
    spec = {"command": [a.replace(root, DIR_TOKEN) for a in stage.command or ["(in-process)"]],
            "config": (stage.config or "").replace(root, DIR_TOKEN),
            "after": {u: state["stages"].get(u, {}).get("outputs") for u in stage.after},
            "files": {str(p).replace(root, DIR_TOKEN): tree_digest(p, cache) for p in stage.files}}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def outputs_digest(stage: Stage) -> str:
    h = hashlib.sha256()
    for p in stage.outputs:
        h.update(f"{p.name}\0{tree_digest(p)}\0".encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------------------------
def load_state(out: Path) -> dict:
    path = out / STATE_FILE
    if not path.exists():
        return {"stages": {}, "file_cache": {}}
    return json.loads(path.read_text())


def save_state(out: Path, state: dict) -> None:
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, out / STATE_FILE)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stage_status(stage: Stage, out: Path, state: dict) -> str:
    """done | stale (finished, but its inputs or outputs changed since) | pending | failed."""
    rec = state["stages"].get(stage.name)
    if not rec:
        return "pending"
    if rec["status"] != "done":
        return "failed" if rec["status"] == "failed" else "pending"
    fresh = rec.get("inputs") == inputs_digest(stage, out, state) and rec.get("outputs_stat") == stat_print(stage.outputs)
    return "done" if fresh else "stale"


def write_chains_tokenizer(out: Path, cfg: RecipeConfig) -> None:
    """DIR/tokenizer/vocab_tokenizer.json: the word-level tokenizer of the digit-chains family that
    `sprint-jax demo` trains with; rewritten only when its content changes (its digest is an input
    of both trainings)."""
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks import chains

    # one prompt per chain: curation's chains tasks have at most 4 (RecipeConfig checks max_chains)
    tok = VocabTokenizer(chains.token_vocabulary(max_prompts=CHAINS_TOKENIZER_PROMPTS), eos_token="<eos>",
                         pad_token="<pad>")
    d = out / TOKENIZER_DIR
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "vocab_tokenizer.json.tmp"
    tok.save(tmp)
    target = d / "vocab_tokenizer.json"
    if target.exists() and target.read_bytes() == tmp.read_bytes():
        tmp.unlink()
    else:
        os.replace(tmp, target)


def run_recipe(cfg: RecipeConfig, config_text: str, out: Path, say=print) -> int:
    """Run every stage of `cfg` not already done with the same inputs; 0 when all are done, 1 when
    a stage failed (after printing one line naming it and its log to stderr)."""
    from sprint_jax import outlock

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    lock = outlock.acquire(out, "--out")
    try:
        (out / CONFIG_COPY).write_text(config_text)
        if cfg.tokenizer == "chains":
            write_chains_tokenizer(out, cfg)
        stages = plan(cfg, out)
        state = load_state(out)
        for k, stage in enumerate(stages):
            label = f"[{k + 1}/{len(stages)}] {stage.name}"
            inputs = inputs_digest(stage, out, state)
            rec = state["stages"].get(stage.name) or {}
            if (rec.get("status") == "done" and rec.get("inputs") == inputs
                    and rec.get("outputs_stat") == stat_print(stage.outputs)):
                say(f"{label}: done, inputs unchanged: skipped")
                continue
            rc = _run_stage(stage, out, state, inputs, rec, label, say)
            if rc:
                return rc
        say(f"done: {out / REPORT_FILE}")
        return 0
    finally:
        outlock.release(lock)


def _run_stage(stage: Stage, out: Path, state: dict, inputs: str, rec: dict, label: str, say) -> int:
    d = stage_dir(out, stage.name)
    if rec.get("inputs") != inputs or rec.get("status") == "done":
        why = "inputs changed" if rec.get("inputs") not in (None, inputs) else (
            "outputs changed" if rec.get("status") == "done" else "new")
        for p in [d / "out", *stage.outputs]:       # what a run with other inputs left
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    else:
        why = "resuming after " + rec.get("status", "an interruption")
    d.mkdir(parents=True, exist_ok=True)
    if stage.config is not None:
        (d / "config.yaml").write_text(stage.config)
    log = d / "log.txt"
    say(f"{label}: running ({why}); log {log}")
    t0 = time.time()
    state["stages"][stage.name] = {"status": "running", "inputs": inputs, "started": _now(), "log": str(log)}
    save_state(out, state)
    rc, missing = _execute(stage, out, log), []
    if rc == 0:
        missing = [str(p) for p in stage.outputs if not p.exists()]
    entry = state["stages"][stage.name]
    entry.update(finished=_now(), seconds=round(time.time() - t0, 1), exit_code=rc)
    if rc or missing:
        entry["status"] = "failed"
        save_state(out, state)
        why = (f"killed by signal {-rc}" if rc < 0 else f"exit {rc}") if rc else f"it wrote no {', '.join(missing)}"
        print(f"sprint-jax recipe: stage {stage.name} failed ({why}); log: {log}", file=sys.stderr, flush=True)
        return 1
    entry.update(status="done", outputs=outputs_digest(stage), outputs_stat=stat_print(stage.outputs))
    save_state(out, state)
    say(f"{label}: done in {entry['seconds']:.0f} s")
    return 0


def _execute(stage: Stage, out: Path, log: Path) -> int:
    """Run the stage with stdout and stderr into `log`; its exit code (an in-process stage: 0, or
    1 with the traceback in the log)."""
    with open(log, "w") as f:
        if stage.command is None:
            import contextlib
            import traceback
            try:
                with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                    stage.write(out)
                return 0
            except Exception:  # noqa: BLE001 -- any failure of the stage is reported as the stage's
                traceback.print_exc(file=f)
                return 1
        argv = [sys.executable, "-m", "sprint_jax.cli", *stage.command]
        f.write("$ sprint-jax " + " ".join(stage.command) + "\n")
        f.flush()
        tie = die_with_parent()
        env = {**tie.pop("env"), "PYTHONUNBUFFERED": "1"}
        return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, **tie).returncode


def die_with_parent() -> dict:
    """Popen arguments that tie a stage to this process: its own session and process group (a
    signal to the group reaches whatever it started) and the runner's pid in the stage's
    environment, with which the stage (sprint_jax.cli, at start) asks the kernel to SIGKILL it
    when this process dies, however (kill -9 included; Linux). Without it a killed runner left
    its stage running, holding the stage's output lock (the rerun failed with "in use") and
    writing into the log the rerun had truncated. SIGKILL, not SIGTERM: the stage must be gone
    before a rerun starts it again; every stage resumes from what it last wrote."""
    from sprint_jax.interrupt import DIE_WITH_ENV
    return {"start_new_session": True, "env": {**os.environ, DIE_WITH_ENV: str(os.getpid())}}


def status_rows(out: Path) -> list[dict]:
    """Per stage of DIR's last run: name, status, started, finished, seconds, log."""
    from sprint_jax.errors import UserError
    from sprint_jax.recipe.config import load_recipe_config

    out = out.resolve()
    if not (out / STATE_FILE).exists() or not (out / CONFIG_COPY).exists():
        raise UserError(f"{out} holds no recipe run (no {STATE_FILE} / {CONFIG_COPY})")
    cfg = load_recipe_config(out / CONFIG_COPY)
    state = load_state(out)
    rows = []
    for stage in plan(cfg, out):
        rec = state["stages"].get(stage.name) or {}
        rows.append({"stage": stage.name, "status": stage_status(stage, out, state),
                     "started": rec.get("started"), "finished": rec.get("finished"),
                     "seconds": rec.get("seconds"), "log": rec.get("log")})
    return rows
