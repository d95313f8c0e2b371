"""Evaluation over hosts: `eval --shard I/N` runs a deterministic slice of the problems,
`eval merge DIR... --out DIR` joins the shards into the results.jsonl / records.jsonl / report.json
(and plots) one unsharded run writes, timings aside.

Shard I of N (0 <= I < N) takes the problems at positions I, I+N, I+2N, ... of the task list (a
stride, so easy and hard problems spread over the shards), and records its place in
report.json meta "shard" {index, count, total, positions}. The merge checks that the N shards
are one split of one evaluation (same count, total, mode, model, data and settings; every index
once; every shard finished, i.e. has its report.json and all its lines), then interleaves their
lines back into task order (a sampled run's lines: each problem's samples together) and
recomputes the report. A shard that died is rerun alone with the
same command; the merge of the rerun is the same (greedy decoding is deterministic). The run's
wall clock in the merged report is derived from the problems' timings like any run's
(`report.run_wall_clock`): the shards' invocations are numbered alike, so shards count as
running at once, and a merge of shards run side by side takes about the slowest shard's time
(shards written before per-problem timings: the slowest shard's report). The shards and their
wall clocks are listed in merge.json. Each shard's KV pool figures (report.json engine_pool) are
kept per shard, and their counts (prompt tokens, prefix-cache hits, evictions) summed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from sprint_jax.errors import UserError

MERGE_FILE = "merge.json"
# report meta keys that differ per shard by construction; everything else must agree
_PER_SHARD = ("shard", "train_overlap")
# report.json engine_pool counts a merge sums over the shards (each ran its own engine)
POOL_COUNTS = ("prompt_tokens", "prefix_hit_tokens", "prompt_tokens_prefilled", "evicted_pages")


def detect_shard() -> tuple[int, int]:
    """`--shard auto`: this process's place in the cluster, found as the trainer finds it
    (`train.distributed.detect_cluster`): SLURM (SLURM_PROCID of SLURM_NTASKS), a multi-host Cloud
    TPU (TPU_WORKER_ID of the TPU_WORKER_HOSTNAMES), or JAX's own variables (JAX_PROCESS_ID of
    JAX_NUM_PROCESSES)."""
    import os

    from sprint_jax.train.distributed import detect_cluster

    kind = detect_cluster()
    env = os.environ
    keys = {"slurm": ("SLURM_PROCID", None), "tpu": ("TPU_WORKER_ID", None),
            "jax-env": ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES")}.get(kind)
    if keys is None:
        raise UserError("--shard auto: no SLURM job with several tasks, multi-host TPU or JAX_NUM_PROCESSES "
                        "found; pass --shard I/N")
    try:
        index = int(env[keys[0]])
        if kind == "slurm":
            count = int(env.get("SLURM_NTASKS") or env["SLURM_NPROCS"])
        elif kind == "tpu":
            count = len(env["TPU_WORKER_HOSTNAMES"].split(","))
        else:
            count = int(env[keys[1]])
    except (KeyError, ValueError):
        raise UserError(f"--shard auto: {kind} detected but {keys[0]} is missing or not a number") from None
    return parse_shard(f"{index}/{count}")


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N) with 0 <= I < N; "auto" -> `detect_shard()`."""
    if text == "auto":
        return detect_shard()
    i, slash, n = (text or "").partition("/")
    try:
        index, count = int(i), int(n)
    except ValueError:
        raise UserError(f"--shard must be I/N (e.g. 0/4: the first of 4 shards), got {text!r}") from None
    if not slash or count < 1 or not 0 <= index < count:
        raise UserError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def shard_positions(total: int, index: int, count: int) -> list[int]:
    """Positions in the task list of shard `index` of `count`."""
    return list(range(index, total, count))


def shard_meta(total: int, index: int, count: int) -> dict:
    return {"index": index, "count": count, "total": total, "positions": shard_positions(total, index, count)}


def _read_lines(path: Path, problem, rerun: str) -> list[dict]:
    """The rows of a shard's jsonl file, each checked by `problem(row, "file:line")` (None when
    sound, else why): a line that is not UTF-8, not JSON or damaged is a UserError naming it."""
    if not path.is_file():
        return []
    rows = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(raw.decode("utf-8"))
            why = problem(row, where) if isinstance(row, dict) else "not a JSON object"
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            why = f"not valid {'UTF-8' if isinstance(e, UnicodeDecodeError) else 'JSON'}"
        if why:
            why = why if why.startswith(where) else f"{where}: {why}"
            raise UserError(f"{why}; {rerun} to redo the damaged line")
        rows.append(row)
    return rows


def _by_problem(rows: list[dict]) -> list[list[dict]]:
    """The lines of each problem (its samples, by sample index) as one group, problems in the
    order they first appear (a run extended to more samples appends the new ones at the end)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(str(r.get("id")), []).append(r)
    return [sorted(g, key=lambda r: r.get("sample") or 0) for g in groups.values()]


def merge_shards(dirs: Sequence[str | Path], out: str | Path) -> dict:
    """Join shard directories into `out` (see the module docstring). Returns the report."""
    from sprint_jax.eval.evaluate import (RECORDS_FILE, REPORT_FILE, RESULTS_FILE, record_row_problem,
                                          result_row_problem)
    from sprint_jax.eval.report import make_report, run_wall_clock, write_plots

    if not dirs:
        raise UserError("eval merge needs at least one shard directory")
    shards = []
    for d in map(Path, dirs):
        rep_path = d / REPORT_FILE
        if not rep_path.is_file():
            raise UserError(f"{d}: no {REPORT_FILE} (the shard did not finish; rerun its `eval --shard I/N`)")
        report = json.loads(rep_path.read_text(encoding="utf-8"))
        shard = (report.get("meta") or {}).get("shard")
        if not shard:
            raise UserError(f"{d}: not a shard (its {REPORT_FILE} has no meta.shard; run `eval --shard I/N`)")
        # one line per problem and sample: grouped by problem, in the shard's order
        rerun = f"rerun shard {shard.get('index')}/{shard.get('count')} into {d}"
        mode = report.get("mode")
        results = _by_problem(_read_lines(d / RESULTS_FILE, lambda r, w: result_row_problem(r, w, mode), rerun))
        records = _by_problem(_read_lines(d / RECORDS_FILE, lambda r, w: record_row_problem(r, w, mode), rerun))
        samples = (report.get("meta") or {}).get("samples") or 1
        if (len(results) != len(shard["positions"]) or len(records) != len(shard["positions"])
                or any(len(g) != samples for g in results + records)):
            raise UserError(f"{d}: {sum(map(len, results))} results and {sum(map(len, records))} records for "
                            f"{len(shard['positions'])} problems x {samples} sample(s) (incomplete; rerun shard "
                            f"{shard['index']}/{shard['count']})")
        shards.append((d, report, shard, results, records))
    d0, rep0, sh0 = shards[0][:3]
    count, total = sh0["count"], sh0["total"]
    seen: dict[int, Path] = {}
    for d, report, shard, _, _ in shards:
        if (shard["count"], shard["total"]) != (count, total):
            raise UserError(f"{d} is shard {shard['index']}/{shard['count']} of {shard['total']} problems but "
                            f"{d0} is of {count} shards of {total}: not one evaluation")
        if shard["index"] in seen:
            raise UserError(f"shard {shard['index']}/{count} given twice: {seen[shard['index']]} and {d}")
        seen[shard["index"]] = d
        if shard["positions"] != shard_positions(total, shard["index"], count):
            raise UserError(f"{d}: meta.shard.positions is not shard {shard['index']}/{count} of {total}")
        if report["mode"] != rep0["mode"]:
            raise UserError(f"{d} ran mode {report['mode']!r} but {d0} ran {rep0['mode']!r}")
        for k in sorted(set(report.get("meta", {})) | set(rep0.get("meta", {}))):
            if k not in _PER_SHARD and report["meta"].get(k) != rep0["meta"].get(k):
                raise UserError(f"{d} and {d0} differ in {k!r} ({report['meta'].get(k)!r} vs "
                                f"{rep0['meta'].get(k)!r}): not one evaluation")
    missing = [i for i in range(count) if i not in seen]
    if missing:
        raise UserError(f"missing shard(s) {', '.join(f'{i}/{count}' for i in missing)} of {count}")
    results: list = [None] * total
    records: list = [None] * total
    for _, _, shard, res, rec in shards:
        for pos, r, c in zip(shard["positions"], res, rec):
            results[pos], records[pos] = r, c
    results = [r for group in results for r in group]
    records = [c for group in records for c in group]
    meta = {k: v for k, v in rep0["meta"].items() if k != "shard"}
    overlaps = [s[1]["meta"].get("train_overlap") for s in shards]
    if any(o is not None for o in overlaps):
        hit = {i for o in overlaps if o for i in o.get("overlap_ids", [])}
        ids = list(dict.fromkeys(r["id"] for r in results if r["id"] in hit))
        meta["train_overlap"] = {"checked": all(bool(o and o.get("checked")) for o in overlaps),
                                 "overlap": len(ids), "overlap_ids": ids}
    walls = [s[1].get("wall_clock_s") for s in shards]
    wall = None
    if run_wall_clock(results) is None and all(isinstance(w, (int, float)) for w in walls):
        wall = max(walls)
    report = make_report(results, rep0["mode"], wall_clock_s=wall, meta=meta)
    report["problems_in_out"] = total
    pools = [s[1].get("engine_pool") for s in sorted(shards, key=lambda x: x[2]["index"])]
    if all(pools):              # each shard's engine: what they did summed, their pools per shard
        report["engine_pool"] = dict({k: sum(p[k] for p in pools) for k in POOL_COUNTS}, shards=pools)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in ((RESULTS_FILE, results), (RECORDS_FILE, records)):
        tmp = out / (name + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(out / name)
    report["plots"] = write_plots(results, out, rep0["mode"])
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / MERGE_FILE).write_text(json.dumps({
        "shards": [{"dir": str(d), "index": s["index"], "count": s["count"], "wall_clock_s": r["wall_clock_s"]}
                   for d, r, s, _, _ in sorted(shards, key=lambda x: x[2]["index"])]}, indent=2) + "\n")
    return report
