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
    """The stages of `cfg` writing into `out`, in the order they run."""
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

    arms = {"sprint": (sprint_file, cfg.sprint_layout, rft_file, "flat"),
            "rft": (rft_file, "flat", sprint_file, cfg.sprint_layout)}
    data = dict(cfg.train.get("data") or {})
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
    for arm, (mine, layout, partner, partner_layout) in arms.items():
        train = {**cfg.train, "model": model, "data": {**data, "train": [str(mine)], "layout": layout,
                                       "paired": {"train": [str(partner)], "layout": partner_layout}}}
        d = stage_dir(out, f"train_{arm}")
        stages.append(Stage(f"train_{arm}", ["curate"], [d / "out" / "hf"],
                            ["train", "--config", str(d / "config.yaml"), "--out", str(d / "out"), "--no-progress"],
                            yaml.safe_dump(train, sort_keys=False), list(train_files)))

    orch = [a for k, v in cfg.eval.orchestrator.items() for a in ("--set", f"{k}={v}")]
    eval_files = []
    if cfg.eval.config:
        from sprint_jax.config import resolve_config_path
        eval_files.append(resolve_config_path(cfg.eval.config).resolve())
        orch = ["--config", str(eval_files[0]), *orch]           # --set fields override the file's
    compares = []
    for s in cfg.eval.sets:
        data_args = ["--data", s.data if s.data in BUILTIN_DATA else str(Path(s.data).resolve()),
                     "--task-kind", s.task_kind] + (["--limit", str(s.limit)] if s.limit else [])
        set_files = eval_files + ([] if s.data in BUILTIN_DATA else [Path(s.data).resolve()])
        runs = {}
        for arm, mode in (("sprint", cfg.eval.sprint_mode), ("rft", cfg.eval.rft_mode)):
            d = stage_dir(out, f"eval_{arm}_{s.name}")
            runs[arm] = d / "out"
            stages.append(Stage(f"eval_{arm}_{s.name}", [f"train_{arm}"], [d / "out" / "results.jsonl"],
                                ["eval", "--model", str(stage_dir(out, f"train_{arm}") / "out" / "hf"),
                                 *data_args, "--mode", mode, "--out", str(d / "out"), "--no-progress",
                                 *orch, *cfg.eval.args, *s.args], None, set_files))
        d = stage_dir(out, f"compare_{s.name}")
        compares.append(f"compare_{s.name}")
        stages.append(Stage(f"compare_{s.name}", [f"eval_sprint_{s.name}", f"eval_rft_{s.name}"],
                            [d / "out" / "compare.json"],
                            ["eval", "compare", str(runs["sprint"]), str(runs["rft"]), "--names", "SPRINT,RFT",
                             "--bins", cfg.compare.bins, "--quantiles", str(cfg.compare.quantiles),
                             "--out", str(d / "out")]))

    def write_report(root: Path) -> None:
        from sprint_jax.recipe.report import write_report as write
        write(cfg, root)

    stages.append(Stage("report", ["train_sprint", "train_rft", *compares], [out / REPORT_FILE],
                        write=write_report))
    return stages


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
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                              **die_with_parent()).returncode


def die_with_parent() -> dict:
    """Popen arguments that tie a stage to this process: its own process group (a signal to the
    group reaches whatever it started) and, on Linux, PR_SET_PDEATHSIG, so the kernel sends it
    SIGKILL when this process dies, however (kill -9 included). Without it a killed runner left
    its stage running, holding the stage's output lock (the rerun failed with "in use") and
    writing into the log the rerun had truncated. SIGKILL, not SIGTERM: the stage must be gone
    before a rerun starts it again; every stage resumes from what it last wrote."""
    if not sys.platform.startswith("linux"):
        return {"start_new_session": True}
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl   # looked up before the fork: the child only calls it
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        os.setpgid(0, 0)
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:            # the parent died before prctl took effect
            os._exit(1)

    return {"preexec_fn": preexec}


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
