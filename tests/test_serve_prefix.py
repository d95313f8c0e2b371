"""`sprint-jax serve` and the prefix cache: chats that share a 1,024-token system prompt, through
the real `openai` client over HTTP, on the tiny real checkpoint (a character-level tokenizer, so a
string's tokens are its characters). References: the expected cache hits, page counts and prefill
calls derived by hand from the prompts' token ids (whole pages of the common prefix), and each
reply decoded greedily on a cold engine of its own (nothing cached). A SPRINT run's prompt is
counted and cached like a plain request's."""
from __future__ import annotations

import json
import re
import string
import time
import urllib.request

import numpy as np
import openai
import pytest

from conftest import tiny_vocab_tokenizer
from sprint_jax.infer import Engine
from sprint_jax.infer.orchestrator import OrchestratorConfig
from sprint_jax.model import from_pretrained
from sprint_jax.serve import Server

PAGE = 16
CAPS = dict(max_seqs=2, max_children=1, max_seq_len=1280, max_branch_tokens=8, decode_chunk=4, prefill_chunk=256,
            eos_token_ids=[], page_size=PAGE)
NAME = "tiny"
MAX_TOKENS = 8
USERS = ["Alpha: what is 12 + 30?", "Beta: name a prime.", "Gamma: spell cat", "Delta: 7 * 6 = ?"]


def _system_prompt() -> str:
    """1,024 characters of letters, digits and spaces: 1,024 tokens of the tiny tokenizer."""
    rng = np.random.default_rng(7)
    chars = string.ascii_letters + string.digits + " "
    return "".join(rng.choice(list(chars), 1024))


@pytest.fixture(scope="module")
def setup(hf_untied):
    model = from_pretrained(hf_untied)
    tok = tiny_vocab_tokenizer()
    sprint_cfg = OrchestratorConfig(max_planner_tokens=6, max_branch_tokens=4, max_total_tokens=8, max_prompts=1)
    server = Server(Engine(model, tok, **CAPS), NAME, sprint_cfg).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    yield server, client, model, tok
    server.stop()


def _get(server, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=60) as r:
        return r.read().decode()


def _idle(server, within: float = 10.0) -> dict:
    """/health once the engine holds nothing (the turn that ended the last request has renewed the
    metrics: the reply can reach the client before that turn's end)."""
    t_end = time.monotonic() + within
    while True:
        h = json.loads(_get(server, "/health"))
        if h["running_jobs"] == 0 and h["slots_used"] == 0 or time.monotonic() > t_end:
            return h
        time.sleep(0.02)


def _prometheus(server) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^sprint_serve_(\w+) ([0-9.eE+-]+)$", _get(server, "/metrics"), re.M)}


def _cold_reply(model, tok, ids: list[int]) -> str:
    """The greedy reply on a fresh engine: the prompt prefilled whole, nothing taken from a cache."""
    engine = Engine(model, tok, **CAPS)
    op = engine.open(ids)
    engine.run([op])
    gen = engine.generate(op.result, MAX_TOKENS)
    engine.run([gen])
    assert engine.page_stats()["prefix_hit_tokens"] == 0
    return gen.result.text


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_shared_system_prompt_is_prefilled_once(setup):
    server, client, model, tok = setup
    system = _system_prompt()
    assert len(tok.encode(system)) == 1024
    # the server's prompt for a chat when the tokenizer has no chat template: `role: content` lines,
    # then `assistant:` (the documented default)
    texts = [f"system: {system}\nuser: {u}\nassistant:" for u in USERS]
    ids = [tok.encode(t) for t in texts]
    cached_seqs: list[list[int]] = []      # token ids of the finished chats: what the cache holds
    before = _prometheus(server)
    assert before["prefix_hit_tokens_total"] == 0 and before["kv_page_size"] == PAGE
    pages_cached = 0
    for k, (user, prompt) in enumerate(zip(USERS, ids)):
        health0 = _idle(server)
        m0 = _prometheus(server)
        r = client.chat.completions.create(model=NAME, max_tokens=MAX_TOKENS, temperature=0,
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": user}])
        assert r.usage.prompt_tokens == len(prompt)
        health1 = _idle(server)
        m1 = _prometheus(server)
        # the longest cached prefix of whole pages, of the prompt less its last token (always run)
        common = max((_lcp(prompt, s) for s in cached_seqs), default=0)
        hit = min(common, len(prompt) - 1) // PAGE * PAGE
        if k == 0:
            assert hit == 0
        else:
            # "system: " + 1,024 tokens + "\nuser: " are common (the user texts differ in their
            # first character): 1,039 tokens, 64 whole pages
            assert common == 8 + 1024 + 7 and hit == 1024
        assert m1["prefix_hit_tokens_total"] - m0["prefix_hit_tokens_total"] == hit
        assert m1["prompt_tokens_cached_total"] - m0["prompt_tokens_cached_total"] == hit
        assert m1["prompt_tokens_total"] - m0["prompt_tokens_total"] == len(prompt)
        assert m1["prompt_tokens_prefilled_total"] - m0["prompt_tokens_prefilled_total"] == len(prompt) - hit
        # prefill calls of prefill_chunk tokens: the miss runs 1,0xx tokens in 5, a hit only its own
        # ~20 (more than a decode chunk, so a prefill call of its own)
        own = len(prompt) - 1 - hit
        assert own > CAPS["decode_chunk"]
        assert health1["prefill_calls"] - health0["prefill_calls"] == -(-own // CAPS["prefill_chunk"])
        assert (health1["prefill_calls"] - health0["prefill_calls"]) == (5 if k == 0 else 1)
        # the reply is the cold engine's
        reply = r.choices[0].message.content
        assert reply == _cold_reply(model, tok, prompt)
        full = prompt + tok.encode(reply)
        assert len(full) == len(prompt) + MAX_TOKENS
        # closed: the chat's full pages of its tokens less the last (the last has no K/V) are
        # cached; the pages of a prefix already cached are the tree's own
        n_full = (len(full) - 1) // PAGE
        shared = max((min(_lcp(full, s), len(s) - 1, len(full) - 1) // PAGE for s in cached_seqs), default=0)
        pages_cached += n_full - shared
        cached_seqs.append(full)
        assert health1["slots_used"] == 0 and health1["pages_used"] == 0
        assert m1["kv_pages_cached"] == pages_cached
        assert m1["kv_pages_free"] == m1["kv_pages_total"] - pages_cached
        assert m1["evicted_pages_total"] == 0
    # the shared 64 pages, then 3 of each chat's own: its 1,066-1,073 prompt tokens + 8 generated,
    # less the last, fill 67 pages
    assert pages_cached == 64 + 4 * 3
    # a SPRINT run opens its prompt too (the planner's sequence): counted, and it hits the same pages
    text = f"system: {system}\nuser: Epsilon: 5 - 1?\nassistant:"
    m0 = _prometheus(server)
    r = client.completions.create(model=NAME + ":sprint", prompt=text, max_tokens=8, temperature=0)
    _idle(server)
    m1 = _prometheus(server)
    n = len(tok.encode(text))
    assert r.usage.prompt_tokens == n
    assert m1["prompt_tokens_total"] - m0["prompt_tokens_total"] == n
    assert m1["prompt_tokens_cached_total"] - m0["prompt_tokens_cached_total"] == 1024
    assert m1["prompt_tokens_prefilled_total"] - m0["prompt_tokens_prefilled_total"] == n - 1024
