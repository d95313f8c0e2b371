"""Where JAX runs is chosen once, when sprint_jax is imported: an environment holding libtpu and the
CUDA plugin (the test extras) runs every command on a machine without accelerators with no probe
errors, and a machine with one, or a JAX_PLATFORMS the user set, is left to JAX."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sprint_jax

ROOT = Path(__file__).resolve().parents[1]
SPRINT_JAX = Path(sys.executable).with_name("sprint-jax")
# what libtpu and the CUDA plugin print when they probe a machine that has neither
PROBE_TEXTS = ("libtpu", "TPU", "host bounds", "worker hostname", "CUDA", "cuda", "Traceback", "E0000")


def _dev(tmp_path: Path, *names: str) -> Path:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in names:
        (dev / name).parent.mkdir(parents=True, exist_ok=True)
        (dev / name).touch()
    return dev


@pytest.mark.parametrize("names, platform", [
    ((), "cpu"),
    (("null", "vfio/vfio", "nvidiactl", "dri/card0"), "cpu"),     # no accelerator among them
    (("accel0",), None),                                           # a TPU chip (v4 and earlier, v5e)
    (("vfio/vfio", "vfio/0"), None),                               # a TPU chip through VFIO (v5p, v6e)
    (("nvidiactl", "nvidia0"), None),                              # an NVIDIA GPU
    (("kfd",), None),                                              # an AMD GPU (ROCm)
])
def test_the_platform_is_cpu_only_on_a_machine_without_accelerators(tmp_path, names, platform):
    devices = sprint_jax.accelerator_devices(_dev(tmp_path, *names))
    assert sprint_jax.platform_for({}, devices) == platform
    for users in ("tpu", "cpu", ""):          # a JAX_PLATFORMS the user set, empty too, is kept
        assert sprint_jax.platform_for({"JAX_PLATFORMS": users}, devices) is None


def _probe_free_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["COLUMNS"] = "200"
    return env


@pytest.mark.slow
def test_commands_print_no_accelerator_probe_on_a_machine_without_one(hf_untied, tmp_path):
    """With JAX_PLATFORMS unset, outside the repository: the top-level help, a command's help and a
    command that initializes JAX's backends (a one-token `generate`) write nothing of libtpu's or
    the CUDA plugin's probes to stderr. The suite's environment holds both (the test extras)."""
    if any(sprint_jax.accelerator_devices().values()):
        pytest.skip("this machine has an accelerator: JAX is left to probe it")
    env = _probe_free_env()
    for args in (["--help"], ["plan", "--help"],
                 ["generate", "--model", str(hf_untied), "--token-ids", "5,17", "--max-new-tokens", "1"]):
        r = subprocess.run([str(SPRINT_JAX), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        probes = [line for line in r.stderr.splitlines() if any(t in line for t in PROBE_TEXTS)]
        assert not probes, (args, probes[:5])
    assert "stop: length" in r.stdout


def test_dev_sh_leaves_the_platform_to_the_package(tmp_path):
    """dev.sh runs the demo and any command as they are: on a TPU VM they must not be held on the
    CPU by the wrapper; a JAX_PLATFORMS the user set still reaches the command."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "seen"
    for name in ("python", "sprint-jax"):
        exe = venv / "bin" / name
        exe.write_text(f'#!/bin/sh\necho "{name} JAX_PLATFORMS=${{JAX_PLATFORMS-unset}}" >> "{log}"\n')
        exe.chmod(0o755)
    env = dict(_probe_free_env(), SPRINT_JAX_VENV=str(venv))
    subprocess.run(["bash", str(ROOT / "dev.sh"), "sprint-jax", "--help"], env=env, check=True, capture_output=True)
    assert log.read_text().splitlines()[-1] == "sprint-jax JAX_PLATFORMS=unset"
    subprocess.run(["bash", str(ROOT / "dev.sh"), "sprint-jax", "--help"], env=dict(env, JAX_PLATFORMS="tpu"),
                   check=True, capture_output=True)
    assert log.read_text().splitlines()[-1] == "sprint-jax JAX_PLATFORMS=tpu"


def test_the_test_extras_compile_for_gpus_without_cuda_libraries():
    """CI plans for NVIDIA GPUs on CPU hosts: the test extras hold the CUDA plugin alone (its PJRT
    plugin, no CUDA libraries: not jax[cuda12] nor the plugin's [with-cuda])."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "jax-cuda12-plugin==0.10.2" in extras["test"]
    assert not [d for d in extras["test"] if "cuda12]" in d or "with-cuda" in d]
