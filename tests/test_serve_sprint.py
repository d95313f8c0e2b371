"""SPRINT mode over HTTP with a model that really writes stages. A tiny Qwen2 is trained
for a few seconds by the real trainer (trie layout) on two curated digit-chains SPRINT
trajectories until it writes them back greedily: a plan of 4 prompts, 4 executions, a second plan,
the final answer. Built once per test session.

References: `sprint-jax infer` on the same query (its --record JSON) for the server's `sprint`
object and content, and the orchestrator's events on the single-run Engine for the order of the
streamed stage events."""
from __future__ import annotations

import argparse
import json

import openai
import pytest

from sprint_jax.cli import main

pytestmark = pytest.mark.slow        # trains a model (~1 minute on a loaded 2-core CPU)

NAME = "sp"
QUERIES = ["Q: 6 0 4 8\n", "Q: 6 4 7 5\n"]          # the two trained problems (chains, seed 0, length 3)
ANSWERS = ["9", "7"]
FLAGS = ["--max-seq-len", "256", "--max-prompts", "4", "--max-branch-tokens", "24", "--max-planner-tokens", "48",
         "--decode-chunk", "8", "--prefill-chunk", "64"]
TIMINGS = ("wall_s", "planner_s", "executors_s", "sync_s", "final_s", "branch_cache_bytes")


@pytest.fixture(scope="session")
def stage_model(tmp_path_factory):
    """The export directory of a tiny model trained to write SPRINT stages."""
    from sprint_jax.config import from_dict
    from sprint_jax.curation.config import CurateConfig
    from sprint_jax.curation.pipeline import run_pipeline
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    out = tmp_path_factory.mktemp("stage_model")
    cur = from_dict(CurateConfig, {
        "tasks": {"source": "chains", "n": 2, "seed": 0, "chain_length": 3},
        "teacher": {"kind": "programmatic"}, "extractor": {"kind": "offline"}, "dag": {"kind": "offline"},
        "merge_min_chars": 4, "min_ratio": 1.5, "seed": 0, "out": str(out / "curate")})
    run_pipeline(cur, out / "curate", progress=False)
    rows = [json.loads(line) for line in (out / "curate" / "sprint.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == QUERIES
    tok = VocabTokenizer(token_vocabulary(max_prompts=4), eos_token="<eos>", pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "init_seed": 0},
        "data": {"train": [str(out / "curate" / "sprint.jsonl")], "layout": "trie", "seq_len": 256, "seed": 0},
        "optim": {"lr": 1e-2, "warmup_steps": 5, "batch_size": 2, "weight_decay": 0.0},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "steps": 150, "log_every": 50, "seed": 0, "tensorboard": False, "plot": False})
    summary = train(tc, out / "train", tokenizer=tok, progress=False)
    return summary["export_dir"], [r["completion"] for r in rows]


@pytest.fixture(scope="module")
def served(stage_model):
    """The model served as `sprint-jax serve --model DIR FLAGS` builds it (in this process)."""
    from sprint_jax.infer.infer_cli import build_engine, config_from_args
    from sprint_jax.serve import Server
    from sprint_jax.serve import cli as serve_cli

    export, _ = stage_model
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--model", export, "--max-seqs", "2", *FLAGS])
    config = config_from_args(args)
    server = Server(build_engine(args, config, args.max_seqs), NAME, config).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    yield server, client
    server.stop()


def _untimed(d):
    if isinstance(d, dict):
        return {k: _untimed(v) for k, v in d.items() if k not in TIMINGS and k != "query"}
    if isinstance(d, list):
        return [_untimed(v) for v in d]
    return d


def _infer(export: str, query: str, tmp_path, mode: str = "parallel") -> dict:
    rec = tmp_path / f"record_{QUERIES.index(query)}_{mode}.json"
    assert main(["infer", query, "--model", export, "--mode", mode, *FLAGS, "--record", str(rec)]) == 0
    return json.loads(rec.read_text())


def test_sprint_response_equals_sprint_jax_infer_on_a_model_that_writes_stages(stage_model, request, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    export, completions = stage_model
    # the references first, before this process also runs a server (one fresh-clone run crashed in
    # an XLA CPU compile of `infer` while the server's threads were up)
    refs = [_infer(export, q, tmp_path) for q in QUERIES]
    seq_ref = _infer(export, QUERIES[0], tmp_path, "sequential")
    server, client = request.getfixturevalue("served")
    for ref, completion, answer in zip(refs, completions, ANSWERS):
        # the model writes its trained trajectory: two stages, four executors, the answer
        assert ref["text"] == completion and ref["termination"] == "final_answer" and ref["final_answer"] == answer
        assert ref["n_stages"] == 2 and len(ref["stages"][0]["executions"]) == 4
        assert ref["sequential_tokens"] < ref["total_tokens"]
    # both queries at once (they share the engine's steps), by the model id and by extra_body
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(client.chat.completions.create, model=NAME + ":sprint",
                           messages=[{"role": "user", "content": QUERIES[0]}], temperature=0)
        comp = pool.submit(client.completions.create, model=NAME, prompt=QUERIES[1],
                           extra_body={"sprint": {"mode": "parallel"}})
        chat, comp = chat.result(), comp.result()
    for r, ref, content in ((chat, refs[0], chat.choices[0].message.content), (comp, refs[1], comp.choices[0].text)):
        got = r.model_extra["sprint"]
        assert _untimed(got) == _untimed(ref)
        assert content == ref["text"] and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == ref["total_tokens"]
    # sequential mode (one stream; this trie-trained model then writes malformed tags, the run
    # still has to be the one infer gives) through extra_body
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUERIES[0]}],
                                       extra_body={"sprint": {"mode": "sequential"}}, temperature=0)
    assert _untimed(r.model_extra["sprint"]) == _untimed(seq_ref) and seq_ref["total_tokens"] > 0


def test_sprint_serial_mode_runs_one_executor_at_a_time_as_infer_does(stage_model, served, tmp_path):
    """sprint.mode 'serial' through the server: the reply is `infer --mode serial`'s run, and every
    fork the worker hands the engine runs its executors one after another (serial=True), as the
    infer / eval driver asks; the worker once forked them all at once."""
    export, _ = stage_model
    ref = _infer(export, QUERIES[0], tmp_path, "serial")
    server, client = served
    engine = server.worker.engine
    forks = []
    real = engine.fork

    def spy(*args, **kw):
        forks.append(kw.get("serial", False))
        return real(*args, **kw)

    engine.fork = spy
    try:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUERIES[0]}],
                                           extra_body={"sprint": {"mode": "serial"}}, temperature=0)
    finally:
        del engine.fork
    assert _untimed(r.model_extra["sprint"]) == _untimed(ref)
    assert ref["n_stages"] == 2 and len(ref["stages"][0]["executions"]) == 4
    assert forks and all(forks), forks


def test_sprint_streaming_emits_the_stage_events_in_order_and_the_text_as_it_is_decoded(stage_model, served):
    from sprint_jax.infer.infer_cli import build_engine, config_from_args
    from sprint_jax.infer.orchestrator import Orchestrator, execution_opening
    from sprint_jax.serve import cli as serve_cli

    export, _ = stage_model
    server, client = served
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    args = p.parse_args(["--model", export, *FLAGS])
    config = config_from_args(args)
    engine = build_engine(args, config)            # the engine `sprint-jax infer` runs on
    events = []
    ref = Orchestrator(engine, config, on_event=lambda ev: events.append(
        (ev.kind, ev.stage.index if ev.stage is not None else None, ev.text))).run(QUERIES[0], "parallel").to_json()
    events = [e for e in events if e[0] != "text"]   # the run's text arrives as content, not as events
    kinds = [e[0] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("executors") == 1 and "sync" in kinds
    messages = [{"role": "user", "content": QUERIES[0]}]
    whole = client.chat.completions.create(model=NAME + ":sprint", messages=messages, temperature=0)
    got, record, usage, deltas, chunks = [], None, None, "", []
    for chunk in client.chat.completions.create(model=NAME + ":sprint", messages=messages, temperature=0, stream=True):
        extra = chunk.model_extra or {}
        if "sprint_event" in extra:
            ev = extra["sprint_event"]
            got.append((ev["kind"], ev["stage"], ev["text"]))
            if ev["kind"] == "executors":       # the executors' texts arrive with their event
                assert [e["text"] for e in ev["executions"]] == [e["text"] for e in ref["stages"][0]["executions"]]
        if "sprint" in extra:
            record = extra["sprint"]
        for ch in chunk.choices:
            text = ch.delta.content or ""
            deltas += text
            if text:
                chunks.append((text, extra.get("sprint_delta"), len(got), "sprint" in extra))
        if chunk.usage is not None:
            usage = chunk.usage
    assert got == events
    assert _untimed(record) == _untimed(ref) and usage.completion_tokens == ref["total_tokens"]
    # the streamed text is the whole reply's, and it arrived as it was decoded, in order: the
    # planner's first call before its executors ended, each executor's text tagged with its index,
    # no more than a held-back end of the answer in the last chunk
    assert deltas == ref["text"] == whole.choices[0].message.content
    stage1 = ref["stages"][0]
    before_executors = "".join(t for t, _, n, _ in chunks if n <= kinds.index("executors"))
    assert before_executors.startswith(stage1["planner_text"])
    for e in stage1["executions"]:
        tagged = "".join(t for t, tag, _, _ in chunks if tag == {"stage": 1, "executor": e["index"]})
        assert tagged == execution_opening(1, e["index"]) + e["text"]
    assert sum(len(t) for t, _, _, last in chunks if last) < len("</Final Answer>")


def test_a_stop_string_ends_a_sprint_run_there_and_a_max_stages_cut_finishes_with_length(stage_model, served, tmp_path):
    """The body an evaluation harness sends (prompt, max_tokens, temperature 0, its stop strings,
    seed): the reply is infer's text cut at the first stop string, finish_reason stop, whole and
    streamed, and the run ended there (its record says stop_string and holds the tokens up to the
    join only, not the second stage's). A run cut by max_stages finishes with length."""
    export, _ = stage_model
    ref = _infer(export, QUERIES[0], tmp_path)
    server, client = served
    stop = "<execution_1.2>"                  # committed with stage 1's executors, before the second plan
    at = ref["text"].find(stop)
    assert at > 0
    body = dict(model=NAME + ":sprint", prompt=QUERIES[0], max_tokens=ref["total_tokens"], temperature=0,
                stop=["\n\nQ:", stop], seed=1234)
    r = client.completions.create(**body)
    rec = r.model_extra["sprint"]
    assert r.choices[0].text == ref["text"][:at] and r.choices[0].finish_reason == "stop"
    assert rec["termination"] == "stop_string" and len(rec["stages"]) == 1
    stage1 = ref["stages"][0]
    assert rec["total_tokens"] == stage1["planner_tokens"] + sum(e["tokens"] for e in stage1["executions"])
    assert rec["total_tokens"] < ref["total_tokens"]
    text, finishes = "", []
    for chunk in client.completions.create(**body, stream=True):
        for ch in chunk.choices:
            text += ch.text
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    assert text == ref["text"][:at] and finishes == ["stop"]
    cut = client.completions.create(model=NAME + ":sprint", prompt=QUERIES[0], temperature=0,
                                    extra_body={"sprint": {"max_stages": 1}})
    assert cut.model_extra["sprint"]["termination"] == "max_stages" and cut.choices[0].finish_reason == "length"
