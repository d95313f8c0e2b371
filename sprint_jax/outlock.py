"""An exclusive lock on an output directory, so two runs never write one directory at once.

Two `train` runs into one --out used to interleave metrics lines, race on checkpoints and hang;
two `eval` or `curate` runs into one directory lose results the same way. Each command
that writes a directory holds `DIR/.sprint-jax.lock` for its whole run: an OS lock (`fcntl.flock`)
on the open file, plus a line saying who holds it (pid, host, command, start time). A second run
stops at once with exit code 2 naming the holder.

A lock held by a process that died is no lock: the OS drops a dead process's flock, so a run
killed with SIGKILL never blocks the next one (its leftover file is just overwritten).
Multi-process training: process i locks `.sprint-jax.lock` (i = 0) or `.sprint-jax.lock.i`, so
a second multi-host run into the same directory is refused on every process.
(flock is advisory and local: on a network file system that does not support it, the lock is a
no-op on other hosts; the holder line is still written.)
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import sys
from pathlib import Path
from typing import Iterator

from sprint_jax.errors import UserError

LOCK_FILE = ".sprint-jax.lock"


class DirectoryLocked(UserError):
    """Another live process holds the output directory."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return (f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
                f"{info.get('command')}")
    except (OSError, ValueError):
        return "another process (no holder details written yet)"


def acquire(directory: str | Path, what: str, process_index: int = 0):
    """Lock `directory` (created if missing); returns the open lock file, or raises DirectoryLocked.

    Keep the returned object alive for as long as the run writes the directory; `release` (or
    the process ending) lets the next run in."""
    import fcntl

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise UserError(f"{what} {d} exists and is not a directory")
    path = d / (LOCK_FILE if process_index == 0 else f"{LOCK_FILE}.{process_index}")
    try:
        d.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+", encoding="utf-8")
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise UserError(f"{what} {d} is not writable ({e.strerror}: {e.filename}); choose a directory you can "
                        f"write, or fix its permissions") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise DirectoryLocked(f"{what} {d} is in use by another run ({_holder(path)}); wait for it to finish "
                              f"or choose another directory") from None
    except OSError:
        pass      # a file system without flock: run unlocked rather than refuse to run at all
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                        "started": datetime.datetime.now().isoformat(timespec="seconds")}) + "\n")
    f.flush()
    return f


def release(lock) -> None:
    if lock is not None and not lock.closed:
        lock.close()          # closing the file drops the flock; the file stays (unlinking would race)


@contextlib.contextmanager
def locked(directory: str | Path, what: str = "output directory", process_index: int = 0) -> Iterator[Path]:
    """`with locked(out): ...` holds the lock of `out` for the block."""
    lock = acquire(directory, what, process_index)
    try:
        yield Path(directory)
    finally:
        release(lock)


__all__ = ["LOCK_FILE", "DirectoryLocked", "acquire", "release", "locked"]
