"""The planner's own figures for one train step: per-chip memory, FLOPs, HBM traffic, roofline.

Everything here is arithmetic on the model config, the batch and the mesh; nothing is traced or
compiled. The memory estimate is held against XLA's `memory_analysis()` of the compiled step
(tests/test_plan.py); FLOPs and traffic are ours because XLA's `cost_analysis()` counts a
`lax.scan` body once and sees no FLOPs inside a Mosaic kernel.

Memory per chip, as the step holds it (`memory_estimate`):
  * state: fp32 master weights + AdamW's two fp32 moments, each sharded by the rules table
    (model/sharding.py; a dimension that does not divide its mesh axis stays whole);
  * batch: the int32 / fp32 [B, T] rows, split over data x fsdp;
  * gradients: fp32, sharded like the weights (three copies with gradient accumulation: the
    running sum, one microbatch's gradients and the next sum);
  * saved activations: what the backward pass keeps per layer under the remat policy (full:
    the layer's bf16 input; dots: also every projection's output; none: every intermediate),
    for all layers;
  * the backward pass's peak, the larger of two phases: the loss (the vocabulary projection
    gathered whole over fsdp in bf16, its fp32 gradient before the reduce-scatter, one chunk's
    fp32 logits, whose cotangent takes their place) or
    one layer (its gathered bf16 weights and fp32 weight gradient, and the working set of its
    recomputed forward and backward: [tokens, width] arrays and the flash kernel's fp32
    gradients and lane-broadcast row statistics).
The phase rule and the working-set counts (`_LAYER_WORK`, `_LOSS_WORK`) were read off XLA's TPU
buffer assignment of the 7B step (a [3584, 152064] fp32 gradient, chunk logits, the stacked
[28, 1, 8192, 3584] layer inputs); the rest is exact sizes. Small programs are not its subject:
the TPU compiler keeps temporaries of tens of MiB in on-chip memory (VMEM), which
`memory_analysis()` does not count as HBM.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from sprint_jax.model.config import Qwen2Config

MESH_AXES = ("data", "fsdp", "tensor")
BF16, FP32, INT32 = 2, 4, 4
LANES = 128          # the TPU flash kernel keeps row statistics (lse, delta) broadcast over 128 lanes


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One train step's shape: the global batch, the microbatching, the mesh, remat, layout."""
    config: Qwen2Config
    batch: int                 # rows per optimizer step (global)
    seq_len: int               # tokens per row
    grad_accum: int = 1        # microbatches per step
    mesh: tuple[int, int, int] = (1, 1, 1)   # (data, fsdp, tensor)
    remat: str = "full"
    loss_chunk: int = 1024     # tokens per vocab-projection chunk (0: the whole row)
    layout: str = "flat"

    @property
    def chips(self) -> int:
        return math.prod(self.mesh)

    @property
    def mesh_dict(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.mesh))

    @property
    def rows_per_chip(self) -> float:
        """Rows of one microbatch on one chip (rows are split over data x fsdp)."""
        return self.batch / self.grad_accum / (self.mesh[0] * self.mesh[1])

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


class _MeshShape:
    """The only part of a Mesh the rules table reads (`mesh.shape`)."""
    def __init__(self, sizes: dict[str, int]):
        self.shape = sizes


def sharded_elements(config: Qwen2Config, mesh: dict[str, int], over: tuple[str, ...] = MESH_AXES
                      ) -> dict[str, float]:
    """Per-chip elements of each parameter under the rules table, counting only the mesh axes in
    `over` (("tensor",) gives a weight as FSDP gathers it). Keys are 'layers/q_proj/kernel'..."""
    import numpy as np

    from sprint_jax.model import qwen2
    from sprint_jax.model.sharding import logical_to_spec

    axes = {"/".join(s.path): s.full_axes() for s in qwen2.param_specs(config)}
    shapes = {"/".join(s.path): s.full_shape(config) for s in qwen2.param_specs(config)}
    view = _MeshShape({k: (v if k in over else 1) for k, v in mesh.items()})
    out = {}
    for name, ax in axes.items():
        spec = logical_to_spec(ax, shapes[name], view, notes=[], name=name)
        div = 1
        for entry in spec:
            for m in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
                div *= view.shape[m]
        out[name] = float(np.prod(shapes[name])) / div
    return out


def param_elements(config: Qwen2Config) -> dict[str, int]:
    """Elements of each parameter (whole model)."""
    from sprint_jax.model import qwen2
    return {"/".join(s.path): math.prod(s.full_shape(config)) for s in qwen2.param_specs(config)}


# [tokens, width] arrays alive while one layer's backward runs (recomputed forward + cotangents),
# in units of (tokens x E bf16, tokens x M bf16 per tensor shard, tokens x H*D fp32 per tensor
# shard); and the loss chunk's fp32 [tokens, V] arrays alive at once (the logits, whose
# cotangent takes their place).
_LAYER_WORK = {"embed": 6.0, "mlp": 5.0, "heads_fp32": 4.0}
_LOSS_WORK = 1.0


def memory_estimate(s: StepShape) -> dict[str, float]:
    """Per-chip bytes of the step by component (module docstring); 'total' is their sum."""
    c = s.config
    mesh = s.mesh_dict
    tensor = mesh["tensor"]
    per_chip = sharded_elements(c, mesh)
    gathered = sharded_elements(c, mesh, over=("tensor",))
    p_chip = sum(per_chip.values())
    layer_names = [k for k in gathered if k.startswith("layers/")]
    layer_gathered = sum(gathered[k] for k in layer_names) / c.num_hidden_layers

    rows = s.rows_per_chip
    n = rows * s.seq_len                                   # tokens per chip per microbatch
    e, m, hd = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim
    kvd = c.num_key_value_heads * c.head_dim
    keys = 7 if s.layout == "merge" else 5

    out = {
        "params": FP32 * p_chip,
        "adam": 2 * FP32 * p_chip,
        "batch": keys * INT32 * s.batch * s.seq_len / (mesh["data"] * mesh["fsdp"]),
        # accumulating: the running sum, one microbatch's gradients and the sum's next value
        "grads": FP32 * p_chip * (1 if s.grad_accum == 1 else 3),
    }
    # saved per layer for the backward pass, in the compute dtype (bf16; fp32 when the step
    # computes in fp32, as a GPU user may: 23.56 GiB compiled for the 7B on h100:8, 19.5 by
    # bf16 sizes)
    act = FP32 if c.dtype == "float32" else BF16
    if s.remat == "full":
        saved = act * e
    elif s.remat == "dots":
        saved = act * (e + (hd + 2 * kvd) / tensor + e + 2 * m / tensor + e)
    else:
        saved = act * (4 * e + 3 * (hd + 2 * kvd) / tensor + 3 * m / tensor) + FP32 * 2 * e
    out["saved_activations"] = n * saved * c.num_hidden_layers
    # The backward pass peaks either in the loss (vocabulary projection gathered in bf16, its
    # fp32 gradient whole over fsdp, one chunk's fp32 logits; the embedding's own gradient
    # stays sharded) or in a layer (its gathered weights and fp32 weight gradient, and its
    # working set); only the larger of the two is counted.
    chunked = 0 < s.loss_chunk < s.seq_len and s.seq_len % s.loss_chunk == 0
    chunk = s.loss_chunk if chunked else s.seq_len
    vocab_local = c.vocab_size / (tensor if c.vocab_size % tensor == 0 else 1)
    loss_phase = ((BF16 + FP32) * vocab_local * e
                  + _LOSS_WORK * rows * chunk * vocab_local * FP32
                  + n * e * (BF16 + FP32))
    heads_local = c.num_attention_heads / (tensor if c.num_attention_heads % tensor == 0 else 1)
    layer_phase = ((act + FP32) * layer_gathered
                   + n * (_LAYER_WORK["embed"] * act * e + _LAYER_WORK["mlp"] * act * m / tensor
                          + _LAYER_WORK["heads_fp32"] * FP32 * hd / tensor + 2 * FP32 * heads_local * LANES))
    out["peak_in_loss" if loss_phase >= layer_phase else "peak_in_layer"] = max(loss_phase, layer_phase)
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------
# FLOPs, HBM traffic, roofline
# ---------------------------------------------------------------------------------------------
def matmul_params(c: Qwen2Config) -> int:
    """Weights that take part in a matmul per token: every projection of every layer + lm_head."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_hidden_layers * (attn + mlp) + c.hidden_size * c.vocab_size


def model_flops(s: StepShape) -> float:
    """Model FLOPs of one step (the MFU convention): 6 x matmul weights x tokens, plus causal
    attention's QK^T and PV products, 6 x B x T^2 x H x D per layer (half of the full square;
    rows packed with several examples need fewer, so this is an upper bound)."""
    c = s.config
    attn = 6.0 * c.num_hidden_layers * s.batch * s.seq_len ** 2 * c.num_attention_heads * c.head_dim
    return 6.0 * matmul_params(c) * s.tokens + attn


def hardware_flops(s: StepShape) -> float:
    """FLOPs the chips execute: model FLOPs plus the forward pass that rematerialisation runs
    again in the backward pass (full: every layer; dots: attention and elementwise only, which
    adds the attention forward)."""
    c = s.config
    layer_fwd = 2.0 * (matmul_params(c) - c.hidden_size * c.vocab_size) * s.tokens
    attn_fwd = 2.0 * c.num_hidden_layers * s.batch * s.seq_len ** 2 * c.num_attention_heads * c.head_dim
    extra = {"full": layer_fwd + attn_fwd, "dots": attn_fwd}.get(s.remat, 0.0)
    if s.loss_chunk and s.loss_chunk < s.seq_len:
        extra += 2.0 * c.hidden_size * c.vocab_size * s.tokens    # the chunked loss recomputes logits
    return model_flops(s) + extra


def hbm_traffic(s: StepShape) -> dict[str, float]:
    """Per-chip HBM bytes moved by one step, by component, and their 'total':
      * optimizer: AdamW reads weights, gradients and both moments and writes weights and
        moments (fp32), and the backward pass writes the gradients once per microbatch;
      * weights: every layer's gathered bf16 weights are read by the forward pass, the remat
        recompute and the backward pass's two products, per microbatch;
      * activations: each layer's [tokens, width] tensors are written and read once per pass;
      * attention: the flash kernels read K and V once per query block (512 rows) per pass;
      * logits: the fp32 [tokens, V] logits are written and read forward and backward."""
    c = s.config
    mesh = s.mesh_dict
    tensor = mesh["tensor"]
    p_chip = sum(sharded_elements(c, mesh).values())
    gathered = sum(sharded_elements(c, mesh, over=("tensor",)).values())
    a = s.grad_accum
    n = s.rows_per_chip * s.seq_len * a                     # tokens per chip per step
    e, m = c.hidden_size, c.intermediate_size
    hd, kvd = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    passes = {"full": 4, "dots": 3}.get(s.remat, 3)
    width = (4 * e + (hd + 2 * kvd) * 2 + 3 * m) / tensor + 4 * e      # one layer's tensors per token
    blocks = max(1, math.ceil(s.seq_len / 512))
    out = {
        "optimizer": FP32 * p_chip * (4 + 3) + FP32 * p_chip * a,
        "weights": BF16 * gathered * passes * a,
        "activations": 2 * BF16 * n * width * c.num_hidden_layers * passes,
        "attention": 3 * BF16 * n * 2 * kvd / tensor * blocks * c.num_hidden_layers,
        "logits": 4 * FP32 * n * c.vocab_size / (tensor if c.vocab_size % tensor == 0 else 1),
    }
    out["total"] = sum(out.values())
    return out


def roofline(s: StepShape, peak_flops: float, hbm_bandwidth: float) -> dict[str, Any]:
    """Step time bound = max(compute time, memory time) per chip at the chip's peak figures
    (inter-chip communication is not in it), and what it implies: tokens/s and the MFU bound."""
    flops = model_flops(s)
    hw = hardware_flops(s)
    traffic = hbm_traffic(s)["total"]
    compute_s = hw / s.chips / peak_flops
    memory_s = traffic / hbm_bandwidth
    step_s = max(compute_s, memory_s)
    return {"flops": flops, "hardware_flops": hw, "hbm_traffic_bytes": traffic,
            "compute_s": compute_s, "memory_s": memory_s, "roofline_s": step_s,
            "bound": "compute" if compute_s >= memory_s else "memory",
            "mfu_bound": flops / s.chips / peak_flops / step_s if step_s else 0.0,
            "tokens_per_s": s.tokens / step_s if step_s else 0.0}
