"""The whole curation pipeline (paper §4-5) against a real HTTP server on 127.0.0.1 driven by the
real openai client: the happy path, then injected 429s / 500s / timeouts / dropped connections,
invalid JSON with a repair turn, cyclic and forward edges under both policies, an endpoint that
stays down, refused keys, and the offline curator on generated Countdown."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_openai_server import CURATION_TASKS, Fault, FakeOpenAIServer, Reply, ScriptedCurator, write_math_jsonl
from sprint_jax.errors import UserError
from sprint_jax.config import ConfigError, load_config
from sprint_jax.curation.config import CurateConfig
from sprint_jax.curation.pipeline import DB_NAME, run_pipeline, status
from sprint_jax.curation.store import Store
from sprint_jax.format import parse_completion

KEY_ENV = "SPRINT_JAX_FAKE_KEY"
SECRET = "sk-fake-never-written-2718281828"
REPO = Path(__file__).resolve().parents[1]


def config_data(base_url: str, tasks_path: Path, **extra) -> dict:
    endpoint = dict(base_url=base_url, api_key_env=KEY_ENV, max_retries=3, timeout_s=5.0,
                    backoff_base_s=0.01, backoff_max_s=0.05, concurrency=2, max_tokens=512)
    data = {
        "tasks": {"source": "file", "path": str(tasks_path)},
        "teacher": {"kind": "openai", "model": "fake-teacher", **endpoint},
        "extractor": {"kind": "llm", "model": "fake-extractor", **endpoint},
        "dag": {"kind": "llm", "model": "fake-dag", **endpoint, "invalid_edge_policy": "drop"},
        "merge_min_chars": 20, "min_ratio": 1.5,
    }
    for key, value in extra.items():
        node = data
        *parents, last = key.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return data


def make_cfg(srv: FakeOpenAIServer, tmp_path: Path, overrides: tuple[str, ...] = (), **extra) -> CurateConfig:
    tasks_path = tmp_path / "tasks.jsonl"
    if not tasks_path.exists():
        write_math_jsonl(tasks_path)
    return load_config(CurateConfig, None, overrides, data=config_data(srv.base_url, tasks_path, **extra))


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with FakeOpenAIServer(ScriptedCurator(), api_key=SECRET) as srv:
        yield srv


def outputs(out: Path) -> dict:
    """Output files and the report, less what legitimately differs between runs that did the same
    work: the per-run section and the number of HTTP attempts (retries) behind each paid call."""
    report = json.loads((out / "curation_report.json").read_text())
    report.pop("run")
    for totals in report["llm"].values():
        totals.pop("attempts")
    return {"sprint": (out / "sprint.jsonl").read_text(), "rft": (out / "rft.jsonl").read_text(),
            "report": report}


def records(out: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{kind}.jsonl").read_text().splitlines()]


def happy_outputs(tmp_path: Path, monkeypatch, **extra) -> dict:
    """Outputs of an uninterrupted, fault-free run (its own server) to compare against."""
    monkeypatch.setenv(KEY_ENV, SECRET)
    with FakeOpenAIServer(ScriptedCurator(), api_key=SECRET) as srv:
        run_pipeline(make_cfg(srv, tmp_path, **extra), tmp_path / "happy", progress=False)
    return outputs(tmp_path / "happy")


def test_happy_path_end_to_end(server, tmp_path):
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)

    # t1, t2 kept; t3 is a chain (rho = 1); t4's answer is wrong
    assert report["counts"] == {"tasks": 4, "teacher": 4, "filter": 3, "extract": 3, "dag": 3, "pack": 2,
                                "reformat": 2, "sprint_examples": 2, "rft_examples": 2}
    assert report["discards"] == {"filter": {"incorrect": 1}, "pack": {"ratio_below_min": 1}}
    assert report["ratio"]["histogram"]["[1.5,1.75)"] == 2 and report["ratio"]["histogram"]["[1,1.25)"] == 1
    assert report["ratio"]["n"] == 3 and report["ratio"]["max"] == pytest.approx(5 / 3)

    # paid calls: 4 teacher + 3 extractor + 3 DAG, each answered once; usage matches the server's
    assert sum(server.answered.values()) == 10 and max(server.answered.values()) == 1
    assert report["llm"]["total"]["calls"] == 10
    assert {k: v["calls"] for k, v in report["llm"].items()} == {"teacher": 4, "extract": 3, "dag": 3, "total": 10}
    assert report["llm"]["total"]["total_tokens"] == server.usage_total()

    sprint = records(out, "sprint")
    assert [r["id"] for r in sprint] == ["t1", "t2"] and all(r["kind"] == "sprint" for r in sprint)
    t1, t2 = sprint
    assert t1["completion"] == (  # written by hand from docs/design.md "The SPRINT format"
        "<Plan_1> <prompt_1.1> Compute 2+3, the first factor. </prompt_1.1> "
        "<prompt_1.2> Compute 4+5, the second factor. </prompt_1.2> </Plan_1>\n"
        "<execution_1.1> 2 + 3 = 5, so the first factor is 5. </execution_1.1>\n"
        "<execution_1.2> 4 + 5 = 9, so the second factor is 9. </execution_1.2>\n"
        "<Plan_2> <prompt_2.1> Multiply the two factors. </prompt_2.1> </Plan_2>\n"
        "<execution_2.1> 5 * 9 = 45, which is the product asked for. </execution_2.1>\n"
        "<Final Answer> 45 </Final Answer>")
    traj, problems = parse_completion(t1["completion"])
    assert problems == []
    # σ = [1, 1, 2]: stage 1 runs both factors in parallel, stage 2 multiplies
    assert [s.prompts for s in traj.stages] == [
        ["Compute 2+3, the first factor.", "Compute 4+5, the second factor."], ["Multiply the two factors."]]
    assert [s.executions for s in traj.stages] == [
        ["2 + 3 = 5, so the first factor is 5.", "4 + 5 = 9, so the second factor is 9."],
        ["5 * 9 = 45, which is the product asked for."]]
    assert "45" in traj.final_answer
    assert t1["prompt"] == CURATION_TASKS[0]["problem"] and t1["answer"] == "45"
    assert t1["meta"]["sigma"] == [1, 1, 2] and t1["meta"]["ratio"] == 1.5
    # the paper's 5-step example: {1: [1], 2: [2, 3, 4], 3: [5]}
    traj2, problems2 = parse_completion(t2["completion"])
    assert problems2 == [] and [len(s.executions) for s in traj2.stages] == [1, 3, 1]
    assert t2["meta"]["sigma"] == [1, 2, 2, 2, 3] and t2["meta"]["ratio"] == pytest.approx(5 / 3)

    rft = records(out, "rft")
    assert [r["id"] for r in rft] == ["t1", "t2"] and all(r["kind"] == "rft" for r in rft)
    assert "2 + 3 = 5" in rft[0]["completion"] and "45" in rft[0]["completion"]

    # a rerun pays nothing and writes the same bytes
    before = outputs(out)
    again = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert sum(server.answered.values()) == 10 and again["run"]["calls_made"] == 0
    assert outputs(out) == before

    # the key is in no file of the run
    for f in out.iterdir():
        assert SECRET.encode() not in f.read_bytes(), f


def test_rft_from_every_correct_trace(server, tmp_path):
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path, rft_source="correct"), out, progress=False)
    assert report["counts"]["sprint_examples"] == 2 and report["counts"]["rft_examples"] == 3
    assert [r["id"] for r in records(out, "rft")] == ["t1", "t2", "t3"]


def test_faults_are_retried_and_change_nothing(server, tmp_path, monkeypatch):
    expected = happy_outputs(tmp_path, monkeypatch)
    srv, script = server, server.script

    def is_(purpose, tid):
        return lambda b: script.purpose(b) == purpose and script.task_id(b) == tid

    srv.add_fault(Fault(status=429, headers={"Retry-After": "1"}), is_("teacher", "t1"))
    srv.add_fault(Fault(kind="drop"), is_("teacher", "t3"))
    srv.add_fault(Fault(status=500), is_("extract", "t2"), times=2)
    srv.add_fault(Fault(status=502, headers={"retry-after-ms": "30"}), is_("dag", "t2"))
    srv.add_fault(Fault(kind="hang", seconds=2.5), is_("dag", "t1"))
    out = tmp_path / "faulty"
    report = run_pipeline(make_cfg(srv, tmp_path, teacher__timeout_s=5.0, dag__timeout_s=1.0), out,
                          progress=False)
    assert outputs(out) == expected
    assert report["run"]["retries"] == 6 and report["run"]["calls_made"] == 10
    assert sum(srv.answered.values()) == 10 and max(srv.answered.values()) == 1
    teacher_t1 = [r for r in srv.log if is_("teacher", "t1")(r.body)]
    assert [r.outcome for r in teacher_t1] == ["status 429", "answered"]
    assert teacher_t1[1].t - teacher_t1[0].t >= 0.95          # Retry-After: 1 honoured
    assert report["llm"]["total"]["attempts"] == 16 and report["llm"]["total"]["calls"] == 10


def test_invalid_json_gets_one_repair_turn(server, tmp_path):
    script = server.script
    script.extract[("t1", 0)] = "Sure! Here are the steps: 1. add 2. multiply"
    script.extract[("t2", 0)] = '{"steps": [{"plan": "only a plan"}]}'                 # missing field
    script.extract[("t2", 1)] = '{"steps": "still wrong"'                               # broken JSON
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert [r["id"] for r in records(out, "sprint")] == ["t1"]           # repaired on the second turn
    assert report["discards"]["extract"] == {"invalid_json": 1}
    with Store(out / DB_NAME) as st:
        fail = st.failure("t2", "extract")
    assert fail["reason"] == "invalid_json" and fail["detail"]
    repair = [r.body for r in server.log if server.script.purpose(r.body) == "extract" and len(r.body["messages"]) > 2]
    assert len(repair) == 2
    t2_repair = next(b for b in repair if "[t2]" in b["messages"][1]["content"])
    assert t2_repair["messages"][2]["content"] == script.extract[("t2", 0)]
    assert "execution" in t2_repair["messages"][3]["content"] and "Field required" in t2_repair["messages"][3]["content"]
    assert report["llm"]["extract"]["calls"] == 5


BAD_EDGES = {
    "t1": [(1, 3), (2, 3), (3, 1)],                                        # 1 -> 3 -> 1: a cycle
    "t2": [(1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5), (4, 2), (2, 2), (1, 9)],  # forward, self-loop, unknown
}


def test_invalid_edges_dropped_and_counted(server, tmp_path, monkeypatch):
    expected = happy_outputs(tmp_path, monkeypatch)
    server.script.edges.update(BAD_EDGES)
    out = tmp_path / "drop"
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert report["dropped_edges"] == {"cycle": 1, "forward_edge": 1, "self_loop": 1, "unknown_step": 1}
    assert outputs(out)["sprint"] == expected["sprint"]                 # the valid edges are the happy ones
    with Store(out / DB_NAME) as st:
        dag = st.dag("t2")
    assert dag["edges"] == sorted(CURATION_TASKS[1]["edges"]) and len(dag["proposed"]) == 9


def test_invalid_edges_reject_the_trace(server, tmp_path):
    server.script.edges.update(BAD_EDGES)
    out = tmp_path / "reject"
    report = run_pipeline(make_cfg(server, tmp_path, dag__invalid_edge_policy="reject"), out, progress=False)
    assert report["discards"]["dag"] == {"cycle": 1, "forward_edge": 1}
    assert report["counts"]["sprint_examples"] == 0 and report["counts"]["dag"] == 1   # only t3 survives
    assert records(out, "sprint") == []


def test_endpoint_down_is_recorded_then_resumed(server, tmp_path, monkeypatch):
    expected = happy_outputs(tmp_path, monkeypatch)
    script = server.script
    server.add_fault(Fault(status=500), lambda b: script.purpose(b) == "teacher" and script.task_id(b) == "t2",
                     times=3)
    out = tmp_path / "run"
    report = run_pipeline(make_cfg(server, tmp_path, teacher__max_retries=2), out, progress=False)
    assert report["discards"]["teacher"] == {"api_error": 1}
    assert [r["id"] for r in records(out, "sprint")] == ["t1"]
    assert status(out)["stages"]["teacher"] == {"kept": 3, "discarded": 1, "pending": 0}
    # the endpoint is back: a rerun retries exactly the failed task and catches up
    report = run_pipeline(make_cfg(server, tmp_path), out, progress=False)
    assert report["run"]["calls_made"] == 3 and "teacher" not in report["discards"]
    assert outputs(out) == expected
    assert sum(server.answered.values()) == 10 and max(server.answered.values()) == 1


def test_stage_by_stage_equals_one_run(server, tmp_path, monkeypatch):
    expected = happy_outputs(tmp_path, monkeypatch)
    out = tmp_path / "staged"
    for stage in ("tasks", "teacher", "filter", "extract", "dag", "pack", "reformat"):
        report = run_pipeline(make_cfg(server, tmp_path), out, stages=[stage], progress=False)
        assert report["stages"][stage]["pending"] == 0
    assert outputs(out) == expected
    assert sum(server.answered.values()) == 10


def test_missing_key_names_the_variable(server, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ConfigError, match=f"{KEY_ENV}.*teacher.api_key_env"):
        run_pipeline(make_cfg(server, tmp_path), tmp_path / "run", progress=False)
    assert server.n_received() == 0


def test_wrong_key_stops_the_run_with_one_clear_error(server, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    with pytest.raises(UserError, match="HTTP 401"):
        run_pipeline(make_cfg(server, tmp_path), tmp_path / "run", progress=False)


def test_resume_with_a_different_config_is_refused(server, tmp_path):
    out = tmp_path / "run"
    run_pipeline(make_cfg(server, tmp_path), out, stages=["tasks", "teacher"], progress=False)
    # execution-only fields may change on resume ...
    run_pipeline(make_cfg(server, tmp_path, teacher__concurrency=1), out, stages=["filter"], progress=False)
    # ... fields that change the data may not
    with pytest.raises(UserError, match="teacher.temperature"):
        run_pipeline(make_cfg(server, tmp_path, teacher__temperature=0.7), out, progress=False)


def test_bad_config_fields_are_named(tmp_path):
    with pytest.raises(ConfigError, match="teacher: concurrency must be >= 1"):
        load_config(CurateConfig, None, ["teacher.concurrency=0"])
    with pytest.raises(ConfigError, match="dag.invalid_edge_policy"):
        load_config(CurateConfig, None, ["dag.invalid_edge_policy=ignore"])
    with pytest.raises(ConfigError, match="teacher.model is required"):
        load_config(CurateConfig, None, ["teacher.kind=openai"])
    with pytest.raises(ConfigError, match="tasks: path is required"):
        load_config(CurateConfig, None, ["tasks.source=file", "teacher.kind=openai", "teacher.model=m"])


def test_teacher_trace_with_sprint_tags_or_truncation_is_discarded(server, tmp_path):
    server.script.teacher["t1"] = "<Plan_1> injected </Plan_1> \\boxed{45}"
    server.script.teacher["t2"] = Reply("Let a = 2. Then a + 1 = 3 and", finish_reason="length")
    report = run_pipeline(make_cfg(server, tmp_path), tmp_path / "run", progress=False)
    assert report["discards"]["teacher"] == {"contains_sprint_tag": 1, "truncated": 1}
    assert report["counts"]["teacher"] == 2


@pytest.mark.slow
def test_cli_run_and_status(server, tmp_path, capsys, monkeypatch):
    """`sprint-jax curate` as a real subprocess; `status` and a missing key through the same entry point."""
    from sprint_jax.cli import main
    import yaml
    cfg_path = tmp_path / "curate_test.yaml"
    cfg_path.write_text(yaml.safe_dump(config_data(server.base_url, tmp_path / "tasks.jsonl")))
    write_math_jsonl(tmp_path / "tasks.jsonl")
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "curate", "--config", str(cfg_path),
                          "--out", str(out), "--set", "teacher.concurrency=1", "--no-progress"],
                         cwd=REPO, env={**os.environ, KEY_ENV: SECRET}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "sprint 2, rft 2" in run.stdout and SECRET not in run.stdout + run.stderr
    assert (out / "sprint.jsonl").exists() and (out / "curation_report.json").exists()

    capsys.readouterr()
    assert main(["curate", "status", str(out)]) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.split()}
    assert lines["teacher"] == ["4", "0", "0"] and lines["filter"] == ["3", "1", "0"]
    assert lines["pack"] == ["2", "1", "0"] and "LLM calls 10" in text

    monkeypatch.delenv(KEY_ENV)
    assert main(["curate", "--config", str(cfg_path), "--out", str(tmp_path / "nokey"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert KEY_ENV in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["curate", "status", str(tmp_path / "nowhere")]) == 2
    assert "no curation store" in capsys.readouterr().err


def test_offline_curator_on_countdown_end_to_end(tmp_path):
    """No endpoint: programmatic teacher + offline extractor + offline DAG on generated Countdown."""
    from sprint_jax.tasks.types import Task
    from sprint_jax.tasks import grade

    cfg = load_config(CurateConfig, REPO / "configs" / "curate_countdown_offline.yaml",
                      ["tasks.n=12", "tasks.seed=3"])
    report = run_pipeline(cfg, tmp_path / "a", progress=False)
    assert report["counts"]["tasks"] == 12 and report["counts"]["filter"] == 12      # the solver is right
    assert report["llm"]["total"]["calls"] == 0
    sprint, rft = records(tmp_path / "a", "sprint"), records(tmp_path / "a", "rft")
    assert len(sprint) == report["counts"]["sprint_examples"] >= 6 and len(rft) == len(sprint)
    for ex in sprint:
        task = Task(id=ex["id"], kind="countdown", problem="", answer=ex["answer"])
        traj, problems = parse_completion(ex["completion"])
        assert problems == [], (ex["id"], problems)
        assert grade(task, traj.final_answer), ex["id"]
        meta = ex["meta"]
        with Store(tmp_path / "a" / DB_NAME) as st:
            steps = st.steps(ex["id"])
        # σ recomputed here by the definition (docs/design.md "Curation"), independently of
        # packing.py
        sigma: dict[int, int] = {}
        for i in range(1, len(steps) + 1):
            parents = [p for p, c in meta["edges"] if c == i]
            sigma[i] = max((sigma[p] + (0 if steps[p - 1].plan_only else 1) for p in parents), default=1)
        assert meta["sigma"] == [sigma[i] for i in range(1, len(steps) + 1)]
        assert len(traj.stages) == meta["n_stages"] == len(set(sigma.values()))
        assert meta["ratio"] == pytest.approx(len(steps) / len(set(sigma.values()))) and meta["ratio"] >= 1.5
        for k, stage in enumerate(traj.stages, start=1):
            executing = [steps[i - 1] for i in sorted(sigma) if sigma[i] == k and not steps[i - 1].plan_only]
            assert stage.prompts == [s.plan for s in executing]
            assert stage.executions == [s.execution for s in executing]
        assert max(len(s.executions) for s in traj.stages) >= 2          # something runs in parallel
        assert ex["prompt"].startswith("A conversation between User and Assistant")
    for ex in rft:
        traj, _ = parse_completion(ex["completion"])
        assert traj.final_answer == next(s for s in sprint if s["id"] == ex["id"])["completion"].rsplit(
            "<Final Answer> ", 1)[1].removesuffix(" </Final Answer>")
    # deterministic: a second run writes the same bytes
    run_pipeline(cfg, tmp_path / "b", progress=False)
    assert outputs(tmp_path / "a") == outputs(tmp_path / "b")
