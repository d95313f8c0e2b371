"""The `sprint-jax` command.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and
`run(args) -> int`; modules are imported only when their subcommand runs, so `--help` is fast.
User mistakes (bad config, missing file) end with one clear line and exit code 2, never a traceback;
so does a write that finds the disk full or the directory not writable (nothing else to do but free
space or fix the permissions, and rerun). Ctrl-C at any moment ends with one line ("interrupted",
and what a rerun will do where the command knows) and exit code 130.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import sys

from sprint_jax.bench.cli import BENCHES   # the benchmark names (a module of argparse and importlib only)
from sprint_jax.errors import UserError  # noqa: F401  (re-exported for scripts)

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("sprint_jax.demo", "SPRINT end to end in miniature: curate -> SFT (SPRINT and RFT) -> parallel inference -> report"),
    "convert": ("sprint_jax.model.convert", "convert between an HF safetensors directory and an orbax checkpoint"),
    "generate": ("sprint_jax.infer.generate_cli", "generate text from a checkpoint (plain decoding)"),
    "curate": ("sprint_jax.curation.cli", "curation pipeline: teacher traces -> steps -> DAG -> stages -> SFT examples"),
    "convert-format": ("sprint_jax.curation.format_cli", "convert training examples between SPRINT's tags and ThreadWeaver's"),
    "train": ("sprint_jax.train.cli", "sharded SFT (SPRINT or RFT) from a config"),
    "infer": ("sprint_jax.infer.infer_cli", "run the SPRINT orchestrator on one query and show the stages live"),
    "eval": ("sprint_jax.eval.cli", "evaluate a model on math500 / countdown / a jsonl file; `eval compare A B`"),
    "serve": ("sprint_jax.serve.cli", "an OpenAI-compatible server (completions, chat, streaming) with a SPRINT mode"),
    "rl": ("sprint_jax.rl.cli", "reinforcement learning on parallel rollouts: P-GRPO with the acceleration reward"),
    "bench": ("sprint_jax.bench.cli", "benchmarks: " + ", ".join(BENCHES)),
    "plan": ("sprint_jax.plan.cli", "plan a run on TPU slices or NVIDIA GPU nodes from this host: compile the train step, the engine's programs or the RL update, per-chip memory, roofline"),
    "selftrain": ("sprint_jax.selftrain_cli", "self-training rounds: sample k trajectories -> keep correct, well-formed -> SFT -> held-out eval"),
    "recipe": ("sprint_jax.recipe.cli", "the paper's experiment, resumable: curate -> SFT both -> eval both -> compare -> report.md"),
}


def main(argv: list[str] | None = None) -> int:
    """Run `sprint-jax ARGV` (sys.argv when None, i.e. as the program); returns the exit code."""
    argv_given = argv
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="sprint-jax",
        description="SPRINT in JAX: plan in sequence, execute independent subtasks in parallel.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"sprint-jax: error: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}",
                  file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    program = argv_given is None       # the process itself, not a caller in Python (tests, scripts)
    if program:
        from sprint_jax import interrupt
        interrupt.die_with_parent_from_env()    # a recipe stage: dies with its runner
        interrupt.install()
    try:
        return _run_command(name, argv[1:])
    except KeyboardInterrupt as e:     # any moment: while importing, compiling, training, saving
        note = str(e)
        print(f"sprint-jax {name}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr, flush=True)
        if program:
            _exit_now(130)
        return 130


def _exit_now(code: int) -> None:
    """End the process at once, after flushing what it printed. Python's normal exit finalises
    the interpreter while XLA's threads may still be compiling, which crashed it (segmentation
    fault) after a Ctrl-C during the first step's compile; every file the commands write is
    closed by then (they are written under `with`, sqlite commits, the lock is the OS's)."""
    import os
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run_command(name: str, argv: list[str]) -> int:
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    cmd_parser = argparse.ArgumentParser(prog=f"sprint-jax {name}", description=getattr(
        module, "DESCRIPTION", help_text), formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv)
    from sprint_jax import interrupt
    from sprint_jax.config import ConfigError
    from sprint_jax.errors import Interrupted
    try:
        try:
            interrupt.check()          # a Ctrl-C that came during the import
            return int(module.run(args) or 0)
        except KeyboardInterrupt as e:  # the command's `rerun_note(args)`, where it has one, says what a rerun does
            if isinstance(e, Interrupted) or not hasattr(module, "rerun_note"):
                raise
            raise Interrupted(module.rerun_note(args)) from None
    except (UserError, ConfigError, FileNotFoundError) as e:
        print(f"sprint-jax {name}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `sprint-jax ... | head`
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 -- a full disk or a denied write is turned into a line; the rest re-raises
        requests = sys.modules.get("sprint_jax.infer.requests")     # loaded when an engine ran
        if requests is not None and isinstance(e, requests.NoProgress):
            # a pool or slot count the runs cannot share (e.g. --kv-pages far below --concurrency's needs)
            print(f"sprint-jax {name}: error: {e}; rerun with more --kv-pages or a lower --concurrency "
                  f"(eval keeps the records it wrote and resumes)", file=sys.stderr)
            return 2
        why = _out_of_space(e)
        if why is not None:
            print(f"sprint-jax {name}: error: {why}; free some space and rerun the same command (train, "
                  f"curate and eval resume where they stopped)", file=sys.stderr)
            return 2
        why = _not_writable(e)
        if why is not None:
            print(f"sprint-jax {name}: error: {why}; what was written so far is kept: make the directory "
                  f"writable and rerun the same command, or choose another output directory", file=sys.stderr)
            return 2
        raise


_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_SPACE_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")


def _chain_error(e: BaseException, errnos: set, texts: tuple, what: str, at: str) -> str | None:
    """`what` with where and why when `e`, or anything in its cause/context chain, is an OSError
    whose errno is in `errnos` or an error whose message holds one of `texts` (orbax and
    tensorstore wrap the OSError in their own types, so their messages are read too); else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in errnos:
            where = f" {at} {e.filename}" if e.filename else ""
            return f"{what}{where} ({e.strerror})"
        text = str(e)
        for t in texts:
            if t in text:
                return f"{what} ({t})"
        e = e.__cause__ or e.__context__
    return None


def _out_of_space(e: BaseException) -> str | None:
    """A one-line description when `e`'s chain holds a write that found no space (ENOSPC, a quota,
    a file size limit); None for every other error."""
    return _chain_error(e, _SPACE_ERRNOS, _SPACE_TEXTS, "out of disk space", "writing")


_ACCESS_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_ACCESS_TEXTS = ("Permission denied", "Read-only file system", "Operation not permitted")


def _not_writable(e: BaseException) -> str | None:
    """A one-line description when `e`'s chain holds a file operation the file system refused (no
    permission, a read-only file system), e.g. an --out the user cannot write, or one made
    read-only mid-run; None for every other error."""
    return _chain_error(e, _ACCESS_ERRNOS, _ACCESS_TEXTS, "permission denied", "on")


if __name__ == "__main__":
    sys.exit(main())
