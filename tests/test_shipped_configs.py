"""Every shipped config runs from any directory of an installed copy, on data the package carries or
a documented command makes: `recipe run configs/NAME` finds the shipped recipe as `train` and `plan`
find theirs, the tiny SFT configs read the package's examples (never the suite's tests/data), and
an install hint names the command that fits the installation (a checkout's editable install, or
a wheel)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_packaging import wheel  # noqa: F401  (the module-scoped fixture: the checkout's wheel)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_DATA = {"sft_tiny_sprint.jsonl": 24, "sft_tiny_threadweaver.jsonl": 16}


def test_no_shipped_config_points_at_the_test_suite():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        body = [line.split("#")[0] for line in path.read_text().splitlines()]
        assert not [line for line in body if "tests/" in line], path.name


def test_the_package_carries_the_tiny_configs_examples_as_the_suite_has_them():
    for name, n in SHIPPED_DATA.items():
        shipped = (ROOT / "sprint_jax" / "data" / name).read_bytes()
        assert shipped == (ROOT / "tests" / "data" / name).read_bytes()
        assert len(shipped.splitlines()) == n


def test_install_hint_in_a_checkout_is_the_editable_one(monkeypatch):
    import sprint_jax
    import sprint_jax.plan.compile as plan_compile
    from sprint_jax.errors import UserError
    from sprint_jax.plan.chips import parse_slices

    assert sprint_jax.install_command("tpu") == "pip install -e '.[tpu]'"
    monkeypatch.setattr(plan_compile, "libtpu_available", lambda: False)
    with pytest.raises(UserError, match=r"comes with libtpu: pip install -e '\.\[tpu\]'$"):
        plan_compile.compiler_available(parse_slices("v5e:2x2"))


@pytest.mark.slow
def test_an_installed_copy_runs_its_configs_from_another_directory(wheel, tmp_path):  # noqa: F811
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
    script = """
import json, sprint_jax
from sprint_jax.train.config import load_train_config
from sprint_jax.train.data import read_examples
counts = {}
for name in ("sft_tiny_cpu", "sft_tiny_cpu_threadweaver"):
    cfg = load_train_config(f"configs/{name}.yaml")
    counts[name] = len(read_examples(cfg.data.train, data_format=cfg.data.format))
import sprint_jax.plan.compile as plan_compile
from sprint_jax.plan.chips import parse_slices
plan_compile.libtpu_available = lambda: False        # as on a machine without the tpu extra
try:
    plan_compile.compiler_available(parse_slices("v5e:2x2"))
    plan_error = None
except Exception as e:
    plan_error = str(e)
print(json.dumps({"file": sprint_jax.__file__, "counts": counts, "hint": sprint_jax.install_command("tpu"),
                  "plan_error": plan_error}))
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"] == str(target / "sprint_jax" / "__init__.py")          # the installed copy ran
    assert got["counts"] == {"sft_tiny_cpu": 24, "sft_tiny_cpu_threadweaver": 16}
    assert got["hint"] == "pip install 'sprint-jax[tpu]'"
    assert got["plan_error"].endswith("comes with libtpu: pip install 'sprint-jax[tpu]'"), got["plan_error"]
    # recipe run finds the shipped recipe: it goes on to the next check (an --out that is a file)
    (elsewhere / "taken").write_text("")
    r = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "recipe", "run", "configs/recipe_tiny_cpu.yaml",
                        "--out", "taken"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "--out taken exists and is not a directory" in r.stderr, r.stderr[-2000:]


def test_the_served_teacher_config_names_the_model_its_comment_serves():
    """curate_countdown_served.yaml's teacher.model is the id `sprint-jax serve` gives the model its
    header comment serves (the demo's SPRINT export), so the two commands work as written."""
    from sprint_jax.config import read_yaml
    from sprint_jax.curation.config import load_curate_config
    from sprint_jax.serve.cli import model_name

    path = ROOT / "configs" / "curate_countdown_served.yaml"
    (serve,) = [line for line in path.read_text().splitlines() if "sprint-jax serve --model" in line]
    served = serve.split("--model")[1].split()[0]
    assert model_name(served) == load_curate_config(path).teacher.model == read_yaml(path)["teacher"]["model"]
