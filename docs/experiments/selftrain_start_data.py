"""Write the start SFT set of docs/experiments/selftrain.md: the demo's curated SPRINT examples with
each one's four chains rewritten into one of three shapes of the same answer, so that the start
model samples all three and the fastest one is rare:

  fast   (example index % 10 == 0, 10%): one stage of four executors, then the combining plan;
  middle (index % 10 in 1..3,      30%): a stage of three, a stage of one, then the combining plan;
  slow   (the other 60%):                a stage of two, then two stages of one, then the answer.

Every stage is one more planner call and one more executor on the critical path, so the shapes
differ in sequential tokens by about one stage each. The slow shape answers right after its third
stage: the demo's tokenizer has plan tags up to Plan_3 only. Stages after the first run one
executor each, so no stage > 1 has two sibling close tags to tell apart.

    python docs/experiments/selftrain_start_data.py runs/selftrain_base/curate/sprint.jsonl runs/selftrain_start.jsonl
"""
from __future__ import annotations

import json
import re
import sys

SHAPES = {"fast": (4,), "middle": (3, 1), "slow": (2, 1, 1)}


def shape_of(index: int) -> str:
    """The shape example `index` is written in: fast 1 in 10, middle 3 in 10, slow the rest."""
    r = index % 10
    return "fast" if r == 0 else "middle" if r <= 3 else "slow"


def reshape(completion: str, groups: tuple[int, ...]) -> str:
    """The one-stage chains completion with its chains run in stages of `groups` executors, in the
    prompts' order; the combining plan follows when a plan tag is left for it (at most 3 plans)."""
    prompts = re.findall(r"<prompt_1\.\d> (Chain \d:) </prompt_1\.\d>", completion)
    execs = re.findall(r"<execution_1\.\d> (\d+) </execution_1\.\d>", completion)
    combine = re.search(r"<Plan_2> (.*?) </Plan_2>", completion).group(1)
    answer = completion[completion.index("<Final Answer>"):]
    assert len(prompts) == len(execs) == sum(groups) == 4, completion
    out, at = [], 0
    for stage, n in enumerate(groups, start=1):
        chosen = range(at, at + n)
        ps = " ".join(f"<prompt_{stage}.{j + 1}> {prompts[i]} </prompt_{stage}.{j + 1}>" for j, i in enumerate(chosen))
        out.append(f"<Plan_{stage}> {ps} </Plan_{stage}>")
        out += [f"<execution_{stage}.{j + 1}> {execs[i]} </execution_{stage}.{j + 1}>" for j, i in enumerate(chosen)]
        at += n
    if len(groups) < 3:
        out.append(f"<Plan_{len(groups) + 1}> {combine} </Plan_{len(groups) + 1}>")
    return "\n".join(out + [answer])


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in open(src, encoding="utf-8") if line.strip()]
    counts = dict.fromkeys(SHAPES, 0)
    with open(dst, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            shape = shape_of(i)
            counts[shape] += 1
            r = {**r, "completion": reshape(r["completion"], SHAPES[shape]), "meta": {**r.get("meta", {}), "shape": shape}}
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} examples: " + ", ".join(f"{n} {s} {SHAPES[s]}" for s, n in counts.items()) + f" -> {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
