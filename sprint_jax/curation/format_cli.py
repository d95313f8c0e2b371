"""`sprint-jax convert-format`: training examples between SPRINT's tags and ThreadWeaver's."""
from __future__ import annotations

import argparse
from pathlib import Path

from sprint_jax.errors import UserError

DESCRIPTION = """\
Convert training examples (jsonl: id, kind, prompt, completion) between SPRINT's tags (<Plan_i>,
<prompt_i.j>, <execution_i.j>, <Final Answer>) and ThreadWeaver's (<think>, <Parallel>, <Outlines>,
<Outline>j:, <Thread>j:, </think> then the answer).

  sprint-jax convert-format --to threadweaver data/sprint.jsonl data/sprint_tw.jsonl

Prompts, ids, kinds and answers are kept; "rft" examples (a serial trace) become a ThreadWeaver
trace with no parallel block, and back. Examples the target format cannot express (SPRINT ->
ThreadWeaver: an implicit prompt, plan text after a prompt, a plan-only plan before another plan,
...) are skipped and counted by reason, the first of each reason shown as FILE:LINE. What converts
converts back unchanged. The output is written atomically and never over the input.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="IN.jsonl", help="the examples to convert")
    parser.add_argument("dst", metavar="OUT.jsonl", help="where to write the converted examples (not IN.jsonl)")
    parser.add_argument("--to", required=True, choices=["sprint", "threadweaver"], help="the target format")


def run(args: argparse.Namespace) -> int:
    from sprint_jax import threadweaver as tw

    if not Path(args.src).is_file():
        raise UserError(f"{args.src}: no such file")
    stats = tw.convert_examples(args.src, args.dst, args.to)
    skipped = sum(stats.skipped.values())
    line = f"read {stats.read}, wrote {stats.written} to {args.dst}, skipped {skipped}"
    if skipped:
        line += ": " + ", ".join(f"{why} {n}" for why, n in stats.skipped.items())
    print(line)
    for why, first in stats.first_skip.items():
        print(f"  first '{why}': {first}")
    if stats.read and not stats.written:
        raise UserError(f"no example of {args.src} could be converted to {args.to}")
    return 0
