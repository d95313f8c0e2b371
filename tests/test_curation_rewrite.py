"""`restructure: rewrite`: the teacher LLM rewrites each correct serial trace into SPRINT tags
(curation/rewrite.py), against the real HTTP server on 127.0.0.1 that the pipeline tests use,
driven by the real openai client. One run covers an accepted rewrite and every rejection reason;
then reruns, an endpoint that drops out, a killed process, stage-by-stage runs, and the number test
that catches an executor using its sibling's result."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fake_openai_server import CURATION_TASKS, Fault, FakeOpenAIServer, Reply, ScriptedCurator
from test_curation_pipeline import KEY_ENV, REPO, SECRET, config_data, outputs, records
from sprint_jax.config import ConfigError, load_config
from sprint_jax.curation.config import CurateConfig, data_fingerprint
from sprint_jax.curation.pipeline import DB_NAME, run_pipeline, status
from sprint_jax.curation.rewrite import REASONS, SYSTEM_PROMPT, first_uses, numbers, sibling_dependencies
from sprint_jax.curation.store import Store
from sprint_jax.errors import UserError
from sprint_jax.format import Prompt, Stage, Trajectory, parse_completion

# t1-t4 as in the pipeline tests (t4's teacher answer is wrong), and five more; the teacher writes
# every trace from its steps (fake_openai_server.trace_text).
TASKS = CURATION_TASKS + [
    dict(id="t5", problem="[t5] Compute (7+6)*11 + 8.", answer="151", final="151",
         steps=[("Add 7 and 6.", "7 + 6 = 13."), ("Multiply by 11.", "13 * 11 = 143."), ("Add 8.", "143 + 8 = 151.")]),
    dict(id="t6", problem="[t6] Compute (1+2)*(3+4).", answer="21", final="21",
         steps=[("First factor.", "1 + 2 = 3."), ("Second factor.", "3 + 4 = 7."), ("Multiply.", "3 * 7 = 21.")]),
    dict(id="t7", problem="[t7] Compute (6+7)*(8+9).", answer="221", final="221",
         steps=[("First factor.", "6 + 7 = 13."), ("Second factor.", "8 + 9 = 17."), ("Multiply.", "13 * 17 = 221.")]),
    dict(id="t8", problem="[t8] Compute (10+20)*(30+40).", answer="2100", final="2100",
         steps=[("First factor.", "10 + 20 = 30."), ("Second factor.", "30 + 40 = 70."), ("Multiply.", "30 * 70 = 2100.")]),
    dict(id="t9", problem="[t9] Compute (5+5)*(6+6).", answer="120", final="120",
         steps=[("First factor.", "5 + 5 = 10."), ("Second factor.", "6 + 6 = 12."), ("Multiply.", "10 * 12 = 120.")]),
]


def two_factors(a: str, b: str, product: str, final: str) -> str:
    return (f"<Plan_1> <prompt_1.1> First factor. </prompt_1.1> <prompt_1.2> Second factor. </prompt_1.2> </Plan_1>\n"
            f"<execution_1.1> {a} </execution_1.1>\n<execution_1.2> {b} </execution_1.2>\n"
            f"<Plan_2> <prompt_2.1> Multiply. </prompt_2.1> </Plan_2>\n<execution_2.1> {product} </execution_2.1>\n"
            f"<Final Answer> {final} </Final Answer>")


# What the rewriter answers, per task (t4 never gets there: the filter drops it).
REWRITES = {
    # accepted; loose whitespace and a boxed answer, which the stored example writes canonically
    "t1": ("<Plan_1>\n  The factors are independent.\n  <prompt_1.1>Compute 2+3, the first factor.</prompt_1.1>\n"
           "  <prompt_1.2>Compute 4+5, the second factor.</prompt_1.2>\n</Plan_1>\n\n"
           "<execution_1.1>2 + 3 = 5, so the first factor is 5.</execution_1.1>\n"
           "<execution_1.2>4 + 5 = 9, so the second factor is 9.</execution_1.2>\n"
           "<Plan_2><prompt_2.1>Multiply the two factors.</prompt_2.1></Plan_2>\n"
           "<execution_2.1>5 * 9 = 45, which is the product asked for.</execution_2.1>\n"
           "<Final Answer>\\boxed{45}</Final Answer>\n"),
    # accepted, inside a ``` fence; three executions in one stage
    "t2": ("```\n<Plan_1> Note that a = 2. <prompt_1.1> Evaluate a+1. </prompt_1.1> <prompt_1.2> Evaluate a+2. "
           "</prompt_1.2> <prompt_1.3> Evaluate a+3. </prompt_1.3> </Plan_1>\n"
           "<execution_1.1> a + 1 = 2 + 1 = 3. </execution_1.1>\n<execution_1.2> a + 2 = 2 + 2 = 4. </execution_1.2>\n"
           "<execution_1.3> a + 3 = 2 + 3 = 5. </execution_1.3>\n"
           "<Plan_2> <prompt_2.1> Add the three terms. </prompt_2.1> </Plan_2>\n"
           "<execution_2.1> 3 + 4 + 5 = 12. </execution_2.1>\n<Final Answer> 12 </Final Answer>\n```"),
    # a chain: one execution per stage
    "t3": ("<Plan_1> <prompt_1.1> Double 1. </prompt_1.1> </Plan_1>\n<execution_1.1> 1 * 2 = 2. </execution_1.1>\n"
           "<Plan_2> <prompt_2.1> Double again. </prompt_2.1> </Plan_2>\n<execution_2.1> 2 * 2 = 4. </execution_2.1>\n"
           "<Plan_3> <prompt_3.1> Add 1. </prompt_3.1> </Plan_3>\n<execution_3.1> 4 + 1 = 5. </execution_3.1>\n"
           "<Final Answer> 5 </Final Answer>"),
    # execution 1.2 multiplies 13, which only execution 1.1 computes
    "t5": ("<Plan_1> <prompt_1.1> Compute 7+6. </prompt_1.1> <prompt_1.2> Multiply the sum by 11. </prompt_1.2> </Plan_1>\n"
           "<execution_1.1> 7 + 6 = 13. </execution_1.1>\n<execution_1.2> 13 * 11 = 143. </execution_1.2>\n"
           "<Plan_2> <prompt_2.1> Add 8. </prompt_2.1> </Plan_2>\n<execution_2.1> 143 + 8 = 151. </execution_2.1>\n"
           "<Final Answer> 151 </Final Answer>"),
    "t6": two_factors("1 + 2 = 3.", "3 + 4 = 7.", "3 * 7 = 21.", "21.0"),          # right, but not "21"
    "t7": two_factors("6 + 7 = 13.", "8 + 9 = 17.", "13 * 17 = 221.", "220"),       # wrong
    # two prompts, one execution
    "t8": ("<Plan_1> <prompt_1.1> First factor. </prompt_1.1> <prompt_1.2> Second factor. </prompt_1.2> </Plan_1>\n"
           "<execution_1.1> 10 + 20 = 30. </execution_1.1>\n"
           "<Plan_2> <prompt_2.1> Multiply. </prompt_2.1> </Plan_2>\n<execution_2.1> 30 * 70 = 2100. </execution_2.1>\n"
           "<Final Answer> 2100 </Final Answer>"),
    "t9": Reply("<Plan_1> <prompt_1.1> First", finish_reason="length"),
}

# Written by hand from docs/design.md "The SPRINT format": canonical whitespace, the trace's answer.
T1_EXPECTED = (
    "<Plan_1> The factors are independent. <prompt_1.1> Compute 2+3, the first factor. </prompt_1.1> "
    "<prompt_1.2> Compute 4+5, the second factor. </prompt_1.2> </Plan_1>\n"
    "<execution_1.1> 2 + 3 = 5, so the first factor is 5. </execution_1.1>\n"
    "<execution_1.2> 4 + 5 = 9, so the second factor is 9. </execution_1.2>\n"
    "<Plan_2> <prompt_2.1> Multiply the two factors. </prompt_2.1> </Plan_2>\n"
    "<execution_2.1> 5 * 9 = 45, which is the product asked for. </execution_2.1>\n"
    "<Final Answer> 45 </Final Answer>")

REJECTED = {"t3": "no_parallelism", "t5": "sibling_dependency", "t6": "answer_changed", "t7": "answer_wrong",
            "t8": "malformed", "t9": "truncated"}
assert sorted(REJECTED.values()) == sorted(REASONS)        # every reason the check names has its case here


class RewriteCurator(ScriptedCurator):
    """ScriptedCurator, plus the rewriter: a request whose system prompt is the rewrite prompt."""

    def __init__(self):
        super().__init__(TASKS)
        self.rewrites = dict(REWRITES)

    @staticmethod
    def is_rewrite(body: dict) -> bool:
        return body["messages"][0]["content"] == SYSTEM_PROMPT

    def __call__(self, body: dict):
        if self.is_rewrite(body):
            return self.rewrites[self.task_id(body)]
        return super().__call__(body)


def write_tasks(path: Path) -> Path:
    with open(path, "w") as f:
        for t in TASKS:
            f.write(json.dumps({"problem": t["problem"], "answer": t["answer"], "unique_id": t["id"]}) + "\n")
    return path


def rewrite_data(base_url: str, tmp_path: Path) -> dict:
    data = config_data(base_url, write_tasks(tmp_path / "tasks.jsonl"))
    endpoint = {k: v for k, v in data["teacher"].items() if k != "kind"}
    return {**data, "restructure": "rewrite", "rewriter": {**endpoint, "model": "fake-rewriter"}}


def make_cfg(srv: FakeOpenAIServer, tmp_path: Path, *overrides: str) -> CurateConfig:
    return load_config(CurateConfig, None, list(overrides), data=rewrite_data(srv.base_url, tmp_path))


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with FakeOpenAIServer(RewriteCurator(), api_key=SECRET) as srv:
        yield srv


def reference(tmp_path: Path, monkeypatch) -> dict:
    """Outputs of an uninterrupted, fault-free run on its own server."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    with FakeOpenAIServer(RewriteCurator(), api_key=SECRET) as srv:
        run_pipeline(make_cfg(srv, tmp_path), tmp_path / "reference", progress=False)
    return outputs(tmp_path / "reference")


def test_rewrite_run_keeps_good_rewrites_and_names_every_rejection(server, tmp_path):
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)

    assert report["counts"] == {"tasks": 9, "teacher": 9, "filter": 8, "rewrite": 2, "reformat": 2,
                                "sprint_examples": 2, "rft_examples": 2}
    assert report["discards"] == {"filter": {"incorrect": 1},
                                  "rewrite": {r: 1 for r in REJECTED.values()}}
    with Store(out / DB_NAME) as st:
        assert {tid: st.failure(tid, "rewrite")["reason"] for tid in REJECTED} == REJECTED
        assert st.failure("t5", "rewrite")["detail"] == "execution 1.2 uses 13, a result of execution 1.1"
        assert "<prompt_1.2> has no <execution_1.2>" in st.failure("t8", "rewrite")["detail"]
    # paid calls: 9 teacher + 8 rewriter (not t4), each answered once
    assert {k: v["calls"] for k, v in report["llm"].items()} == {"teacher": 9, "rewrite": 8, "total": 17}
    assert sum(server.answered.values()) == 17 and max(server.answered.values()) == 1
    assert report["llm"]["total"]["total_tokens"] == server.usage_total()
    sent = {server.script.task_id(r.body): r.body["messages"][1]["content"] for r in server.log
            if RewriteCurator.is_rewrite(r.body)}
    assert sorted(sent) == ["t1", "t2", "t3", "t5", "t6", "t7", "t8", "t9"]
    assert "[t1] Compute (2+3)*(4+5)." in sent["t1"] and "5 * 9 = 45" in sent["t1"]   # problem and trace

    sprint = records(out, "sprint")
    assert [r["id"] for r in sprint] == ["t1", "t2"]
    assert sprint[0]["completion"] == T1_EXPECTED
    assert sprint[0]["meta"] == {"task_id": "t1", "task_kind": "math", "teacher": "openai:fake-teacher",
                                 "restructure": "rewrite", "rewriter": "fake-rewriter", "n_stages": 2,
                                 "widths": [2, 1]}
    traj, problems = parse_completion(sprint[1]["completion"])
    assert problems == [] and [len(s.executions) for s in traj.stages] == [3, 1]
    assert traj.stages[0].executions[2] == "a + 3 = 2 + 3 = 5." and traj.final_answer == "12"
    assert sprint[1]["meta"]["widths"] == [3, 1]
    assert [r["id"] for r in records(out, "rft")] == ["t1", "t2"]        # rft_source: sprint
    # stages and prompts per example, counted by hand: t1 plans of 2 and 1 prompts, t2 of 3 and 1
    assert report["shape"] == {"examples": 2, "stages": {"max": 2, "p99": 2, "histogram": {"2": 2}},
                               "prompts": {"max": 3, "p99": 3, "histogram": {"2": 1, "3": 1}}}

    # `status` reads the run's stages from its store
    got = status(out)
    assert list(got["stages"]) == ["tasks", "teacher", "filter", "rewrite", "reformat"]
    assert got["stages"]["rewrite"] == {"kept": 2, "discarded": 6, "pending": 0}

    # a rerun sends nothing and writes the same bytes
    before, received = outputs(out), server.n_received()
    again = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert server.n_received() == received and again["run"]["calls_made"] == 0
    assert outputs(out) == before

    # the key is in no file of the run (the store, its WAL, the outputs, the report)
    files = [f for f in out.rglob("*") if f.is_file()]
    assert any(f.name == DB_NAME for f in files)
    for f in files:
        assert SECRET.encode() not in f.read_bytes(), f


def test_endpoint_down_then_resumed_equals_one_run(server, tmp_path, monkeypatch):
    expected = reference(tmp_path, monkeypatch)
    script = server.script
    server.add_fault(Fault(status=500), lambda b: script.is_rewrite(b) and script.task_id(b) in ("t1", "t5"), times=4)
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path, "rewriter.max_retries=1"), out, progress=False)
    assert report["discards"]["rewrite"]["api_error"] == 2 and report["counts"]["sprint_examples"] == 1
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert report["run"]["calls_made"] == 2 and "api_error" not in report["discards"]["rewrite"]
    assert outputs(out) == expected
    assert max(server.answered.values()) == 1

    # stage by stage, into a new directory, on the same server (every answer now from nowhere but it)
    staged = tmp_path / "staged"
    for stage in ("tasks", "teacher", "filter", "rewrite", "reformat"):
        assert run_pipeline(make_cfg(server, tmp_path), staged, stages=[stage], progress=False)[
            "stages"][stage]["pending"] == 0
    assert outputs(staged) == expected


@pytest.mark.slow
def test_killed_during_rewrites_then_resumed(tmp_path, monkeypatch):
    """A real `sprint-jax curate` process SIGKILLed as its 12th request (the 3rd rewrite) arrives,
    then resumed: no request answered twice, and the outputs of an uninterrupted run."""
    expected = reference(tmp_path, monkeypatch)
    with FakeOpenAIServer(RewriteCurator(), api_key=SECRET) as srv:
        data = rewrite_data(srv.base_url, tmp_path)
        cfg_path, out = curate_killed_at(srv, data, tmp_path, 12)
        assert RewriteCurator.is_rewrite(srv.log[11].body) and srv.script.task_id(srv.log[11].body) == "t3"
        report = run_pipeline(load_config(CurateConfig, cfg_path), out, progress=False)
        # the resumed run pays for the rewrites not yet answered; t1's and t2's come from the store
        assert report["run"]["calls_made"] == 6 and report["run"]["cache_hits"] == 2
        # 17 paid calls, the one the kill cut off sent twice, none answered twice
        assert srv.n_received() == 18 and sum(srv.answered.values()) == 17 and max(srv.answered.values()) == 1
    assert outputs(out) == expected
    for f in out.iterdir():
        assert SECRET.encode() not in f.read_bytes(), f


def stage(index: int, prompts: list[str], executions: list[str], text: str = "") -> Stage:
    return Stage(index, ([text] if text else []) + [Prompt(p) for p in prompts], executions)


def test_sibling_dependency_check():
    """What the number test catches and what it lets through (rewrite.sibling_dependencies)."""
    query = "Compute (7+6)*11 + 8."
    assert numbers("1,000 and 45.0, x2, t1, 3.25 and 12.") == {"1000", "45", "3.25", "12"}
    assert first_uses("13 * 11 = 143, and 143 + 1 is 144; so x = -5 and y = \\boxed{7}") == {
        "13": False, "11": False, "143": True, "1": False, "144": True, "5": True, "7": True}

    def deps(*stages: Stage) -> list:
        return sibling_dependencies(query, Trajectory(stages=list(stages), final_answer="151"))

    # 1.2 uses the 13 that 1.1 derives
    assert deps(stage(1, ["Add 7 and 6.", "Multiply the sum by 11."], ["7 + 6 = 13.", "13 * 11 = 143."])) == [
        (1, 2, "13", 1)]
    # the same work is fine when the plan gives 13, or when 13 comes from an earlier stage
    assert deps(stage(1, ["Add 7 and 6.", "Multiply 13 by 11."], ["7 + 6 = 13.", "13 * 11 = 143."])) == []
    assert deps(stage(1, ["Add 7 and 6."], ["7 + 6 = 13."]),
                stage(2, ["Multiply by 11.", "Note the 8."], ["13 * 11 = 143.", "8 is added last."])) == []
    # both derive the same number, or both only use a constant: no one's result is taken
    assert deps(stage(1, ["a", "b"], ["7 + 6 = 13.", "6 + 7 = 13 as well."])) == []
    assert deps(stage(1, ["a", "b"], ["A triangle has 180 degrees.", "180 - 11 leaves 169."])) == []
    # blind spots, documented: a number the query already holds, and a result stated without a marker
    assert deps(stage(1, ["a", "b"], ["7 + 1 = 8.", "8 * 11 = 88."])) == []
    assert deps(stage(1, ["a", "b"], ["The sum: 13.", "13 * 11 = 143."])) == []


def test_config_selects_the_path_and_the_default_is_unchanged(tmp_path, monkeypatch, capsys):
    from sprint_jax.cli import main

    default = load_config(CurateConfig, None, [])
    assert default.restructure == "dag"
    # a `dag` run's fingerprint is what it was before `restructure` existed: old stores still resume
    assert set(data_fingerprint(default)) == {"tasks", "teacher", "extractor", "dag", "merge_min_chars",
                                              "min_ratio", "rft_source", "seed"}
    with pytest.raises(ConfigError, match="rewriter.model is required when restructure is rewrite"):
        load_config(CurateConfig, None, ["restructure=rewrite"])
    with pytest.raises(ConfigError, match="restructure"):
        load_config(CurateConfig, None, ["restructure=threads"])
    cfg = load_config(CurateConfig, REPO / "configs" / "curate_math_rewrite_openai.yaml", [])
    assert cfg.restructure == "rewrite" and cfg.rewriter.model

    cfg = load_config(CurateConfig, None, ["restructure=rewrite", "rewriter.model=m", "tasks.n=3"])
    with pytest.raises(UserError, match="stage extract is not part of restructure: rewrite"):
        run_pipeline(cfg, tmp_path / "run", stages=["extract"], progress=False)
    # the programmatic teacher needs no key: tasks and traces of a rewrite run, then its status
    run_pipeline(cfg, tmp_path / "run", stages=["tasks", "teacher", "filter"], progress=False)
    capsys.readouterr()
    assert main(["curate", "status", str(tmp_path / "run")]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.split()}
    assert rows["rewrite"] == ["0", "0", str(cfg.tasks.n)] and "extract" not in rows


def curate_killed_at(srv, data: dict, tmp_path: Path, n: int) -> tuple[Path, Path]:
    """Run a real `sprint-jax curate` of `data` (one request at a time) against `srv` and SIGKILL it
    as the server receives its n-th request; returns (the config's path, the run's out)."""
    data["teacher"]["concurrency"] = data["rewriter"]["concurrency"] = 1
    cfg_path = tmp_path / "curate_killed.yaml"
    cfg_path.write_text(yaml.safe_dump(data))
    pid = {}

    def on_receive(record) -> bool:
        if record.n != n:
            return False
        os.kill(pid["pid"], signal.SIGKILL)
        return True

    srv.on_receive = on_receive
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "sprint_jax.cli", "curate", "--config", str(cfg_path),
                             "--out", str(out), "--no-progress"], cwd=REPO, env={**os.environ, KEY_ENV: SECRET},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid["pid"] = proc.pid
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, stderr
    return cfg_path, out
