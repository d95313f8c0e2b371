"""`sprint-jax bench train`'s matmul floor: the step's matmuls listed, each timed on XLA and torch.

What is checked (timings themselves are never asserted: the bench prints them):
- `step_gemms` lists the step's matmuls outside attention: their FLOPs sum to the matmul part of
  `train_flops_per_step` (6 x matmul params x tokens), for the untied Qwen2 and the tied Qwen3 preset
  (Qwen3: head_dim != hidden / heads, so q / o are not square);
- `time_step_gemms` runs each product on both libraries on the same data, and the two results agree
  (each library is the other's independent reference: a wrong transpose in either form would not);
- the whole bench on the tiny preset prints the floor, and its per-step figures are the sums and
  differences they say they are.
"""
from __future__ import annotations

import argparse
import json

import pytest

from sprint_jax.bench import train as bench_train
from sprint_jax.model.config import resolve_model_config


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_step_gemms_sum_to_the_steps_matmul_flops(preset):
    cfg = resolve_model_config(preset)
    b, t = 3, 40
    gemms = bench_train.step_gemms(cfg, b * t)
    attention_flops = 6.0 * cfg.num_hidden_layers * b * t ** 2 * cfg.num_attention_heads * cfg.head_dim
    matmul_flops = bench_train.train_flops_per_step(cfg, b, t) - attention_flops
    assert sum(g["count"] * g["flops"] for g in gemms) == pytest.approx(matmul_flops, rel=1e-12)
    # every projection appears as forward, input grad and weight grad with the same count
    by_shape = {}
    for g in gemms:
        by_shape.setdefault((g["in"], g["out"]), {})[g["product"]] = g["count"]
    assert all(set(c) == {"forward", "input grad", "weight grad"} and len(set(c.values())) == 1
               for c in by_shape.values())
    assert sum(next(iter(c.values())) for c in by_shape.values()) == 7 * cfg.num_hidden_layers + 1


def test_both_libraries_compute_the_same_products():
    cfg = resolve_model_config("tiny")
    timed = bench_train.time_step_gemms(bench_train.step_gemms(cfg, 37), reps=2, rounds=2)
    assert len(timed) == 3 * 5          # 72->72 (q, o), 72->24 (k, v), 72->200, 200->72, 72->307
    for g in timed:
        assert g["max_rel_diff"] < 1e-5, g
        assert g["xla_s"] > 0 and g["torch_s"] > 0


def test_bench_train_prints_the_floor(capsys):
    p = argparse.ArgumentParser()
    bench_train.add_train_arguments(p)
    args = p.parse_args(["--model", "tiny", "--batch", "2", "--seq-len", "32", "--steps", "2", "--no-dense"])
    assert bench_train.run_train_bench(args) == 0
    out = capsys.readouterr().out
    assert "matmul floor" in out and "per step: XLA" in out
    r = json.loads(out.strip().splitlines()[-1])
    f = r["gemm_floor"]
    assert f["xla_gemm_s"] == pytest.approx(sum(g["count"] * g["xla_s"] for g in r["gemms"]))
    assert f["torch_gemm_s"] == pytest.approx(sum(g["count"] * g["torch_s"] for g in r["gemms"]))
    assert f["ours_rest_s"] == pytest.approx(r["jax"]["step_s"] - f["xla_gemm_s"])
    assert f["torch_rest_s"] == pytest.approx(r["torch"]["step_s"] - f["torch_gemm_s"])
    assert f["rest_budget_s"] == pytest.approx(r["torch"]["step_s"] - f["xla_gemm_s"])
    assert f["gemm_flops"] == pytest.approx(
        bench_train.train_flops_per_step(resolve_model_config("tiny"), 2, 32)
        - 6.0 * 3 * 2 * 32 ** 2 * 6 * 12)
