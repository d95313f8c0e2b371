"""`sprint-jax recipe run CONFIG --out DIR` and `sprint-jax recipe status DIR`."""
from __future__ import annotations

import argparse

DESCRIPTION = """A paper's experiment as one resumable run: a parallel model (SPRINT's or ThreadWeaver's)
against a sequential one trained the same way.

  curate -> parallel and sequential example sets (paired: both train on the same problems)
  [-> convert: ThreadWeaver's format (format: threadweaver)]
  -> SFT of both (train_sprint, train_rft; with a curriculum: mix, then train_sprint_1..N, one per
     phase, each from the previous export)
  [-> selftrain_sprint, selftrain_rft (selftrain: rounds of sample -> keep the well-formed,
     correct rollouts -> SFT)] [-> rl_sprint, rl_rft (rl: P-GRPO; the sequential arm's rollouts
     are sequential, without the acceleration bonus)]
  -> eval of both on each eval set (eval_sprint_SET, eval_rft_SET; an hf:OWNER/NAME set is fetched
     first by data_SET) -> eval compare (compare_SET) -> DIR/report.md (every stage, the paper's
     table, its length bins, the comparison plots)

  sprint-jax recipe run configs/recipe_tiny_cpu.yaml --out runs/recipe_tiny   # SPRINT, offline, this CPU
  sprint-jax recipe run configs/recipe_r1_7b.yaml --out runs/recipe_7b [--set key=value ...]
  sprint-jax recipe run configs/recipe_threadweaver_qwen3_8b.yaml --out runs/tw --set prompts=FILE
  sprint-jax recipe status runs/recipe_7b

Each stage runs as a `sprint-jax` command with its generated config and its log in DIR/STAGE/
(config.yaml, log.txt, out/). A killed run takes its running stage with it (Linux), so rerunning at once resumes.
DIR/state.json records each stage's inputs digest (command, config,
the outputs of the stages it reads, the content of external files such as task files and a
pretrained checkpoint) and outputs digest. Rerunning the same command skips every finished stage
whose inputs are unchanged and reruns the rest: a changed train setting reruns both trainings and
everything after them, not the curation. A stage that fails stops the recipe with one line naming
it and its log (exit 1); rerunning resumes it (train, eval and curate continue where they stopped).

status prints each stage of DIR's last run: done, stale (finished, but an input or output changed
since), pending or failed, with its start, end and seconds.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["run", "status"], help="run the recipe, or show where DIR stands")
    p.add_argument("target", help="run: the recipe config (configs/recipe_*.yaml); status: the run's DIR")
    p.add_argument("--out", help="run: output directory (one subdirectory per stage, state.json, report.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="run: override a recipe field by dotted key, e.g. --set train.optim.lr=2e-5 (repeatable)")


def _print_status(rows: list[dict]) -> None:
    print(f"{'stage':<22} {'status':<8} {'started':<21} {'finished':<21} {'seconds':>8}")
    for r in rows:
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        print(f"{r['stage']:<22} {r['status']:<8} {r['started'] or '-':<21} {r['finished'] or '-':<21} {secs:>8}")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sprint_jax.errors import UserError
    from sprint_jax.recipe import runner

    if args.action == "status":
        if args.out or args.set:
            raise UserError("usage: sprint-jax recipe status DIR (no --out / --set)")
        _print_status(runner.status_rows(Path(args.target)))
        return 0
    if not args.out:
        raise UserError("--out is required: sprint-jax recipe run CONFIG --out DIR")
    from sprint_jax.config import resolve_config_path
    if not resolve_config_path(args.target).is_file():     # configs/NAME: the shipped one from anywhere
        raise UserError(f"recipe config {args.target}: no such file")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} exists and is not a directory")
    import yaml

    from sprint_jax.config import to_dict
    from sprint_jax.recipe.config import check_api_keys, load_recipe_config

    cfg = load_recipe_config(args.target, args.set)
    check_api_keys(cfg)
    text = (f"# the recipe of the last `sprint-jax recipe run` into this directory ({args.target}"
            + (f" with --set {' '.join(args.set)}" if args.set else "") + ")\n"
            + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return runner.run_recipe(cfg, text, Path(args.out))
