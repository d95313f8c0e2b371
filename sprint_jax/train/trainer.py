"""The SFT loop (paper §8-9; docs/design.md "Training"): data -> sharded steps -> metrics,
checkpoints, export. `train(config, out_dir)` is the Python API; `sprint-jax train` is a thin CLI
over it.

Outputs under OUT: config.yaml (the resolved config), data_stats.json (what was used, what was
dropped and why, the length buckets), metrics.jsonl (one JSON object per logged step; `bucket` is
the row length of the step's batch), tb/ (TensorBoard events), checkpoints/ (orbax), loss.png,
hf/ (the final model as HF safetensors + its tokenizer) and summary.json.

Resume is automatic when OUT/checkpoints holds a checkpoint (checkpoint.resume): params,
optimizer state, step, RNG and the data position (a row cursor per length bucket) come back, and
the run continues bit for bit.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from sprint_jax.config import ConfigError
from sprint_jax import interrupt
from sprint_jax.errors import Interrupted, UserError
from sprint_jax.train import distributed
from sprint_jax.train.config import TrainConfig
from sprint_jax.train.rundir import rerun_note, saved_steps


@dataclasses.dataclass
class StepEvent:
    """What a callback sees after every optimizer step."""
    step: int                       # steps completed
    metrics: dict | None            # the logged record on logging steps, else None
    checkpointer: Any               # train.checkpoint.Checkpointer (e.g. to wait for a save)


def _resolve_model(cfg: TrainConfig):
    from sprint_jax.model.config import resolve_model_config

    mc = resolve_model_config(cfg.model.name, **cfg.model.overrides)
    return mc.replace(param_dtype="float32", dtype=cfg.model.dtype)


def _data_digest(items, cfg: TrainConfig) -> str:
    h = hashlib.sha256()
    key = [cfg.data.layout, cfg.data.seq_len, cfg.data.seed, cfg.data.pack_open_rows]
    if len(cfg.data.row_buckets) > 1:   # one bucket is the unbucketed stream: its digest is unchanged
        key += [cfg.data.row_buckets, cfg.optim.batch_size]
    h.update(json.dumps(key).encode())
    for it in items:
        h.update(it.tokens.tobytes())
        h.update(it.weights.tobytes())
    return h.hexdigest()[:16]


class TrainingDiverged(UserError):
    """The loss or the gradient norm became NaN or infinite: training stopped, nothing exported."""


def _check_finite(step: int, m, last_saved: int) -> None:
    """Raise TrainingDiverged when step `step`'s loss or gradient norm is not finite.

    Called one step late (on the previous step's metrics, which are ready by then), so checking
    every step costs no pipeline stall. Continuing would only train and export NaN weights."""
    import math

    import jax
    vals = {k: float(v) for k, v in jax.device_get({k: m[k] for k in ("loss", "grad_norm")}).items()}
    if all(math.isfinite(v) for v in vals.values()):
        return
    where = (f"the last checkpoint (step {last_saved}) is intact and a rerun resumes from it"
             if last_saved > 0 else "no checkpoint was written")
    raise TrainingDiverged(f"training diverged at step {step}: loss {vals['loss']}, grad norm {vals['grad_norm']}; "
                           f"stopped without saving or exporting ({where}); lower optim.lr or set "
                           f"optim.clip_norm > 0")


def _save_checked(ckpt, step: int, state, meta: dict, last_saved: int) -> None:
    """Save, turning a refused non-finite state (weights gone NaN while the loss was still finite)
    into the same one-line stop as a NaN loss."""
    from sprint_jax.train.checkpoint import NonFiniteState
    try:
        ckpt.save(step, state, meta)
    except NonFiniteState as e:
        where = (f"the last checkpoint (step {last_saved}) is intact" if last_saved > 0
                 else "no checkpoint was written")
        raise TrainingDiverged(f"training diverged by step {step} ({e}); stopped without exporting ({where}); "
                               f"lower optim.lr or set optim.clip_norm > 0") from None


class Metrics:
    """A run's metrics log: OUT/metrics.jsonl (one JSON object per logged step) and, with
    `tensorboard`, TensorBoard events under OUT/tb, written by process 0 only. On resume from
    `resume_step` the records after it (a killed run's) are dropped from the file first."""

    def __init__(self, out: Path, tensorboard: bool, resume_step: int):
        self.enabled = _is_main()
        self.path = out / "metrics.jsonl"
        self.records: list[dict] = []
        self.tb = None
        if not self.enabled:
            return
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue                  # a line cut short by a kill
                if rec.get("step", 0) <= resume_step:
                    kept.append(rec)
            self.records = kept
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(str(out / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _is_main() -> bool:
    import jax
    return jax.process_index() == 0


def plot_loss(records: Sequence[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (weighted NLL per token)")
    ax.set_title("SFT loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _tokenizer_name(cfg, given: bool, tokenizer) -> str:
    """What the model was trained with, for the export: qwen2, bytes, a tokenizer directory, the
    checkpoint's own directory (data.tokenizer=auto when fine-tuning), or the class of a
    tokenizer object handed to train()."""
    if given:
        return type(tokenizer).__name__
    spec = cfg.data.tokenizer
    if spec != "auto":
        return spec
    pretrained = cfg.model.init == "pretrained" and isinstance(cfg.model.name, str) and Path(cfg.model.name).is_dir()
    return str(cfg.model.name) if pretrained else "qwen2"


def export_hf(config, params, tokenizer, path: Path, dtype: str, meta: dict | None = None) -> None:
    """Final params -> HF safetensors directory (+ tokenizer, + `meta` in sprint_jax.json: what
    inference must know about the training, e.g. its layout). Every process joins the gather;
    process 0 writes."""
    import jax

    from sprint_jax.model import save_params
    from sprint_jax.dtypes import dtype_of

    dt = dtype_of(dtype)
    cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(dt), t))
    host = jax.tree.map(distributed.gather_to_host, cast(params))
    if not _is_main():
        return
    eos = getattr(tokenizer, "eos_token_id", None)
    if config.eos_token_id is None and eos is not None:
        config = config.replace(eos_token_id=int(eos))
    save_params(config.replace(param_dtype=dtype), host, path)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(path))
    elif hasattr(tokenizer, "save"):
        from sprint_jax.model.tokenizer import VOCAB_TOKENIZER_FILE
        tokenizer.save(path / VOCAB_TOKENIZER_FILE)
    if meta:
        from sprint_jax.model.hf import update_export_meta
        update_export_meta(path, **meta)


def train(config: TrainConfig, out_dir: str | Path, tokenizer=None, progress: bool = True,
          callbacks: Sequence[Callable[[StepEvent], None]] = (), new_run: bool = False) -> dict:
    """Run SFT as configured; returns the summary (also written to OUT/summary.json).

    `tokenizer`: any object with the HF call convention (`tok(text, add_special_tokens=False,
    return_offsets_mapping=True)`, `eos_token_id`, `len()`); default from `data.tokenizer`.
    OUT is locked for the whole run (`sprint_jax.outlock`): a second run into it stops at once.
    A run resumes OUT's checkpoints only with the config they were trained with (`check_resume`);
    `new_run` instead deletes what a previous run left in OUT (RUN_OUTPUTS) and starts at step 0.
    A KeyboardInterrupt leaves as `Interrupted`, saying what a rerun does.
    """
    distributed.initialize(config.distributed)         # before any other JAX call
    import jax

    from sprint_jax import outlock

    lock = outlock.acquire(out_dir, "--out", jax.process_index())
    try:
        return _train(config, out_dir, tokenizer, progress, callbacks, new_run)
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):
            raise
        raise Interrupted(rerun_note(Path(out_dir))) from None
    finally:
        outlock.release(lock)


# What a run writes into OUT: `new_run` deletes these (and only these) before starting over.
RUN_OUTPUTS = ("checkpoints", "checkpoints_quarantine", "tb", "hf", "metrics.jsonl", "summary.json", "loss.png",
               "data_stats.json", "config.yaml")

# Config fields a resumed run may change: how it is saved, logged, exported and spread over
# devices, nothing that decides which weights it computes. Every other field (the model, the data
# and its layout, the optimizer, the seeds, `steps` and `epochs`, which set the learning-rate
# schedule: a longer run is not the short one continued) must be what the checkpoints were trained with.
RESUME_MAY_CHANGE = ("checkpoint.every", "checkpoint.keep", "checkpoint.async_save", "checkpoint.resume", "export.",
                     "distributed.", "mesh.", "log_every", "tensorboard", "plot")


def _flat(d, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix[:-1]: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def check_resume(cfg: TrainConfig, out: Path) -> None:
    """Refuse (ConfigError naming the fields) to resume OUT's checkpoints with a config that
    differs from OUT/config.yaml, the one they were trained with, in a field outside
    RESUME_MAY_CHANGE. Nothing to check without checkpoints, without OUT/config.yaml or when
    checkpoint.resume is false."""
    import yaml

    from sprint_jax.config import to_dict

    steps = saved_steps(out)
    saved_path = out / "config.yaml"
    if not steps or not saved_path.is_file() or not cfg.checkpoint.resume:
        return                  # (checkpoint.resume false: _open_checkpoints refuses the directory)
    try:
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{saved_path}: cannot read the config of the run whose checkpoints are in {out} "
                          f"({e}); pass --new-run to start a new run there, or choose another --out") from None
    old = _flat(saved if isinstance(saved, dict) else {})
    new = _flat(yaml.safe_load(yaml.safe_dump(to_dict(cfg), sort_keys=False)))
    if cfg.epochs is not None:
        old.pop("steps", None)      # derived from epochs and the data, both compared
        new.pop("steps", None)
    missing = object()
    diffs = [f"{k} {old[k] if k in old else '(unset)'} -> {new[k] if k in new else '(unset)'}"
             for k in sorted(set(old) | set(new))
             if old.get(k, missing) != new.get(k, missing)
             and not any(k == a or (a.endswith(".") and k.startswith(a)) for a in RESUME_MAY_CHANGE)]
    if diffs:
        raise ConfigError(
            f"--out {out} holds a run with checkpoints up to step {steps[-1]} trained with another config "
            f"({'; '.join(diffs)}); to resume it, rerun with its config ({saved_path}); to start a new run "
            f"there instead, pass --new-run (deletes its checkpoints); or choose another --out")


def _clear_run(out: Path) -> None:
    """Delete what a previous run left in OUT (RUN_OUTPUTS), so a new one starts at step 0."""
    import shutil

    if _is_main():
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("sprint_jax_new_run")


@dataclasses.dataclass
class _Data:
    """The training set as the step loop sees it."""
    items: list                     # laid-out examples (train.data.Item)
    stats: Any                      # train.data.DataStats of reading and laying them out
    stream: Any                     # train.data.BucketStream: packed rows per length bucket, seeded order
    trims: list[int]                # per bucket: data.trim_rows width granularity (0: never trimmed)
    digest: str                     # identifies the items and their packing (`_data_digest`)


@dataclasses.dataclass
class _Position:
    """How far a run is: optimizer steps done, rows and tokens of the data stream consumed, and
    the stream's position (rows consumed per length bucket)."""
    step: int
    rows: int
    tokens: int
    cursors: list[int]


@dataclasses.dataclass
class _Steps:
    """What the step loop leaves: the final state and what the summary reports."""
    state: Any
    pos: _Position
    records: list[dict]             # the logged metrics (process 0)
    last_loss: float | None         # loss of the last logged step
    steady_tokens: int              # tokens of the steps after the first (compiling) one ...
    steady_s: float                 # ... and their wall time (0 when there was no such step)


def _train(config: TrainConfig, out_dir: str | Path, tokenizer, progress: bool,
           callbacks: Sequence[Callable[[StepEvent], None]], new_run: bool = False) -> dict:
    """`train` inside the output lock: set up, run the steps, write the outputs."""
    distributed.initialize(config.distributed)
    import jax

    from sprint_jax.model import param_count

    t_start = time.time()
    cfg = config
    if not cfg.data.train:
        raise ConfigError("data.train is empty: give at least one jsonl file of examples")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    main = _is_main()
    if new_run:
        _clear_run(out)
    else:
        check_resume(cfg, out)
    if main:
        import yaml
        from sprint_jax.config import to_dict
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def say(msg: str) -> None:
        if main and progress:
            print(msg, file=sys.stderr, flush=True)

    model_cfg, tokenizer, tokenizer_name = _model_and_tokenizer(cfg, tokenizer)
    data = _load_data(cfg, tokenizer, model_cfg.vocab_size, out, say)
    if cfg.epochs is not None:    # as load_train_config does, for a config built in Python: the rows as packed
        from sprint_jax.train.config import steps_for_epochs
        cfg = dataclasses.replace(cfg, steps=steps_for_epochs(cfg.epochs, data.stream.describe()))
        if main:
            import yaml
            from sprint_jax.config import to_dict
            (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        say(f"{cfg.epochs:g} epoch(s) of the packed rows: {cfg.steps} steps")
    mesh, setup = _build_step(cfg, model_cfg, say)
    ckpt = _open_checkpoints(cfg, out)
    state, start, resumed = _restore_or_init(cfg, ckpt, setup, model_cfg, data, out, progress and main, say)
    done = _run_steps(cfg, setup, ckpt, data, state, start, resumed, out, t_start, progress and main,
                      callbacks)
    interrupt.check()
    t_end = time.time()

    if cfg.plot and main and done.records:
        plot_loss(done.records, out / "loss.png")
    export_dir = None
    if cfg.export.enabled:
        export_dir = out / "hf"
        _export(cfg, model_cfg, done.state["params"], tokenizer, tokenizer_name, data.stats, export_dir)
        say(f"exported HF safetensors to {export_dir}")
    summary = {
        "final_loss": done.last_loss if done.last_loss is not None else (done.records[-1]["loss"] if done.records else None),
        "steps": cfg.steps, "start_step": start.step, "resumed": resumed,
        "tokens": done.pos.tokens,
        "tokens_per_s": (done.steady_tokens / done.steady_s) if done.steady_s > 0 and done.steady_tokens else None,
        "wall_s": t_end - t_start, "params": param_count(model_cfg), "layout": cfg.data.layout,
        "data": data.stats.as_dict(), "out_dir": str(out), "export_dir": str(export_dir) if export_dir else None,
        "processes": jax.process_count(), "devices": jax.device_count(), "mesh": dict(mesh.shape),
    }
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _model_and_tokenizer(cfg: TrainConfig, tokenizer):
    """(model config, tokenizer, the tokenizer's name for the export), checked to fit each other
    and data.seq_len before any example is read. `tokenizer` None: from data.tokenizer."""
    from sprint_jax.model.capacity import check_positions
    from sprint_jax.model.tokenizer import check_tokenizer_fits
    from sprint_jax.train import data as data_lib

    if cfg.model.init == "pretrained":
        from sprint_jax.model.convert import model_dir_error
        why = model_dir_error(cfg.model.name)
        if why is not None:
            raise ConfigError(f"model.name: init is pretrained, so it must be an HF checkpoint directory; {why}")
    model_cfg = _resolve_model(cfg)
    tokenizer_name = _tokenizer_name(cfg, tokenizer is not None, tokenizer)
    check_positions(model_cfg, cfg.data.seq_len, "data.seq_len")     # before any row is built
    if tokenizer is None:
        tokenizer = data_lib.resolve_tokenizer(cfg.data.tokenizer, cfg.model.name, cfg.model.init == "pretrained")
    check_tokenizer_fits(tokenizer, model_cfg.vocab_size, "the model",
                         "model.name and data.tokenizer must belong together")
    return model_cfg, tokenizer, tokenizer_name


def _load_data(cfg: TrainConfig, tokenizer, vocab_size: int, out: Path, say) -> _Data:
    """Read data.train (and data.paired), lay the examples out as items, write OUT/data_stats.json,
    report what was used and why the rest was not, and pack the items into a row stream."""
    from sprint_jax.model.tokenizer import pad_id
    from sprint_jax.train import data as data_lib

    examples = data_lib.read_examples(cfg.data.train, cfg.data.max_examples, cfg.data.format)
    paired = None
    if cfg.data.paired.train:
        p, pf = cfg.data.paired, cfg.data.paired_format
        paired = data_lib.Paired(data_lib.read_examples(p.train, None, pf), p.layout, p.trie_whole_trajectory,
                                 list(p.train), pf)
    items, stats = data_lib.build_items(examples, tokenizer, cfg.data.layout, cfg.data.seq_len,
                                        cfg.data.overlong, cfg.data.span_weights, vocab_size,
                                        cfg.data.trie_whole_trajectory, paired, cfg.data.format)
    if sum(stats.dropped.values()) and _is_main():
        print(stats.drop_line(), file=sys.stderr, flush=True)     # also without progress: never silent
    else:
        say(stats.drop_line())
    say(f"data: {stats.read} read, {stats.used} used, {stats.truncated} truncated; "
        f"{stats.tokens} tokens ({stats.tokens_per_example:.1f} per example), {stats.loss_tokens} in the loss "
        f"({cfg.data.layout} layout)")
    for why in stats.first_skip_reasons:
        say(f"  skipped {why}")
    buckets = cfg.data.row_buckets
    stream = data_lib.BucketStream(items, buckets, cfg.optim.batch_size, cfg.data.seed, pad_id(tokenizer),
                                   cfg.data.pack_open_rows)
    stats.buckets = stream.describe()
    if len(buckets) > 1:
        say("buckets: " + ", ".join(f"{b} tokens: {d['examples']} examples, {d['rows_per_step']} rows per step"
                                    for b, d in stats.buckets.items()))
        for b, d in stats.buckets.items():
            if d["examples"] and d["rows_per_epoch"] < d["rows_per_step"]:
                say(f"  bucket {b}: {d['rows_per_epoch']} rows per epoch < {d['rows_per_step']} rows per step, "
                    "so its examples repeat within a step")
    if _is_main():
        (out / "data_stats.json").write_text(json.dumps(stats.as_dict(), indent=2))
    # data.trim_rows: a batch whose rows all end in padding is cut to a narrower width (at most 4
    # widths per bucket, each compiled once); the loss and every real token's gradient are unchanged
    trims = [data_lib.trim_bucket(b, cfg.model.loss_chunk) if cfg.data.trim_rows else 0 for b in buckets]
    return _Data(items, stats, stream, trims, _data_digest(items, cfg))


def _build_step(cfg: TrainConfig, model_cfg, say):
    """(mesh, step setup): the configured mesh, checked to split a microbatch's rows evenly, and
    the jitted step over it; reports sharding notes, the model's size and the attention body."""
    import jax

    from sprint_jax.model import param_count
    from sprint_jax.model.attention import resolve_impl
    from sprint_jax.model.sharding import make_mesh
    from sprint_jax.train import mesh as mesh_lib
    from sprint_jax.train import step as step_lib

    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    micro = cfg.optim.batch_size // cfg.optim.grad_accum
    div = mesh_lib.batch_divisor(mesh)
    if micro % div:
        raise ConfigError(f"optim.batch_size / optim.grad_accum = {micro} rows per microbatch must be a multiple "
                          f"of mesh data x fsdp = {div}")
    setup = step_lib.build_step(model_cfg, cfg.optim, cfg.steps, mesh, cfg.model.remat, cfg.model.loss_chunk,
                                layout=cfg.data.layout, attention_layout=cfg.data.layout)
    for note in setup.sharding_notes:
        say(f"sharding: {note}")
    say(f"model: {param_count(model_cfg) / 1e6:.2f}M params, mesh {dict(mesh.shape)}, "
        f"{jax.process_count()} process(es), {jax.device_count()} device(s)")
    say(f"attention: {resolve_impl(None, cfg.data.layout)} body ({cfg.data.layout} layout on "
        f"{jax.default_backend()}; model/attention.py resolve_impl)")
    return mesh, setup


def _open_checkpoints(cfg: TrainConfig, out: Path):
    """OUT/checkpoints' Checkpointer; refuses a directory with checkpoints when not resuming."""
    from sprint_jax.train import checkpoint as ckpt_lib

    ckpt_dir = out / "checkpoints"
    if not cfg.checkpoint.resume and ckpt_dir.exists() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints and checkpoint.resume is false: "
                          "use a new --out, resume, or pass --new-run to delete them and start over")
    return ckpt_lib.Checkpointer(ckpt_dir, keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)


def _restore_or_init(cfg: TrainConfig, ckpt, setup, model_cfg, data: _Data, out: Path, progress: bool,
                     say) -> tuple[Any, _Position, bool]:
    """(train state, position, resumed): the latest checkpoint's when resuming finds one (warning
    when the data changed since), else a fresh state (pretrained weights when model.init says so)
    at step 0."""
    from sprint_jax.model import load_params
    from sprint_jax.train import checkpoint as ckpt_lib

    restored = ckpt.restore_latest(setup.abstract_state()) if cfg.checkpoint.resume else None
    if restored is not None:
        state, meta = restored
        step = int(meta["step"])
        if step > cfg.steps:
            raise ConfigError(f"the latest checkpoint in {out / 'checkpoints'} is step {step}, past steps = "
                              f"{cfg.steps}: it cannot be resumed to a shorter run; pass --new-run to start "
                              f"over, or choose another --out")
        cursors = meta.get("bucket_rows")
        if cursors is None or len(cursors) != len(data.stream.buckets):
            # a checkpoint of the unbucketed stream (its cursor is `rows`), or of other buckets
            # (the digest warning below says the batches differ): an uninterrupted run's position
            cursors = [int(meta["rows"])] if len(data.stream.buckets) == 1 else data.stream.position_after(step)
        pos = _Position(step, int(meta["rows"]), int(meta.get("tokens", 0)), [int(c) for c in cursors])
        if meta.get("data_digest") != data.digest:
            ckpt_lib.warn("the training data or its layout changed since this checkpoint was written: "
                          "the run continues at the saved row position but not on the same batches")
        say(f"resumed from step {pos.step} (row {pos.rows} of the data stream"
            + (f", rows {pos.cursors} of its buckets {data.stream.buckets})" if len(pos.cursors) > 1 else ")"))
        return state, pos, True
    quarantine = out / "checkpoints_quarantine"
    if cfg.checkpoint.resume and quarantine.exists() and any(quarantine.iterdir()):
        ckpt_lib.warn(f"starting from step 0: no valid checkpoint, and {quarantine} holds bad ones")
    params = None
    if cfg.model.init == "pretrained":
        _, params = load_params(cfg.model.name, config=model_cfg, param_dtype="float32",
                                shardings=setup.param_shardings, progress=progress)
    return (setup.init_state(cfg.seed, params=params, init_seed=cfg.model.init_seed),
            _Position(0, 0, 0, data.stream.start()), False)


class _Throughput:
    """Tokens per second: of the window since the last logged step, and of the steady state (the
    steps after the first, whose time includes compilation)."""

    def __init__(self):
        self.window_start, self.window_tokens = time.time(), 0
        self.first_done: float | None = None    # wall time when the first (compiling) step finished
        self.steady_tokens = 0

    def add(self, n_tok: int, step_metrics) -> None:
        """Count one step's tokens. The first step is waited for: the steady state starts there."""
        import jax

        self.window_tokens += n_tok
        if self.first_done is None:
            jax.block_until_ready(step_metrics)
            self.first_done = time.time()
        else:
            self.steady_tokens += n_tok

    def window_rate(self, now: float) -> float:
        """Tokens per second of the window ending `now`, which starts the next window."""
        rate = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, 0
        return rate


def _record(m: dict, pos: _Position, width: int, bucket: int, epoch: int, speed: _Throughput,
            t_start: float) -> dict:
    """The metrics.jsonl record of a logged step: `m` is the step's metrics on the host."""
    mv = {k: float(v) for k, v in m.items()}
    now = time.time()
    return {"step": pos.step, "loss": mv["loss"], "lr": mv["lr"], "grad_norm": mv["grad_norm"],
            "tokens": pos.tokens, "loss_tokens": int(mv["loss_tokens"]),
            "tokens_per_s": speed.window_rate(now), "row_width": width, "bucket": bucket, "epoch": epoch,
            "wall_s": now - t_start}


def _run_steps(cfg: TrainConfig, setup, ckpt, data: _Data, state, start: _Position, resumed: bool,
               out: Path, t_start: float, progress: bool, callbacks) -> _Steps:
    """Steps start.step .. cfg.steps: each on the next batch of rows, NaN-checked one step late,
    logged every log_every steps, checkpointed every checkpoint.every steps and at the end (the
    checkpoint records the data position); callbacks run after every step. Closes the
    checkpointer and the metrics log, also on an error."""
    import jax

    stream = data.stream
    pos = dataclasses.replace(start, cursors=list(start.cursors))
    metrics = Metrics(out, cfg.tensorboard, start.step)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=start.step, desc="train", unit="step", dynamic_ncols=True)

    def meta_now() -> dict:
        return {"rows": pos.rows, "tokens": pos.tokens, "epoch": stream.epoch_of(pos.cursors),
                "bucket_rows": list(pos.cursors), "data_digest": data.digest}

    speed = _Throughput()
    last_saved = start.step if resumed else -1
    last_loss = None
    pending = None                      # (step, metrics) still to be checked for NaN: one step late
    try:
        for step in range(start.step, cfg.steps):
            interrupt.check()                   # a Ctrl-C whose KeyboardInterrupt Python dropped
            k, row_ids, after = stream.advance(pos.cursors)
            rows = stream.streams[k]            # the bucket's RowStream (one bucket: all items)
            width = rows.width(row_ids, data.trims[k])
            batch = distributed.put_batch(lambda ids: rows.rows(ids, width).as_dict(), row_ids.start,
                                          len(row_ids), width, setup.batch_shardings)
            state, m = setup.step(state, batch)
            if pending is not None:
                _check_finite(*pending, last_saved)
            n_tok = stream.tokens(k, row_ids)
            pos.cursors = after
            pos.rows += len(row_ids)
            pos.tokens += n_tok
            done = pos.step = step + 1
            pending = (done, m)
            speed.add(n_tok, m)
            rec = None
            if done % cfg.log_every == 0 or done == cfg.steps:
                rec = _record(jax.device_get(m), pos, width, stream.buckets[k], stream.epoch_of(pos.cursors),
                              speed, t_start)
                last_loss = rec["loss"]
                metrics.log(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.steps:
                _check_finite(done, m, last_saved)
                _save_checked(ckpt, done, state, meta_now(), last_saved)
                last_saved = done
            if bar is not None:
                bar.update(1)
            for cb in callbacks:
                cb(StepEvent(done, rec, ckpt))
        if pending is not None:
            _check_finite(*pending, last_saved)     # also waits for the last step to finish
        t_steps_end = time.time()
        if last_saved != cfg.steps:
            _save_checked(ckpt, cfg.steps, state, meta_now(), last_saved)
    finally:
        if bar is not None:
            bar.close()
        ckpt.close()
        metrics.close()
    # tokens/s of the steps after the first (compiling) one; the final checkpoint write (in the
    # first run of a process it includes orbax's and the checksum's one-time setup, several
    # seconds) and the export count in wall_s only
    steady = (t_steps_end - speed.first_done) if speed.first_done is not None else 0.0
    return _Steps(state, pos, metrics.records, last_loss, speed.steady_tokens, steady)


def _export(cfg: TrainConfig, model_cfg, params, tokenizer, tokenizer_name: str, stats, export_dir: Path) -> None:
    """The final model as an HF directory, with what inference must know about the training."""
    from sprint_jax import caps
    from sprint_jax.schema import META_KEY, prompt_format_of
    from sprint_jax.train.fingerprint import fingerprint
    # the prompt format travels with the model: inference applies it to a user's query (null
    # when the training prompts end differently: nothing to apply, and a stale value replaced);
    # so does the shape of the trained examples, which inference's default caps come from
    export_hf(model_cfg, params, tokenizer, export_dir, cfg.export.dtype,
              meta={"layout": cfg.data.layout, "format": cfg.data.format, "tokenizer": tokenizer_name,
                    "train_fingerprint": fingerprint(stats.used_prompts),
                    META_KEY: prompt_format_of(stats.used_prompts),
                    caps.SHAPE_KEY: caps.shape_summary(stats.used_shapes)})
