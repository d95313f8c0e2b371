"""`sprint-jax bench decode`: branch-batched decoding (shared / copy / serial) and HF `generate`.

Why. A SPRINT stage (paper §10) runs its executors at the same time: the engine forks the
planner's cache and decodes every branch in one batched step. This benchmark measures, in one
run, what that buys:
  shared   `decode_branches(mode="shared")`: the engine's fork: the prefix's full pages of the KV
           pool held once and read in place once per step for all branches; each branch its own
           pages (its copy of the partly filled page, its tokens),
  copy     the prefix copied into every branch (the baseline to beat: `bench/copy_fork.py`),
  serial   the same fork, one branch after another (what a non-parallel runtime does),
for each branch count and context (prefix) length, plus single-sequence `engine.generate` vs
HF transformers `generate` (PyTorch, `Qwen2ForCausalLM` or `Qwen3ForCausalLM`, eager attention)
on the same weights, the peer a user would otherwise pick.

How it is timed. Every branch decodes exactly --new-tokens tokens: the engine runs with
eos_token_ids=[] and no stop strings, and sampling is greedy. Each point is called once with
N = --new-tokens and once with N = 1 (same compiled shapes); both calls pay the same fork,
branch-prefix prefill and host set-up, so
    step_ms = (wall(N) - wall(1)) / (steps(N) - steps(1))      (steps from last_branch_stats)
is the cost of one decode step with that overhead subtracted (a batched step advances every
branch by one token; a serial step advances one branch). tokens/s = branches x 1000 / step_ms
for batched modes and 1000 / step_ms for serial. stage_ms = wall(N), the whole
`decode_branches` call (fork + branch-prefix prefill + N steps): the stage latency the
orchestrator sees. Each point is called once untimed first (compile; reported as compile_s =
first-call wall minus the best steady wall), then --repeats times with every branch count and
mode of one context length interleaved, so a change of machine load hits them alike. The best
(minimum) of the repeats is reported: on a machine shared with other work, load only ever adds
time; every sample is kept in the JSON. A step time that noise swamps (wall(N) <= wall(1)) is reported as
null rather than as a made-up number.
The HF row times prompt -> N new tokens end to end (engine: prefill + generate; HF: generate;
engine and HF calls interleaved, best of --hf-repeats) and, by the same N vs 1 difference, the
decode step alone; it also counts how many leading greedy tokens the two stacks agree on.

cache_bytes: shared / serial: the pages the fork holds (`single.fork_bytes`: the context's written
tokens in whole pages, once, and each branch's own pages through the last decode call's
reservation); copy: per branch, the copied prefix (its used length in the slot engine's read bucket,
min 64, capped at the sequence's capacity) + the branch's suffix capacity.

Paged vs slot step (`sprint_jax.bench.paged_step`): one decode step of the paged engine's program
vs the slot engine's it replaced (kept as the baseline), at the same used length, for a fork of
each branch count and a generate row (the planner) per context length, with the bytes each
reads per step (prefix once per group + each branch's own), best of --step-repeats, wall clock
and process CPU time.

Ratios (same run): shared/copy step time, stage time and cache bytes; batched vs serial stage
speed-up (serial stage_ms / batched stage_ms) and decode tokens/s ratio; step at n branches vs
one branch; engine vs HF tokens/s. A "targets" section says which of its CPU targets
were met, with the figures.

Models.
  default      `bench-tiny`: a random Qwen2 (hidden 256, 4 layers, 8 heads, 2 KV heads, head dim
               32, SwiGLU 768, vocab 1024, untied; 3.5M parameters): big enough that a step
               is real work on a CPU, small enough for the whole --quick run in under 5 minutes.
  --preset X   any configs/model_X.json (e.g. tiny, r1-distill-qwen-7b, qwen3-8b) with random weights
               (`init_params`, std 0.02) in --dtype; HF gets the same weights via `save_params`.
  --model DIR  a local HF checkpoint directory (both engines load it).
Token ids are what is timed; the engine gets a synthetic vocabulary tokenizer (one entry per
id), so random weights can emit any id and text decoding stays negligible.

Capacities (documented because attention cost follows them): per context length P the engine
is built with max_seq_len = P + branch prefix + N, max_branch_tokens = branch prefix + 1 + N,
so no mode reads past what it can use; the JSON records the resulting capacities and the pool
(page size, pages).

Defaults: CPU full = branches 1,2,4,8,16 x contexts 128,512,2048 x 64 new tokens, 3 repeats,
decode_chunk 32; CPU --quick = branches 1,8 x contexts 128,1024 x 32 new tokens, 2 repeats.
On an accelerator: contexts 1024,4096,16384 (quick 1024,8192), 128 new tokens, decode_chunk 64,
bf16; the HF row is off there unless --hf on (it needs a torch build for that device).

Run:
    sprint-jax bench decode --quick --out bench_decode.json           # CPU, < 5 minutes
    sprint-jax bench decode --out bench_decode.json                   # full CPU sweep
    sprint-jax bench decode --preset r1-distill-qwen-7b               # GPU/TPU, random 7B, bf16
    sprint-jax bench decode --preset r1-distill-qwen-7b --attention-impl pallas
    python -m sprint_jax.bench.decode ...                              # same, without the CLI
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from sprint_jax.bench import paged_step
from sprint_jax.dtypes import DTYPE_NAMES, dtype_of, torch_dtype

DESCRIPTION = __doc__

# The default CPU model: hidden 256, 4 layers, 8 heads / 2 KV heads (grouped-query like the 7B).
BENCH_TINY: dict[str, Any] = dict(
    vocab_size=1024,             # small vocabulary: the lm_head stays a minor cost
    hidden_size=256,             # width E
    intermediate_size=768,       # SwiGLU inner width (3 x E)
    num_hidden_layers=4,         # decoder layers
    num_attention_heads=8,       # query heads (head_dim 32)
    num_key_value_heads=2,       # KV heads: 4 query heads per KV head, as in Qwen2-7B (28/4 = 7)
    max_position_embeddings=32768,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
BENCH_TINY_NAME = "bench-tiny"

MODES = ("shared", "copy", "serial")

# (backend is an accelerator, --quick) -> defaults of the unset flags
DEFAULTS: dict[tuple[bool, bool], dict[str, Any]] = {
    (False, False): dict(branches="1,2,4,8,16", prefix_lens="128,512,2048", new_tokens=64, repeats=3,
                         decode_chunk=32, prefill_chunk=64, branch_prefix_len=4, join_tokens="64,512,2048",
                         step_repeats=7),
    (False, True): dict(branches="1,8", prefix_lens="128,1024", new_tokens=32, repeats=2,
                        decode_chunk=32, prefill_chunk=64, branch_prefix_len=4, join_tokens="64,512",
                        step_repeats=5),
    (True, False): dict(branches="1,2,4,8,16", prefix_lens="1024,4096,16384", new_tokens=128, repeats=3,
                        decode_chunk=64, prefill_chunk=512, branch_prefix_len=4, join_tokens="64,512,2048",
                        step_repeats=7),
    (True, True): dict(branches="1,8", prefix_lens="1024,8192", new_tokens=64, repeats=2,
                       decode_chunk=64, prefill_chunk=512, branch_prefix_len=4, join_tokens="64,512,2048",
                       step_repeats=5),
}
JOIN_EXECUTORS = 8        # executors per stage in the join rows
JOIN_CONTEXT = 128        # planner tokens before the fork in the join rows
JOIN_PREFILL_CHUNK = 512  # the join rows' engine prefill chunk (the re-prefill runs in such chunks)
# Above this many parameters a CPU run is refused (hours of random init and decoding).
CPU_PARAM_LIMIT = 1_000_000_000


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `sprint-jax bench decode`; unset ones take the --quick / full defaults."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="a local HF Qwen2 or Qwen3 checkpoint directory")
    src.add_argument("--preset", help=f"random weights for a model preset: {BENCH_TINY_NAME} (default) "
                                      "or a configs/model_NAME.json, e.g. tiny, r1-distill-qwen-7b, qwen3-8b")
    parser.add_argument("--quick", action="store_true",
                        help="branches 1,8 and two context lengths (CPU: under 5 minutes)")
    parser.add_argument("--out", metavar="FILE.json", help="write the results here as JSON")
    parser.add_argument("--branches", help="comma-separated branch counts (default 1,2,4,8,16)")
    parser.add_argument("--prefix-lens", help="comma-separated context (shared prefix) lengths in tokens "
                                              "(default CPU 128,512,2048; accelerator 1024,4096,16384)")
    parser.add_argument("--new-tokens", type=int,
                        help="tokens each branch decodes (default CPU 64, accelerator 128)")
    parser.add_argument("--branch-prefix-len", type=int,
                        help="forced tokens per branch before it decodes, like `<execution_k.j>` (default 4)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES,
                        help="parameter and compute dtype (activations, KV cache); default float32 on CPU, "
                             "bfloat16 on an accelerator")
    parser.add_argument("--repeats", type=int, help="timed calls per point, best reported (default 3)")
    parser.add_argument("--step-repeats", type=int,
                        help="timed calls per point of the paged vs slot step section, best reported "
                             "(default 7, --quick 5)")
    parser.add_argument("--decode-chunk", type=int,
                        help="decode steps per host round trip (default CPU 32, accelerator 64)")
    parser.add_argument("--prefill-chunk", type=int,
                        help="engine prefill piece; also the slack of every cache "
                             "(default CPU 64, accelerator 512)")
    parser.add_argument("--attention-impl", choices=("xla", "pallas"), default="xla",
                        help="shared-prefix attention of the engine (pallas: the sprint_jax.kernels kernel; "
                             "on CPU it runs in interpret mode and its timings are not meaningful)")
    parser.add_argument("--hf", choices=("auto", "on", "off"), default="auto",
                        help="the HF transformers generate row: auto = on for CPU runs only")
    parser.add_argument("--hf-repeats", type=int, default=5,
                        help="timed calls per HF-row point, best reported (default 5: torch's CPU threads "
                             "stall badly when other processes hold the cores, so it needs more tries)")
    parser.add_argument("--hf-threads", type=int,
                        help="torch CPU threads for the HF row (default 1 on CPU, where it is torch's best "
                             "setting for small models; 0 = torch's own default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    parser.add_argument("--join-tokens",
                        help="join rows: comma-separated tokens per executor, 8 executors each "
                             "(default 64,512,2048; CPU --quick 64,512); 'off' skips the join rows")
    parser.add_argument("--join-executors", type=int, default=JOIN_EXECUTORS,
                        help=f"executors per stage in the join rows (default {JOIN_EXECUTORS}; the demo's "
                             "stages: 4 x ~14 tokens, e.g. --join-executors 4 --join-tokens 14 --join-context 64)")
    parser.add_argument("--join-context", type=int, default=JOIN_CONTEXT,
                        help=f"planner tokens before the fork in the join rows (default {JOIN_CONTEXT})")


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
def _user_error(message: str) -> Exception:
    from sprint_jax.errors import UserError
    return UserError(message)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise _user_error(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise _user_error(f"{flag} needs at least one value and every value >= 1, got {text!r}")
    return sorted(set(values))


def _settings(args: argparse.Namespace, on_accel: bool) -> dict[str, Any]:
    """Flags resolved against the defaults, validated with one-line errors."""
    base = DEFAULTS[(on_accel, bool(args.quick))]
    s = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    s["branches"] = _int_list(s["branches"], "--branches")
    s["join_tokens"] = [] if str(s["join_tokens"]) == "off" else _int_list(s["join_tokens"], "--join-tokens")
    s["prefix_lens"] = _int_list(s["prefix_lens"], "--prefix-lens")
    s["hf_repeats"] = args.hf_repeats
    s["join_executors"], s["join_context"] = args.join_executors, args.join_context
    if s["join_executors"] < 1 or s["join_context"] < 1:
        raise _user_error(f"--join-executors and --join-context must be >= 1, got {s['join_executors']} and "
                          f"{s['join_context']}")
    s["hf_threads"] = args.hf_threads if args.hf_threads is not None else (0 if on_accel else 1)
    if s["hf_threads"] < 0:
        raise _user_error(f"--hf-threads must be >= 0, got {s['hf_threads']}")
    for name in ("new_tokens", "repeats", "decode_chunk", "prefill_chunk", "hf_repeats", "step_repeats"):
        if s[name] < 1:
            raise _user_error(f"--{name.replace('_', '-')} must be >= 1, got {s[name]}")
    if s["new_tokens"] < 2:
        raise _user_error(f"--new-tokens must be >= 2 (the step time is wall(N) - wall(1)), got {s['new_tokens']}")
    if s["branch_prefix_len"] < 1:
        raise _user_error(f"--branch-prefix-len must be >= 1, got {s['branch_prefix_len']}")
    s["dtype"] = args.dtype or ("bfloat16" if on_accel else "float32")
    s["hf"] = args.hf == "on" or (args.hf == "auto" and not on_accel)
    s["seed"] = args.seed
    s["attention_impl"] = args.attention_impl
    return s


# ---------------------------------------------------------------------------------------------
# model, tokenizer, HF peer
# ---------------------------------------------------------------------------------------------
def synthetic_tokenizer(vocab_size: int):
    """One vocabulary entry per id: any id a random model emits decodes, at negligible cost."""
    from sprint_jax.model.tokenizer import VocabTokenizer
    vocab = ["<pad>", "<eos>"] + [f"<t{i}>" for i in range(2, vocab_size)]
    return VocabTokenizer(vocab, eos_token="<eos>", pad_token="<pad>")


def _load_model(args: argparse.Namespace, s: dict[str, Any], on_accel: bool, workdir: Path):
    """(Qwen2 model, description dict, HF directory holding the same weights or None)."""
    import jax

    from sprint_jax.model import (CheckpointError, Qwen2, Qwen2Config, from_pretrained, init_params,
                                  param_count, save_params)

    dt = s["dtype"]
    if args.model:
        path = Path(args.model)
        if not path.is_dir():
            raise _user_error(f"--model {args.model}: not a directory")
        config = Qwen2Config.from_hf_config(path, param_dtype=dt, dtype=dt)
        source: dict[str, Any] = dict(kind="checkpoint", path=str(path))
    else:
        name = args.preset or BENCH_TINY_NAME
        if name == BENCH_TINY_NAME:
            config = Qwen2Config(**BENCH_TINY, param_dtype=dt, dtype=dt)
        else:
            config = Qwen2Config.preset(name, param_dtype=dt, dtype=dt)
        source = dict(kind="preset", name=name, init="random normal(0.02), zero biases, unit norms",
                      seed=s["seed"])
    n_params = param_count(config)
    if not on_accel and n_params > CPU_PARAM_LIMIT:
        raise _user_error(f"{source.get('name', source.get('path'))} has {n_params / 1e9:.1f}B parameters: "
                          "too big for a CPU run; use an accelerator, or the default bench-tiny model")
    if args.model:
        try:
            model = from_pretrained(path, config=config)
        except CheckpointError as e:
            raise _user_error(f"--model {args.model}: {e}") from None
        hf_dir = path if s["hf"] else None
    else:
        params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(s["seed"]))
        model = Qwen2(config, params=params)
        hf_dir = None
        if s["hf"]:
            hf_dir = workdir / "hf_checkpoint"
            save_params(config, params, hf_dir)
    source.update(param_count=n_params, config=dataclasses.asdict(config))
    return model, source, hf_dir


@contextlib.contextmanager
def _torch_threads(threads: int):
    """torch intra-op threads for the HF row, restored afterwards (0 = leave torch's default).

    On CPU the bench default is 1: measured on the 2-core machine with bench-tiny, 1 thread is
    as fast as 2 when the machine is quiet, and 2 threads run 20-50x slower whenever another
    process holds a core (every op waits at a thread barrier).
    """
    import torch
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _load_hf(hf_dir: Path, dtype: str):
    """The HF peer on the same weights: the family's HF class (Qwen2ForCausalLM / Qwen3ForCausalLM)
    with eager attention, on torch's device.

    (torch's intra-op thread count is set by the caller: see `_torch_threads`.)
    """
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from sprint_jax.model import Qwen2Config


    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdt = torch_dtype(dtype)
    hf_logging.disable_progress_bar()
    hf_class = getattr(transformers, Qwen2Config.from_hf_config(hf_dir).family.architecture)
    hf = hf_class.from_pretrained(hf_dir, attn_implementation="eager", dtype=tdt).to(device).eval()
    return hf, device


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------
def _best(xs: list[float]) -> float:
    """Best of the repeats: on a shared machine other load only ever adds time."""
    return float(min(xs))


def _step_seconds(wall_n: float, wall_1: float, extra_steps: int) -> float | None:
    """Seconds per decode step from the N-token and 1-token calls; None when noise swamps it."""
    d = (wall_n - wall_1) / extra_steps
    return d if d > 0 else None


def kv_bytes_per_token(config) -> int:
    """K and V bytes one token occupies across all layers (the unit of every cache figure)."""
    itemsize = np.dtype(dtype_of(config.dtype)).itemsize
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize


def _make_engine(model, tokenizer, p: int, s: dict[str, Any]):
    """A one-sequence engine sized for context p, driven by single-run calls."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.single import SingleRun
    bp, n_new = s["branch_prefix_len"], s["new_tokens"]
    return SingleRun(Engine(model, tokenizer, max_seqs=1, max_seq_len=p + bp + n_new, max_children=max(s["branches"]),
                            max_branch_tokens=bp + 1 + n_new, decode_chunk=s["decode_chunk"],
                            prefill_chunk=s["prefill_chunk"], attention_impl=s["attention_impl"], eos_token_ids=[]))


def _bench_context(engine, state, prefix_sets: dict[int, list[list[int]]],
                   s: dict[str, Any]) -> dict[int, dict[str, dict]]:
    """Rows for every (branch count, mode) at one context length.

    Every point is first called untimed (compile), then each repeat runs all branch counts and
    all modes in turn, so load drift on a shared machine hits every point alike and the
    same-run ratios (n branches vs one, shared vs copy vs serial) compare like with like.
    """
    n_new = s["new_tokens"]

    from sprint_jax.bench.copy_fork import decode_branches_copy

    def call(n: int, mode: str, m: int):
        if mode == "copy":
            decode_branches_copy(engine, state, prefix_sets[n], m)
        else:
            engine.decode_branches(state, prefix_sets[n], m, mode=mode)
        return engine.last_branch_stats

    keys = [(n, mode, m) for n in prefix_sets for mode in MODES for m in (n_new, 1)]
    first = {k: call(*k).wall_s for k in keys}
    runs: dict[tuple[int, str, int], list] = {k: [] for k in keys}
    for _ in range(s["repeats"]):
        for k in keys:
            runs[k].append(call(*k))
    out: dict[int, dict[str, dict]] = {}
    for n in prefix_sets:
        out[n] = {}
        for mode in MODES:
            long, short = runs[(n, mode, n_new)], runs[(n, mode, 1)]
            wall_n, wall_1 = _best([r.wall_s for r in long]), _best([r.wall_s for r in short])
            steps_n, steps_1 = long[0].steps, short[0].steps
            step_s = _step_seconds(wall_n, wall_1, steps_n - steps_1)
            out[n][mode] = dict(
                mode=mode, branches=n, step_ms=None if step_s is None else step_s * 1e3,
                tokens_per_s=None if step_s is None else (1 if mode == "serial" else n) / step_s,
                stage_ms=wall_n * 1e3, one_token_stage_ms=wall_1 * 1e3,
                steps=steps_n, cache_bytes=long[0].cache_bytes,
                compile_s=(max(0.0, first[(n, mode, n_new)] - wall_n)
                           + max(0.0, first[(n, mode, 1)] - wall_1)),
                stage_ms_samples=[r.wall_s * 1e3 for r in long],
                one_token_stage_ms_samples=[r.wall_s * 1e3 for r in short])
    return out


def _ratios(p: int, n: int, rows: dict[str, dict], one: dict[str, dict] | None) -> dict[str, Any]:
    """The same-run comparisons at one point (one = the n=1 rows at this context, if measured)."""
    sh, cp, se = rows["shared"], rows["copy"], rows["serial"]

    def div(a, b):
        return a / b if (a is not None and b) else None

    return dict(
        prefix_len=p, branches=n,
        shared_over_copy_step=div(sh["step_ms"], cp["step_ms"]),
        shared_over_copy_stage=div(sh["stage_ms"], cp["stage_ms"]),
        shared_over_copy_bytes=div(sh["cache_bytes"], cp["cache_bytes"]),
        shared_speedup_vs_serial_stage=div(se["stage_ms"], sh["stage_ms"]),
        copy_speedup_vs_serial_stage=div(se["stage_ms"], cp["stage_ms"]),
        shared_over_serial_tokens_per_s=div(sh["tokens_per_s"], se["tokens_per_s"]),
        shared_step_vs_one_branch=div(sh["step_ms"], one["shared"]["step_ms"]) if one else None,
        copy_step_vs_one_branch=div(cp["step_ms"], one["copy"]["step_ms"]) if one else None,
    )


def _bench_hf(engine, hf, device: str, context: list[int], s: dict[str, Any]) -> dict[str, Any]:
    """Single sequence, prompt -> N greedy tokens: engine (prefill + generate) vs HF generate."""
    import torch

    n_new = s["new_tokens"]
    ids = torch.tensor([context], device=device)
    mask = torch.ones_like(ids)

    def run_engine(m: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        g = engine.generate(engine.prefill(context), m)
        return time.perf_counter() - t0, g.tokens

    def run_hf(m: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, [int(t) for t in out[0, len(context):].tolist()]

    first = {}
    for name, fn in (("engine", run_engine), ("hf", run_hf)):
        for m in (n_new, 1):
            first[(name, m)] = fn(m)[0]
    times: dict[tuple[str, int], list[float]] = {}
    toks: dict[str, list[int]] = {}
    for _ in range(s["hf_repeats"]):
        for name, fn in (("engine", run_engine), ("hf", run_hf)):
            for m in (n_new, 1):
                dt, t = fn(m)
                times.setdefault((name, m), []).append(dt)
                if m == n_new:
                    toks[name] = t
    out: dict[str, Any] = dict(prefix_len=len(context), new_tokens=n_new, hf_device=device,
                               hf_torch_threads=torch.get_num_threads(),
                               engine_e2e_ms_samples=[t * 1e3 for t in times[("engine", n_new)]],
                               hf_e2e_ms_samples=[t * 1e3 for t in times[("hf", n_new)]])
    for name in ("engine", "hf"):
        wall_n, wall_1 = _best(times[(name, n_new)]), _best(times[(name, 1)])
        step_s = _step_seconds(wall_n, wall_1, n_new - 1)
        out[f"{name}_e2e_ms"] = wall_n * 1e3
        out[f"{name}_e2e_tokens_per_s"] = n_new / wall_n
        out[f"{name}_step_ms"] = None if step_s is None else step_s * 1e3
        out[f"{name}_decode_tokens_per_s"] = None if step_s is None else 1.0 / step_s
        out[f"{name}_first_token_ms"] = wall_1 * 1e3
        out[f"{name}_warmup_s"] = first[(name, n_new)] + first[(name, 1)]
        out[f"{name}_tokens_generated"] = len(toks[name])
    out["engine_over_hf_e2e_tokens_per_s"] = out["engine_e2e_tokens_per_s"] / out["hf_e2e_tokens_per_s"]
    out["engine_over_hf_decode_tokens_per_s"] = (
        out["engine_decode_tokens_per_s"] / out["hf_decode_tokens_per_s"]
        if out["engine_decode_tokens_per_s"] and out["hf_decode_tokens_per_s"] else None)
    agree = 0
    for a, b in zip(toks["engine"], toks["hf"]):
        if a != b:
            break
        agree += 1
    out["greedy_tokens_agree"] = agree  # leading tokens identical: the same weights and numerics
    return out


# ---------------------------------------------------------------------------------------------
# targets (the CPU targets, tiny model)
# ---------------------------------------------------------------------------------------------
def bench_join(model, tokenizer, s: dict[str, Any], rng) -> list[dict[str, Any]]:
    """Re-prefill vs merge join, per stage: --join-executors executors of N tokens each
    forked from a --join-context-token planner, on the engine (`Engine`: what the
    orchestrator's demo, eval and server run), timed from the join's call until the cache holds its
    result (block_until_ready). reprefill = `extend` of all executors' tokens onto the planner,
    then the steps that write them (what the sync of a trie model costs: an extend only queues its
    tokens); merge = `merge` of the fork, as in the orchestrator: each executor was forced its
    first N-1 tokens and generated its last (the close tag) in a join fork (`fork(join=True)`),
    which ran that token too, so the merge is the copy of the KV rows alone (merge_tokens_run 0).
    The executors' decode is timed apart (`fork_ms`, best: a plain fork before re-prefill, the join
    fork, whose feed step is its cost of the merge's empty tails, before merge). Timed calls alternate
    (A B A B); best of --repeats is reported, with the process CPU time of the same call (`cpu_ms`:
    XLA's threads included; it moves less with machine load than wall clock)."""
    import jax

    from sprint_jax.infer.engine import Engine

    rows = []
    config = model.config
    k, ctx = s["join_executors"], s["join_context"]
    for n in s["join_tokens"]:
        engine = Engine(model, tokenizer, max_seqs=1, max_children=k, max_seq_len=ctx + k * n + 8,
                        max_branch_tokens=n + 2, decode_chunk=s["decode_chunk"],
                        prefill_chunk=JOIN_PREFILL_CHUNK, eos_token_ids=[])
        context = [int(x) for x in rng.integers(0, config.vocab_size, ctx)]
        forced = [[int(x) for x in rng.integers(0, config.vocab_size, n - 1)] for _ in range(k)]
        ran = {}

        def timed(fn) -> tuple[float, float]:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            jax.block_until_ready(engine.cache)
            return time.perf_counter() - t0, time.process_time() - c0

        def planner_and_fork(join: bool):
            """The planner, its executors (forced N-1 tokens, one generated: a plain fork for
            re-prefill, a join fork for merge), their final tokens, the fork's (wall, cpu)."""
            seq = engine.open(context).seq
            engine.run()
            jax.block_until_ready(engine.cache)
            op = engine.fork(seq, forced, 1, join=join)
            dt = timed(lambda: engine.run([op]))
            return seq, [f + g.tokens for f, g in zip(forced, op.result)], dt

        def reprefill() -> tuple[tuple[float, float], tuple[float, float]]:
            seq, branches, fork_dt = planner_and_fork(False)
            dt = timed(lambda: (engine.extend(seq, [t for b in branches for t in b]), engine.run()))
            engine.close(seq)
            return dt, fork_dt

        def merge() -> tuple[tuple[float, float], tuple[float, float]]:
            seq, branches, fork_dt = planner_and_fork(True)
            host = []

            def join():
                t0 = time.perf_counter()
                engine.merge(seq, branches)         # the orchestrator's sync (the copy dispatched)
                host.append(time.perf_counter() - t0)
            dt = timed(join)
            hosts.append(host[0])
            ran["merge"] = engine.last_join_tokens
            engine.close(seq)
            return dt, fork_dt

        hosts: list[float] = []
        first = {"reprefill": reprefill()[0][0], "merge": merge()[0][0]}
        hosts.clear()
        samples: dict[str, list[tuple[float, float]]] = {"reprefill": [], "merge": []}
        forks: dict[str, list[float]] = {"reprefill": [], "merge": []}
        for _ in range(s["repeats"]):
            for m, fn in (("reprefill", reprefill), ("merge", merge)):
                dt, fork_dt = fn()
                samples[m].append(dt)
                forks[m].append(fork_dt[0])
        best = {m: _best([w for w, _ in v]) for m, v in samples.items()}
        cpu = {m: min(c for _, c in v) for m, v in samples.items()}
        row = dict(executors=k, tokens_per_executor=n, context=ctx, engine="Engine",
                   reprefill_ms=best["reprefill"] * 1e3, merge_ms=best["merge"] * 1e3,
                   merge_over_reprefill=best["merge"] / best["reprefill"],
                   reprefill_cpu_ms=cpu["reprefill"] * 1e3, merge_cpu_ms=cpu["merge"] * 1e3,
                   merge_over_reprefill_cpu=cpu["merge"] / max(cpu["reprefill"], 1e-9),
                   reprefill_tokens=k * n, merge_tokens_run=ran["merge"],
                   compile_s={m: max(first[m] - best[m], 0.0) for m in first},
                   samples_ms={m: [w * 1e3 for w, _ in v] for m, v in samples.items()},
                   samples_cpu_ms={m: [c * 1e3 for _, c in v] for m, v in samples.items()},
                   fork_ms={m: _best(v) * 1e3 for m, v in forks.items()},
                   # merge's host side alone (the copy is dispatched, not waited for)
                   merge_host_ms=_best(hosts) * 1e3, samples_merge_host_ms=[h * 1e3 for h in hosts])
        rows.append(row)
        _print_join(row)
        engine = None  # frees the cache before the next size
    return rows


JOIN_HEADER = (f"{'exec':>4} {'N':>5} {'reprefill_ms':>12} {'merge_ms':>9} {'merge/reprefill':>15} "
               f"{'cpu ratio':>9} {'tokens run (re/merge)':>21}")


def _print_join(r: dict) -> None:
    print(f"{r['executors']:>4} {r['tokens_per_executor']:>5} {r['reprefill_ms']:>12.1f} {r['merge_ms']:>9.2f} "
          f"{r['merge_over_reprefill']:>15.3f} {r['merge_over_reprefill_cpu']:>9.3f} "
          f"{str(r['reprefill_tokens']) + ' / ' + str(r['merge_tokens_run']):>21}", flush=True)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


PAGED_OVER_SLOT_MAX = 1.15   # a paged decode step may cost this much of the slot engine's


def evaluate_targets(ratios: list[dict], hf_rows: list[dict], join_rows: list[dict] = (),
                     step_rows: list[dict] = ()) -> list[dict[str, Any]]:
    """Each target: met True/False (None = not measured in this run) and the figures behind it."""
    by = {(r["prefix_len"], r["branches"]): r for r in ratios}
    lens = sorted({r["prefix_len"] for r in ratios})
    targets = []

    at8 = [by[(p, 8)] for p in lens if (p, 8) in by and by[(p, 8)]["shared_step_vs_one_branch"] is not None]
    targets.append(dict(
        name="shared step at 8 branches <= 2x one-branch step",
        met=(all(r["shared_step_vs_one_branch"] <= 2.0 for r in at8) if at8 else None),
        figures={f"P={r['prefix_len']}": round(r["shared_step_vs_one_branch"], 3) for r in at8},
        detail=("shared step_ms(8) / step_ms(1) at each context length" if at8
                else "needs --branches with 1 and 8")))

    longest = [by[(lens[-1], n)] for n in sorted({r["branches"] for r in ratios}) if n >= 2
               and (lens[-1], n) in by] if lens else []
    targets.append(dict(
        name="shared beats copy at the longest prefix (time and bytes)",
        met=(all(r["shared_over_copy_step"] is not None and r["shared_over_copy_step"] < 1
                 and r["shared_over_copy_bytes"] < 1 for r in longest) if longest else None),
        figures={f"P={r['prefix_len']},n={r['branches']}": dict(
            step=round(r["shared_over_copy_step"], 3) if r["shared_over_copy_step"] is not None else None,
            stage=round(r["shared_over_copy_stage"], 3), bytes=round(r["shared_over_copy_bytes"], 3))
            for r in longest},
        detail="shared/copy ratios (< 1 = shared better) for every branch count >= 2" if longest
        else "needs a branch count >= 2"))

    vs_serial = [by[(p, 8)] for p in lens if (p, 8) in by]
    targets.append(dict(
        name="batched (shared) beats serial by >= 3x at 8 branches",
        met=(all(r["shared_speedup_vs_serial_stage"] >= 3.0 for r in vs_serial) if vs_serial else None),
        figures={f"P={r['prefix_len']}": dict(
            stage=round(r["shared_speedup_vs_serial_stage"], 2),
            decode_tokens_per_s=(round(r["shared_over_serial_tokens_per_s"], 2)
                                 if r["shared_over_serial_tokens_per_s"] is not None else None))
            for r in vs_serial},
        detail="serial stage_ms / shared stage_ms (whole stage); decode tokens/s ratio alongside"
        if vs_serial else "needs --branches with 8"))

    targets.append(dict(
        name="engine tokens/s beats HF transformers generate (same weights)",
        met=(all(h["engine_over_hf_e2e_tokens_per_s"] > 1 for h in hf_rows) if hf_rows else None),
        figures={f"P={h['prefix_len']}": dict(
            e2e=round(h["engine_over_hf_e2e_tokens_per_s"], 2),
            decode=(round(h["engine_over_hf_decode_tokens_per_s"], 2)
                    if h["engine_over_hf_decode_tokens_per_s"] is not None else None))
            for h in hf_rows},
        detail="engine / HF tokens/s, prompt -> N tokens end to end; decode-only alongside" if hf_rows
        else "HF row not run (--hf off, or auto on an accelerator)"))
    targets.append(dict(
        name="merge join <= 0.1x re-prefill time per stage (each join row)",
        met=(all(r["merge_over_reprefill"] <= 0.1 for r in join_rows) if join_rows else None),
        figures={f"N={r['tokens_per_executor']}": round(r["merge_over_reprefill"], 4) for r in join_rows},
        detail=("merge_ms / reprefill_ms per tokens-per-executor, each until the cache holds the join"
                if join_rows else "join rows off")))

    def point(r):
        return f"{r['kind']} P={r['prefix_len']}" + (f",n={r['branches']}" if r["kind"] == "fork" else "")
    targets.append(dict(
        name=f"paged decode step <= {PAGED_OVER_SLOT_MAX}x the slot engine's at the same used length",
        met=(all(r["paged_over_slot"] is not None and r["paged_over_slot"] <= PAGED_OVER_SLOT_MAX
                 for r in step_rows) if step_rows else None),
        figures={point(r): round(r["paged_over_slot"], 3) if r["paged_over_slot"] is not None else None
                 for r in step_rows},
        detail=("paged_ms / slot_ms per point (a null: noise swamped a step time, not met)" if step_rows
                else "paged vs slot step section not run")))
    forks = [r for r in step_rows if r["kind"] == "fork"]
    once: dict[int, dict[str, set]] = {}
    for r in forks:
        for impl in ("paged", "slot"):
            once.setdefault(r["prefix_len"], {}).setdefault(impl, set()).add(r[f"{impl}_prefix_kv_bytes"])
    targets.append(dict(
        name="shared prefix read once per step whatever the branch count (bytes formula, paged and slot)",
        met=(all(len(v) == 1 for by in once.values() for v in by.values()) if forks else None),
        figures={f"P={p}": {impl: sorted(v) for impl, v in by.items()} for p, by in once.items()},
        detail=("prefix K/V bytes per step over every branch count (one value: read once per group)"
                if forks else "paged vs slot step section not run")))
    return targets


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


ROW_HEADER = (f"{'P':>6} {'n':>3} {'mode':>6} {'step_ms':>8} {'tok/s':>8} {'stage_ms':>9} "
              f"{'1tok_ms':>8} {'cache_MiB':>9} {'compile_s':>9}")
RATIO_HEADER = (f"{'P':>6} {'n':>3} {'sh/cp step':>10} {'sh/cp stage':>11} {'sh/cp bytes':>11} "
                f"{'sh x serial':>11} {'sh step/1br':>11}")
HF_HEADER = (f"{'P':>6} {'N':>4} {'engine tok/s':>12} {'HF tok/s':>9} {'ratio':>6} "
             f"{'eng step_ms':>11} {'HF step_ms':>10} {'decode ratio':>12} {'agree':>5}")


def _print_row(p: int, r: dict) -> None:
    print(f"{p:>6} {r['branches']:>3} {r['mode']:>6} {_fmt(r['step_ms'], '.3f'):>8} "
          f"{_fmt(r['tokens_per_s'], '.0f'):>8} "
          f"{r['stage_ms']:>9.1f} {r['one_token_stage_ms']:>8.1f} {r['cache_bytes'] / 2**20:>9.2f} "
          f"{r['compile_s']:>9.2f}", flush=True)


def _print_ratio(q: dict) -> None:
    print(f"{q['prefix_len']:>6} {q['branches']:>3} {_fmt(q['shared_over_copy_step'], '.3f'):>10} "
          f"{_fmt(q['shared_over_copy_stage'], '.3f'):>11} {_fmt(q['shared_over_copy_bytes'], '.3f'):>11} "
          f"{_fmt(q['shared_speedup_vs_serial_stage']):>11} {_fmt(q['shared_step_vs_one_branch']):>11}")


def _print_hf(h: dict) -> None:
    print(f"{h['prefix_len']:>6} {h['new_tokens']:>4} {h['engine_e2e_tokens_per_s']:>12.1f} "
          f"{h['hf_e2e_tokens_per_s']:>9.1f} {h['engine_over_hf_e2e_tokens_per_s']:>6.2f} "
          f"{_fmt(h['engine_step_ms'], '.3f'):>11} {_fmt(h['hf_step_ms'], '.3f'):>10} "
          f"{_fmt(h['engine_over_hf_decode_tokens_per_s']):>12} {h['greedy_tokens_agree']:>5}", flush=True)


def run_decode_bench(args: argparse.Namespace) -> int:
    """Run the sweep, print the tables and the targets, write --out JSON."""
    import jax

    backend = jax.default_backend()
    on_accel = backend != "cpu"
    s = _settings(args, on_accel)
    load_start = _loadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        model, source, hf_dir = _load_model(args, s, on_accel, Path(tmp))
        config = model.config
        tokenizer = synthetic_tokenizer(config.vocab_size)
        hf = hf_device = None
        if hf_dir is not None:
            hf, hf_device = _load_hf(hf_dir, s["dtype"])
        device_kind = jax.devices()[0].device_kind
        print(f"bench decode: {device_kind} ({backend}), model {source.get('name', source.get('path'))} "
              f"({source['param_count'] / 1e6:.1f}M params, {s['dtype']}), new tokens {s['new_tokens']}, "
              f"branch prefix {s['branch_prefix_len']}, decode_chunk {s['decode_chunk']}, "
              f"prefill_chunk {s['prefill_chunk']}, repeats {s['repeats']}, attention {s['attention_impl']}")
        if s["attention_impl"] == "pallas" and not on_accel:
            print("NOTE: pallas on CPU runs the kernel in interpret mode: its timings are not meaningful")
        ncpu = os.cpu_count() or 1
        print(f"load average {load_start} on {ncpu} CPUs"
              + ("  (busy machine: timings are noisy)" if load_start and load_start[0] > 0.5 * ncpu else ""))
        print("step_ms = (wall(N) - wall(1)) / (steps(N) - steps(1)): fork and branch-prefix prefill excluded; "
              "stage_ms = wall(N), the whole decode_branches call")
        rng = np.random.default_rng(s["seed"])
        rows: list[dict] = []
        ratios: list[dict] = []
        hf_rows: list[dict] = []
        capacities: list[dict] = []
        print(ROW_HEADER)
        print("-" * len(ROW_HEADER))
        for p in s["prefix_lens"]:
            engine = _make_engine(model, tokenizer, p, s)
            context = [int(x) for x in rng.integers(0, config.vocab_size, p)]
            t0 = time.perf_counter()
            state = engine.prefill(context)
            prefill_first_s = time.perf_counter() - t0
            capacities.append(dict(prefix_len=p, max_seq_len=engine.max_seq_len,
                                   max_branch_tokens=engine.max_branch_tokens,
                                   kv_bytes_per_token=kv_bytes_per_token(config),
                                   seq_capacity=int(engine.parent_capacity),
                                   suffix_capacity=int(engine.child_capacity),
                                   page_size=int(engine.page_size), num_pages=int(engine.num_pages),
                                   prefill_first_call_s=prefill_first_s))
            prefix_sets = {n: [[int(x) for x in rng.integers(0, config.vocab_size, s["branch_prefix_len"])]
                               for _ in range(n)] for n in s["branches"]}
            page_size = engine.page_size
            points = _bench_context(engine, state, prefix_sets, s)
            for n, point in points.items():
                for mode in MODES:
                    row = dict(prefix_len=p, new_tokens=s["new_tokens"], **point[mode])
                    rows.append(row)
                    _print_row(p, row)
                ratios.append(_ratios(p, n, point, points.get(1)))
            if hf is not None:
                with _torch_threads(s["hf_threads"]):
                    hf_rows.append(_bench_hf(engine, hf, hf_device, context, s))
            del state, engine
        join_rows: list[dict] = []
        if s["join_tokens"]:
            print()
            print(f"join per stage: {s['join_executors']} executors x N tokens after a "
                  f"{s['join_context']}-token planner; "
                  f"reprefill = extend of all executor tokens + the steps writing them, merge = Engine.merge "
                  f"(best of {s['repeats']})")
            print(JOIN_HEADER)
            print("-" * len(JOIN_HEADER))
            join_rows = bench_join(model, tokenizer, s, rng)
        print()
        print(f"decode step, paged KV pool (programs.decode) vs slot cache (slot_programs.decode), same rows and "
              f"used length, chunk {s['decode_chunk']}, random KV, greedy; step = (wall(N) - wall(1)) / (N - 1), "
              f"best of {s['step_repeats']}; bytes per step by the kernels' formulas (all layers)")
        print(paged_step.STEP_HEADER)
        print("-" * len(paged_step.STEP_HEADER))
        step_rows = paged_step.bench_paged_vs_slot(model.params, config, s, page_size, rng)
        load_end = _loadavg()

    print()
    print("same-run ratios (shared/copy < 1: shared better; 'sh x serial' = serial stage / shared stage)")
    print(RATIO_HEADER)
    print("-" * len(RATIO_HEADER))
    for q in ratios:
        _print_ratio(q)
    if hf_rows:
        print()
        print(f"single sequence vs HF transformers generate (PyTorch {hf_device}, "
              f"{hf_rows[0]['hf_torch_threads']} thread(s), Qwen2ForCausalLM eager, same weights, greedy, "
              f"eos off): tok/s = N / (prompt -> N tokens wall)")
        print(HF_HEADER)
        print("-" * len(HF_HEADER))
        for h in hf_rows:
            _print_hf(h)
    targets = evaluate_targets(ratios, hf_rows, join_rows, step_rows)
    print()
    print("targets (stated for CPU, tiny model):")
    for t in targets:
        status = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        print(f"  [{status}] {t['name']}: {json.dumps(t['figures'])}  ({t['detail']})")
    total_s = time.perf_counter() - t_start
    print(f"total {total_s:.0f} s; load average start {load_start} end {load_end}")

    report = dict(
        benchmark="decode", device_kind=device_kind, backend=backend, jax_version=jax.__version__,
        torch_version=sys.modules["torch"].__version__ if hf_rows else None, cpu_count=ncpu,
        loadavg_start=load_start, loadavg_end=load_end, total_s=total_s,
        model={k: v for k, v in source.items()},
        settings={k: v for k, v in s.items()}, capacities=capacities,
        timing=("step_ms = (best wall(N) - best wall(1)) / (steps(N) - steps(1)) from "
                "engine.last_branch_stats; stage_ms = best wall(N); best = minimum over --repeats; "
                "branch counts and modes of a context interleaved per repeat; "
                "compile_s = first-call wall - best wall (N and 1)"),
        rows=rows, ratios=ratios, hf=hf_rows, join=join_rows, paged_step=step_rows, targets=targets)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sprint_jax.bench.decode", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_arguments(parser)
    args = parser.parse_args(argv)
    from sprint_jax.errors import UserError
    from sprint_jax.config import ConfigError
    try:
        return run_decode_bench(args)
    except (UserError, ConfigError, FileNotFoundError) as e:
        print(f"bench decode: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
