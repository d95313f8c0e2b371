"""`sprint-jax selftrain`: self-training of an SFT model on its own trajectories (rounds of sample ->
filter -> SFT). The default filter is ThreadWeaver's (keep every rollout with a correct format and a
correct answer); keep: fastest is ours."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from sprint_jax.recipe.selftrain_config import SelftrainConfig, TaskSet

DESCRIPTION = """Self-training: rounds of sample -> filter -> SFT.

  sprint-jax selftrain --config configs/selftrain_tiny_cpu.yaml --out runs/selftrain
  sprint-jax selftrain --config FILE.yaml --set rounds=3 --set samples=8 --out DIR

Starting from an SFT model (an HF export directory as `sprint-jax train` writes it), round r
(1..rounds):
  1. samples `samples` trajectories per training problem with model r-1 (model 0: the start model) on
     the batched engine, the path `sprint-jax eval --samples K` takes (sample s of a problem with
     a seed hashed from orchestrator.seed, the problem's id and s, so problems draw independently;
     orchestrator.temperature / top_p sample);
  2. keeps the rollouts with a valid format and a correct answer. keep: all (the default) keeps
     every one, as ThreadWeaver's self-training does; keep: fastest, our variant, not the
     paper's, keeps one per problem, the one with the shortest critical path (sequential tokens:
     per stage the planner's tokens plus the longest executor's, plus the final call; ties: the
     lowest sample index);
  3. writes them as training examples (sprint_jax.schema.Example: prompt = the prompt the model
     saw, completion = the trajectory's text, kind sprint, or rft in mode sequential);
  4. trains model r with `sprint-jax train`'s trainer on them, from model r-1 (init_from: previous)
     or from the start model (init_from: base), in the start model's layout and tag format;
     `train` holds TrainConfig fields (steps or epochs, optim, ...);
  5. evaluates model r on the held-out problems (greedy unless heldout_temperature > 0).
Round 0 is the start model's held-out evaluation, the baseline.

Per round it reports the yield (kept / sampled, problems with >= 1 kept), the held-out accuracy and
the mean critical path (sequential tokens) on the held-out problems, as a table and in
OUT/summary.json.

Task sets (train_tasks, heldout_tasks: data, limit, data_seed, task_kind): data is what `eval --data`
takes (math500, countdown, chains: the demo's held-out set, or a task FILE), or chains-train: the
training problems `sprint-jax demo` generates for seed data_seed (its default shape: chains 4,
chain_length 12; other values make other problems of the family).
Held-out problems the model was trained on are refused (the `eval` contamination guard) unless
allow_overlap: true.

Output (--out DIR, or the config's out):
  config.json                      the run's config (a rerun with another one is refused; rounds may grow)
  round_0/eval.jsonl               the start model on the held-out problems (one line per problem)
  round_N/samples.jsonl            every sampled trajectory: id, sample, correct, format_valid,
                                   sequential_tokens, total_tokens, prompt, text, ...
  round_N/train.jsonl              the kept ones as training examples
  round_N/model/                   the trainer's output; model/hf is the export
  round_N/eval.jsonl               model N on the held-out problems
  round_N/done.json                the round's figures; a round with it is skipped on rerun
  summary.json                     every round's figures
A killed run resumes on rerun: finished rounds are skipped, and the sampling and evaluation of an
unfinished round resume where they stopped (their eval directories under round_N/).
"""

ROUND_DONE = "done.json"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.json"
# a task set named by chains-train: the demo's training problems (sprint-jax demo's defaults)
_DEMO_TRAIN_PROBLEMS = 3000


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Selection and records (pure: what the tests check against hand-computed values)
# ---------------------------------------------------------------------------------------------
def keep_samples(samples: list[dict], keep: str = "all") -> list[dict]:
    """The kept samples, in input order. keep="all" (ThreadWeaver's self-training filter): every
    sample with a valid format and a correct answer. keep="fastest" (ours, not the paper's): of
    those, only the one per problem id with the fewest sequential tokens (ties: the lowest sample
    index)."""
    good = [s for s in samples if s["correct"] and s["format_valid"]]
    if keep == "all":
        return good
    if keep != "fastest":
        raise ValueError(f"keep must be fastest or all, got {keep!r}")
    best: dict[str, dict] = {}
    for s in good:
        b = best.get(s["id"])
        if b is None or (s["sequential_tokens"], s["sample"]) < (b["sequential_tokens"], b["sample"]):
            best[s["id"]] = s
    chosen = {id(s) for s in best.values()}
    return [s for s in good if id(s) in chosen]


def training_records(kept: list[dict], kind: str, round_index: int) -> list[dict]:
    """The kept samples as training-file records (schema.Example): the prompt the model saw and
    the trajectory's text as the completion."""
    from sprint_jax.schema import Example

    return [Example(id=f"{s['id']}-r{round_index}-s{s['sample']}", kind=kind, prompt=s["prompt"],
                    completion=s["text"], answer=s.get("gold"),
                    meta={"selftrain_round": round_index, "sample": s["sample"],
                          "sequential_tokens": s["sequential_tokens"]}).to_json()
            for s in kept]


def yield_figures(samples: list[dict], kept: list[dict]) -> dict:
    """kept / sampled and the problems with at least one kept sample."""
    problems = {s["id"] for s in samples}
    with_kept = {s["id"] for s in kept}
    return {"sampled": len(samples), "kept": len(kept), "yield": len(kept) / len(samples) if samples else 0.0,
            "problems": len(problems), "problems_with_kept": len(with_kept),
            "kept_mean_sequential_tokens": _mean([s["sequential_tokens"] for s in kept]),
            "sampled_mean_sequential_tokens": _mean([s["sequential_tokens"] for s in samples])}


def heldout_figures(rows: list[dict]) -> dict:
    """Accuracy, mean critical path (sequential tokens, over every problem) and format-valid rate
    of held-out result rows."""
    return {"heldout_n": len(rows), "accuracy": _mean([float(bool(r["correct"])) for r in rows]),
            "mean_sequential_tokens": _mean([r["sequential_tokens"] for r in rows]),
            "format_valid": _mean([float(bool(r["format_valid"])) for r in rows])}


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    from sprint_jax.fsutil import write_atomic
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------
def load_selftrain_config(path: str | None, overrides=(), out: str | None = None) -> SelftrainConfig:
    """The config file + --set overrides, checked: the model directory, the orchestrator and train
    sections (named by their dotted fields). UserError / ConfigError on a bad one."""
    from sprint_jax.config import load_config
    from sprint_jax.errors import UserError

    cfg = load_config(SelftrainConfig, path, overrides)
    if out is not None:
        cfg = dataclasses.replace(cfg, out=out)
    if not cfg.out:
        raise UserError("no output directory: pass --out DIR (or set out in the config)")
    if not cfg.model:
        raise UserError("model is required: the start SFT model's HF export directory")
    if not Path(cfg.model).is_dir():
        raise UserError(f"model: {cfg.model} is not a directory")
    orchestrator_config(cfg, cfg.model)
    train_config(cfg, cfg.model, Path(cfg.model) / "placeholder.jsonl", check_only=True)
    return cfg


def orchestrator_config(cfg: SelftrainConfig, model: str):
    """The sampling OrchestratorConfig: the model's layout and format, then cfg.orchestrator."""
    from sprint_jax.config import ConfigError, from_dict
    from sprint_jax.infer.infer_cli import model_defaults
    from sprint_jax.infer.orchestrator import OrchestratorConfig

    oc = from_dict(OrchestratorConfig, {**model_defaults(model), **cfg.orchestrator}, prefix="orchestrator.")
    if cfg.samples > 1 and oc.temperature == 0:
        raise ConfigError(f"samples: {cfg.samples} samples under greedy decoding (orchestrator.temperature 0) are "
                          f"identical; set orchestrator.temperature > 0")
    if cfg.mode == "serial" and oc.resolved_join == "merge":
        raise ConfigError("mode serial has nothing to merge: use mode parallel, or orchestrator.join: reprefill")
    return oc


def train_config(cfg: SelftrainConfig, init_model: str, data_file: Path, check_only: bool = False):
    """The TrainConfig of a round: fine-tune `init_model` on `data_file`, in the start model's layout
    and context, with cfg.train's fields on top. `check_only`: validate fields without reading data."""
    from sprint_jax.config import ConfigError, from_dict
    from sprint_jax.infer.infer_cli import export_meta
    from sprint_jax.model.config import Qwen2Config
    from sprint_jax.train.config import TrainConfig, load_train_config

    try:
        positions = Qwen2Config.from_hf_config(Path(cfg.model)).max_position_embeddings
    except Exception as e:  # noqa: BLE001 -- a model directory without a readable config.json
        raise ConfigError(f"model: {cfg.model} has no readable config.json ({e})") from None
    meta = export_meta(cfg.model)     # the start model's layout and tag format: every round trains in them
    base = {"model": {"name": str(init_model), "init": "pretrained", "dtype": "float32", "remat": "none",
                      "loss_chunk": 0},
            "data": {"train": [str(data_file)], "layout": meta.get("layout", "flat"),
                     "format": meta.get("format", "sprint"), "seq_len": min(positions, 2048)},
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
            "checkpoint": {"every": 0, "resume": True},
            "steps": 100, "log_every": 10, "tensorboard": False, "plot": False}
    if cfg.train.get("epochs") is not None:      # epochs instead of the default steps
        del base["steps"]
    merged = _deep_merge(base, cfg.train)
    for key in ("model.name", "model.init", "data.train"):
        if _get(cfg.train, key) is not None:
            raise ConfigError(f"train.{key} is set by selftrain (the round's model and data); remove it")
    if check_only:
        return from_dict(TrainConfig, merged, prefix="train.")
    try:
        return load_train_config(None, (), data=merged)
    except ConfigError as e:
        raise ConfigError(f"train: {e}") from None


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def load_task_set(ts: TaskSet, what: str):
    """The tasks of a TaskSet (UserError naming `what` on a bad one)."""
    from sprint_jax.errors import UserError
    from sprint_jax.tasks import load_tasks

    if ts.data == "chains-train":
        from sprint_jax.tasks import chains
        tasks = chains.generate(_DEMO_TRAIN_PROBLEMS, ts.data_seed, ts.chains, ts.chains, ts.chain_length)
        tasks = tasks if ts.limit is None else tasks[: ts.limit]
    else:
        try:
            tasks = load_tasks(ts.data, ts.limit, ts.task_kind, data_seed=ts.data_seed)
        except UserError as e:
            raise UserError(f"{what}: {e}") from None
    if not tasks:
        raise UserError(f"{what}: no tasks in {ts.data!r}")
    return tasks


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
class _Engines:
    """One engine at a time, for the model last asked for (sampling round r+1 uses model r, which
    round r evaluated last)."""

    def __init__(self, cfg: SelftrainConfig, oc):
        self.cfg, self.oc = cfg, oc
        self.model: str | None = None
        self.engine = None

    def get(self, model: str):
        if model != self.model:
            from types import SimpleNamespace

            from sprint_jax.infer.infer_cli import build_engine
            cfg = self.cfg
            sizing = dataclasses.replace(self.oc, max_prompts=1) if cfg.mode == "sequential" else self.oc
            args = SimpleNamespace(model=model, tokenizer=None, dtype=None, max_seq_len=cfg.max_seq_len,
                                   decode_chunk=cfg.decode_chunk, prefill_chunk=cfg.prefill_chunk, mesh=None,
                                   attention_impl="xla")
            self.engine = None                      # the previous model's cache freed first
            self.engine = build_engine(args, sizing, cfg.concurrency)
            self.model = model
        return self.engine


def _prompt_fn(model: str, engine):
    from sprint_jax.eval.cli import model_prompt_fn
    return model_prompt_fn(model, engine.tokenizer, "off")


def _eval_dir(engine, model, tasks, config, out_dir: Path, cfg: SelftrainConfig, samples: int, progress: bool,
              what: str) -> tuple[list[dict], list[dict], Any]:
    """Run `evaluate` into out_dir (resumable) and return (results, records, prompt_fn)."""
    from sprint_jax.eval.evaluate import RECORDS_FILE, evaluate

    prompt_fn = _prompt_fn(model, engine)
    results, _ = evaluate(engine, tasks, cfg.mode, prompt_fn=prompt_fn, orchestrator_config=config,
                          out_dir=out_dir, progress=progress, concurrency=cfg.concurrency, samples=samples,
                          meta={"model": str(model), "selftrain": what})
    records = {(str(r["id"]), r.get("sample", 0)): r for r in _read_jsonl(out_dir / RECORDS_FILE)}
    recs = [records[(str(r["id"]), r.get("sample", 0))] for r in results]
    return results, recs, prompt_fn


def _heldout(cfg, engines: _Engines, model: str, tasks, oc, rdir: Path, progress: bool) -> dict:
    from sprint_jax.eval.cli import check_overlap

    check_overlap(model, tasks, cfg.allow_overlap)
    hc = dataclasses.replace(oc, temperature=cfg.heldout_temperature)
    engine = engines.get(model)
    results, _, _ = _eval_dir(engine, model, tasks, hc, rdir / "heldout_eval", cfg, 1, progress, "heldout")
    _write_jsonl(rdir / "eval.jsonl", results)
    return heldout_figures(results)


def _samples(cfg, engines: _Engines, model: str, tasks, oc, rdir: Path, progress: bool) -> list[dict]:
    engine = engines.get(model)
    results, records, prompt_fn = _eval_dir(engine, model, tasks, oc, rdir / "sampling_eval", cfg, cfg.samples,
                                            progress, "samples")
    by_id = {str(t.id): t for t in tasks}
    rows = []
    for res, rec in zip(results, records):
        rows.append({"id": str(res["id"]), "sample": res.get("sample", 0), "correct": bool(res["correct"]),
                     "format_valid": bool(res["format_valid"]), "sequential_tokens": res["sequential_tokens"],
                     "total_tokens": res["total_tokens"], "termination": res["termination"],
                     "final_answer": res["final_answer"], "gold": res["gold"],
                     "prompt": prompt_fn(by_id[str(res["id"])]), "text": rec["text"]})
    _write_jsonl(rdir / "samples.jsonl", rows)
    return rows


def _check_config(out: Path, cfg: SelftrainConfig) -> None:
    """The run's config in OUT/config.json; a rerun with another (rounds and out aside) is refused."""
    from sprint_jax.config import to_dict
    from sprint_jax.errors import UserError
    from sprint_jax.fsutil import write_atomic

    now = {k: v for k, v in to_dict(cfg).items() if k not in ("rounds", "out")}
    path = out / CONFIG_FILE
    if path.exists():
        before = json.loads(path.read_text(encoding="utf-8"))
        diff = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if diff:
            raise UserError(f"{out} holds a selftrain run with another config (differs in: {', '.join(diff)}); "
                            f"use the same config to resume, or a new --out")
    else:
        write_atomic(path, json.dumps(now, indent=2) + "\n")


def run_selftrain(cfg: SelftrainConfig, progress: bool = True) -> dict:
    """Every round of `cfg` into cfg.out (rounds with a done marker are read, not rerun); returns
    the summary (also OUT/summary.json) and prints its table."""
    from sprint_jax import outlock
    from sprint_jax.errors import UserError
    from sprint_jax.fsutil import write_atomic
    from sprint_jax.model.tokenizer import load_tokenizer
    from sprint_jax.train.trainer import train

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with outlock.locked(out, "selftrain --out"):
        _check_config(out, cfg)
        oc = orchestrator_config(cfg, cfg.model)
        train_tasks = load_task_set(cfg.train_tasks, "train_tasks")
        heldout_tasks = load_task_set(cfg.heldout_tasks, "heldout_tasks")
        engines = _Engines(cfg, oc)
        kind = "rft" if cfg.mode == "sequential" else "sprint"
        rows: list[dict] = []
        model = str(cfg.model)
        for r in range(cfg.rounds + 1):
            rdir = out / f"round_{r}"
            done = rdir / ROUND_DONE
            if done.exists():
                row = json.loads(done.read_text(encoding="utf-8"))
                _say(f"[round {r}/{cfg.rounds}] done earlier ({done}); skipped")
                rows.append(row)
                model = row["model"]
                continue
            rdir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            if r == 0:
                _say(f"[round 0/{cfg.rounds}] held-out evaluation of the start model {model} "
                     f"({len(heldout_tasks)} problems)")
                row = {"round": 0, "model": model}
                row.update(_heldout(cfg, engines, model, heldout_tasks, oc, rdir, progress))
            else:
                _say(f"[round {r}/{cfg.rounds}] sampling {cfg.samples} x {len(train_tasks)} training problems with "
                     f"{model} (temperature {oc.temperature}, top-p {oc.top_p})")
                samples = _samples(cfg, engines, model, train_tasks, oc, rdir, progress)
                kept = keep_samples(samples, cfg.keep)
                fig = yield_figures(samples, kept)
                _say(f"[round {r}/{cfg.rounds}] kept {fig['kept']} of {fig['sampled']} ({100 * fig['yield']:.1f}%), "
                     f"{fig['problems_with_kept']} of {fig['problems']} problems with one or more; "
                     f"keep={cfg.keep}")
                if not kept:
                    raise UserError(f"round {r}: no sampled trajectory was correct and well-formed (0 of "
                                    f"{fig['sampled']}), so there is nothing to train on; raise samples or "
                                    f"orchestrator budgets, or start from a better model")
                _write_jsonl(rdir / "train.jsonl", training_records(kept, kind, r))
                init = model if cfg.init_from == "previous" else str(cfg.model)
                tc = train_config(cfg, init, rdir / "train.jsonl")
                _say(f"[round {r}/{cfg.rounds}] training {tc.steps} steps on {len(kept)} examples from {init}")
                summary_path = rdir / "model" / "summary.json"
                if summary_path.exists():
                    tsum = json.loads(summary_path.read_text(encoding="utf-8"))
                else:
                    tsum = train(tc, rdir / "model", tokenizer=load_tokenizer(init), progress=progress)
                model = str(tsum["export_dir"])
                _say(f"[round {r}/{cfg.rounds}] held-out evaluation of {model} ({len(heldout_tasks)} problems)")
                row = {"round": r, "model": model, **fig, "train_steps": tsum.get("steps"),
                       "final_loss": tsum.get("final_loss")}
                row.update(_heldout(cfg, engines, model, heldout_tasks, oc, rdir, progress))
            row["wall_s"] = time.perf_counter() - t0
            write_atomic(done, json.dumps(row, indent=2) + "\n")
            rows.append(row)
            _say(f"[round {r}/{cfg.rounds}] held-out accuracy {row['accuracy']:.3f}, mean critical path "
                 f"{row['mean_sequential_tokens']:.2f} sequential tokens ({row['heldout_n']} problems)")
        summary = {"rounds": rows, "config": json.loads((out / CONFIG_FILE).read_text(encoding="utf-8")),
                   "elapsed_s": time.perf_counter() - t_start}
        write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    _say(format_table(rows))
    _say(f"summary: {out / SUMMARY_FILE}")
    return summary


def format_table(rows: list[dict]) -> str:
    """The per-round table: yield, held-out accuracy and mean critical path."""
    head = (f"{'round':>5} {'kept/sampled':>13} {'yield':>6} {'problems kept':>14} {'kept seq':>9} "
            f"{'held-out n':>10} {'accuracy':>9} {'format ok':>9} {'seq tokens':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["round"] == 0:
            ks, y, pk, kseq = "-", "-", "-", "-"
        else:
            ks, y = f"{r['kept']}/{r['sampled']}", f"{r['yield']:.3f}"
            pk, kseq = f"{r['problems_with_kept']}/{r['problems']}", f"{r['kept_mean_sequential_tokens']:.2f}"
        lines.append(f"{r['round']:>5} {ks:>13} {y:>6} {pk:>14} {kseq:>9} {r['heldout_n']:>10} "
                     f"{r['accuracy']:>9.3f} {r['format_valid']:>9.3f} {r['mean_sequential_tokens']:>10.2f}")
    lines.append("  yield: kept / sampled; kept seq: mean critical path of the kept trajectories; seq tokens: "
                 "mean critical path on the held-out problems (planner + longest executor per stage)")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="selftrain config (YAML), e.g. configs/selftrain_tiny_cpu.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set rounds=3 or --set train.steps=50 (repeatable)")
    p.add_argument("--out", default=None, help="output directory (default: the config's out); rerun to resume")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args) -> int:
    cfg = load_selftrain_config(args.config, args.set, args.out)
    run_selftrain(cfg, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    from sprint_jax.cli import main
    sys.exit(main(["selftrain", *sys.argv[1:]]))
