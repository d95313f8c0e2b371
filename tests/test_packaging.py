"""The wheel a user installs (`pip install .`, not editable) holds every package, kernel, config
and data file of the checkout, and an installed copy finds its configs from any directory."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True)
    (whl,) = out.glob("sprint_jax-*.whl")
    return whl


def _source_files() -> set[str]:
    """What the wheel must hold, as its paths: every .py of sprint_jax/ and kernels/, every config,
    the shipped data files."""
    want = {str(p.relative_to(ROOT)) for p in (ROOT / "sprint_jax").rglob("*.py") if "__pycache__" not in p.parts}
    want |= {f"sprint_jax/kernels/{p.name}" for p in (ROOT / "kernels").glob("*.py")}
    want |= {f"sprint_jax/configs/{p.name}" for p in (ROOT / "configs").iterdir() if p.suffix in (".yaml", ".json")}
    want |= {"sprint_jax/data/math500.jsonl", "sprint_jax/data/SOURCES.md",
             "sprint_jax/data/qwen2_tokenizer/vocab.json", "sprint_jax/data/qwen2_tokenizer/merges.txt"}
    return want


def test_wheel_holds_every_package_config_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"not in the wheel: {missing}"
    assert "sprint_jax/rl/trainer.py" in names                   # a subpackage once left out by hand
    assert not any(n.startswith("kernels/") for n in names)      # never a top-level `kernels` package
    assert not any("__pycache__" in n for n in names)


def test_installed_copy_finds_its_configs_from_another_directory(wheel, tmp_path, monkeypatch):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # Load the installed config module by file, so the checkout's editable install cannot answer.
    spec = importlib.util.spec_from_file_location("installed_sprint_config", target / "sprint_jax" / "config.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.CONFIG_DIR == target / "sprint_jax" / "configs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    found = installed.resolve_config_path("configs/sft_tiny_cpu.yaml")
    assert found == target / "sprint_jax" / "configs" / "sft_tiny_cpu.yaml"
    assert installed.read_yaml("configs/sft_tiny_cpu.yaml") == installed.read_yaml(ROOT / "configs" / "sft_tiny_cpu.yaml")
    # a file of the user's own with the same relative name wins over the shipped one
    (elsewhere / "configs").mkdir()
    (elsewhere / "configs" / "sft_tiny_cpu.yaml").write_text("steps: 3\n")
    assert installed.read_yaml("configs/sft_tiny_cpu.yaml") == {"steps": 3}
