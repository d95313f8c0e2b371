"""`sprint-jax bench demo-train`: the old-vs-new demo training benchmark runs end to end on a tiny
setting, each side importing its own tree (checked by the child against the path it was given),
and a bad --baseline-tree is one line and exit 2. No timing is asserted (performance is measured by
running the bench, never by tests)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "sprint_jax.cli", "bench", "demo-train", *args],
                          env=env, capture_output=True, text=True, timeout=900, cwd=cwd)


def test_bad_baseline_tree_is_one_line(tmp_path):
    for tree in (tmp_path / "nothing", ROOT):
        p = _bench("--baseline-tree", str(tree), cwd=tmp_path)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "--baseline-tree" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_interleaved_runs_of_two_trees(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(ROOT / "sprint_jax", old / "sprint_jax", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "r.json"
    p = _bench("--baseline-tree", str(old), "--reps", "1", "--layouts", "flat", "--steps", "10", "--skip", "5",
               "--problems", "24", "--batch-size", "4", "--work", str(tmp_path / "w"), "--out", str(out),
               cwd=tmp_path)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    r = json.loads(out.read_text())
    runs = r["runs"]
    assert [x["tree"] for x in runs] == ["baseline", "this"]
    assert runs[0]["code"] == str(old / "sprint_jax") and runs[1]["code"] == str(ROOT / "sprint_jax")
    for x in runs:
        assert x["window_tokens"] > 0 and x["tokens_per_s"] > 0 and x["tokens_per_cpu_s"] > 0
        assert x["batch_size"] == 4 and 0 < x["fill"] <= 1
    # the same code, data and seed on both sides: the same training
    assert runs[0]["final_loss"] == runs[1]["final_loss"]
    assert set(r["summary"]["flat"]["ratio_this_over_baseline"]) == {"wall_median", "wall_best", "cpu_median",
                                                                      "cpu_best"}
