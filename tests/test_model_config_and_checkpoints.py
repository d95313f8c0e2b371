"""Model presets, config rejection, checkpoint error messages, the convert command."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from sprint_jax.config import ConfigError
from sprint_jax.model import CheckpointError, Qwen2Config, from_pretrained, param_count
from sprint_jax.model.hf import SafetensorsFile, write_safetensors


def test_r1_distill_7b_param_count_via_eval_shape():
    cfg = Qwen2Config.preset("r1-distill-qwen-7b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta, cfg.rms_norm_eps,
            cfg.tie_word_embeddings) == (3584, 28, 28, 4, 18944, 152064, 10000.0, 1e-6, False)
    assert param_count(cfg) == 7_615_616_512
    # independent count from the architecture's formula
    e, i, l, v, h, kv, d = 3584, 18944, 28, 152064, 28, 4, 128
    per_layer = e * h * d + h * d + 2 * (e * kv * d + kv * d) + h * d * e + 3 * e * i + 2 * e
    assert 2 * v * e + l * per_layer + e == 7_615_616_512
    q25 = Qwen2Config.preset("qwen2.5-7b")
    assert q25.rope_theta == 1e6 and param_count(q25) == 7_615_616_512


def test_qwen3_8b_param_count_via_eval_shape():
    cfg = Qwen2Config.preset("qwen3-8b")
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta,
            cfg.tie_word_embeddings) == ("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, 1e6, False)
    assert (cfg.qkv_bias, cfg.qk_norm) == (False, True)
    assert param_count(cfg) == 8_190_735_360
    # independent count: no q/k/v biases, a head_dim-wide q_norm and k_norm per layer, untied head
    e, i, l, v, h, kv, d = 4096, 12288, 36, 151936, 32, 8, 128
    per_layer = e * h * d + 2 * e * kv * d + h * d * e + 2 * d + 3 * e * i + 2 * e
    assert 2 * v * e + l * per_layer + e == 8_190_735_360
    # tied (the small Qwen3 sizes): one vocab x hidden table fewer; Qwen3-0.6B is such a model
    assert param_count(cfg.replace(tie_word_embeddings=True)) == 8_190_735_360 - v * e
    small = Qwen2Config.preset("qwen3-0.6b")
    assert small.tie_word_embeddings and small.head_dim == 128 != small.hidden_size // small.num_attention_heads
    e, i, l, h, kv = 1024, 3072, 28, 16, 8
    per_layer = e * h * d + 2 * e * kv * d + h * d * e + 2 * d + 3 * e * i + 2 * e
    assert param_count(small) == v * e + l * per_layer + e == 596_049_920
    # every logical axis of the new parameters has a sharding rule
    from sprint_jax.model import logical_axes
    from sprint_jax.model.sharding import logical_to_spec
    axes = logical_axes(cfg)
    assert axes["layers"]["q_norm"]["scale"] == ("layers", "norm") and "bias" not in axes["layers"]["q_proj"]
    for leaf in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)):
        logical_to_spec(leaf)


def test_qwen3_config_fields_and_hf_defaults():
    tiny = Qwen2Config.preset("tiny-qwen3")
    assert tiny.head_dim == 20 != tiny.hidden_size // tiny.num_attention_heads and tiny.tie_word_embeddings
    base = json.loads((Qwen2Config.preset.__globals__["CONFIG_DIR"] / "model_tiny-qwen3.json").read_text())
    # HF's Qwen3Config defaults head_dim to 128 (not hidden / heads) when config.json has none
    assert Qwen2Config.from_hf_config({k: v for k, v in base.items() if k != "head_dim"}).head_dim == 128
    # what HF writes for a plain Qwen3 is accepted: no sliding window, full attention everywhere
    ok = {**base, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
          "max_window_layers": 3, "layer_types": ["full_attention"] * 3,
          "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert Qwen2Config.from_hf_config(ok).rope_theta == 5e5
    # export and re-read: same config
    assert Qwen2Config.from_hf_config(tiny.to_hf_config()) == tiny
    with pytest.raises(ConfigError, match="model_type"):
        Qwen2Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, model_type="llama")


@pytest.mark.parametrize("preset,change,field", [
    ("tiny-qwen3", {"attention_bias": True}, "attention_bias"),
    ("tiny-qwen3", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("tiny-qwen3", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ("tiny-qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768}}, "rope_parameters"),
    ("tiny-qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ("tiny", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
])
def test_unsupported_qwen3_configs_are_rejected_naming_the_field(preset, change, field):
    base = json.loads((Qwen2Config.preset.__globals__["CONFIG_DIR"] / f"model_{preset}.json").read_text())
    with pytest.raises(ConfigError, match=field):
        Qwen2Config.from_hf_config({**base, **change})


def test_checkpoint_of_the_other_family_is_named(hf_untied):
    cfg = Qwen2Config.from_hf_config(hf_untied).replace(model_type="qwen3")
    with pytest.raises(CheckpointError, match="model_type"):
        from_pretrained(hf_untied, config=cfg)


@pytest.mark.parametrize("change,field", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_configs_are_rejected_naming_the_field(change, field):
    base = json.loads((Qwen2Config.preset.__globals__["CONFIG_DIR"] / "model_tiny.json").read_text())
    with pytest.raises(ConfigError, match=field):
        Qwen2Config.from_hf_config({**base, **change})


def test_hf_storage_dtype_does_not_choose_our_dtypes(hf_untied, tmp_path):
    """A checkpoint transformers saved in bf16 says so in config.json ("dtype"); that is how the
    file stores tensors, not how we compute: dtypes come from the caller, float32 by default."""
    import torch
    from conftest import load_hf

    load_hf(hf_untied, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert written.get("dtype", written.get("torch_dtype")) == "bfloat16"
    m = from_pretrained(tmp_path / "bf16")
    assert (m.config.param_dtype, m.config.dtype) == ("float32", "float32")
    base = json.loads((Qwen2Config.preset.__globals__["CONFIG_DIR"] / "model_tiny.json").read_text())
    for key in ("dtype", "torch_dtype"):
        cfg = Qwen2Config.from_hf_config({**base, key: "bfloat16"})
        assert (cfg.param_dtype, cfg.dtype) == ("float32", "float32")
    m = from_pretrained(tmp_path / "bf16", compute_dtype="bfloat16")
    assert (m.config.param_dtype, m.config.dtype) == ("float32", "bfloat16")
    with pytest.raises(ValueError, match="float16"):
        from_pretrained(tmp_path / "bf16", param_dtype=np.float16)


def test_export_meta_is_one_dict_and_tolerates_older_exports(tmp_path):
    from sprint_jax.model.hf import EXPORT_META_FILE, read_export_meta, update_export_meta

    assert read_export_meta(tmp_path) == {}                   # an export written before the file existed
    update_export_meta(tmp_path, layout="trie")
    update_export_meta(tmp_path, tokenizer="qwen2")           # other writers keep what is there
    assert read_export_meta(tmp_path) == {"layout": "trie", "tokenizer": "qwen2"}
    (tmp_path / EXPORT_META_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=EXPORT_META_FILE):
        read_export_meta(tmp_path)


def test_bad_checkpoints_name_the_tensor(hf_untied, tmp_path):
    def copy():
        d = tmp_path / f"ck{len(list(tmp_path.iterdir()))}"
        shutil.copytree(hf_untied, d)
        return d

    f = SafetensorsFile(hf_untied / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}

    d = copy()
    t = dict(tensors)
    del t["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(d)

    d = copy()
    t = dict(tensors)
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((24, 70), np.float32)
    write_safetensors(d / "model.safetensors", t)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*\(24, 70\).*\(24, 72\)"):
        from_pretrained(d)

    d = copy()
    write_safetensors(d / "model.safetensors", {**tensors, "model.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"unknown tensor model\.extra\.weight"):
        from_pretrained(d)

    d = copy()
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        from_pretrained(d, config=Qwen2Config.from_hf_config({**cfg, "num_hidden_layers": 4}))


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["hf_tied", "hf_qwen3_untied"])
def test_convert_cli_round_trip(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    orb, back = tmp_path / "orbax", tmp_path / "back"
    for cmd in (["convert", "--to", "orbax", str(src), str(orb)],
                ["convert", "--to", "hf", str(orb), str(back)]):
        r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", *cmd], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    a, b = SafetensorsFile(src / "model.safetensors"), SafetensorsFile(back / "model.safetensors")
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert np.array_equal(a.get(k), b.get(k)), k
    r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "convert", "--to", "hf", str(tmp_path / "nope"),
                        str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_orbax_shape_check_cannot_be_skipped(hf_tied, tmp_path):
    """The shape check before an orbax restore fails loudly (one line, exit 2) on a config that does
    not describe the stored tensors and on metadata it cannot read; it is never skipped."""
    orb = tmp_path / "orbax"
    r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "convert", "--to", "orbax", str(hf_tied), str(orb)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from sprint_jax.model.convert import load_orbax
    good = json.loads((orb / "config.json").read_text())
    (orb / "config.json").write_text(json.dumps({**good, "intermediate_size": good["intermediate_size"] + 1}))
    with pytest.raises(CheckpointError, match=r"has shape .* expected"):
        load_orbax(orb)
    (orb / "config.json").write_text(json.dumps(good))
    (orb / "params" / "_METADATA").write_text("{not json")
    (orb / "params" / "_CHECKPOINT_METADATA").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read the orbax metadata"):
        load_orbax(orb)
    r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "convert", "--to", "hf", str(orb), str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "cannot read the orbax metadata" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["train", "convert", "generate"])
def test_help_lists_every_supported_family(command):
    from sprint_jax.model.config import FAMILIES

    r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", command, "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    text = r.stdout.lower()
    for family in FAMILIES:
        assert family in text, (command, family)
