"""`sprint-jax plan engine --lengths`: how many SPRINT runs of a length distribution one slice holds,
the paged engine against the slot engine. The pages a run holds, the Monte Carlo overflow
probability and the search for the largest N against hand computations on tiny distributions; the
synthetic distribution against its documented parameters; eval records read as runs; bad input
one line and exit 2; the 7B figures of docs/benchmarks.md (no compiler: --programs none)."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from sprint_jax.cli import main
from sprint_jax.errors import UserError
from sprint_jax.model.config import resolve_model_config
from sprint_jax.plan import chips
from sprint_jax.plan.compile import cuda_plugin_available
from sprint_jax.plan import engine as pe
from sprint_jax.plan import fit as pf

GIB = 2 ** 30


def test_the_pages_a_run_holds_by_hand():
    """Page 16, decode chunk 4. A prompt of 20 tokens, a stage of 10 planner tokens and executors
    of 5 and 40 tokens, a final answer of 7. At the fork the parent holds 29 tokens (the 30th
    pending): its partly filled page holds 13, so each executor's own pages hold 13 + 1 (the
    pending token) + its tokens + a chunk: 23 tokens = 2 pages and 58 = 4. At the join the
    parent holds 30 + 45 = 75 tokens + a chunk: 5 pages; with the executors' 6: 11. The final
    context, 82 + 4 tokens: 6 pages. The peak is 11 pages."""
    run = pf.RunLengths(20, ((10, (5, 40)),), 7)
    assert run.trace == 82 and run.widest == 2 and run.longest_branch == 40
    assert pf.run_pages(run, 16, 4) == 11
    # no executors: the trace alone, ceil((20 + 10 + 7 + 4) / 16) = 3 pages
    assert pf.run_pages(pf.RunLengths(20, ((10, ()),), 7), 16, 4) == 3
    # a long final answer outgrows the join: ceil((82 + 200 + 4) / 16) = 18
    assert pf.run_pages(pf.RunLengths(20, ((10, (5, 40)),), 207), 16, 4) == 18


def test_exceed_probability_against_the_binomial():
    """Runs of 10 or 20 pages, each with probability 1/2. Six runs on one shard of 100 pages
    overflow when 5 or 6 are long (60 + 10 x long > 100): (6 + 1) / 64. Five runs never do (at
    most 100). Over two shards of 50 pages, three runs each: a shard overflows only when its three
    are long (1/8), one of two shards: 1 - (7/8)^2 = 15/64."""
    pages = [10, 20]
    for n, parts, shard, want in ((6, 1, 100, 7 / 64), (5, 1, 100, 0.0), (6, 2, 50, 15 / 64)):
        got = pf.exceed_probability(pages, n, parts, shard, trials=40_000, seed=1)
        sd = math.sqrt(want * (1 - want) / 40_000)
        assert abs(got - want) <= 4 * sd + 1e-12, (n, parts, got, want)
    # seeded: the same answer twice
    assert pf.exceed_probability(pages, 6, 1, 100, trials=1000) == pf.exceed_probability(pages, 6, 1, 100,
                                                                                         trials=1000)
    with pytest.raises(ValueError):
        pf.exceed_probability(pages, 5, 2, 50)


def _tiny_7b(mesh=(1, 1, 1)):
    cfg = resolve_model_config("r1-distill-qwen-7b").replace(dtype="bfloat16")
    return pe.EngineShape(cfg, 1, 2, 4096, 1024, mesh, decode_chunk=16, prefill_chunk=64)


def test_the_fit_by_hand_on_a_one_length_distribution():
    """Every run 1,000 tokens of trace with one stage of two 100-token executors: a fixed page
    count p, so N runs overflow with probability 0 or 1 and the paged engine's N is the largest
    with N x p <= the pool that fits beside the weights and temporaries at N. The slot engine:
    the largest N whose programs fit by its own estimate, its slots (4,096 + 16 + 2 x (1,024 + 16)
    tokens a run, 57,344 bytes a token) beside its weights and temporaries. Both searched by hand
    over N = 1, 2, ..."""
    shape = _tiny_7b()
    run = pf.RunLengths(600, ((100, (100, 100)),), 100)
    # at the fork the parent holds 699 tokens: 11 in its last page; own pages ceil((11+1+100+16)/16)
    # = 8 each; at the join 900 + 16 tokens: 58 pages; the final 1,016: 64 -> the peak is 58 + 16
    p = pf.run_pages(run, 16, 16)
    assert p == 74
    hbm = 40 * GIB
    per_page = 57_344 * 16

    def fixed(n):
        s = dataclasses.replace(shape, concurrency=n)
        return max(pe.memory_estimate(s, k)["total"] - pe.memory_estimate(s, k)["cache"] for k in pe.KINDS)

    def slot_fits(n):
        s = dataclasses.replace(shape, concurrency=n)
        return all(pe.slot_memory_estimate(s, k)["total"] <= 0.9 * hbm for k in pe.KINDS)

    paged = max(n for n in range(1, 600) if n * p <= (0.9 * hbm - fixed(n)) // per_page)
    slot = max(n for n in range(1, 600) if slot_fits(n))
    # the slot engine's estimate holds its slots: the cache of n runs, by hand
    assert pe.slot_memory_estimate(dataclasses.replace(shape, concurrency=slot), "decode_stage")["cache"] == \
        slot * 57_344 * (4112 + 2 * 1040)
    assert 1 < slot < paged < 599
    got = pf.fit(shape, hbm, [run], trials=200)
    assert (got["paged_runs"], got["slot_runs"]) == (paged, slot)
    assert got["ratio"] == pytest.approx(paged / slot) and got["exceed_probability"] == 0.0
    assert got["pool_pages"] == (0.9 * hbm - fixed(paged)) // per_page >= paged * p


def test_the_fit_by_hand_on_a_two_length_distribution(monkeypatch):
    """Runs of 10 or 20 pages (half each) on one shard whose pool is set by hand (no weights or
    temporaries: `pool_pages_for` replaced): 100 pages hold 5 runs surely and 6 with overflow
    probability 7/64 > 1%, so N = 5; 200 pages: N runs overflow when 10 x N + 10 x long > 200,
    P(long > 20 - N) < 1% first fails at N = 12 (P(long >= 9 of 12) = 299/4096 = 7.3%; N = 11:
    P(long >= 10 of 11) = 12/2048 = 0.59%), so N = 11."""
    shape = _tiny_7b()
    short, long = pf.RunLengths(140, (), 0), pf.RunLengths(300, (), 0)
    assert (pf.run_pages(short, 16, 16), pf.run_pages(long, 16, 16)) == (10, 20)     # ceil(156/16), ceil(316/16)
    for pool, want in ((100, 5), (200, 11)):
        monkeypatch.setattr(pf, "pool_pages_for", lambda s, hbm, fill, pool=pool: pool)
        got = pf.fit(shape, 80 * GIB, [short, long], trials=20_000)
        assert got["paged_runs"] == want, (pool, got["paged_runs"])
        assert got["pool_pages"] == pool


def test_the_synthetic_distribution_is_the_documented_one():
    """Seeded (the same runs twice); every run within the capacities, 2..K executors a stage, 1..4
    stages; the traces reach the capacity but most are far shorter; the medians of the drawn token
    counts are the documented ones (the redraw of the few runs over the capacity barely moves them)."""
    runs = pf.synthetic_runs(8, 32768, 4096, n=5000)
    assert runs == pf.synthetic_runs(8, 32768, 4096, n=5000)
    assert all(r.trace <= 32768 and r.longest_branch <= 4096 for r in runs)
    assert all(1 <= len(r.stages) <= 4 and all(2 <= len(e) <= 8 for _, e in r.stages) for r in runs)
    assert all(100 <= r.prompt <= 400 for r in runs)
    traces = np.array([r.trace for r in runs])
    assert traces.max() > 0.8 * 32768 and np.median(traces) < 32768 / 3
    planner = np.array([p for r in runs for p, _ in r.stages])
    execs = np.array([e for r in runs for _, es in r.stages for e in es])
    final = np.array([r.final for r in runs])
    assert np.median(planner) == pytest.approx(200, rel=0.06)
    assert np.median(execs) == pytest.approx(500, rel=0.06)
    assert np.median(final) == pytest.approx(300, rel=0.06)
    assert np.std(np.log(execs)) == pytest.approx(0.9, rel=0.06)
    with pytest.raises(UserError, match="--executors must be >= 2"):
        pf.synthetic_runs(1, 32768, 4096)


def _records(root, recs):
    from test_bench_replay import as_written
    root.mkdir(parents=True, exist_ok=True)
    (root / "records.jsonl").write_text("".join(json.dumps(as_written(r)) + "\n" for r in recs))
    return root / "records.jsonl"


def test_runs_from_eval_records(tmp_path):
    """The SPRINT records (not the RFT ones) as runs: a shared or serial stage's executions are its
    executors (forced + generated tokens), an inline / none stage's are planner context."""
    from test_bench_replay import RFT, SPRINT
    path = _records(tmp_path / "r", SPRINT + RFT)
    runs = pf.runs_from_records(path)
    assert runs == pf.runs_from_records(tmp_path)           # the file, or a directory holding it
    assert runs == [pf.RunLengths(5, ((3, (5, 7)), (2, (3, 5))), 2), pf.RunLengths(4, ((2, (4, 5)),), 1),
                    pf.RunLengths(4, ((2, ()),), 1)]
    inline = dict(SPRINT[2], stages=[{"planner_tokens": 3, "executor_mode": "inline", "join": "reprefill",
                                      "sync_tokens": 0, "executions": [{"forced_tokens": 1, "tokens": 6}]}])
    assert pf.runs_from_records(_records(tmp_path / "i", [inline])) == [pf.RunLengths(4, ((10, ()),), 1)]


def _plan_err(capsys, *argv):
    rc = main(["plan", "engine", "--model", "r1-distill-qwen-7b", "--topology", "v5p-8", "--executors", "8",
               "--capacity", "32768", "--programs", "none", *argv])
    err = capsys.readouterr().err
    return rc, [ln for ln in err.splitlines() if not ln.startswith("plan: ")], err


def _malformed(d):
    (d / "records.jsonl").write_text("{not json\n")
    return str(d / "records.jsonl")


def _rft_only(d):
    from test_bench_replay import RFT
    return str(_records(d / "rft", RFT))


def _empty_dir(d):
    (d / "e").mkdir()
    return str(d / "e")


@pytest.mark.parametrize("make, words", [
    (lambda d: str(d / "missing"), "not a directory"),
    (_malformed, "not an eval record"),
    (_rft_only, "no SPRINT runs"),
    (_empty_dir, "no records.jsonl under it"),
])
def test_bad_lengths_are_one_line_and_exit_2(tmp_path, capsys, make, words):
    rc, lines, err = _plan_err(capsys, "--lengths", make(tmp_path))
    assert rc == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, err


def test_lengths_flags_that_do_not_go_together(tmp_path, capsys):
    for argv, words in ((["--lengths", "synthetic", "--search"], "drop --search"),
                        (["--lengths", "synthetic", "--page-size", "0"], "--page-size must be >= 1"),
                        (["--lengths", "synthetic", "--executors", "1"], "--executors must be >= 2"),
                        (["--lengths", "synthetic", "--programs", "decode"], "--programs")):
        rc, lines, err = _plan_err(capsys, *argv)
        assert rc == 2 and len(lines) == 1 and words in lines[0], (argv, err)
    from test_bench_replay import SPRINT
    wide = dict(SPRINT[0], stages=[{"planner_tokens": 3, "executor_mode": "shared", "join": "merge",
                                    "sync_tokens": 0, "executions": [{"forced_tokens": 1, "tokens": 2}] * 3}])
    rc, lines, err = _plan_err(capsys, "--lengths", str(_records(tmp_path / "w", [wide])), "--executors", "2")
    assert rc == 2 and "forks 3 executors, more than --executors 2" in lines[0], err


@pytest.mark.parametrize("topology", ["v5p-8", "h100:8"])
def test_the_7b_runs_per_chip_of_the_benchmark(tmp_path, capsys, topology):
    """docs/benchmarks.md's figures: the 7B with traces to 32k (the synthetic distribution), 8
    executors of branches to 4,096 tokens, the default prefill chunk (256), on v5p-8 and one 8 x H100 node:
    the paged engine holds at least twice the slot engine's runs, its pool pages hold the drawn
    runs but for < 1% of draws, and both engines' bytes stay within 90% of HBM by the estimate."""
    out = tmp_path / "rows.json"
    rc = main(["plan", "engine", "--model", "r1-distill-qwen-7b", "--executors", "8", "--capacity", "32768",
               "--branch-capacity", "4096", "--lengths", "synthetic", "--topology",
               topology, "--programs", "none", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    (row,) = json.loads(out.read_text())
    assert row["ratio"] >= 2 and row["exceed_probability"] < 0.01
    where = chips.parse_slices(topology)[0]
    shape = dataclasses.replace(_tiny_7b(tuple(row["mesh"].values())), executors=8, capacity=32768,
                                branch_capacity=4096, concurrency=row["paged_runs"], num_pages=row["pool_pages"],
                                prefill_chunk=256)
    assert pe.peak_estimate(shape) <= 0.9 * where.chip.hbm_bytes
    # one step of runs more and the pool's pages overflow too often (or do not fit beside)
    more = dataclasses.replace(shape, concurrency=row["paged_runs"] + shape.parts)
    shard = pf.pool_pages_for(more, where.chip.hbm_bytes, 0.9)
    runs = pf.synthetic_runs(8, 32768, 4096)
    pages = [pf.run_pages(r, 16, 16) for r in runs]
    assert pf.exceed_probability(pages, more.concurrency, more.parts, shard) >= 0.01
    for n, fits in ((row["slot_runs"], True), (row["slot_runs"] + shape.parts, False)):
        slot = dataclasses.replace(shape, concurrency=n)
        assert (max(pe.slot_memory_estimate(slot, k)["total"] for k in pe.KINDS) <= 0.9 * where.chip.hbm_bytes) == fits
    text = capsys.readouterr().out
    assert f"runs that fit {where.name}" in text and "paged / slot" in text


def test_lengths_from_records_through_the_command(tmp_path, capsys):
    """`--lengths RECORDS` reads the SPRINT runs (3, not the 2 RFT ones) and fits them (overflow
    under 1% of draws); runs of a few pages leave room for far more runs than the slot engine,
    whose every run reserves its capacities."""
    from test_bench_replay import RFT, SPRINT
    path = _records(tmp_path / "r", SPRINT + RFT)
    out = tmp_path / "rows.json"
    rc = main(["plan", "engine", "--model", "r1-distill-qwen-7b", "--executors", "8", "--capacity", "32768",
               "--branch-capacity", "4096", "--lengths", str(path), "--topology", "v5p-8", "--programs", "none",
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    (row,) = json.loads(out.read_text())
    # p1's peak: its first join, 20 tokens + a chunk in 3 pages and two executors of 2 pages each
    assert row["runs"] == 3 and row["run_pages"]["max"] == 7 and row["ratio"] > 1
    assert row["lengths"] == str(path) and row["exceed_probability"] < 0.01


needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason="compiling for GPUs needs jax-cuda12-plugin")


@needs_plugin
def test_the_programs_compile_at_the_fit(tmp_path, capsys):
    """Without --concurrency the programs are compiled at the paged engine's fit: the join copy of
    the 7B on h100:8 at 440 runs (55 a GPU) over the pool that fits, 473,560 pages of 16 tokens
    split over data=8: 59,195 pages a GPU, 57,344 bytes a token, its argument by hand."""
    out = tmp_path / "rows.json"
    rc = main(["plan", "engine", "--model", "r1-distill-qwen-7b", "--executors", "8", "--capacity", "32768",
               "--branch-capacity", "4096", "--lengths", "synthetic", "--topology",
               "h100:8", "--programs", "join_copy", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    fit_row, join = json.loads(out.read_text())
    assert (fit_row["paged_runs"], fit_row["pool_pages"]) == (440, 473_560)
    assert join["kind"] == "join_copy" and join["compiled"] and join["fits"]
    assert (join["concurrency"], join["pool_pages"]) == (440, 473_560)
    # + the copy's rows: 64 rows' two tables of 4,096 pages and two position rows of 4,112 (int32)
    assert join["per_chip_bytes"]["arguments"] - 473_560 // 8 * 16 * 57_344 == 64 * (2 * 4096 + 2 * 4112) * 4
    assert join["per_chip_bytes"]["arguments"] >= 473_560 // 8 * 16 * 57_344
