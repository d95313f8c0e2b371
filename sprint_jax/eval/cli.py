"""`sprint-jax eval`: accuracy and sequential/total tokens of a model on a task set; `eval compare`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from sprint_jax.tasks import load_tasks

DESCRIPTION = """Evaluate a model with the SPRINT orchestrator (paper §13) and compare two runs.

  sprint-jax eval --model DIR --data math500 --mode parallel --limit 50 --out runs/eval_sprint
  sprint-jax eval --model RFT_DIR --data math500 --mode sequential --limit 50 --out runs/eval_rft
  sprint-jax eval compare runs/eval_sprint runs/eval_rft [--out runs/compare]

--data
  math500       MATH-500, shipped with the package (sprint_jax/data, MIT; $SPRINT_JAX_DATA
                overrides the directory); graded with math-verify.
  countdown     --countdown-n generated Countdown tasks (seed --data-seed); graded by the
                Countdown rules (every number once, + - * / only, equals the target).
  chains        the held-out test set of `sprint-jax demo` at the demo's defaults (100 digit-chains
                problems of 4 chains x 12 steps, none in its training set; --data-seed is the
                demo's seed): evaluate a model the demo trained with the demo's budgets, e.g.
                --model runs/demo/train/sprint/hf --data chains --mode parallel (the RFT model:
                runs/demo/train/rft/hf, --mode sequential) --max-stages 3 --max-prompts 4
                --max-planner-tokens 48 --max-branch-tokens 24 --max-total-tokens 1024
                --max-seq-len 256 --prefill-chunk 128 --concurrency 1.
                With --chains MIN-MAX: instead, a held-out set of mixed lengths (MIN..MAX chains
                of --chain-length steps, distinct start digits, seed --data-seed; --limit, default
                100, problems): `curate` keeps its training problems out of it with
                tasks: {source: chains, min_chains: MIN, max_chains: MAX, held_out: N >= --limit}.
  FILE          a task file: .jsonl, .parquet, .arrow, or a `datasets` save_to_disk directory.
                --task-kind auto reads multiple choice when the first record has
                "choices"/"options" or the GPQA columns, else MATH ({"problem", "answer"}).

GPQA is gated, so it is not shipped: accept its terms on Hugging Face
(Idavidrein/gpqa), download gpqa_diamond.csv yourself, and convert each row to one JSON line,
either keeping the original columns
  {"Record ID": ..., "Question": ..., "Correct Answer": ..., "Incorrect Answer 1": ..., ...}
(options are shuffled per record with a fixed seed) or as
  {"id": ..., "question": ..., "choices": ["...", "...", "...", "..."], "answer": "C"}
then run with --data gpqa.jsonl --task-kind choice. Answers are graded as letters.

Prompts: the model sees the task's problem text (Countdown: TinyZero's prompt), the same text
curation put in the training prompts (sprint_jax.tasks.task_prompt). --chat-template auto (default)
wraps it in the checkpoint's own chat template (transformers' apply_chat_template, one user turn,
generation prompt added: R1-Distill's ends in "<think>\\n") when the tokenizer has one and the
model has no sprint_jax.json, i.e. was not trained here (a model trained here saw the raw text);
on: always; off: never. report.json meta.chat_template says which ran. --instruction adds a line
after the task text (r1-math: DeepSeek-R1's "Please reason step by step, and put your final answer
within \\boxed{}.", for a released R1 model, with --answer-from auto); none by default, as a model
trained here saw the task text alone.

Decoding: greedy unless the config samples. configs/eval_r1_distill_7b.yaml is the papers'
decoding for R1-Distill-Qwen-7B and models tuned from it: temperature 0.6, top-p 0.95 (the
DeepSeek-R1 model card's recommendation), a 32,768-token run budget and no smaller per-call cap.
Without --max-seq-len, eval's context is the run's budget (max_total_tokens) + 2,048 positions
for the prompt and forced tags, at most the model's max_position_embeddings.

--samples K: every problem runs K times, sample s of problem P with its own seed, a stable hash
of (--seed, P's id, s) (so problems draw independently, and a resumed, reordered or extended run,
or one over another --limit, reproduces the samples it has), all on the batched engine. results.jsonl
and records.jsonl keep one line per problem and sample ("sample": s). report.json "samples":
avg_at_k (the mean over problems of each problem's accuracy over its samples), avg_at_k_se (its
standard error: the standard deviation (n - 1) of the per-problem means / sqrt(problems); problems
are the sampled unit, a problem's samples are not independent), pass_at_k for k = 1, 2, 4, ... K
(the unbiased estimator of Chen et al. 2021 from K samples: 1 - C(K - c, k) / C(K, k), averaged
over problems) and per_problem (samples, correct, mean). K > 1 needs --temperature > 0.

Outcomes: every run is correct, wrong, context_full (not correct and cut by the context or
the token budget: termination context_full or token_budget) or capped (not correct and cut by a
cap on its shape: termination max_stages, or prompts past max_prompts that got no executor),
counted apart in report.json "outcomes" (accuracy still counts them as not correct). The caps'
defaults come from the model's training data (sprint_jax.json data_shape; see --max-stages).

--answer-from: which text is graded. final_answer (default): the <Final Answer> block of our
format; boxed_last: the last \\boxed{} of the whole output (a base reasoning model, e.g. the untuned
R1-distill, as a row of the same table); auto: the block, else the last box.

Contamination guard: `sprint-jax train` writes the hashes of its training problems
(train_fingerprint in MODEL/sprint_jax.json). eval lists every evaluated problem the model was
trained on and refuses to report (exit 2) unless --allow-overlap is given. Grader failures are
counted (report.json grader_errors) and logged, never silently graded "wrong".

--concurrency N (default 8): N problems run at once on the batched engine (sprint_jax.infer.engine):
one decode step serves every planner and executor of them. Results are written in problem order
and, under greedy decoding, do not depend on N (timings aside); wall clock per problem at N=1 is
the latency, problems per second at N the throughput.

Timing: wall clocks exclude XLA compilation, which is timed apart (compile_s). Nothing is warmed
up or run twice: the engine compiles each new shape when it first meets it, and the seconds JAX
reports compiling are taken out of the clock of every problem that was running then (its wall_s)
and of the run's wall clock; results.jsonl keeps per problem wall_s, compile_s, finished_s (on its
invocation's clock), invocation and concurrency, report.json the run's compile_s.

Modes: parallel (executors batched over a shared-prefix fork), serial (the same executors one
after another; on the batched engine they run as a fork too), sequential (plain decoding: the RFT baseline, or a SPRINT model run as an ordinary
model).

Output (--out DIR): results.jsonl (per problem: id, correct, sequential_tokens, total_tokens,
stages, wall_s, problems, termination, ...), records.jsonl (full run records), report.json
(accuracy, mean sequential and total tokens, wall clock, format-valid rate, ...), tokens.png
(sequential vs total tokens per problem) and sequential_to_total_by_length.png (the run's own
sequential / total tokens: SPRINT-internal, not a gain over RFT; 1 for a sequential run).
An existing --out is resumed: problems already in its results.jsonl are skipped after checking that
mode, budgets, model weights and problems are the same (eval_run.json); --overwrite starts it afresh.
A finished result is never deleted: a rerun over fewer problems (a smaller --limit) keeps the
others in results.jsonl; the printed summary and report.json cover the problems this command was
asked for (report.json problems_in_out counts the lines on disk). One run at a time per --out (a
second one exits naming the first).

Over hosts / device groups: `--shard I/N` evaluates problems I, I+N, I+2N, ... (0 <= I < N) of
the task list into its own --out; `eval merge SHARD_DIR... --out DIR` joins N finished shards into
the results.jsonl / records.jsonl / report.json one run writes (timings aside; merge.json lists
the shards). A shard that died is rerun alone with its own command. --mesh tensor=4,data=2 runs
one process over several devices (sprint_jax.infer.sharding).

`eval compare A B`: the paper's table (accuracy, sequential tokens, total tokens, wall clock,
change) for run A (SPRINT) against run B (RFT) on the same problems (every line of each
results.jsonl), matched by id (a sampled run through its per-problem means: accuracy is Avg@k);
then the share of context_full runs, Avg@k with its standard error (sampled runs), ThreadWeaver's
self-parallelism ratio (total tokens / sequential tokens, summed over the runs) and activation
ratio (share of problems where the model forked at least once; a problem's share of its
samples, averaged), and the mean per-problem speedup (B's sequential tokens / A's per problem,
averaged over all problems and over those both solved; a sampled problem is solved when more
than half of its samples are) with its distribution (median, min, max, the share of problems
faster, the max over problems both solved); then, per bin of B's sequential length (--bins thresholds,
default 2000,4000,8000 as in the paper's >8k analysis, and --quantiles equal-size bins; problems
of equal length share a bin, so fewer bins when many are equal), both runs' accuracy, sequential
tokens and wall clock. Each run's wall clock and concurrency are derived from its problems'
timings, so a run resumed over several invocations is counted whole (its concurrencies listed
when they differ). With --out: compare.json, bins_by_baseline_length.png, speedup_histogram.png
(per-problem B/A sequential tokens and wall clock, ThreadWeaver Fig. 5).
"""


CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# eval's default --max-seq-len: the run's token budget plus room for the prompt and the forced
# tags (executor openings, repairs) a run holds in its context besides what it generates
PROMPT_ROOM = 2048


def add_arguments(p) -> None:
    from sprint_jax.infer.infer_cli import add_run_arguments

    p.add_argument("--shard", default=None, metavar="I/N",
                   help="evaluate only shard I of N (problems I, I+N, ...; 0 <= I < N), or `auto` (SLURM / "
                        "multi-host TPU task id and count); join the shards with `eval merge`")
    p.add_argument("compare", nargs="*", metavar="compare RUN_A RUN_B | merge SHARD_DIR...",
                   help="compare two eval output directories (SPRINT first, RFT second)")
    p.add_argument("--data", default=None,
                   help="math500 | countdown | chains (the demo's test set) | FILE (.jsonl / .parquet / .arrow / "
                        "dataset dir)")
    p.add_argument("--task-kind", choices=["auto", "math", "choice"], default="auto",
                   help="how to read FILE.jsonl")
    p.add_argument("--mode", choices=["parallel", "serial", "sequential"], default="parallel")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems")
    p.add_argument("--countdown-n", type=int, default=100, help="--data countdown: tasks to generate")
    p.add_argument("--data-seed", type=int, default=0,
                   help="--data countdown: generator seed; --data chains: the demo's seed")
    p.add_argument("--chains", default=None, metavar="MIN-MAX",
                   help="--data chains: the held-out mixed-length set of MIN..MAX chains per problem "
                        "(chains.mixed_test_set) instead of the demo's test set")
    p.add_argument("--chain-length", type=int, default=12, help="--data chains --chains: steps per chain")
    p.add_argument("--out", default=None, help="output directory; an existing one is resumed (problems already "
                   "in its results.jsonl are skipped, after checking the run is the same)")
    p.add_argument("--overwrite", action="store_true", help="start --out afresh instead of resuming it")
    p.add_argument("--names", default="SPRINT,RFT", help="compare: column names of RUN_A,RUN_B")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--samples", type=int, default=1, metavar="K",
                   help="runs per problem, each with its own seed (a hash of --seed, the problem id and the sample "
                        "index); the report gives "
                        "Avg@K with its standard error, pass@k and per-problem means. K > 1 needs "
                        "--temperature > 0 (default 1)")
    p.add_argument("--chat-template", choices=CHAT_TEMPLATE_MODES, default="auto",
                   help="wrap each prompt in the tokenizer's own chat template (apply_chat_template, "
                        "generation prompt added): auto = when the tokenizer has one and the model was not "
                        "trained here (no sprint_jax.json: its prompts are the raw task text); on; off")
    p.add_argument("--instruction", default="", metavar="TEXT|r1-math",
                   help="text added to every problem after a blank line (inside the chat template's user turn), "
                        "e.g. r1-math: the DeepSeek-R1 card's 'Please reason step by step, and put your final answer "
                        "within \\boxed{}.' for a released R1 model (pair with --answer-from auto); default none: "
                        "a model trained here saw the task text alone")
    p.add_argument("--concurrency", type=int, default=8,
                   help="problems run at once on the batched engine (every planner and executor of them "
                        "decodes in one step); 1 = one at a time. results.jsonl does not depend on it "
                        "under greedy decoding (default 8)")
    add_data_arguments(p)
    add_run_arguments(p)


def add_data_arguments(p) -> None:
    """What is graded, the contamination guard, and compare's length bins."""
    from sprint_jax.tasks import EXTRACTION_MODES

    p.add_argument("--answer-from", choices=EXTRACTION_MODES, default="final_answer",
                   help="graded text: the <Final Answer> block, the last \\boxed{}, or auto (block, else box)")
    p.add_argument("--allow-overlap", action="store_true",
                   help="report even when evaluated problems are in the model's training set")
    p.add_argument("--bins", default="2000,4000,8000",
                   help="compare: fixed bins by the baseline's sequential tokens (comma-separated thresholds)")
    p.add_argument("--quantiles", type=int, default=4, help="compare: equal-size bins by baseline length (0 = none)")


def _compare(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.eval.report import (compare, format_compare_table, format_wall_clock, load_results,
                                        wall_clock_summary)

    if len(args.compare) != 3 or args.compare[0] != "compare":
        raise UserError("usage: sprint-jax eval compare RUN_A RUN_B (or eval --model ... --data ... --out ...)")
    names = [n.strip() for n in args.names.split(",")]
    if len(names) != 2 or not all(names):
        raise UserError(f"--names must be two comma-separated names, got {args.names!r}")
    run_a, run_b = args.compare[1:]
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} exists and is not a directory")
    if args.quantiles < 0:
        raise UserError(f"--quantiles must be >= 0, got {args.quantiles}")
    results_a, results_b = load_results(run_a), load_results(run_b)
    table = compare(results_a, results_b, *names, bins=parse_bins(args.bins), quantiles=args.quantiles)
    table["runs"] = [run_a, run_b]
    table["wall_clock"] = {names[0]: wall_clock_summary(run_a, results_a),
                           names[1]: wall_clock_summary(run_b, results_b)}
    print(format_compare_table(table))
    print("\n" + format_wall_clock(names, [table["wall_clock"][n] for n in names]))
    if args.out:
        from sprint_jax.eval.report import BINS_PLOT, SPEEDUP_PLOT, plot_bins, plot_speedups
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(table, indent=2) + "\n")
        plot_bins(table["length_bins"], out / BINS_PLOT, names)
        plot_speedups(table["speedups"], out / SPEEDUP_PLOT, names)
        print(f"\nwritten: {out / 'compare.json'}, {out / BINS_PLOT}, {out / SPEEDUP_PLOT}")
    return 0


def _merge(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.eval.shards import merge_shards

    if not args.out:
        raise UserError("usage: sprint-jax eval merge SHARD_DIR... --out DIR")
    report = merge_shards(args.compare[1:], args.out)
    print(f"merged {len(args.compare) - 1} shards: accuracy {100 * report['accuracy']:.1f}% "
          f"({report['correct']}/{report['n']}) -> {args.out}")
    return 0


def parse_bins(text: str) -> list[int]:
    """--bins "2000,4000,8000" -> [2000, 4000, 8000] ("" = no fixed bins)."""
    from sprint_jax.errors import UserError
    try:
        values = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--bins must be comma-separated token counts, got {text!r}") from None
    if any(v <= 0 for v in values) or values != sorted(set(values)):
        raise UserError(f"--bins must be increasing positive token counts, got {text!r}")
    return values


def mixed_chains_tasks(args) -> list:
    """--data chains --chains MIN-MAX: the first --limit (default 100) problems of
    chains.mixed_test_set; UserError names a bad value."""
    from sprint_jax.errors import UserError
    from sprint_jax.tasks import chains

    if args.data != "chains":
        raise UserError(f"--chains selects a digit-chains test set: it needs --data chains, got --data {args.data}")
    lo, sep, hi = args.chains.partition("-")
    if not (lo.isdigit() and hi.isdigit() and sep) or not 1 <= int(lo) <= int(hi):
        raise UserError(f"--chains must be MIN-MAX with 1 <= MIN <= MAX, e.g. 2-4, got {args.chains!r}")
    if args.chain_length < 1 or (args.limit is not None and args.limit < 1):
        raise UserError(f"--chain-length and --limit must be >= 1, got {args.chain_length}, {args.limit}")
    try:
        return chains.mixed_test_set(100 if args.limit is None else args.limit, args.data_seed, int(lo), int(hi),
                                     args.chain_length)
    except ValueError as e:
        raise UserError(f"--chains {args.chains}: {e}") from None


def check_overlap(model_dir: str | Path, tasks, allow: bool) -> dict:
    """The contamination guard: evaluated problems whose normalised prompt hash is in the model's
    `train_fingerprint` (written by `sprint-jax train` into MODEL/sprint_jax.json). Prints them;
    raises UserError unless `allow`. A model without the file (not trained here) is not checked."""
    from sprint_jax.errors import UserError
    from sprint_jax.tasks import problem_hash, task_prompt
    from sprint_jax.train.fingerprint import read_fingerprint

    trained = read_fingerprint(model_dir)
    if trained is None:
        return {"checked": False, "overlap": 0, "overlap_ids": []}
    hit = [t.id for t in tasks if problem_hash(task_prompt(t)) in trained]
    if hit:
        print(f"contamination guard: {len(hit)} of {len(tasks)} evaluated problems are in the training set "
              f"of {model_dir}:")
        for tid in hit[:50]:
            print(f"  {tid}")
        if len(hit) > 50:
            print(f"  ... and {len(hit) - 50} more")
        if not allow:
            raise UserError(f"{len(hit)} of {len(tasks)} evaluated problems were in {model_dir}'s training data "
                            f"(listed above); evaluate on held-out problems, or pass --allow-overlap to "
                            f"report anyway")
    return {"checked": True, "overlap": len(hit), "overlap_ids": hit}


def model_prompt_fn(model: str, tokenizer=None, chat_template: str = "off", instruction: str = ""):
    """task -> the text the model sees: the task as curation wrote it into training prompts, in
    the prompt format the model's export records (sprint_jax.schema; unchanged for a
    model trained on these prompts, which already end as the format says); or, where
    `uses_chat_template`, that task text as the user turn of the tokenizer's chat template.
    `instruction` (`--instruction`; a name in INSTRUCTIONS or free text) follows the task text
    after a blank line, inside the user turn."""
    from sprint_jax.eval.evaluate import default_prompt
    from sprint_jax.infer.infer_cli import export_meta
    from sprint_jax.schema import apply_prompt_format

    meta = export_meta(model)
    extra = INSTRUCTIONS.get(instruction, instruction).strip()

    def text(task) -> str:
        return f"{default_prompt(task)}\n\n{extra}" if extra else default_prompt(task)
    if uses_chat_template(chat_template, tokenizer, meta, model):
        return lambda task: chat_prompt(tokenizer, text(task))
    return lambda task: apply_prompt_format(text(task), meta)


# --instruction by name: the DeepSeek-R1 model card's "Usage Recommendations" for math problems
INSTRUCTIONS = {"r1-math": "Please reason step by step, and put your final answer within \\boxed{}."}


def uses_chat_template(mode: str, tokenizer, meta: dict, model: str = "the model") -> bool:
    """--chat-template: off never; on always (a tokenizer without a template is a UserError);
    auto when the tokenizer has a template and the model has no sprint_jax.json (`meta` empty: a
    checkpoint not trained here, e.g. a released R1-distill, whose own template is how it was
    trained to be prompted; a model trained here saw the raw task text)."""
    from sprint_jax.errors import UserError

    if mode not in CHAT_TEMPLATE_MODES:
        raise UserError(f"--chat-template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
    has = bool(getattr(tokenizer, "chat_template", None))
    if mode == "on" and not has:
        raise UserError(f"--chat-template on: the tokenizer of {model} has no chat template")
    return mode == "on" or (mode == "auto" and has and not meta)


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as the one user turn of the tokenizer's chat template, with the generation prompt
    (what the assistant's turn starts with; R1-distill's ends in "<think>\n")."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def default_max_seq_len(model: str, config) -> int:
    """eval's context when --max-seq-len is not given: the run's token budget
    (max_total_tokens) plus `PROMPT_ROOM`, at most the model's max_position_embeddings, so the
    budget, not the context, bounds a run."""
    from sprint_jax.model.config import Qwen2Config

    try:
        positions = Qwen2Config.from_hf_config(Path(model)).max_position_embeddings
    except Exception:        # no readable config.json: the loader reports that with its own line
        return config.max_total_tokens + PROMPT_ROOM
    return min(positions, config.max_total_tokens + PROMPT_ROOM)


def _export_meta(model: str) -> dict:
    from sprint_jax.infer.infer_cli import export_meta
    return export_meta(model)


def check_mode_fits_model(model: str, mode: str) -> None:
    """A model whose sprint_jax.json records that it was trained on serial traces only (every
    example's shape has no plan: an RFT model, or ThreadWeaver's sequential baseline) never writes
    the plans --mode parallel / serial run on, and would score ~0: a UserError naming --mode
    sequential. A model without that record is not checked."""
    from sprint_jax.caps import SHAPE_KEY
    from sprint_jax.errors import UserError
    from sprint_jax.model.hf import EXPORT_META_FILE

    shape = _export_meta(model).get(SHAPE_KEY)
    if mode == "sequential" or not isinstance(shape, dict) or not isinstance(shape.get("stages"), dict):
        return
    n = shape.get("examples")
    if isinstance(n, int) and n > 0 and shape["stages"].get("max") == 0:
        raise UserError(f"--model {model} is a sequential model: none of its {n} training examples has a plan "
                        f"({EXPORT_META_FILE}: {SHAPE_KEY}), so --mode {mode} would wait for plans it never writes; "
                        f"evaluate it with --mode sequential")


def run(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.eval.evaluate import evaluate
    from sprint_jax.infer.infer_cli import build_engine, config_from_args

    if args.compare and args.compare[0] == "merge":
        return _merge(args)
    if args.compare:
        return _compare(args)
    for flag, value in (("--model", args.model), ("--data", args.data), ("--out", args.out)):
        if not value:
            raise UserError(f"{flag} is required (or use `sprint-jax eval compare RUN_A RUN_B`)")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out} exists and is not a directory")
    config = config_from_args(args)
    check_mode_fits_model(args.model, args.mode)
    if args.samples < 1:
        raise UserError(f"--samples must be >= 1, got {args.samples}")
    if args.samples > 1 and config.temperature == 0:
        raise UserError(f"--samples {args.samples} under greedy decoding (temperature 0) gives {args.samples} "
                        f"identical runs; set --temperature (e.g. 0.6 with --top-p 0.95, or --config "
                        f"configs/eval_r1_distill_7b.yaml)")
    if args.max_seq_len is None and Path(args.model).is_dir():
        args.max_seq_len = default_max_seq_len(args.model, config)
    if args.chains is not None:
        tasks = mixed_chains_tasks(args)
    else:
        tasks = load_tasks(args.data, args.limit, args.task_kind, args.countdown_n, args.data_seed)
    if not tasks:
        raise UserError(f"--data {args.data}: no tasks")
    shard = None
    if args.shard:
        from sprint_jax.eval.shards import parse_shard, shard_meta
        index, count = parse_shard(args.shard)
        shard = shard_meta(len(tasks), index, count)
        tasks = [tasks[i] for i in shard["positions"]]
        if not tasks:
            raise UserError(f"--shard {args.shard}: no problems in this shard ({shard['total']} in all)")
    overlap = check_overlap(args.model, tasks, args.allow_overlap)
    # plain decoding never forks: its engine holds one branch per slot, whatever max_prompts says
    # (the KV cache of a 7B sequential eval at a 32k budget: 8x smaller than with 8 branches)
    sizing = dataclasses.replace(config, max_prompts=1) if args.mode == "sequential" else config
    engine = build_engine(args, sizing, args.concurrency)
    prompt_fn = model_prompt_fn(args.model, engine.tokenizer, args.chat_template, args.instruction)
    templated = uses_chat_template(args.chat_template, engine.tokenizer, _export_meta(args.model), args.model)
    for task in tasks:   # a tokenizer that cannot read the data is a setup mistake, caught up front
        try:
            engine.encode(prompt_fn(task))
        except ValueError as e:
            raise UserError(f"task {task.id}: the tokenizer cannot encode its prompt ({e})") from None
    _, report = evaluate(engine, tasks, args.mode, prompt_fn=prompt_fn, orchestrator_config=config, out_dir=args.out,
                         progress=not args.no_progress, answer_from=args.answer_from, overwrite=args.overwrite,
                         concurrency=args.concurrency, samples=args.samples,
                         meta={"model": str(args.model), "data": str(args.data), "limit": args.limit,
                               "chat_template": templated, "instruction": args.instruction,
                               "max_seq_len": engine.max_seq_len,
                               "train_overlap": overlap, **({"shard": shard} if shard else {})})
    wall = report["wall_clock_s"]
    problems = report["samples"]["problems"]
    on_disk = report.get("problems_in_out", problems)
    runs = " runs" if args.samples > 1 else ""
    print(f"over the {problems} problem(s)" + (f" x {args.samples} samples" if runs else "") + " asked for"
          + (f" ({on_disk} in {Path(args.out) / 'results.jsonl'})" if on_disk != problems else "")
          + (f", {report['resumed_problems']}{runs} of them finished earlier" if report.get("resumed_problems") else "")
          + f": accuracy {100 * report['accuracy']:.1f}% ({report['correct']}/{report['n']}{runs}), "
          f"sequential tokens {report['mean_sequential_tokens']:.1f}, total tokens "
          f"{report['mean_total_tokens']:.1f}, format-valid {100 * report['format_valid_rate']:.1f}%, "
          f"wall clock {'n/a' if wall is None else f'{wall:.1f} s'} without XLA compilation "
          f"(this run compiled for {report['compile_s']:.1f} s, timed apart) -> {args.out}")
    samples = report["samples"]
    se = samples["avg_at_k_se"]
    print(f"Avg@{args.samples}: {100 * samples['avg_at_k']:.1f}%"
          + ("" if se is None else f" ± {100 * se:.1f} (standard error over {samples['problems']} problems)")
          + ", pass@k " + ", ".join(f"{k}: {100 * v:.1f}%" for k, v in samples["pass_at_k"].items())
          + f"; outcomes {report['outcomes']} (context_full: cut by the context or the token budget; "
          f"capped: cut by max_stages or max_prompts; neither is a graded wrong answer)")
    pool = report.get("engine_pool")
    if pool:
        print(f"KV pool: {pool['pages_total']} pages of {pool['page_size']} tokens; of this run's "
              f"{pool['prompt_tokens']} prompt tokens {pool['prefix_hit_tokens']} came from the prefix cache and "
              f"{pool['prompt_tokens_prefilled']} were prefilled; {pool['evicted_pages']} cached pages evicted")
    if report["grader_errors"]:
        print(f"grader errors: {report['grader_errors']} problem(s) could not be graded and count as wrong "
              f"(ids in report.json grader_error_ids; messages in results.jsonl grader_error)")
    return 0
