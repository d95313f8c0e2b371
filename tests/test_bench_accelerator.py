"""`sprint-jax bench accelerator --tiny` on the CPU: every section's figures are what its measured
times and hand-counted bytes and FLOPs give (recomputed here from the tiny shape, not from the
module's helpers), the published peaks are used only for a device kind the chip tables know, and
bad flags are one line and exit 2. No timing assertion (benchmarks, never timed tests)."""
from __future__ import annotations

import json
import statistics

import pytest

from sprint_jax.bench import accelerator as acc
from sprint_jax.cli import main

# The tiny shape (acc.TINY_MODEL, float32): V 256, E 64, SwiGLU 128, 2 layers, 4 heads / 2 KV heads
# of 16; untied lm_head; qwen2 has q/k/v biases. Per layer: q 64x64 + 64, k and v 64x32 + 32 each,
# o 64x64, gate / up / down 64x128 each, two norms of 64.
LAYER = 64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
WEIGHTS = 2 * LAYER + 64 + 64 * 256            # layers, the final norm, lm_head (the embedding apart)
KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4              # K and V x layers x KV heads x head_dim x fp32
CONTEXT, NEW = 24, 8
# a made-up chip, so that the ratios to a peak are computed (a CPU has none)
FAKE_CHIP = {"name": "fake", "peak_flops": 1e12, "hbm_bandwidth": 1e11, "source": "test"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("accel") / "tiny.json"
    mp = pytest.MonkeyPatch()
    mp.setattr(acc, "chip_of", lambda kind: FAKE_CHIP)
    try:
        rc = main(["bench", "accelerator", "--tiny", "--repeats", "2", "--out", str(out)])
    finally:
        mp.undo()
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_fields_and_device(run):
    assert run["mode"] == "tiny" and run["device"]["platform"] == "cpu" and run["chip"] == FAKE_CHIP
    assert {"decode", "fork", "train", "attention", "replay"} <= set(run)
    assert run["model"]["hidden_size"] == 64 and run["model"]["dtype"] == "float32"


@pytest.mark.slow
def test_decode_bandwidth_is_hand_counted_bytes_over_the_measured_step(run):
    assert [d["rows"] for d in run["decode"]] == [1, 8, 32]
    for d in run["decode"]:
        r = d["rows"]
        assert (d["steps_n"], d["steps_1"]) == (NEW, 1)               # exactly N and 1 decode steps
        assert d["wall_n_s"] == min(d["wall_n_samples"]) and d["wall_1_s"] == min(d["wall_1_samples"])
        step = (d["wall_n_s"] - d["wall_1_s"]) / (NEW - 1)
        assert d["step_s"] == pytest.approx(step, rel=1e-12)
        # every weight once, the embedding at the rows' ids only; each row's KV at the mean position
        assert d["weight_bytes"] == 4 * (WEIGHTS + r * 64)
        assert d["kv_bytes"] == r * (CONTEXT + NEW / 2) * KV_PER_TOKEN
        assert d["bytes_per_s"] == pytest.approx((d["weight_bytes"] + d["kv_bytes"]) / step, rel=1e-12)
        assert d["fraction_of_peak_bandwidth"] == pytest.approx(d["bytes_per_s"] / 1e11, rel=1e-12)
        assert d["tokens_per_s"] == pytest.approx(r / step, rel=1e-12)


@pytest.mark.slow
def test_fork_step_is_against_the_one_row_step(run):
    one = run["decode"][0]
    assert [f["executors"] for f in run["fork"]] == [2, 4]
    for f in run["fork"]:
        k = f["executors"]
        assert (f["steps_n"], f["steps_1"]) == (NEW, 1)
        step = (f["wall_n_s"] - f["wall_1_s"]) / (NEW - 1)
        assert f["step_s"] == pytest.approx(step, rel=1e-12)
        assert f["one_row_step_s"] == one["step_s"]
        assert f["step_vs_one_row"] == pytest.approx(step / one["step_s"], rel=1e-12)
        # the prefix KV once, each child its forced token and on average NEW / 2 generated ones
        assert f["kv_bytes"] == (CONTEXT + k * (1 + NEW / 2)) * KV_PER_TOKEN
        assert f["bytes_per_s"] == pytest.approx((4 * (WEIGHTS + k * 64) + f["kv_bytes"]) / step, rel=1e-12)


@pytest.mark.slow
def test_train_mfu_is_hand_counted_flops_over_the_median_step(run):
    t = run["train"]
    assert (t["layers"], t["batch"], t["seq_len"]) == (2, 2, 64)
    matmul = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 64 * 256          # no biases, no norms
    flops = 6 * matmul * 2 * 64 + 6 * 2 * 2 * 64 ** 2 * 4 * 16                   # + causal attention
    assert t["flops"] == flops
    assert t["step_s"] == statistics.median(t["step_samples"])
    assert t["flops_per_s"] == pytest.approx(flops / t["step_s"], rel=1e-12)
    assert t["mfu"] == pytest.approx(flops / t["step_s"] / 1e12, rel=1e-12)
    assert 0 < t["loss"] < 10


@pytest.mark.slow
def test_attention_rows(run):
    (a,) = run["attention"]
    assert a["interpret"] and (a["branches"], a["prefix_len"], a["suffix_len"]) == (4, 40, 8)
    kv_row = 2 * 2 * 16 * 4
    assert a["bytes"] == 40 * kv_row + 4 * 8 * kv_row + 4 * 4 * 16 * 4     # prefix once, suffixes, q
    assert a["xla_over_pallas"] == pytest.approx(a["xla_s"] / a["pallas_s"], rel=1e-12)
    assert a["pallas_bytes_per_s"] == pytest.approx(a["bytes"] / a["pallas_s"], rel=1e-9)
    assert a["max_abs_diff"] < 1e-5


@pytest.mark.slow
def test_replay_schedules_and_ratios(run):
    r = run["replay"]
    sprint, rft = r["records"]["sprint"], r["records"]["rft"]
    (stage,) = sprint["stages"]
    assert stage["planner_tokens"] == 4 and len(stage["executions"]) == 3 and stage["join"] == "merge"
    # RFT decodes every token SPRINT decodes, in one call: planner 4 + 3 x (2 forced + 6) + final 4
    assert rft["final_tokens"] == 4 + 3 * (2 + 6) + 4 and rft["prompt_tokens"] == sprint["prompt_tokens"]
    # the latency model's steps: SPRINT's planner, the 8-step-wide fork (forced tokens ride it), final
    assert r["decode_steps"] == {"sprint": 4 + 8 + 4, "rft": 32}
    for k in ("sprint", "rft"):
        assert r["measured_s"][k] == min(r["samples_s"][k]) and len(r["samples_s"][k]) == 2
        assert r["predicted_over_measured"][k] == pytest.approx(r["predicted_s"][k] / r["measured_s"][k])
    assert r["measured_ratio"] == pytest.approx(r["measured_s"]["sprint"] / r["measured_s"]["rft"])
    assert r["predicted_ratio"] == pytest.approx(r["predicted_s"]["sprint"] / r["predicted_s"]["rft"])
    assert r["model_chip"] == {"name": "fake", "peak_flops": 1e12, "hbm_bandwidth": 1e11} and r["probe"] is None


@pytest.mark.slow
def test_an_unknown_device_gets_no_ratio_and_its_own_rates(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["bench", "accelerator", "--tiny", "--sections", "attention", "--repeats", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["chip"] is None and set(r) >= {"attention"} and "decode" not in r
    assert "no chip figures for this device kind" in capsys.readouterr().out


def test_chip_figures_by_device_kind():
    from sprint_jax.plan import chips

    assert acc.chip_of("TPU v5 lite")["hbm_bandwidth"] == chips.CHIPS["v5e"].hbm_bandwidth == 819e9
    assert acc.chip_of("TPU v6 lite")["peak_flops"] == 918e12
    assert acc.chip_of("cpu") is None and acc.chip_of("NVIDIA H100 PCIe") is None
    if hasattr(chips, "GPUS"):
        h100 = acc.chip_of("NVIDIA H100 80GB HBM3")
        assert h100 is not None and h100["hbm_bandwidth"] == chips.GPUS["h100"].hbm_bandwidth


@pytest.mark.parametrize("flags, words", [
    (["--sections", "decode,bogus"], "--sections: unknown ['bogus']"),
    (["--sections", "fork"], "add decode"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_flags_are_one_line_and_exit_2(flags, words, capsys):
    assert main(["bench", "accelerator", "--tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
