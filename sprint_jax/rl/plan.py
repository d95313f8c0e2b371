"""`plan rl`: the RL policy-gradient update of an RL config compiled for TPU slices.

The programs are the trainer's own (`rl/loss.py` `build_rl_step` on `train/step.py`
`build_step`, as `rl/trainer.py` builds them): the grad step of one microbatch
[loss.rows_per_micro, loss.seq_len] with the old / reference log-prob inputs the config asks for,
the log-prob forward that computes those inputs (when updates_per_batch > 1 or kl_coef > 0), and
the AdamW apply step. They are traced on ShapeDtypeStructs; nothing is allocated.

A grad row's headroom counts what the chip holds beside the program while it runs (`beside`):
AdamW's two fp32 moments, the running gradient sum of the microbatches before it, and the frozen
fp32 reference weights when the KL term is on. The rollout engine is not in it: it runs between
updates, on the same mesh, and is listed by the `plan engine` estimate (`rollout_engine`: its
calls' argument is the trainer's fp32 weight shard itself) with what the chip holds beside it then
(the AdamW moments, and the reference weights with the KL term).

FLOPs are ours (`flops`): the grad step 6 x matmul weights x tokens + causal attention 6 x L x
B x T^2 x H x D; a log-prob forward a third of that.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from sprint_jax.errors import UserError
from sprint_jax.model.config import Qwen2Config
from sprint_jax.plan import estimate as est
from sprint_jax.plan.chips import GIB, Slice

FP32 = 4
# the packed microbatch rl/layout.py `pack_items` builds: key -> dtype
BATCH = {"tokens": "int32", "positions": "int32", "parents": "int32", "span_end": "int32",
         "advantages": "float32", "mask": "float32", "stage": "int32", "branch": "int32",
         "rollout_logp": "float32"}


@dataclasses.dataclass(frozen=True)
class RLShape:
    """One RL update's shape, from the RL config: a microbatch [rows, seq_len] and what it needs."""
    config: Qwen2Config            # the policy (fp32 master weights, compute dtype)
    rows: int                      # loss.rows_per_micro
    seq_len: int                   # loss.seq_len
    mesh: tuple[int, int, int]     # (data, fsdp, tensor)
    remat: str = "none"            # policy.remat
    loss_chunk: int = 0            # policy.loss_chunk
    with_old: bool = False         # loss.updates_per_batch > 1: logp_old computed before the first update
    with_ref: bool = False         # loss.kl_coef > 0: a frozen reference's log-probs
    updates: int = 1               # loss.updates_per_batch

    @property
    def chips(self) -> int:
        return math.prod(self.mesh)

    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(zip(est.MESH_AXES, self.mesh))

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len

    def step_shape(self) -> est.StepShape:
        """The same microbatch as an SFT step shape (its weights, activations and roofline)."""
        return est.StepShape(self.config, self.rows, self.seq_len, 1, self.mesh, self.remat, self.loss_chunk, "merge")


def shape_from_config(cfg, model_config: Qwen2Config, mesh: tuple[int, int, int]) -> RLShape:
    """The RLShape an `RLConfig` asks for on `mesh`; a microbatch that does not split over
    data x fsdp is refused as the trainer refuses it."""
    rows = cfg.loss.rows_per_micro
    if rows % (mesh[0] * mesh[1]):
        raise UserError(f"loss.rows_per_micro ({rows}) must be a multiple of mesh data x fsdp = {mesh[0] * mesh[1]} "
                        f"(mesh {mesh_text(mesh)}); the trainer refuses it too")
    if cfg.loss.seq_len > model_config.max_position_embeddings:
        raise UserError(f"loss.seq_len {cfg.loss.seq_len} is past the model's max_position_embeddings "
                        f"({model_config.max_position_embeddings})")
    p = cfg.policy
    return RLShape(model_config, rows, cfg.loss.seq_len, mesh, p.remat, p.loss_chunk,
                   cfg.loss.updates_per_batch > 1, cfg.loss.kl_coef > 0, cfg.loss.updates_per_batch)


def mesh_text(mesh) -> str:
    return ",".join(f"{k}={v}" for k, v in zip(est.MESH_AXES, mesh))


# ---------------------------------------------------------------------------------------------
# The planner's own figures
# ---------------------------------------------------------------------------------------------
def attention_flops(c: Qwen2Config, rows: int, seq_len: int) -> float:
    """Causal attention's QK^T and PV products of one forward pass: 2 x L x B x T^2 x H x D (half
    the square; a trie row attends to less, so this bounds it)."""
    return 2.0 * c.num_hidden_layers * rows * seq_len ** 2 * c.num_attention_heads * c.head_dim


def flops(s: RLShape) -> dict[str, float]:
    """Model FLOPs of one microbatch: 'grad' (forward + backward of the policy: 6 x matmul weights
    x tokens + 3 x attention), 'logp' (one forward: 2 x weights x tokens + attention) and 'update':
    per microbatch of a batch, updates x grad + a log-prob forward each for old and reference
    when the config asks for them."""
    c = s.config
    fwd = 2.0 * est.matmul_params(c) * s.tokens + attention_flops(c, s.rows, s.seq_len)
    grad = 3.0 * fwd
    return {"grad": grad, "logp": fwd, "update": s.updates * grad + (int(s.with_old) + int(s.with_ref)) * fwd}


def param_bytes_per_chip(s: RLShape) -> float:
    """fp32 master weights per chip under the rules table."""
    return FP32 * sum(est.sharded_elements(s.config, s.mesh_dict).values())


def batch_bytes_per_chip(s: RLShape) -> float:
    """The packed microbatch's arrays per chip (rows split over data x fsdp): nine 4-byte keys."""
    return 4 * len(BATCH) * s.tokens / (s.mesh[0] * s.mesh[1])


def beside(s: RLShape) -> dict[str, float]:
    """Bytes a chip holds beside the grad program while it runs (module docstring)."""
    p = param_bytes_per_chip(s)
    out = {"adam_moments": 2 * p, "grad_sum": p}
    if s.with_ref:
        out["ref_params"] = p
    return out


def memory_estimate(s: RLShape, kind: str) -> dict[str, float]:
    """Per-chip bytes of a program by component, 'total' their sum. grad: the SFT step's estimate
    of the same microbatch without the AdamW moments (the grad step holds weights, batch,
    gradients, saved activations and the backward peak) plus the old / ref log-prob inputs;
    logp: weights, batch, one chunk's fp32 logits and the output; apply: weights, moments and
    gradients (the state is donated: updated in place)."""
    sft = est.memory_estimate(s.step_shape())
    p = param_bytes_per_chip(s)
    local = s.tokens / (s.mesh[0] * s.mesh[1])
    if kind == "grad":
        out = {k: v for k, v in sft.items() if k not in ("total", "adam", "batch")}
        out["batch"] = batch_bytes_per_chip(s) + FP32 * local * 2      # + old and ref log-prob inputs
    elif kind == "logp":
        c = s.config
        chunk = s.loss_chunk if 0 < s.loss_chunk < s.seq_len and s.seq_len % s.loss_chunk == 0 else s.seq_len
        vocab = c.vocab_size / (s.mesh[2] if c.vocab_size % s.mesh[2] == 0 else 1)
        out = {"params": p, "batch": batch_bytes_per_chip(s), "logits": FP32 * s.rows / (s.mesh[0] * s.mesh[1])
               * chunk * vocab, "logp": FP32 * local}
    elif kind == "apply":
        out = {"params": p, "adam": 2 * p, "grads": p}
    else:
        raise ValueError(kind)
    out["total"] = sum(out.values())
    return out


def roofline(s: RLShape, kind: str, peak_flops: float, hbm_bandwidth: float) -> dict[str, Any]:
    """Time bound of one call per chip (max of compute and HBM time at the chip's peak,
    communication not included). grad: the SFT step's roofline of the microbatch (its
    remat recompute and traffic); logp: one forward reading the bf16 weights once and writing
    and reading the fp32 logits; apply: AdamW's fp32 reads and writes."""
    p = param_bytes_per_chip(s)
    if kind == "grad":
        r = est.roofline(s.step_shape(), peak_flops, hbm_bandwidth)
        return {k: r[k] for k in ("flops", "hardware_flops", "hbm_traffic_bytes", "compute_s", "memory_s",
                                  "roofline_s", "bound", "mfu_bound", "tokens_per_s")}
    if kind == "logp":
        f = flops(s)["logp"]
        gathered = sum(est.sharded_elements(s.config, s.mesh_dict, over=("tensor",)).values())
        local = s.tokens / (s.mesh[0] * s.mesh[1])
        traffic = 2 * gathered + 2 * FP32 * local * s.config.vocab_size / s.mesh[2]
    else:
        f, traffic = 0.0, p * (4 + 3)        # reads weights, grads, two moments; writes weights, moments
    compute_s = f / s.chips / peak_flops
    memory_s = traffic / hbm_bandwidth
    t = max(compute_s, memory_s)
    return {"flops": f, "hardware_flops": f, "hbm_traffic_bytes": traffic, "compute_s": compute_s,
            "memory_s": memory_s, "roofline_s": t, "bound": "compute" if compute_s >= memory_s else "memory",
            "mfu_bound": f / s.chips / peak_flops / t if t else 0.0, "tokens_per_s": s.tokens / t if t and f else 0.0}


# ---------------------------------------------------------------------------------------------
# The programs, compiled
# ---------------------------------------------------------------------------------------------
def kinds(s: RLShape) -> list[str]:
    """The programs an update of `s` runs: grad and apply, and logp when old or ref log-probs are needed."""
    return ["grad"] + (["logp"] if s.with_old or s.with_ref else []) + ["apply"]


def program_name(s: RLShape, kind: str, model: str) -> str:
    extra = "".join([" +old" if s.with_old else "", " +ref" if s.with_ref else ""]) if kind == "grad" else ""
    return f"rl {kind} {model} {s.rows}x{s.seq_len} remat {s.remat}{extra}"


def traces(s: RLShape, optim, devices) -> tuple[dict[str, Callable[[], Any]], list[str]]:
    """kind -> a function tracing that program on abstract arguments (nothing allocated), and the
    sharding notes; built exactly as `rl/trainer.py` builds its update."""
    import jax
    import jax.numpy as jnp

    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.rl.loss import LossSettings, build_rl_step
    from sprint_jax.train import step as step_lib

    mesh = make_mesh(*s.mesh, devices=devices)
    setup = step_lib.build_step(s.config, optim, 1000, mesh, s.remat, s.loss_chunk)
    rl = build_rl_step(setup, LossSettings(1.0, 0.2, 0.01 if s.with_ref else 0.0, s.remat, s.loss_chunk),
                       s.with_old, s.with_ref)
    state = setup.abstract_state()
    params = state["params"]
    batch = {k: jax.ShapeDtypeStruct((s.rows, s.seq_len), jnp.dtype(d)) for k, d in BATCH.items()}
    row_f32 = jax.ShapeDtypeStruct((s.rows, s.seq_len), jnp.float32)
    denom = jax.ShapeDtypeStruct((), jnp.float32)
    grads = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32, sharding=a.sharding), params)
    out = {"grad": lambda: rl.grad.trace(params, batch, denom, row_f32, row_f32),
           "logp": lambda: rl.logp.trace(params, batch),
           "apply": lambda: rl.apply.trace(state, grads)}
    return {k: out[k] for k in kinds(s)}, list(setup.sharding_notes)


def plan_rows(s: RLShape, optim, where: Slice, model: str,
              progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Compile each program of the update for `where` (mesh `s.mesh`) and return one row each:
    the compiler's per-chip bytes, the chip's HBM and headroom (a grad row counts `beside`), the
    planner's estimate, FLOPs and roofline."""
    from sprint_jax.plan.compile import KernelCall, compile_traced, slice_devices, tpu_attention

    devices = slice_devices(where.name)
    if s.chips != len(devices):
        raise UserError(f"mesh {mesh_text(s.mesh)} uses {s.chips} chips but {where.name} has {len(devices)}")
    fns, notes = traces(s, optim, devices)
    rows = []
    for kind, fn in fns.items():
        name = program_name(s, kind, model)
        if progress:
            progress(f"compiling {name} for {where.name} ({where.booking}), mesh {mesh_text(s.mesh)}")
        calls: list[KernelCall] = []

        def trace(fn=fn, calls=calls):
            with tpu_attention(calls, where):
                return fn()
        result = compile_traced(trace, calls, notes, progress, where)
        memory = memory_estimate(s, kind)
        held = beside(s) if kind == "grad" else {}
        row = {"program": name, "kind": kind, "topology": where.name, "accelerator_type": where.booking,
               "chips": where.chips, "mesh": s.mesh_dict, "compiled": result.compiled,
               "compile_s": round(result.compile_s, 2), "lower_s": round(result.lower_s, 2),
               "per_chip_bytes": None, "beside_bytes": held, "hbm_bytes": where.chip.hbm_bytes, "headroom": None,
               "kernels": sorted(set(result.kernels)), "error": result.error, "compiler_oom": result.oom,
               "sharding_notes": result.sharding_notes, "estimate_bytes": memory["total"] + sum(held.values()),
               "estimate": memory, **roofline(s, kind, where.chip.peak_flops, where.chip.hbm_bandwidth)}
        if kind == "grad":
            row["flops_per_microbatch_update"] = flops(s)["update"]
        if result.memory is not None:
            mem = {k: result.memory[k] for k in ("arguments", "outputs", "temp", "alias", "total")}
            row["per_chip_bytes"] = mem
            row["headroom"] = 1.0 - (mem["total"] + sum(held.values())) / where.chip.hbm_bytes
        row["fits"] = bool(result.compiled and row["headroom"] is not None and row["headroom"] >= 0)
        if progress:
            if result.compiled:
                progress(f"compiled in {result.compile_s:.0f} s: {mem['total'] / GIB:.2f} GiB per chip "
                         f"(+ {sum(held.values()) / GIB:.2f} GiB held beside) of {where.chip.hbm_gib:g} GiB")
            else:
                progress(f"not compiled after {result.lower_s + result.compile_s:.0f} s: {result.error}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# The rollout engine
# ---------------------------------------------------------------------------------------------
def rollout_engine(cfg, s: RLShape, where: Slice, model: str, model_arg: str) -> dict[str, Any]:
    """The rollout engine the trainer builds (`rl/trainer.py` `_rollout_engine`: max_seqs = the
    step's runs, max_children = max_prompts, branches of max_branch_tokens + the tag room, on the
    update's mesh, reading the trainer's fp32 weights), as `plan engine` estimates its programs per
    chip (their argument is the trainer's weight shard, and the compute-dtype copy each call
    gathers or casts); what the chip holds beside them (the AdamW moments, and the reference
    weights with the KL term); and the `plan engine` command that compiles them on the slice with
    the trainer's fp32 weights (`model_arg`: its --model)."""
    from sprint_jax.model.capacity import BRANCH_TAG_ROOM
    from sprint_jax.plan import engine as pe

    ro = cfg.rollout
    seqs = ro.concurrency or ro.prompts_per_step * ro.group_size
    branch = ro.orchestrator.max_branch_tokens + BRANCH_TAG_ROOM
    shape = pe.EngineShape(s.config, seqs, ro.orchestrator.max_prompts, ro.max_seq_len, branch, s.mesh,
                           ro.decode_chunk, ro.prefill_chunk, weights_dtype="float32")
    programs = {kind: pe.memory_estimate(shape, kind)["total"] for kind in pe.KINDS}
    held = {"adam_moments": 2 * param_bytes_per_chip(s)}
    if s.with_ref:
        held["ref_params"] = param_bytes_per_chip(s)
    command = (f"sprint-jax plan engine --model {model_arg} --concurrency {seqs} --executors "
               f"{ro.orchestrator.max_prompts} --capacity {ro.max_seq_len} --branch-capacity {branch} "
               f"--decode-chunk {ro.decode_chunk} --prefill-chunk {ro.prefill_chunk} --dtype {s.config.dtype} "
               f"--weights-dtype {shape.weights_dtype} "
               f"--topology {where.name} --mesh {mesh_text(s.mesh)}")
    worst = max(programs.values()) + sum(held.values())
    return {"engine": pe.shape_label(shape, model), "mesh": s.mesh_dict, "cache_bytes_per_chip": pe.cache_bytes(shape),
            "estimate_bytes_per_chip": programs, "beside_bytes": held, "hbm_bytes": where.chip.hbm_bytes,
            "fits": worst <= where.chip.hbm_bytes, "plan_engine_command": command}
