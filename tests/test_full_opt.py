"""The rest of the suite compiles with XLA's CPU backend at optimisation level 0 (conftest.py: the
suite is compile-bound). This test runs the HF-parity module (logits, generate and every
parameter's gradient against HF PyTorch) and the train step's flash-vs-dense exactness module
again in a subprocess at XLA's default backend, the one users run, so the production machine code
is checked against the independent references too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # a subprocess running two test modules

ROOT = Path(__file__).resolve().parents[1]


def test_parity_modules_pass_on_xlas_default_backend():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["SPRINT_JAX_TEST_FULL_OPT"] = "1"
    env.pop("XLA_FLAGS", None)
    # with SPRINT_JAX_TEST_FULL_OPT set, conftest leaves XLA_FLAGS alone (XLA's default backend)
    probe = subprocess.run([sys.executable, "-c", "import os, conftest; print(repr(os.environ.get('XLA_FLAGS')))"],
                           env=env, cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.strip() == "None", probe.stdout + probe.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "tests/test_model_parity.py",
                        "tests/test_flash_attention.py::test_train_loss_and_grads_every_remat_policy_equal_the_dense_step"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
