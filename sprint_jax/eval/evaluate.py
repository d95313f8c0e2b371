"""Evaluation: run the orchestrator over tasks, grade the final answers, write results and a report.

Paper §13: accuracy and sequential tokens of a SPRINT model against its RFT baseline on the same
problems. One problem = one orchestrator run (`sprint_jax.infer.orchestrator`); its answer is graded by
`sprint_jax.tasks.grade_result` by task kind (MATH with math-verify, Countdown's equation rules,
multiple-choice letters). Which text is the answer is `answer_from` (`sprint_jax.tasks.answers`):
the `<Final Answer>` block (default), the last \\boxed{} (a base model without our format), or
`auto` (the block, else the box). A run with no answer is graded wrong; a grader that fails is
graded wrong AND counted (`grader_error` per result, `grader_errors` in the report) and logged.

Prompts. `prompt_fn(task) -> str` forms the text the model sees before its completion. The
default is `sprint_jax.tasks.task_prompt`, the same function curation uses to write the
training examples' prompts: the task's problem text, and for Countdown `countdown.prompt_for`
(TinyZero's prompt). Pass your own when the model was trained on another prompt (the demo does).

Outputs in `out_dir` (when given): results.jsonl (one line per problem and sample, written as it finishes),
records.jsonl (the full run records), eval_run.json (what the run used: mode, orchestrator config,
meta, a digest of the model's weights, a digest of each problem's prompt and gold answer),
report.json (written last, atomically), and the plots of `report.write_plots`.

Timing. XLA compilation (tracing, lowering and compiling a program the engine meets for the first
time) is timed apart, from the spans JAX reports (`CompileClock`): each problem's `wall_s` is its
wall clock with the compilation that stalled it taken out, `compile_s` that compilation, and
`finished_s`, `invocation`, `concurrency` place it in the run (`report.TIMING_FIELDS`). The run's
wall clock is derived from these (`report.run_wall_clock`). Nothing is run twice: the records
are those of an untimed run.

KV pool. With an engine that pages its KV cache (`Engine.page_stats`), report.json's `engine_pool`
holds the pool's pages (in all, page size; free, held by live sequences and cached only when the
run ended) and what this invocation's runs did with it: their prompt tokens (each run opens its
prompt once), how many of them came from the prefix cache instead of being prefilled, and the
cached pages evicted (`engine_pool_figures`).

Samples. `samples=k` runs each problem k times; a results line is one (problem, sample) run, and
its `sample` names it. A sampled run (temperature > 0) draws with its own seed, `run_seed(config
seed, problem id, sample)`: a stable hash of the three, so different problems draw independently
at the same sample index, and a run's draw depends on neither the problems beside it, their order,
the concurrency, --limit nor resuming. Greedy runs keep the config as it is.

Resume. A rerun into the same directory skips the (problem, sample) runs already in results.jsonl
(complete lines only: a line cut by a kill is dropped and rerun; a run asked for more samples
runs only the new ones; a damaged line, one that is not UTF-8 or not JSON, lacks a field or has
one of the wrong type, or whose tokens differ from its record's, is never kept: it is dropped,
said in one line on stderr, and its run redone) after checking that the run is the same,
like `curate` does: a different mode, orchestrator config, model weights or problem text is
refused naming what differs, unless `overwrite=True` (`eval --overwrite`), which starts the
directory afresh. A rerun over fewer problems (a smaller `--limit`) keeps the others' results on
disk; its report covers the problems it was asked for (`problems_in_out` counts the lines on
disk). The directory is locked for the run (`sprint_jax.outlock`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sprint_jax.tasks import Task, extract_answer, grade_result, task_prompt
from sprint_jax.eval.report import (TIMING_FIELDS, check_result_row, make_report, outcome, sample_of, union_length,
                                    untimed, write_plots)
from sprint_jax.infer.orchestrator import MODES, OrchestratorConfig, RunRecord, run_many
from sprint_jax.fsutil import write_atomic

RESULTS_FILE = "results.jsonl"
RECORDS_FILE = "records.jsonl"
REPORT_FILE = "report.json"
RUN_FILE = "eval_run.json"
# a longer or shorter run over the same problems, or with more or fewer samples of each, may resume
_UNCHECKED_META = ("limit", "samples")
# the spans JAX reports for compiling a program: tracing it, lowering it, compiling it
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
    """Between `start()` and `stop()`, collects the compile spans JAX reports (`COMPILE_EVENTS`,
    through `jax.monitoring`); `within(a, b)` is the seconds of [a, b] (`time.time()` clock) spent
    compiling, overlapping spans counted once. Compilation blocks the thread that drives the
    engine, so it stalls every problem in flight."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []

    def _on_span(self, event: str, start: float, end: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.spans.append((start, end))

    def start(self) -> "CompileClock":
        from jax import monitoring
        monitoring.register_event_time_span_listener(self._on_span)
        return self

    def stop(self) -> None:
        from jax import monitoring
        monitoring.unregister_event_time_span_listener(self._on_span)

    def within(self, a: float, b: float) -> float:
        return union_length([(max(s, a), min(e, b)) for s, e in self.spans])


def default_prompt(task: Task) -> str:
    """The task as curation wrote it into the training prompts (see the module docstring)."""
    return task_prompt(task)


def result_of(task: Task, record: RunRecord, answer_from: str = "final_answer", sample: int = 0) -> dict[str, Any]:
    """One results.jsonl line: the graded outcome and the accounting of run `sample` of the task
    (`wall_s` the record's; `evaluate` replaces it with the time apart from compilation and adds
    the other `TIMING_FIELDS`). `outcome`: correct / wrong / context_full / capped (report.outcome);
    `forks`: the stages whose executors ran on a fork (an inline execution is no fork);
    `prompts_dropped`: prompts of forked stages that got no executor (past max_prompts or the
    engine's branches)."""
    answer = extract_answer(record.final_answer, record.text, answer_from)
    graded = grade_result(task, answer)
    row = {
        "id": task.id,
        "sample": sample,
        "kind": task.kind,
        "mode": record.mode,
        "correct": graded.correct,
        "grader_error": graded.error,
        "final_answer": answer,
        "gold": task.answer,
        "sequential_tokens": record.sequential_tokens,
        "total_tokens": record.total_tokens,
        "stages": len(record.stages),
        "executors": sum(len(s.executions) for s in record.stages),
        "forks": sum(1 for s in record.stages if s.executor_mode in ("shared", "serial")),
        "wall_s": record.wall_s,
        "problems": list(record.problems),
        "prompts_dropped": sum(max(0, len(s.prompts) - len(s.executions)) for s in record.stages
                               if s.executor_mode in ("shared", "serial")),
        "format_valid": record.format_valid,
        "termination": record.termination,
    }
    row["outcome"] = outcome(row)
    return row


def _resumable_rows(path: Path, problem: Callable[[dict, str], str | None]
                    ) -> tuple[dict[tuple[str, int], dict], list[str]]:
    """((id, sample) -> row, damaged) of a jsonl file written line by line. A last line cut by a
    kill (no newline after it, not JSON) is skipped silently; every other line that is not UTF-8,
    not a JSON object, or that `problem(row, "file:line")` finds a fault in (it returns why, or
    None) is left out and listed in `damaged` as "file:line: why"."""
    rows: dict[tuple[str, int], dict] = {}
    damaged: list[str] = []
    if not path.exists():
        return rows, damaged
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            damaged.append(f"{where}: not valid UTF-8")
            continue
        except json.JSONDecodeError:
            if n < len(lines):               # the last piece has no newline after it: a write cut by a kill
                damaged.append(f"{where}: not valid JSON")
            continue
        why = problem(row, where) if isinstance(row, dict) else "not a JSON object"
        if why:
            damaged.append(why if why.startswith(where) else f"{where}: {why}")
            continue
        rows[(str(row["id"]), sample_of(row))] = row
    return rows, damaged


# the fields every results line has (`result_of`), with their types; lines of this version also
# carry the timings (report.TIMING_FIELDS), checked by report.check_result_row
_RESULT_FIELDS = (("kind", lambda v: isinstance(v, str), "a string"),
                  ("mode", lambda v: isinstance(v, str), "a string"),
                  ("grader_error", lambda v: v is None or isinstance(v, str), "a string or null"),
                  ("final_answer", lambda v: v is None or isinstance(v, str), "a string or null"),
                  ("gold", lambda v: True, "present"),
                  ("stages", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number"),
                  ("executors", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number"),
                  ("problems", lambda v: isinstance(v, list), "a list"),
                  ("format_valid", lambda v: isinstance(v, bool), "true or false"),
                  ("termination", lambda v: isinstance(v, str), "a string"),
                  ("outcome", lambda v: isinstance(v, str), "a string"))


def result_row_problem(row: dict, where: str, mode: str) -> str | None:
    """Why a results line cannot be kept by a run in `mode` (None when it can): `check_result_row`,
    the fields `result_of` writes with their types, and its mode."""
    from sprint_jax.eval.report import RunFileError

    try:
        check_result_row(row, where)
    except RunFileError as e:
        return str(e)
    if "sample" in row and (not isinstance(row["sample"], int) or isinstance(row["sample"], bool)
                            or row["sample"] < 0):
        return "field 'sample' must be a whole number >= 0"
    for field, ok, what in _RESULT_FIELDS:
        if field not in row:
            return f"missing field {field!r}"
        if not ok(row[field]):
            return f"field {field!r} must be {what}"
    if row["mode"] != mode:
        return f"field 'mode' is {row['mode']!r} in a {mode} run"
    return None


def record_row_problem(row: dict, where: str, mode: str) -> str | None:
    """Why a records line cannot be kept by a run in `mode` (None when it can):
    `infer.record_rows.record_problem`, and its mode."""
    from sprint_jax.infer.record_rows import record_problem

    why = record_problem(row)
    if why is None and row["mode"] != mode:
        why = f"field 'mode' is {row['mode']!r} in a {mode} run"
    return why


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]



def _prepare_out(out: Path, run: dict, problems: dict[str, str],
                 overwrite: bool) -> tuple[dict[tuple[str, int], tuple[dict, dict]], list[dict]]:
    """Check an existing directory against this run. Returns ((id, sample) -> (result, record) of
    this run's problems already done, every finished result kept on disk, asked for now or not)."""
    from sprint_jax.errors import UserError

    run_file = out / RUN_FILE
    had_results = (out / RESULTS_FILE).exists() and (out / RESULTS_FILE).stat().st_size > 0
    if overwrite or not (run_file.exists() or had_results):
        for name in (RESULTS_FILE, RECORDS_FILE, REPORT_FILE, RUN_FILE):
            (out / name).unlink(missing_ok=True)
        write_atomic(run_file, json.dumps({"run": run, "problems": problems}, indent=1, ensure_ascii=False) + "\n")
        return {}, []
    try:
        before = json.loads(run_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise UserError(f"{out} holds eval results but no readable {RUN_FILE} (written by an older version or "
                        f"damaged), so they cannot be checked: use --overwrite or a new --out") from None
    diff = _diff(before.get("run"), run)
    if diff:
        raise UserError(f"{out} holds an eval run with a different setup (differs in: {', '.join(diff)}); "
                        f"rerun the same command to resume, or use --overwrite or a new --out")
    old_problems = before.get("problems", {})
    changed = [i for i, d in problems.items() if i in old_problems and old_problems[i] != d]
    if changed:
        raise UserError(f"{out}: problem {changed[0]!r} has a different prompt or answer than when it was evaluated "
                        f"({len(changed)} such); use --overwrite or a new --out")
    mode = run["mode"]
    results, damaged = _resumable_rows(out / RESULTS_FILE, lambda row, where: result_row_problem(row, where, mode))
    records, damaged_records = _resumable_rows(out / RECORDS_FILE, lambda row, where: record_row_problem(row, where, mode))
    damaged += damaged_records
    # every finished problem stays, asked for this time or not; a result without its record, a
    # cut line, or a damaged one (and its partner) is dropped and, if asked for, redone
    kept = {}
    for i in results:
        if i not in records:
            continue
        r, rec = results[i], records[i]
        if (r["sequential_tokens"], r["total_tokens"]) != (rec["sequential_tokens"], rec["total_tokens"]):
            damaged.append(f"{out / RESULTS_FILE}: problem {i[0]!r} sample {i[1]}: its tokens differ from its "
                           f"record's in {RECORDS_FILE}")
            continue
        kept[i] = (r, rec)
    if damaged:
        import sys
        print(f"eval: {len(damaged)} damaged line(s) in {out} not kept; the problems among them asked for "
              f"run again (first: {damaged[0]})", file=sys.stderr, flush=True)
    write_atomic(out / RESULTS_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r, _ in kept.values()))
    write_atomic(out / RECORDS_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for _, r in kept.values()))
    (out / REPORT_FILE).unlink(missing_ok=True)       # a report describes a finished run only
    write_atomic(run_file, json.dumps({"run": run, "problems": {**old_problems, **problems}}, indent=1,
                                       ensure_ascii=False) + "\n")
    return {i: kept[i] for i in kept if i[0] in problems}, [r for r, _ in kept.values()]


def evaluate(engine: Any, tasks: Sequence[Task], mode: str = "parallel",
             prompt_fn: Callable[[Task], str] | None = None,
             orchestrator_config: OrchestratorConfig | None = None, out_dir: str | Path | None = None,
             progress: bool = True, meta: dict | None = None, overwrite: bool = False,
             answer_from: str = "final_answer", concurrency: int | None = None,
             samples: int = 1) -> tuple[list[dict], dict]:
    """Run every task in `mode` and grade it. Returns (results, report); writes them to out_dir.

    `samples` k runs each task k times (results: task order, samples 0..k-1 of each task in
    turn; each line's `sample`); a sampled run's seed is keyed on (config seed, problem id, sample)
    (`run_config`), so a resumed, extended or reordered run reproduces the samples it already has.
    k > 1 needs sampling (temperature > 0): greedy runs would be k identical copies.

    Up to `concurrency` problems run at once on the engine (default: its sequence slots), every
    planner and executor of them decoding in one batched step; results are written in task order
    either way, so results.jsonl does not depend on the concurrency (timings aside).
    `meta` (e.g. model and data names) is copied into the report. With `out_dir`, problems already
    finished there by the same run are skipped and every finished problem on disk is kept (see the
    module docstring); `overwrite` starts afresh. The report covers `tasks`.
    `answer_from` picks the graded text (see the module docstring). Timings: the module docstring.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    extract_answer(None, "", answer_from)   # reject an unknown mode before any run
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"task ids must be unique; {dup!r} appears twice")
    prompt_fn = prompt_fn or default_prompt
    config = orchestrator_config or OrchestratorConfig()
    if samples > 1 and config.temperature == 0:
        raise ValueError(f"{samples} samples per problem under greedy decoding (temperature 0) would be "
                         f"{samples} identical runs; set a temperature > 0")
    meta = {**(meta or {}), "samples": samples}
    if out_dir is None:
        return _evaluate(engine, tasks, mode, prompt_fn, config, None, progress, meta, {}, [], answer_from,
                         concurrency, samples)
    from sprint_jax import outlock

    out = Path(out_dir)
    with outlock.locked(out, "eval --out"):
        params = getattr(engine, "params", None)
        run = {"mode": mode, "answer_from": answer_from, "config": config.to_json(),
               "meta": {k: v for k, v in (meta or {}).items() if k not in _UNCHECKED_META}}
        if config.temperature > 0:
            run["seeds"] = SEED_RULE
        if params is not None:
            from sprint_jax.treesum import digest
            run["weights"] = digest(params)
        run = json.loads(json.dumps(run, default=str))      # as it reads back from disk (tuples -> lists)
        problems = {str(t.id): _digest([prompt_fn(t), t.answer]) for t in tasks}
        done, on_disk = _prepare_out(out, run, problems, overwrite)
        return _evaluate(engine, tasks, mode, prompt_fn, config, out, progress, meta, done, on_disk, answer_from,
                         concurrency, samples)


# what eval_run.json says about how a sampled run's seed is derived: a directory written under
# another rule is refused on resume instead of mixing two rules' draws
SEED_RULE = "sha256 of [seed, problem id, sample]"


def run_seed(seed: int, problem_id: str, sample: int) -> int:
    """The sampling seed of sample `sample` of problem `problem_id` under the config seed `seed`:
    the first 8 bytes of sha256(json.dumps([seed, problem_id, sample])), big-endian, modulo 2^31.
    Stable across processes and machines (unlike hash()); distinct problems get unrelated seeds."""
    key = json.dumps([int(seed), str(problem_id), int(sample)]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % 2 ** 31


def run_config(config: OrchestratorConfig, problem_id: str, sample: int) -> OrchestratorConfig:
    """The config sample `sample` of problem `problem_id` runs with: under sampling (temperature >
    0) the same with seed `run_seed(config.seed, problem_id, sample)`; greedy, `config` itself."""
    if config.temperature == 0:
        return config
    return dataclasses.replace(config, seed=run_seed(config.seed, problem_id, sample))


def engine_pool_figures(engine, before: dict | None, prompt_tokens: int) -> dict | None:
    """report.json's `engine_pool`: the engine's pool now (`Engine.page_stats`: pages_total,
    page_size, pages_free / pages_used / pages_cached) and, since `before` (page_stats at the start
    of this invocation), prefix_hit_tokens (prompt tokens taken from the cache) and evicted_pages;
    prompt_tokens: this invocation's runs' prompt tokens, prompt_tokens_prefilled the rest of them.
    None for an engine without a paged pool (`before` None)."""
    if before is None:
        return None
    now = engine.page_stats()
    hits = now["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    return dict({k: now[k] for k in ("pages_total", "page_size", "pages_free", "pages_used", "pages_cached")},
                prompt_tokens=prompt_tokens, prefix_hit_tokens=hits, prompt_tokens_prefilled=prompt_tokens - hits,
                evicted_pages=now["evicted_pages"] - before["evicted_pages"])


def _evaluate(engine, tasks, mode, prompt_fn, config, out: Path | None, progress: bool, meta: dict | None,
              done: dict[tuple[str, int], tuple[dict, dict]], on_disk: list[dict], answer_from: str,
              concurrency: int | None, samples: int = 1) -> tuple[list[dict], dict]:
    concurrency = concurrency or engine.max_seqs
    results_by_id: dict[tuple[str, int], dict] = {i: r for i, (r, _) in done.items()}
    wanted = [(t, s) for t in tasks for s in range(samples)]
    todo = [(t, s) for t, s in wanted if (str(t.id), s) not in done]
    # this invocation's number: the problems' intervals are on its own clock (report.run_wall_clock)
    invocation = 1 + max((r.get("invocation") or 0 for r in on_disk), default=0)
    kept_ids = {str(r["id"]) for r in on_disk}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(wanted), initial=len(wanted) - len(todo), desc=f"eval ({mode})",
                   unit="run" if samples > 1 else "problem")
    pool_before = engine.page_stats() if hasattr(engine, "page_stats") else None
    prompt_tokens = 0
    clock = CompileClock().start()
    t0 = time.time()
    files = []
    try:
        if out is not None:
            files = [open(out / name, "a", encoding="utf-8") for name in (RESULTS_FILE, RECORDS_FILE)]
        finished: dict[int, tuple[RunRecord, float]] = {}
        written = 0

        def on_record(i: int, record: RunRecord) -> None:
            nonlocal written, prompt_tokens
            finished[i] = (record, time.time())
            if pool_before is not None and 0 < record.prompt_tokens < engine.max_seq_len:
                prompt_tokens += record.prompt_tokens          # the run opened its prompt
            while written in finished:            # write in task order as soon as possible
                task, sample = todo[written]
                record, end = finished.pop(written)
                written += 1
                result = result_of(task, record, answer_from, sample)
                compile_s = min(record.wall_s, clock.within(end - record.wall_s, end))
                result.update(wall_s=record.wall_s - compile_s, compile_s=compile_s,
                              finished_s=end - t0 - clock.within(t0, end), invocation=invocation,
                              concurrency=concurrency)
                results_by_id[(str(task.id), sample)] = result
                if files:
                    record_row = {"id": task.id, "sample": sample, **record.to_json(), "compile_s": compile_s}
                    for f, row in zip(files, (result, record_row)):
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
                        f.flush()
                if bar is not None:
                    bar.update(1)
                    done_ = list(results_by_id.values())
                    bar.set_postfix(acc=f"{sum(r['correct'] for r in done_) / len(done_):.3f}",
                                    seq=f"{sum(r['sequential_tokens'] for r in done_) / len(done_):.0f}")

        run_many(engine, [prompt_fn(t) for t, _ in todo], mode, config, concurrency=concurrency,
                 on_record=on_record, configs=[run_config(config, str(t.id), s) for t, s in todo])
        compile_s = clock.within(t0, time.time())
    finally:
        clock.stop()
        for f in files:
            f.close()
        if bar is not None:
            bar.close()
    results = [results_by_id[(str(t.id), s)] for t, s in wanted]
    report = make_report(results, mode, compile_s=compile_s, meta={
        **(meta or {}), "answer_from": answer_from, "config": config.to_json(), "concurrency": concurrency})
    pool = engine_pool_figures(engine, pool_before, prompt_tokens)
    if pool is not None:
        report["engine_pool"] = pool
    if done:
        report["resumed_problems"] = len(done)   # finished by an earlier invocation; their timings are kept
    if out is not None:
        report["problems_in_out"] = len(kept_ids | {i for i, _ in results_by_id})
        report["plots"] = write_plots(results, out, mode)
        write_atomic(out / REPORT_FILE, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return results, report


__all__ = ["RESULTS_FILE", "RECORDS_FILE", "REPORT_FILE", "RUN_FILE", "TIMING_FIELDS", "COMPILE_EVENTS",
           "CompileClock", "SEED_RULE", "default_prompt", "engine_pool_figures", "result_of", "untimed", "evaluate",
           "run_config", "run_seed"]
