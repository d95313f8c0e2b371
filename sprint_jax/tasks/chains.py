"""Digit chains: the demo's verifiable task family, with its own programmatic teacher.

Built from what a tiny transformer was measured to learn in a few hundred steps on a CPU:
copying, single-digit facts and a comparison. A problem lists k start digits
(3 or 4). Chain j repeatedly applies a fixed digit map (a 10-cycle, i.e. ten single-digit facts)
to its start digit for `length` steps; the answer is the largest last digit over all chains.
The demo's problems have a fixed shape (4 chains), so what each executor needs sits at a fixed
distance from its fork point: lookups a small model learns by position. `mixed_test_set` and
`mixed_training_set` draw 2..4 chains (any range) per problem, so trace lengths vary by problem.

The chains are genuinely independent sub-computations (each needs only its own start digit) and
their work dominates the trace, so SPRINT can run them as parallel executors while the RFT
baseline writes them one after another. The teacher writes its serial trace as one line per
chain ("Chain 7: 3946..."), then a combining sentence that opens with "So", which is exactly the
shape the offline curator (offline.py) splits into steps and dependencies.
"""
from __future__ import annotations

import random

from sprint_jax.tasks.types import Task, Trace

# The digit map as a single 10-cycle (every start digit walks through all ten digits).
CYCLE = (0, 7, 3, 9, 1, 5, 8, 2, 6, 4)
DIGIT_MAP = {d: CYCLE[(i + 1) % 10] for i, d in enumerate(CYCLE)}
COMBINE = "So the answer is the largest last digit."
QUERY_PREFIX = "Q:"


def chain(start: int, length: int) -> str:
    """`start` and then `length` digits under DIGIT_MAP, as one string (the executor first
    restates its start digit, so every later digit is a single-digit fact of the one before)."""
    out, d = [str(start)], start
    for _ in range(length):
        d = DIGIT_MAP[d]
        out.append(str(d))
    return "".join(out)


def solve(starts: list[int], length: int) -> int:
    return max(int(chain(s, length)[-1]) for s in starts)


def prompt_for(task: Task) -> str:
    """The query the model sees: "Q: 7 3 9 2" and a newline (the body starts on the next line)."""
    return f"{QUERY_PREFIX} " + " ".join(str(s) for s in task.answer["starts"]) + "\n"


def generate(n: int, seed: int, min_chains: int = 4, max_chains: int = 4, length: int = 12,
             exclude: set[tuple[int, ...]] | None = None, distinct: bool = False) -> list[Task]:
    """n problems, deterministic for a seed, each of a number of chains drawn uniformly from
    min_chains..max_chains. `exclude` holds start tuples never to emit (held-out); `distinct`:
    no start tuple twice. ValueError when fewer than n such tuples exist."""
    if not 1 <= min_chains <= max_chains:
        raise ValueError(f"need 1 <= min_chains <= max_chains, got {min_chains}, {max_chains}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if distinct:     # the draw loop below would never end
        space = sum(10 ** k for k in range(min_chains, max_chains + 1)) - len(exclude or ())
        if n > space:
            raise ValueError(f"{n} distinct problems of {min_chains}..{max_chains} chains asked for, "
                             f"only {space} start tuples are left")
    rng = random.Random(seed)
    tasks, seen = [], set(exclude or ())
    while len(tasks) < n:
        k = rng.randint(min_chains, max_chains)
        starts = tuple(rng.randrange(10) for _ in range(k))
        if exclude and starts in exclude:
            continue
        if distinct:
            if starts in seen:
                continue
            seen.add(starts)
        answer = {"starts": list(starts), "length": length, "value": solve(list(starts), length)}
        t = Task(id=f"chains-{seed}-{len(tasks)}", kind="chains", problem="", answer=answer)
        t.problem = prompt_for(t)
        tasks.append(t)
    return tasks


def demo_test_set(n: int = 100, seed: int = 0, chains: int = 4, length: int = 12,
                  train_problems: int = 3000) -> list[Task]:
    """The demo's held-out test problems (`sprint-jax demo` and `eval --data chains`): `n` problems
    of `chains` chains of `length` steps, generated with seed `seed` + 10000, none with the start
    digits of the `train_problems` training problems the demo generates with `seed`. The defaults
    are the demo's; the first k of n are the problems for n = k."""
    train = generate(train_problems, seed, chains, chains, length)
    return generate(n, seed + 10_000, chains, chains, length, exclude={tuple(t.answer["starts"]) for t in train})


MIXED_SEED_OFFSET = 20_000


def mixed_test_set(n: int, seed: int = 0, min_chains: int = 2, max_chains: int = 4,
                   length: int = 12) -> list[Task]:
    """A held-out test set of mixed lengths (`eval --data chains --chains MIN-MAX`): `n` problems
    with distinct start tuples, min_chains..max_chains chains of `length` steps, generated with
    seed `seed` + MIXED_SEED_OFFSET. The first k of n are the problems for n = k. Training sets
    keep out of it by excluding its start tuples (`mixed_training_set`), not the other way round,
    so that the few tuples of short problems (100 of 2 chains) stay in it."""
    return generate(n, seed + MIXED_SEED_OFFSET, min_chains, max_chains, length, distinct=True)


def mixed_training_set(n: int, seed: int, min_chains: int, max_chains: int, length: int = 12,
                       held_out: int = 0) -> list[Task]:
    """`generate(n, seed, min_chains, max_chains, length)` without any start tuple of the first
    `held_out` problems of `mixed_test_set(held_out, seed, ...)` (same seed, chain counts and
    length): training problems for a model evaluated on that set."""
    test = mixed_test_set(held_out, seed, min_chains, max_chains, length) if held_out else []
    return generate(n, seed, min_chains, max_chains, length, exclude={tuple(t.answer["starts"]) for t in test})


def solve_trace(task: Task) -> Trace:
    """The serial trace: one line per chain, then the combining sentence."""
    starts, length = task.answer["starts"], task.answer["length"]
    lines = [f"Chain {s}: {chain(s, length)}" for s in starts] + [COMBINE]
    return Trace(task_id=task.id, text="\n".join(lines), final_answer=str(task.answer["value"]),
                 teacher="programmatic-chains")


def grade(task: Task, final_answer_text: str) -> bool:
    return final_answer_text.strip() == str(task.answer["value"])


def vocabulary() -> list[str]:
    """Every string the family's texts use, for a tokenizer with one token per tag or word."""
    return ["Chain ", ":", QUERY_PREFIX, COMBINE] + [str(d) for d in range(10)]


def token_vocabulary(max_prompts: int, max_stages: int = 3, threadweaver: bool = True) -> list[str]:
    """The vocabulary of a word-level tokenizer for this family (the demo's): pad, EOS, space and
    newline, every string of `vocabulary()`, and each SPRINT tag of up to `max_stages` plans with
    `max_prompts` prompts each, with the single space the format writes beside it; then (unless
    `threadweaver` is False) ThreadWeaver's tags and `<Outline>j:` / `<Thread>j:` for j up to
    `max_prompts`. The order is the token ids: a trained model depends on it, so ThreadWeaver's
    entries come after every SPRINT entry and the SPRINT ids are those of a vocabulary without them."""
    from sprint_jax import format as fmt
    from sprint_jax import threadweaver as tw

    vocab = ["<pad>", "<eos>", " ", "\n"] + vocabulary()
    for tag in fmt.tag_vocabulary(max_stages=max_stages, max_prompts=max_prompts):
        vocab.append(tag)
        if tag.startswith("</"):
            vocab.append(" " + tag)          # content, one space, closing tag
        elif not tag.startswith("<execution"):
            vocab.append(tag + " ")          # opening tag, one space, content
        # an executor's opening is forced by the orchestrator as the bare tag, so no variant
    if threadweaver:
        # ThreadWeaver writes one tag per line (the newline stays a token of its own, as SPRINT's
        # block gap does) and an outline's or thread's number against its tag; the space after
        # `j:` is not merged: a thread's opening is forced up to the colon and its body, from the
        # space on, is a piece of its own at inference
        vocab += tw.tag_vocabulary()
        vocab += [tw.OUTLINE_OPEN + f"{j}:" for j in range(1, max_prompts + 1)]
        vocab += [tw.thread_opening(j) for j in range(1, max_prompts + 1)]
    return vocab
