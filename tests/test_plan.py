"""`sprint-jax plan train`: the train step compiled for TPU slices by XLA's TPU compiler from this
CPU host (libtpu's compile-only topologies), its per-chip memory against the planner's estimate,
and the one-line refusal of a step that does not fit.

Toy models with head_dim 128 (the TPU flash kernel's lane width) and two layers keep each TPU
compile to seconds. The compiling tests need libtpu (the project's [tpu] extra) and skip without
it; run them with JAX_PLATFORMS=cpu so JAX does not probe for a local TPU first.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from sprint_jax.cli import main
from sprint_jax.errors import UserError
from sprint_jax.model.config import Qwen2Config
from sprint_jax.plan import chips, estimate
from sprint_jax.plan import train as plan_train

# Compiles by XLA's TPU compiler: tens of seconds each on an idle host (slow), and only with libtpu.
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="compiling for TPU needs libtpu (pip install -e '.[tpu]')")
compiles = pytest.mark.slow

# Two toy sizes of one layer and 512-token rows, whose weights and vocabulary projection (2 and
# 9 GB of fp32 state over 4 chips) keep the step's temporaries in GiBs: the TPU compiler places up
# to ~100 MiB of temporaries in on-chip VMEM, which memory_analysis() does not count, so a smaller
# step reads low. The small one is narrow with a wide vocabulary (its bytes are the vocabulary's):
# XLA's TPU compile time grows with the layers' width (this one: ~60 s; 2048 wide: ~125 s).
SMALL = {"model_type": "qwen2", "vocab_size": 262144, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128,
         "max_position_embeddings": 8192}
LARGER = {**SMALL, "vocab_size": 131072, "hidden_size": 3072, "intermediate_size": 8192,
          "num_attention_heads": 24, "num_key_value_heads": 8}
STEP = ("--batch", "8", "--seq-len", "512", "--loss-chunk", "256")
# The layouts' kernels at a toy width (hidden 256, two heads of the kernels' 128 lanes, 1024
# tokens of vocabulary) and the same 512-token rows, so the same block sizes: a TPU compile of
# seconds. Which Mosaic kernels lower does not depend on the width; the memory figures that do
# are the estimate test's, at SMALL and LARGER.
TOY = {**SMALL, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
       "num_key_value_heads": 1}
# A vocabulary of 2^20 x 2048 (embedding and projection: 4.3G parameters), whose fp32 weights,
# AdamW moments and gradients (69 GB) cannot fit four 16 GiB v5e chips.
HUGE_VOCAB = {**SMALL, "vocab_size": 2 ** 20, "hidden_size": 2048, "intermediate_size": 5632,
              "num_attention_heads": 16, "num_key_value_heads": 4}


def _config(d: dict) -> Qwen2Config:
    return Qwen2Config(**{k: v for k, v in d.items()}, dtype="bfloat16")


def _model_file(tmp_path, d: dict, name: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


def _plan(tmp_path, model: dict, *args: str, name: str = "m") -> tuple[int, list[dict] | None]:
    out = tmp_path / f"{name}-rows.json"
    rc = main(["plan", "train", "--model", _model_file(tmp_path, model, name), *args, "--json", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else None


# ---------------------------------------------------------------------------------------------
# Names, meshes and the planner's arithmetic (no compiler)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, name, n, booking", [
    ("v5p:2x2x2", "v5p:2x2x2", 8, "v5p-16"), ("v5p-16", "v5p:2x2x2", 8, "v5p-16"),
    ("v5p-8", "v5p:2x2x1", 4, "v5p-8"), ("v5litepod-8", "v5e:2x4", 8, "v5litepod-8"),
    ("v5e:2x2", "v5e:2x2", 4, "v5litepod-4"), ("v6e-8", "v6e:2x4", 8, "v6e-8"),
    ("v5p-128", "v5p:4x4x4", 64, "v5p-128")])
def test_slice_names_count_tensorcores_for_v5p_and_chips_for_v5e_v6e(text, name, n, booking):
    s = chips.parse_slice(text)
    assert (s.name, s.chips, s.booking) == (name, n, booking)


@pytest.mark.parametrize("text, words", [
    ("v5e:1x1", "4-chip host"), ("v5p-6", "no slice shape"), ("v5p-7", "whole number of chips"),
    ("v4-8", "v4 is not planned"), ("v9:2x2", "unknown TPU generation"), ("tpu", "write a libtpu topology"),
    ("v5p:2x2x2x2", "3-D grids")])
def test_bad_slice_names_are_one_clear_error(text, words):
    with pytest.raises(UserError, match=words):
        chips.parse_slice(text)


def test_mesh_flag():
    assert plan_train.parse_mesh("fsdp=8,tensor=1") == {"data": 1, "fsdp": 8, "tensor": 1}
    assert plan_train.resolve_mesh(plan_train.parse_mesh("tensor=2"), 8, "x") == (1, 4, 2)
    for bad in ("fsdp", "pipeline=2", "fsdp=two", "fsdp=-1,tensor=-1", "fsdp=0"):
        with pytest.raises(UserError, match="--mesh"):
            plan_train.parse_mesh(bad)
    with pytest.raises(UserError, match="uses 4 chips but v5e:2x4 has 8"):
        plan_train.resolve_mesh(plan_train.parse_mesh("fsdp=2,tensor=2"), 8, "v5e:2x4")


def test_estimate_shards_the_state_exactly():
    """Weights and AdamW moments: fp32 per chip = the model's parameters split over the mesh by the
    rules table (fsdp splits the model width; norm scales and q/k/v biases have none and stay whole)."""
    from sprint_jax.model.qwen2 import param_count

    cfg = _config(SMALL)
    one = estimate.memory_estimate(estimate.StepShape(cfg, 8, 256, mesh=(1, 1, 1)))
    four = estimate.memory_estimate(estimate.StepShape(cfg, 8, 256, mesh=(1, 4, 1)))
    assert one["params"] == 4 * param_count(cfg) and one["adam"] == 2 * one["params"]
    c, d = cfg.num_hidden_layers, cfg.head_dim
    whole = 4 * ((2 * c + 1) * cfg.hidden_size + c * d * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads))
    assert four["params"] == (one["params"] - whole) / 4 + whole


def test_flops_are_the_bench_formula_and_remat_adds_a_forward():
    from sprint_jax.bench.train import train_flops_per_step

    cfg = _config(LARGER)
    s = estimate.StepShape(cfg, 8, 2048, remat="full", loss_chunk=0)
    assert estimate.model_flops(s) == train_flops_per_step(cfg, 8, 2048)
    none = dataclasses.replace(s, remat="none")
    assert estimate.hardware_flops(none) == estimate.model_flops(none)
    c = cfg
    heads = 2 * c.num_attention_heads + 2 * c.num_key_value_heads
    layer_weights = c.num_hidden_layers * c.hidden_size * (c.head_dim * heads + 3 * c.intermediate_size)
    attention_fwd = 2 * c.num_hidden_layers * 8 * 2048 ** 2 * c.num_attention_heads * c.head_dim
    assert estimate.hardware_flops(s) - estimate.model_flops(s) == 2 * layer_weights * 8 * 2048 + attention_fwd
    r = estimate.roofline(s, 197e12, 819e9)
    assert r["roofline_s"] == max(r["compute_s"], r["memory_s"]) and 0 < r["mfu_bound"] <= 1


def test_a_kernel_that_fails_to_lower_is_named_with_its_blocks_and_shapes():
    from sprint_jax.plan.compile import KernelCall, kernel_error

    calls = [KernelCall("flash_span_fwd", "block_q=512, block_k=512", "q [1, 8192, 28, 128] bfloat16, k/v "
                        "[1, 8192, 4, 128]")]
    line = kernel_error(RuntimeError("Mosaic failed to compile TPU kernel: bad block\nmore"), calls)
    assert line == ("Mosaic kernel flash_span_fwd (block_q=512, block_k=512; q [1, 8192, 28, 128] bfloat16, "
                    "k/v [1, 8192, 4, 128]) failed to lower: Mosaic failed to compile TPU kernel: bad block")
    assert kernel_error(ValueError("unrelated"), calls) is None


def test_the_compilers_out_of_memory_verdicts_are_read():
    from sprint_jax.plan.compile import parse_oom

    g = 2 ** 30
    assert parse_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                     "temporaries (23.13G) exceeds available HBM (15.75G).") == {"temp": 23.13 * g, "limit": 15.75 * g}
    assert parse_oom("Used 113.20G of 95.74G hbm. Exceeded hbm capacity by 17.46G.") == {
        "used": 113.2 * g, "limit": 95.74 * g, "over": 17.46 * g}
    assert parse_oom("INVALID_ARGUMENT: something else") is None


# ---------------------------------------------------------------------------------------------
# The TPU compiler
# ---------------------------------------------------------------------------------------------
KERNELS = {"flat": {"splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"},
           "trie": {"flash_span_fwd", "flash_span_dq", "flash_span_dkdv"},
           "merge": {"flash_span_fwd", "flash_span_dq", "flash_span_dkdv"}}


@needs_libtpu
@compiles
# flat at SMALL: the step test_estimate_is_within_20_percent_of_the_compiler[small-fsdp] plans,
# compiled once for both (compile_step keeps its result); trie and merge at the toy width
@pytest.mark.parametrize("layout, model", [("flat", SMALL), ("trie", TOY), ("merge", TOY)], ids=["flat", "trie", "merge"])
def test_each_layout_compiles_for_v5e_with_its_mosaic_kernels(layout, model):
    """flat runs splash attention, trie and merge our Mosaic kernel; each kernel (forward, twice
    under full remat, and both backward kernels, per layer) is a tpu_custom_call of the HLO."""
    from sprint_jax.plan.compile import compile_step

    shape = estimate.StepShape(_config(model), 8, 512, 1, (1, 4, 1), "full", 256, layout)
    r = compile_step(shape, chips.parse_slice("v5e:2x2"))
    assert r.compiled, r.error
    assert set(r.kernels) == KERNELS[layout]
    assert r.custom_calls == len(r.kernels) == 4 * model["num_hidden_layers"]
    assert r.kernels.count(sorted(k for k in KERNELS[layout] if k.endswith("fwd"))[0]) == 2 * model["num_hidden_layers"]
    assert 0 < r.memory["total"] < chips.CHIPS["v5e"].hbm_bytes


ROW_KEYS = {"program", "topology", "mesh", "compiled", "per_chip_bytes", "hbm_bytes", "estimate_bytes", "flops",
            "hbm_traffic_bytes", "roofline_s", "headroom", "mfu_bound", "tokens_per_s", "compile_s"}


@needs_libtpu
@compiles
# Two sizes and two meshes in two compiles: the small model under fsdp alone (the flat layout's
# compile above, reused in this process) and the larger one with tensor parallelism.
@pytest.mark.parametrize("model, mesh", [(SMALL, "fsdp=4"), (LARGER, "fsdp=2,tensor=2")],
                         ids=["small-fsdp", "larger-fsdp-tensor"])
def test_estimate_is_within_20_percent_of_the_compiler(tmp_path, capsys, model, mesh):
    rc, rows = _plan(tmp_path, model, *STEP, "--mesh", mesh, "--topology", "v5e:2x2")
    assert rc == 0
    (row,) = rows
    assert ROW_KEYS <= set(row) and set(row["per_chip_bytes"]) == {"arguments", "outputs", "temp", "alias", "total"}
    mem = row["per_chip_bytes"]
    assert mem["total"] == mem["arguments"] + mem["outputs"] - mem["alias"] + mem["temp"]
    assert row["compiled"] and row["topology"] == "v5e:2x2" and row["hbm_bytes"] == 16 * 2 ** 30
    assert row["estimate_bytes"] == pytest.approx(mem["total"], rel=0.2)
    out = capsys.readouterr()
    assert "v5e:2x2 (v5litepod-4)" in out.out and "plan: compiling" in out.err


@needs_libtpu
@compiles
def test_a_step_that_does_not_fit_exits_2_with_one_line(tmp_path, capsys):
    rc, rows = _plan(tmp_path, HUGE_VOCAB, "--batch", "4", "--seq-len", "256", "--loss-chunk", "0",
                     "--topology", "v5e:2x2", name="huge")
    assert rc == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("sprint-jax plan: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    line = errors[0]
    assert "on v5e:2x2" in line and "GiB of temporaries" in line and "over by" in line
    assert "way out: --topology v5e:2x4" in line
    assert rows is not None and rows[0]["fits"] is False


@needs_libtpu
@compiles
def test_search_finds_a_slice_the_compiler_accepts(tmp_path, capsys):
    """The huge vocabulary does not fit one 4-chip v5e host; the search names a larger slice and
    the compiler agrees."""
    rc, rows = _plan(tmp_path, HUGE_VOCAB, "--batch", "16", "--seq-len", "256", "--loss-chunk", "0",
                     "--topology", "v5e:4x4", "--search", name="huge")
    assert rc == 0, capsys.readouterr().err
    accepted = rows[-1]
    assert accepted["compiled"] and accepted["fits"] and accepted["search"]
    assert chips.parse_slice(accepted["topology"]).chips > 4
    assert "search: v5e:2x2" in capsys.readouterr().err        # the 4-chip host was ruled out first
