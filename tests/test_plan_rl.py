"""`sprint-jax plan rl`: an RL config's policy-gradient update planned for TPU slices.

Fast: the argument errors, the shapes read from the configs, the FLOP formula and the bytes held
beside the grad step against hand computations, the rollout engine's KV cache by hand. Slow (needs
libtpu): a toy RL config's grad, log-prob and apply programs compiled for v5e:2x2.
"""
from __future__ import annotations

import importlib.util
import json

import pytest

from sprint_jax.cli import main
from sprint_jax.config import load_config
from sprint_jax.errors import UserError
from sprint_jax.model.config import resolve_model_config
from sprint_jax.plan import chips
from sprint_jax.rl import plan as prl
from sprint_jax.rl.config import RLConfig

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="compiling for TPU needs libtpu (pip install -e '.[tpu]')")

# configs/model_tiny.json: E 72, M 200, L 3, H 6, Hkv 2, head_dim 12, V 307, untied, q/k/v biases
TINY_MATMUL = 3 * (72 * 12 * (2 * 6 + 2 * 2) + 3 * 72 * 200) + 72 * 307                # 193176
TINY_PARAMS = (307 * 72                                                               # embedding
               + 3 * (72 * 72 + 72 + 2 * (72 * 24 + 24) + 72 * 72 + 3 * 72 * 200 + 2 * 72)   # layers
               + 72 + 72 * 307)                                                      # final norm, lm_head


def _tiny():
    return resolve_model_config("tiny").replace(param_dtype="float32", dtype="float32")


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("sprint-jax plan: error:")]


@pytest.mark.parametrize("argv, words", [
    (["plan", "rl", "--topology", "v5e:2x2"], "needs an RL config"),
    (["plan", "rl", "configs/no_such.yaml", "--topology", "v5e:2x2"], "no RL config file"),
    (["plan", "rl", "configs/rl_tiny_cpu.yaml", "--topology", "v5e:2x2", "--set", "loss.rows_per_micro=0"],
     "loss.rows_per_micro must be >= 1"),
    (["plan", "rl", "configs/rl_r1_distill_7b.yaml", "--topology", "v5p-16"], "pass --model PRESET"),
    (["plan", "rl", "configs/rl_tiny_cpu.yaml", "--topology", "v5e:2x2", "--batch", "8"], "--batch is not accepted"),
    (["plan", "rl", "configs/rl_tiny_cpu.yaml", "--topology", "v5e:2x2", "--search"], "does not search"),
    (["plan", "rl", "configs/rl_tiny_cpu.yaml", "--topology", "v5e:2x2", "--weights-dtype", "float32"],
     "--weights-dtype is not accepted"),
    (["plan", "rl", "configs/rl_tiny_cpu.yaml", "--topology", "v9z:2x2"], "v9z"),
    (["plan", "train", "configs/rl_tiny_cpu.yaml", "--model", "tiny", "--topology", "v5e:2x2"],
     "takes no CONFIG argument"),
])
def test_bad_rl_requests_are_one_clear_error(capsys, argv, words):
    assert main(argv) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and words in err[0], err


def test_a_shipped_config_is_found_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """`configs/NAME` names the shipped config from any directory, as for `train --config`: the
    config is read (the error is the next check's, its policy path not on this host)."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "rl", "configs/rl_r1_distill_7b.yaml", "--topology", "v5p-16"]) == 2
    err = _errors(capsys.readouterr().err)
    assert len(err) == 1 and "pass --model PRESET" in err[0], err


def test_shapes_come_from_the_rl_config():
    tiny = load_config(RLConfig, "configs/rl_tiny_cpu.yaml")
    s = prl.shape_from_config(tiny, _tiny(), (1, 1, 1))
    assert (s.rows, s.seq_len, s.remat, s.loss_chunk) == (8, 256, "none", 0)
    assert (s.with_old, s.with_ref, s.updates) == (False, False, 1) and prl.kinds(s) == ["grad", "apply"]
    ppo = load_config(RLConfig, "configs/rl_tiny_cpu.yaml", ["loss.updates_per_batch=2", "loss.kl_coef=0.1"])
    s = prl.shape_from_config(ppo, _tiny(), (1, 1, 1))
    assert (s.with_old, s.with_ref, s.updates) == (True, True, 2) and prl.kinds(s) == ["grad", "logp", "apply"]
    big = load_config(RLConfig, "configs/rl_r1_distill_7b.yaml")
    s = prl.shape_from_config(big, resolve_model_config("r1-distill-qwen-7b"), (1, 2, 2))
    assert (s.rows, s.seq_len, s.remat, s.loss_chunk) == (4, 16384, "full", 1024)
    # 4 rows do not split over fsdp=8, as the trainer refuses them
    with pytest.raises(UserError, match=r"rows_per_micro \(4\) must be a multiple of mesh data x fsdp = 8"):
        prl.shape_from_config(big, resolve_model_config("r1-distill-qwen-7b"), (1, 8, 1))


def test_flops_by_hand():
    """Tiny model, 4 rows x 64 tokens: forward = 2 x 193176 x 256 + 2 x 3 x 4 x 64^2 x 6 x 12."""
    s = prl.RLShape(_tiny(), 4, 64, (1, 1, 1), with_old=True, with_ref=True, updates=2)
    assert TINY_MATMUL == 193176
    fwd = 2 * 193176 * 256 + 2 * 3 * 4 * 64 ** 2 * 6 * 12
    assert fwd == 105_984_000
    f = prl.flops(s)
    assert f["logp"] == fwd and f["grad"] == 317_952_000
    assert f["update"] == 2 * 317_952_000 + 2 * 105_984_000          # two updates, old and ref forwards once
    on_policy = prl.flops(prl.RLShape(_tiny(), 4, 64, (1, 1, 1)))
    assert on_policy["update"] == 317_952_000


def test_bytes_held_beside_the_grad_step_by_hand():
    """AdamW's two moments and the running gradient sum (and the reference weights with KL), fp32."""
    assert TINY_PARAMS == 216144
    s = prl.RLShape(_tiny(), 4, 64, (1, 1, 1), with_ref=True)
    held = prl.beside(s)
    assert held == {"adam_moments": 8 * 216144, "grad_sum": 4 * 216144, "ref_params": 4 * 216144}
    assert prl.memory_estimate(s, "apply")["total"] == 16 * 216144
    # the packed microbatch: nine int32 / fp32 [4, 64] arrays
    assert prl.batch_bytes_per_chip(s) == 9 * 4 * 4 * 64


def test_rollout_engine_by_hand():
    """rl_tiny_cpu: 4 prompts x 8 runs = 32 parent slots of 512 + a decode chunk (16) tokens, 4
    executors each of 24 + 32 (the tag room) + 16 tokens; tiny fp32 KV: 2 x 3 x 2 x 12 x 4 bytes
    per token. The engine's default KV pool holds every run at its capacities in pages of 16
    tokens: ceil(528 / 16) = 33 pages and 4 x (ceil(72 / 16) + 1 copied page) = 24, 57 pages a
    run. On the update's mesh data=2 x fsdp=2 x tensor=2 the pages split 4 ways with the runs and
    the two KV heads 2 ways; beside the engine the chip holds the trainer's two fp32 moments."""
    cfg = load_config(RLConfig, "configs/rl_tiny_cpu.yaml")
    where = chips.parse_slices("v5e:2x4")[0]
    one = prl.rollout_engine(cfg, prl.shape_from_config(cfg, _tiny(), (1, 1, 1)), where, "tiny", "tiny")
    assert one["cache_bytes_per_chip"] == 576 * 32 * 57 * 16
    # the engine's argument is the trainer's weights themselves (in its estimate): beside, the moments
    assert one["beside_bytes"] == {"adam_moments": 8 * TINY_PARAMS}
    assert one["fits"]
    e = prl.rollout_engine(cfg, prl.shape_from_config(cfg, _tiny(), (2, 2, 2)), where, "tiny", "tiny")
    assert e["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert e["cache_bytes_per_chip"] == 288 * 8 * 57 * 16
    assert ("--concurrency 32 --executors 4 --capacity 512 --branch-capacity 56 --decode-chunk 16 "
            "--prefill-chunk 128 --dtype float32 --weights-dtype float32 --topology v5e:2x4 "
            "--mesh data=2,fsdp=2,tensor=2") in e["plan_engine_command"]
    ppo = load_config(RLConfig, "configs/rl_tiny_cpu.yaml", ["loss.kl_coef=0.1"])
    held = prl.rollout_engine(ppo, prl.shape_from_config(ppo, _tiny(), (1, 1, 1)), where, "tiny", "tiny")["beside_bytes"]
    assert held["ref_params"] == 4 * TINY_PARAMS


def test_the_rollout_engine_reads_fp32_weights():
    """The engine's calls take the trainer's fp32 master weights: twice the bytes of bf16 weights
    (the tiny model's 216144 parameters whole on one chip), and in a bf16 compute dtype a bf16 copy
    beside them, cast once per call."""
    from sprint_jax.plan import engine as pe

    bf16 = _tiny().replace(dtype="bfloat16")
    shape = pe.EngineShape(bf16, 8, 4, 512, 56)
    assert pe.weight_bytes(shape) == 2 * TINY_PARAMS
    fp32 = pe.EngineShape(bf16, 8, 4, 512, 56, weights_dtype="float32")
    assert pe.weight_bytes(fp32) == 4 * TINY_PARAMS
    parts = pe.memory_estimate(fp32, "decode_planner")
    assert (parts["weights"], parts["gathered_weights"]) == (4 * TINY_PARAMS, 2 * TINY_PARAMS)
    assert "cast_shard" not in parts and "gathered_weights" not in pe.memory_estimate(shape, "decode_planner")


# ---------------------------------------------------------------------------------------------
# The TPU compiler
# ---------------------------------------------------------------------------------------------
TOY = {"model_type": "qwen2", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
       "max_position_embeddings": 4096, "tie_word_embeddings": False}


@needs_libtpu
@pytest.mark.slow
def test_a_toy_rl_update_compiles_for_v5e(tmp_path, capsys):
    """The grad step (with old and reference log-prob inputs), the log-prob forward and the apply
    step compile on fsdp=4, attention in the Mosaic flash kernels; each row's bytes add up, the grad step's arguments hold at least its
    shard of the fp32 weights and the batch, the apply step updates the donated state in place."""
    model = tmp_path / "policy"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TOY))
    out = tmp_path / "rows.json"
    rc = main(["plan", "rl", "configs/rl_tiny_cpu.yaml", "--set", f"policy.path={model}",
               "--set", "loss.rows_per_micro=4", "--set", "loss.seq_len=512", "--set", "loss.kl_coef=0.1",
               "--set", "loss.updates_per_batch=2", "--set", "mesh.fsdp=-1", "--dtype", "bfloat16",
               "--topology", "v5e:2x2", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())
    programs = [r for r in rows if "kind" in r]
    assert [r["kind"] for r in programs] == ["grad", "logp", "apply"]
    params = (8192 * 512 * 2 + 2 * (512 * 512 * 2 + 512 * 256 * 2 + 512 + 2 * 256 + 3 * 512 * 1024 + 2 * 512)
              + 512)
    hbm = chips.CHIPS["v5e"].hbm_bytes
    for r in programs:
        assert r["compiled"] and r["fits"], r["error"]
        assert r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
        mem = r["per_chip_bytes"]
        assert mem["total"] == mem["arguments"] + mem["outputs"] - mem["alias"] + mem["temp"]
        held = sum(r["beside_bytes"].values())
        assert r["headroom"] == pytest.approx(1 - (mem["total"] + held) / hbm)
        assert mem["arguments"] >= 4 * params / 4
    grad, logp, apply = programs
    # the loss's attention is the flash kernel (forward and backward), as in the SFT step
    assert grad["kernels"] == ["flash_span_dkdv", "flash_span_dq", "flash_span_fwd"]
    assert logp["kernels"] == ["flash_span_fwd"] and apply["kernels"] == []
    assert grad["beside_bytes"]["adam_moments"] >= 2 * 4 * params / 4
    assert grad["mesh"] and grad["per_chip_bytes"]["arguments"] >= 4 * params / 4 + (9 + 2) * 4 * 4 * 512 / 4
    assert grad["per_chip_bytes"]["outputs"] >= 4 * params / 4                 # the fp32 gradients
    assert apply["per_chip_bytes"]["alias"] >= 3 * 4 * params / 4             # weights and moments in place
    assert grad["flops"] == 3 * logp["flops"]
    assert "rollout: engine" in capsys.readouterr().out
