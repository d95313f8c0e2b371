"""Token log-probs of `sprint-jax serve` in streamed replies and in SPRINT mode, through the real
`openai` client over HTTP on 127.0.0.1. References: each request decoded alone on a one-sequence
engine (`SingleRun`), and for SPRINT the HF torch model's fp32 forward over the exact context each
token was sampled in (every engine call of the same run recorded by `run_many`'s `on_call`)."""
from __future__ import annotations


import numpy as np
import openai
import pytest

from conftest import load_hf, tiny_vocab_tokenizer

TOL = 1e-4
NAME = "tiny"
CAPS = dict(max_seqs=2, max_children=2, max_seq_len=128, max_branch_tokens=24, decode_chunk=4, prefill_chunk=32,
            eos_token_ids=[])


def _log_softmax(row: np.ndarray, n_valid: int) -> np.ndarray:
    """log-probs of the model's own distribution (temperature 1) over the ids the tokenizer knows."""
    z = row[:n_valid].astype(np.float64)
    m = z.max()
    return z - (m + np.log(np.sum(np.exp(z - m))))


def _torch_logprobs(hf, context: list[int], tokens: list[int], n_valid: int) -> list[np.ndarray]:
    """Per token of `tokens`, the log-probs of the distribution it was drawn from after `context`
    and the tokens before it: one fp32 causal forward of the HF torch model."""
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([context + tokens])).logits[0].double().numpy()
    return [_log_softmax(logits[len(context) + k - 1], n_valid) for k in range(len(tokens))]


@pytest.fixture(scope="module")
def served(tiny_model):
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.orchestrator import OrchestratorConfig
    from sprint_jax.infer.single import SingleRun
    from sprint_jax.serve import Server

    tok = tiny_vocab_tokenizer()
    cfg = OrchestratorConfig(max_planner_tokens=10, max_branch_tokens=8, max_total_tokens=14, max_prompts=2)
    server = Server(Engine(tiny_model, tok, **CAPS), NAME, cfg).start()
    alone = SingleRun(Engine(tiny_model, tok, **CAPS))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield server, client, alone, tok, cfg
    server.stop()
    alone.close()


def _streamed(chunks, chat: bool) -> tuple[dict, dict, int]:
    """Per choice index: the streamed text and the chunks' log-prob entries concatenated; and how
    many chunks carried entries."""
    text, entries, carrying = {}, {}, 0
    for chunk in chunks:
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + ((ch.delta.content or "") if chat else ch.text)
            lp = ch.logprobs
            if lp is None:
                continue
            got = _entries(lp, chat)
            carrying += bool(got)
            entries.setdefault(ch.index, []).extend(got)
    return text, entries, carrying


def _entries(lp, chat: bool) -> list:
    """A `logprobs` object as (token, log-prob, alternatives, text offset or None) tuples."""
    if chat:
        offsets = (lp.model_extra or {}).get("text_offset") or [None] * len(lp.content)
        return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs], o)
                for e, o in zip(lp.content, offsets)]
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    return [(t, v, list(a.items()) if a is not None else None, o)
            for t, v, a, o in zip(lp.tokens, lp.token_logprobs, tops, lp.text_offset)]


@pytest.mark.slow                   # ~24 s on the loaded 2-core CPU (compiles of the fork and top-n programs)
def test_streamed_logprobs_concatenate_to_the_whole_reply_and_equal_the_engines(served):
    """Greedy, n = 2 (and with a stop string): each streamed chunk carries the entries of the
    tokens its text begins; their concatenation per choice == the non-streamed reply's logprobs,
    and both == the request decoded alone (tokens, log-probs, alternatives, offsets)."""
    from sprint_jax.infer.sampling import Sampling

    server, client, alone, tok, _ = served
    dec = alone.engine.decode_text            # special tokens (<pad>) decode to "", as the server's
    prompt = "Tell me: "
    op = alone.engine.generate(alone.prefill(tok.encode(prompt)), 12, sampling=Sampling(0.0, 0, 1.0, 0),
                               top_logprobs=3)
    alone.engine.run([op])
    ref = op.result
    stop = ref.text[7:9]
    cut = ref.text[:ref.text.find(stop)]
    for kw, text in ((dict(max_tokens=12, n=2), ref.text), (dict(max_tokens=12, stop=[stop]), cut)):
        whole = client.completions.create(model=NAME, prompt=prompt, temperature=0, logprobs=3, **kw)
        streamed, parts, carrying = _streamed(client.completions.create(
            model=NAME, prompt=prompt, temperature=0, logprobs=3, stream=True, **kw), chat=False)
        assert carrying > 1 or "stop" in kw                     # streamed in pieces, not all at the end
        starts = [sum(len(dec([t])) for t in ref.tokens[:i]) for i in range(len(ref.tokens))]
        k = sum(s < len(text) for s in starts)          # the tokens whose text begins in the reply's
        assert 0 < k <= len(ref.tokens) and (k < len(ref.tokens)) == (text == cut)
        for c in whole.choices:
            assert c.text == text == streamed[c.index]
            assert parts[c.index] == _entries(c.logprobs, chat=False)
            assert c.logprobs.tokens == [dec([t]) for t in ref.tokens[:k]]
            # float32: a fork's children and the lone sequence run different programs (log-probs near
            # -4 were seen 1.2e-6 apart, a few ulps); 1e-5 still tells any other token's apart
            assert np.allclose(c.logprobs.token_logprobs, ref.logprobs[:k], atol=1e-5, rtol=0)
            _same_alternatives([sorted(a.items()) for a in c.logprobs.top_logprobs],
                               [sorted(dict((dec([i]), v) for i, v in alts).items()) for alts in ref.top_logprobs[:k]])
            assert c.logprobs.text_offset == starts[:k]
    msgs = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                           top_logprobs=2)
    streamed, parts, carrying = _streamed(client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2, stream=True),
        chat=True)
    assert carrying > 1 and streamed[0] == whole.choices[0].message.content == ref.text
    assert parts[0] == _entries(whole.choices[0].logprobs, chat=True)
    assert [t for t, *_ in parts[0]] == [dec([t]) for t in ref.tokens]
    _same_alternatives([a for _, _, a, _ in parts[0]], [[(dec([i]), v) for i, v in alts[:2]] for alts in ref.top_logprobs])
    assert np.allclose([v for _, v, _, _ in parts[0]], ref.logprobs, atol=1e-6, rtol=0)


def _same_alternatives(got: list, want: list) -> None:
    """The same alternatives per token (decoded), their log-probs within 1e-5 (the server's rows
    share decode steps with other rows; the reference decoded alone)."""
    assert [[a for a, _ in alts] for alts in got] == [[a for a, _ in alts] for alts in want]
    assert np.allclose([v for alts in got for _, v in alts], [v for alts in want for _, v in alts], atol=1e-5, rtol=0)


def _reference_calls(engine, query: str, mode: str, config) -> tuple:
    """The same run on its own engine (`run_many`): its record and every generated call's (context,
    Generation) in call order, a fork's children in order, each with the tokens it was sampled after."""
    from sprint_jax.infer.orchestrator import run_many

    calls = []

    def on_call(i, call, context, result):
        if call.kind == "generate":
            calls.append((list(context), result))
        elif call.kind == "branches":
            calls.extend((list(context) + list(p), g) for p, g in zip(call.prefixes, result))
    rec = run_many(engine, [query], mode, config, concurrency=1, on_call=on_call)[0]
    return rec, calls


def _check_sprint_logprobs(entries: list, text: str, calls: list, hf, n_valid: int, decode, top: int) -> int:
    """Every listed entry is the next generated token of the reference calls in text order, at its
    offset in `text`, with the log-prob (and alternatives) of an fp32 forward over its context;
    a call's unlisted tokens are only those past the end of its text. Returns the entries checked."""
    k = 0
    for context, g in calls:
        ref = _torch_logprobs(hf, context, list(g.tokens), n_valid)
        for t, lp in zip(g.tokens, ref):
            if k == len(entries) or entries[k][0] != decode([t]):
                break
            token, got, alts, offset = entries[k]
            assert text[offset:offset + len(token)] == token, (k, offset, token)
            assert abs(got - lp[t]) < TOL, (k, got, lp[t])
            # the n most likely of that distribution, each at its reference log-prob (ids compared by
            # value, so that a near tie may come in either order)
            assert np.allclose([v for _, v in alts], np.sort(lp)[::-1][:top], atol=TOL, rtol=0)
            for name, v in alts:
                assert any(abs(v - lp[i]) < TOL for i in range(len(lp)) if decode([i]) == name), (k, name)
            k += 1
    assert k == len(entries)
    offsets = [o for *_, o in entries]
    assert offsets == sorted(offsets)
    return k


def test_sprint_logprobs_equal_a_full_forward_over_each_tokens_context(served, hf_untied):
    """A greedy SPRINT request on the tiny random model (its planner never closes a plan: one
    planner call, cut by its limit): the completions and chat replies list every generated token
    of the text, each == the torch forward's log-prob at its context within 1e-4, placed at its
    offset; streamed, its chunks carry the same entries as the planner's text is decoded."""
    server, client, alone, tok, cfg = served
    query = "abc xyz hg"
    rec, calls = _reference_calls(alone.engine, query, "parallel", cfg)
    assert rec.termination == "planner_token_limit" and len(calls) == 1
    hf = load_hf(hf_untied)
    r = client.completions.create(model=NAME + ":sprint", prompt=query, temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text == rec.text
    got = _entries(c.logprobs, chat=False)
    assert _check_sprint_logprobs(got, c.text, calls, hf, len(tok), alone.engine.decode_text, 2) == rec.total_tokens == 10
    ch = client.chat.completions.create(model=NAME + ":sprint", messages=[{"role": "user", "content": query}],
                                        temperature=0, logprobs=True, top_logprobs=2)
    got_chat = _entries(ch.choices[0].logprobs, chat=True)
    assert [(t, v, o) for t, v, _, o in got_chat] == [(t, v, o) for t, v, _, o in got]
    assert _check_sprint_logprobs(got_chat, rec.text, calls, hf, len(tok), alone.engine.decode_text, 2) == 10
    streamed, parts, carrying = _streamed(client.completions.create(
        model=NAME + ":sprint", prompt=query, temperature=0, logprobs=2, stream=True), chat=False)
    assert streamed[0] == rec.text and parts[0] == got and carrying > 1
    streamed, parts, carrying = _streamed(client.chat.completions.create(
        model=NAME + ":sprint", messages=[{"role": "user", "content": query}], temperature=0, logprobs=True,
        top_logprobs=2, stream=True), chat=True)
    assert streamed[0] == rec.text and parts[0] == got_chat and carrying > 1
    plain = client.completions.create(model=NAME + ":sprint", prompt=query, temperature=0)
    assert plain.choices[0].logprobs is None


def test_sprint_token_layout_places_each_calls_tokens_and_leaves_out_inserted_text():
    """The layout over a hand-written run log: a plan, two executors (the second repaired after
    its limit), a join tail, the final call; an executor whose join never came lists nothing.
    Expected entries written out by hand."""
    from sprint_jax.infer.requests import Generation
    from sprint_jax.serve.worker import sprint_token_layout

    def gen(tokens, lps, stop_reason="stop"):
        return Generation(tokens=tokens, text="".join(tokens), stop_reason=stop_reason, logprobs=lps)

    def decode(ids):
        return "".join(ids)
    plan = gen(["P", "l", "</P>", "!"], [-1.0, -2.0, -3.0, -4.0])      # "!" decoded past the stop
    e1 = gen(["a", "</e1>"], [-5.0, -6.0])
    e2 = gen(["b", "c"], [-7.0, -8.0], "length")
    final = gen(["F", "<eos>"], [-9.0, -10.0], "eos")
    text = "Pl</P>" + "<e1>a</e1>" + "<e2>bc</e2>" + "|" + "F"
    layout = [("call", plan), ("text", "Pl</P>", None, 0, 0), ("call", [e1, e2]),
              ("text", "<e1>a</e1>", 1, 4, 5), ("text", "<e2>bc</e2>", 2, 4, 2), ("text", "|", None, 0, 0),
              ("call", final)]
    got = [(e.token, e.offset, e.logprob) for e in sprint_token_layout(layout, text, decode, 0)]
    assert got == [("P", 0, -1.0), ("l", 1, -2.0), ("</P>", 2, -3.0), ("a", 10, -5.0), ("</e1>", 11, -6.0),
                   ("b", 20, -7.0), ("c", 21, -8.0), ("F", 28, -9.0)]
    # the run ended before the join: the executors' text never reached the reply
    cut = [("call", plan), ("text", "Pl</P>", None, 0, 0), ("call", [e1, e2])]
    assert [e.token for e in sprint_token_layout(cut, "Pl</P>", decode, 0)] == ["P", "l", "</P>"]


CHAINS, LENGTH = 2, 2


@pytest.fixture(scope="module")
def stage_server(tmp_path_factory):
    """A tiny SPRINT model trained to plan, fork and answer (trie layout; the recipe of
    test_rl_logprob's policy), served; its export directory and tokenizer."""
    from sprint_jax.infer.engine import Engine
    from sprint_jax.infer.orchestrator import OrchestratorConfig
    from sprint_jax.model import from_pretrained
    from sprint_jax.serve import Server
    from sprint_jax.tasks import chains
    from sprint_jax.train.trainer import train
    from conftest import chains_policy_config

    root = tmp_path_factory.mktemp("serve_logprob_sft")
    tc, tok, tasks = chains_policy_config(root, "sprint", "trie", CHAINS, LENGTH)
    export = train(tc, root / "train", tokenizer=tok, progress=False)["export_dir"]
    caps = dict(max_seqs=1, max_children=CHAINS, max_seq_len=160, max_branch_tokens=24, decode_chunk=4,
                prefill_chunk=64)
    cfg = OrchestratorConfig(max_prompts=CHAINS, max_planner_tokens=40, max_branch_tokens=16, max_total_tokens=160,
                             layout="trie")
    model = from_pretrained(export)
    server = Server(Engine(model, tok, **caps), NAME, cfg).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    yield export, tok, Engine(model, tok, **caps), cfg, client, [chains.prompt_for(t) for t in tasks[:2]]
    server.stop()


@pytest.mark.slow
def test_sprint_logprobs_of_a_run_with_executors_equal_a_full_forward(stage_server):
    """A model that plans, forks two executors and answers (greedy, re-prefill join; 60 training
    steps leave it imperfect: an executor may end with EOS and be closed by the orchestrator):
    every planner and executor token of the text is listed in text order (an EOS is not), each ==
    the torch forward's log-prob over the context it was sampled in (the planner's, or the fork's
    prefix + its opening + its own tokens before it) within 1e-4, at its offset in the text; the
    characters no entry covers are exactly the openings and repairs the orchestrator wrote. A
    streamed reply's chunks carry the same entries."""
    from sprint_jax import format as fmt
    from sprint_jax.infer.orchestrator import execution_opening

    export, tok, engine, cfg, client, queries = stage_server
    hf = load_hf(export)
    for query in queries:
        rec, calls = _reference_calls(engine, query, "parallel", cfg)
        assert rec.termination == "final_answer" and len(rec.stages[0].executions) == CHAINS, rec.problems
        ch = client.chat.completions.create(model=NAME + ":sprint", messages=[{"role": "user", "content": query}],
                                            temperature=0, logprobs=True, top_logprobs=3)
        text = ch.choices[0].message.content
        assert text == rec.text
        got = _entries(ch.choices[0].logprobs, chat=True)
        eos = sum(t == tok.eos_token_id for _, g in calls for t in g.tokens)
        assert _check_sprint_logprobs(got, text, calls, hf, len(tok), engine.decode_text, 3) == \
            rec.total_tokens - eos
        covered = set()
        for token, _, _, offset in got:
            covered.update(range(offset, offset + len(token)))
        inserted = "".join(execution_opening(s.index, e.index) + (
            ("" if not e.text or e.text[-1].isspace() else fmt.CLOSE_GAP) + fmt.execution_close(s.index, e.index)
            if e.repaired else "") for s in rec.stages for e in s.executions)
        assert "".join(c for i, c in enumerate(text) if i not in covered) == inserted
        # streamed: the chunks (planner and executor 1 previews, committed executions) carry them all
        streamed, parts, carrying = _streamed(client.chat.completions.create(
            model=NAME + ":sprint", messages=[{"role": "user", "content": query}], temperature=0, logprobs=True,
            top_logprobs=3, stream=True), chat=True)
        assert streamed[0] == text and parts[0] == got and carrying > 2
