"""The one way curation talks to an LLM: the `openai` client, cached in the store, retried politely.

Every teacher, extractor and DAG call (paper §4-5) goes through `CachedChat.complete`:
  1. hash (model, messages, params) and look it up in the store: a hit costs nothing;
  2. otherwise call the endpoint with the openai client's own retries turned off, retrying here on
     429, 5xx, timeouts and connection errors with exponential backoff and full jitter, honouring
     the server's Retry-After (`retry-after-ms` / `retry-after` seconds or HTTP date);
  3. commit the response and its token usage before returning, so a crash after this point never
     pays for the same request again.
`structured` adds JSON-schema output validated with pydantic and one repair turn that sends the
validation error back. Keys come from the environment (EndpointConfig.api_key) and are never
hashed, stored or logged.
"""
from __future__ import annotations

import dataclasses
import email.utils
import json
import random
import threading
import time
from typing import TypeVar

import pydantic

from sprint_jax.curation.config import EndpointConfig
from sprint_jax.curation.store import Store, request_hash

M = TypeVar("M", bound=pydantic.BaseModel)


class Discarded(Exception):
    """A record a stage will not keep, for a named `reason` (counted in the report) with a `detail`
    for the log. Not an error of the run: the pipeline records it and goes on."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class LLMCallError(Exception):
    """A call that failed for good. `retryable` is True when the endpoint stayed unavailable through
    every retry (a later run should try again) and False when the request itself was refused."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class EndpointRefused(Exception):
    """The endpoint refuses every request (bad key, unknown model, wrong URL): stop the whole run."""


@dataclasses.dataclass
class Completion:
    content: str
    finish_reason: str | None
    usage: dict
    cached: bool
    key: str
    reasoning: str = ""              # a reasoning model's separate thinking field, when the server sends one


def _reasoning(response: dict) -> str:
    """DeepSeek / vLLM reasoning parsers return the chain of thought beside `content`."""
    try:
        message = response["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return ""
    return message.get("reasoning_content") or message.get("reasoning") or ""


@dataclasses.dataclass
class CallStats:
    """What this process did (the store holds the cumulative, paid totals)."""
    calls_made: int = 0
    cache_hits: int = 0
    retries: int = 0
    failures: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {"calls_made": self.calls_made, "cache_hits": self.cache_hits,
                "retries": self.retries, "failures": self.failures}


def retry_after_seconds(headers, now: float | None = None) -> float | None:
    """The wait a 429/503 asks for: `retry-after-ms`, then `retry-after` (seconds or an HTTP date,
    counted from `now`, a Unix time, by default the clock's); None when there is none or it is
    unreadable. Never negative."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Full jitter (uniform in [0, min(cap, base * 2^attempt)]): retries from many workers spread out."""
    return rng.uniform(0.0, min(cap, base * (2.0 ** attempt)))


class CachedChat:
    """A chat-completions endpoint bound to a store and a purpose ("teacher" / "extract" / "dag")."""

    def __init__(self, endpoint: EndpointConfig, store: Store, purpose: str, section: str,
                 stats: CallStats | None = None, seed: int = 0):
        self.endpoint = endpoint
        self.store = store
        self.purpose = purpose
        self.section = section           # config section name, for error messages
        self.stats = stats or CallStats()
        self._client = None
        self._client_lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}
        self._inflight_lock = threading.Lock()

    def _openai(self):
        with self._client_lock:
            if self._client is None:
                import openai
                self._client = openai.OpenAI(
                    api_key=self.endpoint.api_key(self.section), base_url=self.endpoint.base_url,
                    timeout=self.endpoint.timeout_s, max_retries=0)
            return self._client

    def params(self, response_format: dict | None = None) -> dict:
        p = {"temperature": self.endpoint.temperature, "max_tokens": self.endpoint.max_tokens}
        if response_format is not None:
            p["response_format"] = response_format
        return p

    def _sleep(self, attempt: int, retry_after: float | None) -> None:
        if retry_after is not None:
            if retry_after > self.endpoint.max_retry_after_s:
                raise LLMCallError(f"{self.endpoint.base_url} asked to retry after {retry_after:.0f}s "
                                   f"(> {self.section}.max_retry_after_s)", retryable=True)
            delay = retry_after
        else:
            with self._rng_lock:
                delay = backoff_delay(attempt, self.endpoint.backoff_base_s, self.endpoint.backoff_max_s, self._rng)
        time.sleep(delay)

    def complete(self, messages: list[dict], response_format: dict | None = None) -> Completion:
        """One chat completion: from the store if this exact request was ever answered, else paid once."""
        params = self.params(response_format)
        key = request_hash(self.endpoint.model, messages, params)
        # identical requests in flight at once (duplicate problems) wait for the first: paid once
        with self._inflight_lock:
            gate = self._inflight.setdefault(key, threading.Lock())
        with gate:
            try:
                return self._complete(key, messages, params)
            finally:
                with self._inflight_lock:
                    self._inflight.pop(key, None)

    def _complete(self, key: str, messages: list[dict], params: dict) -> Completion:
        import openai

        hit = self.store.get_call(key)
        if hit is not None:
            self.stats.add(cache_hits=1)
            return Completion(hit["content"] or "", hit["finish_reason"], hit["usage"], True, key,
                              _reasoning(hit["response"]))
        client = self._openai()
        last = ""
        for attempt in range(self.endpoint.max_retries + 1):
            try:
                resp = client.chat.completions.create(model=self.endpoint.model, messages=messages, **params)
            except openai.APIStatusError as e:
                if e.status_code in (401, 403, 404):
                    raise EndpointRefused(
                        f"{self.endpoint.base_url} refused the {self.purpose} request with HTTP {e.status_code} "
                        f"(check {self.section}.model, {self.section}.base_url and the key in "
                        f"${self.endpoint.api_key_env}): {_short(e)}") from None
                if e.status_code == 429 or e.status_code >= 500 or e.status_code == 408:
                    last = f"HTTP {e.status_code}: {_short(e)}"
                    if attempt == self.endpoint.max_retries:
                        break
                    self.stats.add(retries=1)
                    self._sleep(attempt, retry_after_seconds(e.response.headers))
                    continue
                self.stats.add(failures=1)
                raise LLMCallError(f"HTTP {e.status_code}: {_short(e)}", retryable=False) from None
            except (openai.APITimeoutError, openai.APIConnectionError) as e:
                last = f"{type(e).__name__}: {e}"
                if attempt == self.endpoint.max_retries:
                    break
                self.stats.add(retries=1)
                self._sleep(attempt, None)
                continue
            except openai.APIResponseValidationError as e:
                self.stats.add(failures=1)
                raise LLMCallError(f"malformed response: {e}", retryable=True) from None
            except json.JSONDecodeError as e:      # a JSON content type over a body that is not JSON
                self.stats.add(failures=1)
                raise LLMCallError(f"malformed response: the body is not JSON ({e})", retryable=True) from None
            problem = _malformed(resp)
            if problem:
                self.stats.add(failures=1)
                raise LLMCallError(problem, retryable=True)
            choice = resp.choices[0]
            content = choice.message.content or ""
            usage = resp.usage.model_dump() if resp.usage is not None else {}
            usage = {k: usage.get(k) or 0 for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
            response = resp.model_dump(mode="json")
            self.store.put_call(key, self.purpose, self.endpoint.model,
                                {"model": self.endpoint.model, "messages": messages, "params": params},
                                response, content, choice.finish_reason, usage, attempts=attempt + 1)
            self.stats.add(calls_made=1)
            return Completion(content, choice.finish_reason, usage, False, key, _reasoning(response))
        self.stats.add(failures=1)
        raise LLMCallError(f"{self.purpose} call failed after {self.endpoint.max_retries + 1} attempts: {last}",
                           retryable=True)


def _malformed(resp) -> str:
    """Why a 200 answer is not a usable chat completion ("" when it is). The openai client builds its
    objects without validating them: a body that is not JSON comes back as its text, and a null or
    mistyped field as whatever the server sent, which would otherwise fail far from the call."""
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletion, ChatCompletionMessage

    if not isinstance(resp, ChatCompletion):
        return f"malformed response: not a chat completion: {_clip(repr(resp))}"
    if not isinstance(resp.choices, list) or not resp.choices:
        return "response has no choices"
    message = getattr(resp.choices[0], "message", None)
    if not isinstance(message, ChatCompletionMessage):
        return f"malformed response: choices[0].message is {_clip(repr(message))}, not a message"
    if message.content is not None and not isinstance(message.content, str):
        return f"malformed response: choices[0].message.content is {_clip(repr(message.content))}, not text"
    usage = resp.usage
    counts = [getattr(usage, k, None) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
    if usage is not None and (not isinstance(usage, CompletionUsage)
                              or any(c is not None and (isinstance(c, bool) or not isinstance(c, int)) for c in counts)):
        return f"malformed response: usage is {_clip(repr(usage))}"
    return ""


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _short(e: Exception, limit: int = 300) -> str:
    text = getattr(e, "message", None) or str(e)
    return text if len(text) <= limit else text[:limit] + "..."


def json_schema_format(name: str, model: type[pydantic.BaseModel]) -> dict:
    """`response_format` for OpenAI structured outputs, generated from the pydantic model."""
    return {"type": "json_schema",
            "json_schema": {"name": name, "strict": True, "schema": model.model_json_schema()}}


@dataclasses.dataclass
class StructuredResult:
    value: pydantic.BaseModel | None
    error: str                       # why the last reply was rejected ("" on success)
    calls: int                       # 1, or 2 with the repair turn


def structured(chat: CachedChat, messages: list[dict], model: type[M], name: str,
               check=None) -> StructuredResult:
    """Ask for JSON matching `model`; on a reply that does not parse or validate (or fails `check`,
    a function returning an error string or ""), send the error back once and ask again."""
    fmt = json_schema_format(name, model)
    convo = list(messages)
    error = ""
    for turn in range(2):
        reply = chat.complete(convo, response_format=fmt)
        try:
            value = model.model_validate_json(reply.content)
            error = check(value) if check is not None else ""
        except pydantic.ValidationError as e:
            value, error = None, _validation_message(e)
        if not error:
            return StructuredResult(value, "", turn + 1)
        convo = convo + [
            {"role": "assistant", "content": reply.content},
            {"role": "user", "content": (
                "Your reply was rejected: " + error + "\nReply again with only a JSON object that "
                "matches the schema, fixing this problem.")},
        ]
    return StructuredResult(None, error, 2)


def _validation_message(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "(root)"
        parts.append(f"{loc}: {err.get('msg', '')}")
    return "; ".join(parts) if parts else json.dumps(str(e))[:300]
