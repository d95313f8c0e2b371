"""The OpenAI-compatible HTTP side: request validation, the OpenAI response and error shapes,
server-sent events, metrics. Every engine interaction goes through `EngineWorker`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics (Prometheus text format), all routes of one starlette app (`make_app`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from sprint_jax.schema import apply_prompt_format
from sprint_jax.infer.sampling import USER_SEED_RANGE, Sampling, SamplingError
from sprint_jax.serve.worker import (LATENCY_BUCKETS, STOP_TERMINATION, Channel, EngineWorker, Job, SprintText,
                                     TokenCursor, TokenEntry, cut_at_stop as _cut, executor_opening,
                                     sprint_token_layout)

SPRINT_SUFFIX = ":sprint"
ROLES = ("system", "developer", "user", "assistant")
KEEPALIVE_S = 0.5          # a streaming response writes at least this often (finds a gone client)
MAX_REQUEST_BYTES = 2 * 1024 * 1024    # default body limit: a 128k-token prompt as ids or as text fits
MAX_JSON_DEPTH = 32        # a completion request nests 4 deep (messages[i].content[j].text)
INLINE_CHARS = 4096        # prompts up to this many characters are tokenized on the event loop (well
                           # under a millisecond); longer ones, and bigger bodies' JSON, on worker threads
INLINE_BYTES = 64 * 1024

# The request fields each route implements. Every other OpenAI field changes the output, so it is
# accepted only at the value that leaves the output as it is (OFF_ONLY; null always means unset);
# any field neither here nor there is rejected by name, as OpenAI rejects unknown arguments.
FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop", "seed",
          "user", "sprint"}
COMPLETION_FIELDS = FIELDS | {"prompt", "logprobs"}
CHAT_FIELDS = FIELDS | {"messages", "max_completion_tokens", "metadata", "parallel_tool_calls", "logprobs", "top_logprobs"}
COMPLETION_TOP_MAX = 5      # completions' `logprobs` (alternatives per token), as OpenAI bounds it
CHAT_TOP_MAX = 20           # chat's `top_logprobs` (= the engine's TOP_LOGPROBS)
OFF_ONLY = {        # field: (the accepted values, how the error names them)
    "presence_penalty": ((0,), "0"), "frequency_penalty": ((0,), "0"), "echo": ((False,), "false"), "best_of": ((1,), "1"), "logit_bias": (({},), "{}"),
    "suffix": ((), "null"), "tools": (([],), "[]"), "functions": (([],), "[]"), "tool_choice": (("none",), '"none"'),
    "function_call": (("none",), '"none"'), "response_format": (({"type": "text"},), '{"type": "text"}'),
    "store": ((False,), "false (this server stores nothing)"),
}
COMPLETION_OFF = ("presence_penalty", "frequency_penalty", "echo", "best_of", "logit_bias", "suffix")
CHAT_OFF = ("presence_penalty", "frequency_penalty", "logit_bias", "tools", "functions",
            "tool_choice", "function_call", "response_format", "store")


class APIError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def payload(self) -> dict:
        kind = "server_error" if self.status >= 500 else "rate_limit_error" if self.status == 429 \
            else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _JSON(self.payload(), status_code=self.status, headers=self.headers)


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
    api_key: str | None = None               # None: no authentication
    max_request_bytes: int = MAX_REQUEST_BYTES
    body_timeout_s: float = 30.0             # the whole body must arrive within this
    export_meta: dict = dataclasses.field(default_factory=dict)   # the model's sprint_jax.json (its prompt format)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # shutdown: `begin_drain` sets `draining` (new requests get 503); `grace_s` later every request
    # still in flight is ended (`inflight`: the channels of jobs submitted, `reading`: the timeouts
    # of bodies being read)
    draining: bool = False
    inflight: set = dataclasses.field(default_factory=set)
    reading: set = dataclasses.field(default_factory=set)
    drained: bool = False
    pool: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="sprint-jax-parse"))

    @property
    def engine(self):
        return self.worker.engine

    def begin_drain(self, grace_s: float) -> None:
        """Stop taking requests now; in `grace_s` seconds end the ones still in flight (a JSON 503,
        or an SSE error event then [DONE]). Called on the event loop."""
        self.draining = True
        asyncio.get_running_loop().call_later(max(0.0, grace_s), self._end_inflight)

    def _end_inflight(self) -> None:
        self.drained = True
        for channel in list(self.inflight):
            channel.put(("shutdown", None))
        for timeout in list(self.reading):
            timeout.reschedule(asyncio.get_running_loop().time())

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token of the tokenizer stands for, where that is provable (a
        prompt of C characters is then at least C / this many tokens); None where it is not: an HF
        tokenizer's normalizer, unknown-token fallback or added tokens may map any number of
        characters to one token."""
        from sprint_jax.model.tokenizer import VocabTokenizer

        tok = self.engine.tokenizer
        if isinstance(tok, VocabTokenizer):
            return max(1, max(len(t) for t in tok.vocab))
        return None

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt of a chat: the tokenizer's own chat template when it has one, else
        `default_chat_prompt` in the model's trained prompt format."""
        tok = self.engine.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.formatted(default_chat_prompt(messages))

    def formatted(self, text: str) -> str:
        """A prompt text in the prompt format the model was trained with (sprint_jax.schema)."""
        return apply_prompt_format(text, self.export_meta)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _show(v, limit: int = 60) -> str:
    """A request value for an error message: its repr, cut to `limit` characters."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _same(v, ref) -> bool:
    """JSON equality: false is not 0 and true is not 1 (Python's == says they are)."""
    if isinstance(v, bool) or isinstance(ref, bool):
        return v is ref
    return type(v) is type(ref) and v == ref if isinstance(ref, (str, list, dict)) else v == ref


class _NonFinite:
    """NaN, Infinity, -Infinity or a float literal out of range (1e999), as the parser found it."""

    def __init__(self, text: str):
        self.text = text


def _finite_float(text: str):
    v = float(text)
    return v if math.isfinite(v) else _NonFinite(text)


class _Bad(Exception):
    """A value of the parsed body that is not allowed; `path` is filled in on the way out."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what, self.path = what, []


def _walk(v, depth: int) -> None:
    t = type(v)
    if t is str:
        if not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise _Bad("is not valid Unicode text (it holds a lone surrogate)") from None
    elif t is _NonFinite:
        raise _Bad(f"must be a finite number, got {v.text}")
    elif t is dict or t is list:
        if depth >= MAX_JSON_DEPTH:
            raise _Bad(f"nests deeper than {MAX_JSON_DEPTH} levels")
        for k, x in (v.items() if t is dict else enumerate(v)):
            if type(x) is int and t is list:     # the bulk of a token-id prompt: nothing to check
                continue
            try:
                if t is dict:
                    _walk(k, depth)
                _walk(x, depth + 1)
            except _Bad as e:
                e.path.append(k)
                raise


def _path(keys: list) -> str:
    out = ""
    for k in reversed(keys):
        if isinstance(k, int):
            out += f"[{k}]"
        else:
            k = k.encode("utf-8", "backslashreplace").decode("utf-8")
            out += ("." if out else "") + (k if len(k) <= 40 else k[:40] + "...")
    return out


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object: every string valid Unicode, every number finite, nested
    at most MAX_JSON_DEPTH deep; anything else is a 400 naming where."""
    try:
        body = json.loads(raw, parse_constant=_NonFinite, parse_float=_finite_float)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:              # JSONDecodeError, UnicodeDecodeError, an integer too long to convert
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        _walk(body, 0)
    except _Bad as e:
        where = _path(e.path)
        raise APIError(400, f"{where or 'the request body'} {e.what}", where or None) from None
    return body


def _check_fields(body: dict, chat: bool) -> None:
    """Every field set (not null) is one this route implements, or an OFF_ONLY one at its off value."""
    known, off = (CHAT_FIELDS, CHAT_OFF) if chat else (COMPLETION_FIELDS, COMPLETION_OFF)
    for name, v in body.items():
        if v is None or name in known:
            continue
        if name in off:
            values, shown = OFF_ONLY[name]
            if any(_same(v, a) for a in values):
                continue
            raise APIError(400, f"{name} is not supported by this server (only {shown} is accepted), got {_show(v)}",
                           name)
        shown = name if len(name) <= 60 else name[:60] + "..."
        raise APIError(400, f"Unrecognized request argument supplied: {shown}", shown)
    for name, kind, what in (("user", str, "a string"), ("metadata", dict, "an object"),
                             ("parallel_tool_calls", bool, "a boolean")):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise APIError(400, f"{name} must be {what}, got {_show(body[name])}", name)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None, label: str | None = None):
    """body[name] as an integer in [lo, hi]; `default` when unset (absent or null)."""
    v = body.get(name)
    if v is None:
        return default
    label = label or name
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"{label} must be an integer, got {_show(v)}", label)
    if lo is not None and v < lo or hi is not None and v > hi:
        bound = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"between {lo} and {hi}"
        if hi == INT_MAX:            # a count with no real upper bound: name the side it is past
            bound = f">= {lo}" if v < lo else f"<= {hi}"
        raise APIError(400, f"{label} must be {bound}, got {_show(v)}", label)
    return v


def _float(body: dict, name: str, default, lo: float, hi: float, lo_open: bool = False, label: str | None = None):
    """body[name] as a finite number in [lo, hi] (or (lo, hi]); `default` when unset."""
    v = body.get(name)
    if v is None:
        return default
    label = label or name
    if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and not math.isfinite(v):
        raise APIError(400, f"{label} must be a number, got {_show(v)}", label)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise APIError(400, f"{label} must be in {'(' if lo_open else '['}{lo}, {hi}], got {_show(v)}", label)
    return float(v)


INT_MAX = 2 ** 63 - 1          # the largest integer any count field takes (a bigger one is a 400, not a 500)


def _sampling_fields(obj: dict, state: "ServeState", prefix: str = "") -> dict:
    """temperature / top_p / top_k / seed that `obj` sets, validated (errors name `prefix` + field)."""
    vocab = state.engine.config.vocab_size
    got = {"temperature": _float(obj, "temperature", None, 0.0, 2.0, label=prefix + "temperature"),
           "top_p": _float(obj, "top_p", None, 0.0, 1.0, lo_open=True, label=prefix + "top_p"),
           "top_k": _int(obj, "top_k", None, 0, vocab, label=prefix + "top_k"),
           # only seeds that each give a stream of their own, in plain and SPRINT mode alike
           "seed": _int(obj, "seed", None, *USER_SEED_RANGE, label=prefix + "seed")}
    return {k: v for k, v in got.items() if v is not None}


def _max_tokens(body: dict, chat: bool) -> tuple[int | None, str]:
    """The completion's token limit the request sets (None: unset) and the field that set it.
    Chat takes max_completion_tokens or (its older name) max_tokens; both set must agree."""
    max_tokens = _int(body, "max_tokens", None, 1, INT_MAX)
    if not chat:
        return max_tokens, "max_tokens"
    mct = _int(body, "max_completion_tokens", None, 1, INT_MAX)
    if mct is None:
        return max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens != mct:
        raise APIError(400, f"max_completion_tokens ({mct}) and max_tokens ({max_tokens}) disagree; set one of them",
                       "max_completion_tokens")
    return mct, "max_completion_tokens"


def _include_usage(body: dict, stream: bool) -> bool:
    """Whether a stream ends with a usage chunk: yes unless stream_options.include_usage is false."""
    so = body.get("stream_options")
    if so is None:
        return True
    if not stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(so, dict):
        raise APIError(400, f"stream_options must be an object, got {_show(so)}", "stream_options")
    for k in so:
        if k != "include_usage":
            name = f"stream_options.{k if len(k) <= 40 else k[:40] + '...'}"
            raise APIError(400, f"{name} is not supported by this server (known: include_usage)", name)
    v = so.get("include_usage")
    if v is None:
        return True
    if not isinstance(v, bool):
        raise APIError(400, f"stream_options.include_usage must be a boolean, got {_show(v)}",
                       "stream_options.include_usage")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 4:
        raise APIError(400, f"stop must be a non-empty string or a list of up to 4 of them, got {_show(v)}", "stop")
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


def _too_long(cap: int, prompt: int, completion: int | None, param: str, at_least: bool = False) -> APIError:
    least = "at least " if at_least else ""
    if completion is None:
        return APIError(400, f"This model's maximum context length is {cap} tokens. However, your prompt is "
                             f"{least}{prompt} tokens.", param, "context_length_exceeded")
    return APIError(400, f"This model's maximum context length is {cap} tokens. However, you requested "
                         f"{least}{prompt + completion} tokens ({least}{prompt} in the prompt, {completion} for the "
                         f"completion). Please reduce the prompt or {param}.", param, "context_length_exceeded")


def _tokens(state: ServeState, text: str, param: str, completion: int | None, limit_param: str) -> list[int]:
    """`text` tokenized; a text provably too long for the context (with `completion` tokens after it)
    is rejected by its length in characters before it is tokenized."""
    cap = state.engine.max_seq_len
    room = cap - (completion or 0) if completion is not None else cap - 1
    per = state.max_chars_per_token
    if per is not None and len(text) > room * per:
        raise _too_long(cap, -(-len(text) // per), completion, limit_param if completion is not None else param,
                        at_least=True)
    try:
        ids = state.engine.encode(text)
    except ValueError as e:
        raise APIError(400, f"{param}: the tokenizer cannot encode it ({e})", param) from None
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens", param)
    return ids


def _chat_tokens(state: ServeState, messages: list[dict], completion: int | None,
                 limit_param: str) -> tuple[str, list[int]]:
    """The chat's prompt text and its tokens."""
    text = state.chat_prompt(messages)
    return text, _tokens(state, text, "messages", completion, limit_param)


async def _off_loop(state: ServeState, size: int, fn, *args):
    """fn(*args): on the event loop when `size` (characters or bytes of input) is small, otherwise on
    the state's worker threads, so a big prompt does not stall every other request."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(state.pool, fn, *args)


def _check_model(body: dict, state: ServeState) -> bool:
    """Whether the request asks for SPRINT mode by its model id; 404 for a model we do not serve."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required (GET /v1/models lists them)", "model")
    if model == state.model_name:
        return False
    if model == state.model_name + SPRINT_SUFFIX:
        return True
    raise APIError(404, f"The model {_show(model)} does not exist; this server serves '{state.model_name}' and "
                        f"'{state.model_name}{SPRINT_SUFFIX}'", "model", "model_not_found")


SAMPLING_NAMES = ("temperature", "top_p", "top_k", "seed")
SPRINT_COUNTS = ("max_stages", "max_prompts", "max_planner_tokens", "max_branch_tokens", "max_total_tokens")


def _time_limit(v) -> float | None:
    """sprint.time_limit_s: seconds > 0, or null (no limit)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise APIError(400, f"sprint.time_limit_s must be a number of seconds > 0 (or null), got {_show(v)}",
                       "sprint.time_limit_s")
    return float(v)


def _sprint_config(extra: dict, state: ServeState, sampling: dict, max_tokens: int | None) -> tuple[Any, str]:
    """OrchestratorConfig of a SPRINT request: the server's, then the request's sampling
    (temperature, top_p, top_k, seed), max_tokens as max_total_tokens, then extra_body["sprint"]."""
    from sprint_jax.infer.orchestrator import MODES, OrchestratorConfig

    fields = {f.name for f in dataclasses.fields(OrchestratorConfig)} - {"layout", "format"}   # fixed by training
    upd: dict[str, Any] = dict(sampling)
    if max_tokens is not None:
        upd["max_total_tokens"] = max_tokens
    upd.update(_sampling_fields(extra, state, "sprint."))
    mode = "parallel"
    for k, v in extra.items():
        if k == "mode":
            if not isinstance(v, str) or v not in MODES:
                raise APIError(400, f"sprint.mode must be one of {', '.join(MODES)}, got {_show(v)}", "sprint.mode")
            mode = v
        elif k in SAMPLING_NAMES:
            continue
        elif k in SPRINT_COUNTS:
            upd[k] = _int(extra, k, None, 1, INT_MAX, label=f"sprint.{k}")
        elif k == "time_limit_s":
            upd[k] = _time_limit(v)
        elif k in fields:
            upd[k] = v
        else:
            shown = k if len(k) <= 40 else k[:40] + "..."
            raise APIError(400, f"sprint.{shown} is not a SPRINT budget; known: mode, {', '.join(sorted(fields))}",
                           f"sprint.{shown}")
    try:
        config = dataclasses.replace(state.sprint_config, **upd)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"sprint: {e}", "sprint") from None
    if mode == "serial" and config.resolved_join == "merge":
        raise APIError(400, "sprint.mode 'serial' has no branches to merge and this model joins by merge "
                            "(its layout); use mode 'parallel' or sprint.join 'reprefill'", "sprint.mode")
    return config, mode


async def build_job(body: dict, state: ServeState, chat: bool, channel: Channel) -> tuple[Job, int, bool]:
    """Validate a request into a Job; returns (job, prompt tokens, whether a stream ends with a
    usage chunk). Every field is checked before the prompt is tokenized; a long prompt is tokenized
    on worker threads."""
    _check_fields(body, chat)
    sprint = _check_model(body, state)
    extra = body.get("sprint")
    if extra is not None:
        if not isinstance(extra, dict):
            raise APIError(400, f"sprint must be an object of SPRINT settings ({{}} for the server's defaults) or "
                                f"null, got {_show(extra)}; leave it out to run without SPRINT", "sprint")
        sprint = True
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {_show(stream)}", "stream")
    include_usage = _include_usage(body, stream)
    top = _logprobs_request(body, chat)
    n = _int(body, "n", 1, 1, state.engine.max_children)
    stop = _stop(body)
    sampling = _sampling_fields(body, state)
    max_tokens, limit_param = _max_tokens(body, chat)
    cap = state.engine.max_seq_len
    param = "messages" if chat else "prompt"
    if sprint:
        if n != 1:
            raise APIError(400, "n must be 1 in SPRINT mode (the executors already run in parallel)", "n")
        config, mode = _sprint_config(extra or {}, state, sampling, max_tokens)
        reserve = None                  # the prompt must leave room for one token
    else:
        if max_tokens is not None and max_tokens >= cap:          # no prompt fits beside it
            raise _too_long(cap, 1, max_tokens, limit_param, at_least=True)
        reserve = max_tokens
    if chat:
        messages = _messages(body)
        text, prompt = await _off_loop(state, sum(len(m["content"]) for m in messages), _chat_tokens, state,
                                       messages, reserve, limit_param)
    else:
        text, ids = _prompt(body, state)
        if text is not None:
            text = state.formatted(text)
        prompt = ids if ids is not None else await _off_loop(state, len(text), _tokens, state, text, "prompt",
                                                             reserve, limit_param)
    if sprint:
        if len(prompt) >= cap:
            raise _too_long(cap, len(prompt), None, param)
        if text is None:
            text = await _off_loop(state, len(prompt), state.engine.decode_text, prompt, False)
        return Job("sprint", channel, prompt=prompt, query=text, mode=mode, config=config, stream=stream, stop=stop,
                   logprobs=top is not None, top_logprobs=top or 0), len(prompt), include_usage
    temperature = sampling.get("temperature", 1.0)
    top_p = sampling.get("top_p", 1.0)
    top_k = sampling.get("top_k", 0)
    seed = sampling.get("seed")
    if seed is None:
        seed = secrets.randbits(31)
    if max_tokens is None:
        max_tokens = min(state.default_max_tokens, max(1, cap - len(prompt)))
        if n > 1:                  # each child holds at most this many (the check below)
            max_tokens = min(max_tokens, max(1, state.engine.max_branch_tokens - 1))
    if len(prompt) + max_tokens > cap:
        raise _too_long(cap, len(prompt), max_tokens, limit_param)
    if n > 1 and max_tokens + 1 > state.engine.max_branch_tokens:
        raise APIError(400, f"with n > 1 each choice may generate at most {state.engine.max_branch_tokens - 1} "
                            f"tokens (the engine's child capacity, set by --max-branch-tokens), got "
                            f"{limit_param}={max_tokens}", limit_param)
    try:
        sampling = Sampling(temperature, top_k, top_p, seed)
    except SamplingError as e:                 # a range the checks above do not cover: still the request's fault
        raise APIError(400, str(e)) from None
    return Job("plain", channel, prompt=prompt, n=n, max_tokens=max_tokens, stop=stop, sampling=sampling,
               stream=stream, logprobs=top is not None, top_logprobs=top or 0), len(prompt), include_usage


def _logprobs_request(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request asks for with its log-probs; None: no log-probs.
    Completions: `logprobs` an integer 0..5 (false / null: none). Chat: `logprobs` true, with
    `top_logprobs` 0..20 (which needs `logprobs` true, as OpenAI has it)."""
    if not chat:
        if body.get("logprobs") is False:
            return None
        return _int(body, "logprobs", None, 0, COMPLETION_TOP_MAX)
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise APIError(400, f"logprobs must be a boolean, got {_show(on)}", "logprobs")
    top = _int(body, "top_logprobs", None, 0, CHAT_TOP_MAX)
    if top is not None and not on:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if on else None


def _prompt(body: dict, state: ServeState) -> tuple[str | None, list[int] | None]:
    """Completions: a string, a list of token ids, or a list holding one string; (text, None) for a
    text (tokenized later), (None, ids) for ids."""
    cap = state.engine.max_seq_len
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if len(p) >= cap:
            raise _too_long(cap, len(p), None, "prompt")
        vocab = state.engine.config.vocab_size
        if not all(0 <= t < vocab for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return None, list(p)
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                   "prompt")

# ---------------------------------------------------------------------------------------------
# Response shapes
# ---------------------------------------------------------------------------------------------
def _finish(gen, stops: list[str]) -> tuple[str, str]:
    text, hit = _cut(gen.text, stops)
    return text, "stop" if hit or gen.stop_reason in ("stop", "eos") else "length"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(chat: bool, index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def _logprobs_json(chat: bool, entries: list[TokenEntry], n: int, offsets: bool = False) -> dict:
    """A choice's (or a streamed chunk's) `logprobs` in OpenAI's shape, from the entries the worker
    lists (`TokenCursor`: one per generated token of the returned text, a token past a stop string
    or EOS left out; `sprint_token_layout` in SPRINT mode): each token's log-prob under the
    distribution it was drawn from (a greedy request: the model's own at temperature 1) and its n
    most likely alternatives. Token strings are each token decoded alone. Completions: tokens,
    token_logprobs, top_logprobs (null when n is 0), text_offset (characters into the choice's
    text). Chat: content[{token, logprob, bytes, top_logprobs}], with `offsets` (SPRINT mode, where
    the entries leave the inserted tags out) also text_offset, the same list as completions'."""
    if not chat:
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(e.top) for e in entries] if n else None,
                "text_offset": [e.offset for e in entries]}

    def entry(s: str, v: float) -> dict:
        return {"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8"))}
    out = {"content": [dict(entry(e.token, e.logprob), top_logprobs=[entry(a, w) for a, w in e.top]) for e in entries],
           "refusal": None}
    if offsets:
        out["text_offset"] = [e.offset for e in entries]
    return out


def _gen_logprobs(chat: bool, gen, text: str, n: int, decode) -> dict:
    """A plain choice's `logprobs` from its Generation (logprobs / top_logprobs)."""
    entries = TokenCursor(decode, n).take(gen.tokens, gen.logprobs, gen.top_logprobs, len(text))
    return _logprobs_json(chat, entries, n)


def _delta(chat: bool, index: int, text: str, finish: str | None = None, first: bool = False,
           logprobs: dict | None = None) -> dict:
    if chat:
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": d, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


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


def _sprint_delta(head: "_Head", text: str, stage: int | None, executor: int | None,
                  logprobs: dict | None = None) -> bytes:
    """A SPRINT stream's text chunk: its place in the run rides along (`sprint_delta`: the stage
    when known, the executor index or None for the planner's text)."""
    return _sse(head.body(choices=[_delta(head.chat, 0, text, logprobs=logprobs)],
                          sprint_delta={"stage": stage, "executor": executor}))


class _SprintStreamLogprobs:
    """A streamed SPRINT reply's log-probs: each text chunk carries the entries whose text begins
    in it. Every entry of the text sent so far is known when it is sent: a committed piece's from
    the run's layout at its event (`sprint_token_layout`), a preview's from the decoding row
    (planner: after the committed text; executor 1: after it and its opening, where `SprintText`
    previews it), so the chunks' entries concatenated are the whole reply's."""

    def __init__(self, chat: bool, top: int, decode):
        self.chat, self.top, self.decode = chat, top, decode
        self.listed_to = 0                 # entries before this character were listed

    def chunk(self, entries: list[TokenEntry], end: int) -> dict:
        new = [e for e in entries if self.listed_to <= e.offset < end]
        self.listed_to = max(self.listed_to, end)
        return _logprobs_json(self.chat, new, self.top, offsets=True)

    def committed(self, layout: list, sprint_text: SprintText) -> list[TokenEntry]:
        return sprint_token_layout(layout, sprint_text.committed, self.decode, self.top)

    def preview(self, p, sprint_text: SprintText) -> list[TokenEntry]:
        base = len(sprint_text.committed)
        if p.kind != "generate":
            base += len(executor_opening(sprint_text.format_name, sprint_text.stage, 1))
        return TokenCursor(self.decode, self.top, base).take(p.tokens, p.logprobs, p.tops, len(sprint_text.sent))


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
class _JSON(JSONResponse):
    """A JSON response as OpenAI writes one: compact, UTF-8 (non-ASCII as is)."""

    def render(self, content) -> bytes:
        # backslashreplace: a lone surrogate (never valid UTF-8) goes out as its JSON escape, not a 500
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


class _EventStream(StreamingResponse):
    """A server-sent event stream of one job. However the response ends (finished, the client
    gone, a bug), its event generator is closed (a job still running is cancelled) and `on_close`
    runs."""

    def __init__(self, events, on_close, on_bug):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.on_close, self.on_bug = events, on_close, on_bug

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):     # the client left mid-stream
            pass
        except Exception:                       # a bug: counted; starlette logs it (the stream has begun)
            self.on_bug()
            raise
        finally:
            await self.events.aclose()
            self.on_close()


class _RequireKey:
    """ASGI middleware: every HTTP route but /health needs `Authorization: Bearer <key>` (401 first,
    before routing, so an unknown path tells nothing to a client without the key)."""

    def __init__(self, app, key: bytes):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not _authorized(scope, self.key):
            e = APIError(401, "missing or incorrect API key: send it as the header 'Authorization: Bearer KEY'",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
            await e.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Endpoints:
    """The routes of one server (its `ServeState`), as starlette endpoints."""

    def __init__(self, state: ServeState):
        self.state, self.worker = state, state.worker

    async def models(self, request: Request) -> Response:
        data = [{"id": m, "object": "model", "created": self.state.created, "owned_by": "sprint-jax"}
                for m in (self.state.model_name, self.state.model_name + SPRINT_SUFFIX)]
        return _JSON({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        worker = self.worker
        if not worker.alive:
            return _JSON({"status": "error", "error": worker.error or "the engine is not running"}, status_code=503)
        mesh = getattr(self.state.engine, "mesh", None)
        shape = {k: int(v) for k, v in mesh.shape.items()} if mesh is not None else None
        return _JSON({"status": "ok", "model": self.state.model_name, "mesh": shape, **worker.metrics})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(_prometheus(self.worker), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: Request, chat: bool) -> Response:
        """A completion request: read and validate it, submit its job, answer it (one JSON reply,
        or a stream of server-sent events). A refused request is answered with its APIError."""
        t0 = time.perf_counter()
        try:
            body = await self._read_json(request)
            job, n_prompt, include_usage = await self._submit(body, chat)
        except APIError as e:
            self.worker.observe(e.status, None)
            return e.response()
        head = _Head(chat, body["model"], job.stream)
        inflight = self.state.inflight
        inflight.add(job.channel)               # a shutdown ends it at the grace's end
        if job.stream:
            return _EventStream(self._events(job, head, n_prompt, t0, include_usage),
                                on_close=lambda: inflight.discard(job.channel),
                                on_bug=lambda: self.worker.observe(500, None))
        try:
            return await self._answer(request, job, head, n_prompt, t0)
        finally:
            inflight.discard(job.channel)

    async def _read_json(self, request: Request) -> dict:
        """The request body parsed (`parse_body`): at most state.max_request_bytes (413 as soon as
        it is known to be more: by its Content-Length, before anything is read), all of it within
        state.body_timeout_s (408); a big body is parsed on the worker threads."""
        state = self.state
        limit = state.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        try:
            async with asyncio.timeout(state.body_timeout_s) as timeout:
                state.reading.add(timeout)        # a shutdown ends the wait early
                try:
                    raw = await _read_body(request.receive, limit)
                finally:
                    state.reading.discard(timeout)
        except TimeoutError:
            if state.drained:
                raise _shutting_down() from None
            raise APIError(408, f"the request body did not arrive within {state.body_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"}) from None
        if len(raw) <= INLINE_BYTES:
            return parse_body(raw)
        return await asyncio.get_running_loop().run_in_executor(state.pool, parse_body, raw)

    async def _submit(self, body: dict, chat: bool) -> tuple[Job, int, bool]:
        """The request's job (`build_job`), queued on the engine: 503 while the engine is down or the
        server drains, 429 when the queue is full."""
        state, worker = self.state, self.worker
        if not worker.alive:
            raise APIError(503, worker.error or "the engine is not running", headers={"Retry-After": "5"})
        if state.draining:
            raise _shutting_down()
        job, n_prompt, include_usage = await build_job(body, state, chat, Channel(asyncio.get_running_loop()))
        if state.draining:                    # began while the prompt was tokenized
            raise _shutting_down()
        if not worker.try_submit(job):
            raise APIError(429, f"the server holds {worker.capacity} requests (its queue is full); retry later",
                           code="queue_full", headers={"Retry-After": "1"})
        return job, n_prompt, include_usage

    async def _answer(self, request: Request, job: Job, head: _Head, n_prompt: int, t0: float) -> Response:
        """A submitted non-streaming job's reply, once it ends. A client that leaves first has its
        job cancelled (and gets nothing); a shutdown ends it with a 503."""
        worker = self.worker
        gone = asyncio.ensure_future(_until_disconnect(request.receive, job.channel))
        try:
            kind, value = await job.channel.get()
        finally:
            gone.cancel()
            if not job.finished:           # the client went away, or the server is shutting down
                worker.cancel(job)
        if kind == "gone":                 # nobody to answer (uvicorn drops a reply to a gone client)
            return Response()
        if kind in ("shutdown", "error"):  # an error: the worker's verdict, the request's fault or ours
            e = _shutting_down() if kind == "shutdown" else APIError(getattr(value, "status", 500), str(value))
            worker.observe(e.status, None)
            return e.response()
        worker.observe(200, time.perf_counter() - t0)
        chat = head.chat
        if job.kind == "sprint":
            rec = value
            text, finish = _sprint_reply(rec, job.stop)
            lp = _sprint_logprobs(job, chat, rec, text, self.state.engine.decode_text)
            return _JSON(head.body(choices=[_choice(chat, 0, text, finish, lp)],
                                   usage=_usage(n_prompt, rec.total_tokens), sprint=_sprint_json(rec)))
        choices, completion = [], 0
        for i, g in enumerate(value):
            text, finish = _finish(g, job.stop)
            lp = _gen_logprobs(chat, g, text, job.top_logprobs, self.state.engine.decode_text) if job.logprobs \
                else None
            choices.append(_choice(chat, i, text, finish, lp))
            completion += len(g.tokens)
        return _JSON(head.body(choices=choices, usage=_usage(n_prompt, completion)))

    async def _events(self, job: Job, head: _Head, n_prompt: int, t0: float, include_usage: bool):
        """A streaming job's server-sent events until [DONE]: text deltas as the engine reports
        tokens (SPRINT: its events and progress), a comment every KEEPALIVE_S while nothing comes,
        the final chunk(s) with finish reasons, then the usage chunk unless the client declined
        it. An error or a shutdown ends the stream with an error event."""
        worker, state = self.worker, self.state
        texts = [_StreamText(state.engine.decode_text, job.stop) for _ in range(job.n)]
        cursors = [TokenCursor(state.engine.decode_text, job.top_logprobs) for _ in range(job.n)] \
            if job.logprobs and job.kind == "plain" else None
        # SPRINT mode: the completion as it is decoded, in the model's tag format
        sprint_text = SprintText(state.engine.decode_text, getattr(job.config, "format", "sprint"), job.stop)
        sprint_lp = _SprintStreamLogprobs(head.chat, job.top_logprobs, state.engine.decode_text) \
            if job.logprobs and job.kind == "sprint" else None
        try:
            if head.chat:
                yield _sse(head.body(choices=[_delta(True, i, "", first=True) for i in range(job.n)]))
            while True:
                try:
                    item = await asyncio.wait_for(job.channel.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                kind, value = item[0], item[1]
                if kind == "tokens":
                    for i, toks in enumerate(value):
                        d = texts[i].delta(toks)
                        if d:
                            lp = None
                            if cursors is not None and item[2] is not None:   # the tokens this text begins
                                lps, tops = item[2][i]
                                lp = _logprobs_json(head.chat, cursors[i].take(toks, lps, tops, texts[i].sent),
                                                    job.top_logprobs)
                            yield _sse(head.body(choices=[_delta(head.chat, i, d, logprobs=lp)]))
                elif kind == "event":
                    for d in sprint_text.event(value):
                        lp = sprint_lp.chunk(sprint_lp.committed(item[2], sprint_text), len(sprint_text.sent)) \
                            if sprint_lp is not None else None
                        yield _sprint_delta(head, *d, logprobs=lp)
                    if value.kind != "text":
                        yield _sse(head.body(choices=[_delta(head.chat, 0, "")], sprint_event=_event_json(value)))
                elif kind == "progress":
                    for d in sprint_text.progress(value):
                        lp = sprint_lp.chunk(sprint_lp.preview(value, sprint_text), len(sprint_text.sent)) \
                            if sprint_lp is not None else None
                        yield _sprint_delta(head, *d, logprobs=lp)
                elif kind in ("error", "shutdown"):
                    e = _shutting_down() if kind == "shutdown" else APIError(getattr(value, "status", 500), str(value))
                    worker.observe(e.status, None)
                    yield _sse(e.payload())
                    yield b"data: [DONE]\n\n"
                    return
                else:
                    for chunk in _final_chunks(job, head, value, texts, sprint_text, n_prompt, include_usage,
                                               cursors, state.engine.decode_text, sprint_lp):
                        yield chunk
                    worker.observe(200, time.perf_counter() - t0)
                    return
        finally:
            if not job.finished:
                worker.cancel(job)


def _final_chunks(job: Job, head: _Head, value, texts: list, sprint_text: SprintText, n_prompt: int,
                  include_usage: bool, cursors: list | None, decode, sprint_lp: "_SprintStreamLogprobs | None"):
    """The events that end a finished stream: each choice's rest of text with its finish reason
    and the log-probs of the tokens not listed yet (SPRINT: with the run's record), the usage
    chunk, [DONE]."""
    if job.kind == "sprint":
        rec = value
        text, finish = _sprint_reply(rec, job.stop)
        lp = None
        if sprint_lp is not None:
            lp = sprint_lp.chunk(sprint_token_layout(job.layout, rec.text, decode, job.top_logprobs), len(text))
        yield _sse(head.body(choices=[_delta(head.chat, 0, sprint_text.rest(text), finish, logprobs=lp)],
                             sprint=_sprint_json(rec)))
        completion = rec.total_tokens
    else:
        completion = 0
        for i, g in enumerate(value):
            text, finish = _finish(g, job.stop)
            lp = None
            if cursors is not None:
                lp = _logprobs_json(head.chat, cursors[i].take(g.tokens, g.logprobs, g.top_logprobs, len(text)),
                                    job.top_logprobs)
            yield _sse(head.body(choices=[_delta(head.chat, i, texts[i].rest(text), finish, logprobs=lp)]))
            completion += len(g.tokens)
    if include_usage:
        yield _sse(head.body(choices=[], usage=_usage(n_prompt, completion)))
    yield b"data: [DONE]\n\n"


def _prometheus(worker: EngineWorker) -> str:
    """The worker's metrics in Prometheus text format."""
    m = worker.metrics
    lines = []

    def metric(name, kind, help_text, value):
        lines.extend([f"# HELP sprint_serve_{name} {help_text}", f"# TYPE sprint_serve_{name} {kind}",
                      f"sprint_serve_{name} {value}"])
    metric("queue_depth", "gauge", "Requests waiting for a sequence slot.", m["queue_depth"])
    metric("active_rows", "gauge", "Decoding rows (requests' sequences and their fork children).", m["active_rows"])
    metric("slots_used", "gauge", "Parent sequence slots in use.", m["slots_used"])
    metric("slots_total", "gauge", "Parent sequence slots.", m["slots_total"])
    metric("running_requests", "gauge", "Requests held by the engine.", m["running_jobs"])
    metric("generated_tokens_total", "counter", "Tokens generated since start.", m["tokens_total"])
    metric("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.", f"{m['tokens_per_s']:.3f}")
    metric("cancelled_total", "counter", "Requests cancelled because their client went away.", m["cancelled"])
    metric("kv_pages_total", "gauge", "Pages of the KV pool.", m["pages_total"])
    metric("kv_pages_free", "gauge", "Pages of the KV pool on the free list.", m["pages_free"])
    metric("kv_pages_used", "gauge", "Pages of the KV pool held by live sequences.", m["pages_used"])
    metric("kv_pages_cached", "gauge", "Pages of the KV pool held only by the prefix cache (evictable).",
           m["pages_cached"])
    metric("kv_page_size", "gauge", "Tokens per page of the KV pool.", m["page_size"])
    metric("prefix_hit_tokens_total", "counter", "Prompt tokens sequences took from the prefix cache.",
           m["prefix_hit_tokens"])
    metric("evicted_pages_total", "counter", "Cached pages evicted from the KV pool.", m["evicted_pages"])
    metric("prompt_tokens_total", "counter", "Prompt tokens of the sequences opened for requests.",
           m["prompt_tokens"])
    metric("prompt_tokens_cached_total", "counter", "Prompt tokens of requests taken from the prefix cache.",
           m["prompt_tokens_cached"])
    metric("prompt_tokens_prefilled_total", "counter", "Prompt tokens of requests the model ran (not cached).",
           m["prompt_tokens_prefilled"])
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
    return "\n".join(lines) + "\n"


def make_app(state: ServeState) -> Starlette:
    """The server's starlette app: the routes of `_Endpoints`, the API key check (`_RequireKey`)
    when state.api_key is set, OpenAI-shaped 404 / 405 / 500 replies, and a lifespan that starts
    the engine task (engine on the loop) and stops the worker at shutdown."""
    worker = state.worker
    ep = _Endpoints(state)

    async def not_found(request: Request, exc) -> Response:
        return APIError(404, f"no route {request.method} {request.url.path}").response()

    async def bad_method(request: Request, exc) -> Response:
        return APIError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def internal(request: Request, exc) -> Response:     # a bug: the client gets a 500, the log the traceback
        worker.observe(500, None)
        return internal_error(exc).response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start_on_loop()                 # the engine task, when the engine runs on the loop
        yield
        worker.stop()
        state.pool.shutdown(wait=False, cancel_futures=True)

    routes = [Route("/v1/models", ep.models, methods=["GET"]), Route("/health", ep.health, methods=["GET"]),
              Route("/metrics", ep.metrics, methods=["GET"]),
              Route("/v1/completions", ep.completions, methods=["POST"]),
              Route("/v1/chat/completions", ep.chat_completions, methods=["POST"])]
    middleware = [Middleware(_RequireKey, key=state.api_key.encode())] if state.api_key else []
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: bad_method, Exception: internal})


async def _read_body(receive, limit: int | None = None) -> bytes:
    """The whole request body (what arrived, if the client left); 413 once it exceeds `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":      # http.disconnect
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    # the connection closes after the reply: the rest of the body is never read
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         f"(sprint-jax serve --max-request-bytes)", code="request_too_large",
                    headers={"Connection": "close"})


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or after it restarts",
                    code="server_shutting_down", headers={"Retry-After": "5", "Connection": "close"})


async def _until_disconnect(receive, channel: Channel) -> None:
    """Once the client has gone (its body was read whole before), tell the waiting handler."""
    while (await receive())["type"] == "http.request":
        pass
    channel.put(("gone", None))


def _authorized(scope, key: bytes) -> bool:
    """Whether the request carries `Authorization: Bearer <key>` (compared in constant time)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
    return False


# the terminations of a SPRINT run that ended on its own (its final answer, EOS) or at a stop
# string of the request: finish_reason "stop"; every other one (a budget, the wall clock, the
# context, max_stages, a malformed plan, an engine error) cut the run short: "length"
SPRINT_STOPS = ("final_answer", "eos", STOP_TERMINATION)


def _sprint_reply(rec, stops: list[str]) -> tuple[str, str]:
    """A SPRINT run's reply text and finish reason: its text cut at the first stop string of the
    request (finish "stop"), else the whole text with the finish its termination implies."""
    text, hit = _cut(rec.text, stops)
    return text, "stop" if hit or rec.termination in SPRINT_STOPS else "length"


def _sprint_logprobs(job: Job, chat: bool, rec, text: str, decode) -> dict | None:
    """A SPRINT reply's `logprobs` (None unless asked): `sprint_token_layout` of the run, the
    entries of the returned `text` only, with text_offset in chat too."""
    if not job.logprobs:
        return None
    entries = [e for e in sprint_token_layout(job.layout, rec.text, decode, job.top_logprobs) if e.offset < len(text)]
    return _logprobs_json(chat, entries, job.top_logprobs, offsets=True)


def _sprint_json(rec) -> dict:
    d = rec.to_json()
    d.pop("query", None)
    return d
