"""Pallas kernels, importable only as `sprint_jax.kernels` (docs/design.md
"Attention", the kernels/ name trap).

pyproject's `package-dir` maps this directory to `sprint_jax.kernels`. With the repo root on
sys.path (`python -c` or `python -m pytest` run there), Python's path finder also finds it as a
top-level `kernels`, and transformers, probing for HF's kernel-hub package of that name, imports
whatever `kernels` it finds while loading a model class. Reached under any name but
`sprint_jax.kernels`, this file therefore loads nothing and leaves in sys.modules an empty
placeholder without __file__ or __path__ (transformers reads that as "not installed", and
`kernels.shared_prefix` is unreachable). Inside this directory use relative imports only.
"""
import sys as _sys

if __name__ != "sprint_jax.kernels":
    import types as _types

    _sys.modules[__name__] = _types.ModuleType(
        __name__, "placeholder: the repo's kernels/ is importable only as sprint_jax.kernels")
else:
    from .shared_prefix import (
        BlockSizes,
        bytes_read,
        copy_fork_bytes_read,
        default_block_sizes,
        shared_prefix_attention,
        shared_prefix_attention_reference,
    )
    from .parent_prefix import (
        default_group_block_sizes,
        group_bytes_read,
        grouped_prefix_attention,
        grouped_prefix_attention_reference,
    )

    __all__ = [
        "BlockSizes",
        "bytes_read",
        "copy_fork_bytes_read",
        "default_block_sizes",
        "default_group_block_sizes",
        "group_bytes_read",
        "grouped_prefix_attention",
        "grouped_prefix_attention_reference",
        "shared_prefix_attention",
        "shared_prefix_attention_reference",
    ]
