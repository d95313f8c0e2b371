"""`sprint-jax eval`: accuracy and sequential/total tokens of a model on a task set; `eval compare`."""
from __future__ import annotations

import json
from pathlib import Path

DESCRIPTION = """Evaluate a model with the SPRINT orchestrator (paper §13) and compare two runs.

  sprint-jax eval --model DIR --data math500 --mode parallel --limit 50 --out runs/eval_sprint
  sprint-jax eval --model RFT_DIR --data math500 --mode sequential --limit 50 --out runs/eval_rft
  sprint-jax eval compare runs/eval_sprint runs/eval_rft [--out runs/compare]

--data
  math500       MATH-500 (math500.jsonl in the shared data dir: ../shared/data beside the repo,
                or $SPRINT_JAX_DATA); graded with math-verify.
  countdown     --countdown-n generated Countdown tasks (seed --data-seed); graded by the
                Countdown rules (every number once, + - * / only, equals the target).
  FILE.jsonl    a task file. --task-kind auto reads multiple choice when the first record has
                "choices"/"options" or the GPQA columns, else MATH ({"problem", "answer"}).

GPQA is gated, so it is not shipped: accept its terms on Hugging Face
(Idavidrein/gpqa), download gpqa_diamond.csv yourself, and convert each row to one JSON line,
either keeping the original columns
  {"Record ID": ..., "Question": ..., "Correct Answer": ..., "Incorrect Answer 1": ..., ...}
(options are shuffled per record with a fixed seed) or as
  {"id": ..., "question": ..., "choices": ["...", "...", "...", "..."], "answer": "C"}
then run with --data gpqa.jsonl --task-kind choice. Answers are graded as letters.

Prompts: the model sees the task's problem text (Countdown: TinyZero's prompt), the same text
curation put in the training prompts (sprint_jax.curation.teacher.task_prompt).

--concurrency N (default 8): N problems run at once on the batched engine (sprint_jax.infer.batch):
one decode step serves every planner and executor of them. Results are written in problem order
and, under greedy decoding, do not depend on N (timings aside); wall clock per problem at N=1 is
the latency, problems per second at N the throughput.

Modes: parallel (executors batched over a shared-prefix fork), serial (the same executors one
after another; on the batched engine they run as a fork too), sequential (plain decoding: the RFT baseline, or a SPRINT model run as an ordinary
model).

Output (--out DIR): results.jsonl (per problem: id, correct, sequential_tokens, total_tokens,
stages, wall_s, problems, termination, ...), records.jsonl (full run records), report.json
(accuracy, mean sequential and total tokens, wall clock, format-valid rate, ...), tokens.png
(sequential vs total tokens per problem) and reduction_by_length.png.

`eval compare A B`: the paper's table (accuracy, sequential tokens, total tokens, wall clock,
change) for run A (SPRINT) against run B (RFT) on the same problems, matched by id.
"""


def add_arguments(p) -> None:
    from sprint_jax.infer.infer_cli import add_run_arguments

    p.add_argument("compare", nargs="*", metavar="compare RUN_A RUN_B",
                   help="compare two eval output directories (SPRINT first, RFT second)")
    p.add_argument("--data", default=None, help="math500 | countdown | FILE.jsonl")
    p.add_argument("--task-kind", choices=["auto", "math", "choice"], default="auto",
                   help="how to read FILE.jsonl")
    p.add_argument("--mode", choices=["parallel", "serial", "sequential"], default="parallel")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems")
    p.add_argument("--countdown-n", type=int, default=100, help="--data countdown: tasks to generate")
    p.add_argument("--data-seed", type=int, default=0, help="--data countdown: generator seed")
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--names", default="SPRINT,RFT", help="compare: column names of RUN_A,RUN_B")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--concurrency", type=int, default=8,
                   help="problems run at once on the batched engine (every planner and executor of them "
                        "decodes in one step); 1 = one at a time. results.jsonl does not depend on it "
                        "under greedy decoding (default 8)")
    add_run_arguments(p)


def load_tasks(data: str, limit: int | None = None, task_kind: str = "auto", countdown_n: int = 100,
               data_seed: int = 0):
    """Tasks for --data (see DESCRIPTION)."""
    from sprint_jax.errors import UserError
    from sprint_jax.curation.tasks import load_choice_jsonl, load_math_jsonl
    from sprint_jax.model.tokenizer import shared_data_dir

    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    if data == "math500":
        path = shared_data_dir() / "math500.jsonl"
        if not path.is_file():
            raise UserError(f"MATH-500 not found at {path}; set SPRINT_JAX_DATA to the directory holding "
                            f"math500.jsonl, or pass --data FILE.jsonl")
        return load_math_jsonl(path, limit)
    if data == "countdown":
        from sprint_jax.curation import countdown
        n = countdown_n if limit is None else min(limit, countdown_n)
        if n < 1:
            raise UserError(f"--countdown-n must be >= 1, got {countdown_n}")
        return countdown.generate(n, data_seed)
    path = Path(data)
    if not path.is_file():
        raise UserError(f"--data {data!r} is not math500, countdown, or an existing file")
    if task_kind == "auto":
        task_kind = "math"
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        first = json.loads(line)
                    except json.JSONDecodeError:
                        break   # the loader reports it with the line number
                    if isinstance(first, dict) and ({"choices", "options", "Correct Answer"} & set(first)):
                        task_kind = "choice"
                    break
    return (load_choice_jsonl if task_kind == "choice" else load_math_jsonl)(path, limit)


def _compare(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.eval.report import (compare, format_compare_table, format_wall_clock, load_results,
                                        plot_reduction, wall_clock_summary)

    if len(args.compare) != 3 or args.compare[0] != "compare":
        raise UserError("usage: sprint-jax eval compare RUN_A RUN_B (or eval --model ... --data ... --out ...)")
    names = [n.strip() for n in args.names.split(",")]
    if len(names) != 2 or not all(names):
        raise UserError(f"--names must be two comma-separated names, got {args.names!r}")
    run_a, run_b = args.compare[1:]
    results_a, results_b = load_results(run_a), load_results(run_b)
    table = compare(results_a, results_b, *names)
    table["runs"] = [run_a, run_b]
    table["wall_clock"] = {names[0]: wall_clock_summary(run_a, results_a),
                           names[1]: wall_clock_summary(run_b, results_b)}
    print(format_compare_table(table))
    print("\n" + format_wall_clock(names, [table["wall_clock"][n] for n in names]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(table, indent=2) + "\n")
        if table["reduction_by_baseline_length"]:
            plot_reduction(table["reduction_by_baseline_length"], out / "reduction_by_baseline_length.png",
                           f"{names[1]} tokens per problem (bins)")
        print(f"\nwritten: {out / 'compare.json'}")
    return 0


def run(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.eval.evaluate import evaluate
    from sprint_jax.infer.infer_cli import build_batch_engine, config_from_args

    if args.compare:
        return _compare(args)
    for flag, value in (("--model", args.model), ("--data", args.data), ("--out", args.out)):
        if not value:
            raise UserError(f"{flag} is required (or use `sprint-jax eval compare RUN_A RUN_B`)")
    config = config_from_args(args)
    tasks = load_tasks(args.data, args.limit, args.task_kind, args.countdown_n, args.data_seed)
    if not tasks:
        raise UserError(f"--data {args.data}: no tasks")
    engine = build_batch_engine(args, config, args.concurrency)
    from sprint_jax.eval.evaluate import default_prompt
    for task in tasks:   # a tokenizer that cannot read the data is a setup mistake, caught up front
        try:
            engine.encode(default_prompt(task))
        except ValueError as e:
            raise UserError(f"task {task.id}: the tokenizer cannot encode its prompt ({e})") from None
    _, report = evaluate(engine, tasks, args.mode, orchestrator_config=config, out_dir=args.out,
                         progress=not args.no_progress, concurrency=args.concurrency,
                         meta={"model": str(args.model), "data": str(args.data), "limit": args.limit})
    print(f"accuracy {100 * report['accuracy']:.1f}% ({report['correct']}/{report['n']}), "
          f"sequential tokens {report['mean_sequential_tokens']:.1f}, total tokens "
          f"{report['mean_total_tokens']:.1f}, format-valid {100 * report['format_valid_rate']:.1f}%, "
          f"wall clock {report['wall_clock_s']:.1f} s -> {args.out}")
    return 0
