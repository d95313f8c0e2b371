"""The LLM-facing layer of curation against a real HTTP server, through the real openai client:
caching by request hash, retries honouring Retry-After, timeouts, refusals, JSON repair turns,
and the DAG validation policy."""
from __future__ import annotations

import email.utils
import json
import sqlite3
import sys
import threading
import time

import openai
import pytest

from fake_openai_server import Fault, FakeOpenAIServer, Reply
from sprint_jax.config import ConfigError
from sprint_jax.curation.config import EndpointConfig
from sprint_jax.curation.dag import DagFailed, EdgeList, validate_edges
from sprint_jax.curation.extract import StepList
from sprint_jax.curation.llm import (CachedChat, CallStats, EndpointRefused, LLMCallError, backoff_delay,
                                     retry_after_seconds, structured)
from sprint_jax.curation.store import Store, request_hash
from sprint_jax.curation.teacher import OpenAITeacher, final_answer_of
from sprint_jax.tasks.types import Task

KEY_ENV = "SPRINT_JAX_TEST_KEY"
SECRET = "sk-test-do-not-store-3141592653"


def user_text(body: dict) -> str:
    return body["messages"][-1]["content"]


def echo(body: dict) -> str:
    return "echo: " + user_text(body)


@pytest.fixture
def server():
    with FakeOpenAIServer(echo, api_key=SECRET) as srv:
        yield srv


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "run.sqlite") as s:
        yield s


def endpoint(srv: FakeOpenAIServer, **kw) -> EndpointConfig:
    base = dict(base_url=srv.base_url, model="fake-model", api_key_env=KEY_ENV, max_retries=3,
                timeout_s=5.0, backoff_base_s=0.01, backoff_max_s=0.05, max_tokens=64)
    return EndpointConfig(**{**base, **kw})


def make_chat(srv, store, monkeypatch, **kw) -> CachedChat:
    monkeypatch.setenv(KEY_ENV, SECRET)
    return CachedChat(endpoint(srv, **kw), store, "teacher", "teacher", CallStats())


def msgs(text: str) -> list[dict]:
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]


def test_cache_hit_sends_nothing_and_survives_reopen(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with Store(tmp_path / "a.sqlite") as s:
        chat = CachedChat(endpoint(server), s, "teacher", "teacher")
        first = chat.complete(msgs("hello"))
        again = chat.complete(msgs("hello"))
        other = chat.complete(msgs("world"))
    assert first.content == "echo: hello" and not first.cached
    assert again.cached and again.content == first.content and again.usage == first.usage
    assert other.content == "echo: world"
    assert server.n_received() == 2 and max(server.answered.values()) == 1
    assert first.usage == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert sqlite3.connect(tmp_path / "a.sqlite").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with Store(tmp_path / "a.sqlite") as s:  # a new process would see the same cache
        chat = CachedChat(endpoint(server), s, "teacher", "teacher")
        assert chat.complete(msgs("hello")).cached
        assert s.call_totals()["teacher"]["calls"] == 2
    assert server.n_received() == 2


def test_request_hash_covers_params_not_key_or_url(server, store, monkeypatch):
    chat = make_chat(server, store, monkeypatch)
    key = chat.complete(msgs("x")).key
    assert key == request_hash("fake-model", msgs("x"), {"temperature": 0.0, "max_tokens": 64})
    assert key != request_hash("fake-model", msgs("x"), {"temperature": 0.5, "max_tokens": 64})
    assert key != request_hash("other-model", msgs("x"), {"temperature": 0.0, "max_tokens": 64})
    # a different base URL and key reuse the stored answer (same model, messages, params)
    monkeypatch.setenv("OTHER_KEY", "sk-other")
    mirror = CachedChat(endpoint(server, base_url="http://127.0.0.1:9/v1", api_key_env="OTHER_KEY"),
                        store, "teacher", "teacher")
    assert mirror.complete(msgs("x")).cached
    assert SECRET.encode() not in (store.path.read_bytes() + _wal(store))


def _wal(store: Store) -> bytes:
    wal = store.path.with_name(store.path.name + "-wal")
    return wal.read_bytes() if wal.exists() else b""


def record_backoff(monkeypatch) -> list[tuple]:
    """Each backoff the client asks for, as (attempt, Retry-After seconds or None, the error that
    caused it, the seconds it slept); the waits still happen."""
    real_sleep, asked = time.sleep, []

    def _sleep(self, attempt, retry_after):
        cause = type(sys.exc_info()[1])            # called while the retried error is being handled
        slept, me = [], threading.get_ident()

        def sleep(seconds):
            if threading.get_ident() == me:        # not the server's threads
                slept.append(seconds)
            real_sleep(seconds)
        monkeypatch.setattr(time, "sleep", sleep)
        try:
            real(self, attempt, retry_after)
        finally:
            monkeypatch.setattr(time, "sleep", real_sleep)
        asked.append((attempt, retry_after, cause, slept))

    real = CachedChat._sleep
    monkeypatch.setattr(CachedChat, "_sleep", _sleep)
    return asked


def test_429_honours_retry_after_seconds(server, store, monkeypatch):
    chat = make_chat(server, store, monkeypatch)
    backoff = record_backoff(monkeypatch)
    server.add_fault(Fault(status=429, headers={"Retry-After": "1"}))
    out = chat.complete(msgs("slow down"))
    assert out.content == "echo: slow down"
    first, second = server.log
    assert first.outcome == "status 429" and second.outcome == "answered"
    # it waited what the server asked for (its own backoff would be <= backoff_max_s = 0.05 s)
    assert backoff == [(0, 1.0, openai.RateLimitError, [1.0])]
    assert chat.stats.retries == 1 and chat.stats.calls_made == 1
    assert store.call_totals()["teacher"]["attempts"] == 2


def test_retry_after_ms_and_http_date():
    assert retry_after_seconds({"retry-after-ms": "250"}) == pytest.approx(0.25)
    assert retry_after_seconds({"retry-after": "3"}) == 3.0
    now = 1_750_000_000.0                                      # a whole second: HTTP dates have no fraction
    in_30s = email.utils.formatdate(now + 30, usegmt=True)
    assert retry_after_seconds({"retry-after": in_30s}, now=now) == 30.0
    assert retry_after_seconds({"retry-after": in_30s}, now=now + 40) == 0.0   # a date already past
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None


def test_backoff_is_exponential_capped_and_jittered():
    import random
    rng = random.Random(0)
    draws = [[backoff_delay(a, 1.0, 10.0, rng) for _ in range(200)] for a in range(6)]
    for attempt, d in enumerate(draws):
        assert 0 <= min(d) and max(d) <= min(10.0, 2.0 ** attempt)
        assert len(set(d)) > 150                               # jitter: not one fixed delay
    assert max(draws[3]) > 4 * max(draws[0])                   # grows with the attempt


def test_5xx_then_success_and_exhaustion(server, store, monkeypatch):
    chat = make_chat(server, store, monkeypatch, max_retries=2)
    server.add_fault(Fault(status=500), times=2)
    assert chat.complete(msgs("flaky")).content == "echo: flaky"
    assert [r.outcome for r in server.log] == ["status 500", "status 500", "answered"]
    server.add_fault(Fault(status=503, headers={"retry-after-ms": "10"}), times=3)
    with pytest.raises(LLMCallError) as e:
        chat.complete(msgs("down"))
    assert e.value.retryable and "3 attempts" in str(e.value) and "503" in str(e.value)
    assert store.get_call(request_hash("fake-model", msgs("down"), chat.params())) is None


def test_timeout_is_retried(server, store, monkeypatch):
    """The server holds the first request 2.5 s and then drops it: the client gives up at its 1 s
    timeout (an APITimeoutError, not the later dropped connection), backs off and asks again."""
    chat = make_chat(server, store, monkeypatch, timeout_s=1.0)
    backoff = record_backoff(monkeypatch)
    server.add_fault(Fault(kind="hang", seconds=2.5))
    assert chat.complete(msgs("hang")).content == "echo: hang"
    assert [r.outcome for r in server.log] == ["hang", "answered"]
    [(attempt, retry_after, cause, slept)] = backoff
    assert (attempt, retry_after, cause) == (0, None, openai.APITimeoutError)
    assert len(slept) == 1 and 0 <= slept[0] <= 0.01        # full jitter within backoff_base_s * 2^0
    assert chat.stats.retries == 1 and chat.stats.calls_made == 1 and chat.stats.failures == 0


def test_dropped_connection_is_retried(server, store, monkeypatch):
    chat = make_chat(server, store, monkeypatch)
    server.add_fault(Fault(kind="drop"))
    assert chat.complete(msgs("drop")).content == "echo: drop"
    assert len(server.log) == 2


class BrokenBodyServer(FakeOpenAIServer):
    """A FakeOpenAIServer that can answer with a raw body under status 200: what a proxy's error page
    or a broken server sends with a success status."""

    def __init__(self, script, **kw):
        super().__init__(script, **kw)
        self._bodies: list[list] = []            # [when, body bytes, content type, remaining]
        self._chosen = threading.local()
        self.on_receive = self._choose

    def answer_with(self, body: bytes, content_type: str = "application/json",
                    when=lambda body: True, times: int = 1) -> None:
        with self._lock:
            self._bodies.append([when, body, content_type, times])

    def _choose(self, record) -> bool:
        self._chosen.body = None
        with self._lock:
            for entry in self._bodies:
                if entry[3] > 0 and entry[0](record.body):
                    entry[3] -= 1
                    self._chosen.body = (entry[1], entry[2])
                    break
        return False                               # answer it, with that body

    def _send_json(self, h, status, payload, headers=None) -> None:
        chosen = getattr(self._chosen, "body", None)
        if status != 200 or chosen is None:
            return super()._send_json(h, status, payload, headers)
        self._chosen.body = None
        body, content_type = chosen
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
        h.wfile.flush()


def _completion(**choice) -> bytes:
    return json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "fake-model",
                       "choices": [{"index": 0, "finish_reason": "stop", **choice}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


BROKEN_BODIES = {
    "html page": (b"<html><body>502 Bad Gateway</body></html>", "text/html", "not a chat completion"),
    "not json": (b"<html>upstream error", "application/json", "the body is not JSON"),
    "json list": (b"[]", "application/json", "not a chat completion"),
    "null message": (_completion(message=None), "application/json", "choices[0].message is None"),
    "text message": (_completion(message="hi"), "application/json", "choices[0].message is 'hi'"),
    "number content": (_completion(message={"role": "assistant", "content": 5}), "application/json",
                       "choices[0].message.content is 5"),
    "no choices": (b"{}", "application/json", "response has no choices"),
}


@pytest.mark.parametrize("name", list(BROKEN_BODIES))
def test_a_200_that_is_not_a_completion_is_a_failed_call(store, monkeypatch, name):
    """A 200 whose body is not JSON, or whose message is null or not a message, used to raise
    AttributeError out of the call (and the curate run): it is a failed call, counted, retryable
    by a later run, and nothing is stored."""
    body, content_type, reason = BROKEN_BODIES[name]
    with BrokenBodyServer(echo, api_key=SECRET) as srv:
        srv.answer_with(body, content_type)
        chat = make_chat(srv, store, monkeypatch)
        with pytest.raises(LLMCallError) as e:
            chat.complete(msgs("broken"))
        assert e.value.retryable and reason in str(e.value)
        assert chat.stats.as_dict() == {"calls_made": 0, "cache_hits": 0, "retries": 0, "failures": 1}
        assert store.get_call(request_hash("fake-model", msgs("broken"), chat.params())) is None
        again = chat.complete(msgs("broken"))                   # the later try is paid and stored
        assert again.content == "echo: broken" and not again.cached
        assert chat.complete(msgs("broken")).cached
        assert [r.outcome for r in srv.log] == ["answered", "answered"]


def test_curate_records_a_broken_200_and_a_rerun_catches_up(tmp_path, monkeypatch):
    """Through the pipeline: the teacher's 200 for one task is an HTML page; the run finishes with
    that task discarded as an API error, and the rerun pays for exactly that call."""
    from fake_openai_server import ScriptedCurator, write_math_jsonl
    from sprint_jax.config import load_config
    from sprint_jax.curation.config import CurateConfig
    from sprint_jax.curation.pipeline import run_pipeline, status

    monkeypatch.setenv(KEY_ENV, SECRET)
    write_math_jsonl(tmp_path / "tasks.jsonl")
    endpoint = dict(api_key_env=KEY_ENV, max_retries=1, timeout_s=5.0, backoff_base_s=0.01, backoff_max_s=0.05,
                    concurrency=2, max_tokens=512)
    script = ScriptedCurator()
    with BrokenBodyServer(script, api_key=SECRET) as srv:
        data = {"tasks": {"source": "file", "path": str(tmp_path / "tasks.jsonl")},
                "teacher": {"kind": "openai", "model": "fake-teacher", "base_url": srv.base_url, **endpoint},
                "extractor": {"kind": "llm", "model": "fake-extractor", "base_url": srv.base_url, **endpoint},
                "dag": {"kind": "llm", "model": "fake-dag", "base_url": srv.base_url, **endpoint}}
        cfg = load_config(CurateConfig, None, (), data=data)
        srv.answer_with(b"<html>502</html>", "text/html",
                        when=lambda b: script.purpose(b) == "teacher" and script.task_id(b) == "t2")
        report = run_pipeline(cfg, tmp_path / "out", progress=False)
        assert report["discards"]["teacher"] == {"api_error": 1}
        assert status(tmp_path / "out")["stages"]["teacher"] == {"kept": 3, "discarded": 1, "pending": 0}
        paid = sum(srv.answered.values())
        report = run_pipeline(cfg, tmp_path / "out", progress=False)
        assert "teacher" not in report["discards"]
        assert status(tmp_path / "out")["stages"]["teacher"] == {"kept": 4, "discarded": 0, "pending": 0}
        assert report["run"]["calls_made"] == sum(srv.answered.values()) - paid >= 1

def test_400_fails_without_retry_and_401_stops_the_run(server, store, monkeypatch):
    chat = make_chat(server, store, monkeypatch)
    server.add_fault(Fault(status=400))
    with pytest.raises(LLMCallError) as e:
        chat.complete(msgs("bad"))
    assert not e.value.retryable and len(server.log) == 1
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    wrong = CachedChat(endpoint(server), store, "teacher", "teacher")
    with pytest.raises(EndpointRefused) as e:
        wrong.complete(msgs("who am i"))
    assert "401" in str(e.value) and KEY_ENV in str(e.value) and "sk-wrong" not in str(e.value)


def test_missing_key_names_the_variable(server, store, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    chat = CachedChat(endpoint(server), store, "teacher", "teacher")
    with pytest.raises(ConfigError, match=f"{KEY_ENV}.*teacher.api_key_env"):
        chat.complete(msgs("x"))
    assert server.n_received() == 0


def test_structured_repair_turn_sends_the_error_back(server, store, monkeypatch):
    answers = iter(["this is not json", json.dumps({"steps": [{"plan": "p", "execution": "e"}]})])
    server.script = lambda body: next(answers)
    chat = make_chat(server, store, monkeypatch)
    result = structured(chat, msgs("split this"), StepList, "reasoning_steps")
    assert result.value is not None and result.value.steps[0].plan == "p" and result.calls == 2
    first, repair = (r.body for r in server.log)
    assert first["response_format"]["type"] == "json_schema"
    assert first["response_format"]["json_schema"]["name"] == "reasoning_steps"
    assert first["response_format"]["json_schema"]["schema"]["additionalProperties"] is False
    assert repair["messages"][:2] == first["messages"]
    assert repair["messages"][2] == {"role": "assistant", "content": "this is not json"}
    assert "Invalid JSON" in repair["messages"][3]["content"]


def test_structured_gives_up_after_one_repair(server, store, monkeypatch):
    server.script = lambda body: json.dumps({"edges": [{"parent": "one", "child": 2}]})
    chat = make_chat(server, store, monkeypatch)
    result = structured(chat, msgs("deps"), EdgeList, "step_dependencies")
    assert result.value is None and "edges.0.parent" in result.error and result.calls == 2
    assert server.n_received() == 2


def test_structured_check_failure_triggers_repair(server, store, monkeypatch):
    answers = iter([json.dumps({"steps": []}), json.dumps({"steps": [{"plan": "a", "execution": ""}]})])
    server.script = lambda body: next(answers)
    chat = make_chat(server, store, monkeypatch)
    result = structured(chat, msgs("s"), StepList, "reasoning_steps",
                        check=lambda v: "" if v.steps else "steps is empty")
    assert result.value is not None and "steps is empty" in server.log[1].body["messages"][3]["content"]


def test_reasoning_field_is_kept(server, store, monkeypatch):
    server.script = lambda body: Reply("\\boxed{7}", extra_message={"reasoning_content": "3 + 4 = 7."})
    chat = make_chat(server, store, monkeypatch)
    assert chat.complete(msgs("r")).reasoning == "3 + 4 = 7."
    assert chat.complete(msgs("r")).reasoning == "3 + 4 = 7."    # also from the store


def test_openai_teacher_joins_reasoning_and_strips_think_tags(server, store, monkeypatch):
    server.script = lambda body: Reply("<think>\nTry 2 + 3 = 5.\n</think>\nSo it is \\boxed{5}.",
                                       extra_message={"reasoning_content": "Add the numbers."})
    teacher = OpenAITeacher(make_chat(server, store, monkeypatch))
    task = Task(id="q", kind="math", problem="What is 2+3?", answer="5")
    trace = teacher.generate(task)
    assert trace.text == "Add the numbers.\n\nTry 2 + 3 = 5.\n\nSo it is \\boxed{5}."
    assert trace.final_answer == "5" and trace.usage["completion_tokens"] == 12
    assert trace.teacher == "openai:fake-model"
    sent = server.log[0].body["messages"]
    assert sent[0]["role"] == "system" and sent[1] == {"role": "user", "content": "What is 2+3?"}


def test_final_answer_of_each_task_kind():
    math = Task(id="m", kind="math", problem="", answer="1/2")
    countdown = Task(id="c", kind="countdown", problem="", answer={"target": 3, "numbers": [1, 2]})
    assert final_answer_of(math, "so \\boxed{\\frac{1}{2}} and not \\boxed{3}... wait \\boxed{\\frac12}") == "\\frac12"
    assert final_answer_of(math, "no answer here") == ""
    assert final_answer_of(countdown, "try <answer>1*2</answer> ... <answer> 1 + 2 </answer>") == "1 + 2"
    assert final_answer_of(countdown, "so \\boxed{2 + 1}") == "2 + 1"


def test_concurrent_callers_share_one_store(server, store, monkeypatch):
    import concurrent.futures as cf
    chat = make_chat(server, store, monkeypatch, concurrency=4)
    server.add_fault(Fault(status=429, headers={"retry-after-ms": "20"}), times=3)
    questions = [f"q{i // 3}" for i in range(36)]        # each asked three times at once
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: chat.complete(msgs(q)).content, questions))
    assert outs == [f"echo: {q}" for q in questions]
    assert sum(server.answered.values()) == 12 and max(server.answered.values()) == 1
    assert chat.stats.calls_made == 12 and chat.stats.cache_hits == 24
    assert store.call_totals()["total"]["calls"] == 12


# ---- DAG validation (pure) ---------------------------------------------------------------------

def test_validate_edges_accepts_a_dag_and_collapses_duplicates():
    r = validate_edges(5, [(1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5), (1, 2)], "drop")
    assert r.edges == [(1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5)] and r.dropped == []


def test_validate_edges_drop_policy_classifies_each_error():
    r = validate_edges(5, [(1, 2), (4, 1), (2, 2), (0, 3), (2, 9), (2, 3), (3, 2), (1, 5)], "drop")
    assert r.edges == [(1, 2), (1, 5), (2, 3)]
    assert dict(r.dropped) == {(4, 1): "forward_edge", (2, 2): "self_loop", (0, 3): "unknown_step",
                               (2, 9): "unknown_step", (3, 2): "cycle"}


def test_validate_edges_cycle_through_three_steps():
    r = validate_edges(3, [(1, 2), (2, 3), (3, 1)], "drop")
    assert r.edges == [(1, 2), (2, 3)] and r.dropped == [((3, 1), "cycle")]


@pytest.mark.parametrize("edges,reason", [
    ([(1, 2), (2, 1)], "cycle"), ([(2, 1)], "forward_edge"), ([(2, 2)], "self_loop"),
    ([(1, 7)], "unknown_step"), ([(2, 1), (3, 3), (1, 3), (3, 1)], "cycle"),
])
def test_validate_edges_reject_policy(edges, reason):
    with pytest.raises(DagFailed) as e:
        validate_edges(3, edges, "reject")
    assert e.value.reason == reason
