"""`sprint-jax bench serve` at the smallest settings (two concurrencies, two problems, one
capacity): the rows it writes follow the flags, every concurrency does the same work, a fork's
bytes read off the KV pool equal prefix + suffixes + the copies of the partly filled page (counted
by hand), and the latency model's counts follow the flags. `--prefix`: the cache hits of each
request equal the hand count.
No timing assertion (benchmarks, never timed tests)."""
from __future__ import annotations

import json

import pytest

from sprint_jax.bench.serve import _c1_for, latency_ratio
from sprint_jax.cli import main

P, E, F, K, S = 6, 5, 3, 3, 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "serve.json"
    assert main(["bench", "serve", "--concurrency", "1,2", "--problems", "2", "--repeats", "1",
                 "--prompt-len", "40", "--planner-tokens", str(P), "--executors", str(K), "--executor-tokens", str(E),
                 "--final-tokens", str(F), "--decode-chunk", "4", "--used", "24", "--capacities", "64",
                 "--model-context", "16", "--sequential-tokens", str(S), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_throughput_rows_run_the_same_work_at_every_concurrency(report):
    assert report["same_work"] is True               # identical generations at concurrency 1 and 2
    rows = report["throughput"]
    assert [r["path"] for r in rows] == ["batched@1", "batched@2"]
    for r in rows:
        assert r["problems"] == 2 and len(r["samples_s"]) == 1 and r["tokens_per_s"] > 0
    assert [(r["capacity"], r["used"]) for r in report["capacity"]] == [(64, 24)]
    assert set(report["capacity"][0]) == {"capacity", "used", "batched_step_ms", "batched_samples_s"}


def test_fork_bytes_are_the_prefix_once_plus_each_childs_suffix(report):
    fb = report["fork_bytes"]
    # the prompt's 40 tokens less the pending last: 39, two full pages of 16 (shared) and 7 in a
    # partly filled page, which each child copies before writing its suffix (copy on write)
    assert fb["prefix_slots"] == 39 and fb["page_size"] == 16 and fb["copied_page_slots"] == [7] * K
    per = fb["bytes_per_slot"]
    assert fb["exact"] and fb["measured_bytes"] == fb["expected_bytes"] == per * (39 + K * (4 + E) + K * 7)
    assert fb["parent_slots"] == 39 and fb["child_slots"] == [7 + 4 + E] * K
    assert len(fb["child_slots"]) == K and fb["suffix_slots"] == [4 + E] * K
    assert fb["measured_bytes"] < fb["copied_prefix_bytes"]


def test_latency_model_counts_follow_the_flags(report):
    lm = report["latency_model"]
    assert lm["counts"] == {"one_row_steps": P + F, "fork_steps": 4 + E, "sequential_steps": S}
    assert lm["children"] == K and lm["fork_rows"] == K and lm["context"] == 16
    for label in ("one_row", "fork"):        # repeats + 2 timed calls of each length, 8 and 64 tokens
        samples = lm[f"{label}_samples_s"]
        assert sorted(samples) == ["64", "8"] and all(len(v) == 3 for v in samples.values())
        assert lm[f"{label}_step_ms"] > 0    # the bench refuses a step <= 0
    assert set(lm["matmul_ms"]) == {"1", str(K)}


def test_threshold_algebra():
    # ratio(c1) = (a c1 + b (c1 + x)) / (n c1) falls as c1 grows; _c1_for gives where it meets the target
    a, b, n, x = 41, 18, 86, 0.03
    c = _c1_for(0.75, a, b, n, x)
    assert latency_ratio(a, b, n, c, c + x) == pytest.approx(0.75)
    assert latency_ratio(a, b, n, 2 * c, 2 * c + x) < 0.75 < latency_ratio(a, b, n, c / 2, c / 2 + x)
    assert _c1_for(0.75, 50, 30, 100, x) is None      # 80 steps of 100: 0.8 even with free rows
    assert _c1_for(0.75, a, b, n, 0.0) == 0.0          # free extra rows: any one-row cost meets it


@pytest.mark.parametrize("flags", [["--concurrency", "1,x"], ["--max-tokens", "0"], ["--repeats", "0"]])
def test_http_bad_flags_are_one_line_and_exit_2(flags, capsys):
    assert main(["bench", "serve", "--http", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("must be >= 1" in err or "comma-separated integers" in err), err


def test_prefix_bench_hits_the_system_prompts_whole_pages(tmp_path):
    """`bench serve --prefix`, tiny: a 43-token system prompt in pages of 8, two hits after each
    miss: every miss takes 0 tokens from the cache and every hit 40 (5 whole pages; the user parts
    differ in their first token), in process and through the server; one TTFT sample per request."""
    out = tmp_path / "prefix.json"
    assert main(["bench", "serve", "--prefix", "--preset", "bench-tiny", "--system-tokens", "43", "--user-tokens",
                 "4", "--hits", "2", "--repeats", "2", "--page-size", "8", "--decode-chunk", "4",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["expected_hit_tokens"] == 40 and [r["path"] for r in res["rows"]] == ["inproc", "http"]
    for r in res["rows"]:
        assert r["hit_tokens"] == {"miss": [0, 0], "hit": [40] * 4} and r["hits_as_expected"]
        assert len(r["samples_ms"]["miss"]) == 2 and len(r["samples_ms"]["hit"]) == 4
        assert 0 < r["miss_best_ms"] <= r["miss_median_ms"] and 0 < r["hit_best_ms"] <= r["hit_median_ms"]


@pytest.mark.parametrize("flags", [["--http"], ["--hits", "0"], ["--system-tokens", "0"]])
def test_prefix_bad_flags_are_one_line_and_exit_2(flags, capsys):
    assert main(["bench", "serve", "--prefix", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("must be >= 1" in err or "pick one" in err), err
