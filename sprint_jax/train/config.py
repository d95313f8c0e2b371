"""The SFT run config (docs/design.md "Training"; paper §8-9): one dataclass tree, loaded with
`sprint_jax.config.load_config` from `configs/sft_*.yaml` plus `--set a.b=value` overrides.

SPRINT and the RFT baseline are the same run on different example files (paper §9): only
`data.train` differs between `configs/sft_r1_distill_7b_sprint.yaml` and `..._rft.yaml`.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

from sprint_jax.config import ConfigError, load_config, to_dict
from sprint_jax.dtypes import DType
from sprint_jax.format import Layout
from sprint_jax.threadweaver import Format

# A shorter row bucket's length must be a multiple of this: the GPU flash tile and the TPU splash
# block are 128 rows (model/attention.py default_blocks); a row is padded up to whole tiles.
BUCKET_MULTIPLE = 128

SPAN_WEIGHTS_DEFAULT = {"query": 0.0, "plan": 1.0, "prompt": 1.0, "execution": 1.0, "answer": 1.0, "tag": 1.0}


@dataclasses.dataclass
class ModelSection:
    """Which Qwen2 / Qwen3 model to train and how to run it."""
    name: str | dict[str, Any] = "tiny"       # preset name, HF dir / config.json path, or an HF config dict
    init: Literal["scratch", "pretrained"] = "scratch"  # pretrained: weights from the HF dir `name`
    dtype: DType = "bfloat16"  # compute dtype; master weights stay fp32
    remat: Literal["none", "full", "dots"] = "full"     # rematerialise each layer in the backward pass
    loss_chunk: int = 1024                     # tokens per vocab-projection chunk in the loss (0 = whole row)
    init_seed: int = 0                         # scratch init key
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # Qwen2Config fields to replace

    def __post_init__(self) -> None:
        if self.loss_chunk < 0:
            raise ValueError("loss_chunk must be >= 0")
        if self.init == "pretrained" and not isinstance(self.name, str):
            raise ValueError("init: pretrained needs `name` to be an HF checkpoint directory")


@dataclasses.dataclass
class PairedSection:
    """The partner set of a SPRINT / RFT pair (paper §9: both train on the same problems). Each run
    names the other's files and layout; with the same seq_len and tokenizer both keep exactly the
    problems usable (parsable, not over-long) in both sets. Empty `train` = no pairing."""
    train: list[str] = dataclasses.field(default_factory=list)  # the partner run's data.train
    layout: Layout = "flat"                    # the partner run's data.layout
    trie_whole_trajectory: bool = False        # the partner run's data.trie_whole_trajectory
    format: Format | None = None               # the partner run's data.format (null: this run's)


@dataclasses.dataclass
class DataSection:
    """Examples -> packed token rows (docs/design.md "Training": span-masked loss, flat, trie or
    merge layout).

    `buckets` (row lengths, ascending, the last = seq_len; [] = one bucket of seq_len, the
    unbucketed stream): each example goes to the smallest bucket that holds it and is packed with
    the others of its bucket; a step's batch comes from one bucket, so there is one compiled step
    shape per bucket (up to 4 more with trim_rows). Token budget rule: `optim.batch_size` counts
    rows of the longest bucket (seq_len); a bucket of length L takes batch_size * seq_len / L rows,
    so every step holds about the same number of tokens. Every bucket but the last must be a
    multiple of BUCKET_MULTIPLE (the attention kernels' tile: shorter rows are padded to it) and
    divide seq_len (a whole number of rows per step)."""
    train: list[str] = dataclasses.field(default_factory=list)  # jsonl files of Examples
    layout: Layout = "flat"                    # flat = paper (one sequence); trie = inference calls; merge = merge join
    seq_len: int = 2048                        # tokens per packed row (with buckets: the longest row)
    buckets: list[int] = dataclasses.field(default_factory=list)  # row lengths; [] = [seq_len] (docstring)
    overlong: Literal["drop", "truncate"] = "drop"  # an example longer than seq_len
    span_weights: dict[str, float] = dataclasses.field(default_factory=lambda: dict(SPAN_WEIGHTS_DEFAULT))
    tokenizer: str = "auto"                    # auto | qwen2 | bytes | a tokenizer directory
    seed: int = 0                              # example order (reshuffled every epoch from this seed)
    pack_open_rows: int = 8                    # rows kept open for first-fit packing
    trim_rows: bool = True                     # cut each batch's trailing padding to the next quarter of its row length
    max_examples: int | None = None            # use only the first N examples read (None = all)
    trie_whole_trajectory: bool = False        # trie: also train the whole trajectory as one unit (ThreadWeaver)
    format: Format = "sprint"                  # the examples' text format: sprint | threadweaver (tag grammar)
    paired: PairedSection = dataclasses.field(default_factory=lambda: PairedSection())

    def __post_init__(self) -> None:
        from sprint_jax.format import SPAN_KINDS

        if self.seq_len < 2:
            raise ValueError("seq_len must be >= 2")
        if self.buckets:
            self._check_buckets()
        if self.pack_open_rows < 1:
            raise ValueError("pack_open_rows must be >= 1")
        unknown = sorted(set(self.span_weights) - set(SPAN_KINDS))
        if unknown:
            raise ValueError(f"span_weights.{unknown[0]} is not a span kind; kinds: {', '.join(SPAN_KINDS)}")
        for k, w in self.span_weights.items():
            if w < 0:
                raise ValueError(f"span_weights.{k} must be >= 0, got {w}")
        self.span_weights = {**{k: 0.0 for k in SPAN_KINDS}, **self.span_weights}
        if not any(self.span_weights.values()):
            raise ValueError("span_weights are all zero: nothing would be trained")


    def _check_buckets(self) -> None:
        b = self.buckets
        if any(not isinstance(x, int) or isinstance(x, bool) for x in b):
            raise ValueError(f"buckets must be a list of integers (row lengths), got {b}")
        if any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"buckets must be strictly ascending, got {b}")
        if b[-1] != self.seq_len:
            raise ValueError(f"the largest of buckets ({b[-1]}) must equal data.seq_len ({self.seq_len})")
        for x in b[:-1]:
            if x < BUCKET_MULTIPLE or x % BUCKET_MULTIPLE:
                raise ValueError(f"bucket {x} is not a multiple of {BUCKET_MULTIPLE} (the attention "
                                 f"kernels' tile)")
            if self.seq_len % x:
                raise ValueError(f"bucket {x} does not divide data.seq_len ({self.seq_len}), so a step "
                                 f"of it cannot hold a whole number of rows")

    @property
    def paired_format(self) -> str:
        """The partner set's text format: `paired.format`, or this run's `format` when unset."""
        return self.paired.format or self.format

    @property
    def row_buckets(self) -> list[int]:
        """The row lengths in use: `buckets`, or [seq_len] when none are given."""
        return list(self.buckets) or [self.seq_len]


@dataclasses.dataclass
class OptimSection:
    """optax AdamW, linear warmup then cosine decay, global-norm clipping."""
    lr: float = 1e-5                           # peak learning rate
    warmup_steps: int = 0                      # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1                  # cosine ends at lr * min_lr_ratio at the last step
    weight_decay: float = 0.0                  # decoupled, on kernels and embeddings only
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0                     # global gradient norm clip (0 = off)
    batch_size: int = 8                        # rows of seq_len tokens per optimizer step (global; data.buckets)
    grad_accum: int = 1                        # microbatches per step (batch_size % grad_accum == 0)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError("lr must be > 0")
        if self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("batch_size and grad_accum must be >= 1")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of grad_accum ({self.grad_accum})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("min_lr_ratio must be in [0, 1]")
        if self.warmup_steps < 0 or self.clip_norm < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps, clip_norm and weight_decay must be >= 0")


@dataclasses.dataclass
class MeshSection:
    """Device mesh (data, fsdp, tensor). One size may be -1: it takes the remaining devices."""
    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self) -> None:
        sizes = (self.data, self.fsdp, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError("at most one of data / fsdp / tensor may be -1")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError("mesh sizes must be positive (or -1 for 'the rest')")


@dataclasses.dataclass
class CheckpointSection:
    """orbax checkpoints under OUT/checkpoints."""
    every: int = 0                             # save every N steps (0 = only at the end)
    keep: int = 3                              # keep the last k
    async_save: bool = True                    # write in the background while training continues
    resume: bool = True                        # continue from the latest valid checkpoint in OUT

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError("every must be >= 0 and keep >= 1")


@dataclasses.dataclass
class ExportSection:
    """The final model as an HF safetensors directory (OUT/hf) that transformers loads."""
    enabled: bool = True
    dtype: DType = "float32"


@dataclasses.dataclass
class DistributedSection:
    """jax.distributed: explicit coordinator, or detected from the environment (SLURM, TPU pods)."""
    coordinator: str | None = None             # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = True                          # detect SLURM / TPU-pod environments

    def __post_init__(self) -> None:
        given = [self.coordinator is not None, self.num_processes is not None, self.process_id is not None]
        if any(given) and not all(given):
            raise ValueError("coordinator, num_processes and process_id must be given together")


@dataclasses.dataclass
class TrainConfig:
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    export: ExportSection = dataclasses.field(default_factory=ExportSection)
    distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
    steps: int = 100                           # optimizer steps (replaced by the derived count when epochs is set)
    epochs: float | None = None                # passes over the packed rows: load_train_config sets steps from
    #                                            the data; a TrainConfig built otherwise trains `steps`
    log_every: int = 10                        # metrics.jsonl / TensorBoard / progress bar cadence
    seed: int = 0                              # the train-state RNG
    tensorboard: bool = True                   # TensorBoard events under OUT/tb
    plot: bool = True                          # OUT/loss.png at the end

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("steps must be >= 1")
        if self.log_every < 1:
            raise ValueError("log_every must be >= 1")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"epochs must be > 0 (or null: train `steps`), got {self.epochs}")
        chunk, t = self.model.loss_chunk, self.data.seq_len
        if 0 < chunk < t and t % chunk:
            raise ValueError(f"model.loss_chunk ({chunk}) must divide data.seq_len ({t}) (or be 0)")
        for b in self.data.row_buckets:
            if 0 < chunk < b and b % chunk:
                raise ValueError(f"model.loss_chunk ({chunk}) must divide every data.buckets length "
                                 f"longer than it; {b} is not a multiple (or set loss_chunk 0)")

    def to_dict(self) -> dict:
        return to_dict(self)


def load_train_config(path: str | Path | None = None, overrides=(), data: dict | None = None) -> TrainConfig:
    """YAML + `--set` overrides -> TrainConfig (ConfigError names the bad field)."""
    cfg = load_config(TrainConfig, path, overrides, data=data)
    if not cfg.data.train:
        raise ConfigError("data.train is empty: give at least one jsonl file of examples")
    if cfg.epochs is not None:
        cfg = dataclasses.replace(cfg, steps=steps_for_epochs(cfg.epochs, epoch_buckets(cfg)))
    return cfg


def steps_for_epochs(epochs: float, buckets: dict[str, dict]) -> int:
    """Optimizer steps for `epochs` passes over the packed rows (at least 1). `buckets` is
    `BucketStream.describe()`: a bucket's epoch takes rows_per_epoch / rows_per_step steps, and the
    stream advances every bucket through its epochs at the same pace, so one epoch is their sum."""
    per_epoch = sum(d["rows_per_epoch"] / d["rows_per_step"] for d in buckets.values() if d["examples"])
    return max(1, math.ceil(epochs * per_epoch - 1e-9))      # 1e-9: 2.0000000001 epochs-worth is 2


def epoch_buckets(cfg: TrainConfig, tokenizer=None) -> dict[str, dict]:
    """Per bucket rows per epoch and per step of `cfg`'s data, laid out and packed as the trainer
    does (data.train, data.paired, layout, seq_len, buckets, seed); `tokenizer` None: data.tokenizer."""
    from sprint_jax.model.tokenizer import pad_id
    from sprint_jax.train import data as data_lib

    d = cfg.data
    if tokenizer is None:
        tokenizer = data_lib.resolve_tokenizer(d.tokenizer, cfg.model.name, cfg.model.init == "pretrained")
    paired = None
    if d.paired.train:
        paired = data_lib.Paired(data_lib.read_examples(d.paired.train, None, d.paired_format), d.paired.layout,
                                 d.paired.trie_whole_trajectory, list(d.paired.train), d.paired_format)
    items, _ = data_lib.build_items(data_lib.read_examples(d.train, d.max_examples, d.format), tokenizer,
                                    d.layout, d.seq_len, d.overlong, d.span_weights, None,
                                    d.trie_whole_trajectory, paired, d.format)
    return data_lib.BucketStream(items, d.row_buckets, cfg.optim.batch_size, d.seed, pad_id(tokenizer),
                                 d.pack_open_rows).describe()
