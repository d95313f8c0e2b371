"""Small file-system helpers shared by every command that writes results."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that a reader (or a later run after a kill) sees either the old
    file or the whole new one: a temporary file beside it, flushed to disk, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = ["write_atomic"]
