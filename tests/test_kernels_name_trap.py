"""kernels/ must never load as a top-level `kernels` package (docs/design.md
"Attention", the kernels/ name trap).

transformers imports any `kernels` it can find while loading a model class (it probes for HF's
kernel hub). Run from the repo root, the way `python -c` and `python -m pytest` put it on
sys.path, in a fresh interpreter so that nothing imported by this test process interferes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # runs subprocesses (the `slow` marker: pyproject.toml)

REPO = Path(__file__).resolve().parents[1]
OURS = str(REPO / "kernels")

_OURS_LOADED = """
def ours_loaded(ours):
    hits = []
    for name, mod in list(sys.modules.items()):
        where = [getattr(mod, "__file__", None)]
        try:  # some extension modules expose a __path__ that is not a list of str
            where += list(getattr(mod, "__path__", None) or [])
        except TypeError:
            pass
        if any(os.path.abspath(w) == ours or os.path.abspath(w).startswith(ours + os.sep)
               for w in where if isinstance(w, str) and w):
            hits.append(name)
    return hits
"""

TRANSFORMERS_FIRST = """
import json, os, sys
assert sys.path[0] == "" and os.getcwd() == REPO, (sys.path[:2], os.getcwd())
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
model = Qwen2ForCausalLM(config)
logits = model(torch.tensor([[1, 2, 3]])).logits
after_transformers = ours_loaded(OURS)
import kernels
top_level = {"file": getattr(kernels, "__file__", None), "path": getattr(kernels, "__path__", None),
             "has_kernel": hasattr(kernels, "shared_prefix_attention")}
try:
    import kernels.shared_prefix
    submodule = "imported"
except ImportError:
    submodule = "ImportError"
import sprint_jax.kernels as sk
print(json.dumps({"after_transformers": after_transformers, "top_level": top_level,
                  "submodule": submodule, "ours_file": sk.__file__,
                  "ours_has_kernel": callable(sk.shared_prefix_attention),
                  "logits_shape": list(logits.shape)}))
"""

OURS_FIRST = """
import importlib, json, os, sys
import sprint_jax.kernels as sk
probe = importlib.import_module("kernels")  # what transformers' availability probe does
loaded = ours_loaded(OURS)
print(json.dumps({"loaded": sorted(loaded), "kernels_file": getattr(probe, "__file__", None),
                  "same": probe is sk}))
"""


def _run(body: str, cwd: Path) -> dict:
    prelude = f"import os, sys\nREPO = {str(REPO)!r}\nOURS = {OURS!r}\n" + _OURS_LOADED
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", prelude + body], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transformers_does_not_import_our_kernels_from_repo_root():
    out = _run(TRANSFORMERS_FIRST, REPO)
    assert out["logits_shape"] == [1, 3, 61]
    assert out["after_transformers"] == [], out
    # `import kernels` from the repo root yields an empty placeholder, never our package.
    assert out["top_level"] == {"file": None, "path": None, "has_kernel": False}
    assert out["submodule"] == "ImportError"
    assert out["ours_file"] == os.path.join(OURS, "__init__.py")
    assert out["ours_has_kernel"]


def test_our_package_loaded_first_is_not_loaded_again_as_kernels():
    out = _run(OURS_FIRST, REPO)
    assert out["kernels_file"] is None and not out["same"]
    assert all(name == "sprint_jax.kernels" or name.startswith("sprint_jax.kernels.")
               for name in out["loaded"]), out["loaded"]
    assert "sprint_jax.kernels.shared_prefix" in out["loaded"]


def test_kernels_not_findable_outside_the_repo_root(tmp_path):
    out = _run("import importlib.util, json\n"
               "spec = importlib.util.find_spec('kernels')\n"
               "import sprint_jax.kernels as sk\n"
               "print(json.dumps({'origin': spec and spec.origin, 'ours': sk.__file__}))\n",
               tmp_path)
    assert out["origin"] is None or not out["origin"].startswith(OURS)
    assert out["ours"] == os.path.join(OURS, "__init__.py")
