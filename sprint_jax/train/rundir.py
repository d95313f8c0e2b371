"""What a training run's output directory holds, read without JAX: the finished checkpoints, and
what rerunning the same command into it does (the line an interrupted `train` ends with)."""
from __future__ import annotations

from pathlib import Path


def saved_steps(out: str | Path) -> list[int]:
    """The steps of the finished checkpoints under OUT/checkpoints, ascending (orbax writes a
    temporary directory and renames it to the step's number when the save is complete)."""
    d = Path(out) / "checkpoints"
    try:
        return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def rerun_note(out: str | Path) -> str:
    """What rerunning the same command into `out` does."""
    steps = saved_steps(out)
    if steps:
        return (f"rerun the same command to resume from step {steps[-1]} "
                f"(checkpoint {Path(out) / 'checkpoints' / str(steps[-1])})")
    return "no checkpoint was written yet: rerunning the same command starts from step 0"


__all__ = ["saved_steps", "rerun_note"]
