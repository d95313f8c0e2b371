"""The P-GRPO policy loss on trie-packed units and its sharded update (ThreadWeaver, Lian et al.,
arXiv 2512.07843, section 4).

Per completion token t of a trajectory with advantage A (rl/reward.py, broadcast by rl/layout.py):
    ratio_t = exp(logp_t - logp_old_t)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)  [+ kl_coef * k3(ref || policy)]
summed over every completion token of every unit and divided by the batch's completion-token count.
Fully on-policy with one update per batch (the paper's setting), logp_old is the current policy's
own log-prob under stop_gradient: ratio = 1 and the gradient is -(1/N) sum_t A grad logp_t, i.e.
REINFORCE with the group mean as baseline. With more than one update per batch, logp_old is
computed once before the first update and the clip matters (PPO). No KL by default (the paper has
none); `kl_coef > 0` adds the k3 estimator against a frozen reference (the starting weights).

Log-probs are those of the sampling distribution: logits / temperature (top-k / top-p are not
modelled; keep them off for RL). The batch lays each trajectory out as the engine decoded it
(rl/layout.py `layout_trace`: positions, visibility and merge joins as run), so on-policy these
log-probs equal the ones the engine sampled with (`rollout_logp`; the metric `rollout_logp_gap`
is their mean absolute difference: numerics only). Shardings, optimizer and train state are the SFT trainer's
(train/step.py `build_step`, the model/sharding.py rules table), so checkpoints are the same orbax layout.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from sprint_jax.model import qwen2
from sprint_jax.model.config import Qwen2Config
from sprint_jax.train import mesh as mesh_lib
from sprint_jax.train import step as step_lib

BATCH_KEYS = ("tokens", "positions", "parents", "span_end", "advantages", "mask", "stage", "branch", "rollout_logp")


def token_logprobs(params, config: Qwen2Config, batch: dict, temperature: float = 1.0, remat: str = "none",
                   loss_chunk: int = 0, n_valid: int | None = None) -> jax.Array:
    """log p(token | what it sees) at `temperature`, fp32 [B, T] (train/step.py `token_nll`'s
    layout: each token is predicted from its parent row's hidden state; with the batch's stage /
    branch the merge rule applies too, so a merge-join rollout is scored with the join it ran).
    With `n_valid` the distribution is the engines' sampling one: over the tokenizer's ids only
    (padded ids masked, infer/sampling.py `mask_padded`)."""
    merge = {k: batch[k] for k in step_lib.MERGE_KEYS if k in batch}
    # flash attention on span_end as the SFT step runs it: no [B, T, T] mask (at 7B x 8k rows
    # the dense mask attention's temporaries are most of a chip)
    hidden = qwen2.forward(params, config, batch["tokens"], batch["positions"], span_end=batch["span_end"],
                           remat=remat, return_hidden=True, **merge)        # [B, T, E]
    src = jnp.maximum(batch["parents"], 0)
    hidden = jnp.take_along_axis(hidden, src[..., None], axis=1)
    return step_lib.hidden_logprobs(params, config, hidden, batch["tokens"], loss_chunk, temperature, n_valid)


@dataclasses.dataclass(frozen=True)
class LossSettings:
    temperature: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    remat: str = "none"
    loss_chunk: int = 0
    n_valid: int | None = None       # the tokenizer's ids (padded ids are never sampled, so never scored)


def policy_loss(params, config: Qwen2Config, batch: dict, denom, s: LossSettings,
                old_logp=None, ref_logp=None) -> tuple[jax.Array, dict]:
    """Sum over the batch's completion tokens of the clipped surrogate (+ KL), divided by `denom`."""
    logp = token_logprobs(params, config, batch, s.temperature, s.remat, s.loss_chunk, s.n_valid)
    mask = batch["mask"] * (batch["parents"] >= 0)
    adv = batch["advantages"]
    old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    ratio = jnp.exp(logp - old)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - s.clip_eps, 1.0 + s.clip_eps) * adv
    surrogate = jnp.where(unclipped <= clipped, unclipped, clipped)
    per_token = -surrogate
    aux = {"pg_sum": jnp.sum(mask * per_token),
           "clipped_tokens": jnp.sum(mask * (jnp.abs(ratio - 1.0) > s.clip_eps)),
           "logp_sum": jnp.sum(mask * logp)}
    if "rollout_logp" in batch:      # on-policy, logp equals the rollout's (the engine's) up to numerics
        aux["rollout_gap_sum"] = jnp.sum(mask * jnp.abs(logp - batch["rollout_logp"]))
    if ref_logp is not None:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + s.kl_coef * kl
        aux["kl_sum"] = jnp.sum(mask * kl)
    return jnp.sum(mask * per_token) / denom, aux


@dataclasses.dataclass
class RLStep:
    """Jitted pieces of one update, sharded by the trainer's rules (built from `step_lib.StepSetup`)."""
    setup: step_lib.StepSetup
    grad: Callable      # (params, microbatch, denom, old_logp, ref_logp) -> ((loss, aux), grads)
    logp: Callable      # (params, microbatch) -> logp [R, T]
    apply: Callable     # (state, grads) -> (state, {"grad_norm", "lr"}); state donated


def build_rl_step(setup: step_lib.StepSetup, s: LossSettings, with_old: bool, with_ref: bool) -> RLStep:
    config, mesh = setup.config, setup.mesh
    bs = mesh_lib.batch_sharding(mesh)
    repl = mesh_lib.replicated(mesh)
    batch_sh = {k: bs for k in BATCH_KEYS}

    # both traced under the mesh, as the SFT step: activation constraints and the Pallas flash
    # attention's shard_map read it (a Mosaic kernel cannot be partitioned automatically)
    def grad_fn(params, batch, denom, old_logp, ref_logp):
        def f(p):
            return policy_loss(p, config, batch, denom, s, old_logp if with_old else None,
                               ref_logp if with_ref else None)
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.value_and_grad(f, has_aux=True)(params)

    def logp_fn(params, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return token_logprobs(params, config, batch, s.temperature, s.remat, s.loss_chunk, s.n_valid)

    grad = jax.jit(grad_fn, in_shardings=(setup.param_shardings, batch_sh, repl, bs, bs),
                   out_shardings=((repl, repl), setup.param_shardings))
    logp = jax.jit(logp_fn, in_shardings=(setup.param_shardings, batch_sh), out_shardings=bs)

    def apply_fn(state, grads):
        params = state["params"]
        updates, opt_state = setup.tx.update(grads, state["opt_state"], params)
        rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        new = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
               "opt_state": opt_state, "rng": jax.random.key_data(rng)}
        return new, {"grad_norm": optax.tree.norm(grads), "lr": setup.schedule(state["step"])}

    apply = jax.jit(apply_fn, in_shardings=(setup.state_shardings, setup.param_shardings),
                    out_shardings=(setup.state_shardings, repl), donate_argnums=(0,))
    return RLStep(setup, grad, logp, apply)


def update(rl: RLStep, state: dict, arrays: dict, updates_per_batch: int, ref_params: Any = None) -> tuple[dict, dict]:
    """`updates_per_batch` optimizer steps on one packed batch [M, R, T] (M microbatches whose
    gradients are summed; the loss is normalised by the batch's completion-token count)."""
    m = arrays["tokens"].shape[0]
    micro = [{k: v[i] for k, v in arrays.items()} for i in range(m)]
    n_loss = float(sum(float((mb["mask"] * (mb["parents"] >= 0)).sum()) for mb in micro))
    denom = jnp.float32(max(n_loss, 1.0))
    dummy = [jnp.zeros(mb["tokens"].shape, jnp.float32) for mb in micro]
    old = [rl.logp(state["params"], mb) for mb in micro] if updates_per_batch > 1 else dummy
    ref = [rl.logp(ref_params, mb) for mb in micro] if ref_params is not None else dummy
    out: dict = {}
    for u in range(updates_per_batch):
        grads = None
        sums: dict[str, float] = {}
        loss = 0.0
        for mb, o, r in zip(micro, old, ref):
            (l, aux), g = rl.grad(state["params"], mb, denom, o, r)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            loss += float(l)
            for k, v in aux.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        state, m_apply = rl.apply(state, grads)
        if u == 0:
            out = {"loss": loss, "grad_norm": float(m_apply["grad_norm"]), "lr": float(m_apply["lr"]),
                   "mean_logp": sums["logp_sum"] / max(n_loss, 1.0),
                   "clip_frac": sums["clipped_tokens"] / max(n_loss, 1.0)}
            if "rollout_gap_sum" in sums:
                out["rollout_logp_gap"] = sums["rollout_gap_sum"] / max(n_loss, 1.0)
            if "kl_sum" in sums:
                out["kl"] = sums["kl_sum"] / max(n_loss, 1.0)
    out["update_loss_tokens"] = int(n_loss)
    return state, out


__all__ = ["BATCH_KEYS", "token_logprobs", "LossSettings", "policy_loss", "RLStep", "build_rl_step", "update"]
