"""`sprint-jax infer`: run the SPRINT orchestrator on one query and show the stages as they happen."""
from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import TextIO

DESCRIPTION = """Run the SPRINT orchestrator (paper §10) on one query and show it live: each plan as
the planner closes it, the executors of a stage side by side, the sync, the final answer; then
sequential vs total tokens and wall clock (no grading).

  sprint-jax infer --model runs/demo/train/sprint/hf --config runs/demo/orchestrator.yaml "Q: 8 5 2 1"
  sprint-jax infer --model runs/sft_sprint "What is 17 * 23 + 4?"
  sprint-jax infer --model DIR "..." --mode serial --max-stages 6 --temperature 0.6
  sprint-jax infer --model DIR "..." --mode sequential          # plain decoding (RFT baseline)

Budgets and sampling: one flag per OrchestratorConfig field (--max-stages, --max-prompts,
--max-planner-tokens, --max-branch-tokens, --max-total-tokens, --time-limit-s, --temperature,
--top-k, --top-p, --seed, --layout), or --config FILE.yaml / --set field=value.

Prompt format: the query is given to the model the way its training prompts were written. `sprint-jax
train` records how they end (prompt_format in MODEL/sprint_jax.json, e.g. a newline after "Q: 8 5 2 1")
and the query's trailing whitespace is set to that, with a note on stderr when it changes; a model
without the field gets the query as written.

Timings: each stage's seconds are the model's work; the first use of a shape in the process also
compiles it (XLA), shown separately as "+ N s compiling".

Token convention: where forced text (an executor's opening, the sync) meets generated text, the
context is tokenized the way the model's training layout did (flat or trie). The layout is read
from MODEL/sprint_jax.json, which `sprint-jax train` writes into its export; a model without it
is treated as flat (the paper's layout). `--layout trie` overrides.

Join: how the executors' work reaches the planner at each sync. `reprefill` prefills
the executions onto the planner (every execution token is run again in the planner's context);
`merge` places each executor's KV after the fork point without running the model (executors all
start at the fork position; the planner continues at fork + the longest executor; only tokens a
branch never computed, its close tag or a repair, are run, in their branch). The default follows
the layout: `merge` for a model trained with the merge layout, else `reprefill`; `--join`
overrides (merge needs a trie or merge model, and mode parallel). The two joins are different
computations and agree only when every stage has one executor.
"""


# ---------------------------------------------------------------------------------------------
# Arguments shared with `sprint-jax eval`
# ---------------------------------------------------------------------------------------------
def add_run_arguments(p) -> None:
    """Model, tokenizer, engine capacities and OrchestratorConfig flags."""
    p.add_argument("--model", required=False, help="HF safetensors or orbax model directory (Qwen2 or Qwen3)")
    add_tokenizer_argument(p)
    add_dtype_argument(p)
    p.add_argument("--config", default=None, help="YAML file of OrchestratorConfig fields")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an OrchestratorConfig field (repeatable)")
    from sprint_jax.config import add_config_flags
    from sprint_jax.infer.orchestrator import OrchestratorConfig

    g = p.add_argument_group("budgets and sampling (OrchestratorConfig; flags override --config/--set)")
    add_config_flags(g, OrchestratorConfig, defaults={"layout": "the model's sprint_jax.json, else flat",
                                                      "join": "merge for a merge-layout model, else reprefill",
                                                      "format": "the model's sprint_jax.json, else sprint",
                                                      "max_stages": "2 x the most stages of the model's training "
                                                                    "data (sprint_jax.json), else 12",
                                                      "max_prompts": "the most prompts per stage of the model's "
                                                                     "training data + 25%% (at least +1), else 8"})
    e = p.add_argument_group("engine capacities")
    e.add_argument("--max-seq-len", type=int, default=None,
                   help="planner context capacity in tokens (default: 8192, or the model's "
                        "max_position_embeddings when smaller; more than that is refused)")
    e.add_argument("--decode-chunk", type=int, default=16, help="decode steps per host round trip")
    e.add_argument("--prefill-chunk", type=int, default=512, help="longest prefill piece")
    e.add_argument("--page-size", type=int, default=16, help="tokens per page of the KV pool (default 16)")
    e.add_argument("--kv-pages", type=int, default=None,
                   help="pages in the KV pool (default: what every run at the capacities would hold; fewer "
                        "hold as many runs as their real lengths allow, the youngest decoding run giving its "
                        "pages back when they run out: see `sprint-jax plan engine --lengths`)")
    e.add_argument("--attention-impl", choices=["xla", "pallas"], default="xla",
                   help="shared-prefix attention of a decode step (pallas: the Pallas kernels in "
                        "sprint_jax.kernels, per shard on a mesh; interpret mode on CPU: slow)")
    from sprint_jax.infer.sharding import add_mesh_argument
    add_mesh_argument(e)


def config_from_args(args):
    """OrchestratorConfig: the model export's layout, then --config, then --set and the flags."""
    from sprint_jax.config import flag_overrides, load_config
    from sprint_jax.infer.orchestrator import OrchestratorConfig

    from sprint_jax.errors import UserError

    overrides = list(args.set) + flag_overrides(args, OrchestratorConfig)
    config = load_config(OrchestratorConfig, args.config, overrides, data=model_defaults(args.model))
    if getattr(args, "mode", None) == "serial" and config.resolved_join == "merge":
        raise UserError("--mode serial runs the executors on the planner's own cache, so there is nothing to "
                        "merge: use --mode parallel, or --join reprefill")
    return config


def model_defaults(model: str | None) -> dict:
    """OrchestratorConfig fields fixed by how the model was trained: its layout and tag format,
    and max_stages / max_prompts from the shape of its training data with a margin
    (`caps.caps_from_shape`), all from the export's sprint_jax.json (a key it lacks leaves the
    default: flat, sprint, 12 stages, 8 prompts). A malformed shape record is a UserError."""
    from sprint_jax import caps
    from sprint_jax.errors import UserError
    from sprint_jax.model.hf import EXPORT_META_FILE

    meta = export_meta(model)
    out = {k: meta[k] for k in ("layout", "format") if meta.get(k) is not None}
    try:
        out.update(caps.caps_from_shape(meta.get(caps.SHAPE_KEY)))
    except ValueError as e:
        raise UserError(f"--model {model}: {EXPORT_META_FILE}: {e}") from None
    return out


def export_meta(model: str | None) -> dict:
    """The `--model` directory's sprint_jax.json ({} without one, or without a directory: the
    model loader reports that). An unreadable file, or a prompt format in it that cannot be
    applied, is a UserError."""
    from sprint_jax.errors import UserError
    from sprint_jax.schema import apply_prompt_format
    from sprint_jax.model.hf import EXPORT_META_FILE, CheckpointError, read_export_meta

    if not model or not Path(model).is_dir():
        return {}
    try:
        meta = read_export_meta(model)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    try:
        apply_prompt_format("x", meta)          # the format checked once, before any prompt uses it
    except ValueError as e:
        raise UserError(f"--model {model}: {EXPORT_META_FILE}: {e}") from None
    return meta


def formatted_prompt(model: str | None, text: str, encode, what: str = "query") -> tuple[str, list[int]]:
    """(`text` in the prompt format the `--model` was trained with (sprint_jax.schema),
    its tokens by `encode`). A text the tokenizer cannot encode is a UserError; once it encodes, a
    one-line note on stderr says what the format changed, if anything."""
    from sprint_jax.errors import UserError
    from sprint_jax.schema import META_KEY, apply_prompt_format
    from sprint_jax.model.hf import EXPORT_META_FILE

    out = apply_prompt_format(text, export_meta(model))
    try:
        ids = list(encode(out))
    except ValueError as e:          # e.g. a character outside a VocabTokenizer's vocabulary
        raise UserError(f"the tokenizer cannot encode the {what}: {e}") from None
    if out.rstrip() != text.rstrip():           # wrapped (e.g. in <query> tags)
        print(f"note: the {what} is now {out!r}, as every prompt the model was trained on "
              f"({META_KEY} in {Path(model) / EXPORT_META_FILE})", file=sys.stderr, flush=True)
    elif out != text:
        print(f"note: the {what} now ends in {out[len(out.rstrip()):]!r} instead of {text[len(text.rstrip()):]!r}, "
              f"as every prompt the model was trained on ({META_KEY} in {Path(model) / EXPORT_META_FILE})",
              file=sys.stderr, flush=True)
    return out, ids


def add_tokenizer_argument(p) -> None:
    """`--tokenizer`, the same in generate / infer / eval."""
    p.add_argument("--tokenizer", default=None, metavar="qwen2|DIR",
                   help="tokenizer directory, or 'qwen2' for the Qwen2 BPE (default: the model directory)")


def add_dtype_argument(p) -> None:
    """`--dtype`, the same in generate / infer / eval / bench decode."""
    from sprint_jax.dtypes import DTYPE_NAMES

    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="parameter and compute dtype (activations, KV cache); default float32")


def load_model_arg(model: str | None, dtype: str | None, mesh=None):
    """The model of a `--model DIR` flag (HF or orbax directory), with parameters and compute
    (activations, KV cache) in `dtype` (float32 when None); on `mesh`, each parameter is loaded
    straight into its sharding (a 7B checkpoint never sits whole on one device)."""
    from sprint_jax.errors import UserError
    from sprint_jax.model.convert import load_model, model_dir_error
    from sprint_jax.model.hf import CheckpointError

    if not model:
        raise UserError("--model DIR is required")
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise UserError(f"--model: {model_dir_error(model_dir)}")
    shardings_fn = None
    if mesh is not None:
        from sprint_jax.infer.sharding import param_shardings
        shardings_fn = lambda config: param_shardings(config, mesh)   # noqa: E731
    try:
        return load_model(model_dir, param_dtype=dtype, compute_dtype=dtype, shardings_fn=shardings_fn)
    except CheckpointError as e:            # (a UserError too; caught here to name the flag)
        raise UserError(f"--model {model_dir}: {e}") from None


def mesh_arg(args):
    """The Mesh of `--mesh` (None without the flag)."""
    from sprint_jax.infer.sharding import mesh_from_flag
    return mesh_from_flag(getattr(args, "mesh", None))


def load_tokenizer_arg(tokenizer: str | None, model: str):
    """`--tokenizer qwen2|DIR`, or the tokenizer saved beside the model."""
    from sprint_jax.errors import UserError
    from sprint_jax.model.tokenizer import load_tokenizer, qwen2_tokenizer

    try:
        return qwen2_tokenizer() if tokenizer == "qwen2" else load_tokenizer(tokenizer or model)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from {tokenizer or model} ({e}); "
                        f"pass --tokenizer DIR or --tokenizer qwen2") from None


def _checked_load(args, config, seqs: int = 1, mesh=None):
    """(model, tokenizer, EngineConfig) for `seqs` sequences, each with config.max_prompts
    branches of the per-branch budget plus room for the forced opening tag. Capacities, the KV
    pool's memory and the tokenizer are checked against the model's config.json before the
    weights are read."""
    from sprint_jax.errors import UserError
    from sprint_jax.infer.engine import EngineConfig, EngineError
    from sprint_jax.model.capacity import BRANCH_TAG_ROOM, check_memory, check_positions
    from sprint_jax.model.config import Qwen2Config
    from sprint_jax.model.tokenizer import check_tokenizer_fits

    if not args.model or not Path(args.model).is_dir():
        load_model_arg(args.model, args.dtype)          # the one-line error for a missing --model
    mcfg = Qwen2Config.from_hf_config(Path(args.model))
    if args.dtype:
        mcfg = mcfg.replace(dtype=args.dtype)
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else min(8192, mcfg.max_position_embeddings)
    check_positions(mcfg, max_seq_len, "--max-seq-len")
    branch_tokens = config.max_branch_tokens + BRANCH_TAG_ROOM
    try:
        sizes = EngineConfig(max_seqs=seqs, max_children=config.max_prompts, max_seq_len=max_seq_len,
                             max_branch_tokens=branch_tokens, decode_chunk=args.decode_chunk,
                             prefill_chunk=args.prefill_chunk, page_size=getattr(args, "page_size", 16),
                             num_pages=getattr(args, "kv_pages", None))
    except EngineError as e:
        raise UserError(str(e).replace("num_pages", "--kv-pages").replace("page_size", "--page-size")
                        .replace("decode_chunk", "--decode-chunk").replace("prefill_chunk", "--prefill-chunk")
                        ) from None
    what = (f"{sizes.pool_pages()} pages of {sizes.page_size} tokens" if sizes.num_pages is not None else
            f"{seqs} sequence(s) of --max-seq-len {max_seq_len} with {config.max_prompts} branches of {branch_tokens}")
    if mesh is not None:
        from sprint_jax.infer.sharding import serving_config
        mcfg = serving_config(mcfg, mesh)
    check_memory(sizes.pool_bytes_per_device(mcfg, mesh), f"the KV cache ({what}, per device)",
                 "lower --max-seq-len, --max-prompts, --max-branch-tokens, --kv-pages"
                 + (" or --concurrency" if seqs > 1 else ""))
    tok = load_tokenizer_arg(args.tokenizer, args.model)
    check_tokenizer_fits(tok, mcfg.vocab_size, f"the model in {args.model}")
    model = load_model_arg(args.model, args.dtype, mesh)
    return model, tok, sizes


def build_engine(args, config, concurrency: int = 1):
    """The model, its tokenizer and an Engine with `concurrency` sequence slots, each sized for
    `config` (children per slot = max_prompts; see `_checked_load`)."""
    from sprint_jax.errors import UserError
    from sprint_jax.infer.engine import Engine, EngineError

    if concurrency < 1:
        raise UserError(f"--concurrency must be >= 1, got {concurrency}")
    mesh = mesh_arg(args)
    model, tok, sizes = _checked_load(args, config, concurrency, mesh=mesh)
    try:
        return Engine(model, tok, sizes, mesh=mesh, attention_impl=getattr(args, "attention_impl", "xla"))
    except EngineError as e:
        raise UserError(str(e)) from None




# ---------------------------------------------------------------------------------------------
# Compilation time (eval's CompileClock: JAX's compile spans, overlapping ones counted once)
# ---------------------------------------------------------------------------------------------
def split_seconds(seconds: float, clock, scale: float = 1.0, unit: str = "s", spec: str = ".2f") -> str:
    """A timing that ended just now, as "<running> s" or "<running> s + <compiling> s compiling",
    the compiling part from `clock` (sprint_jax.eval.evaluate.CompileClock, started before it;
    None: not split). scale/unit/spec: e.g. 1000, "ms", ".1f"."""
    import time

    now = time.time()
    c = min(clock.within(now - seconds, now), seconds) if clock is not None else 0.0
    text = f"{format(scale * (seconds - c), spec)} {unit}"
    if format(scale * c, spec) != format(0.0, spec):
        text += f" + {format(scale * c, spec)} {unit} compiling"
    return text


# ---------------------------------------------------------------------------------------------
# Live display
# ---------------------------------------------------------------------------------------------
class LiveDisplay:
    """An `on_event` hook that prints the run as it happens: plans, executors side by side, sync.
    With a started `compile_clock` (sprint_jax.eval.evaluate.CompileClock), every timing it prints
    is split into running and compiling."""

    def __init__(self, stream: TextIO | None = None, width: int | None = None, max_lines: int = 14,
                 compile_clock=None):
        self.stream = stream or sys.stdout
        self.width = width or min(shutil.get_terminal_size((120, 24)).columns, 160)
        self.max_lines = max_lines
        self.clock = compile_clock

    def _secs(self, seconds: float) -> str:
        return split_seconds(seconds, self.clock)

    def _print(self, s: str = "") -> None:
        print(s, file=self.stream, flush=True)

    def _rule(self, title: str) -> None:
        self._print(f"── {title} " + "─" * max(0, self.width - len(title) - 4))

    def _wrap(self, text: str, width: int) -> list[str]:
        lines: list[str] = []
        for para in text.strip().splitlines() or [""]:
            lines += textwrap.wrap(para, width) or [""]
        if len(lines) > self.max_lines:
            lines = lines[: self.max_lines - 1] + [f"… ({len(lines) - self.max_lines + 1} more lines)"]
        return lines

    def _columns(self, blocks: list[tuple[str, str]]) -> None:
        gap = 3
        col = (self.width - gap * (len(blocks) - 1)) // len(blocks)
        if col < 24:   # too many to fit side by side: one under the other
            for head, body in blocks:
                self._print(head)
                for line in self._wrap(body, self.width - 2):
                    self._print("  " + line)
            return
        cells = [[head[:col]] + self._wrap(body, col) for head, body in blocks]
        for r in range(max(len(c) for c in cells)):
            self._print((" " * gap).join((c[r] if r < len(c) else "").ljust(col) for c in cells).rstrip())

    def __call__(self, event) -> None:
        rec, stage = event.record, event.stage
        if event.kind == "start":
            self._rule(f"query ({rec.mode})")
            for line in self._wrap(rec.query, self.width):
                self._print(line)
        elif event.kind == "planner":
            self._rule(f"stage {stage.index} · planner: {stage.planner_tokens} tokens, {self._secs(stage.planner_s)}")
            for line in self._wrap(event.text, self.width):
                self._print(line)
            for p in stage.problems:
                self._print(f"  ! {p}")
        elif event.kind == "executors_start":
            self._print(f"  … {event.text} decoding")
        elif event.kind == "executors":
            self._rule(f"stage {stage.index} · {len(stage.executions)} executor(s) ({stage.executor_mode}), "
                       f"{self._secs(stage.executors_s)}")
            self._columns([(f"[{stage.index}.{e.index}] {e.tokens} tok, {e.stop_reason}", e.text)
                           for e in stage.executions])
        elif event.kind == "implicit_execution":
            self._rule(f"stage {stage.index} · execution (inline, {stage.executions[0].tokens} tokens)")
            for line in self._wrap(event.text, self.width):
                self._print(line)
        elif event.kind == "sync":
            ms = split_seconds(stage.sync_s, self.clock, 1000, "ms", ".1f")
            if stage.join == "merge":
                self._print(f"  ⇢ sync: the executors' caches placed after the fork (merge join), "
                            f"{stage.sync_tokens} tokens run, in {ms}")
            else:
                self._print(f"  ⇢ sync: {stage.sync_tokens} tokens prefilled onto the planner (reprefill join) "
                            f"in {ms}")
        elif event.kind == "final":
            self._rule(f"final ({rec.final_tokens} tokens, {self._secs(rec.final_s)})")
            for line in self._wrap(event.text, self.width):
                self._print(line)
        elif event.kind == "end":
            self._rule("stats")
            for line in summary_lines(rec, self.clock):
                self._print(line)


def summary_lines(rec, clock=None) -> list[str]:
    """The run's stats; with `clock` (just after the run), its wall clock split into running and
    compiling."""
    saved = 1 - rec.sequential_tokens / rec.total_tokens if rec.total_tokens else 0.0
    lines = [f"termination:        {rec.termination}",
             f"stages:             {len(rec.stages)} ({sum(len(s.executions) for s in rec.stages)} executions)",
             f"sequential tokens:  {rec.sequential_tokens}",
             f"total tokens:       {rec.total_tokens}   (critical path {100 * saved:.1f}% shorter)",
             "wall clock:         " + (split_seconds(rec.wall_s, clock) if clock is not None
                                          else f"{rec.wall_s:.2f} s (compilation not measured)"),
             f"final answer:       {rec.final_answer!r}"]
    if rec.problems:
        lines.append(f"problems ({len(rec.problems)}):")
        lines += [f"  - {p}" for p in rec.problems[:10]]
        if len(rec.problems) > 10:
            lines.append(f"  … {len(rec.problems) - 10} more")
    return lines


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("query", help="the query text, in the model's prompt format (see Prompt format above)")
    p.add_argument("--mode", choices=["parallel", "serial", "sequential"], default="parallel")
    p.add_argument("--record", default=None, metavar="FILE.json", help="also write the run record as JSON")
    add_run_arguments(p)


def run(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.infer.orchestrator import Orchestrator

    if not args.query.strip():
        raise UserError("the query is empty")
    if args.record:                      # checked now, not after the whole run
        record_path = Path(args.record)
        if record_path.is_dir():
            raise UserError(f"--record {record_path} is a directory; give a file name")
        if not record_path.parent.is_dir():
            raise UserError(f"--record {record_path}: directory {record_path.parent} does not exist")
    config = config_from_args(args)
    engine = build_engine(args, config)
    query, _ = formatted_prompt(args.model, args.query, engine.encode)
    from sprint_jax.eval.evaluate import CompileClock

    clock = CompileClock().start()
    try:
        record = Orchestrator(engine, config, on_event=LiveDisplay(compile_clock=clock)).run(query, args.mode)
    finally:
        clock.stop()
    if args.record:
        Path(args.record).write_text(json.dumps(record.to_json(), indent=2, ensure_ascii=False) + "\n")
    return 0


__all__ = ["add_run_arguments", "config_from_args", "build_engine", "formatted_prompt", "split_seconds",
           "LiveDisplay", "summary_lines"]
