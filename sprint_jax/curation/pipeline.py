"""The curation driver (docs/design.md "Curation"; paper §4-5, §10):

tasks -> teacher traces -> correctness filter -> step extraction (+ merge short executions)
-> dependency DAG -> σ packing and the ρ filter -> reformat (sprint.jsonl, and rft.jsonl from the
same correct traces, unrestructured). With `restructure: rewrite` the three middle stages are one,
`rewrite`: an LLM rewrites each correct trace into SPRINT tags and the reply is checked
(curation/rewrite.py); with `restructure: threadweaver_rewrite` they are ThreadWeaver's five
steps, `tw1_spans` ... `tw5_validate`, one LLM call each, each reply checked before the next step
(curation/tw_rewrite.py), and the examples are in ThreadWeaver's format (the RFT twins too: a
trace with no block).

Stages run one after another over the tasks still pending at each (store.pending), every record
committed as soon as it is done, so `run_pipeline` can be killed at any point and called again
with the same config to finish the job without repeating a paid call. Output files and the report
are rebuilt from the store at the end of every run, in task order, so an interrupted-and-resumed
run writes the same bytes as an uninterrupted one.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from tqdm import tqdm

from sprint_jax.errors import UserError
from sprint_jax.config import to_dict
from sprint_jax.curation.config import CurateConfig, data_fingerprint
from sprint_jax.curation.dag import DagFailed, propose_llm, propose_offline, validate_edges
from sprint_jax.curation.extract import ExtractFailed, extract_llm, extract_offline, merge_short
from sprint_jax.curation.llm import CachedChat, CallStats, EndpointRefused, LLMCallError
from sprint_jax.curation.store import ALL_STAGES, STAGES, STAGES_OF, Store
from sprint_jax.curation.teacher import TeacherRejected, check_answer, make_teacher, task_prompt
from sprint_jax.schema import Example
from sprint_jax.tasks.types import Task
from sprint_jax.fsutil import write_atomic

DB_NAME = "curation.sqlite"
SPRINT_FILE = "sprint.jsonl"
RFT_FILE = "rft.jsonl"
REPORT_FILE = "curation_report.json"

RATIO_BIN_EDGES = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)


def load_tasks(cfg: CurateConfig) -> list[Task]:
    from sprint_jax import tasks as task_kinds
    t = cfg.tasks
    if t.source == "file":
        if not Path(t.path).exists():
            raise UserError(f"tasks.path: no such file or directory {t.path}")
        return task_kinds.load_task_file(t.path, t.kind, limit=t.limit, split=t.split)
    if t.source == "hf_dataset":
        return task_kinds.load_hf_dataset(t.path, t.kind, t.split, t.name, limit=t.limit)
    if t.source == "chains":
        tasks = task_kinds.chains.mixed_training_set(t.n, t.seed, t.min_chains, t.max_chains, t.chain_length,
                                                     t.held_out)
        return tasks[: t.limit] if t.limit is not None else tasks
    tasks = task_kinds.countdown.generate(t.n, t.seed)
    return tasks[: t.limit] if t.limit is not None else tasks


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


class Curation:
    """One run over one store. `run(stages)` processes what is pending; `report()` summarises."""

    def __init__(self, cfg: CurateConfig, out_dir: str | Path, progress: bool = True):
        self.cfg = cfg
        self.out = Path(out_dir)
        self.progress = progress
        self.store = Store(self.out / DB_NAME, stages=STAGES_OF[cfg.restructure])
        self.stats = CallStats()
        self._chats: dict[str, CachedChat] = {}
        try:
            self._check_fingerprint()
        except BaseException:
            self.store.close()
            raise

    def close(self) -> None:
        self.store.close()

    def _check_fingerprint(self) -> None:
        now = data_fingerprint(self.cfg)
        before = self.store.get_meta("config")
        if before is None:
            self.store.set_meta("config", now)
            return
        diff = _diff(before, now)
        if diff:
            raise UserError(
                f"{self.out} holds a run curated with a different config (differs in: {', '.join(diff)}); "
                f"resume with the same config or choose a new --out")

    def chat(self, section: str) -> CachedChat:
        """The endpoint of a config section, checking its key up front (clear error naming the variable)."""
        if section not in self._chats:
            endpoint = getattr(self.cfg, section)
            endpoint.api_key(section)
            purpose = {"teacher": "teacher", "extractor": "extract", "dag": "dag", "rewriter": "rewrite"}[section]
            self._chats[section] = CachedChat(endpoint, self.store, purpose, section, self.stats,
                                              seed=self.cfg.seed)
        return self._chats[section]

    def step_chat(self, step: str) -> CachedChat:
        """The rewriter's endpoint for one ThreadWeaver rewrite step (its calls counted under the
        step's name in the report's `llm`)."""
        key = f"rewriter:{step}"
        if key not in self._chats:
            self.cfg.rewriter.api_key("rewriter")
            self._chats[key] = CachedChat(self.cfg.rewriter, self.store, step, "rewriter", self.stats,
                                          seed=self.cfg.seed)
        return self._chats[key]

    # ---- driver --------------------------------------------------------------------------------
    def run(self, stages: Iterable[str] | None = None) -> dict:
        mine = self.store.stages
        stages = list(mine if stages is None else stages)
        for s in stages:
            if s not in ALL_STAGES:
                raise UserError(f"unknown stage {s!r}; choose from {', '.join(mine)}")
            if s not in mine:
                raise UserError(f"stage {s} is not part of restructure: {self.cfg.restructure} "
                                f"(its stages: {', '.join(mine)})")
        t0 = time.time()
        self.store.clear_retryable_failures()
        for stage in mine:
            if stage in stages:
                getattr(self, f"_stage_{stage}")()
        self.write_outputs()
        report = self.report(seconds=time.time() - t0)
        write_atomic(self.out / REPORT_FILE, json.dumps(report, indent=2, sort_keys=True) + "\n")
        return report

    def _bar(self, total: int, desc: str):
        return tqdm(total=total, desc=f"curate {desc}", unit="task", file=sys.stderr,
                    disable=not self.progress, dynamic_ncols=True)

    def _each(self, stage: str, work: Callable[[Task], None], workers: int) -> None:
        """Apply `work` to every pending task (in a thread pool when `workers` > 1). `work` records
        per-task outcomes itself; only run-ending errors (EndpointRefused, interrupts) escape."""
        ids = self.store.pending(stage)
        if not ids:
            return
        tasks = self.store.tasks(ids)
        with self._bar(len(tasks), stage) as bar:
            if workers <= 1:
                for task in tasks:
                    work(task)
                    bar.update()
                return
            pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"curate-{stage}")
            try:
                futures = [pool.submit(work, t) for t in tasks]
                for f in cf.as_completed(futures):
                    f.result()
                    bar.update()
            finally:
                pool.shutdown(wait=True, cancel_futures=True)

    def _llm_guard(self, stage: str, task: Task, fn: Callable[[], None]) -> None:
        try:
            fn()
        except LLMCallError as e:
            self.store.put_failure(task.id, stage, "api_error" if e.retryable else "request_refused",
                                   str(e), retryable=e.retryable)
        except EndpointRefused as e:
            raise UserError(str(e)) from None

    # ---- stages --------------------------------------------------------------------------------
    def _stage_tasks(self) -> None:
        tasks = load_tasks(self.cfg)
        if not tasks:
            raise UserError("the task source produced no tasks")
        if self.store.tasks():
            have = [t.id for t in self.store.tasks()]
            if have != [t.id for t in tasks]:
                raise UserError(f"{self.out} already holds a different task list; choose a new --out")
            return
        with self._bar(len(tasks), "tasks") as bar:
            self.store.add_tasks(tasks)
            bar.update(len(tasks))

    def _stage_teacher(self) -> None:
        cfg = self.cfg.teacher
        if not self.store.pending("teacher"):
            return
        teacher = make_teacher(self.cfg, self.chat("teacher") if cfg.kind == "openai" else None)

        def work(task: Task) -> None:
            def go() -> None:
                try:
                    self.store.put_trace(teacher.generate(task))
                except TeacherRejected as e:
                    self.store.put_failure(task.id, "teacher", e.reason, e.detail)
            self._llm_guard("teacher", task, go)

        self._each("teacher", work, cfg.concurrency if cfg.kind == "openai" else 1)

    def _stage_filter(self) -> None:
        def work(task: Task) -> None:
            ok, reason = check_answer(task, self.store.trace(task.id))
            self.store.put_verdict(task.id, ok, reason or "incorrect")
        # graders may use signal-based timeouts, which only work on the main thread
        self._each("filter", work, 1)

    def _stage_extract(self) -> None:
        cfg = self.cfg.extractor
        if not self.store.pending("extract"):
            return
        chat = self.chat("extractor") if cfg.kind == "llm" else None

        def work(task: Task) -> None:
            def go() -> None:
                trace = self.store.trace(task.id)
                try:
                    raw = (extract_llm(chat, task_prompt(task), trace.text) if chat is not None
                           else extract_offline(trace.text))
                    merged = merge_short(raw, self.cfg.merge_min_chars)
                    if not merged:
                        raise ExtractFailed("no_steps", "no step left after merging")
                except ExtractFailed as e:
                    self.store.put_failure(task.id, "extract", e.reason, e.detail)
                    return
                self.store.put_steps(task.id, raw, merged)
            self._llm_guard("extract", task, go)

        self._each("extract", work, cfg.concurrency if chat is not None else 1)

    def _stage_dag(self) -> None:
        cfg = self.cfg.dag
        if not self.store.pending("dag"):
            return
        chat = self.chat("dag") if cfg.kind == "llm" else None

        def work(task: Task) -> None:
            def go() -> None:
                steps = self.store.steps(task.id)
                try:
                    proposed = propose_llm(chat, task_prompt(task), steps) if chat is not None \
                        else propose_offline(steps, task_prompt(task))
                    result = validate_edges(len(steps), proposed, cfg.invalid_edge_policy)
                except DagFailed as e:
                    self.store.put_failure(task.id, "dag", e.reason, e.detail)
                    return
                self.store.put_dag(task.id, result.edges, proposed, result.dropped)
            self._llm_guard("dag", task, go)

        self._each("dag", work, cfg.concurrency if chat is not None else 1)

    def _stage_pack(self) -> None:
        from sprint_jax.curation import packing

        def work(task: Task) -> None:
            steps = self.store.steps(task.id)
            edges = self.store.dag(task.id)["edges"]
            sigma = [int(s) for s in packing.stage_numbers([s.plan_only for s in steps], edges)]
            ratio = float(packing.parallelization_ratio(sigma))
            self.store.put_packing(task.id, sigma, len(packing.stages(sigma)), ratio, self.cfg.min_ratio)

        self._each("pack", work, 1)

    def _stage_rewrite(self) -> None:
        from sprint_jax.curation import rewrite

        if not self.store.pending("rewrite"):
            return
        chat = self.chat("rewriter")
        replies = {}

        def fetch(task: Task) -> None:
            def go() -> None:
                replies[task.id] = chat.complete(rewrite.rewrite_messages(task, self.store.trace(task.id)))
            self._llm_guard("rewrite", task, go)

        def check(task: Task) -> None:
            reply = replies.pop(task.id)
            try:
                ok = rewrite.check_reply(task, self.store.trace(task.id), reply.content, reply.finish_reason)
            except rewrite.RewriteRejected as e:
                self.store.put_failure(task.id, "rewrite", e.reason, e.detail)
                return
            self.store.put_rewrite(task.id, ok.completion, ok.widths)

        # paid calls in parallel (each stored as it lands); the checks grade, and graders may use
        # signal-based timeouts, which only work on the main thread
        self._each("rewrite", fetch, self.cfg.rewriter.concurrency)
        self._each("rewrite", check, 1)

    def _tw_step(self, step: str) -> None:
        """One of ThreadWeaver's five rewrite steps over its pending tasks: the paid calls in
        parallel (each stored as it lands, so a rerun never pays for it again), then the checks,
        each accepted output stored as the step's outcome (what the next step reads)."""
        from sprint_jax.curation import tw_rewrite

        if not self.store.pending(step):
            return
        chat = self.step_chat(step)
        earlier = tw_rewrite.STEPS[:tw_rewrite.STEPS.index(step)]
        replies = {}

        def prior(task: Task) -> dict:
            return {s: self.store.step(s, task.id) for s in earlier}

        def fetch(task: Task) -> None:
            def go() -> None:
                try:
                    msgs = tw_rewrite.messages(step, task, self.store.trace(task.id), prior(task))
                except tw_rewrite.StepRejected as e:          # nothing to ask: no call
                    self.store.put_failure(task.id, step, e.reason, e.detail)
                    return
                replies[task.id] = chat.complete(msgs, response_format=tw_rewrite.response_format(step))
            self._llm_guard(step, task, go)

        def check(task: Task) -> None:
            reply = replies.pop(task.id, None)
            if reply is None:
                return
            try:
                value = tw_rewrite.check(step, task, self.store.trace(task.id), prior(task), reply.content,
                                         reply.finish_reason)
            except tw_rewrite.StepRejected as e:
                self.store.put_failure(task.id, step, e.reason, e.detail)
                return
            self.store.put_step(step, task.id, value)

        # step 5 grades, and graders may use signal-based timeouts, which only work on the main thread
        self._each(step, fetch, self.cfg.rewriter.concurrency)
        self._each(step, check, 1)

    def _stage_tw1_spans(self) -> None:
        self._tw_step("tw1_spans")

    def _stage_tw2_threads(self) -> None:
        self._tw_step("tw2_threads")

    def _stage_tw3_rewrite(self) -> None:
        self._tw_step("tw3_rewrite")

    def _stage_tw4_outlines(self) -> None:
        self._tw_step("tw4_outlines")

    def _stage_tw5_validate(self) -> None:
        self._tw_step("tw5_validate")

    def _sprint_example(self, task: Task, prompt: str, final_answer: str, base: dict) -> tuple[str, dict]:
        """(completion, meta) of a kept task's SPRINT example, from the path this run restructures by.
        Raises ValueError when it cannot be rendered."""
        from sprint_jax import format as fmt
        from sprint_jax.curation import reformat

        if self.cfg.restructure == "threadweaver_rewrite":
            from sprint_jax.threadweaver import FORMAT_META_KEY
            tw5 = self.store.step("tw5_validate", task.id)
            return tw5["completion"], {**base, "restructure": "threadweaver_rewrite", FORMAT_META_KEY: "threadweaver",
                                       "rewriter": self.cfg.rewriter.model, "n_stages": len(tw5["widths"]),
                                       "widths": tw5["widths"]}
        if self.cfg.restructure == "rewrite":
            rw = self.store.rewrite(task.id)
            return rw["completion"], {**base, "restructure": "rewrite", "rewriter": self.cfg.rewriter.model,
                                      "n_stages": len(rw["widths"]), "widths": rw["widths"]}
        steps = self.store.steps(task.id)
        edges = self.store.dag(task.id)["edges"]
        pack = self.store.packing(task.id)
        completion = fmt.render_completion(reformat.to_sprint(prompt, steps, edges, final_answer))
        return completion, {**base, "n_steps": len(steps), "n_stages": pack["n_stages"], "ratio": pack["ratio"],
                            "sigma": pack["sigma"], "edges": [list(e) for e in edges]}

    def _stage_reformat(self) -> None:
        from sprint_jax.curation import reformat
        from sprint_jax.schema import QUERY_WRAPPERS, wrap_query

        kept = set(self.store.survivors(self.store.stages[-2]))     # pack, rewrite, or tw5_validate
        threadweaver = self.cfg.restructure == "threadweaver_rewrite"

        def work(task: Task) -> None:
            trace = self.store.trace(task.id)
            prompt = task_prompt(task)
            # what the examples' prompt field holds; the bare `prompt` is what the teacher saw
            # (its echo is removed from the RFT trace) and what the SPRINT body is built from
            model_prompt = prompt if self.cfg.prompt_wrapper == "none" else \
                wrap_query(prompt, *QUERY_WRAPPERS[self.cfg.prompt_wrapper])
            base = {"task_id": task.id, "task_kind": task.kind, "teacher": trace.teacher}
            examples = []
            failure = None
            sprint_completion = sprint_meta = None
            if task.id in kept:
                try:
                    sprint_completion, sprint_meta = self._sprint_example(task, prompt, trace.final_answer, base)
                except ValueError as e:   # e.g. an extracted step that contains a SPRINT tag
                    failure = ("render_error", f"sprint: {e}")
            if (sprint_completion is not None) or self.cfg.rft_source == "correct":
                try:
                    rft = Example(id=task.id, kind="rft", prompt=model_prompt,
                                  completion=reformat.to_rft(prompt, trace.text, trace.final_answer),
                                  answer=task.answer, meta=base)
                    if threadweaver:      # the sequential baseline in the same format: a trace with no block
                        from sprint_jax.threadweaver import convert_example
                        rft = convert_example(rft, "threadweaver")
                    examples.append(rft)
                except ValueError as e:   # threadweaver.ConversionError is one
                    failure = failure or ("render_error", f"rft: {e}")
                    if self.cfg.rft_source == "sprint":
                        sprint_completion = None   # keep the two sets over the same traces
            if sprint_completion is not None:
                examples.insert(0, Example(
                    id=task.id, kind="sprint", prompt=model_prompt, completion=sprint_completion, answer=task.answer,
                    meta=sprint_meta))
            self.store.put_examples(task.id, examples, failure)

        self._each("reformat", work, 1)

    # ---- outputs -------------------------------------------------------------------------------
    def write_outputs(self) -> None:
        for kind, name in (("sprint", SPRINT_FILE), ("rft", RFT_FILE)):
            lines = [json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in self.store.examples(kind)]
            write_atomic(self.out / name, "".join(lines))

    def report(self, seconds: float | None = None) -> dict:
        stage_counts = self.store.stage_counts()
        ratios = self.store.ratios()
        return {
            "counts": {s: c["kept"] for s, c in stage_counts.items()}
                      | {"sprint_examples": stage_counts["reformat"]["sprint_examples"],
                         "rft_examples": stage_counts["reformat"]["rft_examples"]},
            "stages": stage_counts,
            "discards": self.store.failure_counts(),
            "dropped_edges": self.store.dropped_edge_counts(),
            "ratio": {"histogram": ratio_histogram(ratios), "n": len(ratios),
                      "mean": (sum(ratios) / len(ratios)) if ratios else None,
                      "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None,
                      "min_ratio": self.cfg.min_ratio},
            "shape": example_shapes(self.store.examples("sprint")),
            "llm": self.store.call_totals(),
            "run": {"out": str(self.out), "config": to_dict(self.cfg), **self.stats.as_dict(),
                    "seconds": None if seconds is None else round(seconds, 3)},
        }


def example_shapes(records: list[dict]) -> dict:
    """Stages and most prompts per stage of the kept parallel examples (`caps.example_shape`, in
    each record's format, `meta.format`, SPRINT without one): max, p99 and the count of examples
    per value, what `train` records and eval's default caps come from (`sprint_jax.caps`)."""
    from sprint_jax import caps
    from sprint_jax.threadweaver import FORMAT_META_KEY

    shapes = [caps.example_shape(r["completion"], (r.get("meta") or {}).get(FORMAT_META_KEY, "sprint"))
              for r in records]
    shapes = [s for s in shapes if s is not None]
    out = caps.shape_summary(shapes)
    for k, part in ((0, "stages"), (1, "prompts")):
        counts: dict[str, int] = {}
        for v in sorted(s[k] for s in shapes):
            counts[str(v)] = counts.get(str(v), 0) + 1
        out[part]["histogram"] = counts
    return out


def ratio_histogram(ratios: list[float]) -> dict[str, int]:
    """Counts of ρ in fixed bins [a, b) (the last bin open-ended), so reports compare across runs."""
    labels = [f"[{a:g},{b:g})" for a, b in zip(RATIO_BIN_EDGES, RATIO_BIN_EDGES[1:])]
    labels.append(f"[{RATIO_BIN_EDGES[-1]:g},inf)")
    counts = dict.fromkeys(labels, 0)
    for r in ratios:
        k = sum(1 for e in RATIO_BIN_EDGES if r >= e) - 1
        counts[labels[max(k, 0)]] += 1
    return counts



def run_pipeline(config: CurateConfig, out_dir: str | Path | None = None, stages: Iterable[str] | None = None,
                 progress: bool = True) -> dict:
    """Run (or resume) curation into `out_dir` (default config.out); returns the report dict.

    The directory is locked for the run (`sprint_jax.outlock`): a second run into it stops at once.
    A run that fails before any task was stored leaves nothing it created (`_discard_unused`): a
    store left behind would refuse the corrected rerun as "a different config"."""
    from sprint_jax import outlock

    out = Path(out_dir if out_dir is not None else config.out)
    from sprint_jax.outlock import LOCK_FILE
    fresh_dir, fresh_db, fresh_lock = not out.exists(), not (out / DB_NAME).exists(), not (out / LOCK_FILE).exists()
    discarded = False
    try:
        with outlock.locked(out, "curation output directory"):
            try:
                cur = Curation(config, out, progress=progress)
                try:
                    return cur.run(stages)
                finally:
                    cur.close()
            except BaseException:
                discarded = fresh_db and _discard_unused(out, fresh_lock)
                raise
    finally:
        if discarded and fresh_dir:
            try:
                out.rmdir()           # only when empty
            except OSError:
                pass


def _discard_unused(out: Path, lock_too: bool) -> bool:
    """Delete OUT's store when it holds no task and no LLM call (and, with `lock_too`, the lock
    file, still held: a run starting now creates its own); True when deleted."""
    import sqlite3

    db = out / DB_NAME
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            used = sum(con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("tasks", "llm_calls"))
        finally:
            con.close()
    except sqlite3.Error:
        return False
    if used:
        return False
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    if lock_too:
        from sprint_jax.outlock import LOCK_FILE
        (out / LOCK_FILE).unlink(missing_ok=True)
    return True


def status(out_dir: str | Path) -> dict:
    """Counts per stage, discards and LLM totals of an existing run (reads the store only)."""
    path = Path(out_dir) / DB_NAME
    if not path.exists():
        raise UserError(f"no curation store at {path}")
    import sqlite3

    from sprint_jax.curation.store import StoreError
    with Store(path, read_only=True) as store:        # status never writes (not even a schema)
        try:
            fingerprint = store.get_meta("config")       # the run's stages follow its `restructure`
            restructure = fingerprint.get("restructure", "dag") if isinstance(fingerprint, dict) else "dag"
            store.stages = STAGES_OF.get(restructure, STAGES)
            return {"stages": store.stage_counts(), "discards": store.failure_counts(),
                    "dropped_edges": store.dropped_edge_counts(), "llm": store.call_totals()}
        except (sqlite3.DatabaseError, ValueError) as e:   # ValueError: a meta record that is not JSON
            raise StoreError(f"{path} is not a readable curation store ({e})") from None
