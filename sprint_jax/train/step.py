"""Span-weighted next-token loss and the sharded, jitted train step (paper §8; docs/design.md
"Training").

The step is `jax.jit` with NamedSharding in/out shardings (what pjit became) and the train state
donated. Master weights and AdamW moments are fp32; the forward runs in `config.dtype` (bf16 on
accelerators) because qwen2 casts each weight at its use. Gradient accumulation scans over
microbatches and divides by the *global* loss weight, so A microbatches of b rows give the same
update as one batch of A*b rows. Each decoder layer can be rematerialised (`remat`).

The loss reads each token's prediction from the hidden state of its `parents` row (see
train/data.py), which is i-1 in the flat layout and the trie parent in the trie layout: one loss
for both layouts, and a token with several children in the trie is predicted exactly once each.

The state's `rng` is split every step and checkpointed, so a resumed run continues the same key
stream; Qwen2 has no dropout, so no op draws from it today (a stochastic regulariser would).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from sprint_jax.model import qwen2
from sprint_jax.model.config import Qwen2Config
from sprint_jax.model.sharding import param_shardings
from sprint_jax.train import mesh as mesh_lib
from sprint_jax.train.config import OptimSection

BATCH_KEYS = ("tokens", "positions", "parents", "span_end", "weights")
MERGE_KEYS = ("stage", "branch")     # the merge layout's rows also carry these (train/data.py)
BATCH_DTYPES = {"tokens": jnp.int32, "positions": jnp.int32, "parents": jnp.int32, "span_end": jnp.int32,
                "weights": jnp.float32, "stage": jnp.int32, "branch": jnp.int32}


def batch_keys(layout: str = "flat") -> tuple[str, ...]:
    """The arrays of one batch for a data layout (merge adds the per-token stage and branch)."""
    return BATCH_KEYS + MERGE_KEYS if layout == "merge" else BATCH_KEYS

State = dict[str, Any]   # {"step": int32[], "params": tree, "opt_state": optax state, "rng": uint32[2]}


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------
def attention_mask(span_end: jax.Array, stage: jax.Array | None = None,
                   branch: jax.Array | None = None) -> jax.Array:
    """[B, T] span ends -> [B, T, T] dense mask: row i sees column j iff j <= i < span_end[j]
    (and, with the merge layout's stage / branch, the (stage, branch) rule of model/attention.py).
    The reference for tests; the step itself runs flash attention on span_end (no [T, T] mask)."""
    return qwen2.span_mask(span_end, stage=stage, branch=branch)


def chunk_logprobs(params, config: Qwen2Config, hidden: jax.Array, tokens: jax.Array,
                   temperature: float = 1.0, n_valid: int | None = None) -> jax.Array:
    """log p(`tokens` [B, C]) from the hidden states that predict them [B, C, E], under
    softmax(logits / temperature); with `n_valid` only ids < n_valid have mass. fp32 [B, C].

    Vocab-parallel: the logits stay split over the mesh's `tensor` axis as the lm_head is (the
    rules table's "vocab"), so no chip holds a chunk's whole-vocabulary fp32 logits or their
    cotangent. The log-sum-exp's max and sum and the target logit (a masked sum over the local
    ids) are reductions over the vocabulary: [B, C] partial results combined across `tensor`."""
    hidden = qwen2.constrain(hidden, ("batch", None, None))
    logits = qwen2.constrain(qwen2.unembed(params, config, hidden), ("batch", None, "vocab"))  # [B, C, V] fp32
    if temperature != 1.0:
        logits = logits / temperature
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if n_valid is not None and n_valid < logits.shape[-1]:
        logits = jnp.where(ids < n_valid, logits, -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = top[..., 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
    # the target's logit as a masked sum, not a gather: a gather along a split axis would be
    # partitioned by first collecting the whole vocabulary on every chip
    target = jnp.sum(jnp.where(ids == tokens[..., None], logits, 0.0), axis=-1)
    return target - lse


def hidden_logprobs(params, config: Qwen2Config, hidden: jax.Array, tokens: jax.Array, loss_chunk: int = 0,
                    temperature: float = 1.0, n_valid: int | None = None) -> jax.Array:
    """`chunk_logprobs` over [B, T] tokens and their predicting hidden states [B, T, E], fp32 [B, T];
    the one log-prob of SFT's loss and RL's (rl/loss.py).

    With `loss_chunk` = C dividing T, the vocabulary projection runs over C tokens at a time
    under `jax.checkpoint`, so [B, T, V] logits (5 GB per 8k-token row at V = 152k) never exist
    at once; the backward pass recomputes each chunk's logits."""
    b, t, e = hidden.shape
    if not loss_chunk or loss_chunk >= t or t % loss_chunk:
        return chunk_logprobs(params, config, hidden, tokens, temperature, n_valid)
    n = t // loss_chunk
    hs = jnp.swapaxes(hidden.reshape(b, n, loss_chunk, e), 0, 1)            # [n, B, C, E]
    ts = jnp.swapaxes(tokens.reshape(b, n, loss_chunk), 0, 1)               # [n, B, C]
    body = jax.checkpoint(lambda _, x: (None, chunk_logprobs(params, config, *x, temperature, n_valid)))
    _, lp = jax.lax.scan(body, None, (hs, ts))                              # [n, B, C]
    return jnp.swapaxes(lp, 0, 1).reshape(b, t)


def token_nll(params, config: Qwen2Config, batch: dict, remat: str = "none", loss_chunk: int = 0,
              attention: str = "flash", layout: str | None = None) -> jax.Array:
    """Negative log-likelihood of every token given its parent's hidden state, fp32 [B, T]
    (`hidden_logprobs`, chunked by `loss_chunk`).

    `attention`: "flash" (blockwise, `model.attention.flash_attention` on span_end; what training
    runs) or "dense" (the [T, T] mask reference, kept for tests and `bench train`). `layout`: the
    rows' data layout when known ("flat" lets TPU run splash attention; None: the general rule).
    """
    merge = {k: batch[k] for k in MERGE_KEYS if k in batch}     # the merge layout's rows
    if attention == "flash":
        mask_kw = {"span_end": batch["span_end"], "attention_layout": layout, **merge}
    elif attention == "dense":
        mask_kw = {"attention_mask": attention_mask(batch["span_end"], **merge)}
    else:
        raise ValueError(f"attention must be 'flash' or 'dense', got {attention!r}")
    hidden = qwen2.forward(params, config, batch["tokens"], batch["positions"], remat=remat,
                           return_hidden=True, **mask_kw)                    # [B, T, E]
    src = jnp.maximum(batch["parents"], 0)
    hidden = jnp.take_along_axis(hidden, src[..., None], axis=1)           # [B, T, E]
    return -hidden_logprobs(params, config, hidden, batch["tokens"], loss_chunk)


def weighted_loss_sum(params, config: Qwen2Config, batch: dict, remat: str = "none",
                      loss_chunk: int = 0, attention: str = "flash", layout: str | None = None) -> jax.Array:
    w = jnp.where(batch["parents"] >= 0, batch["weights"], 0.0)
    return jnp.sum(w * token_nll(params, config, batch, remat, loss_chunk, attention, layout))


def loss_weight(batch: dict) -> jax.Array:
    return jnp.sum(jnp.where(batch["parents"] >= 0, batch["weights"], 0.0))


# ---------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------
def decay_mask(params) -> Any:
    """Weight decay on kernels and the embedding table; never on biases or norm scales."""
    def one(path, _):
        last = str(getattr(path[-1], "key", path[-1]))
        return last in ("kernel", "embed_tokens")
    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(opt: OptimSection, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW with linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    warmup = min(opt.warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else opt.lr, peak_value=opt.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=opt.lr * opt.min_lr_ratio)
    parts = []
    if opt.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(opt.clip_norm))
    parts.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                             mask=decay_mask))
    return optax.chain(*parts), schedule


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------
def _microbatches(batch: dict, n: int) -> dict:
    """[B, T] -> [n, B/n, T]; microbatch i takes rows i, i+n, ... so every device keeps its rows."""
    def split(x):
        b = x.shape[0]
        return jnp.swapaxes(x.reshape(b // n, n, *x.shape[1:]), 0, 1)
    return {k: split(v) for k, v in batch.items()}


def make_step_fn(config: Qwen2Config, tx: optax.GradientTransformation, schedule: Callable,
                 remat: str = "none", grad_accum: int = 1, loss_chunk: int = 0,
                 attention: str = "flash", attention_layout: str | None = None
                 ) -> Callable[[State, dict], tuple[State, dict]]:
    """The pure train step: (state, batch of [B, T] arrays) -> (new state, metrics).
    attention_layout: the rows' data layout when known (model/attention.py `resolve_impl`)."""
    grad_fn = jax.value_and_grad(weighted_loss_sum)

    def step(state: State, batch: dict) -> tuple[State, dict]:
        params = state["params"]
        total_w = loss_weight(batch)
        denom = jnp.where(total_w > 0, total_w, 1.0)
        if grad_accum == 1:
            loss_sum, grads = grad_fn(params, config, batch, remat, loss_chunk, attention, attention_layout)
        else:
            def body(carry, mb):
                acc_loss, acc_grads = carry
                l, g = grad_fn(params, config, mb, remat, loss_chunk, attention, attention_layout)
                return (acc_loss + l, jax.tree.map(jnp.add, acc_grads, g)), None
            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss_sum, grads), _ = jax.lax.scan(body, (jnp.float32(0.0), zeros),
                                                _microbatches(batch, grad_accum))
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        metrics = {"loss": loss_sum / denom, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state["step"]),
                   "loss_tokens": jnp.sum((batch["weights"] > 0) & (batch["parents"] >= 0)),
                   "loss_weight": total_w}
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state,
                     "rng": jax.random.key_data(rng)}
        return new_state, metrics

    return step


@dataclasses.dataclass
class StepSetup:
    """Everything with a shape or a sharding for one run: built once, used by init / restore / step."""
    config: Qwen2Config
    mesh: Mesh
    tx: optax.GradientTransformation
    schedule: Callable
    param_shardings: Any
    state_shardings: Any
    batch_shardings: dict
    step: Callable                 # jitted (state, batch) -> (state, metrics), state donated
    sharding_notes: list[str]

    def abstract_state(self) -> State:
        """ShapeDtypeStructs (with shardings) of the train state; nothing allocated."""
        params = qwen2.abstract_params(self.config)
        abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                    "opt_state": jax.eval_shape(self.tx.init, params),
                    "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, self.state_shardings)

    def abstract_batch(self, rows: int, seq_len: int) -> dict:
        return {k: jax.ShapeDtypeStruct((rows, seq_len), BATCH_DTYPES[k], sharding=s)
                for k, s in self.batch_shardings.items()}

    def init_state(self, seed: int, params=None, init_seed: int = 0) -> State:
        """A fresh state; scratch params are created already sharded (never whole on one device)."""
        if params is None:
            params = jax.jit(lambda k: qwen2.init_params(self.config, k),
                             out_shardings=self.param_shardings)(jax.random.key(init_seed))
        else:
            params = jax.device_put(params, self.param_shardings)
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt_state"])(params)
        repl = mesh_lib.replicated(self.mesh)
        return {"step": jax.device_put(jnp.int32(0), repl), "params": params, "opt_state": opt_state,
                "rng": jax.device_put(jax.random.key_data(jax.random.key(seed)), repl)}


def build_step(config: Qwen2Config, opt: OptimSection, total_steps: int, mesh: Mesh,
               remat: str = "none", loss_chunk: int = 0, attention: str = "flash",
               layout: str = "flat", attention_layout: str | None = None) -> StepSetup:
    """Optimizer, shardings from the one rules table, and the jitted step (its batch holds
    `batch_keys(layout)`). attention_layout: what the rows are, passed on to flash attention
    ("flat" lets TPU run splash; the trainer passes data.layout; None: the general span rule)."""
    if config.param_dtype != "float32":
        raise ValueError("train with fp32 master weights: model param_dtype must be float32")
    tx, schedule = make_optimizer(opt, total_steps)
    notes: list[str] = []
    abstract = qwen2.abstract_params(config)
    p_shard = param_shardings(mesh, qwen2.logical_axes(config), abstract, notes)
    repl = mesh_lib.replicated(mesh)
    opt_abstract = jax.eval_shape(tx.init, abstract)
    opt_shard = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, p_shard,
                                      transform_non_params=lambda _: repl,
                                      is_leaf=lambda x: isinstance(x, NamedSharding))
    state_shardings = {"step": repl, "params": p_shard, "opt_state": opt_shard, "rng": repl}
    bs = mesh_lib.batch_sharding(mesh)
    batch_shardings = {k: bs for k in batch_keys(layout)}
    inner = make_step_fn(config, tx, schedule, remat, opt.grad_accum, loss_chunk, attention, attention_layout)

    def fn(state, batch):
        # traced under the mesh: activation constraints and the Pallas attention's shard_map
        # read it (qwen2.constrain, attention.flash_attention)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return inner(state, batch)

    jitted = jax.jit(fn, in_shardings=(state_shardings, batch_shardings),
                     out_shardings=(state_shardings, repl), donate_argnums=(0,))
    return StepSetup(config, mesh, tx, schedule, p_shard, state_shardings, batch_shardings, jitted, notes)
