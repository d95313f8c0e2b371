"""Crash safety of curation (docs/design.md "Reliability contract"): a real `sprint-jax curate`
subprocess is SIGKILLed by the server the moment the N-th request reaches it, twice, then rerun to
the end.
Nothing may be answered twice, nothing may be lost, and the outputs must equal an uninterrupted
run's byte for byte."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from fake_openai_server import FakeOpenAIServer, ScriptedCurator, write_math_jsonl
from test_curation_pipeline import KEY_ENV, REPO, SECRET, config_data, make_cfg, outputs
from sprint_jax.curation.pipeline import DB_NAME, run_pipeline

# Rows that must be identical between a killed-and-resumed run and an uninterrupted one.
TABLES = {
    "tasks": "SELECT id, ord, kind, problem, answer FROM tasks ORDER BY id",
    "llm_calls": "SELECT hash, purpose, model, request, content, finish_reason, prompt_tokens,"
                 " completion_tokens FROM llm_calls ORDER BY hash",
    "traces": "SELECT * FROM traces ORDER BY task_id",
    "verdicts": "SELECT * FROM verdicts ORDER BY task_id",
    "steps": "SELECT * FROM steps ORDER BY task_id",
    "dags": "SELECT * FROM dags ORDER BY task_id",
    "packings": "SELECT * FROM packings ORDER BY task_id",
    "examples": "SELECT * FROM examples ORDER BY task_id, kind",
    "failures": "SELECT * FROM failures ORDER BY task_id, stage",
}


def dump(db: Path) -> dict:
    con = sqlite3.connect(db)
    try:
        return {name: con.execute(sql).fetchall() for name, sql in TABLES.items()}
    finally:
        con.close()


def script() -> ScriptedCurator:
    """t2's first extraction reply is not JSON, so its record needs two calls (answer + repair):
    a kill between them leaves a paid call whose record is unfinished, which only the call
    cache can save from being paid again."""
    s = ScriptedCurator()
    s.extract[("t2", 0)] = "Steps: first note a, then the three terms, then add."
    return s


@pytest.mark.slow
def test_killed_twice_then_resumed(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    write_math_jsonl(tmp_path / "tasks.jsonl")

    # the uninterrupted reference, on its own server
    with FakeOpenAIServer(script(), api_key=SECRET) as ref_srv:
        run_pipeline(make_cfg(ref_srv, tmp_path), tmp_path / "reference", progress=False)
    reference_hashes = set(ref_srv.answered)
    assert len(reference_hashes) == 11 and max(ref_srv.answered.values()) == 1

    with FakeOpenAIServer(script(), api_key=SECRET) as srv:
        cfg_path = tmp_path / "curate_resume.yaml"
        data = config_data(srv.base_url, tmp_path / "tasks.jsonl")
        for section in ("teacher", "extractor", "dag"):
            data[section]["concurrency"] = 1     # a deterministic request order to kill into
        cfg_path.write_text(yaml.safe_dump(data))
        out = tmp_path / "killed"

        pid: dict[str, int] = {}
        pid_known = threading.Event()
        # run 1 dies at the teacher call for t3 (#3); run 2 resends it (#4), does t4 (#5), extracts t1
        # (#6), gets t2's bad first reply (#7, paid and stored) and dies at t2's repair request (#8)
        kill_at = {3, 8}
        killed: list[str] = []

        def on_receive(record) -> bool:
            if record.n not in kill_at:
                return False
            assert pid_known.wait(30)
            os.kill(pid["pid"], signal.SIGKILL)
            killed.append(record.hash)
            return True       # never answered: the killed client could not have stored it

        srv.on_receive = on_receive
        cmd = [sys.executable, "-m", "sprint_jax.cli", "curate", "--config", str(cfg_path), "--out", str(out),
               "--no-progress"]
        codes, stdout = [], ""
        for _ in range(3):
            pid_known.clear()
            proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, KEY_ENV: SECRET},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            pid["pid"] = proc.pid
            pid_known.set()
            stdout, stderr = proc.communicate(timeout=120)
            codes.append(proc.returncode)
        assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0], stderr

    # the kills landed where intended: before any answer for those requests
    assert len(killed) == 2 and srv.n_received() == 13
    first, second = (srv.log[n - 1].body for n in sorted(kill_at))
    assert ScriptedCurator.purpose(first) == "teacher"
    assert ScriptedCurator.purpose(second) == "extract" and len(second["messages"]) == 4   # the repair turn
    # no request was answered twice, and exactly the uninterrupted run's requests were answered
    assert max(srv.answered.values()) == 1 and set(srv.answered) == reference_hashes
    # the two killed requests were each re-sent once and answered then; nothing else was re-sent
    assert {h for h, n in srv.received.items() if n > 1} == set(killed)
    assert all(srv.received[h] == 2 for h in killed)
    # the last run only paid for what the killed runs had not finished
    # (t2's repair, t3's extraction, three DAG calls; t2's first reply came from the store)
    assert "this run: 5 calls made, 1 answered from the store" in stdout
    # no record lost: the stores and the outputs match the uninterrupted run
    assert dump(out / DB_NAME) == dump(tmp_path / "reference" / DB_NAME)
    assert outputs(out) == outputs(tmp_path / "reference")
    for f in out.iterdir():
        assert SECRET.encode() not in f.read_bytes(), f
