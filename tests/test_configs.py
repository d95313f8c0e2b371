"""Every file in configs/ loads with the loader its name selects."""
from __future__ import annotations

from pathlib import Path

import pytest

from sprint_jax.config import CONFIG_DIR, ConfigError, load_config

FILES = sorted(p for p in CONFIG_DIR.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def _load(path: Path):
    name = path.name
    if name.startswith("model_"):
        from sprint_jax.model import Qwen2Config
        return Qwen2Config.from_hf_config(path)
    if name.startswith("curate_"):
        from sprint_jax.curation.config import load_curate_config
        return load_curate_config(path)
    if name.startswith("sft_"):
        from sprint_jax.train.config import load_train_config
        return load_train_config(path)
    if name.startswith("demo"):
        from sprint_jax.demo import DemoConfig
        return load_config(DemoConfig, path)
    if name.startswith("rl_"):
        from sprint_jax.rl.config import RLConfig
        return load_config(RLConfig, path)
    if name.startswith("eval"):
        from sprint_jax.infer.orchestrator import OrchestratorConfig
        return load_config(OrchestratorConfig, path)
    if name.startswith("selftrain_"):
        from sprint_jax.selftrain_cli import SelftrainConfig
        return load_config(SelftrainConfig, path)
    if name.startswith("recipe_"):
        from sprint_jax.recipe.config import load_recipe_config
        return load_recipe_config(path)
    raise AssertionError(f"configs/{name}: no loader for this file name; add one here")


def test_every_config_the_docs_and_code_name_exists():
    """Config paths written in README.md, the package and configs/ itself are files here."""
    import re

    from sprint_jax.config import REPO_ROOT

    texts = [REPO_ROOT / "README.md"] + sorted((REPO_ROOT / "sprint_jax").rglob("*.py")) + FILES
    named = {m for t in texts for m in re.findall(r"configs/([a-z0-9_.\-]+\.(?:ya?ml|json))\b", t.read_text())}
    assert "sft_tiny_cpu.yaml" in named                       # the README's training example
    assert named <= {p.name for p in FILES}, sorted(named - {p.name for p in FILES})


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_config_loads(path):
    assert _load(path) is not None


def test_unknown_and_ill_typed_fields_are_named():
    from sprint_jax.demo import DemoConfig
    with pytest.raises(ConfigError, match="stepz"):
        load_config(DemoConfig, None, ["stepz=3"])
    with pytest.raises(ConfigError, match="model.hidden_size"):
        load_config(DemoConfig, None, ["model.hidden_size=big"])


def test_rl_configs_hold_out_a_set_that_exists():
    """An RL config's held-out source is a generator, a name `--data` knows (the shipped
    MATH-500), or a file shipped here: the 7B run must not stop before its first step."""
    from sprint_jax.rl.config import RLConfig
    from sprint_jax.tasks import load_tasks
    for path in (p for p in FILES if p.name.startswith("rl_")):
        source = load_config(RLConfig, path).tasks.eval_source
        if source is not None:
            assert len(load_tasks(source)) > 0, path.name
    assert len(load_tasks(load_config(RLConfig, CONFIG_DIR / "rl_r1_distill_7b.yaml").tasks.eval_source)) == 500


def test_qwen3_8b_configs_fit_the_model_and_agree():
    """The Qwen3-8B SFT, RL and recipe configs name the qwen3-8b preset's checkpoint, use no more
    positions than the model has, and the recipe trains the step the SFT config was planned with."""
    import json

    from sprint_jax.recipe.config import load_recipe_config
    from sprint_jax.rl.config import RLConfig
    from sprint_jax.train.config import load_train_config

    positions = json.loads((CONFIG_DIR / "model_qwen3-8b.json").read_text())["max_position_embeddings"]
    assert positions == 40960                                  # the HF config of Qwen/Qwen3-8B
    sft = load_train_config(CONFIG_DIR / "sft_qwen3_8b_sprint.yaml")
    assert Path(sft.model.name).name.lower() == "qwen3-8b"    # planned as that preset when not on the host
    assert sft.data.seq_len == positions and sft.data.layout == "trie"
    rl = load_config(RLConfig, CONFIG_DIR / "rl_qwen3_8b.yaml")
    assert rl.loss.seq_len <= positions and rl.rollout.max_seq_len <= positions
    assert rl.rollout.orchestrator.max_total_tokens <= rl.loss.seq_len    # one run's trie fits a row
    recipe = load_recipe_config(CONFIG_DIR / "recipe_sprint_qwen3_8b.yaml")
    assert recipe.sprint_layout == sft.data.layout and recipe.train["model"]["name"] == sft.model.name
    data = recipe.train["data"]
    assert (data["seq_len"], data["buckets"], data["trie_whole_trajectory"]) == (
        sft.data.seq_len, sft.data.buckets, sft.data.trie_whole_trajectory)
    optim = recipe.train["optim"]
    assert (optim["batch_size"], optim["grad_accum"]) == (sft.optim.batch_size, sft.optim.grad_accum)
    assert recipe.train["mesh"] == {"data": sft.mesh.data, "fsdp": sft.mesh.fsdp, "tensor": sft.mesh.tensor}
