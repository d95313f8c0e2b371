"""How many SPRINT runs of a length distribution one chip holds: the paged engine vs the slot engine.

A run's lengths (`RunLengths`): its prompt, each stage's planner tokens and its executors' tokens
(forced opening + generated), and the final answer's tokens; from eval records (`runs_from_records`)
or the synthetic distribution below (`synthetic_runs`).

The paged engine (`sprint_jax.infer.engine.Engine` over `KVPages`) holds, for a run, the pages of
its planner context and, while a stage runs, each executor's own pages (the parent's partly
filled page that a fork copies, the executor's tokens); every row may hold a decode chunk past
its last token (the scheduler reserves it). A merge join copies the branches into the parent's
pages before the children's go, so a stage's peak is its join: `run_pages` is the largest, over
the run, of pages(context after the join + a chunk) + the executors' own pages, and of the final
context. The slot engine reserves max_seq_len + K x max_branch_tokens for every run, whatever it
writes (`engine.slot_cache_bytes`, as `sharding.plan_slots` does).

Fit, within FILL (90%) of a chip's HBM. Slot engine: the largest N whose programs fit by its own
estimate (`engine.slot_memory_estimate`: weights, slots, its programs' temporaries at N). Paged
engine: beside the weights and its programs' temporaries at concurrency N (`engine.memory_estimate`
less the pool, the largest over the four programs) the pool takes the rest (whole pages,
split over the page shards: data x fsdp); N runs fit when N runs drawn from the distribution
(with replacement, N / shards of them on each shard) exceed some shard's pages with probability
< 1% (`P_EXCEED`), estimated by a seeded Monte Carlo of `TRIALS` draws (`exceed_probability`). N
steps over multiples of the shards in both.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sprint_jax.errors import UserError

P_EXCEED = 0.01     # the largest probability that the drawn runs overflow the pool
TRIALS = 4000       # Monte Carlo draws of N runs per N tried
SEED = 0

# The synthetic distribution of SPRINT runs (`synthetic_runs`): token counts, each drawn
# independently per run (stage, executor); LogNormal(median, sigma) = exp(N(ln median, sigma)),
# rounded, at least 1.
SYNTHETIC = {
    "prompt": (100, 400),                 # uniform integer
    "stages": (1, 4),                     # uniform integer: planner -> executors -> join rounds
    "planner": (200, 0.6),                # LogNormal median, sigma: planner tokens per stage
    "executors": 2,                       # uniform integer 2..K per stage (K: --executors)
    "executor": (500, 0.9),               # LogNormal: forced + generated tokens per executor, at most
                                          # max_branch_tokens
    "final": (300, 0.6),                  # LogNormal: the final answer's tokens
}
SYNTHETIC_TEXT = ("prompt U{100..400} tokens; 1-4 stages (uniform), each with planner tokens "
                  "LogNormal(median 200, sigma 0.6) and 2..K executors (uniform) of LogNormal(median 500, "
                  "sigma 0.9) tokens each, at most --branch-capacity; a final answer of LogNormal(median 300, "
                  "sigma 0.6); a run whose trace (prompt + planner + every executor + final) exceeds --capacity "
                  "is drawn again; 20,000 runs, seed 0")
SYNTHETIC_RUNS = 20_000


@dataclasses.dataclass(frozen=True)
class RunLengths:
    """One run's token counts: prompt, stages as (planner tokens, executors' tokens), final."""
    prompt: int
    stages: tuple[tuple[int, tuple[int, ...]], ...]
    final: int

    @property
    def trace(self) -> int:
        """Every token of the run: its planner context at the end (the branches joined into it)."""
        return self.prompt + sum(p + sum(e) for p, e in self.stages) + self.final

    @property
    def widest(self) -> int:
        return max((len(e) for _, e in self.stages), default=0)

    @property
    def longest_branch(self) -> int:
        return max((max(e) for _, e in self.stages if e), default=0)


def run_pages(run: RunLengths, page_size: int, decode_chunk: int) -> int:
    """The most pages the paged engine holds for `run` at once (module docstring): at each stage's
    join, the parent's pages for its context with the branches joined (+ a decode chunk) and each
    executor's own pages (the fork's partly filled page, copied, + the executor's tokens + a
    chunk); at the end, the whole trace + a chunk."""
    def pages(tokens: int) -> int:
        return -(-tokens // page_size)

    ctx = run.prompt
    peak = 0
    for planner, execs in run.stages:
        ctx += planner
        if execs:
            partial = (ctx - 1) % page_size        # the parent holds ctx - 1 tokens (the last one pending)
            own = sum(pages(partial + 1 + e + decode_chunk) for e in execs)
            ctx += sum(execs)
            peak = max(peak, pages(ctx + decode_chunk) + own)
    ctx += run.final
    return max(peak, pages(ctx + decode_chunk))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size=None):
    return np.maximum(1, np.rint(np.exp(rng.normal(math.log(median), sigma, size)))).astype(int)


def synthetic_runs(executors: int, capacity: int, branch_capacity: int, n: int = SYNTHETIC_RUNS,
                   seed: int = SEED) -> list[RunLengths]:
    """`n` runs of the synthetic distribution (`SYNTHETIC_TEXT`), seeded."""
    if executors < 2:
        raise UserError("--lengths synthetic draws 2..K executors a stage: --executors must be >= 2")
    rng = np.random.default_rng(seed)
    s = SYNTHETIC
    out: list[RunLengths] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n:
            raise UserError(f"--lengths synthetic: fewer than 1 in 50 drawn runs fit --capacity {capacity}; "
                            "raise --capacity")
        prompt = int(rng.integers(s["prompt"][0], s["prompt"][1] + 1))
        stages = []
        for _ in range(int(rng.integers(s["stages"][0], s["stages"][1] + 1))):
            planner = int(_lognormal(rng, *s["planner"]))
            k = int(rng.integers(s["executors"], executors + 1))
            execs = np.minimum(_lognormal(rng, *s["executor"], size=k), branch_capacity)
            stages.append((planner, tuple(int(e) for e in execs)))
        run = RunLengths(prompt, tuple(stages), int(_lognormal(rng, *s["final"])))
        if run.trace <= capacity:
            out.append(run)
    return out


def runs_from_records(path: str | Path) -> list[RunLengths]:
    """The SPRINT runs (mode parallel or serial) of eval records: a records.jsonl file, or every
    one under a directory (`records.load_records`'s checks). Executors that ran as rows (shared,
    serial) are the stage's executors; inline / none executions are planner context."""
    from sprint_jax.plan.records import load_records

    loaded = load_records(path, flag="--lengths")
    runs = []
    for rec in loaded["sprint"].values():
        stages = []
        for st in rec["stages"]:
            execs = st.get("executions") or []
            if st.get("executor_mode") in ("shared", "serial"):
                stages.append((st["planner_tokens"], tuple(e["forced_tokens"] + e["tokens"] for e in execs)))
            else:
                stages.append((st["planner_tokens"] + sum(e["forced_tokens"] + e["tokens"] for e in execs), ()))
        runs.append(RunLengths(rec["prompt_tokens"], tuple(stages), rec["final_tokens"]))
    if not runs:
        raise UserError(f"--lengths {path}: no SPRINT runs (mode parallel or serial) in the records; "
                        "an RFT eval alone has no executors to place")
    return runs


def exceed_probability(pages: Sequence[int], n_runs: int, parts: int, shard_pages: int, trials: int = TRIALS,
                       seed: int = SEED) -> float:
    """The Monte Carlo estimate of P(some shard's runs need more than `shard_pages`): `trials`
    draws of `n_runs` runs (indices into `pages`, uniform with replacement), n_runs / parts on each
    of `parts` shards. Seeded: the same arguments give the same answer."""
    if n_runs % parts:
        raise ValueError(f"{n_runs} runs do not split over {parts} shards")
    table = np.asarray(pages, np.int64)
    rng = np.random.default_rng(seed)
    over = 0
    per = n_runs // parts
    batch = max(1, min(trials, 4_000_000 // max(n_runs, 1)))       # bounded memory per draw
    done = 0
    while done < trials:
        m = min(batch, trials - done)
        drawn = table[rng.integers(0, len(table), size=(m, parts, per))]
        over += int(np.count_nonzero((drawn.sum(axis=2) > shard_pages).any(axis=1)))
        done += m
    return over / trials


def _largest(ok, step: int, limit: int = 1 << 17) -> int:
    """The largest multiple n of `step` with ok(n), ok decreasing in n; 0 if none."""
    from sprint_jax.plan.engine import largest
    return largest(ok, step=step, limit=limit)


def fixed_bytes(shape) -> float:
    """Per-chip bytes every engine of `shape` holds beside its KV: the largest, over the four
    programs, of the weights it holds + its temporaries (`engine.memory_estimate` less the cache)."""
    from sprint_jax.plan import engine as pe
    return max(e["total"] - e["cache"] for e in (pe.memory_estimate(shape, k) for k in pe.KINDS))


def pool_pages_for(shape, hbm_bytes: float, fill: float) -> int:
    """Pages of one page shard that one chip holds beside the weights and temporaries of an
    engine of `shape` (its concurrency sets the temporaries), within `fill` of its HBM."""
    from sprint_jax.plan import engine as pe
    per_page = pe.kv_chip_bytes_per_token(shape) * shape.page_size
    return max(0, int((hbm_bytes * fill - fixed_bytes(shape)) // per_page))


def fit(shape, hbm_bytes: float, runs: Sequence[RunLengths], fill: float | None = None,
        trials: int = TRIALS, seed: int = SEED) -> dict[str, Any]:
    """Runs of the distribution `runs` that one slice of `shape.mesh` holds, paged vs slot
    engine (module docstring). Returns the figures `plan engine --lengths` prints."""
    from sprint_jax.plan import engine as pe

    fill = pe.FILL if fill is None else fill
    slots = shape.mesh[0] * shape.mesh[1]
    pages = [run_pages(r, shape.page_size, shape.decode_chunk) for r in runs]

    def at(n: int):
        return dataclasses.replace(shape, concurrency=n)

    def slot_ok(n: int) -> bool:
        return max(pe.slot_memory_estimate(at(n), k)["total"] for k in pe.KINDS) <= hbm_bytes * fill

    def paged_ok(n: int) -> bool:
        shard = pool_pages_for(at(n), hbm_bytes, fill)
        return shard > 0 and exceed_probability(pages, n, at(n).parts, shard, trials, seed) < P_EXCEED

    slot_n = _largest(slot_ok, slots)
    paged_n = _largest(paged_ok, slots)
    chips = math.prod(shape.mesh)
    shard = pool_pages_for(at(paged_n), hbm_bytes, fill) if paged_n else 0
    tokens = np.asarray([r.trace for r in runs])
    return {
        "runs": len(runs), "page_size": shape.page_size, "chips": chips,
        "trace_tokens": {"mean": float(tokens.mean()), "median": float(np.median(tokens)),
                         "p99": float(np.percentile(tokens, 99)), "max": int(tokens.max())},
        "run_pages": {"mean": float(np.mean(pages)), "p99": float(np.percentile(pages, 99)), "max": int(max(pages))},
        "slot_tokens_per_run": shape.parent_capacity + shape.executors * shape.child_capacity,
        "paged_runs": paged_n, "slot_runs": slot_n,
        "paged_runs_per_chip": paged_n / chips, "slot_runs_per_chip": slot_n / chips,
        "ratio": paged_n / slot_n if slot_n else None,
        "pool_pages": shard * at(paged_n).parts if paged_n else 0,
        "exceed_probability": (exceed_probability(pages, paged_n, at(paged_n).parts, shard, trials, seed)
                               if paged_n else None),
        "p_exceed": P_EXCEED, "trials": trials, "seed": seed, "fill": fill,
    }
