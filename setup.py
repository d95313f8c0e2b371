"""Package discovery (the rest of the build is in pyproject.toml).

Every package under sprint_jax/ is found automatically. Two top-level folders install inside the
package: kernels/ as sprint_jax.kernels (never as a top-level `kernels`: transformers imports any
top-level package of that name it finds while loading a model class, and HF's own `kernels`
package would shadow ours) and configs/ as sprint_jax.configs, so presets and run configs are
found from any working directory of an installed copy.
"""
from setuptools import find_namespace_packages, setup

MAPPED = {"sprint_jax.kernels": "kernels", "sprint_jax.configs": "configs"}

setup(
    packages=[p for p in find_namespace_packages(include=["sprint_jax", "sprint_jax.*"])
              if "__pycache__" not in p] + list(MAPPED),
    package_dir=MAPPED,
)
