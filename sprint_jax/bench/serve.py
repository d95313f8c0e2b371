"""`sprint-jax bench serve`: many SPRINT-shaped runs at once on the batched engine.

Model: random weights in the demo's model shape (`demo-size`: sprint_jax.demo.DemoModel, vocabulary
512) by default; --preset bench-tiny or any configs/model_NAME.json. The latency model runs on the
demo's model exactly (configs/demo.yaml, its tokenizer's vocabulary; random weights) unless --preset.

Rows, all measured in one run:
  throughput   problems/s and generated tokens/s at each --concurrency on `Engine`, on
               identical work (concurrency 1: one problem at a time). A problem is a SPRINT run
               with scripted stage lengths:
               prompt (--prompt-len tokens) -> planner call (--planner-tokens) -> fork of
               --executors executors (forced 4-token opening, --executor-tokens each) -> sync
               (the executors' tokens prefilled onto the planner) -> final planner call
               (--final-tokens). Lengths are exact: the engine runs with no EOS and no stop
               strings, greedy. Random weights, so what a model would write does not matter.
  capacity     one sequence's decode step at used length --used (256) in a cache of capacity 512
               vs 8192 (the engine attends over the bucketed used length). The sequence is
               prefilled once; each timed call decodes N tokens and rolls back (truncate), and
               step_ms = (wall(8 chunks) - wall(1 chunk)) / (7 chunks) cancels per-call set-up.
  latency      (the latency model) the decode step of one row vs of a fork of --executors children
               (the same context, --model-context tokens), and an engine call's fixed cost: each
               path decodes N = 8 and 64 tokens in ONE call (decode chunk 64), best of the
               repeats; step = (wall(64) - wall(8)) / 56, per call = wall(8) - 8 x step. Beside
               them the model's matmuls alone (every weight matrix of every layer and the
               unembedding, chained in a loop) at 1 row and at the fork's rows: what the extra
               rows' matmuls cost at the rate XLA reaches here for these shapes. From these, the
               scripted problem's parallel / sequential latency ratio with no per-call cost at
               all: with this engine's fork step, and at the compute floor (fork step = one-row
               step + the extra rows' matmuls). Counts: parallel = planner + final one-row steps and 4 + executor
               tokens steps of the fork (4: the forced opening); sequential = --sequential-tokens
               one-row steps. A parallel stage pays off in wall clock only where extra rows are
               cheap next to a step's fixed cost (accelerators); the ratio says where this
               machine stands, e.g. against the demo's latency target (<= 0.75).
  fork bytes   a fork of --executors children on a fresh engine: the KV bytes written, read off the
               KV pool (token slots whose K or V is non-zero), against prefix + n x suffix + each
               child's copy of the parent's partly filled last page (the prefix's full pages
               stored once) and against what per-child prefix copies would hold.
  --http       instead: plain greedy requests through `sprint-jax serve` vs in-process on an
               identical Engine. Model: the demo's (configs/demo.yaml: its shape, its
               tokenizer, its held-out queries as prompts; random weights) unless --preset. Per
               (--max-tokens, --concurrency): waves of `concurrency` requests, the paths
               alternating wave by wave after the same short idle lead: http.client and the
               openai client (one client process and keep-alive connection per request of a
               wave, sent at one instant), and in-process (each request submitted at the offset
               at which http.client sent it). Per path: latency p50 / p90 / p99 and throughput
               (requests/s, tokens/s); per client, what HTTP adds: the median per-request
               difference to the same request's in-process latency. Every path must return the
               same texts. --engine-on picks where the server's engine steps.
  --prefix     instead: time to first token of a prefix-cache hit vs a miss. Each round is a
               fresh random system prompt (--system-tokens) followed by --hits + 1 requests, each
               with its own random user part (--user-tokens; distinct first tokens): the first
               request misses the cache, the others take the system prompt's whole pages from it
               (hit tokens read off the engine / the server's /health per request, against the
               hand count system_tokens // page_size * page_size). Side by side in one run:
               in-process on an Engine (TTFT: open -> the step that produced the first token) and
               through `sprint-jax serve` (http.client streaming on a keep-alive connection: TTFT =
               request sent -> the first event with a token's text; the openai client would add
               its own time to build a request of 1,000 token ids), each with its own cache.
               Each request generates 4 tokens: its first token comes back with the decode call
               that writes it (min(4, --decode-chunk) steps), in both paths alike. One untimed
               round first (compiles the miss's and the hits' shapes), then --repeats rounds;
               best and median per kind, every sample in the JSON. A round's miss may evict the
               previous rounds' pages (counted).
Every point runs once untimed first (compiles every shape it meets; checks that every concurrency
generates identical tokens: the same work), then --repeats times interleaved; the best is reported
and every sample is kept in the JSON. Each sample also records this process's CPU seconds (all its
threads) and the run the load average: on a shared machine other processes stretch the wall clock
but not the CPU time, so the CPU-time ratio is printed next to the wall-clock one.

Targets (2-core CPU): throughput at concurrency 16 >= 6x concurrency 1; decode step at
used length 256: capacity 8192 <= 1.2x capacity 512.

Run:
    sprint-jax bench serve --quick --out bench_serve.json     # CPU, a few minutes
    sprint-jax bench serve --preset r1-distill-qwen-7b        # accelerator, random weights
    sprint-jax bench serve --http --problems 32 --repeats 3   # HTTP vs in-process, a few minutes
    sprint-jax bench serve --prefix --repeats 5               # prefix-cache hit vs miss TTFT, ~1 minute
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help="random weights: demo-size (default: the demo's model shape), bench-tiny, "
                                         "or a configs/model_NAME.json (e.g. r1-distill-qwen-7b)")
    parser.add_argument("--quick", action="store_true", help="concurrency 1,4,16 and fewer problems")
    parser.add_argument("--out", metavar="FILE.json", help="write the results here as JSON")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,4,16,64; quick 1,4,16)")
    parser.add_argument("--problems", type=int, default=None, help="problems per point (default 128; quick 32)")
    parser.add_argument("--prompt-len", type=int, default=48,
                        help="prompt tokens per problem (--http: only with --preset; else the demo's queries)")
    parser.add_argument("--planner-tokens", type=int, default=24, help="first planner call's tokens")
    parser.add_argument("--executors", type=int, default=3, help="executors forked per problem")
    parser.add_argument("--executor-tokens", type=int, default=24, help="tokens each executor decodes")
    parser.add_argument("--final-tokens", type=int, default=8, help="final planner call's tokens")
    parser.add_argument("--used", type=int, default=256, help="capacity row: used length")
    parser.add_argument("--capacities", default="512,8192", help="capacity row: cache capacities")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per point (best reported)")
    parser.add_argument("--decode-chunk", type=int, default=16, help="decode steps per host round trip")
    m = parser.add_argument_group("latency model: when can parallel executors cut wall clock on this machine?")
    m.add_argument("--no-latency-model", action="store_true", help="skip the latency-model rows")
    m.add_argument("--model-context", type=int, default=64,
                   help="latency model: the context length its steps attend to (the demo's stage 1: ~40-70)")
    m.add_argument("--sequential-tokens", type=int, default=None,
                   help="latency model: tokens of the same problem solved sequentially (one row; default "
                        "planner + executors x executor tokens + final tokens)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    h = parser.add_argument_group("--http: the same plain requests through `sprint-jax serve` vs in-process")
    h.add_argument("--http", action="store_true",
                   help="measure requests through the HTTP server instead, beside the same requests in-process "
                        "(model: the demo's unless --preset): latency percentiles, throughput, what HTTP adds")
    h.add_argument("--max-tokens", default="32,80",
                   help="--http: tokens generated per request, comma-separated (default 32,80: a short request "
                        "(the demo's planner calls stay within 48 tokens), and about a whole answer of the demo's "
                        "RFT model, 77 tokens; a whole SPRINT run of it writes ~93)")
    x = parser.add_argument_group("--prefix: time to first token of a prefix-cache hit vs a miss")
    x.add_argument("--prefix", action="store_true",
                   help="measure TTFT of requests sharing a long system prompt: the first a miss, the next a "
                        "hit (in-process and through `sprint-jax serve`; model: --preset, default demo-size)")
    x.add_argument("--system-tokens", type=int, default=1024, help="--prefix: the shared system prompt's tokens")
    x.add_argument("--user-tokens", type=int, default=32, help="--prefix: each request's own tokens after it")
    x.add_argument("--hits", type=int, default=3, help="--prefix: requests after the miss in a round")
    x.add_argument("--page-size", type=int, default=16, help="--prefix: the KV pool's tokens per page")
    h.add_argument("--engine-on", choices=("auto", "loop", "thread"), default="auto",
                   help="--http: where the server's engine steps, as `sprint-jax serve --engine-on` (default auto: "
                        "the server's default, loop on CPU)")


DEMO_NAME = "demo-size"   # the demo's model shape (sprint_jax.demo.DemoModel), vocabulary 512

def _model(preset: str | None, seed: int):
    import dataclasses

    import jax

    from sprint_jax.bench.decode import BENCH_TINY, BENCH_TINY_NAME, synthetic_tokenizer
    from sprint_jax.demo import DemoModel
    from sprint_jax.model import Qwen2, Qwen2Config, init_params
    on_accel = jax.default_backend() != "cpu"
    dt = "bfloat16" if on_accel else "float32"
    name = preset or DEMO_NAME
    if name == DEMO_NAME:
        config = Qwen2Config(vocab_size=512, **dataclasses.asdict(DemoModel()), param_dtype=dt, dtype=dt)
    elif name == BENCH_TINY_NAME:
        config = Qwen2Config(**BENCH_TINY, param_dtype=dt, dtype=dt)
    else:
        config = Qwen2Config.preset(name, param_dtype=dt, dtype=dt)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))
    return Qwen2(config, params=params), synthetic_tokenizer(config.vocab_size), name


def _problems(n: int, s: dict, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(2, vocab, s["prompt_len"])] for _ in range(n)]


def _openings(s: dict) -> list[list[int]]:
    return [[3, 4, 5, 6 + j] for j in range(s["executors"])]


def run_batched(engine, prompts: list[list[int]], s: dict, concurrency: int, outputs: list | None = None) -> int:
    """The problems on the Engine, `concurrency` at a time; returns generated tokens.
    outputs: if given, receives (problem, stage, tokens) of every generation (the same work at
    every concurrency: greedy, so identical lists once sorted)."""
    tokens = 0
    todo = list(range(len(prompts)))[::-1]
    live: dict[int, dict] = {}

    def advance(i):
        nonlocal tokens
        st = live[i]
        op = st["op"]
        if outputs is not None and op.kind in ("generate", "fork"):
            gens = [op.result] if op.kind == "generate" else op.result
            outputs.extend((i, f"{op.kind}{int(st['forked'])}.{j}", g.tokens) for j, g in enumerate(gens))
        if op.kind == "open":
            st["seq"] = op.result
            st["op"] = engine.generate(st["seq"], s["planner_tokens"])
        elif op.kind == "generate" and not st["forked"]:
            tokens += len(op.result.tokens)
            st["forked"] = True
            st["op"] = engine.fork(st["seq"], _openings(s), s["executor_tokens"])
        elif op.kind == "fork":
            sync = [t for o, g in zip(_openings(s), op.result) for t in o + g.tokens]
            tokens += sum(len(g.tokens) for g in op.result)
            st["op"] = engine.extend(st["seq"], sync)
        elif op.kind == "extend":
            st["op"] = engine.generate(st["seq"], s["final_tokens"])
        else:
            tokens += len(op.result.tokens)
            engine.close(st["seq"])
            del live[i]

    while todo or live:
        while todo and len(live) < concurrency:
            i = todo.pop()
            live[i] = dict(op=engine.open(prompts[i]), seq=None, forked=False)
        engine.step()
        for i in [i for i, st in live.items() if st["op"].done]:
            advance(i)
            while i in live and live[i]["op"].done:
                advance(i)
    return tokens


def fork_bytes(model, tok, prompt: list[int], s: dict, common: dict) -> dict[str, Any]:
    """A fork's KV footprint read off the KV pool: on a fresh engine (zero pool), open the prompt
    and fork --executors children (4-token openings, --executor-tokens each); every token slot of
    a page whose K or V is non-zero anywhere (layers, heads, dims) was written. The slots written
    must be exactly the prefix once + each child's suffix + each child's copy of the parent's
    partly filled last page (copy on write: prefix % page_size tokens; full pages are shared),
    never a per-child copy of the prefix."""
    import jax

    from sprint_jax.infer.engine import Engine
    e = Engine(model, tok, max_seqs=1, max_children=max(s["executors"], 1), **common)
    op = e.open(prompt)
    e.run([op])
    seq = op.result
    fork = e.fork(seq, _openings(s), s["executor_tokens"])
    e.run([fork])
    k, v = jax.device_get((e.cache.k, e.cache.v))                     # [L, Hkv, N, ps, D]
    written = (k != 0).any(axis=(0, 1, 4)) | (v != 0).any(axis=(0, 1, 4))      # [N, ps]
    per_slot = 2 * k.shape[0] * k.shape[1] * k.shape[4] * k.dtype.itemsize     # K and V, all layers
    parent_pages = set(e.page_ids(seq))
    child_pages = [sorted(set(c.pages.pages) - parent_pages) for c in seq.last_fork.children]
    parent_slots = int(written[sorted(parent_pages)].sum())
    child_slots = [int(written[pages].sum()) for pages in child_pages]
    prefix = seq.length                                   # the context's KV entries
    suffixes = [len(o) + len(g.tokens) for o, g in zip(_openings(s), fork.result)]   # pending + opening + generated - 1
    cow = [prefix % e.page_size] * len(suffixes)          # each child's copy of the partly filled page
    measured = per_slot * int(written.sum())
    expected = per_slot * (prefix + sum(suffixes) + sum(cow))
    return dict(bytes_per_slot=per_slot, page_size=e.page_size, parent_slots=parent_slots, child_slots=child_slots,
                prefix_slots=prefix, suffix_slots=suffixes, copied_page_slots=cow, measured_bytes=measured,
                prefix_plus_suffixes_bytes=per_slot * (prefix + sum(suffixes)), expected_bytes=expected,
                copied_prefix_bytes=per_slot * (len(suffixes) * prefix + sum(suffixes)),
                exact=measured == expected == per_slot * (parent_slots + sum(child_slots)))


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.prefix and args.http:
        from sprint_jax.errors import UserError
        raise UserError("--prefix and --http are separate benches: pick one")
    if args.prefix:
        prefix_bench(args)
    elif args.http:
        http_bench(args)
    else:
        serve_bench(args)
    return 0


# ---------------------------------------------------------------------------------------------
# --http: the OpenAI-compatible server vs the same engine in-process
# ---------------------------------------------------------------------------------------------
def _demo_model(seed: int, n: int):
    """The demo's model exactly as `sprint-jax demo` builds it (configs/demo.yaml `model`, its
    tokenizer and vocabulary, float32), with random weights, and `n` of the demo's held-out
    queries (~10 tokens each) as the prompts."""
    import jax

    from sprint_jax.config import CONFIG_DIR, load_config, to_dict
    from sprint_jax.demo import DemoConfig
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model import Qwen2, Qwen2Config, init_params
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks import chains

    cfg = load_config(DemoConfig, CONFIG_DIR / "demo.yaml")
    tok = VocabTokenizer(token_vocabulary(max_prompts=cfg.chains), eos_token="<eos>", pad_token="<pad>")
    config = Qwen2Config.from_hf_config({"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8,
                                         **to_dict(cfg.model), "max_position_embeddings": cfg.seq_len,
                                         "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id})
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))
    tasks = chains.generate(n, cfg.seed + 10_000, cfg.chains, cfg.chains, cfg.chain_length)
    prompts = [tok.encode(chains.prompt_for(t)) for t in tasks]
    return Qwen2(config, params=params), tok, DEMO_NAME, prompts


def _inproc_wave(engine, prompts: list[list[int]], max_new: int,
                 offsets: list[float] | None = None) -> tuple[list[float], list[str]]:
    """The requests of one wave on a Engine driven in this thread, request j submitted at
    `offsets[j]` s after the wave starts (all at once without offsets), each generate following
    its open at once as the server's engine loop does. A request that comes due while a step
    runs waits for the step's end, as it would at the server. Per request: the time from its
    submission to its result, and the texts."""
    n = len(prompts)
    offsets = offsets or [0.0] * n
    order = sorted(range(n), key=lambda j: offsets[j])
    t0 = time.perf_counter()
    ops: dict[int, Any] = {}
    lat: list[float | None] = [None] * n
    texts = [""] * n
    while any(x is None for x in lat):
        now = time.perf_counter()
        while order and t0 + offsets[order[0]] <= now:
            j = order.pop(0)
            op = engine.open(prompts[j])
            ops[j] = engine.generate(op.result, max_new) if op.done else op
        if not ops:                                   # nothing submitted yet: wait for the first
            time.sleep(max(0.0, t0 + offsets[order[0]] - now))
            continue
        engine.step()
        now = time.perf_counter()
        for j, op in list(ops.items()):
            if not op.done:
                continue
            if op.kind == "open":
                ops[j] = engine.generate(op.result, max_new)
                continue
            lat[j], texts[j] = now - (t0 + offsets[j]), op.result.text
            engine.close(op.seq)
            del ops[j]
    return lat, texts


HTTP_CLIENTS = ("http", "openai")       # http.client (a plain HTTP client), the openai package
HTTP_PATHS = ("inproc",) + HTTP_CLIENTS


class _ClientPool:
    """The HTTP clients, one process per connection (as load generators run them: in the server's
    process they would share its GIL), kept for the whole bench. Each process holds one
    keep-alive connection of each client kind (`HTTP_CLIENTS`). `wave` hands request j of a wave
    to process j with one start instant for all; each sends at that instant (or as soon as it is
    scheduled: the send times come back, and the in-process wave replays them)."""

    def __init__(self, url: str, model: str, width: int):
        import subprocess
        import sys

        self.procs = [subprocess.Popen(
            [sys.executable, "-c", "from sprint_jax.bench.serve import _client_main; _client_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(width)]
        for p in self.procs:
            self._write(p, dict(url=url, model=model))
        for p in self.procs:
            self._read(p)

    @staticmethod
    def _write(p, obj) -> None:
        p.stdin.write(json.dumps(obj) + "\n")
        p.stdin.flush()

    @staticmethod
    def _read(p) -> dict:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"an HTTP client process failed: {p.stderr.read()[-2000:]}")
        r = json.loads(line)
        if r.get("error"):
            raise RuntimeError(f"HTTP request failed: {r['error']}")
        return r

    def wave(self, kind: str, prompts: list[list[int]], max_new: int,
             at: float) -> tuple[list[float], list[str], list[float]]:
        """Latencies, texts, and when each request went out (s after the wave's first); the
        requests go out at perf_counter() == at (`wave_lead`: every process has its line by then)."""
        for p, prompt in zip(self.procs, prompts):
            self._write(p, dict(kind=kind, prompt=prompt, max_new=max_new, at=at))
        rs = [self._read(p) for p in self.procs[:len(prompts)]]
        sent = [r["sent"] for r in rs]
        return [r["lat"] for r in rs], [r["text"] for r in rs], [t - min(sent) for t in sent]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            p.wait(30)


def _client_main() -> None:
    """A client process of `_ClientPool`: the first stdin line sets it up (url, model); then each
    line is a request, answered by one JSON line. A request is timed from just before it is sent
    to its parsed reply (the JSON decoded, the text taken out)."""
    import http.client
    import sys
    from urllib.parse import urlsplit

    import openai

    setup = json.loads(sys.stdin.readline())
    model, where = setup["model"], urlsplit(setup["url"])
    hc = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    oa = openai.OpenAI(base_url=setup["url"] + "/v1", api_key="none", max_retries=0, timeout=600)

    def touch(kind: str) -> None:
        """Not timed: the connection is open when the timed request goes out (the server closes
        connections idle for 5 s, e.g. while the in-process waves run). http.client: a look at the
        socket (closed by the server: reconnect); openai (its own pool): a GET /v1/models."""
        if kind == "openai":
            oa.models.list()
        elif hc.sock is None or _closed_by_peer(hc.sock):
            hc.close()
            hc.connect()

    def ask(kind: str, prompt: list[int], max_new: int) -> str:
        if kind == "openai":
            return oa.completions.create(model=model, prompt=prompt, max_tokens=max_new,
                                         temperature=0).choices[0].text
        body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_new, temperature=0)).encode()
        hc.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = hc.getresponse()
        reply = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {reply}")
        return reply["choices"][0]["text"]

    for kind in HTTP_CLIENTS:
        touch(kind)
    print(json.dumps({}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            touch(job["kind"])
            _until(job["at"])
            t = time.perf_counter()
            text = ask(job["kind"], job["prompt"], job["max_new"])
            out = dict(lat=time.perf_counter() - t, text=text, sent=t)
        except Exception as e:                   # noqa: BLE001  (reported to the bench)
            out = dict(error=f"{type(e).__name__}: {e}")
        print(json.dumps(out), flush=True)


def _closed_by_peer(sock) -> bool:
    """Whether the other end closed this idle keep-alive socket (readable, and nothing to read)."""
    import select
    import socket

    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _until(t: float) -> None:
    """Wait until perf_counter() reaches t: asleep, then awake for the last 0.5 ms (a process
    woken from sleep runs its first microseconds slowly on a loaded machine; that is the client's
    wake-up, not the server's cost)."""
    ahead = t - time.perf_counter() - 0.0005
    if ahead > 0:
        time.sleep(ahead)
    while time.perf_counter() < t:
        pass


def wave_lead(n: int) -> float:
    """Seconds from the end of one wave to the start of the next, on every path: long enough for
    n client processes to get their request before it goes out (one that is late sends late: its
    send time is recorded and replayed in-process). The engine is idle that long before every
    wave, HTTP or in-process, so a request that finds it idle pays the same wake-up on both."""
    return 0.001 + 0.0005 * n


def _http_settings(args: argparse.Namespace) -> tuple[list[int], list[int], int]:
    """(concurrencies, max_tokens values, requests per point) from the flags; a bad value is a
    UserError."""
    from sprint_jax.errors import UserError

    try:
        conc = [int(x) for x in (args.concurrency or "1,8").split(",")]
        lengths = [int(x) for x in str(args.max_tokens).split(",")]
    except ValueError:
        raise UserError("--concurrency and --max-tokens take comma-separated integers") from None
    n = args.problems or (16 if args.quick else 32)
    if min(conc) < 1 or n < 1 or args.repeats < 1 or min(lengths) < 1:
        raise UserError("--concurrency, --problems, --repeats and --max-tokens must be >= 1")
    return conc, lengths, n


class _Waves:
    """One (max_tokens, concurrency) point: the requests in waves of `concurrency`, on every path
    (`HTTP_PATHS`). An in-process wave replays the send offsets of the last http.client wave of
    the same requests, so both paths see the same arrivals."""

    def __init__(self, local, clients: _ClientPool, prompts: list[list[int]], max_new: int, concurrency: int):
        self.local, self.clients, self.prompts, self.max_new = local, clients, prompts, max_new
        n = len(prompts)
        self.waves = [list(range(i, min(i + concurrency, n))) for i in range(0, n, concurrency)]
        self.arrivals: dict[int, list[float]] = {}      # wave -> http.client's send offsets

    def run(self, path: str, w: int) -> tuple[list[float], list[str], float]:
        """Wave `w` on `path`, after the idle lead: (latencies, texts, the wave's wall clock: its
        start to its last reply)."""
        ps = [self.prompts[i] for i in self.waves[w]]
        at = time.perf_counter() + wave_lead(len(ps))
        if path == "inproc":
            _until(at)                                # the same idle time before it as an HTTP wave
            offsets = self.arrivals.get(w, [0.0] * len(ps))
            lat, texts = _inproc_wave(self.local, ps, self.max_new, offsets)
        else:
            lat, texts, offsets = self.clients.wave(path, ps, self.max_new, at)
            if path == "http":
                self.arrivals[w] = offsets
        return lat, texts, max(o + x for o, x in zip(offsets, lat))

    def warm(self) -> None:
        """Untimed, twice: compiles every shape (HTTP arrivals spread over a few ms, so their steps
        meet more row counts than an in-process wave all at once); http.client first, so the
        in-process waves have arrivals to replay."""
        for _ in range(2):
            for path in HTTP_PATHS[1:] + HTTP_PATHS[:1]:
                for w in range(len(self.waves)):
                    self.run(path, w)

    def timed(self, repeats: int) -> tuple[dict, dict, dict]:
        """`repeats` passes, the paths alternating wave by wave (their order rotating, so no path
        always goes first): per path the latencies [repeat, request], the walls [repeat] (the
        sum of its waves') and the texts of the last pass."""
        n = len(self.prompts)
        lat = {p: np.zeros((repeats, n)) for p in HTTP_PATHS}
        wall = {p: np.zeros(repeats) for p in HTTP_PATHS}
        texts = {p: [""] * n for p in HTTP_PATHS}
        for r in range(repeats):
            for w, idx in enumerate(self.waves):
                k = (w + r) % len(HTTP_PATHS)
                for path in HTTP_PATHS[k:] + HTTP_PATHS[:k]:
                    lw, tw, ww = self.run(path, w)
                    lat[path][r, idx] = lw
                    wall[path][r] += ww
                    for i, t in zip(idx, tw):
                        texts[path][i] = t
        return lat, wall, texts


def _http_row(waves: _Waves, repeats: int, concurrency: int) -> dict[str, Any]:
    """A point's row: per path the latency percentiles (ms, over every request of every pass) and
    the throughput of its best pass (requests/s, generated tokens/s); per HTTP client, what it
    adds over in-process: the median per-request difference to the same request's in-process
    latency (ms, and % of the in-process p50). RuntimeError when a path's texts differ from the
    in-process engine's (not the same work)."""
    waves.warm()
    lat, wall, texts = waves.timed(repeats)
    for path in HTTP_CLIENTS:
        if texts[path] != texts["inproc"]:
            raise RuntimeError(f"{path}'s texts differ from the in-process engine's: not the same work")
    n = len(waves.prompts)
    row: dict[str, Any] = dict(max_tokens=waves.max_new, concurrency=concurrency)
    for path in HTTP_PATHS:
        x = 1000 * lat[path].ravel()
        best = float(wall[path].min())
        row[path] = dict(p50_ms=float(np.median(x)), p90_ms=float(np.percentile(x, 90)),
                         p99_ms=float(np.percentile(x, 99)), mean_ms=float(x.mean()), samples_ms=x.tolist(),
                         requests_per_s=n / best, tokens_per_s=n * waves.max_new / best,
                         wall_samples_s=wall[path].tolist())
    for path in HTTP_CLIENTS:
        over = 1000 * float(np.median(lat[path] - lat["inproc"]))
        row[path].update(overhead_ms=over, overhead_pct=100 * over / row["inproc"]["p50_ms"])
    return row


def http_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Per (max_tokens, concurrency): the same greedy requests in waves of `concurrency`, in-process
    on a Engine and through `sprint-jax serve` (http.client and the openai client), the paths
    alternating wave by wave; latency percentiles, throughput, and what HTTP adds per request."""
    import os

    import jax

    from sprint_jax.infer.engine import Engine
    from sprint_jax.serve import Server
    from sprint_jax.serve.server import ENGINE_ON

    conc, lengths, n = _http_settings(args)
    if args.preset:
        model, tok, name = _model(args.preset, args.seed)
        prompts = _problems(n, dict(prompt_len=args.prompt_len), model.config.vocab_size, args.seed)
    else:
        model, tok, name, prompts = _demo_model(args.seed, n)
    caps = dict(max_seqs=max(conc), max_children=1, max_seq_len=max(map(len, prompts)) + max(lengths) + 8,
                max_branch_tokens=8, decode_chunk=args.decode_chunk, prefill_chunk=128, eos_token_ids=[])
    local = Engine(model, tok, **caps)
    server = Server(Engine(model, tok, **caps), name,     # its own cache; the jitted steps are shared
                    engine_on_loop=ENGINE_ON[args.engine_on]).start()
    clients = _ClientPool(server.url, name, max(conc))
    out: dict[str, Any] = dict(model=name, backend=jax.default_backend(), requests=n,
                               prompt_tokens=[len(p) for p in prompts], http_impl=server.http_impl,
                               loop_impl=server.loop_impl, engine_on="loop" if server.engine_on_loop else "thread",
                               decode_chunk=args.decode_chunk, rows=[])
    try:
        load_before = os.getloadavg()
        for m in lengths:
            for c in conc:
                out["rows"].append(_http_row(_Waves(local, clients, prompts, m, c), args.repeats, c))
        out["loadavg"] = dict(before=load_before, after=os.getloadavg())
    finally:
        clients.close()
        server.stop()
    _http_report(out, args.repeats)
    _write_json(out, args.out)
    return out


def _http_report(out: dict, repeats: int) -> None:
    print(f"model {out['model']} on {out['backend']}; {out['requests']} requests x {repeats} repeats, prompts of "
          f"{min(out['prompt_tokens'])}-{max(out['prompt_tokens'])} tokens, greedy, decode chunk "
          f"{out['decode_chunk']}; uvicorn http={out['http_impl']} loop={out['loop_impl']}, engine on the "
          f"{out['engine_on']}; load average {out['loadavg']['before'][0]:.1f} -> {out['loadavg']['after'][0]:.1f}")
    print("Waves of `conc` requests, the paths alternating wave by wave; latency = submission -> parsed reply, ms "
          "over every request; req/s: the best pass. inproc: the same requests on an identical engine in this "
          "process, each submitted at the offset in its wave at which http.client sent it. http = http.client, "
          "openai = the openai package, one client process and keep-alive connection per request of a wave; "
          "over = median per request of its latency - the same request's inproc latency (% of the inproc p50).")
    print(f"{'':>11}{'--- inproc':<28}{'--- http':<41}{'--- openai':<41}")
    head = f"{'p50':>7}{'p90':>7}{'p99':>7}{'req/s':>7}"
    print(f"{'tokens':>6}{'conc':>5}{head}{head}{'over':>7}{'%':>6}{head}{'over':>7}{'%':>6}")
    for r in out["rows"]:
        line = f"{r['max_tokens']:>6}{r['concurrency']:>5}"
        for path in HTTP_PATHS:
            x = r[path]
            line += f"{x['p50_ms']:>7.2f}{x['p90_ms']:>7.2f}{x['p99_ms']:>7.2f}{x['requests_per_s']:>7.1f}"
            if path != "inproc":
                line += f"{x['overhead_ms']:>7.2f}{x['overhead_pct']:>6.1f}"
        print(line)


# ---------------------------------------------------------------------------------------------
# --prefix: time to first token of a prefix-cache hit vs a miss
# ---------------------------------------------------------------------------------------------
PREFIX_NEW_TOKENS = 4          # tokens each --prefix request generates (TTFT needs the first)


def _prefix_rounds(n: int, system: int, user: int, hits: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """n rounds of hits + 1 prompts: a fresh random system prompt per round, then per request its
    own random user part whose first token differs from the round's others (the cached prefix of
    a hit is the system prompt's whole pages, nothing of an earlier request's user part)."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n):
        sys_ids = [int(x) for x in rng.integers(2, vocab, system)]
        firsts = rng.choice(np.arange(2, vocab), hits + 1, replace=False)
        rounds.append([sys_ids + [int(f)] + [int(x) for x in rng.integers(2, vocab, user - 1)] for f in firsts])
    return rounds


def _inproc_ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """(TTFT s, prefix-hit tokens) of one greedy request on `engine` driven here as the server
    drives it (generate as soon as the open is admitted, one step at a time)."""
    hits0 = engine.page_stats()["prefix_hit_tokens"]
    t0 = time.perf_counter()
    op = engine.open(prompt)
    gen = engine.generate(op.result, PREFIX_NEW_TOKENS) if op.done else None
    ttft = None
    while True:
        engine.step()
        if gen is None and op.done:
            gen = engine.generate(op.result, PREFIX_NEW_TOKENS)
        if gen is not None and ttft is None and engine.progress(gen)[0]:
            ttft = time.perf_counter() - t0
        if gen is not None and gen.done:
            break
    engine.close(op.result)
    return ttft, engine.page_stats()["prefix_hit_tokens"] - hits0


def _health(url: str, within: float = 30.0) -> dict:
    """The server's /health once its engine holds nothing (its pool figures are renewed then)."""
    import urllib.request
    t_end = time.perf_counter() + within
    while True:
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            h = json.loads(r.read())
        if h["running_jobs"] == 0 and h["slots_used"] == 0 or time.perf_counter() > t_end:
            return h
        time.sleep(0.005)


def _http_ttft(conn, url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    """(TTFT s, prefix-hit tokens) of one greedy streamed request through the server on the
    keep-alive http.client connection `conn`: request sent -> the first event carrying a token's
    text (the stream is read to its end, untimed)."""
    hits0 = _health(url)["prefix_hit_tokens"]
    body = json.dumps(dict(model=model, prompt=prompt, max_tokens=PREFIX_NEW_TOKENS, temperature=0,
                           stream=True)).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
    ttft = None
    while True:
        line = r.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if ttft is None and line.startswith(b"data: {"):
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                ttft = time.perf_counter() - t0
    r.read()
    return ttft, _health(url)["prefix_hit_tokens"] - hits0


def prefix_bench(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of prefix-cache hits vs misses, in-process and through the server (the module
    docstring's --prefix), printed and written to --out."""
    import http.client
    import os
    from urllib.parse import urlsplit

    import jax

    from sprint_jax.errors import UserError
    from sprint_jax.infer.engine import Engine
    from sprint_jax.serve import Server
    from sprint_jax.serve.server import ENGINE_ON

    for flag, v in (("--system-tokens", args.system_tokens), ("--user-tokens", args.user_tokens),
                    ("--hits", args.hits), ("--repeats", args.repeats), ("--page-size", args.page_size)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    model, tok, name = _model(args.preset, args.seed)
    vocab = model.config.vocab_size
    if args.hits + 1 > vocab - 2:
        raise UserError(f"--hits {args.hits}: the vocabulary ({vocab}) has too few tokens for distinct user parts")
    rounds = _prefix_rounds(1 + args.repeats, args.system_tokens, args.user_tokens, args.hits, vocab, args.seed)
    caps = dict(max_seqs=2, max_children=1, max_branch_tokens=8, decode_chunk=args.decode_chunk, prefill_chunk=512,
                eos_token_ids=[], page_size=args.page_size,
                max_seq_len=args.system_tokens + args.user_tokens + PREFIX_NEW_TOKENS + 8)
    local = Engine(model, tok, **caps)
    server = Server(Engine(model, tok, **caps), name, engine_on_loop=ENGINE_ON[args.engine_on]).start()
    where = urlsplit(server.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    expected = args.system_tokens // args.page_size * args.page_size
    samples: dict[str, dict[str, list]] = {p: dict(miss=[], hit=[], miss_hits=[], hit_hits=[])
                                           for p in ("inproc", "http")}
    try:
        load_before = os.getloadavg()
        for r, prompts in enumerate(rounds):
            for path in ("inproc", "http"):
                for k, prompt in enumerate(prompts):
                    if path == "inproc":
                        ttft, hit = _inproc_ttft(local, prompt)
                    else:
                        ttft, hit = _http_ttft(conn, server.url, name, prompt)
                    if r == 0:                          # the untimed round: compiles
                        continue
                    kind = "miss" if k == 0 else "hit"
                    samples[path][kind].append(1000 * ttft)
                    samples[path][kind + "_hits"].append(hit)
        load_after = os.getloadavg()
        pools = dict(inproc=local.page_stats(), http=_health(server.url))
    finally:
        conn.close()
        server.stop()
    out: dict[str, Any] = dict(model=name, backend=jax.default_backend(), system_tokens=args.system_tokens,
                               user_tokens=args.user_tokens, hits_per_round=args.hits, rounds=args.repeats,
                               page_size=args.page_size, prefill_chunk=caps["prefill_chunk"],
                               decode_chunk=args.decode_chunk, expected_hit_tokens=expected,
                               loadavg=dict(before=load_before, after=load_after), rows=[])
    for path, x in samples.items():
        miss, hit = np.asarray(x["miss"]), np.asarray(x["hit"])
        out["rows"].append(dict(
            path=path, miss_best_ms=float(miss.min()), miss_median_ms=float(np.median(miss)),
            hit_best_ms=float(hit.min()), hit_median_ms=float(np.median(hit)),
            hit_over_miss=float(np.median(hit) / np.median(miss)),
            hits_as_expected=all(h == 0 for h in x["miss_hits"]) and all(h == expected for h in x["hit_hits"]),
            evicted_pages=int(pools[path]["evicted_pages"]), samples_ms=dict(miss=x["miss"], hit=x["hit"]),
            hit_tokens=dict(miss=x["miss_hits"], hit=x["hit_hits"])))
    _prefix_report(out)
    _write_json(out, args.out)
    return out


def _prefix_report(out: dict) -> None:
    print(f"model {out['model']} on {out['backend']}; system prompt {out['system_tokens']} tokens + "
          f"{out['user_tokens']} own tokens per request, {out['hits_per_round']} hits after each miss, "
          f"{out['rounds']} rounds; page {out['page_size']}, prefill chunk {out['prefill_chunk']}, decode chunk "
          f"{out['decode_chunk']}; load average {out['loadavg']['before'][0]:.1f} -> {out['loadavg']['after'][0]:.1f}")
    print("Time to first token, ms (inproc: open -> the step that made the first token on an Engine; http: "
          "http.client streaming through `sprint-jax serve`); hits: every miss took 0 tokens from the cache "
          f"and every hit {out['expected_hit_tokens']} (the system prompt's whole pages)")
    print(f"{'path':<8}{'miss best':>11}{'miss p50':>10}{'hit best':>10}{'hit p50':>9}{'hit/miss':>10}"
          f"{'hits':>7}{'evicted':>9}")
    for r in out["rows"]:
        print(f"{r['path']:<8}{r['miss_best_ms']:>11.2f}{r['miss_median_ms']:>10.2f}{r['hit_best_ms']:>10.2f}"
              f"{r['hit_median_ms']:>9.2f}{r['hit_over_miss']:>10.3f}{('ok' if r['hits_as_expected'] else 'WRONG'):>7}"
              f"{r['evicted_pages']:>9}")


def _write_json(out: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"written: {path}")


def serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The rows of the module docstring (throughput, capacity, fork bytes, latency model), printed
    and written to --out."""
    import jax

    from sprint_jax.errors import UserError

    conc = [int(x) for x in (args.concurrency or ("1,4,16" if args.quick else "1,4,16,64")).split(",")]
    n_problems = args.problems or (32 if args.quick else 128)
    caps = [int(x) for x in args.capacities.split(",")]
    if min(conc) < 1 or n_problems < 1 or args.repeats < 1 or min(caps) <= args.used:
        raise UserError("--concurrency, --problems, --repeats must be >= 1 and every capacity > --used")
    if args.model_context < 1 or (args.sequential_tokens is not None and args.sequential_tokens < 1):
        raise UserError("--model-context and --sequential-tokens must be >= 1")
    s = dict(prompt_len=args.prompt_len, planner_tokens=args.planner_tokens, executors=args.executors,
             executor_tokens=args.executor_tokens, final_tokens=args.final_tokens)
    model, tok, name = _model(args.preset, args.seed)
    prompts = _problems(n_problems, s, model.config.vocab_size, args.seed)
    seq_len = s["prompt_len"] + s["planner_tokens"] + s["executors"] * (4 + s["executor_tokens"]) + \
        s["final_tokens"] + 8
    common = dict(max_seq_len=seq_len, max_branch_tokens=4 + 1 + s["executor_tokens"],
                  decode_chunk=args.decode_chunk, prefill_chunk=128, eos_token_ids=[])
    out: dict[str, Any] = dict(model=name, backend=jax.default_backend(), settings=dict(s, problems=n_problems))
    out.update(throughput(model, tok, prompts, s, conc, common, args.repeats))
    out["capacity"] = [capacity_row(model, tok, cap, args.used, common, args.decode_chunk, args.repeats)
                       for cap in caps]
    out["fork_bytes"] = fork_bytes(model, tok, prompts[0], s, common)
    if not args.no_latency_model:
        # the demo's model exactly (its vocabulary too: the unembedding is part of a row's work)
        # unless a preset is named
        lm_model, lm_tok = (model, tok) if args.preset else _demo_model(args.seed, 1)[:2]
        out["latency_model"] = latency_model(lm_model, lm_tok, s, args.model_context, args.repeats,
                                             args.sequential_tokens)
        out["latency_model"]["model"] = name if args.preset else "the demo's (configs/demo.yaml, its vocabulary)"
    _report(out, conc, caps)
    _write_json(out, args.out)
    return out


def throughput(model, tok, prompts: list[list[int]], s: dict, conc: list[int], common: dict,
               repeats: int) -> dict[str, Any]:
    """The throughput rows: the problems on a Engine at each concurrency (`run_batched`), one
    untimed pass each (compiles every shape the timed passes meet; `same_work`: every concurrency
    generated the same tokens), then `repeats` timed passes interleaved. A row keeps the best pass
    and every sample, with this process's CPU seconds (all its threads: on a shared machine other
    processes stretch the wall clock, not it) and the load average around the passes."""
    from sprint_jax.infer.engine import Engine

    engines = {c: Engine(model, tok, max_seqs=c, max_children=max(s["executors"], 1), **common) for c in conc}
    works = {}
    for c, e in engines.items():
        works[c] = []
        run_batched(e, prompts, s, c, works[c])
    out: dict[str, Any] = dict(same_work=all(sorted(w) == sorted(works[conc[0]]) for w in works.values()),
                               loadavg_start=_loadavg(), throughput=[])
    samples: dict[int, list[tuple[float, int, float]]] = {c: [] for c in conc}   # (wall s, tokens, CPU s)
    for _ in range(repeats):
        for c, e in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            n_tok = run_batched(e, prompts, s, c)
            samples[c].append((time.perf_counter() - t0, n_tok, time.process_time() - c0))
    out["loadavg_end"] = _loadavg()
    for c, xs in samples.items():
        wall, n_tok, _ = min(xs)
        out["throughput"].append(dict(path=f"batched@{c}", problems=len(prompts), best_wall_s=wall,
                                      problems_per_s=len(prompts) / wall, tokens_per_s=n_tok / wall,
                                      samples_s=[x[0] for x in xs], best_cpu_s=min(x[2] for x in xs),
                                      cpu_samples_s=[x[2] for x in xs]))
    return out


def capacity_row(model, tok, cap: int, used: int, common: dict, chunk: int, repeats: int) -> dict[str, Any]:
    """One sequence's decode step at used length `used` in a Engine of capacity `cap`: the
    sequence is prefilled once; each timed call decodes `chunk` or 8 x `chunk` tokens and rolls
    back (truncate); the step is their difference per token (`_difference_timing`)."""
    from sprint_jax.infer.engine import Engine

    prompt = [int(x) for x in np.random.default_rng(1).integers(2, model.config.vocab_size, used)]
    be = Engine(model, tok, max_seqs=1, max_children=1, **dict(common, max_seq_len=cap, max_branch_tokens=16))
    op = be.open(prompt)
    be.run([op])
    seq = op.result

    def decode(n):
        g = be.generate(seq, n)
        be.run([g])
        be.truncate(seq, used)                   # back to the used length for the next call
    step, walls = _difference_timing(decode, chunk, 8 * chunk, repeats)
    return dict(capacity=cap, used=used, batched_step_ms=1000 * step if step > 0 else None, batched_samples_s=walls)


MODEL_LO, MODEL_HI = 8, 64        # the latency model's two call lengths (one decode call each)


def _difference_timing(fn, lo: int, hi: int, repeats: int) -> tuple[float, dict[int, list[float]]]:
    """fn(lo) and fn(hi) once each untimed (compiles), then repeats + 2 timed calls of each,
    alternating. Returns (seconds per unit of n: (best(hi) - best(lo)) / (hi - lo), which cancels
    what every call costs alike, and the samples {n: [s, ...]})."""
    for n in (lo, hi):
        fn(n)
    walls: dict[int, list[float]] = {lo: [], hi: []}
    for _ in range(repeats + 2):
        for n in (lo, hi):
            t0 = time.perf_counter()
            fn(n)
            walls[n].append(time.perf_counter() - t0)
    return (min(walls[hi]) - min(walls[lo])) / (hi - lo), walls


def step_costs(model, tok, k: int, context: int, repeats: int) -> dict[str, Any]:
    """One row's decode step, a fork of k children's decode step (the same context) and the
    fixed cost of an engine call, on a one-sequence Engine whose decode chunk holds a whole
    call: each path decodes MODEL_LO and MODEL_HI tokens in one call, alternating, best of
    repeats + 2; step = the difference per token, per call = the short call minus its steps."""
    from sprint_jax.infer.engine import Engine

    kw = dict(max_seq_len=context + MODEL_HI + 8, max_branch_tokens=MODEL_HI + 8, decode_chunk=MODEL_HI,
              prefill_chunk=128, eos_token_ids=[])
    e = Engine(model, tok, max_seqs=1, max_children=k, **kw)
    prompt = [int(x) for x in np.random.default_rng(2).integers(2, model.config.vocab_size, context)]
    op = e.open(prompt)
    e.run([op])
    seq = op.result

    def one(n):
        g = e.generate(seq, n)
        e.run([g])
        e.truncate(seq, context)                 # back to the same context for the next call

    def fork(n):
        f = e.fork(seq, [[]] * k, n)             # k children of the context, n tokens each
        e.run([f])
    out: dict[str, Any] = {"context": context, "children": k}
    for label, fn in (("one_row", one), ("fork", fork)):
        calls0 = e.stats["decode_calls"]
        step, walls = _difference_timing(fn, MODEL_LO, MODEL_HI, repeats)
        if e.stats["decode_calls"] - calls0 != 2 * (repeats + 3):       # the untimed pair, then the timed ones
            raise RuntimeError("latency model: a timed path took more than one decode call")
        out[f"{label}_step_ms"] = 1000 * step
        out[f"{label}_call_ms"] = 1000 * (min(walls[MODEL_LO]) - MODEL_LO * step)
        out[f"{label}_samples_s"] = {str(n): w for n, w in walls.items()}
    return out


def matmul_times(config, rows: list[int], repeats: int, iters: int = 50) -> dict[int, float]:
    """ms per pass of the model's matmuls alone at each row count: every layer's q, k, v, o,
    gate, up and down projections and the unembedding, chained so none is dead code, `iters`
    passes in one compiled loop (best of repeats + 2)."""
    import jax
    import jax.numpy as jnp

    h, d = config.hidden_size, config.head_dim
    shapes = [(h, config.num_attention_heads * d), (h, config.num_key_value_heads * d),
              (h, config.num_key_value_heads * d), (config.num_attention_heads * d, h),
              (h, config.intermediate_size), (h, config.intermediate_size), (config.intermediate_size, h)]
    keys = iter(jax.random.split(jax.random.key(0), 7 * config.num_hidden_layers + 1))
    layers = [[jax.random.normal(next(keys), sh, jnp.float32) * 0.02 for sh in shapes]
              for _ in range(config.num_hidden_layers)]
    emb = jax.random.normal(next(keys), (h, config.vocab_size), jnp.float32) * 0.02

    @jax.jit
    def passes(x):
        def body(_, x):
            for wq, wk, wv, wo, wg, wu, wd in layers:
                side = (x @ wk).sum(-1, keepdims=True) + (x @ wv).sum(-1, keepdims=True)
                x = x + (x @ wq) @ wo + 1e-6 * side
                x = x + ((x @ wg) * (x @ wu)) @ wd
            return x + 1e-6 * (x @ emb).sum(-1, keepdims=True)
        return jax.lax.fori_loop(0, iters, body, x)
    out = {}
    for m in rows:
        x = jnp.ones((m, h), jnp.float32)
        jax.block_until_ready(passes(x))
        best = float("inf")
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            jax.block_until_ready(passes(x))
            best = min(best, time.perf_counter() - t0)
        out[m] = 1000 * best / iters
    return out


def latency_ratio(one_row_steps: int, fork_steps: int, sequential_steps: int, c1: float, ck: float) -> float:
    """Parallel / sequential latency of a problem when an engine call costs nothing but its steps:
    (one-row steps x c1 + fork steps x ck) / (sequential one-row steps x c1)."""
    return (one_row_steps * c1 + fork_steps * ck) / (sequential_steps * c1)


def latency_model(model, tok, s: dict, context: int, repeats: int, sequential_tokens: int | None) -> dict[str, Any]:
    """The latency-model rows (see the module docstring)."""
    k = max(s["executors"], 1)
    costs = step_costs(model, tok, k, context, repeats)
    w = k                                              # rows the fork's step computes (max_children = k)
    mm = matmul_times(model.config, sorted({1, w}), repeats)
    c1, ck = costs["one_row_step_ms"], costs["fork_step_ms"]
    if c1 <= 0 or ck <= 0:
        raise RuntimeError(f"latency model: a step timed <= 0 ms (one row {c1:.4f}, fork {ck:.4f}): the machine "
                           "was too noisy for the difference of two calls; rerun with more --repeats")
    one_row = s["planner_tokens"] + s["final_tokens"]
    forked = 4 + s["executor_tokens"]                  # the forced 4-token opening, then the tokens
    seq = sequential_tokens or (s["planner_tokens"] + k * s["executor_tokens"] + s["final_tokens"])
    floor_ck = c1 + max(mm[w] - mm[1], 0.0)
    return dict(costs, fork_rows=w, matmul_ms={str(m): t for m, t in mm.items()},
                counts=dict(one_row_steps=one_row, fork_steps=forked, sequential_steps=seq),
                ratio_engine=latency_ratio(one_row, forked, seq, c1, ck),
                ratio_compute_floor=latency_ratio(one_row, forked, seq, c1, floor_ck),
                ratio_no_fork_cost=latency_ratio(one_row, forked, seq, c1, c1),
                one_row_step_for_target_ms=_c1_for(0.75, one_row, forked, seq, floor_ck - c1))


def _c1_for(target: float, one_row: int, forked: int, seq: int, extra: float) -> float | None:
    """The one-row step cost at which the compute-floor ratio reaches `target`:
    (a c1 + b (c1 + extra)) / (n c1) <= target  <=>  c1 >= b extra / (target n - a - b)."""
    room = target * seq - one_row - forked
    return forked * extra / room if room > 0 else None


def _loadavg() -> float | None:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def _report(out: dict, conc: list[int], caps: list[int]) -> None:
    print(f"model {out['model']} on {out['backend']}; {out['settings']}")
    print(f"load average {out.get('loadavg_start')} -> {out.get('loadavg_end')}; same work at every concurrency "
          f"(identical generations): {out.get('same_work')}")
    print(f"{'path':<14}{'problems/s':>12}{'tokens/s':>12}{'wall s':>10}{'cpu s':>10}")
    rows = {r["path"]: r for r in out["throughput"]}
    for r in out["throughput"]:
        print(f"{r['path']:<14}{r['problems_per_s']:>12.2f}{r['tokens_per_s']:>12.1f}{r['best_wall_s']:>10.2f}"
              f"{r['best_cpu_s']:>10.2f}")
    targets = {}
    one = rows.get(f"batched@{min(conc)}")
    for c in conc:
        r = rows.get(f"batched@{c}")
        if one and r:
            targets[f"throughput concurrency {c} / {min(conc)}"] = r["problems_per_s"] / one["problems_per_s"]
    for c in conc:
        r = rows.get(f"batched@{c}")
        if one and r and c != min(conc):
            targets[f"  the same in process CPU time ({c} / {min(conc)})"] = one["best_cpu_s"] / r["best_cpu_s"]
    print(f"\n{'capacity':<10}{'used':>6}{'batched step ms':>18}")
    for r in out["capacity"]:
        b = r["batched_step_ms"]
        print(f"{r['capacity']:<10}{r['used']:>6}{(f'{b:.3f}' if b else 'n/a'):>18}")
    cap_rows = {r["capacity"]: r for r in out["capacity"]}
    lo, hi = min(caps), max(caps)
    a, b = cap_rows[lo]["batched_step_ms"], cap_rows[hi]["batched_step_ms"]
    if a and b:
        targets[f"batched step capacity {hi} / {lo}"] = b / a
    out["ratios"] = targets
    fb = out.get("fork_bytes")
    if fb:
        print(f"\nfork of {len(fb['child_slots'])} children, read off the KV pool: {fb['measured_bytes']} bytes "
              f"written ({fb['parent_slots']} parent + {sum(fb['child_slots'])} child token slots); prefix + n x suffix "
              f"+ the copies of the partly filled page = {fb['expected_bytes']} ({fb['prefix_slots']} + "
              f"{fb['suffix_slots']} + {fb['copied_page_slots']} slots, page {fb['page_size']}): "
              f"{'exact' if fb['exact'] else 'DIFFERENT'}; a per-child prefix copy would hold {fb['copied_prefix_bytes']}")
    lm = out.get("latency_model")
    if lm:
        c = lm["counts"]
        mm = lm["matmul_ms"]
        print(f"\nlatency model ({lm['model']}; one sequence, context {lm['context']}, one decode call per path):")
        print(f"  decode step: one row {lm['one_row_step_ms']:.3f} ms; a fork of {lm['children']} children "
              f"({lm['fork_rows']} rows) {lm['fork_step_ms']:.3f} ms ({lm['fork_step_ms'] / lm['one_row_step_ms']:.2f}x); "
              f"per engine call {lm['one_row_call_ms']:.3f} / {lm['fork_call_ms']:.3f} ms")
        print(f"  the model's matmuls alone: 1 row {mm['1']:.3f} ms, {lm['fork_rows']} rows {mm[str(lm['fork_rows'])]:.3f} ms")
        print(f"  problem: parallel {c['one_row_steps']} one-row + {c['fork_steps']} fork steps; sequential "
              f"{c['sequential_steps']} one-row steps. Parallel / sequential latency with no per-call cost:")
        print(f"    this engine's fork step {lm['ratio_engine']:.3f}; compute floor (fork = one row + the extra "
              f"rows' matmuls) {lm['ratio_compute_floor']:.3f}; extra rows free {lm['ratio_no_fork_cost']:.3f}")
        need = lm["one_row_step_for_target_ms"]
        print(f"    the compute floor reaches 0.75 only if a one-row step costs >= "
              f"{(f'{need:.3f} ms' if need is not None else 'never (the token counts alone exceed it)')}")
    print("\nratios (targets: concurrency 16 / 1 >= 6; batched step 8192 / 512 <= 1.2):")
    for k, v in targets.items():
        print(f"  {k:<44}{v:>8.2f}")
