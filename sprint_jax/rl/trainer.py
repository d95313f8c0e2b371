"""The P-GRPO loop (ThreadWeaver, Lian et al., arXiv 2512.07843, section 4): rollouts -> rewards ->
group advantages -> one update on the trie-packed units -> new weights into the engine, in process.

Per step: `prompts_per_step` prompts from a deterministic stream (epoch permutations of the training
tasks, so the data position saved in a checkpoint is one integer), each run G times with its own
sampling seed, a pure function of (seed, step, prompt, member), so a resumed run draws the same
rollouts. Each trajectory is graded (sprint_jax.tasks), rewarded (rl/reward.py), laid out as a
token trie of its units (rl/layout.py) and packed; the update (rl/loss.py) runs on the SFT trainer's
mesh, shardings, optimizer and orbax checkpoints; the engine then decodes with the updated
parameters (no checkpoint round trip). Held-out greedy evaluation goes through
`sprint_jax.eval.evaluate` (the `sprint-jax eval` path): at the start (the SFT model), every
`eval.every` steps, and at the end into OUT/eval (results.jsonl + report.json, for `eval compare`).

Outputs under OUT: config.yaml, metrics.jsonl, tb/, checkpoints/, eval_start/, eval/, hf/,
rl_curves.png, summary.json.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sprint_jax.config import ConfigError, to_dict
from sprint_jax.rl.config import RLConfig

TIMING_KEYS = ("rollout_s", "update_s", "eval_s", "wall_s", "rollout_tokens_per_s", "update_tokens_per_s")


@dataclasses.dataclass
class _Policy:
    """What the engine reads from a model: its config and (the trainer's current) params."""
    config: Any
    params: Any


def load_tasks(cfg: RLConfig):
    """(training tasks, held-out tasks)."""
    from sprint_jax.tasks import chains, countdown
    from sprint_jax.tasks import load_tasks as load_file

    t = cfg.tasks
    if t.source == "keyed_chains":
        from sprint_jax.rl import keyed
        try:
            train, held = keyed.split(t.n, t.eval_n if t.eval_source is None else 0, t.seed, t.eval_seed, t.chains,
                                      t.chain_length)
        except keyed.NoHeldOut as e:
            raise ConfigError(f"tasks: {e}; lower tasks.n, raise tasks.chains or tasks.chain_length, or set "
                              f"tasks.eval_n=0 or tasks.eval_source") from None
    elif t.source == "chains":
        train = chains.generate(t.n, t.seed, t.chains, t.chains, t.chain_length)
        seen = {tuple(x.answer["starts"]) for x in train}
        if t.eval_n and t.eval_source is None and len(seen) == 10 ** t.chains:
            # every start tuple is a training problem: a disjoint held-out problem does not exist
            raise ConfigError(f"tasks: the {t.n} training problems use all {10 ** t.chains} start digit tuples of "
                              f"{t.chains} chain(s), none is left for a disjoint held-out set; lower tasks.n, raise "
                              f"tasks.chains, or set tasks.eval_n=0 or tasks.eval_source")
        held = chains.generate(t.eval_n, t.eval_seed, t.chains, t.chains, t.chain_length, exclude=seen) \
            if t.eval_n and t.eval_source is None else []
    elif t.source == "countdown":
        train = countdown.generate(t.n, t.seed)
        seen = {x.problem for x in train}
        held = [x for x in countdown.generate(t.eval_n * 2, t.eval_seed) if x.problem not in seen][:t.eval_n] \
            if t.eval_n and t.eval_source is None else []
    else:
        train = load_file(t.source, limit=t.n)
        held = []
    if t.eval_source is not None:
        held = load_file(t.eval_source, limit=t.eval_n or None)
    if not train:
        raise ConfigError(f"tasks.source {t.source!r}: no training tasks")
    return train, held


def prompt_fn(cfg: RLConfig):
    """The query of a task as the policy was trained on it (keyed chains carry their key): the
    task prompt in the prompt format the policy's export records (sprint_jax.schema)."""
    from sprint_jax.eval.evaluate import default_prompt
    from sprint_jax.model.hf import read_export_meta
    from sprint_jax.schema import apply_prompt_format
    if cfg.tasks.source == "keyed_chains":
        from sprint_jax.rl import keyed
        return keyed.prompt_for
    meta = read_export_meta(cfg.policy.path)
    try:
        apply_prompt_format("x", meta)          # a malformed format is one line, before any rollout
    except ValueError as e:
        raise ConfigError(f"policy.path {cfg.policy.path}: {e}") from None
    return lambda task: apply_prompt_format(default_prompt(task), meta)


def export_meta(policy_path, layout: str, train_prompts: list[str]) -> dict:
    """The RL export's sprint_jax.json: the policy's own (prompt format, tokenizer), the layout its
    rollouts used, and a training fingerprint of the policy's problems plus every RL training
    problem (all of them, drawn or not: the contamination guard errs on refusing)."""
    from sprint_jax.model.hf import read_export_meta
    from sprint_jax.train.fingerprint import KEY, fingerprint, read_fingerprint
    meta = dict(read_export_meta(policy_path))
    fp = fingerprint(train_prompts)
    hashes = sorted(set(fp["hashes"]) | (read_fingerprint(policy_path) or set()))
    meta.update({"layout": layout, KEY: dict(fp, n=len(hashes), hashes=hashes)})
    return meta


def execution_quality(tasks, records) -> dict:
    """executions_exact / answer_matches_executions for chains tasks (rl/keyed.py), else {}."""
    if not tasks or any(getattr(t, "kind", None) != "chains" for t in tasks):
        return {}
    from sprint_jax.rl import keyed
    return keyed.execution_quality([r if isinstance(r, dict) else r.to_json() for r in records], tasks)


def prompt_indices(n_tasks: int, seed: int, start: int, count: int) -> list[int]:
    """Task indices at stream positions start..start+count-1 (epoch e = permutation seeded (seed, e))."""
    out = []
    for p in range(start, start + count):
        e, k = divmod(p, n_tasks)
        out.append(int(np.random.default_rng((seed, e)).permutation(n_tasks)[k]))
    return out


def rollout_seed(seed: int, step: int, prompt: int, member: int) -> int:
    return int(np.random.SeedSequence([seed, step, prompt, member]).generate_state(1)[0] % (2 ** 31))


def score_groups(tasks, trajectories, group_size: int, reward_cfg) -> dict:
    """Correctness, rewards, eta, bonus, advantages for trajectories ordered prompt-major."""
    from sprint_jax.tasks import grade
    from sprint_jax.rl.reward import group_advantages, reward

    correct, rewards, etas, bonuses = [], [], [], []
    for k, tr in enumerate(trajectories):
        task = tasks[k // group_size]
        rec = tr.record
        ok = rec.final_answer is not None and bool(grade(task, rec.final_answer))
        r, eta, bonus = reward(ok, rec.sequential_tokens, rec.total_tokens, reward_cfg)
        correct.append(ok)
        rewards.append(r)
        etas.append(eta)
        bonuses.append(bonus)
    adv = np.concatenate([group_advantages(rewards[i: i + group_size], reward_cfg)
                          for i in range(0, len(rewards), group_size)])
    return {"correct": correct, "rewards": rewards, "etas": etas, "bonuses": bonuses, "advantages": adv}


def length_parts(record) -> dict:
    """Where a run's tokens went, for a RunRecord or its to_json() dict: planner tokens (every plan
    call and the final call; all on the critical path), executor tokens on the critical path (the
    longest executor of each stage) and in total, and the number of stages with executors. Planner +
    critical executors = sequential_tokens; planner + executors = total_tokens."""
    if isinstance(record, dict):
        stages = [(s["planner_tokens"], [e["tokens"] for e in s["executions"]]) for s in record["stages"]]
        final = record["final_tokens"]
    else:
        stages = [(s.planner_tokens, s.executor_tokens) for s in record.stages]
        final = record.final_tokens
    return {"planner_tokens": sum(p for p, _ in stages) + final,
            "executor_critical_tokens": sum(max(e, default=0) for _, e in stages),
            "executor_tokens": sum(sum(e) for _, e in stages),
            "executor_stages": sum(bool(e) for _, e in stages)}


def mean_parts(records, prefix: str = "") -> dict:
    """length_parts averaged over runs, keys prefixed (``eval_`` for the held-out set)."""
    parts = [length_parts(r) for r in records]
    return {prefix + k: float(np.mean([p[k] for p in parts])) for k in parts[0]} if parts else {}


def plan_shape(record) -> str:
    """The plan shape of a run, for a RunRecord or its to_json() dict: the executors of each stage that
    has any, joined by '+' ('4', '2+2', '1+1+1+1' on keyed chains); 'none' for a run without executors."""
    if isinstance(record, dict):
        counts = [len(s["executions"]) for s in record["stages"]]
    else:
        counts = [len(s.executions) for s in record.stages]
    return "+".join(str(n) for n in counts if n) or "none"


def shape_metrics(records, correct, prefix: str = "") -> dict:
    """Per plan shape (plan_shape): the fraction of runs with that shape (`shape_frac/S`) and their
    accuracy (`shape_acc/S`). The group-mean advantage moves the policy toward the shape it is most
    accurate with, whatever the bonus (s3 diagnosis), so these show where the policy goes at step 1."""
    by: dict[str, list[bool]] = {}
    for r, ok in zip(records, correct, strict=True):
        by.setdefault(plan_shape(r), []).append(bool(ok))
    n = max(len(correct), 1)
    out = {}
    for shape in sorted(by):
        out[f"{prefix}shape_frac/{shape}"] = len(by[shape]) / n
        out[f"{prefix}shape_acc/{shape}"] = float(np.mean(by[shape]))
    return out


def plot_curves(records: list[dict], path: Path) -> None:
    """Eight panels per step: mean reward; sequential and total tokens (rollouts, held-out greedy);
    accuracy; eta and bonus; the sequential tokens split into planner and critical-path executor
    tokens; executor stages per run and executions exact; the plan-shape mix of the rollouts; the
    rollouts' accuracy per plan shape (10-step running mean over the steps that drew it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if "reward" in r]
    ev = [r for r in records if "eval_accuracy" in r]
    x, xe = [r["step"] for r in rows], [r["step"] for r in ev]
    col = lambda rs, k: [r.get(k, np.nan) for r in rs]          # noqa: E731
    fig, axes = plt.subplots(2, 4, figsize=(21, 7.5))
    a = axes.ravel()
    a[0].plot(x, col(rows, "reward"), lw=1.0, label="rollouts")
    a[0].set_ylabel("mean reward")
    a[1].plot(x, col(rows, "sequential_tokens"), lw=1.0, label="rollouts sequential")
    a[1].plot(x, col(rows, "total_tokens"), lw=1.0, label="rollouts total")
    a[1].set_ylabel("tokens per run")
    a[2].plot(x, col(rows, "accuracy"), lw=1.0, label="rollouts")
    a[2].set_ylabel("accuracy")
    a[3].plot(x, col(rows, "eta"), lw=1.0, label="eta (rollouts)")
    a[3].plot(x, col(rows, "bonus"), lw=1.0, label="bonus (rollouts)")
    a[3].set_ylabel("eta = 1 - seq/total; bonus")
    a[4].plot(x, col(rows, "planner_tokens"), lw=1.0, label="planner (rollouts)")
    a[4].plot(x, col(rows, "executor_critical_tokens"), lw=1.0, label="executors on the critical path (rollouts)")
    a[4].set_ylabel("sequential tokens, by part")
    a[5].plot(x, col(rows, "executor_stages"), lw=1.0, label="executor stages (rollouts)")
    a[5].plot(x, col(rows, "executions_exact"), lw=1.0, label="executions exact (rollouts)")
    a[5].set_ylabel("stages per run; fraction")
    shapes = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("shape_frac/")})
    for sh in shapes:
        a[6].plot(x, [r.get(f"shape_frac/{sh}", 0.0) for r in rows], lw=1.0, label=sh)
        acc = [r.get(f"shape_acc/{sh}", np.nan) for r in rows]
        smooth = [np.nanmean(acc[max(0, i - 9): i + 1]) if np.isfinite(acc[max(0, i - 9): i + 1]).any() else np.nan
                  for i in range(len(acc))]
        a[7].plot(x, smooth, lw=1.0, label=sh)
    a[6].set_ylabel("fraction of rollouts, by plan shape")
    a[7].set_ylabel("rollout accuracy by plan shape (10-step mean)")
    if ev:
        a[1].plot(xe, col(ev, "eval_total_tokens"), "s--", ms=8, label="held-out total (greedy)")
        a[1].plot(xe, col(ev, "eval_sequential_tokens"), "o-", label="held-out sequential (greedy)")
        a[2].plot(xe, col(ev, "eval_accuracy"), "o-", label="held-out (greedy)")
        a[4].plot(xe, col(ev, "eval_planner_tokens"), "o-", label="planner (held-out)")
        a[4].plot(xe, col(ev, "eval_executor_critical_tokens"), "s-", label="executors critical (held-out)")
        a[5].plot(xe, col(ev, "eval_executor_stages"), "o-", label="executor stages (held-out)")
        a[5].plot(xe, col(ev, "eval_executions_exact"), "s-", label="executions exact (held-out)")
    for ax in a:
        ax.set_xlabel("step"), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.suptitle("P-GRPO (acceleration reward)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_rl(cfg: RLConfig, out_dir: str | Path, progress: bool = True, stop_after: int | None = None) -> dict:
    """Run P-GRPO as configured; returns the summary (also OUT/summary.json).

    `stop_after=k` checkpoints after step k and returns {"stopped_at": k} (a run split over
    sessions, or a resume test); rerunning with the same OUT continues from there.
    OUT is locked for the whole run (`sprint_jax.outlock`): a second run into it stops at once."""
    from sprint_jax import outlock

    with outlock.locked(out_dir, "rl --out"):
        return _run_rl(cfg, out_dir, progress, stop_after)


def check_prompts_fit(tasks, query_of, tokenizer, max_seq_len: int) -> None:
    """Refuse a `rollout.max_seq_len` that cannot hold every task's prompt (as the engines encode
    it) plus one generated token: such a run would end each rollout before its first token."""
    if not tasks:
        return
    longest, task = max(((len(tokenizer.encode(query_of(t), add_special_tokens=False)), t.id) for t in tasks),
                        key=lambda x: x[0])
    if longest + 1 > max_seq_len:
        raise ConfigError(f"rollout.max_seq_len = {max_seq_len} cannot hold the prompts: task {task}'s prompt is "
                          f"{longest} tokens, so it must be at least {longest + 1} (the prompt and one generated token)")


@dataclasses.dataclass
class _Run:
    """What every step of a run reads: the config, OUT, the policy's model and tokenizer, the tasks,
    the device mesh (the update's and the rollout engine's)."""
    cfg: RLConfig
    out: Path
    progress: bool
    model_cfg: Any
    tok: Any
    train_tasks: list
    held_tasks: list
    query_of: Any
    t_start: float
    mesh: Any

    def say(self, msg: str) -> None:
        if self.progress:
            print(msg, file=sys.stderr, flush=True)


def _open_run(cfg: RLConfig, out: Path, progress: bool, t_start: float) -> _Run:
    """The policy's model config and tokenizer, the tasks and the mesh, each checked against the
    rollout's sizes (prompts, loss rows, the KV cache per device) before anything is allocated."""
    from sprint_jax.infer import sharding as sh
    from sprint_jax.model.capacity import BRANCH_TAG_ROOM, check_memory, check_positions
    from sprint_jax.model.config import Qwen2Config
    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.model.tokenizer import load_tokenizer

    pol, ro = cfg.policy, cfg.rollout
    model_cfg = Qwen2Config.from_hf_config(Path(pol.path)).replace(param_dtype="float32", dtype=pol.dtype)
    try:
        tok = load_tokenizer(pol.tokenizer or pol.path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"policy.tokenizer: cannot load a tokenizer from {pol.tokenizer or pol.path} ({e})") from None
    if len(tok) > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {model_cfg.vocab_size}")
    train_tasks, held_tasks = load_tasks(cfg)
    query_of = prompt_fn(cfg)
    check_prompts_fit(train_tasks + held_tasks, query_of, tok, ro.max_seq_len)
    check_positions(model_cfg, cfg.loss.seq_len, "loss.seq_len")
    seqs = _rollout_seqs(cfg)
    branch_tokens = ro.orchestrator.max_branch_tokens + BRANCH_TAG_ROOM
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    # the engine's KV pool on the fullest device (pages over data x fsdp, KV heads over tensor, as
    # the engine places them on the mesh), sized as `sprint-jax eval` sizes it
    per_device = rollout_engine_config(cfg).pool_bytes_per_device(sh.serving_config(model_cfg, mesh), mesh)
    check_memory(per_device,
                 f"the rollout KV cache ({seqs} run(s) of rollout.max_seq_len {ro.max_seq_len} with "
                 f"{ro.orchestrator.max_prompts} branches of {branch_tokens}, in pages, per device)",
                 "lower rollout.concurrency, rollout.max_seq_len, rollout.orchestrator.max_prompts or "
                 "rollout.orchestrator.max_branch_tokens")
    return _Run(cfg, out, progress, model_cfg, tok, train_tasks, held_tasks, query_of, t_start, mesh)


def rollout_engine_config(cfg: RLConfig):
    """The rollout engine's sizes (`EngineConfig`): the memory check, `plan rl` and the engine."""
    from sprint_jax.infer.engine_config import EngineConfig
    from sprint_jax.model.capacity import BRANCH_TAG_ROOM

    ro = cfg.rollout
    return EngineConfig(max_seqs=_rollout_seqs(cfg), max_children=ro.orchestrator.max_prompts,
                        max_seq_len=ro.max_seq_len, max_branch_tokens=ro.orchestrator.max_branch_tokens + BRANCH_TAG_ROOM,
                        decode_chunk=ro.decode_chunk, prefill_chunk=ro.prefill_chunk)


def _rollout_seqs(cfg: RLConfig) -> int:
    """The engine's sequence slots: every rollout of a step at once unless rollout.concurrency says."""
    return cfg.rollout.concurrency or cfg.rollout.prompts_per_step * cfg.rollout.group_size


def _build_update(run: _Run):
    """(setup, rl step, checkpointer) on the configured mesh."""
    from sprint_jax.infer.sampling import valid_vocab
    from sprint_jax.rl.loss import LossSettings, build_rl_step
    from sprint_jax.train import checkpoint as ckpt_lib
    from sprint_jax.train import mesh as mesh_lib
    from sprint_jax.train import step as step_lib

    cfg, pol, mesh = run.cfg, run.cfg.policy, run.mesh
    if cfg.loss.rows_per_micro % mesh_lib.batch_divisor(mesh):
        raise ConfigError(f"loss.rows_per_micro ({cfg.loss.rows_per_micro}) must be a multiple of mesh data x fsdp "
                          f"= {mesh_lib.batch_divisor(mesh)}")
    setup = step_lib.build_step(run.model_cfg, cfg.optim, cfg.steps, mesh, pol.remat, pol.loss_chunk)
    settings = LossSettings(cfg.rollout.orchestrator.temperature, cfg.loss.clip_eps, cfg.loss.kl_coef, pol.remat,
                            pol.loss_chunk, valid_vocab(run.tok, run.model_cfg.vocab_size))   # the engines' distribution
    rl = build_rl_step(setup, settings, cfg.loss.updates_per_batch > 1, cfg.loss.kl_coef > 0)
    ckpt = ckpt_lib.Checkpointer(run.out / "checkpoints", keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save)
    if not cfg.checkpoint.resume and ckpt.steps():
        raise ConfigError(f"{run.out / 'checkpoints'} already holds checkpoints and checkpoint.resume is false")
    return setup, rl, ckpt


def _initial_state(run: _Run, setup, ckpt):
    """(state, start step, task-stream position, resumed?, frozen reference params or None): the
    latest checkpoint when resuming, else the policy's weights."""
    from sprint_jax.model import load_params

    cfg, pol = run.cfg, run.cfg.policy
    restored = ckpt.restore_latest(setup.abstract_state()) if cfg.checkpoint.resume else None
    ref_params = None                                        # the frozen reference of the optional KL
    if cfg.loss.kl_coef > 0:
        _, ref_params = load_params(pol.path, config=run.model_cfg, param_dtype="float32",
                                    shardings=setup.param_shardings)
    if restored is not None:
        state, meta = restored
        start_step, position = int(meta["step"]), int(meta["prompts"])
        run.say(f"resumed from step {start_step} (prompt {position} of the task stream)")
        return state, start_step, position, True, ref_params
    _, params = load_params(pol.path, config=run.model_cfg, param_dtype="float32", shardings=setup.param_shardings)
    return setup.init_state(cfg.seed, params=params), 0, 0, False, ref_params


def _rollout_engine(run: _Run, params):
    """(engine on the trainer's params and mesh, each rollout traced; orchestrator config; layout):
    on more than one device the engine's pages split over data x fsdp and its KV heads over tensor,
    the weights staying where the trainer placed them. The layout and the tag format are the
    policy's (its export's sprint_jax.json) unless rollout.layout / rollout.format name them."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model.hf import read_export_meta

    ro = run.cfg.rollout
    engine = Engine(_Policy(run.model_cfg, params), run.tok, rollout_engine_config(run.cfg),
                    trace=True,   # each rollout's DecodeTrace: the loss's layout
                    mesh=run.mesh if run.mesh.devices.size > 1 else None)
    if engine.mesh is not None:
        run.say(f"rollout engine on the mesh {dict(run.mesh.shape)}: KV pool "
                f"{_device_bytes(engine.cache) / 2 ** 20:.1f} MiB on each device")
    meta = read_export_meta(run.cfg.policy.path)
    layout = meta.get("layout", "flat") if ro.layout == "auto" else ro.layout
    tag_format = meta.get("format", "sprint") if ro.format == "auto" else ro.format
    run.say(f"rollouts use the {layout} token convention at forks and syncs"
            + (f", the {tag_format} format" if tag_format != "sprint" else ""))
    return engine, dataclasses.replace(ro.orchestrator, layout=layout, format=tag_format), layout


def _device_bytes(tree) -> int:
    """Bytes of a tree of arrays on its fullest device."""
    import jax

    per: dict = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values(), default=0)


def _held_out(run: _Run, engine, orch, step: int, out_sub: str) -> dict:
    """Greedy evaluation of the held-out tasks into OUT/out_sub (the `sprint-jax eval` path): its metrics."""
    from sprint_jax.eval.evaluate import RECORDS_FILE, RESULTS_FILE, evaluate

    if not run.held_tasks:
        return {}
    mode = run.cfg.eval.mode or run.cfg.rollout.mode
    t = time.perf_counter()
    out = run.out / out_sub
    _, rep = evaluate(engine, run.held_tasks, mode, prompt_fn=run.query_of,
                      orchestrator_config=dataclasses.replace(orch, temperature=0.0, seed=0),
                      out_dir=out, progress=False, overwrite=True,
                      meta={"model": str(run.out / "hf"), "rl_step": step, "mode": mode})
    recs = [json.loads(x) for x in (out / RECORDS_FILE).read_text().splitlines()]
    results = {r["id"]: r["correct"] for r in map(json.loads, (out / RESULTS_FILE).read_text().splitlines())}
    quality = execution_quality(run.held_tasks, recs) if mode != "sequential" else {}
    return {"eval_accuracy": rep["accuracy"], "eval_sequential_tokens": rep["mean_sequential_tokens"],
            "eval_total_tokens": rep["mean_total_tokens"], "eval_format_valid": rep["format_valid_rate"],
            **mean_parts(recs, "eval_"), **shape_metrics(recs, [results[r["id"]] for r in recs], "eval_"),
            **{f"eval_{k}": v for k, v in quality.items()}, "eval_s": time.perf_counter() - t}


def _step_metrics(run: _Run, tasks, trajs, sc, um: dict, packed, rollout_s: float, update_s: float) -> dict:
    """A step's metrics row (before its held-out eval and wall clock)."""
    ro = run.cfg.rollout
    adv = sc["advantages"]
    groups = adv.reshape(-1, ro.group_size)
    gen = sum(tr.generated_tokens for tr in trajs)
    records = [t.record for t in trajs]
    return {"reward": float(np.mean(sc["rewards"])), "accuracy": float(np.mean(sc["correct"])),
            "sequential_tokens": float(np.mean([r.sequential_tokens for r in records])),
            "total_tokens": float(np.mean([r.total_tokens for r in records])),
            "eta": float(np.mean(sc["etas"])), "bonus": float(np.mean(sc["bonuses"])),
            "format_valid": float(np.mean([r.format_valid for r in records])),
            **mean_parts(records), **shape_metrics(records, sc["correct"]),
            **(execution_quality([t for t in tasks for _ in range(ro.group_size)], records)
               if ro.mode != "sequential" else {}),
            "adv_mean": float(adv.mean()), "adv_std": float(adv.std()), "adv_abs_mean": float(np.abs(adv).mean()),
            "adv_min": float(adv.min()), "adv_max": float(adv.max()),
            "groups_without_signal": float(np.mean(np.all(groups == 0, axis=1))),
            **um, "update_tokens": packed.tokens, "truncated_loss_tokens": packed.truncated_loss_tokens,
            "rollout_s": rollout_s, "update_s": update_s,
            "rollout_tokens_per_s": gen / max(rollout_s, 1e-9),
            "update_tokens_per_s": packed.tokens / max(update_s, 1e-9)}


def _say_step(run: _Run, rec: dict) -> None:
    run.say(f"step {rec['step']}/{run.cfg.steps}: reward {rec['reward']:.3f} acc {rec['accuracy']:.2f} "
            f"seq {rec['sequential_tokens']:.1f} total {rec['total_tokens']:.1f} eta {rec['eta']:.3f} "
            f"loss {rec['loss']:+.4f} ({rec['rollout_s']:.1f}s rollout, {rec['update_s']:.1f}s update)"
            + (f" | held-out acc {rec['eval_accuracy']:.3f} seq {rec['eval_sequential_tokens']:.1f}"
               if "eval_accuracy" in rec else ""))


def _run_rl(cfg: RLConfig, out_dir: str | Path, progress: bool, stop_after: int | None) -> dict:
    import jax
    import yaml

    from sprint_jax.model.tokenizer import pad_id
    from sprint_jax.rl.layout import layout_trace, pack_items
    from sprint_jax.rl.loss import update
    from sprint_jax.rl.rollout import Rollouts, timed_run
    from sprint_jax.train.trainer import Metrics, export_hf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = _open_run(cfg, out, progress, time.time())
    ro = cfg.rollout
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run.say(f"rl: {len(run.train_tasks)} training tasks, {len(run.held_tasks)} held-out; {ro.prompts_per_step} "
            f"prompts x G={ro.group_size} {ro.mode} rollouts per step, {cfg.steps} steps")
    setup, rl, ckpt = _build_update(run)
    state, start_step, position, resumed, ref_params = _initial_state(run, setup, ckpt)
    engine, orch, layout = _rollout_engine(run, state["params"])
    placement = {"mesh": dict(engine.mesh.shape) if engine.mesh is not None else None,
                 "kv_cache_bytes_per_device": _device_bytes(engine.cache)}
    rollouts = Rollouts(engine, orch)
    pad = pad_id(run.tok)

    metrics = Metrics(out, cfg.tensorboard, start_step)
    if start_step == 0:
        ev = _held_out(run, engine, orch, 0, "eval_start")
        if ev:
            metrics.log({"step": 0, **ev})
            run.say(f"step 0 (SFT model): held-out accuracy {ev['eval_accuracy']:.3f}, sequential tokens "
                    f"{ev['eval_sequential_tokens']:.1f}")

    last_saved = start_step if resumed else -1
    for step in range(start_step, cfg.steps):
        idx = prompt_indices(len(run.train_tasks), cfg.seed, position, ro.prompts_per_step)
        tasks = [run.train_tasks[i] for i in idx]
        queries = [run.query_of(t) for t in tasks for _ in range(ro.group_size)]
        seeds = [rollout_seed(cfg.seed, step, k, g) for k in range(len(tasks)) for g in range(ro.group_size)]
        trajs, rollout_s = timed_run(rollouts, queries, seeds, ro.mode)
        position += ro.prompts_per_step
        sc = score_groups(tasks, trajs, ro.group_size, cfg.reward)
        t1 = time.perf_counter()
        # each trajectory as the engine decoded it (its layout's tokens, positions and join)
        items = [layout_trace(tr.trace, float(a)) for tr, a in zip(trajs, sc["advantages"])]
        packed = pack_items(items, cfg.loss.seq_len, cfg.loss.rows_per_micro, pad)
        state, um = update(rl, state, packed.arrays, cfg.loss.updates_per_batch, ref_params)
        engine.params = state["params"]                      # trainer -> engine, in process
        jax.block_until_ready(engine.params)
        done = step + 1
        rec = {"step": done, **_step_metrics(run, tasks, trajs, sc, um, packed, rollout_s, time.perf_counter() - t1)}
        if (cfg.eval.every and done % cfg.eval.every == 0 and done != cfg.steps):
            rec.update(_held_out(run, engine, orch, done, f"eval_step{done}"))
        if done == cfg.steps:
            rec.update(_held_out(run, engine, orch, done, "eval"))
        rec["wall_s"] = time.time() - run.t_start
        metrics.log(rec)
        _say_step(run, rec)
        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.steps:
            ckpt.save(done, state, {"prompts": position})
            last_saved = done
        if stop_after is not None and done >= stop_after and done != cfg.steps:
            if last_saved != done:
                ckpt.save(done, state, {"prompts": position})
            ckpt.close()
            metrics.close()
            return {"stopped_at": done}
    if last_saved != cfg.steps:
        ckpt.save(cfg.steps, state, {"prompts": position})
    ckpt.close()
    metrics.close()
    if cfg.plot and metrics.records:
        plot_curves(metrics.records, out / "rl_curves.png")
    export_dir = None
    if cfg.export.enabled:
        export_dir = out / "hf"
        export_hf(run.model_cfg, state["params"], run.tok, export_dir, cfg.export.dtype,
                  meta=export_meta(cfg.policy.path, layout, [run.query_of(t) for t in run.train_tasks]))
    return _summary(run, metrics.records, start_step, resumed, export_dir, placement)


def _summary(run: _Run, records: list[dict], start_step: int, resumed: bool, export_dir: Path | None,
             engine: dict) -> dict:
    """The run's summary (first and last step, first and last held-out eval, where the rollout
    engine ran: its mesh and KV cache bytes per device), also OUT/summary.json."""
    recs = [r for r in records if "reward" in r]
    evs = [r for r in records if "eval_accuracy" in r]
    summary = {"steps": run.cfg.steps, "start_step": start_step, "resumed": resumed,
               "first": recs[0] if recs else None, "last": recs[-1] if recs else None,
               "eval_first": evs[0] if evs else None, "eval_last": evs[-1] if evs else None,
               "wall_s": time.time() - run.t_start, "out_dir": str(run.out),
               "export_dir": str(export_dir) if export_dir else None, "rollout_engine": engine}
    (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


__all__ = ["TIMING_KEYS", "check_prompts_fit", "export_meta", "length_parts", "mean_parts", "plan_shape", "shape_metrics", "load_tasks", "prompt_indices", "rollout_seed", "score_groups", "run_rl"]
