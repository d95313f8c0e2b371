"""`sprint-jax serve` against a hostile client: every request a real HTTP request to a server on
127.0.0.1 (in this process, and one real `sprint-jax serve` subprocess for SIGTERM). Each test
reproduces one way a client could crash, stall or fool the server: the request gets one clear
OpenAI-shaped error and the server keeps serving. Every wait is bounded in count and time."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import openai
import pytest

from conftest import tiny_vocab_tokenizer
from sprint_jax.infer.engine import Engine
from sprint_jax.model import from_pretrained
from sprint_jax.serve import Server
from test_serve import CAPS, NAME, SPRINT_CFG, _tiny_model_dir

KEY = "sk-hostile-0123456789"
MAX_CONNECTIONS = 12
MAX_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def setup(hf_untied):
    model = from_pretrained(hf_untied)
    tok = tiny_vocab_tokenizer()
    engine = Engine(model, tok, max_seqs=4, max_children=4, **CAPS)
    server = Server(engine, NAME, SPRINT_CFG, api_key=KEY, header_timeout_s=1.0, body_timeout_s=1.0,
                    max_connections=MAX_CONNECTIONS, max_request_bytes=MAX_BYTES).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield server, client, tok
    server.stop()


def _post(server, body, path: str = "/v1/completions", key: str | None = KEY, method: str = "POST"):
    """(status, headers, parsed JSON body) of one request; `body` a dict or raw bytes."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read()
        return r.status, dict(r.getheaders()), json.loads(raw)      # every answer is JSON, errors too
    finally:
        conn.close()


def _error(server, body, status: int = 400, path: str = "/v1/completions") -> dict:
    got, _, obj = _post(server, body, path)
    assert got == status, (body if isinstance(body, dict) else body[:200], obj)
    assert obj["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error"), obj
    return obj["error"]


def _serves(server) -> None:
    """The server still answers a plain request and its engine is alive."""
    status, _, obj = _post(server, {"model": NAME, "prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert status == 200 and obj["usage"]["completion_tokens"] == 2, obj
    assert json.loads(_get(server, "/health")[1])["status"] == "ok"


def _get(server, path: str, key: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _raw_response(sock: socket.socket, within: float = 10.0) -> tuple[int, dict]:
    """Read one whole response from a raw socket (the server closes after it): (status, JSON body)."""
    sock.settimeout(within)
    data = b""
    t_end = time.monotonic() + within
    while time.monotonic() < t_end:
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), data[:200]
    return int(head.split()[1]), json.loads(body)


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), 10)


HEAD = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY + "\r\nContent-Type: application/json\r\n"


def test_sprint_false_or_zero_is_a_400_not_sprint_mode(setup):
    server, client, tok = setup
    for v in (False, 0, "", [], True):
        err = _error(server, {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0, "sprint": v})
        assert err["param"] == "sprint" and "sprint must be an object" in err["message"], (v, err)
    status, _, obj = _post(server, {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0, "sprint": None})
    assert status == 200 and "sprint" not in obj and obj["usage"]["completion_tokens"] == 2


NON_FINITE = [
    (b'{"model":"tiny","prompt":"hi","max_tokens":2,"temperature":NaN}', "temperature", "NaN"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":2,"top_p":NaN}', "top_p", "NaN"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":2,"temperature":Infinity}', "temperature", "Infinity"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":2,"top_p":-Infinity}', "top_p", "-Infinity"),
    (b'{"model":"tiny","prompt":"hi","max_tokens":2,"temperature":1e999}', "temperature", "1e999"),
    (b'{"model":"tiny","prompt":"hi","sprint":{"time_limit_s":NaN}}', "sprint.time_limit_s", "NaN"),
    (b'{"model":"tiny","prompt":"hi","user":"u","stop":["a",-1e400]}', "stop[1]", "-1e400"),
]


def test_non_finite_numbers_anywhere_in_the_body_are_a_400_naming_where(setup):
    server, client, tok = setup
    for body, param, text in NON_FINITE:
        err = _error(server, body)
        assert err["param"] == param and f"must be a finite number, got {text}" in err["message"], (body, err)
    _serves(server)


SAMPLING = [   # (request, the field the 400 names)
    ({"model": NAME, "prompt": "hi", "max_tokens": 2, "top_k": 2 ** 31}, "top_k"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 2, "top_k": 10 ** 20}, "top_k"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 2, "top_k": 1e20}, "top_k"),
    ({"model": NAME + ":sprint", "prompt": "hi", "top_k": 2 ** 31}, "top_k"),
    ({"model": NAME + ":sprint", "prompt": "hi", "top_k": 1e20}, "top_k"),
    ({"model": NAME, "prompt": "hi", "sprint": {"top_k": 2 ** 40}}, "sprint.top_k"),
    ({"model": NAME, "prompt": "hi", "sprint": {"temperature": -1}}, "sprint.temperature"),
    ({"model": NAME + ":sprint", "prompt": "hi", "seed": "x"}, "seed"),
    ({"model": NAME + ":sprint", "prompt": "hi", "seed": 2 ** 64}, "seed"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 2, "seed": 1.5}, "seed"),
    ({"model": NAME + ":sprint", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": NAME + ":sprint", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": NAME + ":sprint", "prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 2, "n": 1.5}, "n"),
    ({"model": NAME, "prompt": "hi", "max_tokens": True}, "max_tokens"),
]


def test_sampling_fields_are_validated_before_the_engine_sees_them(setup):
    """A top_k of 2^31 or more overflowed deep in the engine and stopped its task for everyone."""
    server, client, tok = setup
    for body, param in SAMPLING:
        err = _error(server, body)
        assert err["param"] == param and err["message"].startswith(param + " must be"), (body, err)
    _serves(server)


def test_a_body_over_the_limit_gets_413_before_it_is_read(setup):
    server, client, tok = setup
    # Content-Length says 20 MB: answered at once, nothing of the body sent
    with _connect(server) as s:
        s.sendall((HEAD + "Content-Length: 20000000\r\n\r\n").encode())
        status, obj = _raw_response(s)
    assert status == 413 and obj["error"]["code"] == "request_too_large" and str(MAX_BYTES) in obj["error"]["message"]
    # chunked (no length up front): 413 once the bytes read pass the limit, the rest never read
    with _connect(server) as s:
        s.sendall((HEAD + "Transfer-Encoding: chunked\r\n\r\n").encode())
        piece = b'{"model":"tiny","prompt":"' + b"a" * (MAX_BYTES // 4)
        sent = 0
        while sent <= MAX_BYTES:
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        status, obj = _raw_response(s)
    assert status == 413 and obj["error"]["code"] == "request_too_large"
    _serves(server)


def test_a_prompt_provably_too_long_is_rejected_by_its_length_before_it_is_tokenized(setup):
    """The tiny vocabulary's longest entry is 6 characters: a prompt of more than 6 x 1023
    characters cannot fit in 1024 tokens. Its characters are ones the tokenizer cannot encode, so
    the answer shows which check ran first."""
    server, client, tok = setup
    longest = max(len(t) for t in tok.vocab)
    assert longest == 6
    err = _error(server, {"model": NAME, "prompt": "\u00e9" * (6 * 1023 + 1)})
    assert err["code"] == "context_length_exceeded" and "at least 1024 tokens" in err["message"], err
    err = _error(server, {"model": NAME, "prompt": "\u00e9" * (6 * 524 + 1), "max_tokens": 500})
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
    err = _error(server, {"model": NAME, "prompt": "\u00e9" * (6 * 524), "max_tokens": 500})   # may fit: tokenized
    assert "the tokenizer cannot encode it" in err["message"], err
    err = _error(server, {"model": NAME, "prompt": "hi", "max_tokens": 1024})        # no prompt fits beside it
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err


def test_a_long_prompt_is_tokenized_off_the_event_loop(setup):
    """While a long prompt is being tokenized (held here until /health has answered), the server
    answers other requests. The prompt (5000 one-character tokens: within the character bound, so
    it is tokenized) then gets its exact token count in the context-length error."""
    server, client, tok = setup
    engine = server.worker.engine
    prompt = "a" * 5000
    entered, release = threading.Event(), threading.Event()
    encode = engine.encode

    def held(text):
        if text == prompt:
            entered.set()
            release.wait(60)
        return encode(text)

    engine.encode = held
    result = {}
    try:
        t = threading.Thread(target=lambda: result.update(r=_post(server, {"model": NAME, "prompt": prompt})))
        t.start()
        assert entered.wait(60)
        # on the event loop, this /health would wait for the release (and time out)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        release.set()
        engine.encode = encode
    t.join(120)
    status, _, obj = result["r"]
    assert len(tok.encode(prompt)) == 5000
    assert status == 400 and obj["error"]["code"] == "context_length_exceeded", obj
    assert "(5000 in the prompt" in obj["error"]["message"], obj


def test_slow_clients_get_408_and_connections_are_bounded(setup):
    server, client, tok = setup
    idle, slow_head, slow_body = _connect(server), _connect(server), _connect(server)
    try:
        slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")        # the head never ends
        slow_body.sendall((HEAD + "Content-Length: 100\r\n\r\n" + '{"model":').encode())   # nor the body
        for s, where in ((slow_head, "head"), (slow_body, "body")):
            status, obj = _raw_response(s)
            assert status == 408 and obj["error"]["code"] == "request_timeout", obj
            assert f"request {where} did not arrive within 1 s" in obj["error"]["message"], obj
        idle.settimeout(10)                  # nothing asked, nothing answered: closed as an idle connection
        assert idle.recv(100) == b""
    finally:
        for s in (idle, slow_head, slow_body):
            s.close()
    # a head that never ends but keeps coming: cut at 64 KiB
    with _connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 70_000)
        status, obj = _raw_response(s)
        assert status == 431 and obj["error"]["code"] == "request_header_fields_too_large", obj
    # one connection more than the limit: that one gets 503 at once (the others are idle, open)
    socks = [_connect(server) for _ in range(MAX_CONNECTIONS + 1)]
    try:
        status, obj = _raw_response(socks[-1], within=5)
        assert status == 503 and obj["error"]["code"] == "too_many_connections", obj
    finally:
        for s in socks:
            s.close()
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end:          # the server sees the closes
        try:
            _serves(server)
            break
        except (AssertionError, OSError, http.client.HTTPException):
            time.sleep(0.1)
    _serves(server)


def test_a_non_streaming_client_that_leaves_cancels_its_job(setup):
    server, client, tok = setup
    before = json.loads(_get(server, "/health")[1])["cancelled"]
    body = json.dumps({"model": NAME, "prompt": "Go on:", "max_tokens": 1000, "temperature": 0}).encode()
    with _connect(server) as s:
        s.sendall((HEAD + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        t_end = time.monotonic() + 60
        while json.loads(_get(server, "/health")[1])["running_jobs"] < 1 and time.monotonic() < t_end:
            time.sleep(0.01)
        assert json.loads(_get(server, "/health")[1])["running_jobs"] == 1
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        m = json.loads(_get(server, "/health")[1])
        if m["running_jobs"] == 0:
            break
        time.sleep(0.02)
    assert m["running_jobs"] == 0 and m["slots_used"] == 0 and m["cancelled"] == before + 1, m


BROKEN = [   # (raw body, what the 400 names)
    (b'{"model":"\\ud800","prompt":"hi"}', "model"),
    (b'{"model":"tiny","prompt":"hi \\udfff"}', "prompt"),
    (b'{"model":"tiny","prompt":"hi","sprint":{"\\udc00x":1}}', "sprint.\\udc00x"),
    (b'{"model":"tiny","prompt":"hi","user":' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"model":"tiny","prompt":"hi","user":' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}", "user" + ".a" * 31),
    (b'{"model":"tiny","prompt":"hi","max_tokens":' + b"9" * 5000 + b"}", None),
]


def test_lone_surrogates_and_deep_nesting_get_a_json_400(setup):
    server, client, tok = setup
    for body, param in BROKEN:
        err = _error(server, body)
        assert err["param"] == param, (body[:80], err)
        assert "surrogate" in err["message"] or "deeper than" in err["message"] or "not valid JSON" in err["message"]
    _serves(server)


def test_unimplemented_openai_fields_are_rejected_unless_off(setup):
    server, client, tok = setup
    plain = {"model": NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    for extra, param in [({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 99}, "frequency_penalty"),
                         ({"echo": True}, "echo"),
                         ({"best_of": 2}, "best_of"), ({"best_of": True}, "best_of"), ({"logit_bias": {"5": 1}}, "logit_bias"),
                         ({"max_completion_tokens": 5}, "max_completion_tokens"), ({"metadata": {}}, "metadata"),
                         ({"bogus": 1}, "bogus")]:
        err = _error(server, {**plain, **extra})
        assert err["param"] == param, (extra, err)
        assert "not supported" in err["message"] or err["message"] == f"Unrecognized request argument supplied: {param}"
    for extra, param in [({"top_logprobs": 0}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                         ({"store": True}, "store"), ({"tools": [{"type": "function"}]}, "tools"),
                         ({"max_completion_tokens": -3}, "max_completion_tokens"),
                         ({"max_completion_tokens": 3}, "max_completion_tokens"),       # disagrees with max_tokens 2
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"user": 5}, "user"), ({"stream_options": {"include_usage": False}}, "stream_options")]:
        err = _error(server, {**chat, **extra}, path="/v1/chat/completions")
        assert err["param"] == param, (extra, err)
    # accepted: the off values, and fields that do not change the output
    for extra in ({"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": None, "echo": False, "best_of": 1,
                   "user": "u", "logit_bias": {}, "suffix": None},):
        status, _, obj = _post(server, {**plain, **extra})
        assert status == 200 and obj["usage"]["completion_tokens"] == 2, obj
    for extra in ({"logprobs": False, "top_logprobs": None, "store": False, "metadata": {"k": "v"},
                   "parallel_tool_calls": True, "tools": [], "user": "u"},):
        status, _, obj = _post(server, {**chat, **extra}, "/v1/chat/completions")
        assert status == 200 and obj["usage"]["completion_tokens"] == 2, obj
    # max_completion_tokens is implemented (chat), alone or beside an equal max_tokens
    ref = client.chat.completions.create(model=NAME, messages=chat["messages"], max_tokens=3, temperature=0)
    for kw in ({"max_completion_tokens": 3}, {"max_completion_tokens": 3, "max_tokens": 3}):
        got = client.chat.completions.create(model=NAME, messages=chat["messages"], temperature=0, **kw)
        assert got.usage.completion_tokens == 3 and got.choices[0].message.content == ref.choices[0].message.content
    # stream_options.include_usage: false sends no usage chunk, true (and unset) one
    for opts, want in (({"include_usage": False}, 0), ({"include_usage": True}, 1), (None, 1)):
        kw = {"stream_options": opts} if opts is not None else {}
        chunks = list(client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0, stream=True, **kw))
        assert sum(c.usage is not None for c in chunks) == want, opts
    # a method a route does not take: a client error
    status, _, obj = _post(server, None, "/v1/completions", method="GET")
    assert status == 405 and obj["error"]["type"] == "invalid_request_error", obj


def test_an_api_key_guards_every_route_but_health(setup, tmp_path, capsys):
    server, client, tok = setup
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/nope")):
        for key in (None, "wrong", KEY + "x", KEY[:-1]):
            status, headers, obj = _post(server, {"model": NAME, "prompt": "hi"} if method == "POST" else None, path,
                                         key=key, method=method)
            assert status == 401 and obj["error"]["code"] == "invalid_api_key", (path, key, obj)
            assert KEY not in json.dumps(obj) and headers.get("www-authenticate") == "Bearer"
    assert _get(server, "/health")[0] == 200
    assert _get(server, "/metrics", key=KEY)[0] == 200
    assert {m.id for m in client.models.list().data} == {NAME, NAME + ":sprint"}       # the openai client, keyed
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert e.value.status_code == 401
    # the command line: listening beyond this machine without a key warns; a bad key is one line
    from sprint_jax.cli import main

    broken = tmp_path / "broken"              # a model directory whose loading fails (after the warning)
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    model = [str(broken), "--port", "0"]
    assert main(["serve", "--model", *model, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "warning: listening on 0.0.0.0 without an API key" in err and "config.json" in err
    assert main(["serve", "--model", *model, "--host", "0.0.0.0", "--api-key", KEY]) == 2
    err = capsys.readouterr().err
    assert "warning" not in err and KEY not in err
    assert main(["serve", "--model", *model]) == 2
    assert "warning" not in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "missing"), "--api-key", " "]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key is empty" in err


def _plain(port: int, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def _streamed(port: int, body: dict, key: str | None = KEY) -> list:
    """The stream's events, parsed ([DONE] as the string)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    r = conn.getresponse()
    assert r.status == 200
    events = [e[6:] for e in r.read().decode().split("\n\n") if e.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def _slow_upload(port: int, key: str | None = KEY) -> tuple[int, dict]:
    """A request whose body never ends (the server must answer it itself)."""
    with socket.create_connection(("127.0.0.1", port), 10) as s:
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n\r\n{{".encode())
        return _raw_response(s, within=60)


def _refused(port: int, within: float = 10.0) -> bool:
    t_end = time.monotonic() + within
    while time.monotonic() < t_end:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            time.sleep(0.02)
        except OSError:
            return True
    return False


def _ended(r) -> bool:
    """Whether a response is the drain's clean end (a JSON 503; a stream's error event, then [DONE])."""
    if isinstance(r, tuple):
        return r[0] == 503 and r[1]["error"]["code"] == "server_shutting_down"
    return r[-1] == "[DONE]" and r[-2].get("error", {}).get("code") == "server_shutting_down"


def test_shutdown_ends_what_is_still_in_flight_at_the_grace_end_cleanly(setup, hf_untied):
    """A server of its own whose engine never gets the jobs (its worker holds them): at the grace's
    end a non-streaming request gets a JSON 503, a stream an error event then [DONE] (plain and
    SPRINT alike), a body still being uploaded a JSON 503; the server stops listening at once and
    stop() returns."""
    from concurrent.futures import ThreadPoolExecutor

    _, _, tok = setup
    engine = Engine(from_pretrained(hf_untied), tok, max_seqs=4, max_children=4, **CAPS)
    server = Server(engine, NAME, SPRINT_CFG, shutdown_grace_s=1.0).start()
    try:
        held = []
        server.worker.try_submit = lambda job: held.append(job) or True       # in flight, never served
        port = server.port
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(_plain, port, {"model": NAME, "prompt": "hi", "max_tokens": 2}, None),
                       pool.submit(_streamed, port, {"model": NAME, "prompt": "hi", "max_tokens": 2}, None),
                       pool.submit(_plain, port, {"model": NAME + ":sprint", "prompt": "hi"}, None),
                       pool.submit(_streamed, port, {"model": NAME + ":sprint", "prompt": "hi"}, None),
                       pool.submit(_slow_upload, port, None)]
            t_end = time.monotonic() + 60
            while (len(held) < 4 or not server.state.reading) and time.monotonic() < t_end:
                time.sleep(0.01)
            assert len(held) == 4 and len(server.state.reading) == 1
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            assert _refused(port)
            results = [f.result(timeout=60) for f in futures]
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        server.stop()
    assert all(_ended(r) for r in results), results


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(hf_untied, tmp_path):
    """A real `sprint-jax serve` (its key from the environment), one slot, requests in flight when
    SIGTERM arrives: a stream decoding, a short request and long ones queued behind it, a body still
    being uploaded. It stops listening at once; the stream and the short request finish within the
    grace; the upload, still incomplete at the grace's end, gets a JSON 503; every other request
    ends whole or cleanly ended; the process exits 0 and its output holds neither a traceback nor
    the key."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    model = _tiny_model_dir(hf_untied, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "sprint_jax.cli", "serve", "--model", model, "--port", "0",
                             "--max-seq-len", "256", "--max-seqs", "1", "--max-prompts", "2", "--max-branch-tokens",
                             "16", "--shutdown-grace", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "SPRINT_JAX_API_KEY": KEY})
    seen = []
    try:
        url = None
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url is not None, "".join(seen)
        port = int(url.rsplit(":", 1)[1])
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        long = dict(model="tinymodel", prompt="Go on:", max_tokens=250, temperature=0)
        assert c.completions.create(**long).usage.completion_tokens == 250         # compiles its shapes
        # greedy: a sampled reply (random seed) may end at EOS before 3 tokens on this untrained model
        assert c.completions.create(model="tinymodel", prompt="x", max_tokens=3,
                                    temperature=0).usage.completion_tokens == 3

        def running() -> int:
            return json.loads(urllib_get(url + "/health"))["running_jobs"]

        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(_streamed, port, long)
            t_end = time.monotonic() + 60
            while running() < 1 and time.monotonic() < t_end:
                time.sleep(0.01)
            short = pool.submit(_plain, port, {"model": "tinymodel", "prompt": "x", "max_tokens": 3, "temperature": 0})
            queued = [pool.submit(_plain, port, long), pool.submit(_streamed, port, long),
                      pool.submit(_plain, port, {"model": "tinymodel:sprint", "prompt": "abc"}),
                      pool.submit(_streamed, port, {"model": "tinymodel:sprint", "prompt": "abc"})]
            upload = pool.submit(_slow_upload, port)
            while running() < 6 and time.monotonic() < t_end:
                time.sleep(0.01)
            assert running() == 6
            time.sleep(0.2)                      # the upload's head is in
            proc.send_signal(signal.SIGTERM)
            assert _refused(port)
            results = [f.result(timeout=120) for f in [first, short, upload] + queued]
        rest, _ = proc.communicate(timeout=60)
        seen.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    log = "".join(seen)
    assert proc.returncode == 0, log[-3000:]
    assert KEY not in log
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    stream, short, upload = results[:3]
    assert stream[-1] == "[DONE]" and stream[-2]["usage"]["completion_tokens"] == 250, stream[-3:]
    assert short[0] == 200 and short[1]["usage"]["completion_tokens"] == 3, short
    assert _ended(upload), upload
    for r in results[3:]:
        whole = r[0] == 200 if isinstance(r, tuple) else r[-1] == "[DONE]" and "usage" in r[-2]
        assert whole or _ended(r), r


def urllib_get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()
