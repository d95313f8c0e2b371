"""DIR/report.md: every stage of the run with its status and time, the paper's table (accuracy,
sequential and total tokens, wall clock, the parallel arm against the sequential one) and its
length bins for every eval set, from each `eval compare` stage's compare.json, with the trainings'
summaries (SFT phases, self-training rounds, RL) and links to the comparison plots."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from sprint_jax.recipe.config import RecipeConfig


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _stages(root: Path) -> list[str]:
    """Every stage of the run with its status and seconds (state.json, as this stage starts)."""
    from sprint_jax.recipe.runner import STATE_FILE

    state = _read(root / STATE_FILE).get("stages") or {}
    rows = [[name, "this file" if name == "report" else rec.get("status", "-"), _num(rec.get("seconds"), ".0f")]
            for name, rec in state.items()]
    return ["## Stages", ""] + _table(["stage", "status", "seconds"], rows)


def _training(root: Path, names: list[str]) -> list[str]:
    rows = []
    for arm, label in zip(("sprint", "rft"), names):
        stages = ([root / f"train_{arm}"] if (root / f"train_{arm}").exists() else
                  sorted(root.glob(f"train_{arm}_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])))
        for d in stages:
            s = _read(d / "out" / "summary.json")
            data = s.get("data") or {}
            rows.append([label, d.name, str(s.get("layout", "-")), str(s.get("steps", "-")),
                         str(data.get("used", "-")), _num(s.get("final_loss"), ".4f"), str(s.get("tokens", "-"))])
    lines = ["## Training", ""] + _table(["model", "stage", "layout", "steps", "examples used", "final loss",
                                          "tokens trained"], rows)
    mix = _read(root / "mix" / "out" / "mix.json").get("phases")
    if mix:
        lines += ["", "Curriculum of the parallel arm's SFT (one train stage per phase):", ""]
        lines += _table(["phase", "parallel fraction", "epochs", "parallel examples", "sequential examples"],
                        [[str(p["phase"]), f"{p['parallel_fraction']:.2f}", f"{p['epochs']:g}", str(p["parallel"]),
                          str(p["sequential"])] for p in mix])
    rows = []
    for arm, label in zip(("sprint", "rft"), names):
        for r in _read(root / f"selftrain_{arm}" / "out" / "summary.json").get("rounds") or []:
            rows.append([label, str(r["round"]), "-" if r["round"] == 0 else f"{r['kept']}/{r['sampled']}",
                         _num(r.get("accuracy"), ".3f"), _num(r.get("mean_sequential_tokens"), ".1f")])
    if rows:
        lines += ["", "## Self-training", ""] + _table(
            ["model", "round", "kept / sampled", "held-out accuracy", "held-out seq tokens"], rows)
    rows = []
    for arm, label in zip(("sprint", "rft"), names):
        s = _read(root / f"rl_{arm}" / "out" / "summary.json")
        if s:
            last = s.get("last") or {}
            rows.append([label, str(last.get("step", "-")), _num(last.get("reward"), ".3f"),
                         _num(last.get("accuracy"), ".3f"), _num(last.get("sequential_tokens"), ".1f")])
    if rows:
        lines += ["", "## RL (P-GRPO)", ""] + _table(
            ["model", "steps", "last reward", "last rollout accuracy", "last rollout seq tokens"], rows)
    return lines


def _bins(bins: list[dict], names: list[str]) -> list[str]:
    a, b = names
    rows = []
    for x in bins:
        hi = "inf" if x["max_baseline_tokens"] is None else str(x["max_baseline_tokens"])
        rows.append([f"{x['min_baseline_tokens']}-{hi}", str(x["n"]),
                     _num(x["a"]["accuracy"], ".3f"), _num(x["b"]["accuracy"], ".3f"),
                     _num(x["a"]["mean_sequential_tokens"], ".1f"), _num(x["b"]["mean_sequential_tokens"], ".1f"),
                     _num(x.get("sequential_ratio"), ".3f")])
    return _table([f"{b} sequential tokens", "n", f"accuracy {a}", f"accuracy {b}", f"seq tokens {a}",
                   f"seq tokens {b}", f"seq ratio {a}/{b}"], rows)


def _per_model(table: dict, names: list[str]) -> list[str]:
    """Avg@k with its standard error, pass@k, self-parallelism and activation ratio per model,
    where compare.json has them (an eval with --samples, a compare that reports parallelism)."""
    samples, par = table.get("samples") or {}, table.get("parallelism") or {}
    if not samples and not par:
        return []
    rows = []
    for n in names:
        s, p = samples.get(n) or {}, par.get(n) or {}
        k = (s.get("samples_per_problem") or {}).get("min")
        se = s.get("avg_at_k_se")
        avg = "-" if s.get("avg_at_k") is None else (f"{100 * s['avg_at_k']:.1f}%"
                                                     + ("" if se is None else f" ± {100 * se:.1f}"))
        passes = ", ".join(f"@{j} {100 * v:.1f}%" for j, v in (s.get("pass_at_k") or {}).items())
        rows.append([n, str(k or "-"), avg, passes or "-",
                     _num((p.get("self_parallelism") or {}).get("ratio_of_sums"), ".3f"),
                     _num(p.get("activation_ratio"), ".3f")])
    return [""] + _table(["model", "samples per problem", "Avg@k ± SE", "pass@k", "self-parallelism",
                          "activation ratio"], rows)


def _eval_set(root: Path, name: str, data: str) -> list[str]:
    table = json.loads((root / f"compare_{name}" / "out" / "compare.json").read_text())
    a, b = table["names"]
    rows = []
    for r in table["rows"]:
        if r["key"] == "accuracy":
            cells = [f"{100 * r[a]:.1f}%", f"{100 * r[b]:.1f}%", f"{r['points']:+.1f} pts"]
        else:
            spec = ".2f" if r["key"] == "mean_wall_s" else ".1f"
            rel = r.get("relative")
            cells = [_num(r[a], spec), _num(r[b], spec), "n/a" if rel is None else f"{100 * rel:+.1f}%"]
        rows.append([r["metric"], *cells])
    lines = [f"## {name} ({data}, {table['n']} problems)", ""] + _table(["", a, b, "change"], rows)
    lines += _per_model(table, [a, b])
    tok = (table.get("speedups") or {}).get("tokens") or []
    if tok:
        lines += ["", f"Mean per-problem speedup in sequential tokens ({b} / {a}): "
                      f"{sum(tok) / len(tok):.3f} over {len(tok)} problems."]
    bins = table.get("length_bins") or {}
    if bins.get("fixed"):
        lines += ["", f"### By {b} sequential length (fixed bins)", ""] + _bins(bins["fixed"], [a, b])
    if bins.get("quantiles"):
        lines += ["", f"### By {b} sequential length (quantile bins)", ""] + _bins(bins["quantiles"], [a, b])
    plots = [p for p in sorted((root / f"compare_{name}" / "out").glob("*.png"))]
    if plots:
        lines += [""] + [f"![{p.stem}]({p.relative_to(root)})" for p in plots]
    return lines


def write_report(cfg: RecipeConfig, root: Path) -> Path:
    """Write root/report.md from the recipe's stage outputs under `root`; returns its path."""
    from sprint_jax.recipe.runner import REPORT_FILE

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    names = [n.strip() for n in cfg.compare.names.split(",")]
    lines = [f"# {names[0]} against {names[1]}", "",
             f"Written by `sprint-jax recipe` at {now} (config: recipe.yaml; per-stage logs: "
             f"*/log.txt; full tables: compare_*/out/compare.json).", ""]
    lines += _stages(root) + [""]
    lines += _training(root, names)
    for s in cfg.eval.sets:
        lines += [""] + _eval_set(root, s.name, s.data)
    path = root / REPORT_FILE
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path
