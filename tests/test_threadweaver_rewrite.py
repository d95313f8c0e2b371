"""`restructure: threadweaver_rewrite`: ThreadWeaver's five-step rewrite (curation/tw_rewrite.py)
against the local fake teacher server, driven by the real openai client: a run that writes
ThreadWeaver-format examples, a task rejected at every step and counted there, and kills / resumes
that never send a completed step's request again (the server counts what it receives)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_openai_server import FakeOpenAIServer, Reply
from test_curation_pipeline import KEY_ENV, SECRET, outputs, records
from test_curation_rewrite import TASKS, RewriteCurator, curate_killed_at, rewrite_data, write_tasks
from sprint_jax import threadweaver as tw
from sprint_jax.config import load_config
from sprint_jax.curation import tw_rewrite
from sprint_jax.curation.config import CurateConfig, data_fingerprint
from sprint_jax.curation.pipeline import DB_NAME, run_pipeline, status
from sprint_jax.curation.store import Store
from sprint_jax.tasks.types import Task, Trace

STEPS = tw_rewrite.STEPS

# What the rewriter answers at steps 1-4, per task (t4 never gets there: the filter drops it).
# Paragraphs are those of fake_openai_server.trace_text: one per step of the task, then the answer.
PLAN = {
    "t1": dict(spans=[[1, 2]], threads=[[[1], [2]]],
               rewrite=[["2 + 3 = 5, so the first factor is 5.", "4 + 5 = 9, so the second factor is 9."]],
               outlines=[["Compute 2+3, the first factor.", "Compute 4+5, the second factor."]]),
    "t2": dict(spans=[[2, 4]], threads=[[[2], [3], [4]]],
               rewrite=[["a + 1 = 2 + 1 = 3.", "a + 2 = 2 + 2 = 4.", "a + 3 = 2 + 3 = 5."]],
               outlines=[["Evaluate a+1.", "Evaluate a+2.", "Evaluate a+3."]]),
    "t3": dict(spans=[]),                                                          # step 1: no_span
    "t5": dict(spans=[[2, 5]]),                                                    # step 1: past the 4 paragraphs
    "t6": dict(spans=[[1, 2]], threads=[[[1], [1]]]),                              # step 2: paragraph 2 in no thread
    "t7": dict(spans=[[1, 2]], threads=[[[1], [2]]],                               # step 3: thread 2 quotes 13
               rewrite=[["6 + 7 = 13.", "8 + 9 = 17, and 13 stays as it is."]]),
    "t8": dict(spans=[[1, 2]], threads=[[[1], [2]]], rewrite=[["10 + 20 = 30.", "30 + 40 = 70."]],
               outlines=[["Add 10 and 20, which gives 70.", "Add 30 and 40."]]),   # step 4: outline 1 gives 70
    "t9": dict(spans=[[1, 2]], threads=[[[1], [2]]], rewrite=[["5 + 5 = 10.", "6 + 6 = 12."]],
               outlines=[["Add 5 and 5.", "Add 6 and 6."]]),                   # step 5: a thread dropped
}
REJECTED = {"t3": ("tw1_spans", "no_span"), "t5": ("tw1_spans", "bad_span"), "t6": ("tw2_threads", "bad_partition"),
            "t7": ("tw3_rewrite", "sibling_dependency"), "t8": ("tw4_outlines", "outline_gives_result"),
            "t9": ("tw5_validate", "structure_changed")}

# Written by hand from the ThreadWeaver grammar (sprint_jax/threadweaver.py's docstring): the block
# in place of paragraphs 1-2, paragraph 3 and the answer sentence sequential, the trace's answer.
T1_EXPECTED = (
    "<think>\n<Parallel>\n<Outlines>\n<Outline>1: Compute 2+3, the first factor.</Outline>\n"
    "<Outline>2: Compute 4+5, the second factor.</Outline>\n</Outlines>\n"
    "<Thread>1: 2 + 3 = 5, so the first factor is 5.</Thread>\n<Thread>2: 4 + 5 = 9, so the second factor is 9.</Thread>\n"
    "</Parallel>\nMultiply the two factors. 5 * 9 = 45, which is the product asked for.\n\n"
    "So the final answer is \\boxed{45}.\n</think>\n45")


class TWCurator(RewriteCurator):
    """The teacher of the rewrite tests, plus the five steps: steps 1-4 by their response_format's
    name, step 5 by its system prompt. Step 5 echoes the trajectory it is sent (t2's inside a
    ``` fence; t9's without its second outline and thread) unless `overrides[(step, tid)]` says otherwise."""

    def __init__(self):
        super().__init__()
        self.overrides: dict[tuple[str, str], str | Reply] = {}

    @staticmethod
    def step_of(body: dict) -> str | None:
        fmt = body.get("response_format")
        if fmt and fmt["json_schema"]["name"] in STEPS:
            return fmt["json_schema"]["name"]
        return "tw5_validate" if body["messages"][0]["content"] == tw_rewrite.SYSTEM_PROMPTS["tw5_validate"] else None

    def __call__(self, body: dict):
        step = self.step_of(body)
        if step is None:
            return super().__call__(body)
        tid = self.task_id(body)
        if (step, tid) in self.overrides:
            return self.overrides[(step, tid)]
        plan = PLAN[tid]
        if step == "tw1_spans":
            return json.dumps({"spans": [{"first": a, "last": b, "reason": "independent"} for a, b in plan["spans"]]})
        if step == "tw2_threads":
            return json.dumps({"blocks": [{"threads": t} for t in plan["threads"]]})
        if step == "tw3_rewrite":
            return json.dumps({"blocks": [{"threads": t} for t in plan["rewrite"]]})
        if step == "tw4_outlines":
            return json.dumps({"blocks": [{"outlines": o} for o in plan["outlines"]]})
        doc = body["messages"][1]["content"].split("Trajectory:\n", 1)[1]
        if tid == "t2":
            return "```\n" + doc + "\n```"
        if tid == "t9":
            return doc.replace("<Outline>2: Add 6 and 6.</Outline>\n", "").replace("<Thread>2: 6 + 6 = 12.</Thread>\n", "")
        return doc


def tw_data(base_url: str, tmp_path: Path) -> dict:
    return {**rewrite_data(base_url, tmp_path), "restructure": "threadweaver_rewrite"}


def make_cfg(srv: FakeOpenAIServer, tmp_path: Path, *overrides: str) -> CurateConfig:
    return load_config(CurateConfig, None, list(overrides), data=tw_data(srv.base_url, tmp_path))


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with FakeOpenAIServer(TWCurator(), api_key=SECRET) as srv:
        yield srv


def reference(tmp_path: Path, monkeypatch) -> dict:
    """Outputs of an uninterrupted, fault-free run on its own server."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    with FakeOpenAIServer(TWCurator(), api_key=SECRET) as srv:
        run_pipeline(make_cfg(srv, tmp_path), tmp_path / "reference", progress=False)
    return outputs(tmp_path / "reference")


# requests per step, counted by hand: 9 teacher calls; step 1 for the 8 correct traces; then the
# survivors of each step (t3, t5 out at 1; t6 at 2; t7 at 3; t8 at 4)
PAID = {"teacher": 9, "tw1_spans": 8, "tw2_threads": 6, "tw3_rewrite": 5, "tw4_outlines": 4, "tw5_validate": 3}


def test_five_step_run_writes_threadweaver_examples_and_counts_rejections_per_step(server, tmp_path):
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)

    assert report["counts"] == {"tasks": 9, "teacher": 9, "filter": 8, "tw1_spans": 6, "tw2_threads": 5,
                                "tw3_rewrite": 4, "tw4_outlines": 3, "tw5_validate": 2, "reformat": 2,
                                "sprint_examples": 2, "rft_examples": 2}
    assert report["discards"] == {"filter": {"incorrect": 1}, "tw1_spans": {"no_span": 1, "bad_span": 1},
                                  "tw2_threads": {"bad_partition": 1}, "tw3_rewrite": {"sibling_dependency": 1},
                                  "tw4_outlines": {"outline_gives_result": 1}, "tw5_validate": {"structure_changed": 1}}
    with Store(out / DB_NAME) as st:
        assert {tid: (step, st.failure(tid, step)["reason"]) for tid, (step, _) in REJECTED.items()} == REJECTED
        assert st.failure("t5", "tw1_spans")["detail"] == "paragraphs 2-5: not a span of paragraphs 1-4"
        assert st.failure("t7", "tw3_rewrite")["detail"] == "thread 1.2 uses 13, a result of thread 1.1"
        assert st.failure("t8", "tw4_outlines")["detail"] == "outline 1.1 states 70, a result of thread 1.2"
    assert {k: v["calls"] for k, v in report["llm"].items()} == {**PAID, "total": sum(PAID.values())}
    assert server.n_received() == sum(PAID.values()) == 35 and max(server.answered.values()) == 1

    sprint = records(out, "sprint")
    assert [r["id"] for r in sprint] == ["t1", "t2"]
    assert sprint[0]["completion"] == T1_EXPECTED
    assert sprint[0]["meta"] == {"task_id": "t1", "task_kind": "math", "teacher": "openai:fake-teacher",
                                 "restructure": "threadweaver_rewrite", "format": "threadweaver",
                                 "rewriter": "fake-rewriter", "n_stages": 1, "widths": [2]}
    for r in sprint:                                     # the project's grammar accepts them as they are
        traj, problems = tw.parse_completion(r["completion"])
        assert problems == [] and tw.render_completion(traj) == r["completion"]
    t2, _ = tw.parse_completion(sprint[1]["completion"])
    assert t2.blocks[0].before == "Note the value of a. a is given as 2, so every term uses a = 2."
    assert t2.blocks[0].threads == ["a + 1 = 2 + 1 = 3.", "a + 2 = 2 + 2 = 4.", "a + 3 = 2 + 3 = 5."]
    assert t2.answer == "12"
    # the RFT twins in the same format: the serial trace with no block, the answer after </think>
    rft = records(out, "rft")
    assert [r["id"] for r in rft] == ["t1", "t2"] and all(r["meta"]["format"] == "threadweaver" for r in rft)
    traj, problems = tw.parse_completion(rft[0]["completion"])
    assert problems == [] and traj.blocks == [] and traj.answer == "45" and traj.after.startswith("Compute 2+3")
    # stages and prompts per example, counted by hand: t1 one block of 2 threads, t2 one of 3
    assert report["shape"] == {"examples": 2, "stages": {"max": 1, "p99": 1, "histogram": {"1": 2}},
                               "prompts": {"max": 3, "p99": 3, "histogram": {"2": 1, "3": 1}}}
    # the requests: step 2 sees step 1's spans, step 5 the trajectory assembled from steps 1-4
    sent = {(TWCurator.step_of(r.body), server.script.task_id(r.body)): r.body["messages"][1]["content"]
            for r in server.log}
    assert "[1] Compute 2+3, the first factor." in sent[("tw1_spans", "t1")]
    assert sent[("tw2_threads", "t1")].endswith("Spans: paragraphs 1-2")
    assert sent[("tw5_validate", "t1")].endswith("Trajectory:\n" + T1_EXPECTED)

    assert list(status(out)["stages"]) == ["tasks", "teacher", "filter", *STEPS, "reformat"]
    # a rerun sends nothing and writes the same bytes
    before, received = outputs(out), server.n_received()
    again = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert server.n_received() == received and again["run"]["calls_made"] == 0
    assert outputs(out) == before
    for f in (f for f in out.rglob("*") if f.is_file()):
        assert SECRET.encode() not in f.read_bytes(), f


def test_the_other_rejections_of_each_step():
    """Every reason `REASONS` names, on a small trace, straight through `tw_rewrite.check`."""
    task = Task("x", "math", "[x] Compute (5+6)*(7+8).", "165")
    trace = Trace("x", "First. 5 + 6 = 11.\n\nSecond. 7 + 8 = 15.\n\nMultiply. 11 * 15 = 165.\n\nSo \\boxed{165}.",
                  "165", "t")
    p1 = {"tw1_spans": {"spans": [[1, 2]]}}
    p2 = {**p1, "tw2_threads": {"blocks": [[[1], [2]]]}}
    p3 = {**p2, "tw3_rewrite": {"blocks": [["5 + 6 = 11.", "7 + 8 = 15."]]}}
    p4 = {**p3, "tw4_outlines": {"blocks": [["Add 5 and 6.", "Add 7 and 8."]]}}
    doc = tw.render_completion(tw_rewrite.assemble(trace, p4))
    spans = lambda *s: json.dumps({"spans": [{"first": a, "last": b, "reason": ""} for a, b in s]})  # noqa: E731
    blocks = lambda key, *b: json.dumps({"blocks": [{key: x} for x in b]})  # noqa: E731
    cases = [
        ("tw1_spans", {}, spans([1, 2]), "length", "truncated"),
        ("tw1_spans", {}, "not json", "stop", "malformed"),
        ("tw1_spans", {}, json.dumps({"spans": [{"first": 1}]}), "stop", "malformed"),
        ("tw1_spans", {}, spans([2, 1]), "stop", "bad_span"),
        ("tw1_spans", {}, spans([1, 2], [2, 3]), "stop", "bad_span"),
        ("tw1_spans", {}, spans([3, 3]), "stop", "bad_span"),
        ("tw2_threads", p1, blocks("threads", [[1], [2]], [[3], [4]]), "stop", "wrong_count"),
        ("tw2_threads", p1, blocks("threads", [[1, 2]]), "stop", "single_thread"),
        ("tw2_threads", p1, blocks("threads", [[1], [2], []]), "stop", "bad_partition"),
        ("tw3_rewrite", p2, blocks("threads", ["5 + 6 = 11."]), "stop", "wrong_count"),
        ("tw3_rewrite", p2, blocks("threads", ["5 + 6 = 11.", " "]), "stop", "empty_text"),
        ("tw3_rewrite", p2, blocks("threads", ["5 + 6 = 11.", "<Thread>7 + 8 = 15."]), "stop", "tag_in_text"),
        ("tw3_rewrite", p2, blocks("threads", ["5 + 6 = 11.", "<Plan_1> 7 + 8 = 15."]), "stop", "tag_in_text"),
        ("tw3_rewrite", p2, blocks("threads", ["5 + 6 = 11.", "Add 7 and 8."]), "stop", "lost_result"),
        ("tw4_outlines", p3, blocks("outlines", ["a"], ["b"]), "stop", "wrong_count"),
        ("tw4_outlines", p3, blocks("outlines", ["a", ""]), "stop", "empty_text"),
        ("tw4_outlines", p3, blocks("outlines", ["a", "</Outline>"]), "stop", "tag_in_text"),
        ("tw5_validate", p4, doc.replace("</Thread>", "", 1), "stop", "malformed"),
        ("tw5_validate", p4, doc.replace("\n</think>\n165", ""), "stop", "malformed"),
        ("tw5_validate", p4, doc.replace("</think>\n165", "</think>\n166"), "stop", "answer_wrong"),
        ("tw5_validate", p4, doc.replace("</think>\n165", "</think>\n165.0"), "stop", "answer_changed"),
        ("tw5_validate", p4, doc.replace("7 + 8 = 15.", "7 + 8 = 15, and 11 * 15 = 165."), "stop",
         "sibling_dependency"),
        ("tw5_validate", p4, doc, "length", "truncated"),
    ]
    for step, prior in (("tw2_threads", p1), ("tw3_rewrite", p2), ("tw4_outlines", p3)):
        cases += [(step, prior, '{"blocks": [{"text": "x"}]}', "stop", "malformed"),
                  (step, prior, "", "length", "truncated")]
    seen = {s: set() for s in STEPS}
    for step, prior, content, finish, reason in cases:
        with pytest.raises(tw_rewrite.StepRejected) as e:
            tw_rewrite.check(step, task, trace, prior, content, finish)
        assert e.value.reason == reason, (step, content, e.value)
        seen[step].add(reason)
    seen["tw1_spans"].add("no_span")                     # in the run above
    seen["tw3_rewrite"].add("sibling_dependency")
    seen["tw4_outlines"].add("outline_gives_result")
    seen["tw5_validate"].add("structure_changed")
    assert seen == {s: set(r) for s, r in tw_rewrite.REASONS.items()}
    # a trace of one paragraph is rejected before any call
    with pytest.raises(tw_rewrite.StepRejected, match="no_span"):
        tw_rewrite.messages("tw1_spans", task, Trace("x", "5 + 6 = 11, 7 + 8 = 15, 11 * 15 = 165.", "165", "t"), {})
    # the accepted trajectory, re-rendered canonically with the trace's answer
    assert tw_rewrite.check("tw5_validate", task, trace, p4, doc.replace("\n", "\n\n", 3), "stop") == {
        "completion": doc, "widths": [2]}


def test_interrupted_between_a_paid_reply_and_its_check_then_resumed_pays_nothing_twice(server, tmp_path,
                                                                                         monkeypatch):
    """Steps run up to step 3 only, then a run interrupted while checking its first step-4 reply
    (the replies are stored; nothing was checked), then a full run: every request is sent once."""
    expected = reference(tmp_path, monkeypatch)
    out = tmp_path / "run"
    first = ["tasks", "teacher", "filter", "tw1_spans", "tw2_threads", "tw3_rewrite"]
    run_pipeline(make_cfg(server, tmp_path), out, stages=first, progress=False)
    assert server.n_received() == sum(v for k, v in PAID.items() if k not in ("tw4_outlines", "tw5_validate"))
    real = tw_rewrite.check

    def interrupted(step, *a):
        if step == "tw4_outlines":
            raise KeyboardInterrupt
        return real(step, *a)
    monkeypatch.setattr(tw_rewrite, "check", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert server.n_received() == 9 + 8 + 6 + 5 + 4                     # step 4's replies came and are stored
    monkeypatch.setattr(tw_rewrite, "check", real)
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert report["run"]["cache_hits"] == 4 and report["run"]["calls_made"] == PAID["tw5_validate"]
    assert server.n_received() == 35 and max(server.received.values()) == 1
    assert outputs(out) == expected


@pytest.mark.slow
def test_killed_during_step_three_then_resumed(tmp_path, monkeypatch):
    """A real `sprint-jax curate` process SIGKILLed as its 25th request (t2's step-3 call, the 2nd
    of step 3) arrives, then resumed: the requests of the steps done before are not sent again,
    and the outputs are those of an uninterrupted run."""
    expected = reference(tmp_path, monkeypatch)
    with FakeOpenAIServer(TWCurator(), api_key=SECRET) as srv:
        data = tw_data(srv.base_url, tmp_path)
        cfg_path, out = curate_killed_at(srv, data, tmp_path, 25)
        killed = srv.log[24].body
        assert TWCurator.step_of(killed) == "tw3_rewrite" and srv.script.task_id(killed) == "t2"
        done_before = {r.hash for r in srv.log[:24]}
        report = run_pipeline(load_config(CurateConfig, cfg_path), out, progress=False)
        # the resumed run pays for t2's step 3 and what follows; t1's step-3 reply comes from the store
        assert report["run"]["calls_made"] == 35 - 24 and report["run"]["cache_hits"] == 1
        assert all(srv.received[h] == 1 for h in done_before)
        assert srv.n_received() == 36 and sum(srv.answered.values()) == 35 and max(srv.answered.values()) == 1
    assert outputs(out) == expected


def test_config_selects_the_five_steps(tmp_path):
    from sprint_jax.config import ConfigError

    with pytest.raises(ConfigError, match="rewriter.model is required when restructure is threadweaver_rewrite"):
        load_config(CurateConfig, None, ["restructure=threadweaver_rewrite"])
    cfg = load_config(CurateConfig, None, ["restructure=threadweaver_rewrite", "rewriter.model=m", "tasks.n=2"])
    fp = data_fingerprint(cfg)
    assert fp["restructure"] == "threadweaver_rewrite" and "rewriter" in fp and "extractor" not in fp
    # the programmatic teacher needs no key: tasks and traces of a run; a store of another path refuses it
    run_pipeline(cfg, tmp_path / "run", stages=["tasks", "teacher", "filter"], progress=False)
    assert status(tmp_path / "run")["stages"]["tw1_spans"]["pending"] == 2
    from sprint_jax.errors import UserError
    with pytest.raises(UserError, match="differs in: restructure"):
        run_pipeline(load_config(CurateConfig, None, ["restructure=rewrite", "rewriter.model=m", "tasks.n=2"]),
                     tmp_path / "run", stages=["tasks"], progress=False)
    write_tasks(tmp_path / "unused.jsonl")      # (the rewrite tests' task file writer is shared)
    assert len(TASKS) == 9
