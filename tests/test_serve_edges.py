"""`sprint-jax serve` at the edges a new user, an evaluation harness and a hostile client reach:
what a SPRINT reply's finish_reason says about a cut run, stop strings in SPRINT mode (the body
lm-evaluation-harness sends), the seeds that give streams of their own, n > 1 without max_tokens,
integers too long to print, a client that half-closes its socket, an address the server cannot
listen on, the default model id, and a shutdown while the engine is inside a long step (a
compile). Real HTTP on 127.0.0.1 with the openai client or raw sockets, on the tiny checkpoint."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import tiny_vocab_tokenizer
from sprint_jax.infer import Engine, Sampling, SingleRun
from sprint_jax.infer.orchestrator import OrchestratorConfig, RunRecord
from sprint_jax.model import from_pretrained
from sprint_jax.serve import Server
from test_serve import CAPS, NAME, SPRINT_CFG
from test_serve_hostile import _ended, _refused

INT32_TOP = 2 ** 31 - 1


@pytest.fixture(scope="module")
def setup(hf_untied):
    model = from_pretrained(hf_untied)
    tok = tiny_vocab_tokenizer()
    engine = Engine(model, tok, max_seqs=4, max_children=4, **CAPS)
    server = Server(engine, NAME, SPRINT_CFG).start()
    alone = SingleRun(Engine(model, tok, max_seqs=4, max_children=4, **CAPS))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield server, client, alone, tok, model
    server.stop()


def _post(port: int, body, path: str = "/v1/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _stream_events(port: int, body: dict) -> list:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        events = [e[6:] for e in r.read().decode().split("\n\n") if e.startswith("data: ")]
        return [e if e == "[DONE]" else json.loads(e) for e in events]
    finally:
        conn.close()


# ---- finish_reason of a SPRINT run cut short; its budgets' types -----------------------------
def test_a_sprint_run_cut_by_the_wall_clock_finishes_with_length(setup):
    server, client, *_ = setup
    r = client.completions.create(model=NAME + ":sprint", prompt="abc", temperature=0,
                                  extra_body={"sprint": {"time_limit_s": 1e-9}})
    assert r.model_extra["sprint"]["termination"] == "wall_clock"
    assert r.choices[0].finish_reason == "length"
    events = _stream_events(server.port, {"model": NAME + ":sprint", "prompt": "abc", "temperature": 0,
                                          "sprint": {"time_limit_s": 1e-9}})
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
                if c["finish_reason"]]
    assert finishes == ["length"] and events[-1] == "[DONE]"


@pytest.mark.parametrize("termination, finish", [
    ("final_answer", "stop"), ("eos", "stop"), ("stop_string", "stop"), ("wall_clock", "length"),
    ("max_stages", "length"), ("token_budget", "length"), ("planner_token_limit", "length"),
    ("context_full", "length"), ("malformed", "length"), ("engine_error", "length")])
def test_every_sprint_termination_maps_to_the_finish_reason_it_means(termination, finish):
    from sprint_jax.serve.app import _sprint_reply

    assert _sprint_reply(RunRecord(query="q", mode="parallel", config={}, termination=termination, text="a b"), []) \
        == ("a b", finish)
    # a stop string of the request cuts the text wherever the run ended
    assert _sprint_reply(RunRecord(query="q", mode="parallel", config={}, termination=termination, text="a b"), [" b"]) \
        == ("a", "stop")


@pytest.mark.parametrize("value, message", [
    (True, "sprint.time_limit_s must be a number of seconds > 0 (or null), got True"),
    ("x", "sprint.time_limit_s must be a number of seconds > 0 (or null), got 'x'"),
    (0, "sprint.time_limit_s must be a number of seconds > 0"),
    (-1.5, "sprint.time_limit_s must be a number of seconds > 0")])
def test_a_sprint_time_limit_that_is_not_a_positive_number_is_a_clear_400(setup, value, message):
    server, *_ = setup
    status, obj = _post(server.port, {"model": NAME + ":sprint", "prompt": "abc",
                                      "sprint": {"time_limit_s": value}})
    assert status == 400 and message in obj["error"]["message"], obj


# ---- stop strings in SPRINT mode -------------------------------------------------------------
def test_sprint_mode_applies_the_stop_strings_an_evaluation_harness_sends(setup):
    """lm-evaluation-harness's local-completions body (prompt, max_tokens, temperature 0, its
    `until` strings as stop, seed): the reply is the run's text cut at the first stop string, as a
    plain reply is, with finish_reason stop; streamed the same."""
    server, client, *_ = setup
    base = {"model": NAME + ":sprint", "prompt": "Question: abc\nAnswer:", "max_tokens": 14, "temperature": 0,
            "seed": 1234}
    status, whole = _post(server.port, base)
    assert status == 200, whole
    full = whole["choices"][0]["text"]
    assert len(full) >= 4, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expect = full[:full.find(stop)]
    body = {**base, "stop": ["\n\nQuestion:", stop]}
    status, got = _post(server.port, body)
    assert status == 200, got
    assert got["choices"][0]["text"] == expect and got["choices"][0]["finish_reason"] == "stop"
    events = _stream_events(server.port, body)
    text = "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices", []))
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
                if c["finish_reason"]]
    assert text == expect and finishes == ["stop"] and events[-1] == "[DONE]"


# ---- seeds -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2 ** 31, 42 + 2 ** 31, 2 ** 63 - 1])
def test_a_seed_that_would_share_another_seeds_samples_is_a_400(setup, seed):
    server, *_ = setup
    for model in (NAME, NAME + ":sprint"):
        status, obj = _post(server.port, {"model": model, "prompt": "Roll: ", "max_tokens": 4, "temperature": 1.0,
                                          "seed": seed})
        assert status == 400 and obj["error"]["message"] == f"seed must be between 0 and {INT32_TOP}, got {seed}"


def test_the_largest_accepted_seed_samples_its_own_stream(setup):
    server, client, alone, tok, _ = setup
    kw = dict(model=NAME, prompt="Roll: ", max_tokens=16, temperature=1.0)
    top = client.completions.create(seed=INT32_TOP, **kw).choices[0].text
    assert top == alone.generate(alone.prefill(tok.encode("Roll: ")), 16,
                                 sampling=Sampling(temperature=1.0, seed=INT32_TOP)).text
    assert top != client.completions.create(seed=0, **kw).choices[0].text


def test_sprint_configs_refuse_the_seeds_their_derivation_would_fold_together(tmp_path, capsys):
    from sprint_jax.cli import main
    from sprint_jax.errors import UserError

    for seed in (-1, 2 ** 31, 42 + 2 ** 31):
        with pytest.raises(UserError, match="seed must be"):
            OrchestratorConfig(seed=seed, temperature=1.0)
    # in range, distinct seeds give every call a distinct seed
    assert OrchestratorConfig(seed=INT32_TOP, temperature=1.0).sampling(3).seed \
        != OrchestratorConfig(seed=0, temperature=1.0).sampling(3).seed
    code = main(["infer", "a query", "--model", str(tmp_path / "none"), "--seed", "-1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "seed must be >= 0, got -1" in err, err


# ---- n > 1 without max_tokens; integers too long to print --------------------------------------
def test_n_above_1_without_max_tokens_gets_each_choices_capacity(setup):
    server, client, *_ = setup
    r = client.completions.create(model=NAME, prompt="Count: ", n=2, temperature=0)
    capacity = CAPS["max_branch_tokens"] - 1            # 47 < the server's default of 256
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert r.usage.completion_tokens == 2 * capacity


@pytest.mark.parametrize("field, path", [("max_tokens", "/v1/completions"),
                                         ("max_completion_tokens", "/v1/chat/completions")])
def test_a_4300_digit_max_tokens_is_a_400(setup, field, path):
    server, *_ = setup
    big = b"9" * 4300                                   # Python parses it, cannot print a 4301-digit sum
    ask = b'"prompt":"hi"' if field == "max_tokens" else b'"messages":[{"role":"user","content":"hi"}]'
    body = b'{"model":"tiny",' + ask + b',"' + field.encode() + b'":' + big + b"}"
    status, obj = _post(server.port, body, path)
    assert status == 400 and obj["error"]["message"].startswith(f"{field} must be <= {2 ** 63 - 1}, got 999"), obj
    status, obj = _post(server.port, b'{"model":"tiny:sprint","prompt":"hi","sprint":{"max_stages":' + big + b"}}")
    assert status == 400 and obj["error"]["message"].startswith("sprint.max_stages must be <="), obj


# ---- a client that half-closes ------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_followed_by_a_half_close_is_answered(setup, stream):
    server, client, alone, tok, _ = setup
    body = {"model": NAME, "prompt": "Go on:", "max_tokens": 24, "temperature": 0, "stream": stream}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        conn.sock.shutdown(socket.SHUT_WR)              # done sending; still reading
        r = conn.getresponse()                          # (http.client reads past a 100 Continue)
        raw = r.read().decode()
    finally:
        conn.close()
    assert r.status == 200, raw
    if stream:
        text = "".join(c["text"] for e in raw.split("\n\n") if e.startswith("data: {")
                       for c in json.loads(e[6:])["choices"])
        assert raw.rstrip().endswith("data: [DONE]")
    else:
        text = json.loads(raw)["choices"][0]["text"]
    assert text == alone.generate(alone.prefill(tok.encode("Go on:")), 24).text


# ---- the command line: the address first, the model's name -------------------------------------
def test_an_address_the_server_cannot_listen_on_is_one_line_and_exit_2_before_the_model_loads(tmp_path, capsys):
    from sprint_jax.cli import main

    model = tmp_path / "m"                             # a model directory that would fail to load: the
    model.mkdir()                                      # address is checked before it is read
    (model / "config.json").write_text("{}")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--model", str(model), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err and "config" not in err, err
    assert main(["serve", "--model", str(model), "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host no-such-host.invalid: not an address" in err, err


def test_the_default_model_id_is_the_models_name_not_its_export_directorys(tmp_path):
    from sprint_jax.serve.cli import model_name

    for path, name in (("runs/demo/train/sprint/hf", "sprint"), ("runs/demo/train/rft/hf", "rft"),
                       ("r/train_sprint/out/hf", "train_sprint"), ("models/Qwen2.5-0.5B", "Qwen2.5-0.5B")):
        (tmp_path / path).mkdir(parents=True)
        assert model_name(str(tmp_path / path)) == name
        assert model_name(str(tmp_path / path) + "/") == name


# ---- a shutdown while the engine is inside a long step -------------------------------------------
def test_a_shutdown_during_a_long_engine_step_holds_its_grace(setup):
    """The engine's step held (as a first compile of a shape holds it, for seconds to minutes):
    the loop still answers /health; a shutdown ends every request in flight at the grace's end
    (a JSON 503; a stream, plain or SPRINT, an error event then [DONE]) and stop() returns, all
    while the step is still held."""
    _, _, _, tok, model = setup
    engine = Engine(model, tok, max_seqs=4, max_children=4, **CAPS)
    server = Server(engine, NAME, SPRINT_CFG, shutdown_grace_s=0.5).start()
    step, entered, release = engine.step, threading.Event(), threading.Event()

    def held_step():
        entered.set()
        release.wait(120)
        return step()
    engine.step = held_step
    try:
        port = server.port
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_post, port, {"model": NAME, "prompt": "hi", "max_tokens": 4}),
                       pool.submit(_stream_events, port, {"model": NAME, "prompt": "hi", "max_tokens": 4}),
                       pool.submit(_post, port, {"model": NAME + ":sprint", "prompt": "hi"}),
                       pool.submit(_stream_events, port, {"model": NAME + ":sprint", "prompt": "hi"})]
            assert entered.wait(60)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)   # the loop is not held
            conn.request("GET", "/health")
            assert json.loads(conn.getresponse().read())["status"] == "ok"
            conn.close()
            t_end = time.monotonic() + 30
            while len(server.state.inflight) < 4 and time.monotonic() < t_end:
                time.sleep(0.02)
            assert len(server.state.inflight) == 4
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            assert _refused(port)
            results = [f.result(timeout=30) for f in futures]
            stopper.join(30)
            assert not stopper.is_alive() and not release.is_set() and server.worker.busy
    finally:
        release.set()
        server.stop()
    assert all(_ended(r) for r in results), results


@pytest.mark.slow
def test_sigterm_while_the_first_requests_compile_drains_and_exits_0(hf_untied, tmp_path):
    """A real `sprint-jax serve`, SIGTERM while its first requests (a plain one and a SPRINT stream)
    still compile their programs: /health answers meanwhile, every request ends whole or cleanly
    ended (never a reset or a stream without [DONE]), and the process exits 0 without a traceback."""
    import signal

    from test_serve import SUBPROCESS_FLAGS, _Subprocess, _tiny_model_dir

    server = _Subprocess(_tiny_model_dir(hf_untied, tmp_path), *SUBPROCESS_FLAGS, "--shutdown-grace", "0.5")
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(_post, port, {"model": "tinymodel", "prompt": "abc", "max_tokens": 40,
                                                 "temperature": 0}),
                       pool.submit(_stream_events, port, {"model": "tinymodel:sprint", "prompt": "abc"})]
            time.sleep(0.5)                     # the first step's programs compile (seconds on this CPU)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)       # the loop answers meanwhile
            conn.request("GET", "/health")
            assert json.loads(conn.getresponse().read())["status"] == "ok"
            conn.close()
            server.proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=120) for f in futures]
        log = "".join(server.seen) + server.proc.communicate(timeout=60)[0]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.communicate(timeout=30)
    assert server.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    plain, stream = results
    assert plain[0] == 200 or _ended(plain), plain
    assert stream[-1] == "[DONE]" and ("sprint" in stream[-2] or "usage" in stream[-2] or _ended(stream)), stream[-3:]
