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
