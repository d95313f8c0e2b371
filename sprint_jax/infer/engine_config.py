"""An engine's sizes in one place (`EngineConfig`): what `Engine` builds, and what the RL trainer,
`eval`, `serve` and the planners size the engine's memory by.

Capacities:
  max_seqs           sequences held at once (the decode batch's rows; more opens queue)  (default 16)
  max_children       children per fork (executors of a stage, n of n>1)                  (default 8)
  max_seq_len        tokens one sequence may hold                                        (default 2048)
  max_branch_tokens  forced prefix + generated tokens per child                          (default 512)
  decode_chunk       decode steps per host round trip                                    (default 16)
  prefill_chunk      tokens per sequence per prefill call                                (default 256)
  page_size          tokens per page of the KV pool                                      (default 16)
  num_pages          pages in the pool (None: what the capacities would reserve, `pool_pages`)
  min_bucket         the smallest attention read, in tokens (shapes are buckets above it) (default 64)
"""
from __future__ import annotations

import dataclasses
import math

from sprint_jax.infer.requests import EngineError


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_seqs: int = 16
    max_children: int = 8
    max_seq_len: int = 2048
    max_branch_tokens: int = 512
    decode_chunk: int = 16
    prefill_chunk: int = 256
    page_size: int = 16
    num_pages: int | None = None
    min_bucket: int = 64

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name == "num_pages":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise EngineError(f"{f.name} must be a positive integer, got {v!r}")

    @property
    def parent_capacity(self) -> int:
        """Tokens a sequence may write: a decode chunk may run past its last token before the host
        sees the stop."""
        return self.max_seq_len + self.decode_chunk

    @property
    def child_capacity(self) -> int:
        return self.max_branch_tokens + self.decode_chunk

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def pages_per_seq(self) -> int:
        """The most pages one sequence with a full fork holds: its own tokens, and per child a copy
        of the partly filled page at the fork and the child's tokens."""
        return self.pages_for(self.parent_capacity) + self.max_children * (self.pages_for(self.child_capacity) + 1)

    def pool_pages(self, parts: int = 1) -> int:
        """The pool's pages: num_pages, or every sequence at its capacities; a multiple of `parts`
        (the page shards)."""
        pages = self.max_seqs * self.pages_per_seq if self.num_pages is None else self.num_pages
        return -(-pages // parts) * parts

    def page_bytes(self, config) -> int:
        """K and V bytes of one page, every layer and KV head (config: the model's, in the dtype
        the engine computes in)."""
        from sprint_jax.model.qwen2 import dtype_of
        import numpy as np
        item = np.dtype(dtype_of(config.dtype)).itemsize
        return 2 * config.num_hidden_layers * config.num_key_value_heads * self.page_size * config.head_dim * item

    def pool_bytes_per_device(self, config, mesh=None) -> int:
        """Bytes of the pool on the fullest device: pages split over the mesh axes that split the
        sequence slots (data x fsdp, when max_seqs divides them), KV heads over tensor where they
        divide, as `Engine` places it. config: the config the engine serves (on a mesh,
        `sharding.serving_config`'s)."""
        if mesh is None:
            return self.pool_pages() * self.page_bytes(config)
        from sprint_jax.infer import sharding as sh
        slots = sh.kv_sharding(config, mesh, self.max_seqs, [], "sequence slots")
        parts = sh.slot_parts((slots,))
        spec = tuple(slots.spec) + (None,) * 5
        heads = sh.axes_size(mesh, spec[sh.KV_HEAD_AXIS])
        return math.ceil(self.pool_pages(parts) / parts) * self.page_bytes(config) // heads

    def engine_kwargs(self) -> dict:
        return dataclasses.asdict(self)
