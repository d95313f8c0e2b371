"""Ctrl-C for the `sprint-jax` program: an interrupt is never lost and never crashes the exit.

Python's default SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be.
Raised inside a gc callback (JAX registers one) or a `__del__`, it is printed as "Exception
ignored" and dropped, and the run went on to the end as if nothing had been pressed. The handler
installed here also records the interrupt; `check()`, called between training steps, raises it
again when it was dropped, and the drop is not printed. An interrupt that comes while a module is
being imported is only recorded (raised there, it could abort the process) and raised by the next
`check()` (sprint_jax.cli calls one after importing the command).

The program then ends with `os._exit` (sprint_jax.cli) rather than a normal interpreter exit:
finalising the interpreter while XLA's compiler threads are still running crashed it
(segmentation fault) when Ctrl-C came during a compile.
"""
from __future__ import annotations

import signal
import sys
import threading

_requested = False


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _handler(signum, frame) -> None:
    global _requested
    _requested = True
    if _in_import(frame):
        # raised inside an import (jax's take seconds), it aborted the process (SIGABRT) or
        # surfaced as another error with a traceback; `check()` raises it after the import
        return
    raise KeyboardInterrupt


def _unraisable(hook):
    def quiet(args) -> None:
        if _requested and isinstance(args.exc_value, KeyboardInterrupt):
            return                       # recorded: check() raises it at the next safe point
        hook(args)
    return quiet


def install() -> None:
    """Record every SIGINT (and raise KeyboardInterrupt as Python does). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _handler)
    sys.unraisablehook = _unraisable(sys.unraisablehook)


def requested() -> bool:
    """Whether an interrupt came since `install` (whatever became of its KeyboardInterrupt)."""
    return _requested


def check() -> None:
    """Raise KeyboardInterrupt when an interrupt came: a safe point for a long loop to stop at."""
    if _requested:
        raise KeyboardInterrupt


__all__ = ["install", "requested", "check"]


# A stage the recipe runner starts names the runner's pid here; the stage then asks the kernel to
# SIGKILL it when the runner dies (PR_SET_PDEATHSIG), so a kill -9 of the runner never leaves a
# stage running. Done by the stage itself, at start, rather than in a preexec_fn: a preexec_fn
# makes subprocess fork the runner (which has imported JAX) instead of spawning, and JAX warns
# that a fork of a multithreaded process may deadlock.
DIE_WITH_ENV = "SPRINT_JAX_DIE_WITH"


def die_with_parent_from_env(environ=None) -> None:
    """If DIE_WITH_ENV names this process's parent: take the variable out of the environment (no
    grandchild sees it) and, on Linux, have the kernel SIGKILL this process when the parent dies;
    exit at once if the parent has died already. A no-op without the variable."""
    import os
    environ = os.environ if environ is None else environ
    value = environ.pop(DIE_WITH_ENV, None)
    if not value or not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if str(os.getppid()) != value:       # the parent died before prctl took effect
        os._exit(1)
