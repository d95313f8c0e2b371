"""`sprint-jax train --config configs/sft_*.yaml [--set key=value ...] --out DIR`."""
from __future__ import annotations

import argparse
import json

DESCRIPTION = """Sharded SFT of a Qwen2 or Qwen3 model on SPRINT or RFT examples (paper §8-9).

model.name is a preset (configs/model_*.json: tiny, tiny-qwen3, r1-distill-qwen-7b, qwen2.5-7b,
qwen3-8b, qwen3-0.6b) or an HF checkpoint directory / config.json; its model_type (qwen2 | qwen3)
picks the family.

Resumes automatically from DIR/checkpoints, with the config the run was started with (DIR/config.yaml):
a rerun that changes another field than checkpoint.every / keep / async_save / resume, export.*, mesh.*,
distributed.*, log_every, tensorboard or plot is refused, naming the fields (steps and epochs too:
they set the learning-rate schedule, so a longer run is not the shorter one continued); --new-run
starts over instead. Ctrl-C ends with the step a rerun resumes from. Multi-host: pass --coordinator HOST:PORT
--num-processes N --process-id I on every host (or run under SLURM / on a TPU pod, detected
from the environment).

examples:
  sprint-jax train --config configs/sft_tiny_cpu.yaml --out runs/tiny
  sprint-jax train --config configs/sft_r1_distill_7b_sprint.yaml --set steps=200 --out runs/sprint
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (configs/sft_*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field by dotted key, e.g. --set optim.lr=2e-5 (repeatable)")
    p.add_argument("--out", required=True, help="output directory (checkpoints, metrics, export)")
    p.add_argument("--coordinator", help="host:port of process 0 (multi-host)")
    p.add_argument("--num-processes", type=int, help="number of processes (multi-host)")
    p.add_argument("--process-id", type=int, help="this process's id (multi-host)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or status lines")
    p.add_argument("--new-run", action="store_true",
                   help="start a new run from step 0 even if --out holds one: DELETES its checkpoints, metrics, "
                        "tb/, hf/ export and summary first (without it a rerun resumes, and only with the same config)")


def run(args: argparse.Namespace) -> int:
    from sprint_jax.train.config import load_train_config
    from sprint_jax.train.trainer import train

    overrides = list(args.overrides)
    for flag, key in (("coordinator", "coordinator"), ("num_processes", "num_processes"),
                      ("process_id", "process_id")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"distributed.{key}={value}")
    cfg = load_train_config(args.config, overrides)
    summary = train(cfg, args.out, progress=not args.no_progress, new_run=args.new_run)
    import jax
    if jax.process_index() == 0:
        print(json.dumps({k: summary[k] for k in ("final_loss", "steps", "tokens", "tokens_per_s", "wall_s",
                                                   "export_dir")}, indent=2))
    return 0


def rerun_note(args: argparse.Namespace) -> str:
    """For an interrupt that came before training started: what a rerun of the command does."""
    from sprint_jax.train.rundir import rerun_note as note
    return note(args.out)
