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
