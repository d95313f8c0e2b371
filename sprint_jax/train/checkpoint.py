"""orbax checkpoints of the whole train state, written atomically and verified on restore.

docs/design.md "Reliability contract": checkpoints are written atomically (orbax writes a temporary
directory and renames it when every process has finished, so a kill mid-save leaves no step
directory) and verified on restore: each checkpoint carries a checksum of every array's bits
(written at save time, recomputed after reading: exact, so a flipped byte or two swapped values
are caught), every floating-point array must be finite (a NaN compares false with everything, so
it must be looked for), and the older fingerprint (per-leaf sums and absolute sums) is still
checked. A latest checkpoint that fails to read or to verify is moved aside to `quarantine/`
with a loud warning, and the previous one is used. A state that is not finite is never saved.

A checkpoint holds params, optimizer state, step and RNG (`state`, an orbax PyTree) and the data
position (`meta`, JSON: rows consumed from the deterministic row stream), so a resumed run takes
the same batches, bit for bit.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from sprint_jax.errors import UserError
from sprint_jax.treesum import checksum


class NoValidCheckpoint(UserError):
    """Checkpoints exist but none could be restored and verified (each was reported and moved aside)."""


class CheckpointSpaceError(UserError):
    """The disk cannot hold the next checkpoint: nothing is written, the previous ones stay."""


class NonFiniteState(UserError):
    """The train state holds NaN or infinite values: it is not written as a checkpoint."""


@jax.jit
def _fingerprint(tree) -> Any:
    def one(x):
        xf = jnp.asarray(x).astype(jnp.float32)
        return jnp.stack([jnp.sum(xf), jnp.sum(jnp.abs(xf))])
    return jax.tree.map(one, tree)


def fingerprint(state) -> list[list[float]]:
    """Per-leaf [sum, sum |x|] of the state, as plain floats (JSON)."""
    fp = jax.device_get(_fingerprint(state))
    return [list(map(float, np.asarray(v))) for v in jax.tree.leaves(fp)]


def _matches(a: list[list[float]], b: list[list[float]], rtol: float = 1e-4) -> bool:
    """Fingerprints agree (written so that a NaN on either side is a mismatch, not a pass)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        scale = max(abs(x[1]), abs(y[1]), 1e-30)
        if not (abs(x[0] - y[0]) <= rtol * scale and abs(x[1] - y[1]) <= rtol * scale):
            return False
    return True


def warn(msg: str) -> None:
    if jax.process_index() == 0:
        bar = "!" * 78
        print(f"\n{bar}\nWARNING: {msg}\n{bar}", file=sys.stderr, flush=True)


class Checkpointer:
    """Periodic async saves with keep-last-k; restore of the newest checkpoint that verifies."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.async_save = async_save
        self._open()

    def _open(self) -> None:
        opts = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                            enable_async_checkpointing=self.async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict) -> None:
        """Start writing `state` + `meta` for `step` (async: returns once the arrays are copied).

        Raises NonFiniteState (and writes nothing) when an array holds a NaN or an infinity."""
        self._check_space(step, state)
        sums, bad = checksum(state)
        if bad:
            raise NonFiniteState(f"not saving checkpoint step {step}: non-finite values in {', '.join(bad[:3])}"
                                 + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""))
        meta = {**meta, "step": int(step), "fingerprint": fingerprint(state), "checksum": sums,
                "saved_at": time.time()}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def _check_space(self, step: int, state) -> None:
        """Refuse a save that cannot fit on the disk before orbax starts writing it: a write that
        fails halfway ends in hundreds of lines from orbax's writer threads instead of one."""
        need = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
        free = shutil.disk_usage(self.directory).free
        if need + need // 20 + (16 << 20) > free:
            raise CheckpointSpaceError(
                f"not enough disk space for checkpoint step {step} in {self.directory}: it needs about "
                f"{need / 2**20:.0f} MiB and {free / 2**20:.0f} MiB are free; free some space (or lower "
                f"checkpoint.keep) and rerun the same command: training resumes from the last checkpoint")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def _quarantine(self, step: int) -> None:
        """Move a bad step directory out of orbax's sight so it is never picked again."""
        if jax.process_index() == 0:
            src = self.directory / str(step)
            dst_root = self.directory.parent / (self.directory.name + "_quarantine")
            dst_root.mkdir(parents=True, exist_ok=True)
            dst = dst_root / f"{step}.{int(time.time())}"
            if src.exists():
                shutil.move(str(src), str(dst))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"sprint_jax_quarantine_{step}")
        self.manager.close()
        self._open()

    def restore_latest(self, abstract_state) -> tuple[Any, dict] | None:
        """(state, meta) from the newest checkpoint that reads and verifies, or None if none exist.

        `abstract_state` is a tree of ShapeDtypeStructs with shardings: arrays are read straight
        into their shards. Bad checkpoints are reported and quarantined, newest first.
        """
        steps = self.steps()
        if not steps:
            return None
        errors = []
        for step in reversed(steps):
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
                state, meta = out["state"], dict(out["meta"])
                if "fingerprint" not in meta:
                    raise ValueError("meta has no fingerprint")
                sums, bad = checksum(state)
                if bad:
                    raise ValueError(f"non-finite values in {', '.join(bad[:3])}")
                if "checksum" in meta and sums != meta["checksum"]:   # older checkpoints have none
                    raise ValueError("array bits do not match the checksum written at save time")
                got = fingerprint(state)
                if not _matches(got, meta["fingerprint"]):
                    raise ValueError("array contents do not match the fingerprint written at save time")
                if int(jax.device_get(state["step"])) != step:
                    raise ValueError(f"state.step = {int(jax.device_get(state['step']))} != directory step {step}")
            except Exception as e:  # noqa: BLE001 -- any failure to read means: not this one
                text = (str(e).splitlines() or [""])[0].split(" [tensorstore_spec")[0]
                msg = f"{type(e).__name__}: {text[:300]}"
                errors.append(f"step {step}: {msg}")
                warn(f"checkpoint {self.directory / str(step)} is corrupt or incomplete ({msg}); "
                     f"moving it to {self.directory.name}_quarantine/ and trying the previous one")
                self._quarantine(step)
                continue
            if errors:
                warn(f"resumed from OLDER checkpoint step {step} (skipped: {'; '.join(errors)})")
            return state, meta
        raise NoValidCheckpoint(f"no checkpoint under {self.directory} could be restored ({'; '.join(errors)}); "
                                f"they were moved to {self.directory.name}_quarantine/; rerun to start from step 0 "
                                f"in this directory, or use a new --out")
