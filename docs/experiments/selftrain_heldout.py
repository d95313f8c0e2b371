"""Evaluate models of docs/experiments/selftrain.md on a larger held-out set than the run's 100:
the first N problems of the demo's held-out generator (`chains.demo_test_set(N)`, whose first 100
are the run's held-out set), greedy, with the selftrain config's budgets, as selftrain's own
held-out step runs them. One eval directory per model under OUT (resumable, as `eval --out`).

    python docs/experiments/selftrain_heldout.py configs/selftrain_tiny_cpu.yaml 1000 runs/selftrain3_heldout1000 \
        runs/selftrain_start3/hf runs/selftrain3/round_1/model/hf runs/selftrain3/round_2/model/hf
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from sprint_jax.selftrain_cli import _Engines, _prompt_fn, load_selftrain_config, orchestrator_config
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.tasks import chains


def main(config: str, n: str, out: str, *models: str) -> None:
    cfg = load_selftrain_config(config, out=out)
    tasks = chains.demo_test_set(int(n), seed=cfg.heldout_tasks.data_seed)
    engines = _Engines(cfg, orchestrator_config(cfg, cfg.model))
    for k, model in enumerate(models):
        oc = dataclasses.replace(orchestrator_config(cfg, model), temperature=cfg.heldout_temperature)
        engine = engines.get(model)
        _, rep = evaluate(engine, tasks, cfg.mode, prompt_fn=_prompt_fn(model, engine), orchestrator_config=oc,
                          out_dir=Path(out) / f"model_{k}", progress=False, concurrency=cfg.concurrency,
                          meta={"model": model, "selftrain": "heldout"})
        print(f"{model}: n {rep['n']}, accuracy {rep['accuracy']:.4f}, format-valid {rep['format_valid_rate']:.4f}, "
              f"mean critical path {rep['mean_sequential_tokens']:.2f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
