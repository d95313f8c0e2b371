"""`plan engine`: the engine's own jitted programs compiled for TPU slices or GPU nodes, memory and roofline.

The programs are `sprint_jax.infer.programs`' own (prefill, decode, copy_join over the paged KV
pool), called on abstract arguments built by the same code the engine uses: weights from
`qwen2.abstract_params` placed by the serving rules table (`infer.sharding`), the pool from
`KVPages.zeros` under `eval_shape` placed by `sharding.pool_sharding` (pages over data like the
sequence slots, KV heads over tensor), the rows from `PrefillRows.empty` / `DecodeRows.empty(...).pack()`
/ `CopyRows.empty` at the page-table widths the scheduler picks. A change to a program's
arguments or outputs therefore reaches the planner without an edit here. Nothing is allocated.

An `EngineShape` is what `Engine(max_seqs=C, max_children=K, max_seq_len=S,
max_branch_tokens=S_c, page_size=ps, num_pages=P, mesh=...)` would hold; the programs are compiled
at their largest shapes (every sequence busy, page tables as wide as a full capacity): a prefill
chunk of every sequence, a decode call of C planner rows, a decode call of C forks of K executors,
and a merge join's copy.

The planner's own figures (`memory_estimate`, `decode_step`) are arithmetic on the config and the
shape, held against the compiler's `memory_analysis()` in tests/test_plan_engine.py. How many
runs of a length distribution fit a chip, paged vs slot engine, is `sprint_jax.plan.fit`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from sprint_jax.model.config import Qwen2Config
from sprint_jax.plan import estimate as est

BF16, FP32 = 2, 4


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """An engine's capacities (`Engine`'s arguments) and its mesh (data, fsdp, tensor)."""
    config: Qwen2Config           # as trained (compute dtype = the cache's and the weights')
    concurrency: int              # max_seqs: parent slots, runs held at once
    executors: int                # max_children: child slots per parent
    capacity: int                 # max_seq_len: tokens a parent (a run's planner context) holds
    branch_capacity: int          # max_branch_tokens: tokens an executor holds after its fork
    mesh: tuple[int, int, int] = (1, 1, 1)
    decode_chunk: int = 16
    prefill_chunk: int = 256
    attention_impl: str = "pallas"
    weights_dtype: str | None = None   # the weights' dtype when not the compute dtype (the RL trainer's fp32 master)
    page_size: int = 16           # tokens per page of the KV pool (the Engine's default)
    num_pages: int | None = None  # the pool's pages; None: the Engine's default (`default_pages`)

    @property
    def chips(self) -> int:
        return math.prod(self.mesh)

    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(zip(est.MESH_AXES, self.mesh))

    # `Engine.__init__`: a decode chunk may run past a row's last token before the host sees it
    @property
    def parent_capacity(self) -> int:
        return self.capacity + self.decode_chunk

    @property
    def child_capacity(self) -> int:
        return self.branch_capacity + self.decode_chunk

    @property
    def parts(self) -> int:
        """Page shards: the runs (and their pages) split over data x fsdp where the runs divide."""
        slots = self.mesh[0] * self.mesh[1]
        return slots if slots > 1 and self.concurrency % slots == 0 else 1

    @property
    def engine_config(self):
        """The `EngineConfig` of an engine of this shape (what `Engine` builds)."""
        from sprint_jax.infer.engine_config import EngineConfig
        return EngineConfig(max_seqs=self.concurrency, max_children=self.executors, max_seq_len=self.capacity,
                            max_branch_tokens=self.branch_capacity, decode_chunk=self.decode_chunk,
                            prefill_chunk=self.prefill_chunk, page_size=self.page_size, num_pages=self.num_pages)

    def pages_for(self, tokens: float) -> int:
        return -(-int(tokens) // self.page_size)

    @property
    def default_pages(self) -> int:
        """The Engine's pool when num_pages is not given: every run at its worst case (its planner
        context at full capacity, each executor's full branch and the page a fork copies)."""
        return self.concurrency * self.engine_config.pages_per_seq

    @property
    def pool_pages(self) -> int:
        """The pool's pages, a multiple of the page shards (`EngineConfig.pool_pages`)."""
        return self.engine_config.pool_pages(self.parts)

    def page_bucket(self, n_pages: int, cap_tokens: int) -> int:
        """A page-table width, as `Scheduler._page_bucket` picks it (`buckets.page_bucket`)."""
        from sprint_jax.infer.buckets import page_bucket
        return page_bucket(n_pages, self.page_size, self.engine_config.min_bucket, cap_tokens)

    @property
    def table_widths(self) -> dict[str, int]:
        """Page-table widths of the largest calls: a sequence at full capacity (prefill, planner
        rows: 'parent'), a fork's shared full pages ('shared'), a child's own pages (the copied
        partly filled page, its branch, a decode chunk and a join's fed token: 'child'), and a
        merge join's table (`Joins._merge_pages`: 'join')."""
        from sprint_jax.infer.buckets import bucket
        pcap = self.parent_capacity
        return {"parent": self.page_bucket(self.pages_for(pcap), pcap),
                "shared": self.page_bucket(self.capacity // self.page_size, pcap),
                "child": self.page_bucket(self.pages_for(self.page_size + self.child_capacity),
                                          self.page_size + self.child_capacity),
                "join": bucket(self.pages_for(self.parent_capacity), max(1, 64 // self.page_size))}


def serving_config(shape: EngineShape) -> Qwen2Config:
    """The config the engine runs: weights in the compute dtype (or `weights_dtype`: the RL
    trainer's engine reads its fp32 master weights, each call casting them to the compute dtype),
    heads laid out for the tensor axis as the engine lays them
    (`infer.sharding.head_layout`: KV heads copied when tensor exceeds them)."""
    from sprint_jax.infer.sharding import head_layout

    cfg = shape.config.replace(param_dtype=shape.weights_dtype or shape.config.dtype)
    layout = head_layout(cfg, shape.mesh[2])
    return cfg if layout is None else layout[0]


# ---------------------------------------------------------------------------------------------
# The programs, on abstract arguments
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
    """One engine program to compile: its name and how to trace it."""
    name: str
    trace: Callable[[], Any]          # -> jax.stages.Traced
    kind: str                         # prefill, decode_planner, decode_stage, join_copy
    rows: int                         # rows of the call (tokens per step for decode)


def _abstract(x, sharding):
    import jax
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def engine_programs(shape: EngineShape, devices) -> tuple[list[Program], list[str]]:
    """The programs of an engine of `shape` on a mesh of `devices` (compile-only TPU or GPU
    devices), and the sharding notes (what was replicated)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sprint_jax.infer import programs, sharding as sh
    from sprint_jax.infer.pages import KVPages
    from sprint_jax.infer.buckets import bucket, bucket_fine
    from sprint_jax.model.qwen2 import abstract_params
    from sprint_jax.model.sharding import make_mesh

    data, fsdp, tensor = shape.mesh
    mesh = make_mesh(data, fsdp, tensor, devices=devices)
    notes: list[str] = []
    cfg = serving_config(shape)
    c, k = shape.concurrency, shape.executors
    pages, ps = shape.pool_pages, shape.page_size
    # as `Engine.__init__` places them: pages over data like the sequence slots, KV heads over tensor
    slots = sh.kv_sharding(cfg, mesh, c, notes, "sequence slots")
    parts = sh.slot_parts((slots,))
    pages = -(-pages // parts) * parts
    kv = (sh.pool_sharding(cfg, mesh, slots, pages, ps, notes),)
    params = jax.tree.map(_abstract, abstract_params(cfg), sh.param_shardings(cfg, mesh, notes))
    pool = jax.eval_shape(lambda: KVPages.zeros(cfg, pages, ps))
    pool = jax.tree.map(_abstract, pool, KVPages(kv[0], kv[0]))
    whole = NamedSharding(mesh, P())

    def rows_of(tree):
        return jax.tree.map(lambda a: _abstract(np.asarray(a), whole), tree)

    widths = shape.table_widths
    every = list(range(c))
    _, r_b = sh.slot_blocks(every, c, parts)
    prefill_rows = programs.PrefillRows.empty(r_b, bucket_fine(shape.prefill_chunk, 16), widths["parent"])
    out = [Program(f"prefill {r_b}x{prefill_rows.tokens.shape[1]}", lambda: programs.prefill.trace(
        params, cfg, pool, rows_of(prefill_rows), kv=kv), "prefill", r_b * prefill_rows.tokens.shape[1])]

    _, na = sh.slot_blocks(every, c, parts)
    planner, layout_p = programs.DecodeRows.empty(na, 0, 1, shape.decode_chunk, widths["parent"]).pack()
    out.append(Program(f"decode {na} planner rows", lambda: programs.decode.trace(
        params, cfg, pool, rows_of(planner), layout=layout_p, chunk=shape.decode_chunk, kv=kv,
        attention_impl=shape.attention_impl, n_valid=cfg.vocab_size), "decode_planner", na))
    _, nf = sh.slot_blocks(every, c, parts)
    w = min(bucket(k, 1), k)
    stage, layout_s = programs.DecodeRows.empty(0, nf, w, shape.decode_chunk, 1, widths["shared"],
                                                widths["child"]).pack()
    out.append(Program(f"decode {nf}x{w} executor rows", lambda: programs.decode.trace(
        params, cfg, pool, rows_of(stage), layout=layout_s, chunk=shape.decode_chunk, kv=kv,
        attention_impl=shape.attention_impl, n_valid=cfg.vocab_size), "decode_stage", nf * w))
    # `Joins._join_copy` at the longest branch: K children's rows in one shard's block
    _, j_b = sh.slot_blocks([0] * k, c, parts, cap=c // parts * k)
    copy = programs.CopyRows.empty(j_b, join_window(shape), widths["join"], widths["join"])
    out.append(Program(f"join copy {k} children", lambda: programs.copy_join.trace(
        pool, rows_of(copy), kv=kv), "join_copy", k))
    # the decode calls first: the programs a mesh is most likely to refuse (a search stops there)
    order = {"decode_stage": 0, "decode_planner": 1, "prefill": 2, "join_copy": 3}
    return sorted(out, key=lambda p: order[p.kind]), notes


def join_window(shape: EngineShape) -> int:
    """`Joins._join_window` at the longest branch: a length bucket of a child's positions."""
    from sprint_jax.infer.buckets import bucket
    return min(bucket(shape.branch_capacity + 1, 64), shape.child_capacity)


# ---------------------------------------------------------------------------------------------
# The planner's arithmetic
# ---------------------------------------------------------------------------------------------
def weight_bytes(shape: EngineShape, leave_out: tuple[str, ...] = (), over: tuple[str, ...] = ("tensor",),
                 dtype: str | None = None) -> float:
    """Per-chip bytes of the weights in `dtype` (default the weights' own: the compute dtype or
    `weights_dtype`), split over the mesh axes in `over` by the rules table, less the parameters
    named in `leave_out` ('lm_head/kernel'). Over tensor alone (the default): the weights a call
    reads, since a call gathers what fsdp splits (every slot shard reads whole weights); over every
    axis: each chip's shard, the call's argument."""
    cfg = serving_config(shape)
    item = 2 if (dtype or cfg.param_dtype) == "bfloat16" else 4
    parts = est.sharded_elements(cfg, shape.mesh_dict, over=over)
    return item * sum(v for k, v in parts.items() if k not in leave_out)


def weight_parts(shape: EngineShape, leave_out: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-chip bytes of the weights a call holds: its argument, each chip's shard in the weights'
    dtype ('weights'); when that is not what the layers read (the weights split over fsdp, or held
    in another dtype than the compute dtype) the call's whole compute-dtype copy split over tensor
    alone, gathered or cast once before the decode loop ('gathered_weights'), and, for a shard in
    another dtype that fsdp splits, its cast copy, cast before the gather ('cast_shard'). Read off
    the TPU compiler's arguments and temporaries of the 7B's decode calls on v5p: bf16 and fp32
    weights on fsdp=4 x tensor=2 and fp32 on data=4 x tensor=2."""
    cfg = serving_config(shape)
    every = est.MESH_AXES
    out = {"weights": weight_bytes(shape, leave_out, over=every)}
    fsdp, cast = shape.mesh[1] > 1, cfg.param_dtype != cfg.dtype
    if fsdp or cast:
        out["gathered_weights"] = weight_bytes(shape, leave_out, dtype=cfg.dtype)
    if fsdp and cast:
        out["cast_shard"] = weight_bytes(shape, leave_out, over=every, dtype=cfg.dtype)
    return out


def kv_bytes_per_token(config: Qwen2Config) -> int:
    """K and V of one token, every layer (whole model)."""
    item = 2 if config.dtype == "bfloat16" else 4
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * item


def kv_chip_bytes_per_token(shape: EngineShape) -> float:
    """K and V of one token on one chip: the KV heads split over tensor where they divide."""
    cfg = serving_config(shape)
    return kv_bytes_per_token(cfg) / cfg.num_key_value_heads * _split(cfg.num_key_value_heads, shape.mesh[2])


def _split(n: int, ways: int) -> float:
    """n split `ways` ways if it divides, else whole (the rules table replicates what does not)."""
    return n / ways if ways > 1 and n % ways == 0 else n


def cache_parts(shape: EngineShape) -> dict[str, float]:
    """Per-chip bytes of the KV pool, K and V: `pool_pages` pages of page_size tokens, the pages
    split over the page shards (data x fsdp where the runs divide) and the KV heads over tensor
    where they divide."""
    return {"pool": kv_chip_bytes_per_token(shape) * shape.pool_pages / shape.parts * shape.page_size}


def cache_bytes(shape: EngineShape) -> float:
    """Per-chip bytes of the whole KV pool (`cache_parts`)."""
    return sum(cache_parts(shape).values())


def slot_cache_bytes(shape: EngineShape) -> float:
    """Per-chip bytes the slot engine's cache would hold at this shape (`sharding.plan_slots`'
    reservation): C parent slots of the parent capacity and C x K child slots of the child
    capacity, K and V, the slots over data x fsdp and the KV heads over tensor where they divide
    (a child slot stays with its parent when the parents do not split)."""
    per_token = kv_chip_bytes_per_token(shape)
    slots = shape.mesh[0] * shape.mesh[1]
    c, k = shape.concurrency, shape.executors
    local = _split(c, slots)
    children = (_split(c * k, slots) if local != c else c * k)
    return per_token * (local * shape.parent_capacity + children * shape.child_capacity)


def memory_estimate(shape: EngineShape, kind: str) -> dict[str, float]:
    """Per-chip bytes of one program (`Program.kind`) by component; 'total' their sum: the
    weights it holds (`weight_parts`), the KV pool ('cache': donated and updated in place, counted
    once) and its temporaries (`temporaries`)."""
    # a prefill chunk without logits never reads the vocabulary projection: jit drops it
    out = ({"weights": 0.0} if kind == "join_copy" else
           weight_parts(shape, ("lm_head/kernel",) if kind == "prefill" else ()))
    out["cache"] = cache_bytes(shape)
    out.update(temporaries(shape, kind))
    out["total"] = sum(out.values())
    return out


def temporaries(shape: EngineShape, kind: str) -> dict[str, float]:
    """Per-chip bytes of a program's largest live temporaries (they depend on the rows and the
    page-table widths, not on the pool's size):
      decode calls: the rows' fp32 logits; the pages one layer's attention gathers (K and V of
        each executor's own pages, `table_widths`['child'] wide, and its fp32 scores; with the XLA
        attention also each group's shared pages and each planner row's pages: the Pallas kernel
        reads those in place);
      prefill: each row's gathered pages (K and V, and the transposed copy the blockwise flash
        attention to the pages before the chunk takes: its scores are never held whole) and the
        [rows x chunk] activations;
      join copy: the children's copied tokens (one shard's block of K rows x the join window,
        every layer, K and V).
    Read off the TPU compiler (v5p, v5e): at the 7B on data=4 the prefill's temporaries are 4.1
    bytes a score (one fp32 array), the join's the copied tokens (1.74 vs 1.76 GiB); the decode
    calls hold ~0.7 GiB more that is not modelled. On a mesh without data the compiler keeps a
    second copy of the prefill's scores (6.8 bytes a score on a toy at tensor=4) and fuses the
    join's gather (no temporaries); see tests/test_plan_engine.py."""
    cfg = serving_config(shape)
    item = 2 if cfg.dtype == "bfloat16" else 4
    t = shape.mesh[2]
    local = shape.concurrency // shape.parts
    hkv, heads = _split(cfg.num_key_value_heads, t), _split(cfg.num_attention_heads, t)
    v_local = _split(cfg.vocab_size, t)
    ps, d = shape.page_size, cfg.head_dim
    widths = shape.table_widths
    xla = shape.attention_impl == "xla"
    out: dict[str, float] = {}
    if kind == "decode_planner":
        out["logits"] = 2 * FP32 * local * v_local
        if xla:
            out["gathered_pages"] = 2 * item * local * hkv * widths["parent"] * ps * d
    elif kind == "decode_stage":
        rows = local * min(shape.executors, 1 << max(shape.executors - 1, 0).bit_length())
        own = widths["child"] * ps
        out["logits"] = 2 * FP32 * rows * v_local
        out["gathered_children"] = 2 * item * rows * hkv * own * d
        out["suffix_scores"] = FP32 * rows * heads * own
        if xla:
            out["gathered_prefix"] = 2 * item * local * hkv * widths["shared"] * ps * d
    elif kind == "prefill":
        from sprint_jax.infer.buckets import bucket_fine
        chunk = bucket_fine(shape.prefill_chunk, 16)
        keys = widths["parent"] * ps
        out["gathered_pages"] = 2 * 2 * item * local * hkv * keys * d
        out["activations"] = local * chunk * (4 * item * cfg.hidden_size + 2 * item * cfg.intermediate_size / t)
    elif kind == "join_copy":
        rows = min(1 << max(shape.executors - 1, 0).bit_length(), local * shape.executors)
        out["copied_tokens"] = 2 * item * cfg.num_hidden_layers * rows * join_window(shape) * hkv * d
    return out


def slot_memory_estimate(shape: EngineShape, kind: str) -> dict[str, float]:
    """Per-chip bytes of one program of the slot engine (`bench/slot_programs.py`) at this shape, as
    this planner estimated it before the pool (held against the TPU compiler then: within 2% at
    the 7B on v5p-8 and v5litepod-32): the weights (`weight_parts`), its slot cache
    (`slot_cache_bytes`) and temporaries: a decode call's fp32 logits and one layer's gathered
    child rows and their scores; a prefill's gathered parent rows (K and V, and the transposed copy
    flash attention takes) and activations; a join's windows (8 windows' worth of K and V)."""
    cfg = serving_config(shape)
    item = 2 if cfg.dtype == "bfloat16" else 4
    t = shape.mesh[2]
    local = _split(shape.concurrency, shape.mesh[0] * shape.mesh[1])
    hkv = _split(cfg.num_key_value_heads, t)
    out = ({"weights": 0.0} if kind == "join_copy" else
           weight_parts(shape, ("lm_head/kernel",) if kind == "prefill" else ()))
    out["cache"] = slot_cache_bytes(shape)
    v_local = _split(cfg.vocab_size, t)
    if kind == "decode_planner":
        out["logits"] = 2 * FP32 * local * v_local
    elif kind == "decode_stage":
        rows = local * shape.executors
        out["logits"] = 2 * FP32 * rows * v_local
        out["gathered_children"] = 2 * item * rows * hkv * shape.child_capacity * cfg.head_dim
        out["suffix_scores"] = FP32 * rows * _split(cfg.num_attention_heads, t) * shape.child_capacity
    elif kind == "prefill":
        out["gathered_parents"] = 2 * 2 * item * local * hkv * shape.parent_capacity * cfg.head_dim
        out["activations"] = local * shape.prefill_chunk * (4 * item * cfg.hidden_size
                                                            + 2 * item * cfg.intermediate_size / t)
    elif kind == "join_copy":
        window = min(1 << max(shape.child_capacity - 1, 0).bit_length(), shape.child_capacity,
                     shape.parent_capacity)
        out["windows"] = 2 * 8 * item * cfg.num_hidden_layers * hkv * window * cfg.head_dim
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------
# FLOPs, HBM traffic and the roofline of a decode step
# ---------------------------------------------------------------------------------------------
def decode_step(config: Qwen2Config, tensor: int, groups: int, width: int, prefix: float, suffix: float,
                peak_flops: float, hbm_bandwidth: float) -> dict[str, float]:
    """One decode step of one chip's rows: `groups` groups of `width` rows, each group reading its
    parent's `prefix` keys once for all its rows (the shared-prefix attention) and each row its own
    `suffix` keys, every row writing one token's K/V. Per chip under `tensor`-way tensor
    parallelism (weights, heads and KV heads split `tensor` ways):
      FLOPs   = (2 x matmul weights x rows + 4 x layers x heads x head_dim x keys attended) / tensor
      traffic = (matmul weights x itemsize + KV bytes per token x (groups x prefix + rows x
                suffix + rows)) / tensor
      time    = max(FLOPs / peak, traffic / bandwidth).
    The weights are read in the compute dtype: weights held in another dtype are cast once per call,
    before its decode loop (not counted)."""
    item = 2 if config.dtype == "bfloat16" else 4
    rows = groups * width
    keys = rows * (prefix + suffix + 1)
    flops = (2.0 * est.matmul_params(config) * rows
             + 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * keys) / tensor
    read = groups * prefix + rows * suffix
    traffic = (est.matmul_params(config) * item + kv_bytes_per_token(config) * (read + rows)) / tensor
    compute_s, memory_s = flops / peak_flops, traffic / hbm_bandwidth
    return {"flops": flops, "hbm_traffic_bytes": traffic, "compute_s": compute_s, "memory_s": memory_s,
            "roofline_s": max(compute_s, memory_s), "bound": "compute" if compute_s >= memory_s else "memory"}


def prefill_tokens(config: Qwen2Config, tensor: int, tokens: float, context: float, peak_flops: float,
                   hbm_bandwidth: float) -> dict[str, float]:
    """`tokens` new tokens of one sequence after `context` held ones, in one pass: FLOPs 2 x matmul
    weights x tokens + 4 x layers x heads x head_dim x tokens x (context + tokens / 2); traffic:
    the weights once, the context's K/V read and the new tokens' written; per chip as `decode_step`."""
    item = 2 if config.dtype == "bfloat16" else 4
    if tokens <= 0:
        return {"flops": 0.0, "hbm_traffic_bytes": 0.0, "roofline_s": 0.0}
    flops = (2.0 * est.matmul_params(config) * tokens + 4.0 * config.num_hidden_layers * config.num_attention_heads
             * config.head_dim * tokens * (context + tokens / 2)) / tensor
    traffic = (est.matmul_params(config) * item + kv_bytes_per_token(config) * (context + tokens)) / tensor
    return {"flops": flops, "hbm_traffic_bytes": traffic,
            "roofline_s": max(flops / peak_flops, traffic / hbm_bandwidth)}


def program_figures(shape: EngineShape, kind: str, peak_flops: float, hbm_bandwidth: float) -> dict[str, float]:
    """FLOPs, HBM traffic and roofline time per chip of one program at its compiled shape (every
    slot busy at full context): a decode program per step, a prefill per chunk, a join per copy."""
    cfg = serving_config(shape)
    t = shape.mesh[2]
    local = _split(shape.concurrency, shape.mesh[0] * shape.mesh[1])
    if kind == "decode_planner":
        return decode_step(cfg, t, local, 1, shape.capacity, 0, peak_flops, hbm_bandwidth)
    if kind == "decode_stage":
        return decode_step(cfg, t, local, shape.executors, shape.capacity, shape.branch_capacity, peak_flops,
                           hbm_bandwidth)
    if kind == "prefill":
        one = prefill_tokens(cfg, t, shape.prefill_chunk, shape.capacity - shape.prefill_chunk, peak_flops,
                             hbm_bandwidth)
        weights = est.matmul_params(cfg) * (2 if cfg.dtype == "bfloat16" else 4) / t
        flops = one["flops"] * local
        traffic = weights + (one["hbm_traffic_bytes"] - weights) * local
        return {"flops": flops, "hbm_traffic_bytes": traffic,
                "roofline_s": max(flops / peak_flops, traffic / hbm_bandwidth)}
    # join copy: each child's branch read from its slot and written into the parent's
    traffic = 2.0 * kv_chip_bytes_per_token(shape) * shape.executors * shape.branch_capacity
    return {"flops": 0.0, "hbm_traffic_bytes": traffic, "roofline_s": traffic / hbm_bandwidth}


def decode_ms(shape: EngineShape, peak_flops: float, hbm_bandwidth: float) -> dict[str, float]:
    """Roofline ms per decode step at full context: one row (a planner alone), one run's K
    executors, and C concurrent runs of K executors (per chip: a data shard's share)."""
    cfg = serving_config(shape)
    t = shape.mesh[2]
    local = _split(shape.concurrency, shape.mesh[0] * shape.mesh[1])
    k, p, s = shape.executors, shape.capacity, shape.branch_capacity
    return {"1 row": 1e3 * decode_step(cfg, t, 1, 1, p, 0, peak_flops, hbm_bandwidth)["roofline_s"],
            f"{k} executors": 1e3 * decode_step(cfg, t, 1, k, p, s, peak_flops, hbm_bandwidth)["roofline_s"],
            f"{shape.concurrency} runs x {k}": 1e3 * decode_step(cfg, t, local, k, p, s, peak_flops,
                                                                 hbm_bandwidth)["roofline_s"]}


# ---------------------------------------------------------------------------------------------
# Rows: compile every program of an engine for one slice
# ---------------------------------------------------------------------------------------------
FILL = 0.9      # the estimate must leave this share of HBM free for a candidate to be compiled


def mesh_text(mesh) -> str:
    return ",".join(f"{k}={v}" for k, v in zip(est.MESH_AXES, mesh))


def shape_label(shape: EngineShape, model: str) -> str:
    weights = f", {shape.weights_dtype} weights" if shape.weights_dtype not in (None, shape.config.dtype) else ""
    return (f"engine {model} {shape.concurrency} runs x {shape.executors} executors, capacity "
            f"{shape.capacity}/{shape.branch_capacity}, {shape.pool_pages} pages of {shape.page_size}{weights}")


def engine_rows(shape: EngineShape, where, model: str, progress: Callable[[str], None] | None = None,
                stop_at_failure: bool = False, kinds: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Compile each program of `shape` for the slice `where` (a `chips.Slice`; the mesh must use
    all its chips) and return one row per program (plan train's row keys, and `kind`,
    `decode_ms`). Each is traced as the engine traces it: under the mesh as the active abstract
    mesh (`infer.sharding.traced_on_mesh`, entered by the program itself).
    stop_at_failure: no program is compiled after one that does not fit (a search's candidate).
    kinds: only these programs (`KINDS`; default all)."""
    from sprint_jax.plan.compile import as_tpu, compile_traced, slice_devices

    devices = slice_devices(where.name)
    if shape.chips != len(devices):
        from sprint_jax.errors import UserError
        raise UserError(f"mesh {mesh_text(shape.mesh)} uses {shape.chips} chips but {where.name} has {len(devices)}")
    progs, notes = engine_programs(shape, devices)
    progs = [p for p in progs if kinds is None or p.kind in kinds]
    rows = []
    chip = where.chip
    for prog in progs:
        if progress:
            progress(f"compiling {prog.name} ({shape_label(shape, model)}) for {where.name} ({where.booking}), "
                     f"mesh {mesh_text(shape.mesh)}")
        calls: list = []

        def trace(prog=prog, calls=calls):
            with as_tpu(calls, where):
                return prog.trace()
        result = compile_traced(trace, calls, notes, progress, where)
        memory = memory_estimate(shape, prog.kind)
        row = {"program": f"{prog.name}", "kind": prog.kind, "engine": shape_label(shape, model),
               "topology": where.name, "accelerator_type": where.booking, "chips": where.chips,
               "mesh": shape.mesh_dict, "attention_impl": shape.attention_impl,
               "compiled": result.compiled, "compile_s": round(result.compile_s, 2),
               "lower_s": round(result.lower_s, 2), "per_chip_bytes": None, "hbm_bytes": chip.hbm_bytes,
               "headroom": None, "kernels": sorted(set(result.kernels)), "tpu_custom_calls": result.custom_calls,
               "error": result.error, "compiler_oom": result.oom, "sharding_notes": result.sharding_notes,
               "estimate_bytes": memory["total"], "estimate": memory, "concurrency": shape.concurrency,
               "pool_pages": shape.pool_pages, "page_size": shape.page_size,
               **program_figures(shape, prog.kind, chip.peak_flops, chip.hbm_bandwidth)}
        if prog.kind.startswith("decode"):
            row["decode_ms"] = decode_ms(shape, chip.peak_flops, chip.hbm_bandwidth)
        if result.memory is not None:
            mem = {k: result.memory[k] for k in ("arguments", "outputs", "temp", "alias", "total")}
            row["per_chip_bytes"] = mem
            row["headroom"] = 1.0 - mem["total"] / chip.hbm_bytes
        row["fits"] = bool(result.compiled and row["headroom"] is not None and row["headroom"] >= 0)
        if progress:
            if result.compiled:
                progress(f"compiled in {result.compile_s:.0f} s: {row['per_chip_bytes']['total'] / 2 ** 30:.2f} GiB "
                         f"per chip of {chip.hbm_gib:g} GiB (estimate {memory['total'] / 2 ** 30:.2f})")
            else:
                progress(f"not compiled: {result.error}")
        rows.append(row)
        if stop_at_failure and not row["fits"]:
            break
    return rows


# ---------------------------------------------------------------------------------------------
# Capacity: what fits one chip by the estimate; meshes; the way out of a no-fit
# ---------------------------------------------------------------------------------------------
KINDS = ("prefill", "decode_planner", "decode_stage", "join_copy")


def peak_estimate(shape: EngineShape) -> float:
    """The largest per-chip estimate over the engine's programs (they run one at a time)."""
    return max(memory_estimate(shape, k)["total"] for k in KINDS)


def fits(shape: EngineShape, hbm_bytes: float, fill: float = FILL) -> bool:
    return peak_estimate(shape) <= hbm_bytes * fill


def largest(ok: Callable[[int], bool], step: int = 1, limit: int = 1 << 20) -> int:
    """The largest multiple n of `step` with ok(n) (ok monotone decreasing in n); 0 if none."""
    if not ok(step):
        return 0
    lo, hi = step, step
    while hi < limit and ok(hi * 2):
        lo, hi = hi * 2, hi * 2
    hi = min(hi * 2, limit)
    while hi - lo > step:                 # ok(lo), not ok(hi)
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def capacity(shape: EngineShape, hbm_bytes: float) -> dict[str, int]:
    """By the planner's estimate on chips of `hbm_bytes` (10% kept free): the largest concurrency
    at the shape's executor width, and the largest executor width at its concurrency."""
    slots = shape.mesh[0] * shape.mesh[1]
    return {"max_concurrency": largest(lambda c: fits(dataclasses.replace(shape, concurrency=c), hbm_bytes),
                                        step=slots),
            "max_executors": largest(lambda k: fits(dataclasses.replace(shape, executors=k), hbm_bytes))}


def meshes(chips: int, shape: EngineShape, node: int | None = None) -> list[tuple[int, int, int]]:
    """(data, 1, tensor) meshes on `chips` chips, least tensor parallelism first: tensor a power
    of two that divides the KV heads or is a multiple of them (the engine copies KV heads then),
    data the rest, the runs splitting evenly over data; on GPU nodes tensor stays inside one
    (`node` GPUs)."""
    c = shape.config
    out = []
    t = 1
    while t <= min(chips, node or chips):
        heads_ok = t == 1 or c.num_key_value_heads % t == 0 or t % c.num_key_value_heads == 0
        if chips % t == 0 and heads_ok and shape.concurrency % (chips // t) == 0:
            out.append((chips // t, 1, t))
        t *= 2
    return out


def way_out(shape: EngineShape, where) -> str:
    """Changes that fit by the estimate, in the CLI's flags: more tensor parallelism on this
    slice, fewer runs, fewer executors, a smaller capacity, a larger slice."""
    from sprint_jax.plan.chips import Slice, shapes

    from sprint_jax.plan.train import node_size

    hbm = where.chip.hbm_bytes
    options = []
    for mesh in meshes(where.chips, shape, node_size(where)):
        if mesh[2] > shape.mesh[2] and fits(dataclasses.replace(shape, mesh=mesh), hbm):
            options.append(f"--mesh tensor={mesh[2]} (data={mesh[0]})")
            break
    cap = capacity(shape, hbm)
    if 0 < cap["max_concurrency"] < shape.concurrency:
        options.append(f"--concurrency {cap['max_concurrency']}")
    if 0 < cap["max_executors"] < shape.executors:
        options.append(f"--executors {cap['max_executors']}")
    s = largest(lambda n: fits(dataclasses.replace(shape, capacity=n, branch_capacity=min(n, shape.branch_capacity)),
                                hbm), step=1024, limit=shape.capacity)
    if 0 < s < shape.capacity:
        options.append(f"--capacity {s}")
    for n, grid in shapes(where.chip).items():
        if n <= where.chips:
            continue
        bigger = Slice(where.chip, grid)
        found = next((m for m in meshes(n, shape, node_size(bigger)) if fits(dataclasses.replace(shape, mesh=m), hbm)), None)
        if found:
            options.append(f"--topology {bigger.name} ({bigger.booking}) --mesh tensor={found[2]}")
            break
    if not options:
        return "way out: none of more tensor parallelism, fewer runs or executors, a smaller capacity or a larger " \
               "slice fits by the planner's estimate"
    return "way out: " + " or ".join(options[:4])


def not_fit_line(shape: EngineShape, where, model: str, rows: list[dict] | None = None) -> str:
    """One line: what does not fit on `where`, by how much, and a way out."""
    gib = 2 ** 30
    head = f"{shape_label(shape, model)} on {where.name} ({where.booking}, mesh {mesh_text(shape.mesh)})"
    hbm = where.chip.hbm_bytes
    worst = None
    for r in rows or []:
        used = (r["per_chip_bytes"] or {}).get("total")
        oom = r.get("compiler_oom") or {}
        if used is None and oom.get("used") == oom.get("used") and oom.get("used") is not None:
            used = oom["used"]
        if used is not None and used > hbm and (worst is None or used > worst[1]):
            worst = (r["program"], used, "the TPU compiler")
    if worst is None:
        kind = max(KINDS, key=lambda k: memory_estimate(shape, k)["total"])
        worst = (kind, memory_estimate(shape, kind)["total"], "the planner's estimate")
    parts = memory_estimate(shape, "decode_stage")
    weights = sum(parts.get(k, 0.0) for k in ("weights", "gathered_weights", "cast_shard"))
    what = (f"{worst[0]} needs {worst[1] / gib:.1f} GiB per chip by {worst[2]}, {(worst[1] - hbm) / gib:.1f} GiB "
            f"over the chip's {hbm / gib:g} GiB (weights {weights / gib:.1f} GiB, KV pool "
            f"{parts['cache'] / gib:.1f} GiB)")
    return f"{head}: {what}; {way_out(shape, where)}"


MAX_SEARCH_CANDIDATES = 3


def search(shape: EngineShape, top, model: str, progress: Callable[[str], None] | None = None,
           kinds: tuple[str, ...] | None = None) -> tuple[list[dict] | None, list[dict]]:
    """The smallest slice of `top`'s generation (up to `top`) and the least-tensor mesh on it
    whose programs all compile and fit; a candidate is compiled only when the estimate leaves
    10% of HBM free, and the compiler has the last word. Returns (the accepted rows or None,
    every row compiled)."""
    from sprint_jax.plan.chips import ladder
    from sprint_jax.plan.train import node_size

    tried: list[dict] = []
    candidates = 0
    for where in ladder(top):
        for mesh in meshes(where.chips, shape, node_size(where)):
            candidate = dataclasses.replace(shape, mesh=mesh)
            need = peak_estimate(candidate)
            if need > where.chip.hbm_bytes * FILL:
                if progress:
                    progress(f"search: {where.name} mesh {mesh_text(mesh)}: estimate {need / 2 ** 30:.1f} GiB per "
                             f"chip > {FILL:.0%} of {where.chip.hbm_gib:g} GiB, skipped")
                continue
            rows = engine_rows(candidate, where, model, progress, stop_at_failure=True, kinds=kinds)
            for r in rows:
                r["search"] = True
            tried.extend(rows)
            # a program refused while lowering costs seconds; one that reached the compiler, minutes
            candidates += any(r["compile_s"] > 0 for r in rows)
            if len(rows) == len(kinds or KINDS) and all(r["fits"] for r in rows):
                return rows, tried
            if candidates >= MAX_SEARCH_CANDIDATES:
                return None, tried
    return None, tried
