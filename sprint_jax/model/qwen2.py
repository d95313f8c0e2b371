"""Qwen2 / Qwen3 decoder in JAX / flax.nnx (DeepSeek-R1-Distill-Qwen-7B is Qwen2; ThreadWeaver's
base is Qwen3). One model code for both families: Qwen3 drops the q/k/v biases and adds a per-head
RMSNorm on q and k before RoPE (`config.qkv_bias`, `config.qk_norm`; see model/config.py FAMILIES).

Parameters are declared once, in `PARAM_SPECS`: shape, logical axes, initialiser, the HF tensor
name and when a family has it (`only_if`). The nnx module, the abstract tree (`jax.eval_shape`),
the trainer's shardings and the HF conversion table are all derived from it. Per-layer
parameters are stacked on a leading "layers" axis and the decoder runs under `lax.scan`
(optionally `jax.checkpoint` per layer): one compiled layer body, fast compiles at 7B.

`forward` is pure (params dict in, logits out) and takes an `attend` hook, so the KV-cache
engine (sprint_jax.infer) reuses the same layers with its own cache layouts. Attention lives in
`sprint_jax.model.attention` (re-exported here): the dense reference `attend_partial` +
`merge_partials` (partial attentions merge exactly by log-sum-exp, Hydragen-style) and the
blockwise `flash_attention` over the span rule that training and prefill run.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sprint_jax.model.attention import (  # noqa: F401  (re-exported: the engine and kernels use them)
    NEG_INF, attend_partial, constrain, flash_attention, merge_partials, segment_causal_mask, span_mask)
from sprint_jax.model.config import Qwen2Config
from sprint_jax.dtypes import dtype_of

Params = dict[str, Any]




# ---------------------------------------------------------------------------------------------
# Parameter table (one place per fact)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    path: tuple[str, ...]                      # position in the params tree
    shape: Callable[[Qwen2Config], tuple]      # our shape (per layer for layer params)
    axes: tuple[str, ...]                      # logical axis names (without "layers")
    init: str                                  # "normal" | "zeros" | "ones"
    hf_name: str                               # HF tensor name; {i} = layer index
    transpose: bool                            # HF stores [out, in]: ours = W.T reshaped
    per_layer: bool = True
    only_if: Callable[[Qwen2Config], bool] = lambda c: True

    def full_shape(self, c: Qwen2Config) -> tuple:
        return ((c.num_hidden_layers,) if self.per_layer else ()) + tuple(self.shape(c))

    def full_axes(self) -> tuple[str, ...]:
        return (("layers",) if self.per_layer else ()) + self.axes

    def hf_shape(self, c: Qwen2Config) -> tuple:
        s = self.shape(c)
        if not self.transpose:
            return (int(np.prod(s)),) if len(s) > 1 and self.axes[-1] == "head_dim" else tuple(s)
        n_in = 1 if self.axes[0] in ("embed", "mlp") else 2  # o_proj's input is (heads, head_dim)
        return (int(np.prod(s[n_in:])), int(np.prod(s[:n_in])))


_E = lambda c: c.hidden_size  # noqa: E731
PARAM_SPECS: tuple[ParamSpec, ...] = (
    ParamSpec(("embed_tokens",), lambda c: (c.vocab_size, c.hidden_size), ("vocab", "embed"),
              "normal", "model.embed_tokens.weight", False, per_layer=False),
    ParamSpec(("layers", "input_layernorm", "scale"), lambda c: (_E(c),), ("norm",),
              "ones", "model.layers.{i}.input_layernorm.weight", False),
    ParamSpec(("layers", "q_proj", "kernel"), lambda c: (_E(c), c.num_attention_heads, c.head_dim),
              ("embed", "heads", "head_dim"), "normal", "model.layers.{i}.self_attn.q_proj.weight", True),
    ParamSpec(("layers", "q_proj", "bias"), lambda c: (c.num_attention_heads, c.head_dim),
              ("heads", "head_dim"), "zeros", "model.layers.{i}.self_attn.q_proj.bias", False,
              only_if=lambda c: c.qkv_bias),
    ParamSpec(("layers", "k_proj", "kernel"), lambda c: (_E(c), c.num_key_value_heads, c.head_dim),
              ("embed", "kv_heads", "head_dim"), "normal", "model.layers.{i}.self_attn.k_proj.weight", True),
    ParamSpec(("layers", "k_proj", "bias"), lambda c: (c.num_key_value_heads, c.head_dim),
              ("kv_heads", "head_dim"), "zeros", "model.layers.{i}.self_attn.k_proj.bias", False,
              only_if=lambda c: c.qkv_bias),
    ParamSpec(("layers", "v_proj", "kernel"), lambda c: (_E(c), c.num_key_value_heads, c.head_dim),
              ("embed", "kv_heads", "head_dim"), "normal", "model.layers.{i}.self_attn.v_proj.weight", True),
    ParamSpec(("layers", "v_proj", "bias"), lambda c: (c.num_key_value_heads, c.head_dim),
              ("kv_heads", "head_dim"), "zeros", "model.layers.{i}.self_attn.v_proj.bias", False,
              only_if=lambda c: c.qkv_bias),
    ParamSpec(("layers", "q_norm", "scale"), lambda c: (c.head_dim,), ("norm",), "ones",
              "model.layers.{i}.self_attn.q_norm.weight", False, only_if=lambda c: c.qk_norm),
    ParamSpec(("layers", "k_norm", "scale"), lambda c: (c.head_dim,), ("norm",), "ones",
              "model.layers.{i}.self_attn.k_norm.weight", False, only_if=lambda c: c.qk_norm),
    ParamSpec(("layers", "o_proj", "kernel"), lambda c: (c.num_attention_heads, c.head_dim, _E(c)),
              ("heads", "head_dim", "embed"), "normal", "model.layers.{i}.self_attn.o_proj.weight", True),
    ParamSpec(("layers", "post_attention_layernorm", "scale"), lambda c: (_E(c),), ("norm",),
              "ones", "model.layers.{i}.post_attention_layernorm.weight", False),
    ParamSpec(("layers", "gate_proj", "kernel"), lambda c: (_E(c), c.intermediate_size), ("embed", "mlp"),
              "normal", "model.layers.{i}.mlp.gate_proj.weight", True),
    ParamSpec(("layers", "up_proj", "kernel"), lambda c: (_E(c), c.intermediate_size), ("embed", "mlp"),
              "normal", "model.layers.{i}.mlp.up_proj.weight", True),
    ParamSpec(("layers", "down_proj", "kernel"), lambda c: (c.intermediate_size, _E(c)), ("mlp", "embed"),
              "normal", "model.layers.{i}.mlp.down_proj.weight", True),
    ParamSpec(("norm", "scale"), lambda c: (_E(c),), ("norm",), "ones", "model.norm.weight", False,
              per_layer=False),
    ParamSpec(("lm_head", "kernel"), lambda c: (_E(c), c.vocab_size), ("embed", "vocab"), "normal",
              "lm_head.weight", True, per_layer=False, only_if=lambda c: not c.tie_word_embeddings),
)


def param_specs(config: Qwen2Config) -> list[ParamSpec]:
    return [s for s in PARAM_SPECS if s.only_if(config)]


def tree_set(tree: dict, path: Sequence[str], value) -> None:
    """Sets tree[path[0]][path[1]]...[path[-1]] = value in place, making the missing dicts."""
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def tree_get(tree: dict, path: Sequence[str]):
    for p in path:
        tree = tree[p]
    return tree


def init_params(config: Qwen2Config, key: jax.Array, std: float = 0.02) -> Params:
    """Random parameters (normal(std) kernels, zero biases, unit norms), as a plain dict."""
    dt = dtype_of(config.param_dtype)
    params: Params = {}
    specs = param_specs(config)
    for spec, k in zip(specs, jax.random.split(key, len(specs))):
        shape = spec.full_shape(config)
        if spec.init == "normal":
            v = (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)
        elif spec.init == "zeros":
            v = jnp.zeros(shape, dt)
        else:
            v = jnp.ones(shape, dt)
        tree_set(params, spec.path, v)
    return params


def logical_axes(config: Qwen2Config) -> Params:
    """The params tree with each leaf replaced by its logical axis names."""
    out: Params = {}
    for spec in param_specs(config):
        tree_set(out, spec.path, spec.full_axes())
    return out


def abstract_params(config: Qwen2Config) -> Params:
    """ShapeDtypeStructs of every parameter; nothing is allocated."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def param_count(config: Qwen2Config) -> int:
    """Number of parameters, computed with jax.eval_shape (no allocation)."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract_params(config))))


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis as Qwen2/3 compute it: statistics in fp32, scale in the input dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, half-split layout (HF `rotate_half`). x [B, T, N, D], positions [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))      # [D/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq                        # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1)[:, :, None, :]          # [B, T, 1, D]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rotated = jnp.concatenate([-x2, x1], -1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def dense(x: jax.Array, w: jax.Array, n_in: int = 1) -> jax.Array:
    """x [..., *I] @ w [*I, *O] -> [..., *O], contracting x's last `n_in` axes with w's first `n_in`.

    Runs as one 2-D matmul over the flattened rows ([B*T, prod I] @ [prod I, prod O]): XLA CPU
    differentiates that form ~2x faster than the batched einsum (the weight gradient of
    "bte,em->btm" is a two-axis contraction it handles badly). Same arithmetic, same result.
    """
    lead, inner, outer = x.shape[: x.ndim - n_in], w.shape[:n_in], w.shape[n_in:]
    k = math.prod(inner)
    y = x.reshape(-1, k) @ w.reshape(k, -1)                                   # [N, I] @ [I, O]
    return y.reshape(*lead, *outer)


@jax.custom_vjp
def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """The MLP's gate: silu(g) * u, with a hand-written backward.

    Autodiff of `jax.nn.silu(g) * u` makes the forward pass write sigmoid(g), silu(g) and silu's
    derivative as separate [tokens, intermediate] arrays for the backward (memory-bound passes,
    the largest activations of the layer). This backward keeps only g and u (the two matmul
    outputs, live anyway) and recomputes sigmoid(g) in the one fused pass that forms both
    cotangents, in fp32: dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s with s = sigmoid(g).
    Measured on the 10M CPU train step (`sprint-jax bench train --hidden 384 --layers 6 --heads 6`):
    ~3% faster. tests/test_model_parity.py checks it, and every parameter's gradient, against HF
    torch's autograd."""
    return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
    return swiglu(g, u), (g, u)


def _swiglu_bwd(res, dy):
    g, u = res
    gf, dyf = g.astype(jnp.float32), dy.astype(jnp.float32)
    s = jax.nn.sigmoid(gf)
    du = dyf * gf * s
    dg = dyf * u.astype(jnp.float32) * s * (1.0 + gf * (1.0 - s))
    return dg.astype(g.dtype), du.astype(u.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _layer(config: Qwen2Config, x, lp, positions, attend: AttendFn, layer_cache):
    """One decoder layer. x [B, T, E]; lp: this layer's params (no leading layers axis)."""
    cdt = dtype_of(config.dtype)
    c = lambda a: a.astype(cdt)  # noqa: E731
    h = rms_norm(x, lp["input_layernorm"]["scale"], config.rms_norm_eps)
    q = dense(h, c(lp["q_proj"]["kernel"]))                                   # [B, T, H, D]
    k = dense(h, c(lp["k_proj"]["kernel"]))                                   # [B, T, Hkv, D]
    v = dense(h, c(lp["v_proj"]["kernel"]))                                   # [B, T, Hkv, D]
    if config.qkv_bias:                                                       # Qwen2
        q, k, v = (y + c(lp[n]["bias"]) for y, n in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
    if config.qk_norm:                                # Qwen3: per-head RMSNorm over D, before RoPE
        q = rms_norm(q, lp["q_norm"]["scale"], config.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"]["scale"], config.rms_norm_eps)
    q = rope(q, positions, config.rope_theta)
    k = rope(k, positions, config.rope_theta)
    a, new_cache = attend(q, k, v, layer_cache)                               # [B, T, H, D]
    x = x + dense(a, c(lp["o_proj"]["kernel"]), n_in=2)                       # [B, T, E]
    h = rms_norm(x, lp["post_attention_layernorm"]["scale"], config.rms_norm_eps)
    g = dense(h, c(lp["gate_proj"]["kernel"]))                                # [B, T, M]
    u = dense(h, c(lp["up_proj"]["kernel"]))                                  # [B, T, M]
    x = x + dense(swiglu(g, u), c(lp["down_proj"]["kernel"]))                # [B, T, E]
    return x, new_cache


def masked_attend(mask: jax.Array) -> AttendFn:
    """The attend hook for a plain (cache-free) pass with a dense mask (the reference path)."""
    def attend(q, k, v, layer_cache):
        return attend_partial(q, k, v, mask)[0], layer_cache
    return attend


def span_attend(span_end: jax.Array, impl: str | None = None, stage: jax.Array | None = None,
                branch: jax.Array | None = None, layout: str | None = None) -> AttendFn:
    """The attend hook for a plain pass under the span rule (train/data.py): flash attention
    (with stage / branch: the merge layout's (stage, branch) form; layout "flat" lets TPU run
    splash attention, model/attention.py)."""
    def attend(q, k, v, layer_cache):
        q = constrain(q, ("batch", None, "heads", None))
        k = constrain(k, ("batch", None, "kv_heads", None))
        v = constrain(v, ("batch", None, "kv_heads", None))
        out = flash_attention(q, k, v, span_end, stage=stage, branch=branch, impl=impl, layout=layout)
        return constrain(out, ("batch", None, "heads", None)), layer_cache
    return attend


def embed(params: Params, config: Qwen2Config, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed_tokens"], tokens, axis=0).astype(dtype_of(config.dtype))


def unembed(params: Params, config: Qwen2Config, x: jax.Array) -> jax.Array:
    """Final norm + lm_head; logits in fp32. x [..., E] -> [..., V], one 2-D matmul (see `dense`)."""
    x = rms_norm(x, params["norm"]["scale"], config.rms_norm_eps)
    lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1])                     # [N, E]
    if config.tie_word_embeddings:
        w = params["embed_tokens"].astype(x.dtype)                            # [V, E]
        logits = jnp.einsum("ne,ve->nv", rows, w, preferred_element_type=jnp.float32)
    else:
        w = params["lm_head"]["kernel"].astype(x.dtype)                       # [E, V]
        logits = jnp.einsum("ne,ev->nv", rows, w, preferred_element_type=jnp.float32)
    return logits.reshape(*lead, -1)                                          # [..., V]


# Plain forwards (training) of models with at most this many layers unroll the layer scan: the
# scan's per-layer bookkeeping (slicing the stacked weights, carrying activations, the backward
# pass's stacked residuals) is 10-30% of a small model's CPU train step (measured with `bench
# train`: tiny 3 layers, 10M 6 layers), and a few layer bodies still compile fast. Deep models
# (7B: 28 layers) keep one compiled layer body.
UNROLL_MAX_LAYERS = 8


def scan_unroll(config: Qwen2Config) -> int:
    """The `unroll` of the layer scan in a plain forward: all layers for small stacks, else 1."""
    n = config.num_hidden_layers
    return n if n <= UNROLL_MAX_LAYERS else 1


def per_layer(params: Params) -> Params:
    """The same weights with `layers` as a tuple of per-layer trees (one copy of the layer
    weights) instead of arrays stacked on a leading layers axis. `decoder` runs either form. The
    stacked form's scan takes each layer's weights out of the stack with dynamic slices, which XLA
    CPU materialises as copies every time the stack runs; the per-layer form's layers read their
    own weights where they lie. The engine runs small models in this form (`Engine`'s
    per_layer_weights: a decode step runs the stack once per token, and on the demo's model those
    copies were about half of a one-row step)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))}


def decoder(params: Params, config: Qwen2Config, x: jax.Array, positions: jax.Array,
            attend: AttendFn, cache: Any = None, remat: str = "none", unroll: int = 1):
    """The layer stack under lax.scan (`unroll` layers per loop iteration; the same arithmetic).
    `cache` is any pytree with a leading layers axis (or None). With `params["layers"]` in the
    per-layer form (`per_layer`) the scan runs over the layer index and a `lax.switch` on it runs
    the layer body with that layer's own weights (no slice of a stack). Still one scan, not a
    Python loop over the layers: the engine's attend reads its KV cache at the scan's layer
    index and the caller writes the new K/V after the stack; with the layers unrolled in the
    caller's computation XLA could not order those writes after the last layer's reads and copied
    the whole cache every step (`tests/test_batch_engine.py`'s HLO test checks both forms)."""
    def body(carry, xs):
        lp, lc = xs
        y, new_lc = _layer(config, constrain(carry, ("batch", None, None)), lp, positions, attend, lc)
        return constrain(y, ("batch", None, None)), new_lc

    if remat == "full":
        body = jax.checkpoint(body)
    elif remat == "dots":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    elif remat != "none":
        raise ValueError(f"remat must be 'none', 'full' or 'dots', got {remat!r}")
    if isinstance(params["layers"], (list, tuple)):
        layers = params["layers"]

        def run(carry, xs):
            i, lc = xs
            branches = [lambda c, layer_cache, lp=lp: body(c, (lp, layer_cache)) for lp in layers]
            return jax.lax.switch(i, branches, carry, lc)

        return jax.lax.scan(run, x, (jnp.arange(len(layers)), cache))
    x, new_cache = jax.lax.scan(body, x, (params["layers"], cache), unroll=unroll)
    return x, new_cache


def forward(params: Params, config: Qwen2Config, tokens: jax.Array, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, attention_mask: jax.Array | None = None,
            *, span_end: jax.Array | None = None, stage: jax.Array | None = None,
            branch: jax.Array | None = None, attention_impl: str | None = None,
            remat: str = "none", return_hidden: bool = False, attention_layout: str | None = None) -> jax.Array:
    """Plain forward pass: tokens [B, T] -> logits [B, T, V] (fp32).

    positions default to arange(T). span_end [B, T] selects flash attention under the span rule
    (row i sees j iff j <= i < span_end[j]; the trainer's one mask for both layouts), with
    `attention_impl` its body (None: per backend); stage and branch [B, T] add the merge layout's
    (stage, branch) factor (model/attention.py); attention_layout "flat" says span_end is the flat
    layout's (TPU then runs splash attention; `attention.resolve_impl`). Otherwise the dense reference runs: segment_ids
    [B, T] restrict a causal mask to the same segment (packing; segment 0 can mark padding), or
    attention_mask [B, T, T] (True = may attend) replaces it entirely.
    """
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if span_end is not None:
        if attention_mask is not None or segment_ids is not None:
            raise ValueError("pass span_end, or segment_ids / attention_mask, not both")
        attend = span_attend(span_end, attention_impl, stage, branch, attention_layout)
    else:
        if stage is not None or branch is not None:
            raise ValueError("stage / branch go with span_end (or build the dense mask with span_mask)")
        if attention_mask is None:
            if segment_ids is None:
                segment_ids = jnp.ones((b, t), jnp.int32)
            attention_mask = segment_causal_mask(segment_ids)
        attend = masked_attend(attention_mask)
    x = embed(params, config, tokens)
    x, _ = decoder(params, config, x, positions, attend, None, remat, unroll=scan_unroll(config))
    if return_hidden:
        return x
    return unembed(params, config, x)


@functools.partial(jax.jit, static_argnames=("config", "remat"))
def _forward_jit(params, config, tokens, positions, segment_ids, attention_mask, remat="none"):
    return forward(params, config, tokens, positions, segment_ids, attention_mask, remat=remat)


# ---------------------------------------------------------------------------------------------
# The nnx module
# ---------------------------------------------------------------------------------------------
class _Node(nnx.Module):
    """A plain container so the module tree mirrors the params dict."""


class Qwen2(nnx.Module):
    """Qwen2 or Qwen3 (by `config.model_type`) as an nnx module. Each parameter is an `nnx.Param`
    with `logical_axes` metadata.

    `model(tokens, positions=None, segment_ids=None)` -> logits [B, T, V]. The pure function
    behind it is `forward(model.params, model.config, ...)`.
    """

    def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs | None = None, params: Params | None = None):
        self.config = config
        if params is None:
            key = rngs.params() if rngs is not None else jax.random.key(0)
            params = init_params(config, key)
        for spec in param_specs(config):
            node = self
            for name in spec.path[:-1]:
                if not hasattr(node, name):
                    setattr(node, name, _Node())
                node = getattr(node, name)
            value = tree_get(params, spec.path)
            if tuple(value.shape) != spec.full_shape(config):
                raise ValueError(f"{'.'.join(spec.path)}: shape {tuple(value.shape)} != "
                                 f"expected {spec.full_shape(config)}")
            setattr(node, spec.path[-1], nnx.Param(value, logical_axes=spec.full_axes()))

    @property
    def params(self) -> Params:
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, tokens, positions=None, segment_ids=None, attention_mask=None):
        tokens = jnp.asarray(tokens)
        return _forward_jit(self.params, self.config, tokens, positions, segment_ids, attention_mask)
