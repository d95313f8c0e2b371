"""Reports over evaluation results: summary numbers, plots, and the SPRINT-vs-RFT table.

Paper §13: the headline table gives accuracy and sequential tokens (tokens on the critical path,
DESIGN.md "Orchestrator") for SPRINT against RFT on the same problems, and the analysis shows the
savings growing with the length of the baseline's trajectory. `compare` builds that table from two
runs matched by problem id; `reduction_by_length` bins the saving by the baseline's length.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Sequence

from sprint_jax.errors import UserError

TOKENS_PLOT = "tokens.png"
REDUCTION_PLOT = "reduction_by_length.png"


class RunFileError(UserError):
    """An evaluation run directory that cannot be read or compared; the message says which."""


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def make_report(results: Sequence[dict], mode: str, wall_clock_s: float, meta: dict | None = None) -> dict:
    """report.json: accuracy, mean sequential / total tokens, wall clock, format-valid rate.

    `format_valid_rate` is the fraction of runs whose output parses with no problem and ends with
    a final answer (RunRecord.format_valid). `token_reduction` = 1 - Σ sequential / Σ total: the
    share of generated tokens taken off the critical path by parallel executors (0 for
    sequential runs).
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
        "token_reduction": (1.0 - sum(seq) / sum(tot)) if sum(tot) else 0.0,
        "mean_stages": _mean([r["stages"] for r in results]),
        "mean_wall_s": _mean([r["wall_s"] for r in results]),
        "wall_clock_s": float(wall_clock_s),
        "format_valid_rate": _mean([float(bool(r["format_valid"])) for r in results]),
        "terminations": dict(Counter(r["termination"] for r in results)),
        "reduction_by_length": reduction_by_length(results),
    }
    if meta:
        report["meta"] = meta
    return report


def reduction_by_length(results: Sequence[dict], baseline: Sequence[dict] | None = None,
                        bins: int = 5) -> list[dict]:
    """The sequential-token saving binned by the baseline's length (paper §13's analysis).

    With `baseline` (an RFT run, matched by id) the length is its generated tokens and the
    saving is 1 - Σ sequential / Σ baseline tokens per bin. Without one, each run is its own
    baseline: the length is its total tokens (what decoding the same trajectory serially costs).
    Bins are quantiles of the baseline length (at most `bins`, fewer when lengths repeat).
    """
    if baseline is None:
        pairs = [(r["total_tokens"], r["sequential_tokens"]) for r in results]
    else:
        base = {r["id"]: r for r in baseline}
        pairs = [(base[r["id"]]["sequential_tokens"], r["sequential_tokens"]) for r in results if r["id"] in base]
    pairs = sorted(p for p in pairs if p[0] > 0)
    if not pairs:
        return []
    n_bins = max(1, min(bins, len(pairs)))
    out = []
    for b in range(n_bins):
        chunk = pairs[b * len(pairs) // n_bins:(b + 1) * len(pairs) // n_bins]
        if not chunk:
            continue
        base_sum = sum(p[0] for p in chunk)
        out.append({"min_length": chunk[0][0], "max_length": chunk[-1][0], "n": len(chunk),
                    "mean_baseline_tokens": base_sum / len(chunk),
                    "mean_sequential_tokens": sum(p[1] for p in chunk) / len(chunk),
                    "reduction": 1.0 - sum(p[1] for p in chunk) / base_sum})
    return out


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


def plot_reduction(bins: Sequence[dict], path: str | Path, xlabel: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    labels = [f"{b['min_length']}-{b['max_length']}\n(n={b['n']})" for b in bins]
    ax.bar(range(len(bins)), [100 * b["reduction"] for b in bins], color="tab:blue")
    ax.set_xticks(range(len(bins)), labels, fontsize=7)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("sequential-token reduction (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_plots(results: Sequence[dict], out_dir: str | Path) -> list[str]:
    """tokens.png and reduction_by_length.png (each run its own baseline) in out_dir."""
    out = Path(out_dir)
    paths = [plot_tokens(results, out / TOKENS_PLOT),
             plot_reduction(reduction_by_length(results), out / REDUCTION_PLOT,
                            "total tokens of the trajectory (bins)")]
    return [p.name for p in paths]


# ---------------------------------------------------------------------------------------------
# Runs on disk and the comparison table
# ---------------------------------------------------------------------------------------------
def load_results(run_dir: str | Path) -> list[dict]:
    """results.jsonl of an `sprint-jax eval` run directory."""
    path = Path(run_dir) / "results.jsonl"
    if not path.is_file():
        raise RunFileError(f"{run_dir}: no results.jsonl (is it an `sprint-jax eval --out` directory?)")
    from sprint_jax.jsonl import iter_objects, require_fields

    rows = []
    for n, row in iter_objects(path, RunFileError):
        require_fields(row, ("id", "correct", "sequential_tokens", "total_tokens", "wall_s"), f"{path}:{n}", RunFileError)
        rows.append(row)
    return rows


_ROWS = (("accuracy", "accuracy"), ("sequential tokens", "mean_sequential_tokens"),
         ("total tokens", "mean_total_tokens"), ("wall clock (s / problem)", "mean_wall_s"))


def compare(results_a: Sequence[dict], results_b: Sequence[dict], name_a: str = "SPRINT",
            name_b: str = "RFT") -> dict:
    """The paper's table for run A (SPRINT) against run B (the RFT baseline) on the same problems.

    Problems are matched by id; different problem sets are an error (the comparison would not be
    of like with like). Change is A - B in percentage points for accuracy and (A - B) / B for the
    rest. Also returns the saving binned by the baseline's length.
    """
    ids_a = [r["id"] for r in results_a]
    ids_b = [r["id"] for r in results_b]
    for name, ids in ((name_a, ids_a), (name_b, ids_b)):
        if len(set(ids)) != len(ids):
            raise RunFileError(f"run {name} lists a problem id twice")
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
            "accuracy": _mean([float(bool(r["correct"])) for r in rows]),
            "mean_sequential_tokens": _mean([r["sequential_tokens"] for r in rows]),
            "mean_total_tokens": _mean([r["total_tokens"] for r in rows]),
            "mean_wall_s": _mean([r["wall_s"] for r in rows]),
        }
    rows = []
    for label, key in _ROWS:
        a, b = summary[name_a][key], summary[name_b][key]
        if key == "accuracy":
            change = {"points": 100.0 * (a - b)}
        else:
            change = {"relative": (a - b) / b if b else None}
        rows.append({"metric": label, "key": key, name_a: a, name_b: b, **change})
    return {"n": len(ids_a), "names": [name_a, name_b], "rows": rows, "summary": summary,
            "reduction_by_baseline_length": reduction_by_length(results_a, results_b)}


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
    bins = table.get("reduction_by_baseline_length") or []
    if bins:
        lines.append("")
        lines.append(f"sequential-token reduction vs {name_b}, by {name_b} length:")
        for b in bins:
            lines.append(f"  {b['min_length']:>6}-{b['max_length']:<6} n={b['n']:<4} {100 * b['reduction']:+.1f}%")
    return "\n".join(lines)


def wall_clock_summary(run_dir: str | Path, results: Sequence[dict]) -> dict:
    """Wall clock of one eval run: the whole run's clock (report.json) per problem and per correct
    answer, the mean per-problem latency (results.jsonl wall_s), and the concurrency it ran at.
    Per problem at concurrency 1 is latency; at N it is the inverse throughput."""
    path = Path(run_dir) / "report.json"
    report = {}
    if path.is_file():
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RunFileError(f"{path}: not JSON ({e})") from None
    wall = report.get("wall_clock_s")
    n = len(results)
    correct = sum(bool(r["correct"]) for r in results)
    return {"concurrency": (report.get("meta") or {}).get("concurrency", 1), "wall_clock_s": wall,
            "wall_per_problem_s": wall / n if wall is not None and n else None,
            "wall_per_correct_s": wall / correct if wall is not None and correct else None,
            "mean_latency_s": _mean([r["wall_s"] for r in results])}


def format_wall_clock(names: Sequence[str], summaries: Sequence[dict]) -> str:
    """The wall-clock rows of `eval compare` as aligned text."""
    f = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [("concurrency", "concurrency", str), ("run wall clock / problem (s)", "wall_per_problem_s", f),
            ("run wall clock / correct (s)", "wall_per_correct_s", f), ("latency / problem (s)", "mean_latency_s", f)]
    lines = [f"{'':30}{names[0]:>12}{names[1]:>12}"]
    for label, key, fmt_ in rows:
        lines.append(f"{label:30}{fmt_(summaries[0][key]):>12}{fmt_(summaries[1][key]):>12}")
    return "\n".join(lines)


__all__ = ["RunFileError", "make_report", "reduction_by_length", "plot_tokens", "plot_reduction", "write_plots",
           "load_results", "compare", "format_compare_table", "TOKENS_PLOT", "REDUCTION_PLOT",
           "wall_clock_summary", "format_wall_clock"]
