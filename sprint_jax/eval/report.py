"""Reports over evaluation results: summary numbers, plots, and the SPRINT-vs-RFT table.

Paper §13: the headline table gives accuracy and sequential tokens (tokens on the critical path,
docs/design.md "The orchestrator and its accounting") for SPRINT against RFT on the same problems,
and the analysis shows the savings growing with the length of the baseline's trajectory (the paper:
problems whose RFT trace is over 8k tokens). `compare` builds that table from two runs matched by
problem id, with `length_bins`: per bin of the baseline's sequential length (fixed thresholds such
as 2000,4000,8000, and quantiles) the accuracy, sequential tokens and wall clock of both runs;
`plot_speedups` draws the per-problem speedup histogram (ThreadWeaver, Fig. 5).

Two ratios, never to be confused:
* against the baseline (`compare`): SPRINT's sequential tokens / RFT's, on the same problems. This
  is the gain over RFT.
* `sequential_to_total` (one run's report): the run's own critical path over its own generated
  tokens. It says how much of SPRINT's work ran in parallel, NOT that SPRINT beats RFT (the paper's
  MATH-500 figure of 2,440 sequential vs 3,622 total tokens is this ratio).

Timings (`TIMING_FIELDS`, per problem in results.jsonl): `wall_s` is the problem's wall clock with
XLA compilation taken out, `compile_s` the compilation that stalled it (timed apart), `finished_s`
when it finished on its invocation's clock (compilation excluded), `invocation` which run of
`eval` into the directory made it and `concurrency` that run's concurrency. A run's wall clock is
derived from these (`run_wall_clock`), so it stays right over a run resumed in several invocations.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Sequence

from sprint_jax.errors import UserError

TOKENS_PLOT = "tokens.png"
INTERNAL_PLOT = "sequential_to_total_by_length.png"
SPEEDUP_PLOT = "speedup_histogram.png"
BINS_PLOT = "bins_by_baseline_length.png"
# per-problem timings in results.jsonl (see the module docstring); everything else in a line is
# the same whenever greedy decoding produces the same run
TIMING_FIELDS = ("wall_s", "compile_s", "finished_s", "invocation", "concurrency")


class RunFileError(UserError):
    """An evaluation run directory that cannot be read or compared; the message says which."""


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def untimed(row: dict) -> dict:
    """A results.jsonl line without its timings (`TIMING_FIELDS`)."""
    return {k: v for k, v in row.items() if k not in TIMING_FIELDS}


def union_length(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of the intervals [start, end] (overlaps counted once)."""
    total, reach = 0.0, None
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def run_wall_clock(results: Sequence[dict]) -> float | None:
    """The wall clock these problems took, from their own timings: per invocation, the union of
    the problems' intervals [finished_s - wall_s, finished_s] on that invocation's clock
    (compilation excluded), summed over the invocations: the time some problem was running (a gap
    between problems, e.g. grading one at concurrency 1, is not in it). A merged run's shards are
    numbered alike and ran at once: their intervals overlap. None when a line lacks the timings
    (an older run)."""
    spans: dict = {}
    for r in results:
        if r.get("invocation") is None or r.get("finished_s") is None:
            return None
        spans.setdefault(r["invocation"], []).append((r["finished_s"] - r["wall_s"], r["finished_s"]))
    return float(sum(union_length(s) for s in spans.values()))


def run_concurrency(results: Sequence[dict]) -> int | list[int] | None:
    """The concurrency the problems ran at: one number, the sorted distinct values when the
    invocations that made them differed, None when a line lacks it (an older run)."""
    values = sorted({r.get("concurrency") for r in results}, key=lambda v: (v is None, v))
    if not values or None in values:
        return None
    return values[0] if len(values) == 1 else values


def make_report(results: Sequence[dict], mode: str, wall_clock_s: float | None = None, meta: dict | None = None,
                compile_s: float | None = None) -> dict:
    """report.json: accuracy, mean sequential / total tokens, wall clock, format-valid rate.

    `format_valid_rate` is the fraction of runs whose output parses with no problem and ends with
    a final answer (RunRecord.format_valid). `sequential_to_total` = Σ sequential / Σ total is
    SPRINT-internal (1.0 for sequential runs): the run's critical path over its own generated
    tokens, not a comparison with RFT (use `eval compare` for that). `grader_errors` counts problems whose grader failed (graded wrong, logged,
    listed by id in `grader_error_ids`): a non-zero count means the accuracy is a lower bound.
    `n`, `correct` and `accuracy` count runs (a problem sampled k times is k runs); `outcomes`
    splits them into correct / wrong / context_full / capped (`outcome`); `samples` is `sample_summary`
    (Avg@k with its standard error, pass@k, per-problem means); `self_parallelism` and
    `activation_ratio` are `parallelism`'s.
    `wall_clock_s` defaults to `run_wall_clock(results)` (compilation excluded); `compile_s`, when
    given, is the compilation timed apart from it.
    """
    n = len(results)
    seq = [r["sequential_tokens"] for r in results]
    tot = [r["total_tokens"] for r in results]
    report = {
        "mode": mode,
        "n": n,
        "correct": sum(bool(r["correct"]) for r in results),
        "accuracy": _mean([float(bool(r["correct"])) for r in results]),
        "mean_sequential_tokens": _mean(seq),
        "mean_total_tokens": _mean(tot),
        "sequential_to_total": (sum(seq) / sum(tot)) if sum(tot) else None,
        "mean_stages": _mean([r["stages"] for r in results]),
        "mean_wall_s": _mean([r["wall_s"] for r in results]),
        "wall_clock_s": run_wall_clock(results) if wall_clock_s is None else float(wall_clock_s),
        "concurrency": run_concurrency(results),
        "format_valid_rate": _mean([float(bool(r["format_valid"])) for r in results]),
        "terminations": dict(Counter(r["termination"] for r in results)),
        "grader_errors": sum(1 for r in results if r.get("grader_error")),
        "grader_error_ids": [r["id"] for r in results if r.get("grader_error")][:20],
        "sequential_to_total_by_length": sequential_to_total_by_length(results),
        "outcomes": {k: sum(outcome(r) == k for r in results) for k in OUTCOMES},
        "samples": sample_summary(results),
        **parallelism(results),
    }
    if compile_s is not None:
        report["compile_s"] = float(compile_s)
    if meta:
        report["meta"] = meta
    return report


# ---------------------------------------------------------------------------------------------
# Outcomes, samples (Avg@k, pass@k) and parallelism
# ---------------------------------------------------------------------------------------------
# terminations of a run that ran out of room: the planner context (max_seq_len) or the run's
# generated-token budget (max_total_tokens). Such a run was cut, not answered wrong.
CONTEXT_FULL_TERMINATIONS = ("context_full", "token_budget")
# terminations of a run a cap on its shape stopped: a plan past max_stages (sprint_jax.caps)
CAPPED_TERMINATIONS = ("max_stages",)
OUTCOMES = ("correct", "wrong", "context_full", "capped")
SE_ESTIMATOR = ("standard deviation (n - 1) of the per-problem mean accuracies / sqrt(number of problems): "
                "problems are the sampled unit, a problem's k samples are not independent draws")


def outcome(row: dict) -> str:
    """correct | context_full (not correct, and the run hit the context or its token budget:
    `CONTEXT_FULL_TERMINATIONS`) | capped (not correct, and a cap on the plan's shape cut it: the
    run ended at max_stages, `CAPPED_TERMINATIONS`, or a plan's prompts past max_prompts or the
    engine's branches got no executor, `prompts_dropped`) | wrong (every other run that is not
    correct)."""
    if row["correct"]:
        return "correct"
    if row.get("termination") in CONTEXT_FULL_TERMINATIONS:
        return "context_full"
    if row.get("termination") in CAPPED_TERMINATIONS or row.get("prompts_dropped"):
        return "capped"
    return "wrong"


def outcome_share(row: dict, kind: str) -> float:
    """1.0 / 0.0 for one run whose `outcome` is / is not `kind`; a per-problem row of a sampled
    run (`problem_rows`) carries the share of its samples under the key `kind`."""
    share = row.get(kind)
    if isinstance(share, (int, float)) and not isinstance(share, bool):
        return float(share)
    return 1.0 if outcome(row) == kind else 0.0


def context_full_share(row: dict) -> float:
    """`outcome_share(row, "context_full")`."""
    return outcome_share(row, "context_full")


def sample_of(row: dict) -> int:
    """The sample index of a results line (0 for a line without one: an unsampled run)."""
    return int(row.get("sample") or 0)


def by_problem(results: Sequence[dict]) -> dict[str, list[dict]]:
    """Problem id -> its runs (one per sample), in the order the problems first appear."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(str(r["id"]), []).append(r)
    return groups


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), computed as
    1 - prod_{i = n - c + 1}^{n} (1 - k / i) (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def sample_summary(results: Sequence[dict]) -> dict:
    """Avg@k over the problems of `results` (one line per problem and sample).

    avg_at_k: the mean over problems of each problem's accuracy over its samples (with k samples
    for every problem, the accuracy over all runs); avg_at_k_se: its standard error, `SE_ESTIMATOR`
    (None for one problem); pass_at_k: for k = 1, 2, 4, ... up to the fewest samples any problem
    has (and that number), the mean over problems of `pass_at_k`; per_problem: each problem's
    samples, correct count, mean accuracy and context_full and capped counts."""
    import math

    groups = by_problem(results)
    per_problem = []
    for pid, rows in groups.items():
        c = sum(bool(r["correct"]) for r in rows)
        per_problem.append({"id": rows[0]["id"], "samples": len(rows), "correct": c, "mean": c / len(rows),
                            "context_full": sum(outcome(r) == "context_full" for r in rows),
                            "capped": sum(outcome(r) == "capped" for r in rows)})
    means = [p["mean"] for p in per_problem]
    m = len(means)
    avg = _mean(means)
    se = None
    if m > 1:
        se = math.sqrt(sum((x - avg) ** 2 for x in means) / (m - 1)) / math.sqrt(m)
    counts = [p["samples"] for p in per_problem]
    fewest = min(counts, default=0)
    ks = sorted({2 ** e for e in range(max(fewest, 1).bit_length()) if 2 ** e <= fewest} | ({fewest} if fewest else set()))
    return {"problems": m, "samples_per_problem": {"min": fewest, "max": max(counts, default=0)},
            "avg_at_k": avg, "avg_at_k_se": se, "se_estimator": SE_ESTIMATOR,
            "pass_at_k": {str(k): _mean([pass_at_k(p["samples"], p["correct"], k) for p in per_problem])
                          for k in ks},
            "per_problem": per_problem}


def problem_rows(results: Sequence[dict]) -> list[dict]:
    """One row per problem: its samples' means of correct (a share), sequential and total
    tokens, wall clock, context_full and capped (shares). Lines of an unsampled run pass unchanged."""
    groups = by_problem(results)
    if all(len(rows) == 1 for rows in groups.values()):
        return list(results)
    out = []
    for rows in groups.values():
        row = {"id": rows[0]["id"], "samples": len(rows),
               "correct": _mean([float(bool(r["correct"])) for r in rows]),
               "context_full": _mean([context_full_share(r) for r in rows]),
               "capped": _mean([outcome_share(r, "capped") for r in rows])}
        for key in ("sequential_tokens", "total_tokens", "wall_s"):
            row[key] = _mean([r[key] for r in rows])
        out.append(row)
    return out


def parallelism(results: Sequence[dict]) -> dict:
    """How much one run (every line: every problem and sample) parallelised.

    self_parallelism: ThreadWeaver's self-parallelism ratio, total tokens / sequential (critical
    path) tokens, as Σ total / Σ sequential over the runs (1 for plain decoding), and the mean of
    the per-run ratios (runs with sequential tokens > 0). activation_ratio: the share of problems
    where the model chose to parallelise, i.e. its executors ran on a fork at least once
    (`forks` >= 1; a problem's share of its samples, averaged over problems); None when a line of
    a parallel run lacks `forks` (written by an older version)."""
    seq = sum(r["sequential_tokens"] for r in results)
    tot = sum(r["total_tokens"] for r in results)
    per_run = [r["total_tokens"] / r["sequential_tokens"] for r in results if r["sequential_tokens"] > 0]

    def forked(r):
        if r.get("forks") is not None:
            return float(r["forks"] >= 1)
        return 0.0 if r.get("mode") == "sequential" else None
    flags = [forked(r) for r in results]
    activation = None
    if results and None not in flags:
        shares: dict[str, list[float]] = {}
        for r, f in zip(results, flags):
            shares.setdefault(str(r["id"]), []).append(f)
        activation = _mean([_mean(v) for v in shares.values()])
    return {"self_parallelism": {"ratio_of_sums": tot / seq if seq else None,
                                 "mean_per_run": _mean(per_run) if per_run else None},
            "activation_ratio": activation}


def mean_speedup(pairs: Sequence[tuple[dict, dict]]) -> dict:
    """Mean per-problem speedup of A over B: B's sequential tokens / A's per problem (per-problem
    means of a sampled run), averaged (arithmetic mean) over all problems and over the problems
    both runs solved (a sampled problem is solved when more than half of its samples are correct);
    problems where A generated no token are left out. n: the problems averaged."""
    def ratios(ps):
        return [p[1]["sequential_tokens"] / p[0]["sequential_tokens"] for p in ps if p[0]["sequential_tokens"] > 0]
    everything = ratios(pairs)
    solved = ratios([p for p in pairs if float(p[0]["correct"]) > 0.5 and float(p[1]["correct"]) > 0.5])
    return {"all": _mean(everything) if everything else None, "n_all": len(everything),
            "both_solved": _mean(solved) if solved else None, "n_both_solved": len(solved)}


def sequential_to_total_by_length(results: Sequence[dict], bins: int = 5) -> list[dict]:
    """One run's own sequential / total tokens, in quantile bins of its total tokens (SPRINT-internal:
    how much of the trajectory ran off the critical path, not a gain over RFT)."""
    pairs = sorted((r["total_tokens"], r["sequential_tokens"]) for r in results if r["total_tokens"] > 0)
    out = []
    for chunk in _quantile_chunks(pairs, bins, key=lambda p: p[0]):
        out.append({"min_length": chunk[0][0], "max_length": chunk[-1][0], "n": len(chunk),
                    "mean_total_tokens": sum(p[0] for p in chunk) / len(chunk),
                    "mean_sequential_tokens": sum(p[1] for p in chunk) / len(chunk),
                    "sequential_to_total": sum(p[1] for p in chunk) / sum(p[0] for p in chunk)})
    return out


def _quantile_chunks(sorted_items: Sequence, bins: int, key=lambda x: x) -> list[list]:
    """`sorted_items` (sorted by `key`) cut into at most `bins` consecutive chunks of (nearly) equal
    size. Items with equal keys stay in one chunk: a cut that falls inside a run of equal keys moves
    to the nearer end of the run (the later one on a tie), so bins whose edges would coincide
    ("93-93" five times) are one bin, and no key value is in two bins."""
    n = len(sorted_items)
    k = max(1, min(bins, n))
    keys = [key(x) for x in sorted_items]
    cuts = [0]
    for b in range(1, k):
        i = b * n // k
        if 0 < i < n and keys[i - 1] == keys[i]:
            lo, hi = i, i
            while lo > 0 and keys[lo - 1] == keys[i]:
                lo -= 1
            while hi < n and keys[hi] == keys[i]:
                hi += 1
            i = lo if i - lo < hi - i and lo > cuts[-1] else hi
        cuts.append(max(i, cuts[-1]))
    cuts.append(n)
    return [list(sorted_items[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]


def _bin_row(pairs: Sequence[tuple[dict, dict]], lo: float, hi: float | None) -> dict:
    """One bin of (A, B) result pairs: n, and per run accuracy, mean sequential tokens, mean wall
    clock; the ratios A/B of summed sequential tokens and of summed wall clock; per run the share
    of runs that were `context_full`, and of runs that were `capped`."""
    row: dict = {"min_baseline_tokens": lo, "max_baseline_tokens": hi, "n": len(pairs)}
    for side, k in (("a", 0), ("b", 1)):
        rows = [p[k] for p in pairs]
        row[side] = {"accuracy": _mean([float(r["correct"]) for r in rows]) if rows else None,
                     "mean_sequential_tokens": _mean([r["sequential_tokens"] for r in rows]) if rows else None,
                     "mean_wall_s": _mean([r["wall_s"] for r in rows]) if rows else None}
    seq_b = sum(p[1]["sequential_tokens"] for p in pairs)
    wall_b = sum(p[1]["wall_s"] for p in pairs)
    row["sequential_ratio"] = sum(p[0]["sequential_tokens"] for p in pairs) / seq_b if seq_b else None
    row["wall_ratio"] = sum(p[0]["wall_s"] for p in pairs) / wall_b if wall_b else None
    row["context_full"] = {side: _mean([context_full_share(p[k]) for p in pairs]) if pairs else None
                           for side, k in (("a", 0), ("b", 1))}
    row["capped"] = {side: _mean([outcome_share(p[k], "capped") for p in pairs]) if pairs else None
                     for side, k in (("a", 0), ("b", 1))}
    return row


def length_bins(pairs: Sequence[tuple[dict, dict]], thresholds: Sequence[int] = (), quantiles: int = 0) -> dict:
    """Bins of matched (A, B) results by B's (the baseline's) sequential tokens.

    `thresholds` t1 < t2 < ... give the fixed bins [0, t1), [t1, t2), ..., [tk, inf) (empty bins are
    kept, n = 0); `quantiles` q gives up to q bins of (nearly) equal size over the sorted lengths,
    problems of equal length always in one bin (`_quantile_chunks`: bins whose edges would coincide
    are merged; `min/max_baseline_tokens` are the bin's actual extremes). Each bin: see `_bin_row`.
    """
    ts = list(thresholds)
    if any(t <= 0 for t in ts) or ts != sorted(set(ts)):
        raise UserError(f"--bins must be increasing positive token counts, got {','.join(map(str, ts))}")
    fixed = []
    edges = [0, *ts, None]
    for lo, hi in zip(edges, edges[1:]):
        inside = [p for p in pairs if p[1]["sequential_tokens"] >= lo and (hi is None or p[1]["sequential_tokens"] < hi)]
        fixed.append(_bin_row(inside, lo, hi))
    quant = []
    if quantiles > 0:
        ordered = sorted(pairs, key=lambda p: p[1]["sequential_tokens"])
        for chunk in _quantile_chunks(ordered, quantiles, key=lambda p: p[1]["sequential_tokens"]):
            quant.append(_bin_row(chunk, chunk[0][1]["sequential_tokens"], chunk[-1][1]["sequential_tokens"]))
    return {"thresholds": ts, "fixed": fixed, "quantiles": quant}


def speedups(pairs: Sequence[tuple[dict, dict]]) -> dict:
    """Per problem: B's sequential tokens / A's (token speedup) and B's wall clock / A's."""
    tok = [p[1]["sequential_tokens"] / p[0]["sequential_tokens"] for p in pairs if p[0]["sequential_tokens"] > 0]
    wall = [p[1]["wall_s"] / p[0]["wall_s"] for p in pairs if p[0]["wall_s"] > 0]
    return {"tokens": tok, "wall": wall}


def speedup_summary(pairs: Sequence[tuple[dict, dict]]) -> dict:
    """The distribution of per-problem token speedups of A over B (B's sequential tokens / A's, as
    `speedups`; ThreadWeaver reports its histogram and its maximum on correct answers), as numbers:
    n, min, median (the mean of the middle two for an even n), max, `faster` (the share of problems
    with a speedup > 1), and `max_both_solved`, the largest speedup among the problems both runs
    solved (more than half of a sampled problem's samples correct, as `mean_speedup`). Problems
    where A generated no token are left out; each value is None when nothing is left."""
    import statistics

    def ratio(p):
        return p[1]["sequential_tokens"] / p[0]["sequential_tokens"]
    kept = [p for p in pairs if p[0]["sequential_tokens"] > 0]
    tok = [ratio(p) for p in kept]
    solved = [ratio(p) for p in kept if float(p[0]["correct"]) > 0.5 and float(p[1]["correct"]) > 0.5]
    return {"n": len(tok), "min": min(tok, default=None),
            "median": statistics.median(tok) if tok else None, "max": max(tok, default=None),
            "faster": _mean([float(x > 1) for x in tok]) if tok else None,
            "max_both_solved": max(solved, default=None), "n_both_solved": len(solved)}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_tokens(results: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Per problem: total tokens (x) against sequential tokens (y); the diagonal is no saving."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    xs = [r["total_tokens"] for r in results]
    ys = [r["sequential_tokens"] for r in results]
    colors = ["tab:green" if r["correct"] else "tab:red" for r in results]
    ax.scatter(xs, ys, s=14, c=colors, alpha=0.8)
    hi = max(xs + ys + [1])
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="sequential = total")
    ax.set_xlabel("total tokens (Σ planner + Σ executors)")
    ax.set_ylabel("sequential tokens (critical path)")
    ax.set_title(title or "tokens per problem (green: correct)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _range_label(lo, hi) -> str:
    if hi is None:
        return f"{lo}+"
    return str(lo) if lo == hi else f"{lo}-{hi}"


def internal_title(mode: str | None) -> str:
    """The title of a run's own sequential / total plot, by the kind of run it is."""
    if mode == "sequential":
        return "sequential run (RFT baseline): one decoding path, sequential = total"
    return f"SPRINT {mode or ''} run, internal ratio: not a gain over RFT".replace("  ", " ")


def plot_sequential_to_total(bins: Sequence[dict], path: str | Path, mode: str | None = None) -> Path:
    """One run's own sequential / total tokens by its total length, titled by the run's `mode`
    (SPRINT-internal for parallel / serial runs; 1 by construction for a sequential run)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{_range_label(b['min_length'], b['max_length'])}\nn={b['n']}" for b in bins]
    ax.bar(range(len(bins)), [b["sequential_to_total"] for b in bins], color="tab:blue")
    ax.set_xticks(range(len(bins)), labels, fontsize=8)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("total tokens of the trajectory (quantile bins)")
    ax.set_ylabel("sequential / total tokens (this run only)")
    ax.set_title(internal_title(mode), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _bin_label(b: dict) -> str:
    return f"{_range_label(b['min_baseline_tokens'], b['max_baseline_tokens'])}\nn={b['n']}"


def plot_bins(bins: dict, path: str | Path, names: Sequence[str]) -> Path:
    """Per bin of the baseline's length (`length_bins`: a row of fixed bins, a row of quantile
    bins): accuracy, mean sequential tokens and mean wall clock of both runs. One legend above the
    panels; an empty bin has no bars."""
    plt = _pyplot()
    rows = [(kind, bins[kind]) for kind in ("fixed", "quantiles") if bins.get(kind)]
    fig, axes = plt.subplots(max(1, len(rows)), 3, figsize=(14, 0.6 + 3.4 * max(1, len(rows))), squeeze=False)
    for (kind, row), ax_row in zip(rows, axes):
        x = list(range(len(row)))
        for ax, key, label in zip(ax_row, ("accuracy", "mean_sequential_tokens", "mean_wall_s"),
                                  ("accuracy", "sequential tokens (mean)", "wall clock s (mean)")):
            for off, side, name in ((-0.2, "a", names[0]), (0.2, "b", names[1])):
                ax.bar([i + off for i in x], [b[side][key] or 0 for b in row], width=0.4, label=name,
                       color="tab:blue" if side == "a" else "tab:orange")
            # two-line labels side by side while they fit the panel (~44 characters at this size),
            # else one line each, slanted
            crowded = len(row) * max(len(line) for b in row for line in _bin_label(b).split("\n")) > 44
            labels = [_bin_label(b).replace("\n", " ") if crowded else _bin_label(b) for b in row]
            ax.set_xticks(x, labels, fontsize=8, rotation=30 if crowded else 0, ha="right" if crowded else "center")
            ax.set_ylabel(label)
            ax.set_title(f"{names[1]} sequential tokens, {'fixed' if kind == 'fixed' else 'quantile'} bins",
                         fontsize=9)
            if key == "accuracy":
                ax.set_ylim(0, 1)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_speedups(speedup: dict, path: str | Path, names: Sequence[str]) -> Path:
    """Histogram of per-problem speedups of A over B (ThreadWeaver Fig. 5): tokens and wall clock."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in zip(axes, ("tokens", "wall"), ("sequential tokens", "wall clock")):
        values = speedup[key]
        if values:
            ax.hist(values, bins=min(30, max(5, len(values) // 3)), color="tab:green")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel(f"{names[1]} / {names[0]} {label} per problem (> 1: {names[0]} faster)")
        ax.set_ylabel("problems")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_plots(results: Sequence[dict], out_dir: str | Path, mode: str | None = None) -> list[str]:
    """tokens.png and sequential_to_total_by_length.png (this run only, titled by `mode`, by
    default the results' own "mode") in out_dir."""
    out = Path(out_dir)
    if mode is None:
        modes = {r.get("mode") for r in results}
        mode = modes.pop() if len(modes) == 1 else None
    paths = [plot_tokens(results, out / TOKENS_PLOT),
             plot_sequential_to_total(sequential_to_total_by_length(results), out / INTERNAL_PLOT, mode)]
    return [p.name for p in paths]


# ---------------------------------------------------------------------------------------------
# Runs on disk and the comparison table
# ---------------------------------------------------------------------------------------------
def load_results(run_dir: str | Path) -> list[dict]:
    """results.jsonl of an `sprint-jax eval` run directory."""
    path = Path(run_dir) / "results.jsonl"
    if not path.is_file():
        raise RunFileError(f"{run_dir}: no results.jsonl (is it an `sprint-jax eval --out` directory?)")
    import sys

    from sprint_jax.jsonl import read_objects_tolerating_cut_end

    rows = []
    objects, skipped = read_objects_tolerating_cut_end(path, RunFileError)
    if skipped:    # a run killed mid-write: its complete lines are still results
        print(f"warning: {path}: skipped {skipped} incomplete last line (cut by a killed run); using the "
              f"{len(objects)} complete ones", file=sys.stderr)
    for n, row in objects:
        check_result_row(row, f"{path}:{n}")
        rows.append(row)
    return rows


def _is_number(v) -> bool:
    import math
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_result_row(row: dict, where: str) -> None:
    """A results.jsonl line has the fields reports and compare compute with, of the right types;
    else RunFileError naming `where` (file:line) and the field. Timings other than wall_s may be
    absent (lines of an older run)."""
    from sprint_jax.jsonl import require_fields

    require_fields(row, ("id", "correct", "sequential_tokens", "total_tokens", "wall_s"), where, RunFileError)
    checks = [("id", lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a string or an integer"),
              ("correct", lambda v: isinstance(v, bool), "true or false"),
              ("sequential_tokens", _is_count, "a whole number >= 0"),
              ("total_tokens", _is_count, "a whole number >= 0"),
              ("wall_s", lambda v: _is_number(v) and v >= 0, "a number of seconds >= 0"),
              ("compile_s", lambda v: _is_number(v) and v >= 0, "a number of seconds >= 0"),
              ("finished_s", _is_number, "a number of seconds"),
              ("invocation", _is_count, "a whole number >= 0"),
              ("concurrency", lambda v: _is_count(v) and v >= 1, "a whole number >= 1")]
    for field, ok, what in checks:
        required = field in ("id", "correct", "sequential_tokens", "total_tokens", "wall_s")
        if field in row and (required or row[field] is not None) and not ok(row[field]):
            raise RunFileError(f"{where}: field {field!r} must be {what}, got {json.dumps(row[field])}")


_ROWS = (("accuracy", "accuracy"), ("sequential tokens", "mean_sequential_tokens"),
         ("total tokens", "mean_total_tokens"), ("wall clock (s / problem)", "mean_wall_s"))


def compare(results_a: Sequence[dict], results_b: Sequence[dict], name_a: str = "SPRINT",
            name_b: str = "RFT", bins: Sequence[int] = (2000, 4000, 8000), quantiles: int = 4) -> dict:
    """The paper's table for run A (SPRINT) against run B (the RFT baseline) on the same problems.

    Problems are matched by id; different problem sets are an error (the comparison would not be
    of like with like). A run with several samples per problem is compared through its
    per-problem means (`problem_rows`): accuracy is then Avg@k. Change is A - B in percentage
    points for accuracy and (A - B) / B for the rest. Also returns `length_bins` (by B's
    sequential length: fixed `bins` thresholds and `quantiles`), the per-problem `speedups`,
    their `mean_speedup` and `speedup_summary`, each run's `parallelism` (self-parallelism and
    activation ratios) and `samples` (`sample_summary` without the per-problem list).
    """
    for name, rows in ((name_a, results_a), (name_b, results_b)):
        keys = [(str(r["id"]), sample_of(r)) for r in rows]
        if len(set(keys)) != len(keys):
            pid, k = next(x for x in keys if keys.count(x) > 1)
            raise RunFileError(f"run {name} lists problem {pid!r} (sample {k}) twice")
    extra = {"parallelism": {name_a: parallelism(results_a), name_b: parallelism(results_b)},
             "samples": {name: {k: v for k, v in sample_summary(rows).items() if k != "per_problem"}
                         for name, rows in ((name_a, results_a), (name_b, results_b))}}
    results_a, results_b = problem_rows(results_a), problem_rows(results_b)
    ids_a = [r["id"] for r in results_a]
    ids_b = [r["id"] for r in results_b]
    if set(ids_a) != set(ids_b):
        only_a = sorted(set(ids_a) - set(ids_b))
        only_b = sorted(set(ids_b) - set(ids_a))
        raise RunFileError(f"the runs cover different problems: {len(only_a)} only in {name_a} "
                           f"(e.g. {only_a[:3]}), {len(only_b)} only in {name_b} (e.g. {only_b[:3]})")
    if not ids_a:
        raise RunFileError("the runs have no problems")
    by_b = {r["id"]: r for r in results_b}
    b_sorted = [by_b[i] for i in ids_a]
    summary = {}
    for label, rows in ((name_a, list(results_a)), (name_b, b_sorted)):
        summary[label] = {
            "accuracy": _mean([float(r["correct"]) for r in rows]),
            "mean_sequential_tokens": _mean([r["sequential_tokens"] for r in rows]),
            "mean_total_tokens": _mean([r["total_tokens"] for r in rows]),
            "mean_wall_s": _mean([r["wall_s"] for r in rows]),
            "grader_errors": sum(1 for r in rows if r.get("grader_error")),
            "context_full": _mean([context_full_share(r) for r in rows]),
            "capped": _mean([outcome_share(r, "capped") for r in rows]),
        }
    rows = []
    for label, key in _ROWS:
        a, b = summary[name_a][key], summary[name_b][key]
        if key == "accuracy":
            change = {"points": 100.0 * (a - b)}
        else:
            change = {"relative": (a - b) / b if b else None}
        rows.append({"metric": label, "key": key, name_a: a, name_b: b, **change})
    pairs = list(zip(results_a, b_sorted))
    return {"n": len(ids_a), "names": [name_a, name_b], "rows": rows, "summary": summary,
            "length_bins": length_bins(pairs, bins, quantiles), "speedups": speedups(pairs),
            "mean_speedup": mean_speedup(pairs), "speedup_summary": speedup_summary(pairs), **extra}


def _format_bins(bins: Sequence[dict], name_a: str, name_b: str) -> list[str]:
    lines = [f"  {name_b + ' seq tokens':>16} {'n':>5} {'acc ' + name_a:>11} {'acc ' + name_b:>11} "
             f"{'seq ' + name_a:>10} {'seq ' + name_b:>10} {'seq ratio':>9} {'wall ' + name_a:>10} "
             f"{'wall ' + name_b:>10} {'wall ratio':>10}"]

    def num(v, f):
        return "-" if v is None else format(v, f)
    def tokens(v):        # a per-problem mean of a sampled run may be fractional
        return str(int(v)) if float(v).is_integer() else f"{v:.1f}"
    for b in bins:
        hi = "inf" if b["max_baseline_tokens"] is None else tokens(b["max_baseline_tokens"])
        lines.append(f"  {tokens(b['min_baseline_tokens']) + '-' + hi:>16} {b['n']:>5} "
                     f"{num(b['a']['accuracy'], '.3f'):>11} {num(b['b']['accuracy'], '.3f'):>11} "
                     f"{num(b['a']['mean_sequential_tokens'], '.1f'):>10} {num(b['b']['mean_sequential_tokens'], '.1f'):>10} "
                     f"{num(b['sequential_ratio'], '.3f'):>9} {num(b['a']['mean_wall_s'], '.2f'):>10} "
                     f"{num(b['b']['mean_wall_s'], '.2f'):>10} {num(b['wall_ratio'], '.3f'):>10}")
    return lines


def _format_extras(table: dict) -> list[str]:
    """The rows after the paper's table: context_full, capped, Avg@k with its standard error when a run
    has several samples, ThreadWeaver's ratios, and the mean per-problem speedup."""
    name_a, name_b = table["names"]
    num = lambda v, f=".2f": "n/a" if v is None else format(v, f)  # noqa: E731
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = []
    if "context_full" in table["summary"][name_a]:
        lines.append(f"{'context_full (cut runs)':26}{pct(table['summary'][name_a]['context_full']):>12}"
                     f"{pct(table['summary'][name_b]['context_full']):>12}")
    if "capped" in table["summary"][name_a]:
        lines.append(f"{'capped (cut by a cap)':26}{pct(table['summary'][name_a]['capped']):>12}"
                     f"{pct(table['summary'][name_b]['capped']):>12}")
    samples = table.get("samples") or {}
    if any((samples.get(n) or {}).get("samples_per_problem", {}).get("max", 1) > 1 for n in (name_a, name_b)):
        cells, ks = [], set()
        for n in (name_a, name_b):
            s = samples[n]
            ks |= {s["samples_per_problem"]["min"], s["samples_per_problem"]["max"]}
            se = s["avg_at_k_se"]
            cells.append(f"{100 * s['avg_at_k']:.1f}" + ("" if se is None else f"±{100 * se:.1f}"))
        label = f"Avg@{ks.pop() if len(ks) == 1 else 'k'} ± s.e. (%)"
        lines.append(f"{label:26}{cells[0]:>12}{cells[1]:>12}")
    par = table.get("parallelism") or {}
    if par:
        lines.append(f"{'self-parallelism (tot/seq)':26}"
                     + "".join(f"{num(par[n]['self_parallelism']['ratio_of_sums']):>12}" for n in (name_a, name_b)))
        lines.append(f"{'activation ratio':26}" + "".join(f"{pct(par[n]['activation_ratio']):>12}"
                                                          for n in (name_a, name_b)))
    ms = table.get("mean_speedup")
    if ms:
        lines.append(f"mean per-problem speedup ({name_b} / {name_a} sequential tokens): "
                     f"{num(ms['all'], '.3f')} over all {ms['n_all']} problems, {num(ms['both_solved'], '.3f')} "
                     f"over the {ms['n_both_solved']} both solved")
    ss = table.get("speedup_summary")
    if ss and ss["n"]:
        lines.append(f"per-problem speedup: median {num(ss['median'], '.3f')}, max {num(ss['max'], '.3f')} "
                     f"(max {num(ss['max_both_solved'], '.3f')} over the {ss['n_both_solved']} both solved), "
                     f"{pct(ss['faster'])} of problems faster")
    return lines


def format_compare_table(table: dict) -> str:
    """The table as aligned text."""
    name_a, name_b = table["names"]
    lines = [f"{table['n']} problems", f"{'':26}{name_a:>12}{name_b:>12}{'change':>12}"]
    for row in table["rows"]:
        a, b = row[name_a], row[name_b]
        if row["key"] == "accuracy":
            cells = (f"{100 * a:.1f}%", f"{100 * b:.1f}%", f"{row['points']:+.1f} pts")
        else:
            rel = row["relative"]
            cells = (f"{a:.1f}" if row["key"] != "mean_wall_s" else f"{a:.2f}",
                     f"{b:.1f}" if row["key"] != "mean_wall_s" else f"{b:.2f}",
                     "n/a" if rel is None else f"{100 * rel:+.1f}%")
        lines.append(f"{row['metric']:26}{cells[0]:>12}{cells[1]:>12}{cells[2]:>12}")
    errors = {k: v["grader_errors"] for k, v in table["summary"].items() if v.get("grader_errors")}
    if errors:
        lines.append("grader errors (graded wrong): " + ", ".join(f"{k} {v}" for k, v in errors.items()))
    lines += _format_extras(table)
    bins = table.get("length_bins") or {}
    ratio_note = f"ratios are {name_a} / {name_b} (summed over the bin; < 1: {name_a} needs less)"
    if bins.get("fixed"):
        lines += ["", f"by {name_b} sequential length, fixed bins ({ratio_note}):"]
        lines += _format_bins(bins["fixed"], name_a, name_b)
    if bins.get("quantiles"):
        lines += ["", f"by {name_b} sequential length, quantile bins:"]
        lines += _format_bins(bins["quantiles"], name_a, name_b)
    return "\n".join(lines)


def _legacy_report(run_dir: str | Path, n: int) -> tuple[float | None, int | None]:
    """(wall clock, concurrency) from the report.json of a run whose results.jsonl lines carry no
    timings (an older version): its wall clock only if it covers exactly these n problems in one
    invocation (a resumed run's covered its last invocation alone)."""
    path = Path(run_dir) / "report.json"
    if not path.is_file():
        return None, None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path}: not JSON ({e})") from None
    if not isinstance(report, dict):
        raise RunFileError(f"{path}: expected a JSON object, got {type(report).__name__}")
    meta = report.get("meta") or {}
    if not isinstance(meta, dict):
        raise RunFileError(f"{path}: field 'meta' must be an object, got {json.dumps(meta)}")
    wall, conc, count = report.get("wall_clock_s"), meta.get("concurrency"), report.get("n")
    for field, v, ok, what in (("wall_clock_s", wall, lambda v: _is_number(v) and v >= 0, "a number of seconds >= 0"),
                               ("meta.concurrency", conc, lambda v: _is_count(v) and v >= 1, "a whole number >= 1"),
                               ("n", count, _is_count, "a whole number >= 0")):
        if v is not None and not ok(v):
            raise RunFileError(f"{path}: field {field!r} must be {what}, got {json.dumps(v)}")
    whole = count == n and not report.get("resumed_problems")
    return (float(wall) if whole and wall is not None else None), (conc if whole else None)


def wall_clock_summary(run_dir: str | Path, results: Sequence[dict]) -> dict:
    """Wall clock of one eval run, from its problems' own timings (`run_wall_clock`, compilation
    excluded, summed over the invocations of a resumed run): per problem (all its samples) and per
    correct answer (a correct run),
    the mean per-problem latency (wall_s), and the concurrency the problems ran at (several
    values for a run resumed at another concurrency). Per problem at concurrency 1 is latency; at
    N it is the inverse throughput. A run written before the per-problem timings falls back on its
    report.json, only where that covers exactly these problems (else n/a)."""
    wall, conc = run_wall_clock(results), run_concurrency(results)
    if wall is None or conc is None:
        wall, conc = _legacy_report(run_dir, len(results))
    n = len(by_problem(results))         # problems: a sampled problem's runs all count in its time
    correct = sum(bool(r["correct"]) for r in results)
    return {"concurrency": conc, "wall_clock_s": wall,
            "wall_per_problem_s": wall / n if wall is not None and n else None,
            "wall_per_correct_s": wall / correct if wall is not None and correct else None,
            "mean_latency_s": _mean([r["wall_s"] for r in results])}


def format_concurrency(c) -> str:
    """A run's concurrency as text: "8", "1,8" for a run resumed at another one, "n/a" unknown."""
    if c is None:
        return "n/a"
    return ",".join(map(str, c)) if isinstance(c, list) else str(c)


def format_wall_clock(names: Sequence[str], summaries: Sequence[dict]) -> str:
    """The wall-clock rows of `eval compare` as aligned text."""
    f = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [("concurrency", "concurrency", format_concurrency),
            ("run wall clock / problem (s)", "wall_per_problem_s", f),
            ("run wall clock / correct (s)", "wall_per_correct_s", f), ("latency / problem (s)", "mean_latency_s", f)]
    lines = [f"{'':30}{names[0]:>12}{names[1]:>12}"]
    for label, key, fmt_ in rows:
        lines.append(f"{label:30}{fmt_(summaries[0][key]):>12}{fmt_(summaries[1][key]):>12}")
    lines.append("(wall clocks without XLA compilation, which each run times apart: compile_s)")
    return "\n".join(lines)


__all__ = ["RunFileError", "make_report", "sequential_to_total_by_length", "length_bins", "speedups",
           "plot_tokens", "plot_sequential_to_total", "plot_bins", "plot_speedups", "write_plots",
           "load_results", "compare", "format_compare_table", "TOKENS_PLOT", "INTERNAL_PLOT", "SPEEDUP_PLOT",
           "BINS_PLOT", "wall_clock_summary", "format_wall_clock", "TIMING_FIELDS", "untimed", "union_length",
           "run_wall_clock", "run_concurrency", "check_result_row", "internal_title", "format_concurrency",
           "CONTEXT_FULL_TERMINATIONS", "CAPPED_TERMINATIONS", "OUTCOMES", "SE_ESTIMATOR", "outcome",
           "outcome_share", "context_full_share", "sample_of", "by_problem",
           "pass_at_k", "sample_summary", "problem_rows", "parallelism", "mean_speedup",
           "speedup_summary"]
