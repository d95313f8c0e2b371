"""Keyed digit chains: the RL demo's task, where skipping the executors cannot win.

Why a variant. On the demo's digit chains (tasks/chains.py) the answer is a fixed function of the
start digits (a 10-cycle walked `length` steps), so a planner can learn to write it without the
executions; P-GRPO with the acceleration bonus found exactly that shortcut (executors stopped
working, "executions exact" 0.37 -> 0.00, accuracy still rising). Here every problem carries a
random key of `length` bits, shared by its chains: step t applies the demo's digit map when bit t
is 1 and copies the digit when it is 0. A chain's last digit is then CYCLE[start + popcount(key)],
a parity-like count a 2-layer model cannot do in the one token of a final answer, while each
executor step is one of 20 single-digit facts (map or copy, read off the key at a fixed distance).
The answer still needs the executors' results: a planner that skips them can only guess the
count (`guess_accuracy`: the best such guess is right on ~1/4 of problems).

The format is the demo's: query `Q: 7 3 9 2 : 0110101101` (the key after a colon), one prompt
`Chain s:` per start and one execution per chain (the start digit, then one digit per step), a
plan with the combining sentence, `<Final Answer>`. Unlike the demo, the SFT set mixes three plan
shapes (`SHAPES`, a third each): all four chains in one stage, two stages of two, four stages of
one. They are equally correct but not equally parallel (sequential tokens ~46 / ~55 / ~80), so
the acceleration bonus has something to choose between: RL should move the policy to the
parallel shape, lowering sequential tokens without touching what the executors compute. The
vocabulary is the demo's plus tags up to `<Plan_5>` (`vocabulary`). Tasks have kind "chains"
(graded by the chains grader on `answer["value"]`) with `answer["key"]`; their prompt is
`prompt_for` (pass it as `prompt_fn`).

`write_sft_data` writes the SPRINT and RFT training sets; `sft` trains both models with the real
trainer (the command `python -m sprint_jax.rl.keyed --out DIR`, see the README's RL section).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

from sprint_jax.tasks import chains
from sprint_jax.tasks.types import Task

KIND = "chains"


def chain(start: int, key: str) -> str:
    """`start`, then one digit per key bit: the digit map on 1, a copy on 0."""
    out, d = [str(start)], start
    for b in key:
        d = chains.DIGIT_MAP[d] if b == "1" else d
        out.append(str(d))
    return "".join(out)


def solve(starts: list[int], key: str) -> int:
    return max(int(chain(s, key)[-1]) for s in starts)


def prompt_for(task: Task) -> str:
    return f"{chains.QUERY_PREFIX} " + " ".join(str(s) for s in task.answer["starts"]) + f" : {task.answer['key']}\n"


def generate(n: int, seed: int, n_chains: int = 4, length: int = 10,
             exclude: set[tuple] | None = None) -> list[Task]:
    """n problems, deterministic for a seed; `exclude` holds (starts, key) pairs never to emit."""
    if n_chains < 1 or length < 1:
        raise ValueError(f"need n_chains >= 1 and length >= 1, got {n_chains}, {length}")
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < n:
        starts = [rng.randrange(10) for _ in range(n_chains)]
        key = "".join(rng.choice("01") for _ in range(length))
        if exclude and (tuple(starts), key) in exclude:
            continue
        t = Task(id=f"keyed-{seed}-{len(out)}", kind=KIND, problem="",
                 answer={"starts": starts, "length": length, "key": key, "value": solve(starts, key)})
        t.problem = prompt_for(t)
        out.append(t)
    return out


class NoHeldOut(ValueError):
    """Every possible problem is a training problem: no held-out problem can be disjoint from them."""


def split(n_train: int, n_eval: int, seed: int = 0, eval_seed: int = 10_000, n_chains: int = 4,
          length: int = 10) -> tuple[list[Task], list[Task]]:
    """Training problems and held-out problems (disjoint (starts, key)); NoHeldOut when held-out
    problems are asked for and the training problems already use every (starts, key) pair."""
    train = generate(n_train, seed, n_chains, length)
    seen = {(tuple(t.answer["starts"]), t.answer["key"]) for t in train}
    if n_eval and len(seen) == 10 ** n_chains * 2 ** length:
        raise NoHeldOut(f"the {n_train} training problems use all {len(seen)} (starts, key) pairs of {n_chains} "
                        f"chain(s) of {length} key bits, none is left for a disjoint held-out set")
    return train, generate(n_eval, eval_seed, n_chains, length, exclude=seen) if n_eval else []


def guess_accuracy(tasks: list[Task]) -> float:
    """Accuracy of the best answer that ignores the key's count: for each problem, the answer under
    the single most likely popcount (length / 2) — what a planner skipping the executors can hope for."""
    ok = 0
    for t in tasks:
        length = t.answer["length"]
        ok += solve(t.answer["starts"], "1" * (length // 2)) == t.answer["value"]
    return ok / max(len(tasks), 1)


def execution_quality(records: list[dict], tasks: list[Task]) -> dict:
    """Did the executors do the work? Per run record (RunRecord.to_json) of a chains task (keyed or
    the demo's), the fraction of executions equal to their chain, and of final answers equal to the
    max over the executions' last digits."""
    exact = total = consistent = 0
    for r, t in zip(records, tasks):
        execs = [e for st in r["stages"] for e in st["executions"]]      # chains in order over the stages
        lasts = []
        for k, s in enumerate(t.answer["starts"]):
            body = execs[k]["text"].split("</")[0].strip() if k < len(execs) else ""
            want = chain(s, t.answer["key"]) if "key" in t.answer else chains.chain(s, t.answer["length"])
            exact += body == want
            total += 1
            lasts.append(int(body[-1]) if body[-1:].isdigit() else -1)
        consistent += str(max(lasts)) == (r.get("final_answer") or "").strip()
    return {"executions_exact": exact / max(total, 1), "answer_matches_executions": consistent / max(len(records), 1)}


SHAPES = ((4,), (2, 2), (1, 1, 1, 1))   # chains per stage: all parallel, two by two, one by one


def parse_weights(text: str, shapes=SHAPES) -> tuple[float, ...] | None:
    """`"1,1,3"` -> one non-negative weight per shape of `shapes` (None for an empty string)."""
    if not text.strip():
        return None
    try:
        w = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"shape weights must be comma-separated numbers, got {text!r}") from None
    if len(w) != len(shapes) or min(w) < 0 or sum(w) <= 0:
        raise ValueError(f"shape weights need {len(shapes)} non-negative numbers with a positive sum "
                         f"(one per shape of {shapes}), got {text!r}")
    return w


def shape_of(task: Task, shapes=SHAPES, weights: tuple[float, ...] | None = None) -> tuple[int, ...]:
    """The plan shape of a task's SPRINT example: a pure function of its id, uniform over `shapes`
    that fit its number of chains, or drawn with `weights` (one per shape of `shapes`)."""
    n = len(task.answer["starts"])
    rng = random.Random(task.id)
    if weights is None:
        fits = [sh for sh in shapes if sum(sh) == n] or [(n,)]
        return fits[rng.randrange(len(fits))]
    pairs = [(sh, w) for sh, w in zip(shapes, weights) if sum(sh) == n and w > 0]
    if not pairs:
        return (n,)
    x, acc = rng.random() * sum(w for _, w in pairs), 0.0
    for sh, w in pairs:
        acc += w
        if x < acc:
            return sh
    return pairs[-1][0]


LAST_DIGITS = "Last digits"
COMBINES = ("sentence", "digits")


def combine_text(task: Task, combine: str = "sentence") -> str:
    """The plan of the combining stage: the demo's sentence, or (`digits`) the chains' last digits
    in chain order, `Last digits: 1 1 8 5`, so the answer is the largest of four adjacent digits
    whatever the plan shape that laid out the executions."""
    if combine == "sentence":
        return chains.COMBINE
    if combine != "digits":
        raise ValueError(f"combine must be one of {', '.join(COMBINES)}, got {combine!r}")
    key = task.answer["key"]
    return f"{LAST_DIGITS}: " + " ".join(chain(s, key)[-1] for s in task.answer["starts"])


def sprint_completion(task: Task, shape: tuple[int, ...] | None = None, combine: str = "sentence") -> str:
    """The SPRINT body: the chains in order over stages of `shape` (default: all in one stage), then
    a stage with the combining plan (`combine_text`), then the final answer."""
    from sprint_jax import format as fmt
    starts, key = task.answer["starts"], task.answer["key"]
    shape = shape or (len(starts),)
    stages, k = [], 0
    for i, m in enumerate(shape, start=1):
        part = starts[k:k + m]
        stages.append(fmt.Stage(i, [fmt.Prompt(f"Chain {s}:") for s in part], [chain(s, key) for s in part]))
        k += m
    stages.append(fmt.Stage(len(shape) + 1, [combine_text(task, combine)]))
    return fmt.render_completion(fmt.Trajectory(stages=stages, final_answer=str(task.answer["value"])))


def rft_completion(task: Task) -> str:
    from sprint_jax.curation.reformat import to_rft
    lines = [f"Chain {s}: {chain(s, task.answer['key'])}" for s in task.answer["starts"]] + [chains.COMBINE]
    return to_rft(prompt_for(task), "\n".join(lines), str(task.answer["value"]))


def write_sft_data(tasks: list[Task], out: Path, shape_weights: tuple[float, ...] | None = None,
                   combine: str = "sentence") -> dict[str, Path]:
    """OUT/sprint.jsonl and OUT/rft.jsonl: the same problems, as SPRINT bodies (plan shapes drawn by
    `shape_of` with `shape_weights`, combining plan by `combine`) and serial traces."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"sprint": out / "sprint.jsonl", "rft": out / "rft.jsonl"}
    for kind, path in paths.items():
        make = (lambda t: sprint_completion(t, shape_of(t, weights=shape_weights), combine)) if kind == "sprint" else rft_completion
        with open(path, "w") as f:
            for t in tasks:
                f.write(json.dumps({"id": t.id, "kind": kind, "prompt": prompt_for(t), "completion": make(t),
                                    "answer": t.answer["value"]}) + "\n")
    return paths


MAX_STAGES = 5


def vocabulary(n_chains: int = 4) -> list[str]:
    """The demo's vocabulary (one token per tag and word; the key needs only ':' and digits) with
    tags for up to MAX_STAGES plans (one chain per stage, then the combining stage)."""
    from sprint_jax import format as fmt
    # SPRINT's entries only: LAST_DIGITS and the later tags keep the ids keyed models were trained with
    vocab = chains.token_vocabulary(max_prompts=n_chains, threadweaver=False) + [LAST_DIGITS]
    for tag in fmt.tag_vocabulary(max_stages=MAX_STAGES, max_prompts=n_chains):
        for v in ([tag, " " + tag] if tag.startswith("</") else [tag] if tag.startswith("<execution") else
                  [tag, tag + " "]):
            if v not in vocab:
                vocab.append(v)
    return vocab


@dataclasses.dataclass
class SFTSettings:
    n: int = 3000
    chains: int = 4
    length: int = 10
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 4e-3
    seed: int = 0
    shape_weights: str = ""   # one weight per SHAPES entry, e.g. "1,1,3"; empty = a third each
    combine: str = "sentence"  # the combining plan: the demo's sentence, or "digits" (combine_text)


def sft(out: Path, s: SFTSettings, kinds=("sprint", "rft"), progress: bool = True) -> dict[str, str]:
    """Train the SPRINT (trie layout) and RFT (flat) models of the demo's size on keyed chains with
    the real trainer; returns {kind: HF export dir}."""
    from sprint_jax.config import from_dict
    from sprint_jax.demo import DemoModel
    from sprint_jax.config import to_dict
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    tasks, _ = split(s.n, 0, s.seed, n_chains=s.chains, length=s.length)
    paths = write_sft_data(tasks, out / "data", parse_weights(s.shape_weights), s.combine)
    tok = VocabTokenizer(vocabulary(s.chains), eos_token="<eos>", pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, **to_dict(DemoModel()),
             "max_position_embeddings": s.seq_len, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    exports = {}
    for kind in kinds:
        tc = from_dict(TrainConfig, {
            "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "init_seed": s.seed},
            "data": {"train": [str(paths[kind])], "layout": "trie" if kind == "sprint" else "flat",
                     "seq_len": s.seq_len, "seed": s.seed},
            "optim": {"lr": s.lr, "warmup_steps": 30, "batch_size": s.batch_size, "weight_decay": 0.01},
            "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
            "steps": s.steps, "log_every": 20, "seed": s.seed, "tensorboard": False, "plot": True})
        exports[kind] = train(tc, out / kind, tokenizer=tok, progress=progress)["export_dir"]
    return exports


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sprint_jax.rl.keyed",
                                description="Train the SFT models (SPRINT trie + RFT flat) on keyed digit chains, "
                                            "the starting points of configs/rl_keyed_cpu*.yaml.")
    p.add_argument("--out", required=True)
    p.add_argument("--kinds", default="sprint,rft", help="comma list of sprint, rft")
    for f in dataclasses.fields(SFTSettings):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    a = p.parse_args(argv)
    try:
        parse_weights(a.shape_weights)
        if a.combine not in COMBINES:
            raise ValueError(f"--combine must be one of {', '.join(COMBINES)}, got {a.combine!r}")
    except ValueError as e:
        p.error(str(e))                                   # one line, exit 2
    s = SFTSettings(**{f.name: getattr(a, f.name) for f in dataclasses.fields(SFTSettings)})
    ex = sft(Path(a.out), s, [k for k in a.kinds.split(",") if k])
    print(json.dumps(ex))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
