"""Where the tiny recipe's models go wrong (docs/experiments/recipe-tiny.md, "Where the accuracy goes").

forced MODEL_DIR sprint|rft [N]: the model's teacher-forced argmax accuracy and mean NLL per token
class on the teacher's own traces of the first N (default 40) problems of the recipe's held-out set
(`chains.mixed_test_set(N, 0, 2, 4, 12)`), laid out as the model was trained (SPRINT: merge, RFT:
flat), every trained token predicted from its parent row as in the loss. The classes: the start
digit the planner writes after "Chain" (SPRINT: in the plan's prompts; RFT: each line's label),
an execution's first digit (SPRINT: the executor restating its own prompt's start digit, right
after its forced <execution_1.j> opening; RFT: the digit after "Chain d: ", a copy three tokens
back), the other execution tokens, the final answer, and every other trained token.

wrong RECORDS sprint|rft [RECORDS sprint|rft ...]: per eval records.jsonl, the runs whose traces
are fully right (every start digit once, every chain right) and why each wrong answer is wrong.

    python docs/experiments/recipe_tiny_causes.py forced runs/recipe_tiny/train_sprint/out/hf sprint
    python docs/experiments/recipe_tiny_causes.py wrong runs/recipe_tiny/eval_sprint_chains/out/records.jsonl sprint
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from sprint_jax import format as fmt
from sprint_jax.model import qwen2
from sprint_jax.model.hf import load_params
from sprint_jax.model.tokenizer import load_tokenizer
from sprint_jax.schema import Example
from sprint_jax.tasks import chains
from sprint_jax.train import data as D

LENGTH = 12


def teacher_example(task, kind: str) -> Example:
    """The curation's trace of `task` (the programmatic teacher's text, as in sprint.jsonl / rft.jsonl)."""
    s, v = task.answer["starts"], task.answer["value"]
    if kind == "rft":
        comp = "\n".join(f"Chain {x}: {chains.chain(x, LENGTH)}" for x in s)
        comp += f"\n{chains.COMBINE}\n<Final Answer> {v} </Final Answer>"
    else:
        plan = " ".join(f"<prompt_1.{j}> Chain {x}: </prompt_1.{j}>" for j, x in enumerate(s, 1))
        ex = "\n".join(f"<execution_1.{j}> {chains.chain(x, LENGTH)} </execution_1.{j}>" for j, x in enumerate(s, 1))
        comp = f"<Plan_1> {plan} </Plan_1>\n{ex}\n<Plan_2> {chains.COMBINE} </Plan_2>\n<Final Answer> {v} </Final Answer>"
    return Example(id=task.id, kind=kind, prompt=task.problem, completion=comp, answer=task.answer)


def _token_class(kind: str, strs: list[str], i: int, branch: int) -> str:
    prev, prev2 = (strs[i - 1] if i else ""), (strs[i - 2] if i > 1 else "")
    if kind == "sprint" and branch > 0:
        if prev == "" and prev2.startswith("<execution_"):
            return "execution first digit"
        return "execution other"
    if prev == "Chain":
        return "planner start digit"
    if kind == "rft" and prev == "" and prev2 == ":":
        return "execution first digit"
    if kind == "rft" and strs[i].isdigit() and prev.isdigit():
        return "execution other"
    if prev == "<Final Answer>":
        return "final answer"
    return "other"


def forced(model_dir: str, kind: str, n: int = 40) -> None:
    tok = load_tokenizer(model_dir)
    cfg, params = load_params(model_dir)
    layout = "merge" if kind == "sprint" else "flat"
    ok, tot, nll = Counter(), Counter(), Counter()
    for task in chains.mixed_test_set(n, 0, 2, 4, LENGTH):
        it = D.layout_example(tok, teacher_example(task, kind), layout, {k: 1.0 for k in fmt.SPAN_KINDS})
        kw = {"span_end": jnp.asarray(it.span_end[None])}
        if it.stage is not None:
            kw.update(stage=jnp.asarray(it.stage[None]), branch=jnp.asarray(it.branch[None]))
        logits = qwen2.forward(params, cfg, jnp.asarray(it.tokens[None]), jnp.asarray(it.positions[None]), **kw)[0]
        logp = np.asarray(logits - jax.nn.logsumexp(logits, -1, keepdims=True))
        strs = [tok.decode([int(x)]).strip() for x in it.tokens]
        for i in range(len(it)):
            p = it.parents[i]
            if p < 0 or it.weights[i] == 0 or it.labels[i] == D.LABEL_IDS["query"]:
                continue              # not a trained token
            c = _token_class(kind, strs, i, 0 if it.branch is None else int(it.branch[i]))
            ok[c] += int(np.argmax(logp[p]) == it.tokens[i])
            tot[c] += 1
            nll[c] -= float(logp[p, it.tokens[i]])
    for c in sorted(tot):
        print(f"{kind} {c}: argmax right {ok[c]}/{tot[c]} = {100 * ok[c] / tot[c]:.1f}%, "
              f"mean NLL {nll[c] / tot[c]:.4f}, share of the NLL sum {nll[c] / sum(nll.values()):.2f}")
    print(f"{kind} all trained tokens: mean NLL {sum(nll.values()) / sum(tot.values()):.4f} over {sum(tot.values())}")


def _computed(r: dict, kind: str) -> list[str]:
    """The chains a run wrote: SPRINT's execution bodies, RFT's "Chain d: ..." digits."""
    if kind == "sprint":
        return [re.sub(r"</execution_\d+\.\d+>", "", e["text"]).strip() for s in r["stages"] for e in s["executions"]]
    return [b for _, b in re.findall(r"Chain (\d): (\d+)", r["text"])]


def wrong(path: str, kind: str) -> None:
    rows = [json.loads(x) for x in open(path)]
    why, full = Counter(), 0
    last = lambda s: int(chains.chain(s, LENGTH)[-1])  # noqa: E731
    for r in rows:
        starts = [int(x) for x in r["query"].split()[1:]]
        gold = max(last(s) for s in starts)
        bodies = _computed(r, kind)
        valid = all(b and b == chains.chain(int(b[0]), LENGTH) for b in bodies)   # right for the digit it restates
        got = sorted(int(b[0]) for b in bodies if b)
        right = r.get("final_answer") == str(gold)
        full += valid and got == sorted(starts) and right
        if right:
            continue
        if not bodies or r["termination"] != "final_answer":
            why["no answer or cut"] += 1
        elif not valid:
            why["a chain's digits wrong"] += 1
        elif max(last(s) for s in got) > gold:
            why["start digit copied wrong: a chain not in the problem wins"] += 1
        elif all(last(s) != gold for s in got):
            why["start digit copied wrong: the winning chain never written"] += 1
        elif r.get("final_answer") != str(max(int(b[-1]) for b in bodies)):
            why["answer not the largest last digit written"] += 1
        else:
            why["other"] += 1
    n, bad = len(rows), sum(why.values())
    print(f"{path}: {n} runs, {n - bad} right answers, {full} fully right traces")
    for k, v in why.most_common():
        print(f"  wrong: {k}: {v}")


if __name__ == "__main__":
    if sys.argv[1] == "forced":
        forced(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:5]))
    elif sys.argv[1] == "wrong":
        for path, kind in zip(sys.argv[2::2], sys.argv[3::2]):
            wrong(path, kind)
    else:
        sys.exit(__doc__)
