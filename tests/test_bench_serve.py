"""`sprint-jax bench serve` at the smallest settings (one concurrency, one problem, one capacity),
for the latency model it prints: its counts follow the flags, its costs are the stated differences
of the calls it timed (a per-call cost may come out below 0 under load: it is a difference of
timings), and its ratios are the arithmetic the module docstring states, recomputed here by hand
from the reported costs. No timing assertion (benchmarks, never timed tests)."""
from __future__ import annotations

import json

import pytest

from sprint_jax.bench.serve import _c1_for, latency_ratio
from sprint_jax.cli import main

P, E, F, K, S = 6, 5, 3, 3, 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "serve.json"
    assert main(["bench", "serve", "--concurrency", "1", "--problems", "1", "--repeats", "1", "--no-single",
                 "--prompt-len", "8", "--planner-tokens", str(P), "--executors", str(K), "--executor-tokens", str(E),
                 "--final-tokens", str(F), "--decode-chunk", "4", "--used", "24", "--capacities", "64", "--model-context", "16",
                 "--sequential-tokens", str(S), "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_latency_model_counts_and_costs(report):
    lm = report["latency_model"]
    assert lm["counts"] == {"one_row_steps": P + F, "fork_steps": 4 + E, "sequential_steps": S}
    assert lm["children"] == K and lm["fork_rows"] == K and lm["context"] == 16
    for label in ("one_row", "fork"):        # repeats + 2 timed calls of each length, 8 and 64 tokens
        samples = lm[f"{label}_samples_s"]
        assert sorted(samples) == ["64", "8"]
        assert all(len(v) == 3 and all(x > 0 for x in v) for v in samples.values())
        # the step is the difference of the best calls per token (the bench refuses a step <= 0), the
        # per-call cost the short call minus its steps: a difference of timings, so under load it may
        # come out below 0, and only its arithmetic is checked here
        step = (min(samples["64"]) - min(samples["8"])) / (64 - 8)
        assert lm[f"{label}_step_ms"] == pytest.approx(1000 * step) and step > 0
        assert lm[f"{label}_call_ms"] == pytest.approx(1000 * (min(samples["8"]) - 8 * step))
    assert set(lm["matmul_ms"]) == {"1", str(K)} and all(v > 0 for v in lm["matmul_ms"].values())


def test_latency_model_ratios_are_the_stated_arithmetic(report):
    lm = report["latency_model"]
    c1, ck = lm["one_row_step_ms"], lm["fork_step_ms"]
    extra = max(lm["matmul_ms"][str(K)] - lm["matmul_ms"]["1"], 0.0)
    a, b = P + F, 4 + E
    assert lm["ratio_engine"] == pytest.approx((a * c1 + b * ck) / (S * c1))
    assert lm["ratio_compute_floor"] == pytest.approx((a * c1 + b * (c1 + extra)) / (S * c1))
    assert lm["ratio_no_fork_cost"] == pytest.approx((a + b) / S)
    need = lm["one_row_step_for_target_ms"]
    if need is not None:                     # at that one-row cost the floor ratio is exactly 0.75
        assert (a * need + b * (need + extra)) / (S * need) == pytest.approx(0.75)


def test_threshold_algebra():
    # ratio(c1) = (a c1 + b (c1 + x)) / (n c1) falls as c1 grows; _c1_for gives where it meets the target
    a, b, n, x = 41, 18, 86, 0.03
    c = _c1_for(0.75, a, b, n, x)
    assert latency_ratio(a, b, n, c, c + x) == pytest.approx(0.75)
    assert latency_ratio(a, b, n, 2 * c, 2 * c + x) < 0.75 < latency_ratio(a, b, n, c / 2, c / 2 + x)
    assert _c1_for(0.75, 50, 30, 100, x) is None      # 80 steps of 100: 0.8 even with free rows
    assert _c1_for(0.75, a, b, n, 0.0) == 0.0          # free extra rows: any one-row cost meets it
