"""`sprint-jax plan engine`: the engine's own programs compiled for TPU slices from this CPU host,
the planner's memory estimate and decode roofline against independent figures, the capacity
planner, the one-line refusal of a config that does not fit, the latency predicted from eval
records, and the Pallas kernels at 7B shapes for TPU (compiled) and GPU (lowered).

Compiling tests need libtpu (the project's [tpu] extra) and are slow (tens of seconds per
program); run them with JAX_PLATFORMS=cpu.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import shutil

import pytest

from sprint_jax.cli import main
from sprint_jax.model.config import Qwen2Config, resolve_model_config
from sprint_jax.plan import chips
from sprint_jax.plan import engine as pe
from sprint_jax.plan import records as rec

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="compiling for TPU needs libtpu (pip install -e '.[tpu]')")
GIB = 2 ** 30

# Two toy sizes (2 layers, head_dim 128: the TPU kernels' lane width) whose KV cache is hundreds of
# MiB per chip, so the compiled programs' bytes are the cache and weights the estimate counts.
SMALL = {"model_type": "qwen2", "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
         "max_position_embeddings": 65536}
LARGER = {**SMALL, "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 5632,
          "num_attention_heads": 16, "num_key_value_heads": 8}

# The tests that check only that a program lowers and compiles with its kernels (no memory
# figures): SMALL's two layers and 128-lane heads at a toy width, heads and KV heads still split
# over tensor=2.
TOY = {**SMALL, "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 4,
       "num_key_value_heads": 2}
# SMALL's layers, heads and KV heads (so its KV bytes per token, which the search weighs and which
# dominate a program's bytes) at the toy width: the same cache sizes in compiles of a quarter to
# half the time (the search; every program under tensor=4).
NARROW = {**SMALL, "vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1024}


def _config(d: dict) -> Qwen2Config:
    return Qwen2Config(**d, dtype="bfloat16")


def _model_file(tmp_path, d: dict, name: str = "m") -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return str(path)


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("sprint-jax plan: error:")]


# ---------------------------------------------------------------------------------------------
# The planner's arithmetic against independent figures (no compiler)
# ---------------------------------------------------------------------------------------------
def test_7b_weights_and_kv_bytes_are_the_published_figures():
    """R1-Distill-Qwen-7B (Qwen2.5-7B's shapes): 7,615,616,512 parameters (the HF model card's
    7.62B), bf16; K and V of one token: 2 x 28 layers x 4 KV heads x 128 x 2 bytes = 57,344.
    The engine's default pool holds every run at its capacities: a run's 16,384 + 16 (a decode
    chunk) tokens in 1,025 pages of 16, and 8 executors of 16,400 tokens in 1,025 pages + the page
    a fork copies each: 9,233 pages a run."""
    cfg = resolve_model_config("r1-distill-qwen-7b").replace(dtype="bfloat16")
    shape = pe.EngineShape(cfg, 32, 8, 16384, 16384)
    assert pe.weight_bytes(shape) == 2 * 7_615_616_512
    assert pe.kv_bytes_per_token(cfg) == 57_344
    assert shape.pool_pages == 32 * 9_233 and shape.page_size == 16
    # the pool's pages of 16 tokens, the KV heads split 4 ways
    four = dataclasses.replace(shape, mesh=(1, 1, 4))
    assert pe.cache_bytes(four) == 57_344 / 4 * 32 * 9_233 * 16
    # tensor=8 > 4 KV heads: the engine copies each KV head twice, so a chip still holds a quarter
    assert pe.cache_bytes(dataclasses.replace(shape, mesh=(1, 1, 8))) == pe.cache_bytes(four)
    # data splits the pages (each run's on its shard): 4 ways
    assert pe.cache_bytes(dataclasses.replace(shape, mesh=(4, 1, 1))) == 57_344 * 8 * 9_233 * 16
    # a pool of a given size; 30 runs do not split over data=4: the pages are whole on every chip
    sized = dataclasses.replace(shape, mesh=(4, 1, 1), num_pages=100_001, concurrency=30)
    assert sized.parts == 1 and pe.cache_bytes(sized) == 57_344 * 100_001 * 16
    assert dataclasses.replace(sized, concurrency=32).pool_pages == 100_004        # whole pages a shard
    # the slot engine: 32 parents and 256 executors of 16,384 + 16 slots
    assert pe.slot_cache_bytes(four) == 57_344 / 4 * (32 + 256) * 16_400
    assert pe.slot_cache_bytes(dataclasses.replace(shape, mesh=(4, 1, 1))) == 57_344 * (8 + 64) * 16_400


def test_the_weights_a_call_holds_by_hand():
    """R1-Distill-Qwen-7B's 7,615,616,512 parameters: 204,288 in norms ((2 x 28 + 1) x 3584, no
    mesh axis), 129,024 in q/k/v biases (28 x (28 + 4 + 4) x 128, heads only) and 7,615,283,200 in
    matrices (an embed axis and a heads, KV heads, MLP or vocab axis). Per chip over tensor=2:
    3,807,641,600 + 64,512 + 204,288 = 3,807,910,400 (what a call reads); over fsdp=4 x tensor=2:
    951,910,400 + 64,512 + 204,288 = 952,179,200 (each chip's shard). The TPU compiler's decode
    calls on v5p (docs/benchmarks.md) hold the shard as their argument in the weights' dtype and,
    when fsdp splits the weights or they are not in the compute dtype, a bf16 copy of what a call
    reads as temporaries (fp32 under fsdp: the shard cast to bf16 before the gather too)."""
    cfg = resolve_model_config("r1-distill-qwen-7b").replace(dtype="bfloat16")
    read, shard = 3_807_910_400, 952_179_200
    assert 2 * (read - 204_288 - 64_512) + 204_288 + 129_024 == 7_615_616_512
    assert 8 * (shard - 204_288 - 64_512) + 204_288 + 129_024 == 7_615_616_512

    def weights(mesh, dtype=None, kind="decode_stage"):
        e = pe.memory_estimate(pe.EngineShape(cfg, 128, 8, 16384, 2080, mesh, weights_dtype=dtype), kind)
        return {k: e[k] for k in ("weights", "gathered_weights", "cast_shard") if k in e}

    assert weights((4, 1, 2)) == {"weights": 2 * read}                       # bf16, no fsdp: read in place
    assert weights((1, 4, 2)) == {"weights": 2 * shard, "gathered_weights": 2 * read}
    assert weights((4, 1, 2), "float32") == {"weights": 4 * read, "gathered_weights": 2 * read}
    assert weights((1, 4, 2), "float32") == {"weights": 4 * shard, "gathered_weights": 2 * read,
                                             "cast_shard": 2 * shard}
    assert weights((1, 4, 2), "float32", "join_copy") == {"weights": 0.0}   # a join reads no weights


def test_decode_step_roofline_by_hand():
    """One row at 4096 keys on a v5e chip: memory-bound, time = (weights + KV read + written) / BW."""
    cfg = resolve_model_config("r1-distill-qwen-7b").replace(dtype="bfloat16")
    v5e = chips.CHIPS["v5e"]
    e, m, v, layers = 3584, 18944, 152064, 28
    matmul = layers * (e * 128 * (2 * 28 + 2 * 4) + 3 * e * m) + e * v      # q, k, v, o, MLP, lm_head
    one = pe.decode_step(cfg, 1, 1, 1, 4096, 0, v5e.peak_flops, v5e.hbm_bandwidth)
    traffic = 2 * matmul + 57_344 * (4096 + 1)
    assert one["hbm_traffic_bytes"] == traffic and one["bound"] == "memory"
    assert one["roofline_s"] == pytest.approx(traffic / 819e9)
    # eight executors sharing that prefix, each with 512 keys of its own: the prefix read once
    eight = pe.decode_step(cfg, 1, 1, 8, 4096, 512, v5e.peak_flops, v5e.hbm_bandwidth)
    assert eight["hbm_traffic_bytes"] == 2 * matmul + 57_344 * (4096 + 8 * 512 + 8)
    assert eight["flops"] == 2 * matmul * 8 + 4 * layers * 28 * 128 * 8 * (4096 + 512 + 1)
    # tensor parallelism splits both over 4 chips
    t4 = pe.decode_step(cfg, 4, 1, 8, 4096, 512, v5e.peak_flops, v5e.hbm_bandwidth)
    assert t4["hbm_traffic_bytes"] == pytest.approx(eight["hbm_traffic_bytes"] / 4)


def test_capacity_is_the_largest_that_fits_by_the_estimate():
    cfg = resolve_model_config("r1-distill-qwen-7b").replace(dtype="bfloat16")
    shape = pe.EngineShape(cfg, 32, 8, 16384, 16384, mesh=(2, 1, 4))
    hbm = chips.CHIPS["v5p"].hbm_bytes
    cap = pe.capacity(shape, hbm)
    c, k = cap["max_concurrency"], cap["max_executors"]
    assert c % 2 == 0 and c > 32 and k > 8           # runs split over data=2
    assert pe.fits(dataclasses.replace(shape, concurrency=c), hbm)
    assert not pe.fits(dataclasses.replace(shape, concurrency=c + 2), hbm)
    assert pe.fits(dataclasses.replace(shape, executors=k), hbm)
    assert not pe.fits(dataclasses.replace(shape, executors=k + 1), hbm)


def test_a_config_that_cannot_fit_is_one_line_and_exit_2(capsys):
    """7B at 64 runs x 8 executors x 16k on one 4-chip v5e host: 542 GB of KV pool against 64 GiB
    of HBM. Refused before compiling, naming the bytes, the overflow and a way out."""
    rc = main(["plan", "engine", "--model", "r1-distill-qwen-7b", "--concurrency", "64", "--executors", "8",
               "--capacity", "16384", "--mesh", "tensor=4", "--topology", "v5e:2x2"])
    assert rc == 2
    err = capsys.readouterr().err
    (line,) = _errors(err)
    assert "Traceback" not in err
    assert "on v5e:2x2 (v5litepod-4, mesh data=1,fsdp=1,tensor=4)" in line
    # 64 runs x 9,233 pages of 16 tokens (test_7b_weights_...), 57,344 / 4 bytes a token on each
    # of 4 chips: 135,540,350,976 bytes, 126.2 GiB each
    assert "KV pool 126.2 GiB" in line and "GiB over the chip's 16 GiB" in line
    assert "way out:" in line and ("--concurrency" in line or "--capacity" in line or "--topology" in line)


@pytest.mark.parametrize("argv, words", [
    (["--concurrency", "0", "--executors", "8", "--capacity", "1024"], "--concurrency must be >= 1"),
    (["--concurrency", "8", "--capacity", "1024"], "needs --executors"),
    (["--concurrency", "8", "--executors", "8", "--capacity", "1024", "--mesh", "pipeline=2"], "--mesh"),
    (["--concurrency", "8", "--executors", "8", "--capacity", "200000"], "max_position_embeddings"),
    (["--concurrency", "8", "--executors", "8", "--capacity", "1024", "--records", "/nonexistent"],
     "not a directory"),
])
def test_bad_engine_flags_are_one_clear_error(capsys, argv, words):
    rc = main(["plan", "engine", "--model", "r1-distill-qwen-7b", "--topology", "v5e:2x2", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Latency from eval records
# ---------------------------------------------------------------------------------------------
def _hand_memory_bound_s(r: dict, w: float, kv: float, bw: float, chunk: int = 16) -> float:
    """A record's latency when every step is memory-bound: each one-row decode step moves the
    weights w and its context's KV (kv bytes a token), plus the token it writes; a prefill moves
    the weights and its context's and tokens' KV. Closed forms for the one-row runs. A fork's
    step moves the weights, the prefix once, each live executor's suffix and new token; an
    opening longer than a decode chunk is prefilled first (and sits in each suffix on average)."""
    def run(n, ctx):             # n steps at contexts ctx .. ctx + n - 1, each reading ctx + i + 1
        return n * w + kv * (n * ctx + n * (n + 1) / 2)
    t, ctx = w + kv * r["prompt_tokens"], r["prompt_tokens"]
    for st in r["stages"]:
        t += run(st["planner_tokens"], ctx)
        ctx += st["planner_tokens"]
        ex = st["executions"]
        if ex and st["executor_mode"] == "shared":
            pre = [e["forced_tokens"] if e["forced_tokens"] > chunk else 0 for e in ex]
            steps = [e["forced_tokens"] - p + e["tokens"] for e, p in zip(ex, pre)]
            t += w + kv * (ctx + sum(pre)) if sum(pre) else 0
            for s in range(max(steps)):
                width = sum(n > s for n in steps)
                t += w + kv * (ctx + width * (s + sum(pre) / len(ex)) + width)
            t += w + kv * (ctx + st["sync_tokens"]) if st["sync_tokens"] else 0
            ctx += sum(e["forced_tokens"] + e["tokens"] for e in ex)
    return (t + run(r["final_tokens"], ctx)) / bw


def test_latency_of_a_written_record_by_hand():
    """A SPRINT record with a fork of three executors (openings short enough to ride the decode
    chunk) and a merge sync, against the closed-form memory-bound sum."""
    cfg = _config(SMALL)
    v5e = chips.CHIPS["v5e"]
    execs = [{"tokens": n, "forced_tokens": f} for n, f in ((7, 3), (12, 2), (4, 5))]
    r = {"mode": "parallel", "prompt_tokens": 40, "final_tokens": 9,
         "stages": [{"planner_tokens": 11, "executor_mode": "shared", "executions": execs, "sync_tokens": 3},
                    {"planner_tokens": 5, "executor_mode": "none", "executions": [], "sync_tokens": 0}]}
    got = rec.record_latency(r, cfg, v5e)
    from sprint_jax.plan.estimate import matmul_params
    w = 2 * matmul_params(cfg)
    kv = 2 * 2 * 4 * 128 * 2
    assert got["latency_s"] == pytest.approx(_hand_memory_bound_s(r, w, kv, 819e9), rel=1e-9)
    assert got["decode_steps"] == 11 + 14 + 5 + 9


def test_latency_from_scripted_evals_records(tmp_path):
    """`evaluate` of a scripted SPRINT model (three stages, forks of executors) and its scripted
    RFT baseline writes records.jsonl; the prediction from them against the hand computation."""
    from test_eval import TASKS, _prompt, _rft_engine, _sprint_engine

    from sprint_jax.eval.evaluate import evaluate

    evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "sprint", progress=False)
    evaluate(_rft_engine(), TASKS, "sequential", prompt_fn=_prompt, out_dir=tmp_path / "rft", progress=False)
    loaded = rec.load_records(tmp_path)
    assert sorted(loaded["sprint"]) == sorted(loaded["rft"]) == sorted(t.id for t in TASKS)
    forks = [st for r in loaded["sprint"].values() for st in r["stages"] if st["executor_mode"] == "shared"]
    assert forks and any(len(st["executions"]) > 1 for st in forks)
    cfg = resolve_model_config("r1-distill-qwen-7b").replace(dtype="bfloat16")
    v5e = chips.CHIPS["v5e"]
    pred = rec.predict(loaded, cfg, v5e)
    from sprint_jax.plan.estimate import matmul_params
    w, kv = 2 * matmul_params(cfg), 57_344
    for label in ("sprint", "rft"):
        for key, r in loaded[label].items():
            want = _hand_memory_bound_s(r, w, kv, 819e9)
            assert pred["per_problem"][label][key]["latency_s"] == pytest.approx(want, rel=1e-9), (label, key)
    assert pred["paired_problems"] == len(TASKS) and 0 < pred["ratio"]


@pytest.mark.slow
def test_latency_from_the_real_evals_records(hf_untied, tmp_path, capsys):
    """`sprint-jax eval` of the tiny checkpoint, SPRINT (parallel) and its RFT baseline (sequential),
    into one directory; the prediction per problem and in total against the hand computation."""
    from conftest import tiny_vocab_tokenizer

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{k}", "problem": f"What is {k}+{k}?", "answer": str(2 * k)})
                             + "\n" for k in range(1, 4)))
    caps = ["--max-seq-len", "224", "--decode-chunk", "8", "--prefill-chunk", "32", "--max-prompts", "2",
            "--max-branch-tokens", "16", "--max-planner-tokens", "10", "--max-total-tokens", "40", "--no-progress"]
    for mode, sub in (("parallel", "sprint"), ("sequential", "rft")):
        assert main(["eval", "--model", str(model), "--data", str(tasks), "--mode", mode, "--limit", "3",
                     "--out", str(tmp_path / "records" / sub), *caps]) == 0
    loaded = rec.load_records(tmp_path / "records")
    assert sorted(loaded["sprint"]) == sorted(loaded["rft"]) == ["t1", "t2", "t3"]
    cfg = resolve_model_config(str(model)).replace(dtype="bfloat16")
    v5e = chips.CHIPS["v5e"]
    pred = rec.predict(loaded, cfg, v5e, decode_chunk=8)
    from sprint_jax.plan.estimate import matmul_params
    w = 2 * matmul_params(cfg)
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    total = {}
    for label in ("sprint", "rft"):
        for key, r in loaded[label].items():
            assert r["prompt_tokens"] > 0 and (r["stages"] or r["final_tokens"])
            want = _hand_memory_bound_s(r, w, kv, 819e9, chunk=8)
            assert pred["per_problem"][label][key]["latency_s"] == pytest.approx(want, rel=1e-9)
            total[label] = total.get(label, 0.0) + want
        assert pred["total"][label]["latency_s"] == pytest.approx(total[label], rel=1e-9)
    assert pred["ratio"] == pytest.approx(total["sprint"] / total["rft"], rel=1e-9)


def test_records_that_are_not_eval_records_are_refused(tmp_path):
    from sprint_jax.errors import UserError

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "records.jsonl").write_text('{"mode": "parallel", "id": "x"}\n')
    with pytest.raises(UserError, match="not an eval record"):
        rec.load_records(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no records.jsonl"):
        rec.load_records(empty)


# ---------------------------------------------------------------------------------------------
# The TPU compiler: the engine's programs
# ---------------------------------------------------------------------------------------------
KERNELS = {"decode_stage": {"grouped_paged_prefix_attention"}, "decode_planner": {"grouped_paged_prefix_attention"},
           "prefill": {"flash_span_fwd"}, "join_copy": set()}


def _plan(tmp_path, model: dict, *args: str, name: str = "m") -> tuple[int, list[dict] | None]:
    out = tmp_path / f"{name}-rows.json"
    rc = main(["plan", "engine", "--model", _model_file(tmp_path, model, name), *args, "--json", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else None


ROW_KEYS = {"program", "topology", "mesh", "compiled", "per_chip_bytes", "hbm_bytes", "estimate_bytes", "flops",
            "hbm_traffic_bytes", "roofline_s", "headroom", "compile_s", "kernels", "kind"}


@needs_libtpu
@pytest.mark.slow
def test_every_engine_program_compiles_for_v5e_with_its_mosaic_kernels(tmp_path, capsys):
    """Traced as the engine traces them (under its mesh): the decode calls hold the paged
    grouped-prefix kernel (the planner rows' pages, the executors' shared prefix), the prefill
    chunk the flash kernel (its own keys; the pages before it are the XLA attention), each one
    tpu_custom_call; every program's arguments are the weights and the pool by the estimate, and
    the estimate is within 20% of the compiler on the other rows; its temporaries bound the
    executors' decode call's (the compiler may fuse their gathered pages)."""
    rc, rows = _plan(tmp_path, NARROW, "--concurrency", "8", "--executors", "4", "--capacity", "16384",
                     "--mesh", "tensor=4", "--topology", "v5e:2x2")
    assert rc == 0, capsys.readouterr().err
    assert sorted(r["kind"] for r in rows) == sorted(KERNELS)
    for r in rows:
        assert ROW_KEYS <= set(r) and r["compiled"] and r["fits"], r["error"]
        assert set(r["kernels"]) == KERNELS[r["kind"]]
        # a page table too large for the kernel's scalar memory is split over calls
        assert r["tpu_custom_calls"] >= len(KERNELS[r["kind"]])
        mem = r["per_chip_bytes"]
        assert mem["total"] == mem["arguments"] + mem["outputs"] - mem["alias"] + mem["temp"]
        e = r["estimate"]
        assert 0 <= mem["arguments"] - e["weights"] - e["cache"] <= 2 ** 20       # + the rows
        if r["kind"] == "decode_stage":
            # the executors' gathered pages (384 MiB by the estimate) are an upper bound: this
            # compile fuses the gather into the attention's products
            assert mem["temp"] <= e["total"] - e["weights"] - e["cache"]
            continue
        # the prefill's flash blocks and gathered pages are a larger share of a toy's total than of
        # the 7B's (within 5% there: docs/benchmarks.md), and the compiler lays them out per mesh
        assert r["estimate_bytes"] == pytest.approx(mem["total"], rel=0.5 if r["kind"] == "prefill" else 0.2), \
            r["program"]
    out = capsys.readouterr().out
    assert "v5e:2x2 (v5litepod-4)" in out and "decode step at full context" in out


@needs_libtpu
@pytest.mark.slow
def test_the_prefill_compiles_as_the_engine_traces_it(tmp_path):
    """Under tensor parallelism the prefill's Mosaic flash kernel must run inside a shard_map,
    which attention only builds under an active mesh: the engine's programs enter their mesh
    themselves (`sharding.traced_on_mesh`), so the plain command compiles, two flash kernel calls
    (the gathered pages before the chunk, the chunk's own keys). With the runs over data too,
    the prefill already runs per data shard (manual over data), and enough rows per shard
    (32 runs: 16 a shard) that data would divide them again: the kernel's shard_map must split
    heads over tensor only."""
    rc, rows = _plan(tmp_path, TOY, "--concurrency", "32", "--executors", "4", "--capacity", "1024",
                     "--mesh", "data=2,tensor=2", "--topology", "v5e:2x2", "--programs", "prefill")
    (prefill,) = rows
    assert prefill["compiled"], prefill["error"]
    assert prefill["kernels"] == ["flash_span_fwd"] and prefill["tpu_custom_calls"] == 2


@needs_libtpu
@pytest.mark.slow
def test_the_pallas_decode_compiles_with_runs_over_data(tmp_path):
    """With the runs split over data the decode step runs per page shard (a shard_map manual over
    data only); the paged Pallas prefix kernel inside it gets a nested shard_map over the other
    mesh axes (a Mosaic kernel must sit fully inside one), so it compiles, its calls all the kernel."""
    rc, rows = _plan(tmp_path, TOY, "--concurrency", "8", "--executors", "4", "--capacity", "1024",
                     "--mesh", "data=4", "--topology", "v5e:2x2", "--programs", "decode_stage")
    (decode,) = rows
    assert decode["compiled"], decode["error"]
    assert set(decode["kernels"]) == {"grouped_paged_prefix_attention"}
    assert decode["tpu_custom_calls"] >= 1


@needs_libtpu
def test_the_engine_compiles_with_the_rl_trainers_fp32_weights(tmp_path):
    """`--weights-dtype float32`, the RL trainer's rollout engine (it reads the trainer's fp32
    master weights, on the update's fsdp x tensor mesh): the executors' decode call compiles, and
    each chip's arguments are its shard of the fp32 weights and of the bf16 pool, by hand.
    TOY on fsdp=2 x tensor=2 (the width over fsdp; heads, KV heads, MLP and vocab over tensor;
    norms whole), elements per chip:
      embedding [1024, 512] and lm_head [512, 1024]: 131072 each; final norm 512;
      a layer: q, o [512, 4, 128] 65536 each, q bias [4, 128] 256, k, v [512, 2, 128] 32768 each,
      k, v biases [2, 128] 128 each, gate, up, down [512, 1024] 131072 each, two norms 512 each:
      591360; two layers: 1445376 elements, 5,781,504 bytes in fp32.
    The pool: the Engine's default, 8 runs of ceil(1040 / 16) = 65 pages (1024 tokens + a decode
    chunk) and 4 executors of ceil(272 / 16) + 1 = 18 (256 + 16, and the page a fork copies):
    1,096 pages of 16 tokens, split over fsdp=2 with the runs, one KV head of the two per chip:
    K and V x 2 layers x 128 x 2 bytes = 1 KiB a token, 548 x 16 KiB = 8,978,432 bytes. The rest of
    the arguments are the call's rows (a few KiB)."""
    rc, rows = _plan(tmp_path, TOY, "--concurrency", "8", "--executors", "4", "--capacity", "1024",
                     "--branch-capacity", "256", "--mesh", "fsdp=2,tensor=2", "--weights-dtype", "float32",
                     "--attention", "xla", "--topology", "v5e:2x2", "--programs", "decode_stage")
    (decode,) = rows
    assert decode["compiled"] and decode["fits"], decode["error"]
    assert decode["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} and "float32 weights" in decode["engine"]
    weights = 4 * (2 * 131072 + 512 + 2 * (2 * 65536 + 256 + 2 * (32768 + 128) + 3 * 131072 + 2 * 512))
    cache = 2 * 2 * 128 * 2 * 16 * (8 * (65 + 4 * 18) // 2)
    assert (weights, cache) == (5_781_504, 8_978_432)
    rows_bytes = decode["per_chip_bytes"]["arguments"] - weights - cache
    assert 0 <= rows_bytes <= 64 * 1024, rows_bytes      # bf16 weights would be 2.9 MB fewer
    assert decode["estimate"]["weights"] == weights and decode["estimate"]["cache"] == cache


@needs_libtpu
@pytest.mark.slow
# the narrow model under tensor=4 with the Pallas decode is test_every_engine_program_compiles_...'s
@pytest.mark.parametrize("model, mesh, attention", [(LARGER, "data=2,tensor=2", "pallas"), (SMALL, "data=4", "xla")],
                         ids=["larger-data-tensor-pallas", "small-data-xla"])
def test_estimate_is_within_20_percent_of_the_compiler(tmp_path, capsys, model, mesh, attention):
    """The two largest programs (the executors' decode call and the prefill chunk) of the other
    sizes and meshes with the runs over data (the XLA decode attention; the Pallas one with the
    heads over tensor too), executors of 1,024 tokens: the pool and the gathered pages dominate,
    as at the 7B (docs/benchmarks.md: within 5% there; there too the decode's gathers are fused)."""
    rc, rows = _plan(tmp_path, model, "--concurrency", "8", "--executors", "4", "--capacity", "16384",
                     "--branch-capacity", "1024", "--mesh", mesh, "--attention", attention, "--topology", "v5e:2x2",
                     "--programs", "decode_stage,prefill")
    assert rc == 0, capsys.readouterr().err
    assert sorted(r["kind"] for r in rows) == ["decode_stage", "prefill"]
    for r in rows:
        assert r["compiled"], r["error"]
        total, e = r["per_chip_bytes"]["total"], r["estimate"]
        if r["kind"] == "decode_stage":
            # the gathered pages are an upper bound (these compiles fuse the gathers into the
            # attention's products): the estimate bounds the compiler, and without them is within 20%
            gathered = e["gathered_children"] + e.get("gathered_prefix", 0)
            assert total <= r["estimate_bytes"] and r["estimate_bytes"] - gathered == pytest.approx(total, rel=0.2)
            continue
        # the prefill: see test_every_engine_program_compiles_for_v5e_with_its_mosaic_kernels
        assert r["estimate_bytes"] == pytest.approx(total, rel=0.5), r["program"]


@needs_libtpu
@pytest.mark.slow
def test_search_finds_a_slice_the_compiler_accepts(tmp_path, capsys):
    """48 runs x 8 executors x 32k of the narrow model (the small one's KV heads and layers): 54 GiB
    of KV cache, more than one 4-chip v5e host holds (64 GiB of HBM, less the decode step's
    temporaries); the search rules it out by the estimate and names a larger slice that the
    compiler accepts for every program."""
    from test_eval import TASKS, _prompt, _rft_engine, _sprint_engine

    from sprint_jax.eval.evaluate import evaluate

    evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "r" / "s", progress=False)
    evaluate(_rft_engine(), TASKS, "sequential", prompt_fn=_prompt, out_dir=tmp_path / "r" / "b", progress=False)
    rc, rows = _plan(tmp_path, NARROW, "--concurrency", "48", "--executors", "8", "--capacity", "32768",
                     "--attention", "xla", "--topology", "v5e:2x4", "--search",
                     "--records", str(tmp_path / "r"))
    assert rc == 0, capsys.readouterr().err
    accepted = [r for r in rows if r.get("search") and r["topology"] == "v5e:2x4"]
    assert len(accepted) == 4 and all(r["compiled"] and r["fits"] for r in accepted)
    out = capsys.readouterr()
    assert "search: v5e:2x2" in out.err        # the 4-chip host was ruled out first
    # the latency predicted from the records on the accepted slice's chip and tensor parallelism
    (latency,) = [r for r in rows if r["program"] == "latency from records"]
    tensor = accepted[0]["mesh"]["tensor"]
    want = rec.predict(rec.load_records(tmp_path / "r"), _config(NARROW), chips.CHIPS["v5e"], tensor)
    assert latency["tensor"] == tensor and latency["ratio"] == pytest.approx(want["ratio"])
    assert latency["total"]["sprint"]["latency_s"] == pytest.approx(want["total"]["sprint"]["latency_s"])
    assert "predicted latency on v5e:2x4" in out.out and "SPRINT / RFT" in out.out


# ---------------------------------------------------------------------------------------------
# The Pallas kernels at 7B and Qwen3-8B shapes
# ---------------------------------------------------------------------------------------------
SHAPES = {"r1-distill-qwen-7b": (28, 4, 128), "qwen3-8b": (32, 8, 128)}


def _kernel_calls(heads: int, kv_heads: int, dim: int, platform: str, sharding=None):
    """(name, jitted kernel, abstract args) of every decode kernel at an engine's shapes: 32 runs
    of 8 executors over 16k-token slots (both cache layouts), and one fork over a 16k prefix."""
    import jax
    import jax.numpy as jnp

    from sprint_jax.kernels import grouped_prefix_attention, shared_prefix_attention

    s = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    n, cap, groups, width = 32, 16400, 32, 8
    out = []
    for heads_first in (True, False):
        cache = s((n, kv_heads, cap, dim) if heads_first else (n, cap, kv_heads, dim))
        out.append((f"grouped_prefix_attention heads_first={heads_first}",
                    jax.jit(functools.partial(grouped_prefix_attention, platform=platform, heads_first=heads_first)),
                    (s((groups, width, heads, dim)), cache, cache, s((groups,), jnp.int32),
                     s((groups, width), jnp.int32))))
    out.append(("shared_prefix_attention",
                jax.jit(functools.partial(shared_prefix_attention, platform=platform, return_lse=True)),
                (s((width, heads, dim)), s((cap, kv_heads, dim)), s((cap, kv_heads, dim)), s((), jnp.int32),
                 s((width, 4096, kv_heads, dim)), s((width, 4096, kv_heads, dim)), s((width,), jnp.int32))))
    return out


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology, model", [("v5e:2x2", "r1-distill-qwen-7b"), ("v5p:2x2x1", "qwen3-8b")])
def test_every_pallas_decode_kernel_compiles_for_tpu_at_7b_shapes(topology, model):
    """Mosaic compiles each kernel with the block sizes the code picks (one custom call each,
    two for the shared-prefix kernel: its prefix and its suffix pass); each model's shapes on one
    chip generation, each generation once (the code picks block sizes from the shapes alone)."""
    from jax.sharding import SingleDeviceSharding

    from sprint_jax.plan.compile import slice_devices

    one = SingleDeviceSharding(slice_devices(topology)[0])
    for name, fn, args in _kernel_calls(*SHAPES[model], "tpu", one):
        compiled = fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()
        calls = compiled.as_text().count('custom_call_target="tpu_custom_call"')
        assert calls == (2 if name.startswith("shared") else 1), name


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_the_triton_kernels_lower_for_cuda(model):
    """Lowered (not compiled: that needs a GPU) for CUDA, each body a Triton custom call."""
    import jax
    import jax.numpy as jnp

    from sprint_jax.kernels import flash_attention as flash

    heads, kv_heads, dim = SHAPES[model]
    calls = _kernel_calls(heads, kv_heads, dim, "gpu")
    s = jax.ShapeDtypeStruct
    calls.append(("flash_span_fwd", jax.jit(functools.partial(flash.flash_forward, platform="gpu", block_q=64,
                                                               block_k=64)),
                  (s((1, 1024, heads, dim), jnp.bfloat16), s((1, 1024, kv_heads, dim), jnp.bfloat16),
                   s((1, 1024, kv_heads, dim), jnp.bfloat16), s((1, 1024), jnp.int32), s((1,), jnp.int32))))
    for name, fn, args in calls:
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == (2 if name.startswith("shared") else 1), name
