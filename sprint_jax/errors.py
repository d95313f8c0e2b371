"""The project's error types, in a module that imports nothing of ours.

Library modules raise these; only `sprint_jax.cli` turns them into one line and exit code 2.
Keeping them here means no library module has to import the command-line layer.
"""
from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input: printed as one line, exit code 2."""


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C, with what a rerun of the same command will do (its message), e.g. which
    checkpoint training resumes from: printed after "interrupted", exit code 130."""
