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

Outputs in `out_dir` (when given): results.jsonl (one line per problem, written as it finishes),
records.jsonl (the full run records), report.json, and the plots of `report.write_plots`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sprint_jax.tasks import Task, extract_answer, grade_result, task_prompt
from sprint_jax.eval.report import make_report, write_plots
from sprint_jax.infer.orchestrator import MODES, Orchestrator, OrchestratorConfig, RunRecord, run_many

RESULTS_FILE = "results.jsonl"
RECORDS_FILE = "records.jsonl"
REPORT_FILE = "report.json"


def default_prompt(task: Task) -> str:
    """The task as curation wrote it into the training prompts (see the module docstring)."""
    return task_prompt(task)


def result_of(task: Task, record: RunRecord, answer_from: str = "final_answer") -> dict[str, Any]:
    """One results.jsonl line: the graded outcome and the accounting of one run."""
    answer = extract_answer(record.final_answer, record.text, answer_from)
    graded = grade_result(task, answer)
    return {
        "id": task.id,
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
        "wall_s": record.wall_s,
        "problems": list(record.problems),
        "format_valid": record.format_valid,
        "termination": record.termination,
    }


def evaluate(engine: Any, tasks: Sequence[Task], mode: str = "parallel",
             prompt_fn: Callable[[Task], str] | None = None,
             orchestrator_config: OrchestratorConfig | None = None, out_dir: str | Path | None = None,
             progress: bool = True, meta: dict | None = None,
             concurrency: int | None = None,
             answer_from: str = "final_answer") -> tuple[list[dict], dict]:
    """Run every task in `mode` and grade it. Returns (results, report); writes them to out_dir.

    On a `BatchEngine` up to `concurrency` problems run at once (default: its sequence slots), every
    planner and executor of them decoding in one batched step; results are written in task order
    either way, so results.jsonl does not depend on the concurrency (timings aside). On the
    single-run `Engine` problems run one after another. `meta` is copied into the report; `answer_from` picks the graded
    text (see the module docstring).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    extract_answer(None, "", answer_from)   # reject an unknown mode before any run
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"task ids must be unique; {dup!r} appears twice")
    prompt_fn = prompt_fn or default_prompt
    config = orchestrator_config or OrchestratorConfig()
    batched = hasattr(engine, "max_seqs")
    concurrency = (concurrency or engine.max_seqs) if batched else 1
    out = Path(out_dir) if out_dir is not None else None
    results: list[dict] = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(tasks), desc=f"eval ({mode})", unit="problem")
    t0 = time.perf_counter()
    files = []
    try:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            files = [open(out / RESULTS_FILE, "w", encoding="utf-8"), open(out / RECORDS_FILE, "w", encoding="utf-8")]
        finished: dict[int, RunRecord] = {}

        def on_record(i: int, record: RunRecord) -> None:
            finished[i] = record
            while len(results) in finished:       # write in task order as soon as possible
                task = tasks[len(results)]
                record = finished.pop(len(results))
                result = result_of(task, record, answer_from)
                results.append(result)
                if files:
                    for f, row in zip(files, (result, {"id": task.id, **record.to_json()})):
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
                        f.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(acc=f"{sum(r['correct'] for r in results) / len(results):.3f}",
                                    seq=f"{sum(r['sequential_tokens'] for r in results) / len(results):.0f}")

        if batched:
            run_many(engine, [prompt_fn(t) for t in tasks], mode, config, concurrency=concurrency,
                     on_record=on_record)
        else:
            orchestrator = Orchestrator(engine, config)
            for i, task in enumerate(tasks):
                on_record(i, orchestrator.run(prompt_fn(task), mode))
    finally:
        for f in files:
            f.close()
        if bar is not None:
            bar.close()
    report = make_report(results, mode, wall_clock_s=time.perf_counter() - t0, meta={
        **(meta or {}), "answer_from": answer_from, "config": config.__dict__, "concurrency": concurrency})
    if out is not None:
        report["plots"] = write_plots(results, out)
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return results, report


__all__ = ["RESULTS_FILE", "RECORDS_FILE", "REPORT_FILE", "default_prompt", "result_of", "evaluate"]
