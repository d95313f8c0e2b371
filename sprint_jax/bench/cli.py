"""`sprint-jax bench NAME`: benchmark scripts that print a table and write JSON.

Performance is measured here, as ratios side by side in one run, never by timed unit tests.
"""
from __future__ import annotations

import argparse
import importlib
import textwrap

# name -> (module, add-arguments function, run function, what it measures): the one list of
# benchmarks (`sprint-jax --help` and `sprint-jax bench --help` are both written from it)
BENCHES = {
    "decode": ("sprint_jax.bench.decode", "add_decode_arguments", "run_decode_bench",
               "engine decode: shared vs copy vs serial branches, vs HF generate"),
    "kernels": ("sprint_jax.bench.kernels", "add_kernels_arguments", "run_kernels_bench",
                "Pallas shared-prefix attention vs the XLA shared path vs copy-fork"),
    "serve": ("sprint_jax.bench.serve", "add_serve_arguments", "run_serve_bench",
              "many SPRINT runs at once on the batched engine; decode cost vs capacity (--http: requests "
              "through the OpenAI-compatible server vs in-process: latency, throughput)"),
    "serve-memory": ("sprint_jax.bench.serve_memory", "add_serve_memory_arguments", "run_serve_memory_bench",
                     "per-device weights + KV cache of the batched decode step on a mesh"),
    "train": ("sprint_jax.bench.train", "add_train_arguments", "run_train_bench",
              "train step tokens/s vs an HF PyTorch step (MFU on GPU/TPU)"),
    "train-memory": ("sprint_jax.bench.train", "add_train_memory_arguments", "run_train_memory_bench",
                     "per-device memory of the 7B train step on a fake 8-device mesh"),
    "replay": ("sprint_jax.bench.replay", "add_replay_arguments", "run_replay_bench",
               "eval records' decode schedules replayed on this CPU, SPRINT vs RFT, vs the latency model "
               "fed this CPU's measured FLOP/s and bytes/s"),
    "accelerator": ("sprint_jax.bench.accelerator", "add_accelerator_arguments", "run_accelerator_bench",
                    "for a lent GPU / TPU: 7B-shaped decode bandwidth at 1 / 8 / 32 rows vs the chip's peak, the "
                    "k-executor fork step vs one row, train MFU, Pallas vs XLA attention, latency model vs "
                    "replayed schedules (--tiny: CPU)"),
    "demo-train": ("sprint_jax.bench.demo_train", "add_demo_train_arguments", "run_demo_train_bench",
                   "the demo's training tokens/s vs an older checkout, runs interleaved"),
}

DESCRIPTION = ("Benchmarks (each prints a table and writes JSON with --out):\n\n"
               + "\n".join(textwrap.fill(what, 100, initial_indent=f"  sprint-jax bench {name:<14}",
                                          subsequent_indent=" " * 33) for name, (*_, what) in BENCHES.items())
               + "\n\nAdd --help after a name for its options.\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")


def run(args) -> int:
    module_name, add_fn, run_fn, _ = BENCHES[args.name]
    # train-memory fakes 8 host devices; that must happen before jax initialises its backends
    if args.name in ("train-memory", "serve-memory"):
        import os
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f"sprint-jax bench {args.name}",
                                  description=(module.__doc__ or "").strip().split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    getattr(module, add_fn)(sub)
    sub_args = sub.parse_args(args.rest)
    return int(getattr(module, run_fn)(sub_args) or 0)
