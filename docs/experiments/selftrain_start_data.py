"""Write the start SFT set of docs/experiments/selftrain.md: the demo's curated SPRINT examples, every
other one rewritten to run its four chains as two stages of two executors (a longer critical path,
the same answer), so that the start model samples both shapes and self-training can select.

    python docs/experiments/selftrain_start_data.py runs/selftrain_base/curate/sprint.jsonl runs/selftrain_start.jsonl
"""
from __future__ import annotations

import json
import re
import sys


def two_stages(completion: str) -> str:
    """The one-stage chains completion as two stages of two chains each, then the combining plan."""
    prompts = re.findall(r"<prompt_1\.\d> (Chain \d:) </prompt_1\.\d>", completion)
    execs = re.findall(r"<execution_1\.\d> (\d+) </execution_1\.\d>", completion)
    tail = completion[completion.index("<Plan_2>"):].replace("Plan_2>", "Plan_3>")
    assert len(prompts) == len(execs) == 4, completion
    out = []
    for stage, (a, b) in ((1, (0, 1)), (2, (2, 3))):
        ps = " ".join(f"<prompt_{stage}.{j + 1}> {prompts[i]} </prompt_{stage}.{j + 1}>" for j, i in enumerate((a, b)))
        out.append(f"<Plan_{stage}> {ps} </Plan_{stage}>")
        out += [f"<execution_{stage}.{j + 1}> {execs[i]} </execution_{stage}.{j + 1}>" for j, i in enumerate((a, b))]
    return "\n".join(out) + "\n" + tail


def main(src: str, dst: str) -> None:
    rows = [json.loads(line) for line in open(src, encoding="utf-8") if line.strip()]
    with open(dst, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            if i % 2:
                r = {**r, "completion": two_stages(r["completion"]), "meta": {**r.get("meta", {}), "shape": "2x2"}}
            f.write(json.dumps(r) + "\n")
    print(f"{len(rows)} examples, {len(rows) // 2} rewritten as two stages -> {dst}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
