"""`sprint-jax curate`: run or resume the curation pipeline, or show where a run stands."""
from __future__ import annotations

import argparse

from sprint_jax.errors import UserError
from sprint_jax.curation.store import ALL_STAGES

DESCRIPTION = """\
Curation pipeline (paper §4-5): teacher traces -> correctness filter -> steps -> DAG -> σ stages
-> ρ filter -> sprint.jsonl + rft.jsonl + curation_report.json in the output directory.

  sprint-jax curate --config configs/curate_countdown_offline.yaml [--set key=value ...] [--out DIR]
                    [--stage tasks|teacher|filter|extract|dag|pack|rewrite|tw1_spans|...|reformat]
  sprint-jax curate status DIR

`restructure: rewrite` (configs/curate_math_rewrite_openai.yaml) replaces extract, dag and pack by
one stage, `rewrite`: the `rewriter` LLM restructures each correct trace into SPRINT tags, and a
reply is kept only if it parses, runs two or more executions in some stage, no execution uses a
number that only a sibling execution derives, and its final answer is the trace's, graded correct.
`restructure: threadweaver_rewrite` does it in ThreadWeaver's five steps, one call and one check
each (tw1_spans, tw2_threads, tw3_rewrite, tw4_outlines, tw5_validate: parallelizable spans, thread
boundaries, threads rewritten to stand alone, outlines, the assembled trajectory validated), and
writes ThreadWeaver-format examples; curation_report.json counts the discards of each step.

Every LLM call and every record is committed to DIR/curation.sqlite as it completes: rerunning the
same command resumes a killed run without repeating a paid call. API keys are read from the
environment variable each endpoint names (e.g. teacher.api_key_env) and are never written.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["run", "status"], default="run",
                        help="run (default) the pipeline, or print the status of DIR")
    parser.add_argument("dir", nargs="?", help="with `status`: the run's output directory")
    parser.add_argument("--config", help="curation config (configs/curate_*.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field by dotted key, e.g. --set teacher.concurrency=4")
    parser.add_argument("--out", help="output directory (default: the config's `out`)")
    parser.add_argument("--stage", action="append", choices=ALL_STAGES,
                        help="run only this stage (repeatable); default: all stages of the config's "
                             "restructure path in order (rewrite: tasks, teacher, filter, rewrite, reformat)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _print_status(status: dict) -> None:
    print(f"{'stage':<12} {'kept':>7} {'discarded':>10} {'pending':>8}")
    for stage, c in status["stages"].items():
        print(f"{stage:<12} {c['kept']:>7} {c['discarded']:>10} {c['pending']:>8}")
    r = status["stages"]["reformat"]
    print(f"examples: sprint {r['sprint_examples']}, rft {r['rft_examples']}")
    for stage, reasons in status["discards"].items():
        print(f"discarded at {stage}: " + ", ".join(f"{k} {v}" for k, v in reasons.items()))
    if status.get("dropped_edges"):
        print("dropped edges: " + ", ".join(f"{k} {v}" for k, v in status["dropped_edges"].items()))
    total = status["llm"]["total"]
    print(f"LLM calls {total['calls']} (attempts {total['attempts']}), tokens {total['total_tokens']} "
          f"(prompt {total['prompt_tokens']}, completion {total['completion_tokens']})")


def run(args: argparse.Namespace) -> int:
    from sprint_jax.curation import pipeline

    if args.action == "status":
        if not args.dir:
            raise UserError("usage: sprint-jax curate status DIR")
        _print_status(pipeline.status(args.dir))
        return 0
    if args.dir:
        raise UserError(f"unexpected argument {args.dir!r} (did you mean `curate status {args.dir}`?)")
    if not args.config:
        raise UserError("--config is required (e.g. --config configs/curate_countdown_offline.yaml)")
    from sprint_jax.curation.config import load_curate_config

    cfg = load_curate_config(args.config, args.set)
    out = args.out or cfg.out
    report = pipeline.run_pipeline(cfg, out, stages=args.stage, progress=not args.no_progress)
    _print_status({"stages": report["stages"], "discards": report["discards"],
                   "dropped_edges": report["dropped_edges"], "llm": report["llm"]})
    run_stats = report["run"]
    print(f"this run: {run_stats['calls_made']} calls made, {run_stats['cache_hits']} answered from the store, "
          f"{run_stats['retries']} retries, {run_stats['seconds']}s")
    print(f"wrote {out}/{pipeline.SPRINT_FILE}, {out}/{pipeline.RFT_FILE}, {out}/{pipeline.REPORT_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sprint_jax.curation.cli ...` (same as `sprint-jax curate ...`)."""
    from sprint_jax.cli import main as cli_main
    import sys
    return cli_main(["curate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
