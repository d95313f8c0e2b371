"""The `sprint-jax selftrain` config (SelftrainConfig, TaskSet): plain dataclasses, read by the
command (sprint_jax/selftrain_cli.py) and checked by the recipe when it runs self-training rounds."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal


@dataclasses.dataclass
class TaskSet:
    """Which problems: `data` as `eval --data` takes it, or chains-train (the module docstring)."""
    data: str = "chains-train"
    limit: int | None = None
    data_seed: int = 0
    task_kind: Literal["auto", "math", "choice"] = "auto"
    chains: int = 4                          # chains-train: chains per problem (the demo's default)
    chain_length: int = 12                   # chains-train: steps per chain (the demo's default)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 or null, got {self.limit}")
        if self.chains < 1 or self.chain_length < 1:
            raise ValueError(f"chains and chain_length must be >= 1, got {self.chains}, {self.chain_length}")


@dataclasses.dataclass
class SelftrainConfig:
    """A self-training run (see the module's DESCRIPTION)."""
    model: str = ""                          # the start SFT model: an HF export directory
    rounds: int = 2
    samples: int = 4                         # trajectories per training problem and round
    keep: Literal["all", "fastest"] = "all"  # all: ThreadWeaver's filter; fastest: ours (keep_samples)
    mode: Literal["parallel", "serial", "sequential"] = "parallel"
    init_from: Literal["previous", "base"] = "previous"
    train_tasks: TaskSet = dataclasses.field(default_factory=TaskSet)
    heldout_tasks: TaskSet = dataclasses.field(default_factory=lambda: TaskSet(data="chains"))
    orchestrator: dict[str, Any] = dataclasses.field(default_factory=dict)   # OrchestratorConfig fields
    heldout_temperature: float = 0.0         # 0: greedy held-out evaluation
    train: dict[str, Any] = dataclasses.field(default_factory=dict)          # TrainConfig fields
    concurrency: int = 8                     # problems at once on the engine
    max_seq_len: int | None = None           # engine context; None: the model's positions, at most 8192
    prefill_chunk: int = 128
    decode_chunk: int = 16
    allow_overlap: bool = False
    out: str | None = None

    def __post_init__(self) -> None:
        for name in ("rounds", "samples", "concurrency", "prefill_chunk", "decode_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heldout_temperature < 0:
            raise ValueError(f"heldout_temperature must be >= 0, got {self.heldout_temperature}")
