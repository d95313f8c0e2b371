"""The RL run config (`sprint-jax rl --config configs/rl_*.yaml`): one dataclass tree, loaded with
`sprint_jax.config.load_config` plus `--set a.b=value` overrides. P-GRPO per ThreadWeaver
(Lian et al., arXiv 2512.07843, section 4); the RFT-side baseline is the same config with
`rollout.mode: sequential` and `reward.rho: 0`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from sprint_jax.config import ConfigError, load_config
from sprint_jax.infer.orchestrator import OrchestratorConfig
from sprint_jax.rl.reward import RewardConfig
from sprint_jax.train.config import CheckpointSection, ExportSection, MeshSection, OptimSection


def _at_least(where: str, obj, **lowest: int) -> None:
    """Each named field of `obj` must be >= its lowest value; the error names `where.field` as
    `--set` spells it (these sections appear once in RLConfig, under `where`)."""
    for name, low in lowest.items():
        value = getattr(obj, name)
        if value < low:
            raise ConfigError(f"{where + '.' if where else ''}{name} must be >= {low}, got {value}")


@dataclasses.dataclass
class PolicySection:
    """The starting model (an SFT export: HF safetensors + tokenizer, e.g. OUT/hf of `sprint-jax train`)."""
    path: str = ""                              # HF checkpoint directory
    tokenizer: str | None = None                # default: the checkpoint directory
    dtype: Literal["float32", "bfloat16"] = "float32"   # compute dtype (master weights stay fp32)
    remat: Literal["none", "full", "dots"] = "none"     # rematerialise each layer in the update
    loss_chunk: int = 0                         # tokens per vocab-projection chunk (0 = whole row)

    def __post_init__(self) -> None:
        _at_least("policy", self, loss_chunk=0)


@dataclasses.dataclass
class TasksSection:
    """Prompts with graders: `chains` (the demo's family, generated) or a task jsonl (MATH / choice)."""
    source: str = "chains"                      # chains | keyed_chains | countdown | FILE.jsonl
    n: int = 2000                               # chains / countdown: training problems to generate
    seed: int = 0                               # generator seed (training problems)
    chains: int = 4                             # chains: sub-computations per problem
    chain_length: int = 12                      # chains / keyed_chains: steps per chain (keyed: key bits)
    eval_source: str | None = None              # held-out tasks: FILE.jsonl or math500 (default: generated, disjoint)
    eval_n: int = 100                           # held-out problems
    eval_seed: int = 10_000                     # held-out generator seed

    def __post_init__(self) -> None:
        _at_least("tasks", self, n=1, eval_n=0, chains=1, chain_length=1)


@dataclasses.dataclass
class RolloutSection:
    """G SPRINT runs per prompt with temperature sampling (ThreadWeaver §4)."""
    mode: Literal["parallel", "serial", "sequential"] = "parallel"   # sequential = the RFT-side baseline
    group_size: int = 8                          # G runs per prompt
    prompts_per_step: int = 4                    # prompts per RL step (batch = prompts x G trajectories)
    orchestrator: OrchestratorConfig = dataclasses.field(
        default_factory=lambda: OrchestratorConfig(temperature=1.0))   # budgets + sampling (seed is per run)
    layout: Literal["auto", "flat", "trie", "merge"] = "auto"   # token convention and join at fork/sync: auto = the policy export's (sprint_jax.json), flat without one
    format: Literal["auto", "sprint", "threadweaver"] = "auto"  # the policy's tag format: auto = the export's, sprint without one
    concurrency: int = 0                         # runs at once on the engine (0 = prompts_per_step x group_size)
    max_seq_len: int = 2048                      # engine: planner context capacity
    decode_chunk: int = 16                       # engine: decode steps per host round trip
    prefill_chunk: int = 512                     # engine: longest prefill piece

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ConfigError(f"rollout.group_size must be >= 2 (the baseline is the group mean), got {self.group_size}")
        if self.orchestrator.layout != "flat":
            raise ConfigError("set rollout.layout (auto | flat | trie | merge), not rollout.orchestrator.layout")
        if self.orchestrator.format != "sprint":
            raise ConfigError("set rollout.format (auto | sprint | threadweaver), not rollout.orchestrator.format")
        # concurrency 0 = every run of a step at once; max_seq_len against the prompts: run_rl
        _at_least("rollout", self, prompts_per_step=1, concurrency=0, max_seq_len=2, decode_chunk=1, prefill_chunk=1)
        if self.orchestrator.temperature <= 0:
            raise ConfigError("rollout.orchestrator.temperature must be > 0 (policy-gradient rollouts sample)")
        if self.orchestrator.top_k or self.orchestrator.top_p < 1:
            raise ConfigError("rollout.orchestrator.top_k / top_p must be off: the loss models plain temperature "
                              "sampling")


@dataclasses.dataclass
class LossSection:
    """Clipped surrogate on trie-packed units (rl/loss.py)."""
    seq_len: int = 1024                          # tokens per packed row
    rows_per_micro: int = 4                      # rows per microbatch (gradients summed over microbatches)
    updates_per_batch: int = 1                   # 1 = on-policy REINFORCE with the group-mean baseline
    clip_eps: float = 0.2                        # PPO clip (matters only when updates_per_batch > 1)
    kl_coef: float = 0.0                         # k3 KL to the starting weights (0 = none, as the paper)

    def __post_init__(self) -> None:
        _at_least("loss", self, seq_len=2, rows_per_micro=1, updates_per_batch=1, kl_coef=0)
        if self.clip_eps <= 0:
            raise ConfigError(f"loss.clip_eps must be > 0, got {self.clip_eps}")


@dataclasses.dataclass
class EvalSection:
    """Greedy held-out evaluation through `sprint_jax.eval.evaluate` (the `eval` command's path)."""
    every: int = 0                               # evaluate every N steps (0 = only at start and end)
    mode: Literal["parallel", "serial", "sequential"] | None = None   # default: rollout.mode

    def __post_init__(self) -> None:
        _at_least("eval", self, every=0)


@dataclasses.dataclass
class RLConfig:
    policy: PolicySection = dataclasses.field(default_factory=PolicySection)
    tasks: TasksSection = dataclasses.field(default_factory=TasksSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    loss: LossSection = dataclasses.field(default_factory=LossSection)
    optim: OptimSection = dataclasses.field(default_factory=lambda: OptimSection(lr=1e-6, clip_norm=1.0))
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=lambda: CheckpointSection(every=10))
    export: ExportSection = dataclasses.field(default_factory=ExportSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    steps: int = 100                             # RL steps (one rollout batch each)
    seed: int = 0                                # rollout seeds and the train-state RNG
    tensorboard: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        _at_least("", self, steps=1, seed=0)        # seed: numpy's seed sequences take no negative entropy
        if self.optim.grad_accum != 1:
            raise ConfigError("optim.grad_accum is not used by rl: set loss.rows_per_micro instead")


def load_rl_config(path: str | Path | None = None, overrides=()) -> RLConfig:
    cfg = load_config(RLConfig, path, overrides)
    if not cfg.policy.path:
        raise ConfigError("policy.path is empty: give the SFT model directory (HF safetensors + tokenizer)")
    if not (Path(cfg.policy.path) / "config.json").exists():
        raise ConfigError(f"policy.path: {cfg.policy.path!r} is not an HF checkpoint directory (no config.json)")
    return cfg
