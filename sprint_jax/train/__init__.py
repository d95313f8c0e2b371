"""Sharded SFT (paper §8-9; docs/design.md "Training").

    from sprint_jax.train import TrainConfig, load_train_config, train
    summary = train(load_train_config("configs/sft_tiny_cpu.yaml"), "runs/tiny")

Modules: config (TrainConfig), data (examples -> span-weighted token rows, flat / trie layouts,
packing), mesh (the logical-axis rules table), step (loss + jitted step), checkpoint (orbax),
distributed (jax.distributed, process-local batches), trainer (the loop), cli (`sprint-jax train`).
"""
from sprint_jax.train.config import TrainConfig, load_train_config
from sprint_jax.train.trainer import StepEvent, train

__all__ = ["TrainConfig", "load_train_config", "train", "StepEvent"]
