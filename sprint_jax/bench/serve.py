"""`sprint-jax bench serve`: many SPRINT-shaped runs at once on the batched engine (issue 13).

Model: random weights in the demo's model shape (`demo-size`: sprint_jax.demo.DemoModel, vocabulary
512) by default; --preset bench-tiny or any configs/model_NAME.json.

Rows, all measured in one run:
  throughput   problems/s and generated tokens/s at each --concurrency on `BatchEngine`, and the
               same problems one after another on the single-run `Engine` (the current per-run
               path), on identical work. A problem is a SPRINT run with scripted stage lengths:
               prompt (--prompt-len tokens) -> planner call (--planner-tokens) -> fork of
               --executors executors (forced 4-token opening, --executor-tokens each) -> sync
               (the executors' tokens prefilled onto the planner) -> final planner call
               (--final-tokens). Lengths are exact: the engines run with no EOS and no stop
               strings, greedy. Random weights, so what a model would write does not matter.
  capacity     one sequence's decode step at used length --used (256) in a cache of capacity 512
               vs 8192, for the batched engine (attends over the bucketed used length) and the
               single-run engine (attends over its capacity). The sequence is prefilled once;
               each timed call decodes N tokens and rolls back (truncate), and
               step_ms = (wall(8 chunks) - wall(1 chunk)) / (7 chunks) cancels per-call set-up.
  fork bytes   a fork of --executors children on a fresh engine: the KV bytes written, read off the
               cache arrays (slots whose K or V is non-zero), against prefix + n x suffix (the
               prefix stored once) and against what per-child prefix copies would hold.
  --http       (issue 16) instead: the same plain requests (--prompt-len ids -> each of
               --max-tokens, greedy) through `sprint-jax serve` at each --concurrency (default
               1,8) vs in-process on an identical BatchEngine, with two clients: a minimal
               keep-alive http.client (what HTTP itself costs) and the openai client (what users
               run; its own Python work adds to the latency). Per-request p50 latency, the HTTP
               overhead (target: < 10% of the in-process latency on the demo-sized model),
               requests/s, and the load average. Every path must return the same texts.
Every point runs once untimed first (compiles every shape it meets; checks that every concurrency
generates identical tokens: the same work), then --repeats times interleaved; the best is reported
and every sample is kept in the JSON. Each sample also records this process's CPU seconds (all its
threads) and the run the load average: on a shared machine other processes stretch the wall clock
but not the CPU time, so the CPU-time ratio is printed next to the wall-clock one.

Targets (issue 13, 2-core CPU): throughput at concurrency 16 >= 6x concurrency 1; decode step at
used length 256: capacity 8192 <= 1.2x capacity 512.

Run:
    sprint-jax bench serve --quick --out bench_serve.json     # CPU, a few minutes
    sprint-jax bench serve --preset r1-distill-qwen-7b        # accelerator, random weights
    sprint-jax bench serve --http --problems 24 --repeats 2   # HTTP vs in-process, a minute
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
    parser.add_argument("--prompt-len", type=int, default=48, help="prompt tokens per problem")
    parser.add_argument("--planner-tokens", type=int, default=24, help="first planner call's tokens")
    parser.add_argument("--executors", type=int, default=3, help="executors forked per problem")
    parser.add_argument("--executor-tokens", type=int, default=24, help="tokens each executor decodes")
    parser.add_argument("--final-tokens", type=int, default=8, help="final planner call's tokens")
    parser.add_argument("--used", type=int, default=256, help="capacity row: used length")
    parser.add_argument("--capacities", default="512,8192", help="capacity row: cache capacities")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per point (best reported)")
    parser.add_argument("--decode-chunk", type=int, default=16, help="decode steps per host round trip")
    parser.add_argument("--no-single", action="store_true", help="skip the single-run Engine rows")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    h = parser.add_argument_group("--http: the same plain requests through `sprint-jax serve` vs in-process")
    h.add_argument("--http", action="store_true",
                   help="measure the HTTP server's per-request overhead instead (model: the demo's size "
                        "unless --preset)")
    h.add_argument("--max-tokens", default="32,128",
                   help="--http: tokens generated per request, comma-separated (default 32,128: a short "
                        "request, and about the length of a whole SPRINT completion of the demo's model: "
                        "plans of <= 48 tokens, 4 executors of ~15)")


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
    """The problems on the BatchEngine, `concurrency` at a time; returns generated tokens.
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


def run_single(engine, prompts: list[list[int]], s: dict) -> int:
    """The same problems one after another on the single-run Engine."""
    tokens = 0
    for p in prompts:
        state = engine.prefill(p)
        g = engine.generate(state, s["planner_tokens"])
        gens = engine.decode_branches(state, _openings(s), s["executor_tokens"], mode="shared")
        engine.extend(state, [t for o, b in zip(_openings(s), gens) for t in o + b.tokens])
        f = engine.generate(state, s["final_tokens"])
        tokens += len(g.tokens) + sum(len(b.tokens) for b in gens) + len(f.tokens)
    return tokens


def fork_bytes(model, tok, prompt: list[int], s: dict, common: dict) -> dict[str, Any]:
    """A fork's KV footprint read off the cache arrays: on a fresh engine (zero cache), open the
    prompt and fork --executors children (4-token openings, --executor-tokens each); every slot
    whose K or V is non-zero anywhere (layers, heads, dims) was written. The bytes written must be
    exactly prefix + sum of the children's suffixes (the prefix stored once), never a copy."""
    import jax

    from sprint_jax.infer.batch import BatchEngine
    e = BatchEngine(model, tok, max_seqs=1, max_children=max(s["executors"], 1), **common)
    op = e.open(prompt)
    e.run([op])
    seq = op.result
    fork = e.fork(seq, _openings(s), s["executor_tokens"])
    e.run([fork])
    pk, pv, ck, cv = jax.device_get((e.cache.pk, e.cache.pv, e.cache.ck, e.cache.cv))

    def written(k, v):                      # [L, N, C, H, D] -> slots written, per row
        return ((k != 0).any(axis=(0, 3, 4)) | (v != 0).any(axis=(0, 3, 4))).sum(axis=1)
    per_slot = 2 * pk.shape[0] * pk.shape[3] * pk.shape[4] * pk.dtype.itemsize   # K and V, all layers
    parent_slots = int(written(pk, pv).sum())
    child_slots = [int(x) for x in written(ck, cv)[: len(fork.result)]]
    prefix = seq.length                                   # the context's KV entries
    suffixes = [len(o) + len(g.tokens) for o, g in zip(_openings(s), fork.result)]   # pending + opening + generated - 1
    measured = per_slot * (parent_slots + sum(child_slots))
    expected = per_slot * (prefix + sum(suffixes))
    return dict(bytes_per_slot=per_slot, parent_slots=parent_slots, child_slots=child_slots,
                prefix_slots=prefix, suffix_slots=suffixes, measured_bytes=measured,
                prefix_plus_suffixes_bytes=expected, copied_prefix_bytes=per_slot * (len(suffixes) * prefix + sum(suffixes)),
                exact=measured == expected)


def run_serve_bench(args: argparse.Namespace) -> int:
    if args.http:
        http_bench(args)
    else:
        serve_bench(args)
    return 0


# ---------------------------------------------------------------------------------------------
# --http: the OpenAI-compatible server vs the same engine in-process (issue 16)
# ---------------------------------------------------------------------------------------------
def _demo_model(seed: int):
    """Random weights in the shape of the demo's model (configs/demo.yaml `model`)."""
    import jax
    import yaml

    from sprint_jax.bench.decode import BENCH_TINY, synthetic_tokenizer
    from sprint_jax.config import CONFIG_DIR
    from sprint_jax.model import Qwen2, Qwen2Config, init_params

    dims = yaml.safe_load((CONFIG_DIR / "demo.yaml").read_text())["model"]
    config = Qwen2Config(**{**BENCH_TINY, **dims}, param_dtype="float32", dtype="float32")
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))
    return Qwen2(config, params=params), synthetic_tokenizer(config.vocab_size), "demo-size"


def _inproc(engine, prompts: list[list[int]], max_new: int, concurrency: int):
    """Plain requests (open -> generate -> close) on a BatchEngine in this thread, `concurrency` in
    flight; per-request latency from submission to its result. Returns (wall, latencies, texts)."""
    todo = list(range(len(prompts)))[::-1]
    live: dict[int, dict] = {}
    lat: list[float] = [0.0] * len(prompts)
    texts: list[str] = [""] * len(prompts)
    t_start = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            i = todo.pop()
            live[i] = dict(op=engine.open(prompts[i]), t=time.perf_counter())
        engine.step()
        for i in list(live):
            st = live[i]
            if not st["op"].done:
                continue
            if st["op"].kind == "open":
                st["op"] = engine.generate(st["op"].result, max_new)
                continue
            lat[i] = time.perf_counter() - st["t"]
            texts[i] = st["op"].result.text
            engine.close(st["op"].seq)
            del live[i]
    return time.perf_counter() - t_start, lat, texts


def _over_http(url: str, model: str, prompts: list[list[int]], max_new: int, concurrency: int, client: str):
    """The same requests through the server, `concurrency` client threads, from a separate process
    (as clients are: in this one they would share the server's GIL). client: "openai" (the openai
    package, what users run) or "raw" (one keep-alive http.client connection per thread, JSON in
    and out: what the HTTP round trip itself costs, without the openai package's own work)."""
    import subprocess
    import sys

    job = json.dumps(dict(url=url, model=model, prompts=prompts, max_new=max_new, concurrency=concurrency,
                          client=client))
    proc = subprocess.run([sys.executable, "-c", "from sprint_jax.bench.serve import _client_main; _client_main()"],
                          input=job, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the HTTP client process failed: {proc.stderr.strip()[-2000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return r["wall"], r["lat"], r["texts"]


def _client_main() -> None:
    """The client process of `_over_http`: a job on stdin, the result as one JSON line."""
    import sys

    job = json.loads(sys.stdin.read())
    wall, lat, texts = _clients(job["url"], job["model"], job["prompts"], job["max_new"], job["concurrency"],
                                job["client"])
    print(json.dumps(dict(wall=wall, lat=lat, texts=texts)))


def _clients(url: str, model: str, prompts: list[list[int]], max_new: int, concurrency: int, client: str):
    import http.client
    import threading
    from urllib.parse import urlsplit

    import openai

    lat: list[float] = [0.0] * len(prompts)
    texts: list[str] = [""] * len(prompts)
    errors: list[str] = []
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()
    where = urlsplit(url)

    def make():
        if client == "openai":
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            c.models.list()                           # connect (not timed)
            return c
        c = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
        c.request("GET", "/v1/models")
        c.getresponse().read()
        return c

    def ask(c, prompt) -> str:
        if client == "openai":
            return c.completions.create(model=model, prompt=prompt, max_tokens=max_new, temperature=0).choices[0].text
        body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_new, temperature=0))
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        data = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data}")
        return data["choices"][0]["text"]

    conns = [make() for _ in range(concurrency)]

    def client_thread(c):
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                break
            t = time.perf_counter()
            try:
                texts[i] = ask(c, prompts[i])
            except Exception as e:                   # noqa: BLE001  (reported below)
                errors.append(f"{type(e).__name__}: {e}")
                continue
            lat[i] = time.perf_counter() - t
        c.close()

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client_thread, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} HTTP request(s) failed, e.g. {errors[0]}")
    return time.perf_counter() - t_start, lat, texts


HTTP_PATHS = ("inproc", "raw", "openai")


def http_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Per (max_tokens, concurrency): p50 / mean request latency and requests/s in-process, over
    HTTP with a minimal client (raw) and with the openai client, and the overhead each HTTP path
    adds per request (target: < 10% of the in-process p50)."""
    import os

    import jax

    from sprint_jax.errors import UserError
    from sprint_jax.infer.batch import BatchEngine
    from sprint_jax.serve import Server

    try:
        conc = [int(x) for x in (args.concurrency or "1,8").split(",")]
        lengths = [int(x) for x in str(args.max_tokens).split(",")]
    except ValueError:
        raise UserError("--concurrency and --max-tokens take comma-separated integers") from None
    n = args.problems or (16 if args.quick else 32)
    if min(conc) < 1 or n < 1 or args.repeats < 1 or min(lengths) < 1:
        raise UserError("--concurrency, --problems, --repeats and --max-tokens must be >= 1")
    model, tok, name = _model(args.preset, args.seed) if args.preset else _demo_model(args.seed)
    s = dict(prompt_len=args.prompt_len)
    prompts = _problems(n, s, model.config.vocab_size, args.seed)
    caps = dict(max_seqs=max(conc), max_children=1, max_seq_len=args.prompt_len + max(lengths) + 8,
                max_branch_tokens=8, decode_chunk=args.decode_chunk, prefill_chunk=128, eos_token_ids=[])
    local = BatchEngine(model, tok, **caps)
    served = BatchEngine(model, tok, **caps)          # its own cache; the jitted steps are shared
    server = Server(served, name).start()
    out: dict[str, Any] = dict(model=name, backend=jax.default_backend(), requests=n, prompt_len=args.prompt_len,
                               http_impl=server.http_impl, rows=[])

    def one(path: str, m: int, c: int):
        if path == "inproc":
            return _inproc(local, prompts, m, c)
        server.worker.overheads.clear()
        wall, lat, texts = _over_http(server.url, name, prompts, m, c, path)
        server_side[path].extend(server.worker.overheads)
        return wall, lat, texts

    server_side: dict[str, list[float]] = {p: [] for p in HTTP_PATHS[1:]}
    try:
        # compile every shape on every path: HTTP requests arrive staggered, so their batches take
        # more shapes than the in-process ones (every row count bucket up to the concurrency)
        for m in lengths:
            for c in conc:
                for path in HTTP_PATHS:
                    for _ in range(2 if path != "openai" else 1):
                        one(path, m, c)
        load_before = os.getloadavg()
        for m in lengths:
            for c in conc:
                runs: dict[str, list] = {p: [] for p in HTTP_PATHS}
                for v in server_side.values():
                    v.clear()
                for _ in range(args.repeats):         # interleaved: the paths see the same machine
                    for path in HTTP_PATHS:
                        runs[path].append(one(path, m, c))
                for path in HTTP_PATHS[1:]:
                    if runs[path][0][2] != runs["inproc"][0][2]:
                        raise RuntimeError(f"the server's texts ({path} client) differ from the in-process "
                                           "engine's: not the same work")
                row: dict[str, Any] = dict(max_tokens=m, concurrency=c)
                for path, rs in runs.items():
                    lat = np.concatenate([np.array(r[1]) for r in rs])
                    row[path] = dict(p50_ms=1000 * float(np.median(lat)), mean_ms=1000 * float(lat.mean()),
                                     min_ms=1000 * float(lat.min()),
                                     p99_ms=1000 * float(np.percentile(lat, 99)),
                                     requests_per_s=n / min(r[0] for r in rs), walls_s=[r[0] for r in rs])
                for path in HTTP_PATHS[1:]:
                    # the server's own share, timed inside it (handler time outside the engine
                    # thread): unlike the end-to-end difference it does not move with the engine's
                    # step times, which the machine's load changes run to run
                    row[path]["server_ms_p50"] = 1000 * float(np.median(server_side[path]))
                    over = row[path]["p50_ms"] - row["inproc"]["p50_ms"]
                    row[path]["overhead_ms_p50"] = over
                    row[path]["overhead_pct_p50"] = 100 * over / row["inproc"]["p50_ms"]
                out["rows"].append(row)
        out["loadavg"] = dict(before=load_before, after=os.getloadavg())
    finally:
        server.stop()
    print(f"model {name} on {out['backend']}; {n} requests of {args.prompt_len} prompt tokens, greedy; "
          f"uvicorn http={out['http_impl']}; load average {out['loadavg']['before'][0]:.1f} -> "
          f"{out['loadavg']['after'][0]:.1f}")
    print("p50 latency per request (ms); over = HTTP p50 - in-process p50; raw = a keep-alive http.client "
          "connection, openai = the openai client; srv = the server's own time per request outside the engine "
          "thread (timed inside it), srv % = of the in-process p50")
    print(f"{'tokens':>6}{'conc':>5}{'inproc':>9}{'raw':>9}{'over ms':>9}{'over %':>8}{'openai':>9}{'over ms':>9}"
          f"{'over %':>8}{'srv ms':>8}{'srv %':>7}{'inproc req/s':>14}{'raw req/s':>11}{'openai req/s':>14}")
    for r in out["rows"]:
        i, a, o = r["inproc"], r["raw"], r["openai"]
        srv = a["server_ms_p50"]
        print(f"{r['max_tokens']:>6}{r['concurrency']:>5}{i['p50_ms']:>9.2f}{a['p50_ms']:>9.2f}"
              f"{a['overhead_ms_p50']:>9.2f}{a['overhead_pct_p50']:>8.1f}{o['p50_ms']:>9.2f}{o['overhead_ms_p50']:>9.2f}"
              f"{o['overhead_pct_p50']:>8.1f}{srv:>8.2f}{100 * srv / i['p50_ms']:>7.1f}{i['requests_per_s']:>14.1f}"
              f"{a['requests_per_s']:>11.1f}{o['requests_per_s']:>14.1f}")
    print("target (issue 16): HTTP overhead per request < 10% of the in-process latency")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"written: {args.out}")
    return out


def serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    from sprint_jax.errors import UserError
    from sprint_jax.infer import Engine
    from sprint_jax.infer.batch import BatchEngine

    conc = [int(x) for x in (args.concurrency or ("1,4,16" if args.quick else "1,4,16,64")).split(",")]
    n_problems = args.problems or (32 if args.quick else 128)
    caps = [int(x) for x in args.capacities.split(",")]
    if min(conc) < 1 or n_problems < 1 or args.repeats < 1 or min(caps) <= args.used:
        raise UserError("--concurrency, --problems, --repeats must be >= 1 and every capacity > --used")
    s = dict(prompt_len=args.prompt_len, planner_tokens=args.planner_tokens, executors=args.executors,
             executor_tokens=args.executor_tokens, final_tokens=args.final_tokens)
    model, tok, name = _model(args.preset, args.seed)
    prompts = _problems(n_problems, s, model.config.vocab_size, args.seed)
    seq_len = s["prompt_len"] + s["planner_tokens"] + s["executors"] * (4 + s["executor_tokens"]) + \
        s["final_tokens"] + 8
    common = dict(max_seq_len=seq_len, max_branch_tokens=4 + 1 + s["executor_tokens"],
                  decode_chunk=args.decode_chunk, prefill_chunk=128, eos_token_ids=[])
    out: dict[str, Any] = dict(model=name, backend=jax.default_backend(), settings=dict(s, problems=n_problems),
                               throughput=[], capacity=[])
    engines = {c: BatchEngine(model, tok, max_seqs=c, max_children=max(s["executors"], 1), **common) for c in conc}
    single = None if args.no_single else Engine(model, tok, max_branches=max(s["executors"], 1), **common)
    # compile every shape once: an untimed pass over the same work (the scheduler meets the same
    # batch shapes again in the timed passes), then interleave the timed repeats. The untimed pass
    # also checks that every concurrency does the same work: identical generations (greedy).
    works = {}
    for c, e in engines.items():
        works[c] = []
        run_batched(e, prompts, s, c, works[c])
    out["same_work"] = all(sorted(w) == sorted(works[conc[0]]) for w in works.values())
    if single is not None:
        run_single(single, prompts[:1], s)
    # each sample: wall s, generated tokens, this process's CPU s (all threads; on a shared machine
    # the CPU time is what the run itself cost: other processes' load stretches the wall, not it)
    samples: dict[str, list[tuple[float, int, float]]] = {}
    out["loadavg_start"] = _loadavg()
    for _ in range(args.repeats):
        for c, e in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            n_tok = run_batched(e, prompts, s, c)
            samples.setdefault(f"batched@{c}", []).append((time.perf_counter() - t0, n_tok, time.process_time() - c0))
        if single is not None:
            t0, c0 = time.perf_counter(), time.process_time()
            n_tok = run_single(single, prompts, s)
            samples.setdefault("single", []).append((time.perf_counter() - t0, n_tok, time.process_time() - c0))
    out["loadavg_end"] = _loadavg()
    for key, xs in samples.items():
        wall, n_tok, _ = min(xs)
        cpu = min(x[2] for x in xs)
        out["throughput"].append(dict(path=key, problems=n_problems, best_wall_s=wall, problems_per_s=n_problems / wall,
                                      tokens_per_s=n_tok / wall, samples_s=[x[0] for x in xs], best_cpu_s=cpu,
                                      cpu_samples_s=[x[2] for x in xs]))
    # capacity row
    used_prompt = [int(x) for x in np.random.default_rng(1).integers(2, model.config.vocab_size, args.used)]
    n_new = 8 * args.decode_chunk
    for cap in caps:
        kw = dict(common, max_seq_len=cap, max_branch_tokens=16)
        row = dict(capacity=cap, used=args.used)
        be = BatchEngine(model, tok, max_seqs=1, max_children=1, **kw)
        op = be.open(used_prompt)
        be.run([op])
        seq = op.result

        def batched(n, be=be, seq=seq):
            g = be.generate(seq, n)
            be.run([g])
            be.truncate(seq, len(used_prompt))       # back to the used length for the next call
        paths = [("batched", batched)]
        if single is not None:
            se = Engine(model, tok, max_branches=1, **kw)
            state = se.prefill(used_prompt)

            def one(n, se=se, state=state):
                se.generate(state, n)
                se.truncate(state, len(used_prompt))
            paths.append(("single", one))
        lo_n = args.decode_chunk
        for label, fn in paths:
            for n in (lo_n, n_new):
                fn(n)                                  # compile
            walls = {lo_n: [], n_new: []}
            for _ in range(args.repeats + 2):
                for n in (lo_n, n_new):
                    t0 = time.perf_counter()
                    fn(n)
                    walls[n].append(time.perf_counter() - t0)
            step = (min(walls[n_new]) - min(walls[lo_n])) / (n_new - lo_n)
            row[f"{label}_step_ms"] = 1000 * step if step > 0 else None
            row[f"{label}_samples_s"] = walls
        out["capacity"].append(row)
    out["fork_bytes"] = fork_bytes(model, tok, prompts[0], s, common)
    _report(out, conc, caps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"written: {args.out}")
    return out


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
    if "single" in rows and one:
        targets[f"batched@{min(conc)} / single (latency path)"] = one["problems_per_s"] / rows["single"]["problems_per_s"]
    print(f"\n{'capacity':<10}{'used':>6}{'batched step ms':>18}{'single step ms':>16}")
    for r in out["capacity"]:
        b, s = r.get("batched_step_ms"), r.get("single_step_ms")
        print(f"{r['capacity']:<10}{r['used']:>6}{(f'{b:.3f}' if b else 'n/a'):>18}{(f'{s:.3f}' if s else 'n/a'):>16}")
    cap_rows = {r["capacity"]: r for r in out["capacity"]}
    lo, hi = min(caps), max(caps)
    for label in ("batched", "single"):
        a, b = cap_rows[lo].get(f"{label}_step_ms"), cap_rows[hi].get(f"{label}_step_ms")
        if a and b:
            targets[f"{label} step capacity {hi} / {lo}"] = b / a
    out["ratios"] = targets
    fb = out.get("fork_bytes")
    if fb:
        print(f"\nfork of {len(fb['child_slots'])} children, read off the cache arrays: {fb['measured_bytes']} bytes "
              f"written ({fb['parent_slots']} parent + {sum(fb['child_slots'])} child slots); prefix + n x suffix = "
              f"{fb['prefix_plus_suffixes_bytes']} ({fb['prefix_slots']} + {fb['suffix_slots']} slots): "
              f"{'exact' if fb['exact'] else 'DIFFERENT'}; a per-child prefix copy would hold {fb['copied_prefix_bytes']}")
    print("\nratios (issue 13 targets: concurrency 16 / 1 >= 6; batched step 8192 / 512 <= 1.2):")
    for k, v in targets.items():
        print(f"  {k:<44}{v:>8.2f}")
