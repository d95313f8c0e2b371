"""`sprint-jax serve`: the real `openai` client against the server on 127.0.0.1, on the
tiny real checkpoint. References: each request decoded alone on a one-sequence engine (`SingleRun`, itself
tested against full forwards), `Orchestrator.run` (run_many at concurrency 1: what `sprint-jax infer` runs),
the batched engine's counters (one prefill for n children), and the server's own metrics."""
from __future__ import annotations

import json
import sys
import threading
import time

import urllib.error
import urllib.request
import numpy as np
import openai
import pytest

from conftest import tiny_vocab_tokenizer, xla_flags
from sprint_jax.infer import Engine, Sampling, SingleRun
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig
from sprint_jax.model import from_pretrained
from sprint_jax.serve import Server

CAPS = dict(max_seq_len=1024, max_branch_tokens=48, decode_chunk=4, prefill_chunk=32, eos_token_ids=[])
NAME = "tiny"
SPRINT_CFG = OrchestratorConfig(max_planner_tokens=10, max_branch_tokens=16, max_total_tokens=14, max_prompts=4)
TIMINGS = ("wall_s", "planner_s", "executors_s", "sync_s", "final_s", "branch_cache_bytes")


@pytest.fixture(scope="module")
def setup(hf_untied):
    model = from_pretrained(hf_untied)
    tok = tiny_vocab_tokenizer()
    engine = Engine(model, tok, max_seqs=4, max_children=4, **CAPS)
    server = Server(engine, NAME, SPRINT_CFG).start()
    alone = SingleRun(Engine(model, tok, max_seqs=4, max_children=4, **CAPS))   # room beside the held sequence
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield server, client, alone, tok
    server.stop()


def _http(server, path: str, data: bytes | None = None) -> tuple[int, bytes]:
    """A raw request (what the openai client cannot send)."""
    req = urllib.request.Request(server.url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _metrics(server) -> dict:
    return json.loads(_http(server, "/health")[1])


def _idle(server, within: float = 5.0) -> dict:
    """Wait until the engine holds nothing; the final /health."""
    t_end = time.monotonic() + within
    while True:
        m = _metrics(server)
        if m["slots_used"] == 0 and m["active_rows"] == 0 and m["running_jobs"] == 0 or time.monotonic() > t_end:
            return m
        time.sleep(0.05)


def _alone_text(alone, tok, prompt: str, n_tokens: int, sampling=None) -> str:
    return alone.generate(alone.prefill(tok.encode(prompt)), n_tokens, sampling=sampling).text


def test_completions_and_chat_equal_the_request_decoded_alone(setup):
    server, client, alone, tok = setup
    models = {m.id for m in client.models.list().data}
    assert models == {NAME, NAME + ":sprint"}
    prompt = "What is 17 * 23?"
    ref = _alone_text(alone, tok, prompt, 12)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(prompt)), 12)
    # a lone user message is the prompt as is (the documented default: this tokenizer has no template)
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=12,
                                       temperature=0)
    assert c.choices[0].message.content == ref and c.choices[0].message.role == "assistant"
    assert c.usage.total_tokens == len(tok.encode(prompt)) + 12
    # token-id prompts are accepted too
    r2 = client.completions.create(model=NAME, prompt=tok.encode(prompt), max_tokens=12, temperature=0)
    assert r2.choices[0].text == ref


def test_n4_children_share_one_prefill_and_equal_the_branches_decoded_alone(setup):
    server, client, alone, tok = setup
    prompt = "Name four primes: "
    _idle(server)
    before = _metrics(server)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, n=4, temperature=1.0, seed=5)
    after = _metrics(server)
    # one prompt shorter than prefill_chunk: exactly one prefill call for all four children
    assert after["prefill_calls"] - before["prefill_calls"] == 1
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    ref = alone.decode_branches(alone.prefill(tok.encode(prompt)), [[]] * 4, 10,
                                sampling=Sampling(temperature=1.0, seed=5))
    assert [c.text for c in r.choices] == [g.text for g in ref]
    assert len({c.text for c in r.choices}) > 1           # four samples, not one copied
    assert r.usage.completion_tokens == 40


def test_streaming_equals_the_whole_response_and_ends_with_usage(setup):
    server, client, alone, tok = setup
    prompt = "Count: 1, 2, 3"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, n=2, temperature=0.7, seed=3)
    parts, usage, finish = {0: "", 1: ""}, None, {}
    for chunk in client.completions.create(model=NAME, prompt=prompt, max_tokens=20, n=2, temperature=0.7, seed=3,
                                           stream=True):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [parts[0], parts[1]] == [c.text for c in whole.choices]
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 40
    text, chunks = "", 0
    for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=20, temperature=0, stream=True):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            chunks += 1
    assert text == _alone_text(alone, tok, prompt, 20) and chunks > 2


def test_stop_strings_cut_the_text_in_whole_and_streamed_responses(setup):
    server, client, alone, tok = setup
    prompt = "Say something: "
    free = _alone_text(alone, tok, prompt, 24)
    stop = free[9:11]
    expect = free[: free.find(stop)]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\u00a7never"])
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.text for chunk in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True) for ch in chunk.choices)
    assert streamed == expect


def test_seed_reproduces_samples(setup):
    server, client, alone, tok = setup
    kw = dict(model=NAME, prompt="Roll: ", max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b != c
    assert a == _alone_text(alone, tok, "Roll: ", 16, Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=7))


def _untimed(d):
    if isinstance(d, dict):
        return {k: _untimed(v) for k, v in d.items() if k not in TIMINGS}
    if isinstance(d, list):
        return [_untimed(v) for v in d]
    return d


def test_sprint_mode_gives_the_record_of_the_single_run_driver(setup):
    server, client, alone, tok = setup
    query = "abc xyz hg"
    for mode in ("parallel", "sequential"):
        ref = Orchestrator(alone.engine, SPRINT_CFG).run(query, mode).to_json()
        ref.pop("query")
        if mode == "parallel":      # by the model id
            r = client.chat.completions.create(model=NAME + ":sprint", messages=[{"role": "user", "content": query}],
                                               temperature=0)
        else:                       # by extra_body, on the plain id
            r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": query}],
                                               extra_body={"sprint": {"mode": mode}})
        got = r.model_extra["sprint"]
        assert _untimed(got) == _untimed(ref), mode
        assert r.choices[0].message.content == ref["text"]
        assert r.usage.completion_tokens == ref["total_tokens"] > 0
        assert got["sequential_tokens"] == ref["sequential_tokens"] and "wall_s" in got
    # streaming: the stage events as they happen, then the record, then usage
    kinds, record, usage = [], None, None
    for chunk in client.chat.completions.create(model=NAME + ":sprint", messages=[{"role": "user", "content": query}],
                                                temperature=0, stream=True):
        extra = chunk.model_extra or {}
        if "sprint_event" in extra:
            kinds.append(extra["sprint_event"]["kind"])
        if "sprint" in extra:
            record = extra["sprint"]
        if chunk.usage is not None:
            usage = chunk.usage
    ref = Orchestrator(alone.engine, SPRINT_CFG).run(query, "parallel").to_json()
    assert kinds[0] == "start" and kinds[-1] == "end" and record is not None
    assert _untimed(record) == _untimed({k: v for k, v in ref.items() if k != "query"})
    assert usage.completion_tokens == ref["total_tokens"]


BAD = [
    (dict(model="nope", prompt="hi"), 404, "does not exist"),
    (dict(model=NAME, prompt="hi", max_tokens=0), 400, "max_tokens must be >= 1"),
    (dict(model=NAME, prompt="hi", max_tokens=1100), 400, "maximum context length is 1024"),
    (dict(model=NAME, prompt="hi", temperature=3), 400, "temperature must be in"),
    (dict(model=NAME, prompt="hi", top_p=0), 400, "top_p must be in"),
    (dict(model=NAME, prompt="hi", n=9), 400, "n must be between 1 and 4"),
    (dict(model=NAME, prompt="hi", n=2, max_tokens=60), 400, "with n > 1"),
    (dict(model=NAME, prompt="", max_tokens=4), 400, "prompt is empty"),
    (dict(model=NAME, prompt="hi", stop=["a", "b", "c", "d", "e"]), 400, "stop must be"),
    (dict(model=NAME, prompt="hi", logprobs=6), 400, "logprobs must be between 0 and 5"),
    (dict(model=NAME, prompt="caf\u00e9", max_tokens=2), 400, "prompt: the tokenizer cannot encode it"),
    (dict(model=NAME, prompt="hi", extra_body={"top_k": -1}), 400, "top_k must be between 0 and 307"),
    (dict(model=NAME, prompt="hi", extra_body={"seed": "x"}), 400, "seed must be an integer"),
    (dict(model=NAME, prompt="hi", extra_body={"sprint": {"max_stages": 0}}), 400, "max_stages must be"),
    (dict(model=NAME, prompt="hi", extra_body={"sprint": {"bogus": 1}}), 400, "sprint.bogus"),
    (dict(model=NAME + ":sprint", prompt="hi", n=2), 400, "n must be 1 in SPRINT mode"),
]


def test_serial_mode_on_a_merge_layout_model_is_a_400(setup):
    """A model exported with the merge layout joins by merge; a serial request has no branches to
    merge: one clear 400 (sprint.join 'reprefill' makes it valid again)."""
    import dataclasses

    server, client, alone, tok = setup
    before = server.state.sprint_config
    server.state.sprint_config = dataclasses.replace(before, layout="merge")   # what a merge export sets
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=NAME + ":sprint", prompt="hi", extra_body={"sprint": {"mode": "serial"}})
        assert e.value.status_code == 400 and "no branches to merge" in e.value.message
        assert e.value.body["param"] == "sprint.mode"
    finally:
        server.state.sprint_config = before


def test_bad_inputs_get_their_status_and_message_and_the_server_keeps_serving(setup):
    server, client, alone, tok = setup
    for kw, status, message in BAD:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(**kw)
        assert e.value.status_code == status, kw
        assert message in e.value.message, (kw, e.value.message)
        assert e.value.body["type"] in ("invalid_request_error",), kw
        assert client.completions.create(model=NAME, prompt="ok", max_tokens=2, temperature=0).choices[0].text
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
    assert e.value.status_code == 400 and "messages[0].role" in e.value.message
    status, raw = _http(server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]
    # a full queue: 429 with Retry-After, then served again once there is room
    worker = server.worker
    worker.max_queue = 0
    try:
        streams = [client.completions.create(model=NAME, prompt="hold", max_tokens=150, temperature=0, stream=True)
                   for _ in range(4)]
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        for s in streams:
            s.close()
    finally:
        worker.max_queue = 64
    _idle(server)
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2, temperature=0).usage.completion_tokens == 2
    text = _http(server, "/metrics")[1].decode()
    for name in ("queue_depth", "active_rows", "slots_used", "tokens_per_second",
                 "request_latency_seconds_bucket", 'requests_total{status="429"}', 'requests_total{status="404"}'):
        assert "sprint_serve_" + name in text, name


def test_a_full_queue_gets_429_with_retry_after_and_the_server_keeps_serving(setup, hf_untied):
    """A server of its own with a tiny queue (`max_queue=1`, as `serve --max-queue 1` builds it):
    4 requests decode, 1 waits, the next gets 429 + Retry-After in OpenAI's error shape (openai
    client and a raw request); once the holders leave it serves again (reference: the request
    decoded alone). A stopped engine (here: the engine task on the event loop) gives 503 + Retry-After."""
    _, _, alone, tok = setup
    model = from_pretrained(hf_untied)
    engine = Engine(model, tok, max_seqs=4, max_children=4, **CAPS)    # the module engine's shapes
    server = Server(engine, NAME, SPRINT_CFG, max_queue=1).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        assert server.worker.capacity == 5
        # 1000 tokens each: they hold their slots (and the queue place) for the whole test
        holders = [client.completions.create(model=NAME, prompt=f"hold {i}", max_tokens=1000, temperature=0,
                                             stream=True) for i in range(5)]
        assert server.worker._pending == 5          # what the 429 decision counts
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=NAME, prompt="one more", max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "rate_limit_error" and e.value.body["code"] == "queue_full"
        assert "queue is full" in e.value.message
        status, raw = _http(server, "/v1/chat/completions", json.dumps(
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode())
        assert status == 429 and json.loads(raw)["error"]["code"] == "queue_full"
        req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(
            {"model": NAME, "prompt": "x"}).encode(), headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(req, timeout=60)
        assert h.value.code == 429 and h.value.headers["Retry-After"] == "1"
        t_end = time.monotonic() + 120                # the engine's first step compiles
        while _metrics(server)["running_jobs"] < 5 and time.monotonic() < t_end:
            time.sleep(0.02)
        m = _metrics(server)
        assert m["running_jobs"] == 5 and m["slots_used"] == 4 and m["queue_depth"] == 1, m
        for s in holders:
            s.close()
        m = _idle(server, within=10)
        assert m["slots_used"] == 0 and m["running_jobs"] == 0 and m["queue_depth"] == 0, m
        assert server.worker._pending == 0
        got = client.completions.create(model=NAME, prompt="Count: 1, 2", max_tokens=12, temperature=0)
        assert got.choices[0].text == _alone_text(alone, tok, "Count: 1, 2", 12)
        text = _http(server, "/metrics")[1].decode()
        assert 'sprint_serve_requests_total{status="429"} 3' in text and 'requests_total{status="200"} 1' in text
        # the engine gone (here: stopped): 503 + Retry-After, and /health says so
        server.worker.stop()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=NAME, prompt="ok", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
        assert _http(server, "/health")[0] == 503
    finally:
        server.stop()


def test_the_engine_on_a_thread_of_its_own_serves_the_same(setup, hf_untied):
    """`serve --engine-on thread` (the accelerator default; the module's server runs its engine on
    the event loop, the CPU default): greedy completions and chat equal the request decoded alone,
    n = 4 shares one prefill and equals the branches decoded alone, streaming equals the whole
    response, SPRINT mode gives `Orchestrator.run`'s record, a client leaving mid-stream frees
    its slot within a second, and a stopped engine thread gives 503."""
    loop_server, _, alone, tok = setup
    assert loop_server.engine_on_loop and loop_server.worker.on_loop         # CPU: the engine on the loop
    switch = sys.getswitchinterval()
    assert switch == 0.0005                  # paced by the loop, its steps run on a thread too: short hand-offs
    model = from_pretrained(hf_untied)
    engine = Engine(model, tok, max_seqs=4, max_children=4, **CAPS)    # the module engine's shapes
    server = Server(engine, NAME, SPRINT_CFG, engine_on_loop=False).start()
    try:
        assert not server.worker.on_loop and server.worker._thread.is_alive()
        assert sys.getswitchinterval() == 0.0005                            # on a thread: short hand-offs
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompt = "What is 17 * 23?"
        ref = _alone_text(alone, tok, prompt, 12)
        assert client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text == ref
        c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=12,
                                           temperature=0)
        assert c.choices[0].message.content == ref
        before = _metrics(server)
        r = client.completions.create(model=NAME, prompt="Name four primes: ", max_tokens=10, n=4, temperature=1.0,
                                      seed=5)
        assert _metrics(server)["prefill_calls"] - before["prefill_calls"] == 1
        branches = alone.decode_branches(alone.prefill(tok.encode("Name four primes: ")), [[]] * 4, 10,
                                         sampling=Sampling(temperature=1.0, seed=5))
        assert [ch.text for ch in r.choices] == [g.text for g in branches]
        streamed = "".join(ch.text for chunk in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True) for ch in chunk.choices)
        assert streamed == ref
        query = "abc xyz hg"
        got = client.chat.completions.create(model=NAME + ":sprint", messages=[{"role": "user", "content": query}],
                                             temperature=0).model_extra["sprint"]
        sprint_ref = Orchestrator(alone.engine, SPRINT_CFG).run(query, "parallel").to_json()
        sprint_ref.pop("query")
        assert _untimed(got) == _untimed(sprint_ref)
        client.completions.create(model=NAME, prompt="Go on:", max_tokens=180, temperature=0)   # compiles its shapes
        stream = client.completions.create(model=NAME, prompt="Go on:", max_tokens=180, temperature=0, stream=True)
        next(c for c in stream if c.choices and c.choices[0].text)
        assert _metrics(server)["slots_used"] == 1
        stream.close()
        m = _idle(server, within=1.0)
        assert m["slots_used"] == 0 and m["active_rows"] == 0 and m["running_jobs"] == 0
        server.worker.stop()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=NAME, prompt="ok", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
    finally:
        server.stop()
    assert sys.getswitchinterval() == switch                                 # restored by stop()


def test_a_client_that_leaves_mid_stream_has_its_job_cancelled_and_its_slots_freed(setup):
    server, client, alone, tok = setup
    # the same request whole first: every shape it needs is compiled
    client.completions.create(model=NAME, prompt="Go on:", max_tokens=180, temperature=0)
    _idle(server)
    m = _metrics(server)
    cancelled, generated = m["cancelled"], m["tokens_total"]
    stream = client.completions.create(model=NAME, prompt="Go on:", max_tokens=180, n=1, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += sum(len(c.text) for c in chunk.choices)
        if got:
            break
    assert _metrics(server)["slots_used"] == 1
    stream.close()
    m = _idle(server, within=60.0)
    assert m["slots_used"] == 0 and m["active_rows"] == 0 and m["running_jobs"] == 0
    # cancelled, not run to its end: the engine stopped generating for it
    assert m["cancelled"] == cancelled + 1 and m["tokens_total"] - generated < 180
    # a fork (n = 4) leaves too: its children's rows go
    stream = client.completions.create(model=NAME, prompt="More:", max_tokens=40, n=4, temperature=1, stream=True)
    next(iter(stream))
    stream.close()
    m = _idle(server, within=60.0)
    assert m["slots_used"] == 0 and m["active_rows"] == 0


def test_load_64_concurrent_clients(setup):
    server, client, alone, tok = setup
    _idle(server)
    rng = np.random.default_rng(0)
    prompts = ["".join(rng.choice(list("abcdefgh 0123456789"), int(k))) for k in rng.integers(4, 40, 64)]
    latencies, errors = [], []
    lock = threading.Lock()

    def one_client(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for k in range(2):
            t = time.perf_counter()
            try:
                if k == 0:
                    r = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=8, temperature=0)
                    ok = r.usage.completion_tokens == 8
                else:
                    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompts[i]}],
                                                  max_tokens=6, temperature=0.5, seed=i)
                    ok = r.usage.completion_tokens == 6
                if not ok:
                    raise AssertionError(f"client {i}: wrong usage {r.usage}")
            except Exception as e:                      # noqa: BLE001  (every failure is reported)
                with lock:
                    errors.append(f"{i}/{k}: {type(e).__name__}: {e}")
                continue
            with lock:
                latencies.append(time.perf_counter() - t)
        c.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = time.perf_counter() - t0
    assert not errors, errors[:5]
    assert len(latencies) == 128
    m = _idle(server)
    assert m["slots_used"] == 0 and m["active_rows"] == 0 and m["running_jobs"] == 0 and m["queue_depth"] == 0
    assert server.worker._pending == 0
    lat = np.sort(latencies)
    print(f"\nload: 64 clients x 2 requests: {len(lat) / wall:.1f} req/s, {128 * 7 / wall:.0f} tokens/s, "
          f"p50 {1000 * np.percentile(lat, 50):.0f} ms, p99 {1000 * np.percentile(lat, 99):.0f} ms, wall {wall:.1f} s")


def test_curate_with_our_server_as_teacher_completes_and_resumes_from_its_store(setup, tmp_path):
    from sprint_jax.cli import main
    from sprint_jax.config import CONFIG_DIR

    server, client, alone, tok = setup
    served = lambda: sum(v for k, v in server.worker.requests.items())          # noqa: E731
    args = ["curate", "--config", str(CONFIG_DIR / "curate_countdown_served.yaml"), "--out", str(tmp_path / "cur"),
            "--no-progress", "--set", f"teacher.base_url={server.url}/v1", "--set", f"teacher.model={NAME}",
            "--set", "tasks.n=3", "--set", "teacher.max_tokens=12", "--set", "teacher.concurrency=3"]
    before = served()
    assert main(args) == 0
    assert served() - before == 3 and server.worker.requests.get("200", 0) >= 3   # one teacher call per task
    calls = json.loads((tmp_path / "cur" / "curation_report.json").read_text())["llm"]["total"]
    assert calls["calls"] == 3 and calls["completion_tokens"] == 3 * 12
    assert main(args) == 0                     # resumed: every answer comes from the store
    assert served() - before == 3


def _served_200(server) -> int:
    """Answered completion requests, as the server's /metrics counts them."""
    text = _http(server, "/metrics")[1].decode()
    return int(next((l.split()[-1] for l in text.splitlines() if l.startswith('sprint_serve_requests_total{status="200"}')),
                    "0"))


@pytest.mark.slow
def test_curate_with_our_server_as_teacher_resumes_after_a_kill(setup, tmp_path):
    """A real `sprint-jax curate` subprocess (teacher: this server, one call at a time, greedy) is
    SIGKILLed the moment its 3rd teacher request reaches the server, then rerun to the end. The
    store's rows and the outputs equal an uninterrupted run's; the rerun re-sends only the request
    the kill cut off (the server's /metrics count the requests)."""
    import os
    import signal
    import subprocess
    import sys

    from test_curation_pipeline import outputs
    from test_curation_resume import dump
    from sprint_jax.cli import main
    from sprint_jax.config import CONFIG_DIR
    from sprint_jax.curation.pipeline import DB_NAME

    server, client, alone, tok = setup
    _idle(server)
    flags = ["--config", str(CONFIG_DIR / "curate_countdown_served.yaml"), "--no-progress",
             "--set", f"teacher.base_url={server.url}/v1", "--set", f"teacher.model={NAME}", "--set", "tasks.n=4",
             "--set", "teacher.max_tokens=12", "--set", "teacher.concurrency=1", "--set", "teacher.temperature=0"]
    before = _served_200(server)
    assert main(["curate", *flags, "--out", str(tmp_path / "reference")]) == 0
    assert _served_200(server) - before == 4                     # one teacher call per task

    worker = server.worker
    submit, seen, proc = worker.try_submit, [], {}

    def watching_submit(job):                # the server itself is untouched: this only watches
        seen.append(tuple(job.prompt))
        if len(seen) == 3:
            os.kill(proc["p"].pid, signal.SIGKILL)
        return submit(job)

    worker.try_submit = watching_submit
    try:
        before = _served_200(server)
        proc["p"] = subprocess.Popen([sys.executable, "-m", "sprint_jax.cli", "curate", *flags,
                                      "--out", str(tmp_path / "killed")],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = proc["p"].communicate(timeout=600)[0]
        assert proc["p"].returncode == -signal.SIGKILL and len(seen) == 3, log
        _idle(server)
        killed_run = list(seen)
        assert main(["curate", *flags, "--out", str(tmp_path / "killed")]) == 0
    finally:
        worker.try_submit = submit
    rerun = seen[3:]
    # the two answered requests were not sent again; the cut-off one was, once; then the last task
    assert len(killed_run) == 3 and len(set(killed_run)) == 3
    assert rerun[0] == killed_run[2] and len(rerun) == 2 and rerun[1] not in killed_run
    # 2 answered in the killed run + 2 in the rerun; the cut-off request is cancelled once the
    # server sees its client gone, unless it finished first (then one more 200 nobody read)
    assert _served_200(server) - before in (4, 5)
    assert dump(tmp_path / "killed" / DB_NAME) == dump(tmp_path / "reference" / DB_NAME)
    assert outputs(tmp_path / "killed") == outputs(tmp_path / "reference")


def test_batch_engine_abort_frees_the_slot_in_every_state(setup, hf_untied):
    """`Engine.abort` (the server's cancel): a queued open, a sequence mid-prefill, a decoding
    row and a fork's children all go; the engine then serves a request exactly as alone."""
    server, client, alone, tok = setup
    engine = Engine(from_pretrained(hf_untied), tok, max_seqs=2, max_children=4, **CAPS)
    rng = np.random.default_rng(3)
    p_short, p_long, p_q = ([int(x) for x in rng.integers(3, 307, k)] for k in (9, 80, 5))
    a, b, c = engine.open(p_short), engine.open(p_long), engine.open(p_q)
    engine.step()                                    # a prefilled; b has 80 tokens: still prefilling
    assert engine.waiting == 1 and b.seq.id in engine._prefill_work
    engine.abort(c.seq)
    assert c.done and c.result is None and engine.waiting == 0
    engine.abort(b.seq)
    assert engine.free_slots == 1 and b.seq.id not in engine._prefill_work
    g = engine.generate(a.result, 40)
    engine.step()
    assert 0 < len(engine.progress(g)[0]) < 40 and engine.live_rows == 1
    engine.abort(a.seq)
    assert engine.free_slots == 2 and engine.live_rows == 0 and not engine.busy
    o = engine.open(p_short)
    engine.run([o])
    f = engine.fork(o.result, [[]] * 4, 20, sampling=Sampling(temperature=1.0, seed=1))
    engine.step()
    assert engine.live_rows == 4
    engine.abort(o.result)
    assert engine.free_slots == 2 and engine.live_rows == 0 and not engine.busy and f.done
    run = SingleRun(engine)
    got = run.generate(run.prefill(p_long), 12).tokens
    run.close()
    assert got == alone.generate(alone.prefill(p_long), 12).tokens


def test_cli_rejects_bad_flags_in_one_line(tmp_path, capsys):
    from sprint_jax.cli import main

    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--max-seqs", "0"]) == 2
    assert "--max-seqs must be >= 1" in capsys.readouterr().err
    for flag, value, message in (("--max-request-bytes", "0", "--max-request-bytes must be >= 1"),
                                 ("--max-connections", "-1", "--max-connections must be >= 1"),
                                 ("--header-timeout", "0", "--header-timeout must be a number of seconds > 0"),
                                 ("--body-timeout", "nan", "--body-timeout must be a number of seconds > 0"),
                                 ("--shutdown-grace", "-1", "--shutdown-grace must be a number of seconds >= 0"),
                                 ("--api-key", "two words", "--api-key must be printable ASCII without spaces")):
        assert main(["serve", "--model", str(tmp_path), flag, value]) == 2, flag
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert "two words" not in err                     # a key is never echoed, not even a bad one
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", str(tmp_path), "--engine-on", "gpu"])
    assert e.value.code == 2 and "--engine-on: invalid choice: 'gpu'" in capsys.readouterr().err


def _tiny_model_dir(hf_untied, tmp_path) -> str:
    import shutil

    model = tmp_path / "tinymodel"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    return str(model)


class _Subprocess:
    """`sprint-jax serve` as a user runs it: a subprocess on a free port (read from uvicorn's line)."""

    def __init__(self, model: str, *flags: str, env: dict | None = None):
        import os
        import re
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "sprint_jax.cli", "serve", "--model", model, "--port", "0",
                                      *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
        self.url, self.seen = None, []
        for line in self.proc.stdout:
            self.seen.append(line)
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.stop()
            raise AssertionError("".join(self.seen))

    def stop(self) -> str:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.communicate(timeout=60)[0]


SUBPROCESS_FLAGS = ("--max-seq-len", "64", "--max-seqs", "4", "--max-prompts", "2", "--max-branch-tokens", "16")


@pytest.mark.slow
def test_cli_serves_a_checkpoint_until_terminated(hf_untied, tmp_path):
    """`sprint-jax serve` as a user runs it: a subprocess on a free port, the openai client, SIGTERM.
    The model is a trained export (RUN/hf): its id is the run's name, said at start-up."""
    import shutil

    export = tmp_path / "runs" / "demo_run" / "hf"
    shutil.copytree(_tiny_model_dir(hf_untied, tmp_path), export)
    server = _Subprocess(str(export), *SUBPROCESS_FLAGS)
    try:
        assert "model ids demo_run and demo_run:sprint" in "".join(server.seen), server.seen
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        assert {m.id for m in c.models.list().data} == {"demo_run", "demo_run:sprint"}
        r = c.completions.create(model="demo_run", prompt="abc", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    finally:
        rest = server.stop()
    # uvicorn shuts down gracefully; a drained SIGTERM exits 0
    assert server.proc.returncode == 0 and "Finished server process" in rest, rest


def _mesh_workload(url: str) -> dict:
    """Greedy requests, four at once (they share engine steps), a fork of 2, a stream."""
    from concurrent.futures import ThreadPoolExecutor

    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = ["What is 17 * 23?", "abc def", "Name four primes: ", "0123456789 9876543210"]
    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda p: c.completions.create(model="tinymodel", prompt=p, max_tokens=20,
                                                             temperature=0).choices[0].text, prompts))
    fork = [ch.text for ch in c.completions.create(model="tinymodel", prompt="Count: 1, 2", max_tokens=12, n=2,
                                                   temperature=0).choices]
    streamed = "".join(ch.delta.content or "" for chunk in c.chat.completions.create(
        model="tinymodel", messages=[{"role": "user", "content": "Go on:"}], max_tokens=24, temperature=0,
        stream=True) for ch in chunk.choices)
    return dict(plain=plain, fork=fork, streamed=streamed)


@pytest.mark.slow
def test_cli_serve_on_a_mesh_gives_the_single_device_servers_completions(hf_untied, tmp_path):
    """`sprint-jax serve --mesh tensor=2,data=4` on 8 fake CPU devices (parameters and KV cache
    split over the mesh) answers every request as the same server on one device does."""
    model = _tiny_model_dir(hf_untied, tmp_path)
    one = _Subprocess(model, *SUBPROCESS_FLAGS)
    try:
        ref = _mesh_workload(one.url)
    finally:
        one.stop()
    meshed = _Subprocess(model, *SUBPROCESS_FLAGS, "--mesh", "tensor=2,data=4",
                         env={"XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8")})
    try:
        got = _mesh_workload(meshed.url)
        health = json.loads(urllib.request.urlopen(meshed.url + "/health", timeout=60).read())
    finally:
        log = meshed.stop()
    assert got == ref, log[-3000:]
    assert all(ref["plain"]) and ref["fork"][0] == ref["fork"][1]       # greedy children: one text twice
    assert health["mesh"] == {"data": 4, "fsdp": 1, "tensor": 2} and health["prefill_calls"] > 0


@pytest.mark.slow
def test_bench_serve_http_runs_the_same_work_on_every_path(tmp_path):
    """`sprint-jax bench serve --http` end to end, tiny settings: the server (http.client and the
    openai client) and the in-process engine answer every request of every wave with the same
    texts (the bench raises otherwise), and a row per (max_tokens, concurrency) holds each path's
    samples, one per request per pass."""
    from sprint_jax.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "serve", "--http", "--problems", "4", "--repeats", "2", "--concurrency", "1,2",
                 "--max-tokens", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["model"] == "demo-size" and len(res["prompt_tokens"]) == 4 and res["engine_on"] == "loop"
    assert [(r["max_tokens"], r["concurrency"]) for r in rows] == [(4, 1), (4, 2)]
    for r in rows:
        for p in ("inproc", "http", "openai"):
            x = r[p]
            assert len(x["samples_ms"]) == 8 and len(x["wall_samples_s"]) == 2
            assert 0 < x["p50_ms"] <= x["p90_ms"] <= x["p99_ms"] and x["requests_per_s"] > 0
        assert "overhead_ms" in r["http"] and "overhead_ms" in r["openai"] and "overhead_ms" not in r["inproc"]
