"""Model presets, config rejection, checkpoint error messages, the convert command."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

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
def test_convert_cli_round_trip(hf_tied, tmp_path):
    orb, back = tmp_path / "orbax", tmp_path / "back"
    for cmd in (["convert", "--to", "orbax", str(hf_tied), str(orb)],
                ["convert", "--to", "hf", str(orb), str(back)]):
        r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", *cmd], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    a, b = SafetensorsFile(hf_tied / "model.safetensors"), SafetensorsFile(back / "model.safetensors")
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert np.array_equal(a.get(k), b.get(k)), k
    r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "convert", "--to", "hf", str(tmp_path / "nope"),
                        str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
