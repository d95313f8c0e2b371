"""The package's layers point down: a module imports only from its own component or a lower layer.

`LAYERS` below is the one statement of the order, bottom to top. Every import in sprint_jax/ and
kernels/ (installed as sprint_jax.kernels) is read with `ast`: module level, inside functions and
under `if TYPE_CHECKING:` alike, because an import deferred into a function is still a dependency
(it only moves the failure from import time to the first call). Two rules:

  * an import may name its own component or any component of a lower layer; components of one
    layer (curation, train and infer, say) are independent of each other;
  * no module imports another module's private (`_name`) names: a name another module needs is
    part of its owner's interface and is made public there.

Command modules (sprint_jax/cli.py, every */cli.py and *_cli.py) sit above everything and may
import anything; so may the `if __name__ == "__main__":` block of any module (it runs as a script).
No module below them may import a command module.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"sprint_jax": ROOT / "sprint_jax", "sprint_jax.kernels": ROOT / "kernels"}

# Bottom to top: (layer, what lives there, its components as {component: module prefixes}).
LAYERS: list[tuple[str, str, dict[str, tuple[str, ...]]]] = [
    ("base", "errors, dtypes, files, JSONL, output locks, tree checksums, config loading, the "
     "interrupt handler; the Pallas "
     "kernels with their dense references, which import nothing of the package",
     {"base": ("sprint_jax", "sprint_jax.errors", "sprint_jax.dtypes", "sprint_jax.fsutil",
               "sprint_jax.jsonl", "sprint_jax.outlock", "sprint_jax.treesum", "sprint_jax.config",
               "sprint_jax.interrupt"),
      "kernels": ("sprint_jax.kernels",)}),
    ("model", "the decoder, attention dispatch, sharding rules and mesh helpers, checkpoints, "
     "tokenizers, KV capacity", {"model": ("sprint_jax.model",)}),
    ("schema", "the SPRINT and ThreadWeaver text formats, training examples, the prompt format and "
     "the examples' shape (stages and prompts: the caps)",
     {"schema": ("sprint_jax.format", "sprint_jax.threadweaver", "sprint_jax.schema", "sprint_jax.caps")}),
    ("tasks", "task kinds: loaders, prompts, graders", {"tasks": ("sprint_jax.tasks",)}),
    ("pipelines", "curation (traces -> examples), training (examples -> weights), inference "
     "(weights -> text); independent of each other",
     {"curation": ("sprint_jax.curation",), "train": ("sprint_jax.train",),
      "infer": ("sprint_jax.infer",)}),
    ("plan", "planning a training run on TPU slices: the compiled step, per-chip memory, roofline",
     {"plan": ("sprint_jax.plan",)}),
    ("eval", "evaluation runs and reports", {"eval": ("sprint_jax.eval",)}),
    ("demo", "the end-to-end demo", {"demo": ("sprint_jax.demo",)}),
    ("rl", "reinforcement learning on the orchestrator's rollouts", {"rl": ("sprint_jax.rl",)}),
    ("serve", "the HTTP server", {"serve": ("sprint_jax.serve",)}),
    ("bench", "benchmarks", {"bench": ("sprint_jax.bench",)}),
    ("recipe", "the resumable recipe: curate, train, eval and compare as stages", {"recipe": ("sprint_jax.recipe",)}),
]
COMMANDS = "commands"   # the layer above all: sprint_jax.cli, *.cli, *_cli


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((pkg,) + parts)] = path
    return found


MODULES = _modules()


def is_command(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return module == "sprint_jax.cli" or last == "cli" or last.endswith("_cli")


def place(module: str) -> tuple[int, str] | None:
    """(layer index, component) of a module, None if in no layer. The longest matching prefix
    decides: a prefix names a module and everything under it, except the root "sprint_jax", which
    names only the package's own __init__."""
    if is_command(module):
        return len(LAYERS), COMMANDS
    best = None
    for i, (_, _, components) in enumerate(LAYERS):
        for comp, prefixes in components.items():
            for p in prefixes:
                under = module.startswith(p + ".") and p != "sprint_jax"
                if (module == p or under) and (best is None or len(p) > best[0]):
                    best = (len(p), i, comp)
    return None if best is None else (best[1], best[2])


def _is_main_guard(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def imports_of(module: str) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for every import of `module` into the package,
    outside `if __name__ == "__main__":` blocks. `from pkg import sub` names the submodule."""
    path = MODULES[module]
    return imports_in(path.read_text(), module, path.name == "__init__.py", str(path))


def imports_in(source: str, module: str, is_package: bool = False, filename: str = "<source>"):
    """`imports_of` for the text of `module` (a package's __init__ when `is_package`)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if _is_main_guard(child):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name, None) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = child.module or ""
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([target] if target else []))
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    found.append((child.lineno, sub, None) if sub in MODULES else
                                 (child.lineno, target, a.name))
            visit(child)

    visit(ast.parse(source, filename))
    return [(line, target, name) for line, target, name in found
            if target == "sprint_jax" or target.startswith("sprint_jax.")]


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def _layer_name(index: int) -> str:
    return COMMANDS if index == len(LAYERS) else LAYERS[index][0]


def test_the_reader_sees_deferred_relative_and_package_imports():
    source = """
import sprint_jax.errors
from . import data
from ..model import sharding
from sprint_jax.model.hf import parse_size
def f():
    from sprint_jax.infer import engine
    if True:
        import numpy
if __name__ == "__main__":
    from sprint_jax.cli import main
"""
    assert imports_in(source, "sprint_jax.train.trainer") == [
        (2, "sprint_jax.errors", None), (3, "sprint_jax.train.data", None),
        (4, "sprint_jax.model.sharding", None), (5, "sprint_jax.model.hf", "parse_size"),
        (7, "sprint_jax.infer.engine", None)]
    assert place("sprint_jax.infer.engine") == (place("sprint_jax.train.trainer")[0], "infer")
    assert place("sprint_jax.eval.cli")[1] == COMMANDS and place("sprint_jax.kernels.splash")[1] == "kernels"


def test_every_module_has_a_layer():
    lost = sorted(m for m in MODULES if place(m) is None)
    if lost:
        pytest.fail("modules in no layer: " + ", ".join(lost) + "\nAdd each (or its package) to the "
                    "component of LAYERS in tests/test_layers.py where it belongs: above everything it "
                    "imports, below everything that imports it.", pytrace=False)


def test_imports_point_down():
    bad = []
    for module in sorted(m for m in MODULES if place(m) is not None):    # the others fail above
        here, comp = place(module)
        for line, target, name in imports_of(module):
            if place(target) is None:
                continue
            there, other = place(target)
            if here == len(LAYERS) or other == comp or there < here:
                continue
            what = "a higher layer" if there > here else "an independent component of its own layer"
            entry = (f"{_where(module, line)}: {module} ({_layer_name(here)}/{comp}) imports {target} "
                     f"({_layer_name(there)}/{other}), {what}")
            if entry not in bad:
                bad.append(entry)
    if bad:
        pytest.fail(
        "imports that point up or sideways (layers, bottom to top: "
        + " < ".join(n for n, _, _ in LAYERS) + f" < {COMMANDS}):\n  " + "\n  ".join(bad)
        + "\nMove what the lower module needs down to its layer (or lower) and import it from there; "
          "or, if the importer really belongs higher, move it up. A deferred import inside a function "
          "counts too. Change LAYERS in tests/test_layers.py only when the design itself changes.",
        pytrace=False)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_attribute_uses(module: str) -> list[tuple[int, str, str]]:
    """(line, other module, name) for every `alias._name` where `alias` is another module of the
    package imported under that name (`import sprint_jax.x as alias`, `from sprint_jax import x`)."""
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" in MODULES})
    return [(node.lineno, aliases[node.value.id], node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in aliases and aliases[node.value.id] != module and _private(node.attr)]


def test_no_private_names_across_modules():
    bad: dict[tuple[str, int, str], list[str]] = {}
    for module in sorted(MODULES):
        for line, target, name in imports_of(module):
            privates = [p for p in target.split(".") + ([name] if name else []) if _private(p)]
            if target != module and privates:
                bad.setdefault((module, line, target), []).extend(privates)
        for line, target, name in private_attribute_uses(module):
            bad.setdefault((module, line, target), []).append(name)
    if bad:
        pytest.fail(
            "imports of another module's private names:\n  "
            + "\n  ".join(f"{_where(m, line)}: {m} imports {', '.join(names)} from {target}"
                          for (m, line, target), names in bad.items())
            + "\nA name another module needs is part of its owner's interface: drop the underscore "
              "there (with a docstring saying its contract) and import the public name.", pytrace=False)
