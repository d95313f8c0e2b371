"""The serving engine's driver (`EngineWorker`) keeps one request's failure, or its client's
departure, to that request: jobs submitted straight to the worker (past the HTTP validation) that
raise inside the engine, jobs cancelled mid-run or before the engine took them; then a good job,
whose tokens are checked against a plain full forward. Also the sampling values' own checks and
the reply text without the EOS token's text."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from conftest import greedy_by_full_forward, tiny_vocab_tokenizer
from sprint_jax.errors import UserError
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.single import SingleRun
from sprint_jax.infer.orchestrator import OrchestratorConfig
from sprint_jax.infer.sampling import Sampling
from sprint_jax.model.tokenizer import VocabTokenizer
from sprint_jax.serve.worker import Channel, EngineWorker, Job

CAPS = dict(max_seq_len=128, max_branch_tokens=32, decode_chunk=2, prefill_chunk=16, eos_token_ids=[])
PROMPT = "Name a prime: "
WAIT_S = 120            # a bound on waiting for an item, so a dead engine fails the test instead of hanging


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture
def engine(model):
    """A fresh engine per test: what one test leaves in it never shows in the next."""
    return Engine(model, tiny_vocab_tokenizer(), max_seqs=2, max_children=2, **CAPS)


def _serve(engine, scenario):
    """Run `scenario(worker)` with the worker's engine task on this test's event loop."""
    async def main():
        worker = EngineWorker(engine, on_loop=True)
        worker.start_on_loop()
        try:
            return await scenario(worker)
        finally:
            worker.stop()
    return asyncio.run(main())


def _plain(engine, max_tokens: int = 6, sampling: Sampling | None = None, stream: bool = False) -> Job:
    return Job("plain", Channel(asyncio.get_running_loop()), prompt=engine.encode(PROMPT), max_tokens=max_tokens,
               sampling=sampling or Sampling(), stream=stream)


def _sprint(config: OrchestratorConfig, stream: bool = False) -> Job:
    return Job("sprint", Channel(asyncio.get_running_loop()), query=PROMPT, mode="parallel", config=config,
               stream=stream)


async def _last(job: Job):
    """The job's final item (done / error), skipping streamed ones."""
    while True:
        kind, value, *_ = await asyncio.wait_for(job.channel.get(), WAIT_S)   # a streamed item may carry log-probs third
        if kind in ("done", "error"):
            return kind, value


async def _idle(worker: EngineWorker) -> None:
    """Until the engine holds no job (bounded: a leaked job fails the test's asserts after)."""
    for _ in range(10_000):
        if not worker._jobs and worker.engine.free_slots == worker.engine.max_seqs:
            return
        await asyncio.sleep(0)


def test_a_job_that_raises_in_the_engine_ends_alone_and_the_engine_serves_on(model, engine, caplog):
    bad = Sampling(temperature=1.0, seed=1)
    object.__setattr__(bad, "top_k", 2 ** 31)         # past the int32 row array of the decode step
    seedless = OrchestratorConfig(max_planner_tokens=6, max_total_tokens=12)
    seedless.seed = "x"                                # set after the config checked it

    async def scenario(worker):
        jobs = [_plain(engine, sampling=bad), _sprint(seedless), _plain(engine)]
        assert all(worker.try_submit(j) for j in jobs)
        return [await _last(j) for j in jobs], worker.alive

    caplog.set_level(logging.ERROR, "sprint_jax.serve.worker")
    (topk, seed, good), alive = _serve(engine, scenario)
    assert topk[0] == "error" and topk[1].status == 400 and "top_k" in topk[1]
    assert seed[0] == "error" and seed[1].status == 500
    failures = [r for r in caplog.records if r.exc_info]
    assert len(failures) == 1 and "internal error" in failures[0].getMessage()   # the bug, logged once
    assert good[0] == "done" and alive
    ref = greedy_by_full_forward(model, engine.encode(PROMPT), 6)
    assert good[1][0].tokens == ref
    assert engine.free_slots == engine.max_seqs and engine.live_rows == 0


def test_cancel_ends_a_plain_and_a_sprint_run_at_the_next_step_and_frees_their_slots(model, engine):
    config = OrchestratorConfig(max_planner_tokens=60, max_total_tokens=100)

    async def scenario(worker):
        out = []
        for job in (_plain(engine, max_tokens=60, stream=True), _sprint(config, stream=True)):
            assert worker.try_submit(job)
            while True:          # until it has decoded something (a plain job's tokens, the planner's)
                kind, value, *_ = await asyncio.wait_for(job.channel.get(), WAIT_S)
                if kind in ("tokens", "progress"):
                    break
                assert kind == "event", (kind, value)
            calls = engine.stats["decode_calls"]
            worker.cancel(job)
            await _idle(worker)
            # no decode call ran for it after the cancel: the engine went idle at once
            out.append((engine.stats["decode_calls"] - calls, job.finished))
            assert engine.free_slots == engine.max_seqs and engine.live_rows == 0 and not worker._jobs
        good = _plain(engine)
        assert worker.try_submit(good)
        return out, await _last(good)

    out, good = _serve(engine, scenario)
    assert out == [(0, True), (0, True)]
    assert good[0] == "done" and good[1][0].tokens == greedy_by_full_forward(model, engine.encode(PROMPT), 6)


def test_a_job_cancelled_before_the_engine_took_it_never_runs(model, engine):
    """The engine on a thread of its own: a handler on the loop submits (handed over when the loop
    turns) and its client leaves at once, so the cancel reaches the engine first."""
    async def scenario():
        worker = EngineWorker(engine).start()
        try:
            gone, good = _plain(engine, max_tokens=20), _plain(engine)
            assert worker.try_submit(gone)
            worker.cancel(gone)
            await asyncio.sleep(0)                      # the hand-over of `gone`
            assert worker.try_submit(good)
            result = await _last(good)
            for _ in range(1000):                       # the engine thread's last turn
                if worker.metrics["running_jobs"] == 0:
                    break
                time.sleep(0.01)
            return result, worker.metrics, gone.seq
        finally:
            worker.stop()

    good, metrics, gone_seq = asyncio.run(scenario())
    assert good[0] == "done" and good[1][0].tokens == greedy_by_full_forward(model, engine.encode(PROMPT), 6)
    assert gone_seq is None                           # never opened
    assert metrics["running_jobs"] == 0 and engine.free_slots == engine.max_seqs


@pytest.mark.parametrize("field, value", [
    ("top_k", 2 ** 31), ("top_k", -1), ("top_k", 2.5), ("seed", 2 ** 31), ("seed", "4"), ("seed", True),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5), ("top_p", float("nan")),
])
def test_sampling_refuses_values_out_of_range_naming_the_field(field, value):
    with pytest.raises(UserError, match=f"^{field} must be"):
        Sampling(**{field: value})
    with pytest.raises(ValueError, match=field):        # a ValueError too, for config loaders
        Sampling(**{field: value})


def test_sprint_config_refuses_a_seed_that_is_not_an_integer_or_outside_its_own_streams_range():
    with pytest.raises(UserError, match="seed must be an integer"):
        OrchestratorConfig(seed=1.5)
    with pytest.raises(UserError, match="seed must be at most 2147483647"):   # would share 0's draws
        OrchestratorConfig(seed=2 ** 31)
    assert 0 <= OrchestratorConfig(seed=2 ** 31 - 1, temperature=1.0).sampling(3).seed < 2 ** 31


def test_infer_with_a_sampling_value_out_of_range_is_one_line_and_exit_2(tmp_path, capsys):
    from sprint_jax.cli import main

    code = main(["infer", "a query", "--model", str(tmp_path / "none"), "--set", "top_k=1e20"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "top_k must be at most" in err, err


def test_reply_text_leaves_out_the_eos_token_and_no_sprint_tag_is_special(model):
    from sprint_jax import format as fmt
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model.tokenizer import qwen2_tokenizer

    tok = tiny_vocab_tokenizer()
    prompt = tok.encode("What is 17 * 23?")          # greedy: a few distinct tokens before any repeats
    toks = greedy_by_full_forward(model, prompt, 6)
    k = next(i for i in range(1, 6) if toks[i] not in toks[:i] and tok.vocab[toks[i]] not in ("<pad>", "<bos>"))
    # the same vocabulary with the k-th greedy token as its EOS: the model ends its reply there
    eos_tok = VocabTokenizer(tok.vocab, eos_token=tok.vocab[toks[k]], pad_token="<pad>", bos_token="<bos>")
    run = SingleRun(Engine(model, eos_tok, max_seqs=1, max_children=1, **{**CAPS, "eos_token_ids": None}))
    g = run.generate(run.prefill(prompt), 6)
    assert g.stop_reason == "eos" and g.tokens == toks[:k + 1]
    assert g.text == "".join(tok.vocab[t] for t in toks[:k])
    # nothing meaningful is a special token: every SPRINT tag keeps its text in the tokenizers we
    # train (the demo's vocabulary) and ship (Qwen2's BPE)
    tags = fmt.tag_vocabulary(max_stages=3, max_prompts=4)
    demo = VocabTokenizer(token_vocabulary(max_prompts=4))
    qwen = qwen2_tokenizer()
    for t in (demo, qwen):
        assert all(t.decode(t.encode(tag), skip_special_tokens=True) == tag for tag in tags)
