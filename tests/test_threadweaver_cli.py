"""`sprint-jax convert-format`: the command over a real training file, both ways, and its errors."""
from __future__ import annotations

import json
from pathlib import Path

from sprint_jax import format as fmt
from sprint_jax.cli import main

DATA = Path(__file__).parent / "data" / "sft_tiny_sprint.jsonl"


def _records(path) -> dict[str, dict]:
    return {d["id"]: d for d in map(json.loads, Path(path).read_text().splitlines())}


def test_threadweaver_convert_format_round_trips_what_converts(tmp_path, capsys):
    tw_file, back = tmp_path / "tw.jsonl", tmp_path / "back.jsonl"
    assert main(["convert-format", "--to", "threadweaver", str(DATA), str(tw_file)]) == 0
    out = capsys.readouterr().out
    originals = _records(DATA)
    converted = _records(tw_file)
    # an implicit-prompt plan (one execution, no prompt) has no ThreadWeaver form: those are skipped
    implicit = {i for i, d in originals.items()
                if any(s.executions and not s.prompts for s in fmt.parse_completion(d["completion"])[0].stages)}
    assert implicit and set(converted) <= set(originals) and set(converted).isdisjoint(implicit)
    assert f"read {len(originals)}, wrote {len(converted)}" in out and "an implicit prompt" in out
    for d in converted.values():
        assert "<Parallel>" in d["completion"] and "<Plan_" not in d["completion"]
        assert d["meta"]["format"] == "threadweaver"
    assert main(["convert-format", "--to", "sprint", str(tw_file), str(back)]) == 0
    for i, d in _records(back).items():
        assert d["completion"] == originals[i]["completion"] and d["prompt"] == originals[i]["prompt"]


def test_threadweaver_convert_format_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    cases = [(["--to", "sprint", str(tmp_path / "none.jsonl"), str(tmp_path / "o.jsonl")], "no such file"),
             (["--to", "sprint", str(bad), str(tmp_path / "o.jsonl")], "bad.jsonl:1"),
             (["--to", "threadweaver", str(DATA), str(DATA)], "overwrite the input")]
    for argv, words in cases:
        assert main(["convert-format", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "o.jsonl").exists()
