"""`sprint-jax bench serve`: many SPRINT-shaped runs at once on the batched engine.

Model: random weights in the demo's model shape (`demo-size`: sprint_jax.demo.DemoModel, vocabulary
512) by default; --preset bench-tiny or any configs/model_NAME.json. The latency model runs on the
demo's model exactly (configs/demo.yaml, its tokenizer's vocabulary; random weights) unless --preset.

Rows, all measured in one run:
  throughput   problems/s and generated tokens/s at each --concurrency on `BatchEngine`, and the
               same problems one after another on the single-run `Engine` (the single-run API,
               a layer over the same slot core with one slot: one run at a time), on identical work. A problem is a SPRINT run with scripted stage lengths:
               prompt (--prompt-len tokens) -> planner call (--planner-tokens) -> fork of
               --executors executors (forced 4-token opening, --executor-tokens each) -> sync
               (the executors' tokens prefilled onto the planner) -> final planner call
               (--final-tokens). Lengths are exact: the engines run with no EOS and no stop
               strings, greedy. Random weights, so what a model would write does not matter.
  capacity     one sequence's decode step at used length --used (256) in a cache of capacity 512
               vs 8192, for the batched engine (attends over the bucketed used length) and the
               single-run engine (the same core through the single-run API). The sequence is prefilled once;
               each timed call decodes N tokens and rolls back (truncate), and
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
               cache arrays (slots whose K or V is non-zero), against prefix + n x suffix (the
               prefix stored once) and against what per-child prefix copies would hold.
  --http       instead: plain greedy requests through `sprint-jax serve` vs in-process
               on an identical BatchEngine. Model: the demo's (configs/demo.yaml: its shape, its
               tokenizer, its held-out queries as prompts; random weights) unless --preset. Per
               (--max-tokens, --concurrency): waves of `concurrency` requests submitted at once
               on every path (in-process: opened together; HTTP: one client process and keep-alive
               connection each, sent at one instant), the paths alternating wave by wave, each
               wave on every path the same short idle lead after the last (`wave_lead`). Clients:
               lean (`LeanHTTP`, a raw-socket HTTP/1.1 client as load generators use: what HTTP
               and the server cost), http.client and the openai client (what each adds over lean
               is reported as its own column). HTTP overhead per request = its lean latency
               through the server minus the same request's in-process latency in the same wave
               (median over requests); target: < 10% of the in-process p50 latency. A floor row
               times requests that reach no engine (GET /health, a POST answered 400). Every path
               must return the same texts. Beside each concurrency-1 row, the stack floor: the
               same lean requests to two servers that run none of our code and no engine, each
               answering after a busy wait of the row's in-process p50 with a reply of the row's
               size: a bare ASGI app on uvicorn as `sprint-jax serve` configures it (what the
               issue's stack costs by itself) and a blocking-socket server with no framework
               (Python and the loopback alone). --engine-on picks where the server's engine steps;
               --compare-engine-on adds a second server with it on the other place (lean client,
               same waves): the two side by side in one run.
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
    parser.add_argument("--no-single", action="store_true", help="skip the single-run Engine rows")
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
                   help="measure the HTTP server's per-request overhead instead (model: the demo's size "
                        "unless --preset), with the stack floor beside each concurrency-1 row: what a bare "
                        "uvicorn app and a no-framework socket server add to a request of that length")
    h.add_argument("--max-tokens", default="32,80",
                   help="--http: tokens generated per request, comma-separated (default 32,80: a short request "
                        "(the demo's planner calls stay within 48 tokens), and about a whole answer of the demo's "
                        "RFT model, 77 tokens; a whole SPRINT run of it writes ~93)")
    h.add_argument("--engine-on", choices=("auto", "loop", "thread"), default="auto",
                   help="--http: where the server's engine steps, as `sprint-jax serve --engine-on` (default auto: "
                        "the server's default, loop on CPU)")
    h.add_argument("--compare-engine-on", action="store_true",
                   help="--http: also a second server with its engine on the other place (thread if the first is on "
                        "the loop, and back), the lean client, in the same waves: the two side by side in one run")


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

    def written(k, v):                      # [L, N, H, C, D] -> slots written, per row
        return ((k != 0).any(axis=(0, 2, 4)) | (v != 0).any(axis=(0, 2, 4))).sum(axis=1)
    per_slot = 2 * pk.shape[0] * pk.shape[2] * pk.shape[4] * pk.dtype.itemsize   # K and V, all layers
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
# --http: the OpenAI-compatible server vs the same engine in-process
# ---------------------------------------------------------------------------------------------
def _demo_model(seed: int, n: int):
    """The demo's model exactly as `sprint-jax demo` builds it (configs/demo.yaml `model`, its
    tokenizer and vocabulary, float32), with random weights, and `n` of the demo's held-out
    queries (~10 tokens each) as the prompts."""
    import jax

    from sprint_jax.config import CONFIG_DIR, load_config, to_dict
    from sprint_jax.demo import DemoConfig, _vocabulary
    from sprint_jax.model import Qwen2, Qwen2Config, init_params
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks import chains

    cfg = load_config(DemoConfig, CONFIG_DIR / "demo.yaml")
    tok = VocabTokenizer(_vocabulary(cfg), eos_token="<eos>", pad_token="<pad>")
    config = Qwen2Config.from_hf_config({"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8,
                                         **to_dict(cfg.model), "max_position_embeddings": cfg.seq_len,
                                         "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id})
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))
    tasks = chains.generate(n, cfg.seed + 10_000, cfg.chains, cfg.chains, cfg.chain_length)
    prompts = [tok.encode(chains.prompt_for(t)) for t in tasks]
    return Qwen2(config, params=params), tok, DEMO_NAME, prompts


def _inproc_wave(engine, prompts: list[list[int]], max_new: int,
                 offsets: list[float] | None = None) -> tuple[list[float], list[str]]:
    """The requests of one wave on a BatchEngine driven in this thread, request j submitted at
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


class LeanHTTP:
    """A minimal keep-alive HTTP/1.1 client on a raw socket, the kind a load generator uses (as
    wrk does): one request at a time on one connection, the request written in one send, the
    status line and headers split by hand, the body framed by Content-Length, chunked transfer
    encoding or the connection's close. What http.client adds on top (email.parser headers, a
    buffered file per response) is the client's cost, not the server's; `bench serve --http`
    times both. `request` returns (status, [(lower-case name, value)], body)."""

    def __init__(self, host: str, port: int, timeout: float = 600.0):
        import socket

        self._socket = socket
        self.host, self.port, self.timeout = host, port, timeout
        self.sock = None
        self._buf = b""
        self._host_line = f"Host: {host}:{port}\r\n".encode()

    def connect(self) -> None:
        self.close()
        s = self._socket.create_connection((self.host, self.port), self.timeout)
        s.setsockopt(self._socket.IPPROTO_TCP, self._socket.TCP_NODELAY, 1)
        self.sock, self._buf = s, b""

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: str = "application/json") -> tuple[int, list[tuple[str, str]], bytes]:
        if self.sock is None:
            self.connect()
        head = f"{method} {path} HTTP/1.1\r\n".encode() + self._host_line
        if body is not None:
            head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n".encode()
        try:
            self.sock.sendall(head + b"\r\n" + (body or b""))
            return self._response(method)
        except BaseException:
            self.close()                          # a half-read response: the connection is unusable
            raise

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection before the response ended")
        self._buf += data

    def _response(self, method: str) -> tuple[int, list[tuple[str, str]], bytes]:
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._recv()
        lines = self._buf[:end].decode("latin-1").split("\r\n")
        self._buf = self._buf[end + 4:]
        version, status, *_ = lines[0].split(" ", 2) + [""]
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise ConnectionError(f"not an HTTP/1.x status line: {lines[0]!r}")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ConnectionError(f"malformed header line: {line!r}")
            headers.append((name.strip().lower(), value.strip()))
        h = dict(headers)
        code = int(status)
        if method == "HEAD" or code in (204, 304) or code < 200:
            if code < 200:
                raise ConnectionError(f"an interim {code} response (this client sends no Expect header)")
            body = b""
        elif "chunked" in h.get("transfer-encoding", "").lower():
            body = self._chunked()
        elif "content-length" in h:
            n = int(h["content-length"])
            while len(self._buf) < n:
                self._recv()
            body, self._buf = self._buf[:n], self._buf[n:]
        else:                                     # framed by the connection's close
            while data := self.sock.recv(65536):
                self._buf += data
            body, self._buf = self._buf, b""
            self.close()
        if h.get("connection", "").lower() == "close":
            self.close()
        return code, headers, body

    def _chunked(self) -> bytes:
        parts = []
        while True:
            while (i := self._buf.find(b"\r\n")) < 0:
                self._recv()
            size = int(self._buf[:i].split(b";")[0], 16)
            end = i + 2 + size + 2
            while len(self._buf) < end:
                self._recv()
            if self._buf[end - 2:end] != b"\r\n":
                raise ConnectionError("a chunk does not end with CRLF (or the last chunk has trailers)")
            if size == 0:
                self._buf = self._buf[end:]
                return b"".join(parts)
            parts.append(self._buf[i + 2:i + 2 + size])
            self._buf = self._buf[end:]


class _ClientPool:
    """The HTTP clients, one process per connection (as load generators run them: in the server's
    process they would share its GIL, as threads of one process each other's), kept for the whole
    bench. Each process holds, per server, one keep-alive connection of each client kind: lean
    (`LeanHTTP`), httpclient (http.client) and openai. `wave` hands request j of a wave to process
    j with one start instant for all; each sends at that instant (or as soon as it is scheduled:
    the send times come back and the in-process replay uses them) and returns its latency and
    text. `work_urls`: stack-floor servers (`_BareUvicorn`, `_RawServer`), reached by `work`
    with the lean client alone."""

    def __init__(self, urls: list[str], model: str, width: int, work_urls: tuple[str, ...] = ()):
        import subprocess
        import sys

        self.procs = [subprocess.Popen(
            [sys.executable, "-c", "from sprint_jax.bench.serve import _client_main; _client_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(width)]
        for p in self.procs:
            self._write(p, dict(urls=urls, model=model, work_urls=list(work_urls)))
        self.last_bytes: list[int | None] = []       # the last wave's reply sizes (lean, http.client)
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

    def wave(self, kind: str, server: int, prompts: list[list[int]], max_new: int,
             at: float) -> tuple[list[float], list[str], list[float]]:
        """Latencies, texts, and when each request went out (s after the wave's first); the
        requests go out at perf_counter() == at (`wave_lead`: every process has its line by then)."""
        for p, prompt in zip(self.procs, prompts):
            self._write(p, dict(kind=kind, server=server, prompt=prompt, max_new=max_new, at=at))
        rs = [self._read(p) for p in self.procs[:len(prompts)]]
        self.last_bytes = [r["bytes"] for r in rs]
        sent = [r["sent"] for r in rs]
        return [r["lat"] for r in rs], [r["text"] for r in rs], [t - min(sent) for t in sent]

    def work(self, server: int, work_ms: float, reply_bytes: int, at: float) -> float:
        """One request to stack-floor server `work_urls[server]` (process 0, lean client), sent
        at perf_counter() == at: its latency (s)."""
        self._write(self.procs[0], dict(kind="work", server=server, work_ms=work_ms, reply_bytes=reply_bytes, at=at))
        return self._read(self.procs[0])["lat"]

    def floor(self, server: int, n: int) -> dict:
        """Round trips of requests that reach no engine (process 0, one at a time)."""
        self._write(self.procs[0], dict(kind="floor", server=server, n=n))
        return self._read(self.procs[0])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            p.wait(30)


def _client_main() -> None:
    """A client process of `_ClientPool`: the first stdin line sets it up (urls, model); then each
    line is a request (or a floor job), answered by one JSON line. A request is timed from just
    before it is sent to its parsed reply (the JSON decoded, the text taken out)."""
    import http.client
    import sys
    from urllib.parse import urlsplit

    import openai

    setup = json.loads(sys.stdin.readline())
    model = setup["model"]
    where = [urlsplit(u) for u in setup["urls"]]
    lean = [LeanHTTP(w.hostname, w.port) for w in where]
    hc = [http.client.HTTPConnection(w.hostname, w.port, timeout=600) for w in where]
    oa = [openai.OpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=600) for u in setup["urls"]]
    work = [LeanHTTP(w.hostname, w.port) for w in map(urlsplit, setup["work_urls"])]

    def get_hc(s: int, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        hc[s].request("POST" if body is not None else "GET", path, body, {"Content-Type": "application/json"})
        r = hc[s].getresponse()
        return r.status, r.read()

    def touch(kind: str, s: int) -> None:
        """Not timed: the connection is open when the timed request goes out (the server closes
        connections idle for 5 s, e.g. while the in-process waves run). lean / http.client: a
        look at the socket (closed by the server: reconnect), no request; openai (its own pool):
        a GET /v1/models."""
        if kind == "openai":
            oa[s].models.list()
            return
        c = {"lean": lean, "httpclient": hc, "work": work}[kind][s]
        if c.sock is None or _closed_by_peer(c.sock):
            c.close()
            c.connect()

    def ask(kind: str, s: int, prompt: list[int], max_new: int) -> tuple[str, int | None]:
        """The reply's text and its body's size in bytes (None from the openai client)."""
        if kind == "openai":
            return oa[s].completions.create(model=model, prompt=prompt, max_tokens=max_new,
                                            temperature=0).choices[0].text, None
        body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_new, temperature=0)).encode()
        if kind == "lean":
            status, _, data = lean[s].request("POST", "/v1/completions", body)
        else:
            status, data = get_hc(s, "/v1/completions", body)
        reply = json.loads(data)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {reply}")
        return reply["choices"][0]["text"], len(data)

    for s in range(len(where)):
        for kind in ("lean", "httpclient", "openai"):
            touch(kind, s)
    for s in range(len(work)):
        touch("work", s)
    print(json.dumps({}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        s = job["server"]
        try:
            if job["kind"] == "floor":
                print(json.dumps(_floor(lean[s], get_hc, s, job["n"])), flush=True)
                continue
            if job["kind"] == "work":
                touch("work", s)
                body = json.dumps(dict(work_ms=job["work_ms"], reply_bytes=job["reply_bytes"])).encode()
                _until(job["at"])
                t = time.perf_counter()
                status, _, data = work[s].request("POST", "/work", body)
                json.loads(data)
                lat = time.perf_counter() - t
                if status != 200:
                    raise RuntimeError(f"stack floor: HTTP {status}")
                print(json.dumps(dict(lat=lat)), flush=True)
                continue
            touch(job["kind"], s)
            _until(job["at"])
            t = time.perf_counter()
            text, nbytes = ask(job["kind"], s, job["prompt"], job["max_new"])
            out = dict(lat=time.perf_counter() - t, text=text, sent=t, bytes=nbytes)
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


def _floor(lean: LeanHTTP, get_hc, s: int, n: int) -> dict:
    """Median round trip (ms) of `n` requests the engine never sees, per client: GET /health (a
    starlette route) and a POST /v1/completions that the handler answers 400 at once (the
    completion route's own path: the body read, JSON decoded, validated, a JSON reply), back to
    back; and the same POST sent 5 ms after the last reply (the client awake: `_until`), what a
    request pays when it finds the server idle (its thread asleep in the poll)."""
    out = {}
    for label, method, path, body, want, gap in (("health", "GET", "/health", None, 200, 0.0),
                                                ("post_400", "POST", "/v1/completions", b"{}", 400, 0.0),
                                                ("post_400_idle", "POST", "/v1/completions", b"{}", 400, 0.005)):
        for kind in ("lean", "httpclient"):
            lat = []
            for _ in range(n + 1):                 # the first one is not counted (a warm connection)
                if gap:
                    _until(time.perf_counter() + gap)
                t = time.perf_counter()
                if kind == "lean":
                    status, _, data = lean.request(method, path, body)
                else:
                    status, data = get_hc(s, path, body)
                json.loads(data)
                lat.append(time.perf_counter() - t)
                if status != want:
                    raise RuntimeError(f"{method} {path}: HTTP {status}, expected {want}")
            out[f"{label}_{kind}_ms"] = 1000 * float(np.median(lat[1:]))
    return out


# ---------------------------------------------------------------------------------------------
# --http: what the HTTP stack alone costs at a request's length (no engine, no sprint-jax code)
# ---------------------------------------------------------------------------------------------
def _work_reply(body: bytes) -> bytes:
    """A stack-floor request: body {"work_ms": W, "reply_bytes": N}. Busy until W ms after this
    call (the engine's time on a request, the thread awake as the in-process caller is), then a
    JSON reply of N bytes (the size of the real completion it stands for)."""
    t_in = time.perf_counter()
    job = json.loads(body)
    end = t_in + job["work_ms"] / 1000
    while time.perf_counter() < end:
        pass
    return b'{"text":"' + b"x" * max(0, int(job["reply_bytes"]) - 11) + b'"}'


async def _stack_floor_app(scope, receive, send) -> None:
    """The smallest ASGI app: the whole body read, `_work_reply`, one response (as the server's
    completion route answers: start, then the body)."""
    from sprint_jax.serve.app import _read_body

    if scope["type"] != "http":
        return
    reply = _work_reply(await _read_body(receive))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]})
    await send({"type": "http.response.body", "body": reply})


class _BareUvicorn:
    """`_stack_floor_app` on uvicorn configured by the function `sprint-jax serve` uses
    (`serve.server.uvicorn_server`: the same HTTP parser and event loop, no access log, no proxy
    headers), on a thread: what the server's ASGI stack costs a request before any of our code
    runs."""

    def __init__(self):
        from sprint_jax.serve.server import run_in_thread, uvicorn_server

        self._uv = uvicorn_server(_stack_floor_app, "127.0.0.1", 0, lifespan="off")
        self._thread, port = run_in_thread(self._uv, "stack-floor-uvicorn")
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self._uv.should_exit = True
        self._thread.join(10)


class _RawServer:
    """No framework: HTTP/1.1 on blocking sockets, a thread per connection, the request split by
    hand (Content-Length framing), `_work_reply`, the response written in one send. What Python and
    this machine's loopback cost a request (the two processes' wake-ups included)."""

    def __init__(self):
        import socket
        import threading

        self._socket = socket
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, name="stack-floor-raw", daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:                      # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        conn.setsockopt(self._socket.IPPROTO_TCP, self._socket.TCP_NODELAY, 1)
        buf = b""
        try:
            with conn:
                while True:
                    while (end := buf.find(b"\r\n\r\n")) < 0:
                        if not (data := conn.recv(65536)):
                            return
                        buf += data
                    n = 0
                    for line in buf[:end].split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            n = int(value)
                    while len(buf) < end + 4 + n:
                        if not (data := conn.recv(65536)):
                            return
                        buf += data
                    body, buf = buf[end + 4:end + 4 + n], buf[end + 4 + n:]
                    reply = _work_reply(body)
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                 % len(reply) + reply)
        except OSError:                          # the client went away
            return

    def close(self) -> None:
        self.sock.close()


def wave_lead(n: int) -> float:
    """Seconds from the end of one wave to the start of the next, on every path: long enough for
    n client processes to get their request before it goes out (one that is late sends late: its
    send time is recorded and replayed in-process). The engine is idle that long before every
    wave, HTTP or in-process: a request that finds it idle pays the wake-up of its threads
    (measured: ~2 ms more in-process latency for 32 tokens after 5 ms idle at load 8) on both
    paths alike; short, so that it stays small."""
    return 0.001 + 0.0005 * n


HTTP_PATHS = ("inproc", "at_once", "lean", "httpclient", "openai")
HTTP_CLIENTS = ("lean", "httpclient", "openai")


def http_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Per (max_tokens, concurrency): the same requests in waves of `concurrency` submitted at
    once, in-process and through the server (a minimal client and the openai client), the paths
    alternating wave by wave; the HTTP overhead per request is its HTTP latency minus the
    in-process latency of the same request in the same wave position (median over requests)."""
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
    if args.preset:
        model, tok, name = _model(args.preset, args.seed)
        prompts = _problems(n, dict(prompt_len=args.prompt_len), model.config.vocab_size, args.seed)
    else:
        model, tok, name, prompts = _demo_model(args.seed, n)
    prompt_len = max(len(p) for p in prompts)
    caps = dict(max_seqs=max(conc), max_children=1, max_seq_len=prompt_len + max(lengths) + 8,
                max_branch_tokens=8, decode_chunk=args.decode_chunk, prefill_chunk=128, eos_token_ids=[])
    local = BatchEngine(model, tok, **caps)
    served = BatchEngine(model, tok, **caps)          # its own cache; the jitted steps are shared
    from sprint_jax.serve.cli import ENGINE_ON
    server = Server(served, name, engine_on_loop=ENGINE_ON[args.engine_on]).start()
    paths, client_paths = HTTP_PATHS, HTTP_CLIENTS
    other = None
    if args.compare_engine_on:                        # lean_other: the lean client, the other engine place
        other = Server(BatchEngine(model, tok, **caps), name, engine_on_loop=not server.engine_on_loop).start()
        paths, client_paths = HTTP_PATHS + ("lean_other",), HTTP_CLIENTS + ("lean_other",)
    # the HTTP stack alone (no engine, no sprint-jax code), at the length of each concurrency-1 row
    floors = {"uvicorn": _BareUvicorn(), "raw": _RawServer()} if 1 in conc else {}
    clients = _ClientPool([server.url] + ([other.url] if other is not None else []), name, max(conc),
                          work_urls=tuple(f.url for f in floors.values()))
    out: dict[str, Any] = dict(model=name, backend=jax.default_backend(), requests=n,
                               prompt_tokens=[len(p) for p in prompts], http_impl=server.http_impl,
                               loop_impl=server.loop_impl, engine_on="loop" if server.engine_on_loop else "thread",
                               decode_chunk=args.decode_chunk, rows=[])
    if other is not None:
        out["other_engine_on"] = "loop" if other.engine_on_loop else "thread"

    arrivals: dict[tuple, list[float]] = {}      # (tokens, conc, wave) -> the lean client's send offsets
    reply_bytes: dict[int, list[int]] = {}       # tokens -> the lean client's reply sizes

    def wave(path: str, key: tuple, idx: list[int], m: int):
        """(latencies, texts, the server's timings of each request: engine / server / wait)"""
        ps = [prompts[i] for i in idx]
        at = time.perf_counter() + wave_lead(len(ps))
        if path in ("at_once", "inproc"):
            _until(at)                                # the same idle time before it as an HTTP wave
            # inproc: the HTTP clients' arrival pattern, replayed; at_once: all at one instant
            return (*_inproc_wave(local, ps, m, arrivals.get(key) if path == "inproc" else None), [])
        srv = other if path == "lean_other" else server
        srv.worker.timings.clear()
        lat, texts, sent = clients.wave("lean" if path == "lean_other" else path, int(path == "lean_other"), ps, m,
                                        at)
        if path == "lean":
            arrivals[key] = sent
            reply_bytes.setdefault(m, []).extend(clients.last_bytes)
        by_prompt = {tuple(t["prompt"]): t for t in srv.worker.timings}
        return lat, texts, [by_prompt[tuple(p)] for p in ps]

    try:
        load_before = os.getloadavg()
        # the floor: round trips of requests that reach no engine, per client (no wave running)
        out["floor"] = clients.floor(0, 200)
        for m in lengths:
            for c in conc:
                waves = [list(range(i, min(i + c, n))) for i in range(0, n, c)]
                # untimed: compile every shape; HTTP arrivals spread over a few ms, so their steps
                # meet more row counts than the in-process waves (every bucket up to c)
                for _ in range(2):
                    for path in ("lean",) + tuple(p for p in paths if p != "lean"):
                        for w, idx in enumerate(waves):
                            wave(path, (m, c, w), idx, m)
                lat = {p: np.zeros((args.repeats, n)) for p in paths}
                timing = {p: {k: np.zeros((args.repeats, n)) for k in ("engine", "server", "wait")}
                          for p in client_paths}
                spread: list[float] = []
                texts: dict[str, list[str]] = {p: [""] * n for p in paths}
                for r in range(args.repeats):
                    for w, idx in enumerate(waves):
                        k = (w + r) % len(paths)   # rotate the order: no path always goes first
                        for path in paths[k:] + paths[:k]:
                            l, t, tm = wave(path, (m, c, w), idx, m)
                            lat[path][r, idx] = l
                            for i, x in zip(idx, t):
                                texts[path][i] = x
                            for i, x in zip(idx, tm):
                                for key in ("engine", "server", "wait"):
                                    timing[path][key][r, i] = x[key]
                            if path == "lean":
                                spread.append(max(arrivals[(m, c, w)]))
                for path in paths[1:]:
                    if texts[path] != texts["inproc"]:
                        raise RuntimeError(f"{path}'s texts differ from the in-process engine's: not the same work")
                row: dict[str, Any] = dict(max_tokens=m, concurrency=c,
                                           arrival_spread_ms=1000 * float(np.median(spread)))
                for path in paths:
                    x = 1000 * lat[path].ravel()
                    row[path] = dict(p50_ms=float(np.median(x)), mean_ms=float(x.mean()), min_ms=float(x.min()),
                                     p99_ms=float(np.percentile(x, 99)), samples_ms=x.tolist())
                inproc_p50 = row["inproc"]["p50_ms"]
                for path in client_paths:
                    # end to end, per request: HTTP latency - the same request's in-process latency
                    # (same wave, submitted at the same offset in it)
                    over = 1000 * float(np.median(lat[path] - lat["inproc"]))
                    # per request: HTTP latency - the engine's time on that request: what HTTP,
                    # the server and the client add; the engine's step times, which the machine's
                    # load moves run to run, cancel out
                    outside = 1000 * float(np.median(lat[path] - timing[path]["engine"]))
                    row[path].update(overhead_ms=over, overhead_pct=100 * over / inproc_p50,
                                     outside_engine_ms=outside, outside_engine_pct=100 * outside / inproc_p50,
                                     engine_ms_p50=1000 * float(np.median(timing[path]["engine"])),
                                     engine_samples_ms=(1000 * timing[path]["engine"].ravel()).tolist(),
                                     server_ms_p50=1000 * float(np.median(timing[path]["server"])),
                                     pick_wait_ms_p50=1000 * float(np.median(timing[path]["wait"])))
                # what http.client / the openai package add over the lean client: clients' costs, not the server's
                for path in ("httpclient", "openai"):
                    row[path]["client_ms"] = 1000 * float(np.median(lat[path] - lat["lean"]))
                row["target_met"] = row["lean"]["overhead_pct"] < 10
                row["lean"]["reply_bytes_p50"] = int(np.median(reply_bytes[m]))
                if c == 1 and floors:
                    row["stack_floor"] = _stack_floor(clients, list(floors), inproc_p50,
                                                      row["lean"]["reply_bytes_p50"], args.repeats * n)
                out["rows"].append(row)
        out["loadavg"] = dict(before=load_before, after=os.getloadavg())
    finally:
        clients.close()
        for f in floors.values():
            f.close()
        server.stop()
        if other is not None:
            other.stop()
    _http_report(out, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"written: {args.out}")
    return out


def _stack_floor(clients: _ClientPool, kinds: list[str], work_ms: float, reply_bytes: int,
                 samples: int) -> dict[str, Any]:
    """Per stack-floor server (`kinds`, in `clients`' work_urls order): `samples` requests one at a
    time, each after the waves' idle lead, the servers taking turns, each answered after a busy wait
    of `work_ms` (the row's in-process p50) with a `reply_bytes` reply. Overhead = latency -
    work_ms: what that stack and this machine add to a request of this length before any of the
    server's own code runs. Median ms and % of work_ms."""
    for s in range(len(kinds)):                   # untimed: warm connections and code paths
        for _ in range(5):
            clients.work(s, 0.0, reply_bytes, time.perf_counter() + wave_lead(1))
    over: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(samples):
        for j in range(len(kinds)):
            s = (i + j) % len(kinds)
            lat = clients.work(s, work_ms, reply_bytes, time.perf_counter() + wave_lead(1))
            over[kinds[s]].append(1000 * lat - work_ms)
    return {k: dict(overhead_ms=float(np.median(v)), overhead_pct=100 * float(np.median(v)) / work_ms,
                    samples_ms=v) for k, v in over.items()} | dict(work_ms=work_ms, reply_bytes=reply_bytes)


def _http_report(out: dict, repeats: int) -> None:
    print(f"model {out['model']} on {out['backend']}; {out['requests']} requests x {repeats} repeats, prompts of "
          f"{min(out['prompt_tokens'])}-{max(out['prompt_tokens'])} tokens, greedy, decode chunk "
          f"{out['decode_chunk']}; uvicorn http={out['http_impl']} loop={out['loop_impl']}, engine on the "
          f"{out['engine_on']}; load average "
          f"{out['loadavg']['before'][0]:.1f} -> {out['loadavg']['after'][0]:.1f}")
    f = out["floor"]
    print(f"floor (no engine, one request at a time, p50 ms): GET /health lean {f['health_lean_ms']:.3f}, http.client "
          f"{f['health_httpclient_ms']:.3f}; POST /v1/completions answered 400 lean {f['post_400_lean_ms']:.3f}, "
          f"http.client {f['post_400_httpclient_ms']:.3f}; the same POST 5 ms after the last reply (the server "
          f"idle) lean {f['post_400_idle_lean_ms']:.3f}, http.client {f['post_400_idle_httpclient_ms']:.3f}")
    print("Waves of `conc` requests, the paths alternating wave by wave; latency = submission -> parsed reply, p50 "
          "ms. Clients: one process per connection, a keep-alive connection each; lean = a raw-socket HTTP/1.1 "
          "client (LeanHTTP), http.client = the standard library's, openai = the openai package's. inproc: the "
          "same requests on an identical engine in-process, each submitted at the offset in its wave at which the "
          "lean client sent it (spread: the last one's offset, p50); at once: a wave in-process all at the same "
          "instant. Per request, median: e2e over = the lean client's latency - the same request's inproc latency; "
          "outside = lean latency - the engine's time on it (what HTTP, the server and the client add, the "
          "engine's step times cancelled out); % = of the inproc p50. srv: the server's time per request outside "
          "the engine, timed inside it; wait: of that, until the engine took it (a step was running). http.client "
          "and openai: e2e over as for lean, and client = their latency - lean's (the client's own cost).")
    print(f"{'':<11}{'':>7}{'':>8}{'':>8}{'--- lean client':<47}{'--- http.client':<23}{'--- openai':<10}")
    print(f"{'tokens':>6}{'conc':>5}{'spread':>7}{'at once':>8}{'inproc':>8}{'p50':>7}{'e2e over':>9}{'%':>6}"
          f"{'outside':>8}{'%':>6}{'srv':>6}{'wait':>5}{'p50':>8}{'e2e over':>9}{'client':>7}{'p50':>8}{'client':>7}")
    for r in out["rows"]:
        i, z, a, h, o = r["inproc"], r["at_once"], r["lean"], r["httpclient"], r["openai"]
        print(f"{r['max_tokens']:>6}{r['concurrency']:>5}{r['arrival_spread_ms']:>7.2f}{z['p50_ms']:>8.2f}"
              f"{i['p50_ms']:>8.2f}{a['p50_ms']:>7.2f}{a['overhead_ms']:>9.2f}{a['overhead_pct']:>6.1f}"
              f"{a['outside_engine_ms']:>8.2f}{a['outside_engine_pct']:>6.1f}{a['server_ms_p50']:>6.2f}"
              f"{a['pick_wait_ms_p50']:>5.2f}{h['p50_ms']:>8.2f}{h['overhead_ms']:>9.2f}{h['client_ms']:>7.2f}"
              f"{o['p50_ms']:>8.2f}{o['client_ms']:>7.2f}")
    if out.get("other_engine_on"):
        print(f"The same waves through a second server with its engine on the {out['other_engine_on']} (lean client):")
        print(f"{'tokens':>6}{'conc':>5}{'inproc':>8}{'p50':>8}{'e2e over':>9}{'%':>6}{'outside':>8}{'%':>6}{'srv':>6}"
              f"{'wait':>6}")
        for r in out["rows"]:
            i, a = r["inproc"], r["lean_other"]
            print(f"{r['max_tokens']:>6}{r['concurrency']:>5}{i['p50_ms']:>8.2f}{a['p50_ms']:>8.2f}{a['overhead_ms']:>9.2f}"
                  f"{a['overhead_pct']:>6.1f}{a['outside_engine_ms']:>8.2f}{a['outside_engine_pct']:>6.1f}"
                  f"{a['server_ms_p50']:>6.2f}{a['pick_wait_ms_p50']:>6.2f}")
    sf = [r for r in out["rows"] if "stack_floor" in r]
    if sf:
        print("The HTTP stack alone at concurrency 1, no engine and none of our code: a request answered after a busy "
              "wait of the row's inproc p50, with a reply of the same size, lean client, the same idle lead; p50 "
              "latency - the wait, ms (% of the inproc p50). uvicorn: a bare ASGI app on uvicorn configured as the "
              "server is; raw: a blocking-socket server, no framework (Python and the loopback alone):")
        for r in sf:
            f = r["stack_floor"]
            print(f"{r['max_tokens']:>6} tokens: uvicorn {f['uvicorn']['overhead_ms']:.2f} "
                  f"({f['uvicorn']['overhead_pct']:.1f}%), raw {f['raw']['overhead_ms']:.2f} ({f['raw']['overhead_pct']:.1f}%)"
                  f"; the server (lean) {r['lean']['overhead_ms']:.2f} ({r['lean']['overhead_pct']:.1f}%)")
    met = [r for r in out["rows"] if r["target_met"]]
    print(f"target: HTTP overhead per request (lean client, e2e over) < 10% of the in-process p50 "
          f"latency: met in {len(met)} of {len(out['rows'])} rows")
    beyond = [r for r in sf if r["stack_floor"]["uvicorn"]["overhead_pct"] >= 10]
    if beyond:
        print("  out of reach on this stack and machine where the bare stack alone is >= 10%: "
              + ", ".join(f"{r['max_tokens']}/1" for r in beyond))


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
        for label, fn in paths:
            step, walls = _difference_timing(fn, args.decode_chunk, n_new, args.repeats)
            row[f"{label}_step_ms"] = 1000 * step if step > 0 else None
            row[f"{label}_samples_s"] = walls
        out["capacity"].append(row)
    out["fork_bytes"] = fork_bytes(model, tok, prompts[0], s, common)
    if not args.no_latency_model:
        # the demo's model exactly (its vocabulary too: the unembedding is part of a row's work)
        # unless a preset is named
        lm_model, lm_tok = (model, tok) if args.preset else _demo_model(args.seed, 1)[:2]
        out["latency_model"] = latency_model(lm_model, lm_tok, s, args.model_context, args.repeats,
                                             args.sequential_tokens)
        out["latency_model"]["model"] = name if args.preset else "the demo's (configs/demo.yaml, its vocabulary)"
    _report(out, conc, caps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
        print(f"written: {args.out}")
    return out


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
    fixed cost of an engine call, on a one-sequence BatchEngine whose decode chunk holds a whole
    call: each path decodes MODEL_LO and MODEL_HI tokens in one call, alternating, best of
    repeats + 2; step = the difference per token, per call = the short call minus its steps."""
    from sprint_jax.infer.batch import BatchEngine

    kw = dict(max_seq_len=context + MODEL_HI + 8, max_branch_tokens=MODEL_HI + 8, decode_chunk=MODEL_HI,
              prefill_chunk=128, eos_token_ids=[])
    e = BatchEngine(model, tok, max_seqs=1, max_children=k, **kw)
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
