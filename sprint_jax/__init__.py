"""sprint-jax: SPRINT (Biju et al., 2025) in JAX/Flax.

Subpackages: model (Qwen2 port, HF checkpoints), infer (engine, orchestrator), train (sharded SFT),
tasks (per task kind: loader, prompt, grader; shared by curation and eval), curation (traces ->
SPRINT examples), eval (runs, reports), bench, kernels (Pallas); data/ holds the package data
(MATH-500, the Qwen2 BPE files; see data/SOURCES.md).

Importing the package chooses where JAX runs (`choose_platform`, below), before JAX is imported.
"""
from __future__ import annotations

__version__ = "0.1.0"

# ---------------------------------------------------------------------------------------------
# The platform. Where JAX runs, chosen once, when the package is imported (before JAX is).
#
# An environment may hold accelerator plugins for a machine it is not on: the test extras install
# libtpu (`plan` compiles for TPU slices) and the CUDA plugin (`plan` compiles for NVIDIA GPUs), and
# both then probe at every start on a CPU machine, printing libtpu's "Failed to find host bounds"
# and "unexpected worker hostname" errors, or a "RuntimeError: Unable to load CUDA" traceback, before
# JAX falls back to its CPU. So:
#
#   * JAX_PLATFORMS, when the user set it (even empty), is kept as it is;
#   * else, when this machine has no accelerator device (`accelerator_devices`: TPU chips appear as
#     /dev/accel* or /dev/vfio/N, NVIDIA GPUs as /dev/nvidia*, AMD GPUs as /dev/kfd), it is set to
#     "cpu": nothing probes, and compile-only targets (`plan`'s TPU and GPU topologies) still work;
#   * on a machine with no NVIDIA device, the CUDA plugin's libraries, when installed, are loaded
#     here with their start-up notes ("Could not find cuda drivers on your machine") kept off the
#     terminal: they print them when loaded, whatever JAX_PLATFORMS says.
#
# Nothing is done when JAX is already imported (its platform is then fixed). `JAX_PLATFORMS=` (set,
# empty) leaves the choice to JAX itself.
import os
import sys
from pathlib import Path

# the CUDA plugin's modules that print their note when loaded (found by importing each alone)
_CUDA_NOTE_MODULES = ("jax_cuda12_plugin._solver", "jax_cuda12_plugin._prng", "jax_cuda12_plugin._linalg")
_CUDA_NOTES = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


def accelerator_devices(dev: str | Path = "/dev") -> dict[str, list[str]]:
    """{'tpu': [...], 'gpu': [...]}: the accelerator device files under `dev` (names only)."""
    root = Path(dev)

    def names(pattern: str) -> list[str]:
        try:
            return sorted(str(p.relative_to(root)) for p in root.glob(pattern))
        except OSError:
            return []

    vfio = [n for n in names("vfio/*") if n.split("/")[-1].isdigit()]     # not the vfio control node
    return {"tpu": names("accel*") + vfio, "gpu": names("nvidia[0-9]*") + names("kfd")}


def platform_for(environ, devices: dict[str, list[str]]) -> str | None:
    """The JAX_PLATFORMS to set: "cpu" when `environ` has none and `devices`
    (`accelerator_devices`) lists no accelerator, else None (leave JAX's own choice)."""
    return None if "JAX_PLATFORMS" in environ or devices["tpu"] or devices["gpu"] else "cpu"


def choose_platform(environ=os.environ, dev: str | Path = "/dev") -> str | None:
    """Apply `platform_for` to `environ` (before JAX is imported; nothing once it is) and keep the
    CUDA plugin's load-time notes off stderr when there is no NVIDIA device. Returns the value it
    set, or None."""
    if "jax" in sys.modules:
        return None
    found = accelerator_devices(dev)
    if not any(n.startswith("nvidia") for n in found["gpu"]):
        _load_cuda_plugin_quietly()
    chosen = platform_for(environ, found)
    if chosen is not None:
        environ["JAX_PLATFORMS"] = chosen
    return chosen


def _plugin_matches_jaxlib() -> bool:
    """The CUDA plugin is the installed jaxlib's version: JAX loads only such a plugin (it skips
    another with a warning), so only such a one is loaded ahead of it."""
    from importlib import metadata

    try:
        return metadata.version("jax-cuda12-plugin") == metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return False


def _load_cuda_plugin_quietly() -> None:
    """Load the CUDA plugin's libraries (if installed) with file descriptor 2 sent to a file, then
    write back to stderr whatever else they printed. Loaded once, they print nothing when JAX loads
    them again."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations or not _plugin_matches_jaxlib():
        return
    import ctypes
    import tempfile

    library = Path(list(spec.submodule_search_locations)[0]) / "xla_cuda_plugin.so"
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:                               # no stderr to protect: JAX loads the plugin as usual
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            if library.exists():
                ctypes.CDLL(str(library))
            for name in _CUDA_NOTE_MODULES:
                try:
                    importlib.import_module(name)
                except ImportError:
                    pass
        except OSError:
            pass                                  # JAX reports a library it cannot load itself
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        rest = [line for line in caught.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not any(note in line for note in _CUDA_NOTES)]
    if rest and sys.stderr is not None:
        sys.stderr.write("".join(rest))


choose_platform()


def install_command(extra: str) -> str:
    """The pip command that adds the optional dependencies `extra` (e.g. "tpu") to this installation:
    `pip install -e '.[tpu]'` when the package runs from a checkout (an editable install: run it
    there), `pip install 'sprint-jax[tpu]'` for an installed wheel or sdist."""
    checkout = (Path(__file__).resolve().parents[1] / "pyproject.toml").is_file()
    return f"pip install -e '.[{extra}]'" if checkout else f"pip install 'sprint-jax[{extra}]'"
