"""Damaged lines in an eval directory: a line that still parses but is not what eval wrote (bytes
that are not UTF-8, a field of the wrong type, fields missing) is never kept by a resumed run: it
is dropped, said in one line, and its problem run again; `plan engine --records` refuses it in one
line."""
from __future__ import annotations

import json

from sprint_jax.cli import main
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.eval.report import untimed
from test_eval import ANSWERS, TASKS, _engine_for, _prompt, _sprint_engine


def _damage(out):
    """m1's record: invalid UTF-8 in its query; m2's record: stages not a list; m3's result: no kind
    nor mode; m4's result: a line that is not JSON (not the last). m5 is left whole."""
    records = (out / "records.jsonl").read_bytes().splitlines(keepends=True)
    results = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    first = json.loads(records[0])
    records[0] = json.dumps({**first, "query": "QUERY"}).encode().replace(b"QUERY", b"caf\xe9 \xff") + b"\n"
    records[1] = json.dumps({**json.loads(records[1]), "stages": "notalist"}).encode() + b"\n"
    third = json.loads(results[2])
    del third["kind"], third["mode"]
    results[2] = json.dumps(third).encode() + b"\n"
    results[3] = b'{"id": "m4", "correct": tru\n'
    (out / "records.jsonl").write_bytes(b"".join(records))
    (out / "results.jsonl").write_bytes(b"".join(results))


def test_a_resumed_eval_redoes_damaged_lines_and_says_so(tmp_path, capsys):
    full, _ = evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    whole = (tmp_path / "results.jsonl").read_text().splitlines()[4]
    _damage(tmp_path)
    engine = _engine_for(ANSWERS[:4])                 # scripted for m1..m4 alone: m5 must not run
    results, report = evaluate(engine, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 damaged line(s)" in err[0] and "run again" in err[0], err
    assert "records.jsonl:1: not valid UTF-8" in err[0] or "results.jsonl:3" in err[0], err
    assert report["resumed_problems"] == 1
    assert [untimed(r) for r in results] == [untimed(r) for r in json.loads(json.dumps(full))]
    on_disk = (tmp_path / "results.jsonl").read_text().splitlines()
    assert whole in on_disk                            # m5 kept as written
    rows = [json.loads(x) for x in on_disk]
    records = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in records) == sorted(t.id for t in TASKS)
    assert all(r["kind"] and r["mode"] == "parallel" for r in rows)
    assert all(isinstance(r["stages"], list) and "\ufffd" not in r["query"] for r in records)
    # resumed again: nothing is damaged, nothing runs
    idle = _engine_for([])
    evaluate(idle, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    assert idle.calls == [] and capsys.readouterr().err == ""


def test_a_result_whose_tokens_differ_from_its_record_is_redone(tmp_path, capsys):
    evaluate(_sprint_engine(), TASKS[:2], "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    results = (tmp_path / "results.jsonl").read_text().splitlines()
    row = json.loads(results[1])
    row["total_tokens"] += 1
    (tmp_path / "results.jsonl").write_text(results[0] + "\n" + json.dumps(row) + "\n")
    engine = _engine_for(ANSWERS[1:2])
    again, _ = evaluate(engine, TASKS[:2], "parallel", prompt_fn=_prompt, out_dir=tmp_path, progress=False)
    assert engine.calls and again[1]["total_tokens"] == row["total_tokens"] - 1
    assert "1 damaged line(s)" in capsys.readouterr().err


def test_plan_records_refuses_a_damaged_record_in_one_line(tmp_path, capsys):
    evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "e", progress=False)
    _damage(tmp_path / "e")
    flags = ["plan", "engine", "--model", "r1-distill-qwen-7b", "--topology", "v5e:2x2", "--concurrency", "8",
             "--executors", "8", "--capacity", "1024", "--records", str(tmp_path / "e")]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records.jsonl:1: not an eval record" in err[0] and "Traceback" not in err[0], err
    lines = (tmp_path / "e" / "records.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "e" / "records.jsonl").write_bytes(b"".join(lines[1:]))     # now the first is stages: "notalist"
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "field 'stages' must be a list of objects" in err[0], err


def test_eval_merge_refuses_a_damaged_shard_line(tmp_path, capsys):
    from sprint_jax.eval.shards import shard_meta

    shard = tmp_path / "s0"
    evaluate(_sprint_engine(), TASKS, "parallel", prompt_fn=_prompt, out_dir=shard, progress=False,
             meta={"shard": shard_meta(len(TASKS), 0, 1)})
    assert main(["eval", "merge", str(shard), "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    _damage(shard)
    assert main(["eval", "merge", str(shard), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "results.jsonl:3: missing field 'kind'" in err[0] and "rerun shard 0/1" in err[0], err
    assert not (tmp_path / "again").exists()
