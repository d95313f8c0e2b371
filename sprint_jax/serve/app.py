"""The OpenAI-compatible HTTP side: request validation, the OpenAI response and error shapes,
server-sent events, metrics. Every engine interaction goes through `EngineWorker`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics (Prometheus text format). The two POST routes are plain ASGI handlers, reached before
starlette (its middleware, routing, Request and Response objects cost ~0.1 ms a request, which is
what a request's whole HTTP overhead may be on the demo model); the rest is a starlette app.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from sprint_jax.infer.sampling import Sampling
from sprint_jax.serve.worker import LATENCY_BUCKETS, Channel, EngineWorker, Job

SPRINT_SUFFIX = ":sprint"
ROLES = ("system", "developer", "user", "assistant")
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "logit_bias", "suffix", "tools", "tool_choice",
               "functions", "function_call", "response_format")
KEEPALIVE_S = 0.5          # a streaming response writes at least this often (finds a gone client)


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def payload(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "server_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


def internal_error(exc: Exception) -> APIError:
    """A bug in a handler, as the client sees it (a 500 naming the exception)."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def default_chat_prompt(messages: list[dict]) -> str:
    """The prompt of a chat for a tokenizer without a chat template: a lone user message is given
    as is (SPRINT models are trained on the bare problem text); otherwise each message becomes
    `role: content` on its own line(s), then `assistant:` opens the reply."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


@dataclasses.dataclass
class ServeState:
    worker: EngineWorker
    model_name: str
    sprint_config: Any                       # OrchestratorConfig: the server's defaults for SPRINT mode
    default_max_tokens: int = 256
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def engine(self):
        return self.worker.engine

    def chat_prompt(self, messages: list[dict]) -> str:
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return default_chat_prompt(messages)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name, default)
    if v is None:
        v = default
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"{name} must be an integer, got {v!r}", name)
    if lo is not None and v < lo or hi is not None and v > hi:
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise APIError(400, f"{name} must be {bound}, got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(400, f"{name} must be a number, got {v!r}", name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise APIError(400, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 4:
        raise APIError(400, f"stop must be a non-empty string or a list of up to 4 of them, got {v!r}", "stop")
    return v


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        c = m.get("content")
        if isinstance(c, list):           # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise APIError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": m["role"], "content": c})
    return out


def _prompt(body: dict, state: ServeState) -> tuple[str | None, list[int]]:
    """Completions: a string, a list of token ids, or a list holding one string."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        return p, _encode(state, p, "prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = state.engine.config.vocab_size
        if not all(0 <= t < vocab for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return None, list(p)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                   "prompt")


def _encode(state: ServeState, text: str, param: str) -> list[int]:
    try:
        ids = state.engine.encode(text)
    except ValueError as e:
        raise APIError(400, f"{param}: the tokenizer cannot encode it ({e})", param) from None
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens", param)
    return ids


def _check_model(body: dict, state: ServeState) -> bool:
    """Whether the request asks for SPRINT mode by its model id; 404 for a model we do not serve."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required (GET /v1/models lists them)", "model")
    if model == state.model_name:
        return False
    if model == state.model_name + SPRINT_SUFFIX:
        return True
    raise APIError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}' and "
                        f"'{state.model_name}{SPRINT_SUFFIX}'", "model", "model_not_found")


def _sprint_config(body: dict, state: ServeState) -> tuple[Any, str]:
    """OrchestratorConfig of a SPRINT request: the server's, then the request's sampling
    (temperature, top_p, top_k, seed), max_tokens as max_total_tokens, then extra_body["sprint"]."""
    from sprint_jax.infer.orchestrator import MODES, OrchestratorConfig

    extra = body.get("sprint") or {}
    if not isinstance(extra, dict):
        raise APIError(400, "sprint must be an object of budgets (OrchestratorConfig fields and mode)", "sprint")
    fields = {f.name for f in dataclasses.fields(OrchestratorConfig)} - {"layout"}
    upd: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if body.get(name) is not None:
            upd[name] = body[name]
    if body.get("max_tokens") is not None:
        upd["max_total_tokens"] = body["max_tokens"]
    mode = "parallel"
    for k, v in extra.items():
        if k == "mode":
            if v not in MODES:
                raise APIError(400, f"sprint.mode must be one of {', '.join(MODES)}, got {v!r}", "sprint.mode")
            mode = v
        elif k in fields:
            upd[k] = v
        else:
            raise APIError(400, f"sprint.{k} is not a SPRINT budget; known: mode, {', '.join(sorted(fields))}",
                           f"sprint.{k}")
    try:
        config = dataclasses.replace(state.sprint_config, **upd)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"sprint: {e}", "sprint") from None
    if mode == "serial" and config.resolved_join == "merge":
        raise APIError(400, "sprint.mode 'serial' has no branches to merge and this model joins by merge "
                            "(its layout); use mode 'parallel' or sprint.join 'reprefill'", "sprint.mode")
    return config, mode


def build_job(body: dict, state: ServeState, chat: bool, channel: Channel) -> tuple[Job, int]:
    """Validate a request into a Job; returns (job, prompt tokens)."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise APIError(400, f"{name} is not supported by this server", name)
    sprint = _check_model(body, state) or body.get("sprint") is not None
    if chat:
        text = state.chat_prompt(_messages(body))
        prompt = _encode(state, text, "messages")
    else:
        text, prompt = _prompt(body, state)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {stream!r}", "stream")
    n = _int(body, "n", 1, 1, state.engine.max_children)
    stop = _stop(body)
    cap = state.engine.max_seq_len
    if sprint:
        if n != 1:
            raise APIError(400, "n must be 1 in SPRINT mode (the executors already run in parallel)", "n")
        if stop:
            raise APIError(400, "stop is not supported in SPRINT mode (the orchestrator sets its own stops)", "stop")
        if text is None:
            text = state.engine.decode_text(prompt)
        config, mode = _sprint_config(body, state)
        if len(prompt) >= cap:
            raise APIError(400, f"This model's maximum context length is {cap} tokens. However, your prompt is "
                                f"{len(prompt)} tokens.", "messages" if chat else "prompt", "context_length_exceeded")
        return Job("sprint", channel, prompt=prompt, query=text, mode=mode, config=config, stream=stream), len(prompt)
    temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, 0)
    seed = _int(body, "seed", None)
    if seed is None:
        seed = secrets.randbits(31)
    seed &= 0x7FFFFFFF
    limit_default = min(state.default_max_tokens, max(1, cap - len(prompt)))
    name = "max_tokens" if not chat or body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = _int(body, name, limit_default, 1)
    if len(prompt) + max_tokens > cap:
        raise APIError(400, f"This model's maximum context length is {cap} tokens. However, you requested "
                            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or max_tokens.", "max_tokens",
                       "context_length_exceeded")
    if n > 1 and max_tokens + 1 > state.engine.max_branch_tokens:
        raise APIError(400, f"with n > 1 each choice may generate at most {state.engine.max_branch_tokens - 1} "
                            f"tokens (the engine's child capacity, set by --max-branch-tokens), got max_tokens={max_tokens}", "max_tokens")
    sampling = Sampling(temperature, top_k, top_p, seed)
    return Job("plain", channel, prompt=prompt, n=n, max_tokens=max_tokens, stop=stop, sampling=sampling,
               stream=stream), len(prompt)


# ---------------------------------------------------------------------------------------------
# Response shapes
# ---------------------------------------------------------------------------------------------
def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the first stop string (excluded, as OpenAI does)."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def _finish(gen, stops: list[str]) -> tuple[str, str]:
    text, hit = _cut(gen.text, stops)
    return text, "stop" if hit or gen.stop_reason in ("stop", "eos") else "length"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(chat: bool, index: int, text: str, finish: str | None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": None}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


def _delta(chat: bool, index: int, text: str, finish: str | None = None, first: bool = False) -> dict:
    if chat:
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": d, "finish_reason": finish, "logprobs": None}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


class _Head:
    def __init__(self, chat: bool, model: str, stream: bool):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.object = ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else "")

    def body(self, **kw) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **kw}


def _event_json(ev) -> dict:
    out = {"kind": ev.kind, "stage": ev.stage.index if ev.stage is not None else None, "text": ev.text}
    if ev.stage is not None:
        st = ev.stage
        out.update(plan=st.plan, prompts=list(st.prompts), planner_tokens=st.planner_tokens,
                   executions=[dataclasses.asdict(e) for e in st.executions], executor_mode=st.executor_mode,
                   planner_s=st.planner_s, executors_s=st.executors_s, sync_s=st.sync_s)
    return out


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _StreamText:
    """Streamed text of one choice: only text no stop string can still cut is sent, and never a
    trailing partial character."""

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0
        self.done = False

    def delta(self, tokens: list[int]) -> str:
        if self.done:
            return ""
        text, hit = _cut(self.decode(tokens), self.stops)
        if hit:
            self.done = True
            safe = len(text)
        else:
            safe = len(text) - self.hold
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent:safe], safe
        return out

    def rest(self, final_text: str) -> str:
        return final_text[self.sent:] if len(final_text) > self.sent else ""


# ---------------------------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------------------------
def make_app(state: ServeState):
    worker = state.worker

    async def models(request: Request) -> Response:
        data = [{"id": m, "object": "model", "created": state.created, "owned_by": "sprint-jax"}
                for m in (state.model_name, state.model_name + SPRINT_SUFFIX)]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        if not worker.alive:
            return JSONResponse({"status": "error", "error": worker.error or "the engine is not running"},
                                status_code=503)
        mesh = getattr(state.engine, "mesh", None)
        shape = {k: int(v) for k, v in mesh.shape.items()} if mesh is not None else None
        return JSONResponse({"status": "ok", "model": state.model_name, "mesh": shape, **worker.metrics})

    async def metrics(request: Request) -> Response:
        m = worker.metrics
        lines = []

        def metric(name, kind, help_text, value, labels=""):
            lines.extend([f"# HELP sprint_serve_{name} {help_text}", f"# TYPE sprint_serve_{name} {kind}",
                          f"sprint_serve_{name}{labels} {value}"])
        metric("queue_depth", "gauge", "Requests waiting for a sequence slot.", m["queue_depth"])
        metric("active_rows", "gauge", "Decoding rows (requests' sequences and their fork children).", m["active_rows"])
        metric("slots_used", "gauge", "Parent sequence slots in use.", m["slots_used"])
        metric("slots_total", "gauge", "Parent sequence slots.", m["slots_total"])
        metric("running_requests", "gauge", "Requests held by the engine.", m["running_jobs"])
        metric("generated_tokens_total", "counter", "Tokens generated since start.", m["tokens_total"])
        metric("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
               f"{m['tokens_per_s']:.3f}")
        metric("cancelled_total", "counter", "Requests cancelled because their client went away.", m["cancelled"])
        with worker._lock:
            counts, total, reqs = list(worker.latency_counts), worker.latency_sum, dict(worker.requests)
        lines += ["# HELP sprint_serve_requests_total HTTP requests to the completion endpoints by status.",
                  "# TYPE sprint_serve_requests_total counter"]
        lines += [f'sprint_serve_requests_total{{status="{k}"}} {v}' for k, v in sorted(reqs.items())]
        lines += ["# HELP sprint_serve_request_latency_seconds Latency of served completion requests.",
                  "# TYPE sprint_serve_request_latency_seconds histogram"]
        acc = 0
        for b, c in zip(list(LATENCY_BUCKETS) + ["+Inf"], counts):
            acc += c
            lines.append(f'sprint_serve_request_latency_seconds_bucket{{le="{b}"}} {acc}')
        lines += [f"sprint_serve_request_latency_seconds_sum {total:.6f}",
                  f"sprint_serve_request_latency_seconds_count {acc}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def post(scope, receive, send, chat: bool) -> None:
        """POST /v1/completions (chat False) and /v1/chat/completions (chat True), plain ASGI."""
        t0 = time.perf_counter()
        started = False

        async def reply(status: int, obj: dict, headers: dict | None = None) -> None:
            nonlocal started
            started = True
            await _send_json(send, status, obj, headers)

        try:
            try:
                raw = await _read_body(receive)
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise APIError(400, "the request body is not valid JSON") from None
                if not isinstance(body, dict):
                    raise APIError(400, "the request body must be a JSON object")
                if not worker.alive:
                    raise APIError(503, worker.error or "the engine is not running", headers={"Retry-After": "5"})
                channel = Channel(asyncio.get_running_loop())
                job, n_prompt = build_job(body, state, chat, channel)
                if not worker.try_submit(job):
                    raise APIError(429, f"the server holds {worker.capacity} requests (its queue is full); retry later",
                                   code="queue_full", headers={"Retry-After": "1"})
            except APIError as e:
                worker.observe(e.status, None)
                await reply(e.status, e.payload(), e.headers)
                return
            head = _Head(chat, body["model"], job.stream)
            if job.stream:
                started = True
                events = _stream(job, head, n_prompt, t0)
                try:
                    await StreamingResponse(events, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"})(scope, receive, send)
                except (ClientDisconnect, OSError):   # the client left mid-stream
                    pass
                finally:
                    await events.aclose()             # a job still running is cancelled now
                return
            try:
                kind, value = await channel.get()
            finally:
                if not job.finished:           # the client went away (the handler was cancelled)
                    worker.cancel(job)
            if kind == "error":
                worker.observe(500, None)
                await reply(500, APIError(500, value).payload())
                return
            worker.observe(200, time.perf_counter() - t0)
            if job.kind == "sprint":
                rec = value
                await reply(200, head.body(choices=[_choice(chat, 0, rec.text, _sprint_finish(rec))],
                                           usage=_usage(n_prompt, rec.total_tokens), sprint=_sprint_json(rec)))
                return
            choices, completion = [], 0
            for i, g in enumerate(value):
                text, finish = _finish(g, job.stop)
                choices.append(_choice(chat, i, text, finish))
                completion += len(g.tokens)
            obj = head.body(choices=choices, usage=_usage(n_prompt, completion))
            engine_s = job.t_end - job.t_pick       # recorded before the reply goes out (a client that
            worker.timings.append(dict(prompt=job.prompt, engine=engine_s,    # has it may read them)
                                       server=time.perf_counter() - t0 - engine_s, wait=job.t_pick - job.t0))
            await reply(200, obj)
        except Exception as exc:               # noqa: BLE001  (a bug: the client gets a 500, the log the traceback)
            worker.observe(500, None)
            if started:
                raise
            await reply(500, internal_error(exc).payload())
            raise

    async def _stream(job: Job, head: _Head, n_prompt: int, t0: float):
        texts = [_StreamText(state.engine.decode_text, job.stop) for _ in range(job.n)]
        first = [True] * job.n
        try:
            if chat_of(head):
                yield _sse(head.body(choices=[_delta(True, i, "", first=True) for i in range(job.n)]))
                first = [False] * job.n
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.channel.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if kind == "tokens":
                    for i, toks in enumerate(value):
                        d = texts[i].delta(toks)
                        if d:
                            yield _sse(head.body(choices=[_delta(head.chat, i, d)]))
                elif kind == "event":
                    yield _sse(head.body(choices=[_delta(head.chat, 0, "")], sprint_event=_event_json(value)))
                elif kind == "error":
                    worker.observe(500, None)
                    yield _sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
                    yield b"data: [DONE]\n\n"
                    return
                else:
                    if job.kind == "sprint":
                        rec = value
                        yield _sse(head.body(choices=[_delta(head.chat, 0, rec.text, _sprint_finish(rec))],
                                             sprint=_sprint_json(rec)))
                        completion = rec.total_tokens
                    else:
                        completion = 0
                        for i, g in enumerate(value):
                            text, finish = _finish(g, job.stop)
                            yield _sse(head.body(choices=[_delta(head.chat, i, texts[i].rest(text), finish)]))
                            completion += len(g.tokens)
                    yield _sse(head.body(choices=[], usage=_usage(n_prompt, completion)))
                    yield b"data: [DONE]\n\n"
                    worker.observe(200, time.perf_counter() - t0)
                    return
        finally:
            if not job.finished:
                worker.cancel(job)

    def chat_of(head: _Head) -> bool:
        return head.chat

    class Post:                                # an ASGI app (starlette's Route calls it as one)
        def __init__(self, chat: bool):
            self.chat = chat

        async def __call__(self, scope, receive, send) -> None:
            await post(scope, receive, send, self.chat)

    posts = {"/v1/completions": Post(False), "/v1/chat/completions": Post(True)}

    async def not_found(request: Request, exc) -> Response:
        return APIError(404, f"no route {request.method} {request.url.path}").response()

    async def bad_method(request: Request, exc) -> Response:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def internal(request: Request, exc) -> Response:
        worker.observe(500, None)
        return internal_error(exc).response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start_on_loop()                 # the engine task, when the engine runs on the loop
        yield
        worker.stop()

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    routes += [Route(path, handler, methods=["POST"]) for path, handler in posts.items()]
    rest = Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method, Exception: internal},
                     lifespan=lifespan)

    async def app(scope, receive, send) -> None:
        """The completion POSTs straight to their handler; everything else to starlette."""
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = posts.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await rest(scope, receive, send)

    return app


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":      # http.disconnect
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _send_json(send, status: int, obj, headers: dict | None = None) -> None:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    h = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    for k, v in (headers or {}).items():
        h.append((k.lower().encode("latin-1"), str(v).encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": data})


def _sprint_finish(rec) -> str:
    return "length" if rec.termination in ("token_budget", "planner_token_limit", "context_full") else "stop"


def _sprint_json(rec) -> dict:
    d = rec.to_json()
    d.pop("query", None)
    return d
