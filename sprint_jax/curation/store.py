"""The curation store: one SQLite database (WAL) per run (docs/design.md "Curation").

Why a database and not files: the pipeline pays for every teacher / extractor / DAG call, and a
run over thousands of traces gets killed, rate-limited and restarted. Every LLM call is keyed by a
hash of (model, messages, params) and looked up before it is made; every stage result is committed
per record (`synchronous=FULL`), so a killed run resumes where it stopped, loses nothing and never
pays twice. API keys are never part of a request hash or of anything written here.

Stage bookkeeping: a task that leaves the pipeline at stage X has one row in `failures` with
(stage X, reason). Stage X has *survivors* (an outcome row for X and no failure at X) and *pending*
tasks (survivors of the stage before X with neither an outcome nor a failure at X yet). A run's
stage list (`Store.stages`) is `STAGES`, or `REWRITE_STAGES` when a teacher LLM restructures each
trace in one call (config `restructure: rewrite`) instead of extract / dag / pack, or
`TW_REWRITE_STAGES` when it does so in ThreadWeaver's five steps (`threadweaver_rewrite`), each
step a stage of its own whose outcome row is the step's checked output.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from sprint_jax.schema import Example, Step
from sprint_jax.tasks.types import Task, Trace
from sprint_jax.errors import UserError

STAGES = ("tasks", "teacher", "filter", "extract", "dag", "pack", "reformat")
REWRITE_STAGES = ("tasks", "teacher", "filter", "rewrite", "reformat")
TW_STEPS = ("tw1_spans", "tw2_threads", "tw3_rewrite", "tw4_outlines", "tw5_validate")   # curation/tw_rewrite.py
TW_REWRITE_STAGES = ("tasks", "teacher", "filter") + TW_STEPS + ("reformat",)
ALL_STAGES = ("tasks", "teacher", "filter", "extract", "dag", "pack", "rewrite") + TW_STEPS + ("reformat",)
# config `restructure` -> the run's stages
STAGES_OF = {"dag": STAGES, "rewrite": REWRITE_STAGES, "threadweaver_rewrite": TW_REWRITE_STAGES}

# stage -> the table whose row for a task is that stage's outcome
_OUTCOME_TABLE = {"tasks": "tasks", "teacher": "traces", "filter": "verdicts", "extract": "steps",
                  "dag": "dags", "pack": "packings", "rewrite": "rewrites", "reformat": "reformats",
                  **{s: s for s in TW_STEPS}}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
  id TEXT PRIMARY KEY, ord INTEGER NOT NULL, kind TEXT NOT NULL, problem TEXT NOT NULL,
  answer TEXT NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS llm_calls (
  hash TEXT PRIMARY KEY, purpose TEXT NOT NULL, model TEXT NOT NULL, request TEXT NOT NULL,
  response TEXT NOT NULL, content TEXT, finish_reason TEXT,
  prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
  total_tokens INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 1, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS traces (
  task_id TEXT PRIMARY KEY, text TEXT NOT NULL, final_answer TEXT NOT NULL, teacher TEXT NOT NULL,
  usage TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS verdicts (task_id TEXT PRIMARY KEY, correct INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS steps (task_id TEXT PRIMARY KEY, raw TEXT NOT NULL, merged TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS dags (
  task_id TEXT PRIMARY KEY, edges TEXT NOT NULL, proposed TEXT NOT NULL, dropped TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS packings (
  task_id TEXT PRIMARY KEY, sigma TEXT NOT NULL, n_stages INTEGER NOT NULL, ratio REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rewrites (
  task_id TEXT PRIMARY KEY, completion TEXT NOT NULL, widths TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reformats (task_id TEXT PRIMARY KEY, sprint INTEGER NOT NULL, rft INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS examples (
  task_id TEXT NOT NULL, kind TEXT NOT NULL, ord INTEGER NOT NULL, record TEXT NOT NULL,
  PRIMARY KEY (task_id, kind));
CREATE TABLE IF NOT EXISTS failures (
  task_id TEXT NOT NULL, stage TEXT NOT NULL, reason TEXT NOT NULL, detail TEXT NOT NULL,
  retryable INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (task_id, stage));
""" + "".join(f"CREATE TABLE IF NOT EXISTS {s} (task_id TEXT PRIMARY KEY, value TEXT NOT NULL);\n" for s in TW_STEPS)


class StoreError(UserError):
    """A file that is not a readable curation store: the message names it."""


def request_hash(model: str, messages: list[dict], params: dict) -> str:
    """sha256 of the canonical JSON of (model, messages, params). Never includes the API key or the
    base URL: the same request to a mirror of the same model is the same paid call."""
    blob = json.dumps({"model": model, "messages": messages, "params": params},
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


class Store:
    """Thread-safe handle on one run's database. Each write method is one committed transaction."""

    def __init__(self, path: str | Path, read_only: bool = False, stages: tuple[str, ...] = STAGES):
        """Open (or, unless `read_only`, create) the store at `path`; `stages` is the run's stage
        list (`STAGES_OF[restructure]`), which `pending` and `stage_counts` follow.

        A file that is not a store (garbage, truncated, another program's SQLite database) raises
        StoreError naming it, and is never written: the schema goes only into a new or empty file
        or an existing store. `read_only` (for `curate status`) writes nothing at all."""
        self.path = Path(path)
        self.stages = stages
        self._lock = threading.RLock()
        if read_only:
            if not self.path.is_file():
                raise StoreError(f"no curation store at {self.path}")
            uri = f"{self.path.absolute().as_uri()}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=30.0)
        else:
            if self.path.exists() and not self.path.is_file():
                raise StoreError(f"{self.path} is not a file")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None,
                                       timeout=30.0)
        try:
            tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if tables and not {"meta", "tasks", "llm_calls"} <= tables:
                raise StoreError(f"{self.path} is an SQLite database of something else (tables: "
                                 f"{', '.join(sorted(tables)[:5])}), not a sprint-jax curation store; "
                                 f"choose another directory")
            if read_only and not tables:
                raise StoreError(f"{self.path} is empty, not a curation store")
            check = self._db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {check[0] if check else 'no answer'}")
            if not read_only:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            self._db.close()
            if "readonly" in str(e) or "unable to open" in str(e):   # the file or its directory is not writable
                raise StoreError(f"cannot write the curation store {self.path} ({e}): make it and its directory "
                                 f"writable and rerun the same command, or choose another --out") from None
            raise StoreError(f"{self.path} is not a readable curation store ({e}); it may be damaged or "
                             f"another program's file") from None
        except StoreError:
            self._db.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- meta ----------------------------------------------------------------------------------
    def get_meta(self, key: str) -> Any:
        rows = self._query("SELECT value FROM meta WHERE key=?", (key,))
        return json.loads(rows[0][0]) if rows else None

    def set_meta(self, key: str, value: Any) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, _dumps(value)))

    # ---- tasks ---------------------------------------------------------------------------------
    def add_tasks(self, tasks: list[Task]) -> int:
        """Insert tasks in list order (their output order); existing ids are kept. Returns #new."""
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"duplicate task id {dup!r}")
        with self._tx() as db:
            before = db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
            db.executemany("INSERT OR IGNORE INTO tasks VALUES (?,?,?,?,?,?)", [
                (t.id, i, t.kind, t.problem, _dumps(t.answer), _dumps(t.meta)) for i, t in enumerate(tasks)])
            return db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] - before

    def tasks(self, ids: list[str] | None = None) -> list[Task]:
        rows = self._query("SELECT id, kind, problem, answer, meta FROM tasks ORDER BY ord")
        out = [Task(id=r[0], kind=r[1], problem=r[2], answer=json.loads(r[3]), meta=json.loads(r[4]))
               for r in rows]
        if ids is not None:
            wanted = set(ids)
            out = [t for t in out if t.id in wanted]
        return out

    # ---- LLM calls -----------------------------------------------------------------------------
    def get_call(self, key: str) -> dict | None:
        rows = self._query("SELECT content, finish_reason, prompt_tokens, completion_tokens, total_tokens,"
                           " response FROM llm_calls WHERE hash=?", (key,))
        if not rows:
            return None
        r = rows[0]
        return {"content": r[0], "finish_reason": r[1],
                "usage": {"prompt_tokens": r[2], "completion_tokens": r[3], "total_tokens": r[4]},
                "response": json.loads(r[5])}

    def put_call(self, key: str, purpose: str, model: str, request: dict, response: dict,
                 content: str | None, finish_reason: str | None, usage: dict, attempts: int) -> None:
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO llm_calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", (
                key, purpose, model, _dumps(request), _dumps(response), content, finish_reason,
                int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                int(usage.get("total_tokens") or 0), attempts, time.time()))

    def call_totals(self) -> dict[str, dict[str, int]]:
        rows = self._query("SELECT purpose, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens),"
                           " SUM(total_tokens), SUM(attempts) FROM llm_calls GROUP BY purpose ORDER BY purpose")
        out = {r[0]: {"calls": r[1], "prompt_tokens": r[2], "completion_tokens": r[3],
                      "total_tokens": r[4], "attempts": r[5]} for r in rows}
        out["total"] = {k: sum(v[k] for v in out.values())
                        for k in ("calls", "prompt_tokens", "completion_tokens", "total_tokens", "attempts")}
        return out

    # ---- stage outcomes ------------------------------------------------------------------------
    def put_trace(self, trace: Trace) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO traces VALUES (?,?,?,?,?)", (
                trace.task_id, trace.text, trace.final_answer, trace.teacher, _dumps(trace.usage)))

    def trace(self, task_id: str) -> Trace | None:
        rows = self._query("SELECT text, final_answer, teacher, usage FROM traces WHERE task_id=?", (task_id,))
        if not rows:
            return None
        r = rows[0]
        return Trace(task_id=task_id, text=r[0], final_answer=r[1], teacher=r[2], usage=json.loads(r[3]))

    def put_verdict(self, task_id: str, correct: bool, reason: str = "incorrect", detail: str = "") -> None:
        """The correctness filter's verdict; a wrong answer also records the discard in one transaction."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO verdicts VALUES (?,?)", (task_id, int(correct)))
            if not correct:
                db.execute("INSERT OR REPLACE INTO failures VALUES (?,?,?,?,0)", (task_id, "filter", reason, detail))

    def put_steps(self, task_id: str, raw: list[Step], merged: list[Step]) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO steps VALUES (?,?,?)", (
                task_id, _dumps([[s.plan, s.execution] for s in raw]),
                _dumps([[s.plan, s.execution] for s in merged])))

    def steps(self, task_id: str, merged: bool = True) -> list[Step] | None:
        rows = self._query(f"SELECT {'merged' if merged else 'raw'} FROM steps WHERE task_id=?", (task_id,))
        return [Step(plan=p, execution=e) for p, e in json.loads(rows[0][0])] if rows else None

    def put_dag(self, task_id: str, edges: list[tuple[int, int]], proposed: list[tuple[int, int]],
                dropped: list[tuple[tuple[int, int], str]]) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO dags VALUES (?,?,?,?)", (
                task_id, _dumps([list(e) for e in edges]), _dumps([list(e) for e in proposed]),
                _dumps([[list(e), why] for e, why in dropped])))

    def dag(self, task_id: str) -> dict | None:
        rows = self._query("SELECT edges, proposed, dropped FROM dags WHERE task_id=?", (task_id,))
        if not rows:
            return None
        return {"edges": [tuple(e) for e in json.loads(rows[0][0])],
                "proposed": [tuple(e) for e in json.loads(rows[0][1])],
                "dropped": [(tuple(e), why) for e, why in json.loads(rows[0][2])]}

    def put_packing(self, task_id: str, sigma: list[int], n_stages: int, ratio: float,
                    min_ratio: float) -> None:
        """σ and ρ for one trace; a trace below the ρ threshold is discarded in the same transaction."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO packings VALUES (?,?,?,?)", (task_id, _dumps(sigma), n_stages, ratio))
            if ratio < min_ratio:
                db.execute("INSERT OR REPLACE INTO failures VALUES (?,?,?,?,0)", (
                    task_id, "pack", "ratio_below_min", f"rho={ratio:.4f} < {min_ratio}"))

    def packing(self, task_id: str) -> dict | None:
        rows = self._query("SELECT sigma, n_stages, ratio FROM packings WHERE task_id=?", (task_id,))
        return {"sigma": json.loads(rows[0][0]), "n_stages": rows[0][1], "ratio": rows[0][2]} if rows else None

    def put_rewrite(self, task_id: str, completion: str, widths: list[int]) -> None:
        """An accepted rewrite: its canonical SPRINT completion and the executions per stage."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO rewrites VALUES (?,?,?)", (task_id, completion, _dumps(widths)))

    def rewrite(self, task_id: str) -> dict | None:
        rows = self._query("SELECT completion, widths FROM rewrites WHERE task_id=?", (task_id,))
        return {"completion": rows[0][0], "widths": json.loads(rows[0][1])} if rows else None

    def put_step(self, stage: str, task_id: str, value: Any) -> None:
        """The checked output of one of the five ThreadWeaver rewrite steps (`TW_STEPS`)."""
        if stage not in TW_STEPS:
            raise ValueError(f"not a rewrite step: {stage!r}")
        with self._tx() as db:
            db.execute(f"INSERT OR REPLACE INTO {stage} VALUES (?,?)", (task_id, _dumps(value)))

    def step(self, stage: str, task_id: str) -> Any:
        if stage not in TW_STEPS:
            raise ValueError(f"not a rewrite step: {stage!r}")
        rows = self._query(f"SELECT value FROM {stage} WHERE task_id=?", (task_id,))
        return json.loads(rows[0][0]) if rows else None

    def put_examples(self, task_id: str, examples: list[Example],
                     failure: tuple[str, str] | None = None) -> None:
        """A task's examples (and, when its SPRINT example could not be written, the reason) at once."""
        order = self._query("SELECT ord FROM tasks WHERE id=?", (task_id,))[0][0]
        kinds = {e.kind for e in examples}
        with self._tx() as db:
            if failure is not None:
                db.execute("INSERT OR REPLACE INTO failures VALUES (?,?,?,?,0)",
                           (task_id, "reformat", failure[0], failure[1][:2000]))
            for e in examples:
                db.execute("INSERT OR REPLACE INTO examples VALUES (?,?,?,?)",
                           (task_id, e.kind, order, _dumps(e.to_json())))
            db.execute("INSERT OR REPLACE INTO reformats VALUES (?,?,?)",
                       (task_id, int("sprint" in kinds), int("rft" in kinds)))

    def examples(self, kind: str) -> list[dict]:
        """Records of one kind in task order (so output files do not depend on completion order)."""
        return [json.loads(r[0]) for r in
                self._query("SELECT record FROM examples WHERE kind=? ORDER BY ord", (kind,))]

    def put_failure(self, task_id: str, stage: str, reason: str, detail: str = "",
                    retryable: bool = False) -> None:
        """Record that `task_id` left the pipeline at `stage`. Retryable failures (an endpoint that
        stayed down through every retry) are cleared and tried again by the next run."""
        if stage not in ALL_STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO failures VALUES (?,?,?,?,?)",
                       (task_id, stage, reason, detail[:2000], int(retryable)))

    def clear_retryable_failures(self) -> int:
        """Forget retryable failures and everything written downstream of them for those tasks."""
        with self._tx() as db:
            ids = [r[0] for r in db.execute("SELECT DISTINCT task_id FROM failures WHERE retryable=1")]
            for tid in ids:
                db.execute("DELETE FROM failures WHERE task_id=? AND retryable=1", (tid,))
                db.execute("DELETE FROM reformats WHERE task_id=?", (tid,))
                db.execute("DELETE FROM examples WHERE task_id=?", (tid,))
            return len(ids)

    def failure(self, task_id: str, stage: str) -> dict | None:
        rows = self._query("SELECT reason, detail, retryable FROM failures WHERE task_id=? AND stage=?",
                           (task_id, stage))
        return {"reason": rows[0][0], "detail": rows[0][1], "retryable": bool(rows[0][2])} if rows else None

    def failure_counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for stage, reason, n in self._query(
                "SELECT stage, reason, COUNT(*) FROM failures GROUP BY stage, reason ORDER BY stage, reason"):
            out.setdefault(stage, {})[reason] = n
        return out

    # ---- stage queries -------------------------------------------------------------------------
    def _ids(self, sql: str, args: tuple = ()) -> list[str]:
        return [r[0] for r in self._query(sql, args)]

    def survivors(self, stage: str) -> list[str]:
        """Task ids (in task order) with an outcome at `stage` and no failure there (for reformat:
        the tasks that got a SPRINT example; their RFT twins are counted apart)."""
        table = _OUTCOME_TABLE[stage]
        key = "id" if table == "tasks" else "task_id"
        extra = "AND o.sprint = 1 " if stage == "reformat" else ""
        return self._ids(
            f"SELECT t.id FROM tasks t JOIN {table} o ON o.{key} = t.id {extra}"
            f"WHERE NOT EXISTS (SELECT 1 FROM failures f WHERE f.task_id=t.id AND f.stage=?) ORDER BY t.ord",
            (stage,))

    def pending(self, stage: str) -> list[str]:
        """Task ids (in task order) that reached `stage` and have neither an outcome nor a failure there.
        reformat is pending for a correct trace once its SPRINT branch has concluded (kept by the ρ
        filter or the rewrite check, or discarded at a stage between filter and reformat), because
        its RFT example may still be written."""
        if stage == "tasks":
            return []
        table = _OUTCOME_TABLE[stage]
        done = (f"NOT EXISTS (SELECT 1 FROM {table} o WHERE o.task_id=t.id) AND "
                f"NOT EXISTS (SELECT 1 FROM failures f WHERE f.task_id=t.id AND f.stage='{stage}')")
        if stage == "reformat":
            correct = set(self.survivors("filter"))
            branch = self.stages[self.stages.index("filter") + 1:-1]     # extract, dag, pack | rewrite
            marks = ",".join("?" * len(branch))
            concluded = set(self.survivors(branch[-1])) | set(self._ids(
                f"SELECT task_id FROM failures WHERE stage IN ({marks})", tuple(branch)))
            return [i for i in self._ids(f"SELECT t.id FROM tasks t WHERE {done} ORDER BY t.ord")
                    if i in correct and i in concluded]
        prev = set(self.survivors(self.stages[self.stages.index(stage) - 1]))
        return [i for i in self._ids(f"SELECT t.id FROM tasks t WHERE {done} ORDER BY t.ord") if i in prev]

    def ratios(self) -> list[float]:
        return [r[0] for r in self._query("SELECT p.ratio FROM packings p JOIN tasks t ON t.id=p.task_id ORDER BY t.ord")]

    def dropped_edge_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (dropped,) in self._query("SELECT dropped FROM dags"):
            for _, why in json.loads(dropped):
                out[why] = out.get(why, 0) + 1
        return dict(sorted(out.items()))

    def stage_counts(self) -> dict[str, dict[str, int]]:
        """Per stage: how many tasks survived it, were discarded at it, and are still pending there."""
        fails = {s: n for s, n in self._query("SELECT stage, COUNT(*) FROM failures GROUP BY stage")}
        out = {}
        for stage in self.stages:
            out[stage] = {"kept": len(self.survivors(stage)), "discarded": fails.get(stage, 0),
                          "pending": len(self.pending(stage))}
        out["reformat"]["sprint_examples"] = self._query("SELECT COUNT(*) FROM examples WHERE kind='sprint'")[0][0]
        out["reformat"]["rft_examples"] = self._query("SELECT COUNT(*) FROM examples WHERE kind='rft'")[0][0]
        return out
