"""SPRINT's and RFT's latency per problem on a TPU chip, predicted from eval records.

`sprint-jax eval` writes records.jsonl (one line per problem: `RunRecord.to_json()` with the
problem's id): the prompt's tokens, each stage's planner tokens, its executions (generated and
forced tokens), how they ran (executor_mode: shared = one fork decoded together, serial = one
after another, inline / none = no executor rows) and the sync's tokens, and the final call's
tokens. A SPRINT eval (mode parallel or serial) and its RFT baseline (mode sequential) are read
from every records.jsonl under a directory and replayed, one run alone on the chip, through the
roofline model of `plan.engine` (`decode_step`, `prefill_tokens`):

  * the prompt: one prefill of its tokens;
  * a planner call (and the final call, and an RFT trace): one decode step per token, one row,
    reading the context so far;
  * a stage's executors (shared): one decode step per step of the longest, the rows alive at
    step t (an executor runs its forced opening, when at most a decode chunk, then its tokens)
    reading the planner's context once for all of them and each its own suffix; an opening
    longer than a decode chunk is prefilled first (as the engine does); serial: each alone;
  * the sync: a prefill of the tokens it ran (a merge join: only the never-computed ones);
    the context then holds every branch.
Engine overheads (host round trips, sampling) are not in it: this is the accelerator's side.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sprint_jax.errors import UserError
from sprint_jax.infer.record_rows import record_problem
from sprint_jax.model.config import Qwen2Config
from sprint_jax.plan.engine import decode_step, prefill_tokens

RECORDS_FILE = "records.jsonl"
SPRINT_MODES = ("parallel", "serial")


def load_records(directory: str | Path, flag: str = "--records") -> dict[str, dict[str, dict]]:
    """{'sprint': {problem key: record}, 'rft': {...}} from every records.jsonl under
    `directory`, or from one records file (the key: id, and #sample past the first). UserError
    naming what is wrong (and `flag`, the option that named the path)."""
    root = Path(directory)
    if root.is_file():
        files = [root]
    elif not root.is_dir():
        raise UserError(f"{flag} {directory}: not a directory (nor a records file)")
    else:
        files = sorted(root.rglob(RECORDS_FILE))
    if not files:
        raise UserError(f"{flag} {directory}: no {RECORDS_FILE} under it (write one with sprint-jax eval --out)")
    out: dict[str, dict[str, dict]] = {"sprint": {}, "rft": {}}
    for path in files:
        for n, raw in enumerate(path.read_bytes().splitlines(), 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise UserError(f"{path}:{n}: not an eval record ({type(e).__name__}: {e})") from None
            why = record_problem(rec)        # a line that parses may still be damaged
            if why:
                raise UserError(f"{path}:{n}: not an eval record ({why}); rerun the eval into that --out "
                                f"to redo the damaged lines") from None
            key = str(rec["id"]) + (f"#{rec['sample']}" if rec.get("sample") else "")
            out["sprint" if rec["mode"] in SPRINT_MODES else "rft"][key] = rec
    return out


def _steps(cfg: Qwen2Config, tensor: int, chip, groups: int, width: int, prefix: float, suffix: float) -> float:
    return decode_step(cfg, tensor, groups, width, prefix, suffix, chip.peak_flops, chip.hbm_bandwidth)["roofline_s"]


def _prefill(cfg: Qwen2Config, tensor: int, chip, tokens: int, context: int) -> float:
    return prefill_tokens(cfg, tensor, tokens, context, chip.peak_flops, chip.hbm_bandwidth)["roofline_s"]


def record_latency(rec: dict[str, Any], cfg: Qwen2Config, chip, tensor: int = 1,
                   decode_chunk: int = 16) -> dict[str, float]:
    """One record replayed through the roofline (module docstring): {'latency_s', 'decode_steps',
    'prefill_s', 'decode_s'}."""
    prefill_s = _prefill(cfg, tensor, chip, rec["prompt_tokens"], 0)
    decode_s, steps = 0.0, 0
    ctx = rec["prompt_tokens"]

    def alone(n: int, ctx: int) -> float:
        return sum(_steps(cfg, tensor, chip, 1, 1, ctx + i, 0) for i in range(n))

    for st in rec["stages"]:
        n = st["planner_tokens"]
        decode_s += alone(n, ctx)
        steps += n
        ctx += n
        runs = st.get("executions") or []
        mode = st.get("executor_mode", "none")
        if runs and mode in ("shared", "serial"):
            ridden = [e["forced_tokens"] if e["forced_tokens"] <= decode_chunk else 0 for e in runs]
            prefilled = [e["forced_tokens"] - r for e, r in zip(runs, ridden)]
            if any(prefilled):
                prefill_s += _prefill(cfg, tensor, chip, sum(prefilled), ctx)
            lengths = [r + e["tokens"] for r, e in zip(ridden, runs)]
            if mode == "shared":
                for t in range(max(lengths)):
                    width = sum(n > t for n in lengths)
                    decode_s += _steps(cfg, tensor, chip, 1, width, ctx, t + sum(prefilled) / len(runs))
                steps += max(lengths)
            else:
                for n, p in zip(lengths, prefilled):
                    decode_s += sum(_steps(cfg, tensor, chip, 1, 1, ctx, p + t) for t in range(n))
                    steps += n
            prefill_s += _prefill(cfg, tensor, chip, st.get("sync_tokens", 0), ctx)
            ctx += sum(e["forced_tokens"] + e["tokens"] for e in runs)
        else:
            ctx += sum(e.get("tokens", 0) for e in runs)
    n = rec["final_tokens"]
    decode_s += alone(n, ctx)
    steps += n
    return {"latency_s": prefill_s + decode_s, "decode_s": decode_s, "prefill_s": prefill_s, "decode_steps": steps}


def predict(records: dict[str, dict[str, dict]], cfg: Qwen2Config, chip, tensor: int = 1,
            decode_chunk: int = 16) -> dict[str, Any]:
    """Per problem and in total, SPRINT's and RFT's predicted latency on `chip` under `tensor`-way
    tensor parallelism; 'ratio' = SPRINT / RFT total over the problems both have (None if none)."""
    per: dict[str, dict[str, dict]] = {}
    total: dict[str, dict] = {}
    for label, recs in records.items():
        if not recs:
            continue
        per[label] = {k: record_latency(r, cfg, chip, tensor, decode_chunk) for k, r in recs.items()}
        total[label] = {"problems": len(recs), "latency_s": sum(v["latency_s"] for v in per[label].values()),
                        "decode_steps": sum(v["decode_steps"] for v in per[label].values())}
    both = sorted(set(per.get("sprint", {})) & set(per.get("rft", {})))
    ratio = None
    if both:
        ratio = (sum(per["sprint"][k]["latency_s"] for k in both)
                 / sum(per["rft"][k]["latency_s"] for k in both))
    return {"chip": chip.name, "tensor": tensor, "per_problem": per, "total": total, "paired_problems": len(both),
            "ratio": ratio}
