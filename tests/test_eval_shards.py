"""`eval --shard I/N` + `eval merge`: three shards of a real tiny-model evaluation,
merged, write the results.jsonl / records.jsonl / report.json of one unsharded run of the same
command (timings aside); a shard that died (report missing, lines cut) makes the merge refuse,
and after rerunning that shard alone the merge is identical again."""
from __future__ import annotations

import json
import shutil

import pytest

from sprint_jax.cli import main
from sprint_jax.errors import UserError
from sprint_jax.eval.shards import parse_shard, shard_positions


def _untimed(x):
    """Drop timings (keys ending in _s: wall_s, final_s, wall_clock_s, ...) at any depth."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not k.endswith("_s")}
    if isinstance(x, list):
        return [_untimed(v) for v in x]
    return x


def _run_files(d):
    """results, records and report of an eval directory, timings aside; of the report's engine_pool
    only what the runs did (prompt tokens, prefix hits, prefilled, evictions): a pool's state at
    the end (pages free / cached) is each engine's own, one per shard after a merge."""
    lines = lambda name: [_untimed(json.loads(x)) for x in (d / name).read_text().splitlines()]  # noqa: E731
    report = _untimed(json.loads((d / "report.json").read_text()))
    pool = report.pop("engine_pool")
    report["engine_pool_counts"] = {k: pool[k] for k in ("prompt_tokens", "prefix_hit_tokens",
                                                           "prompt_tokens_prefilled", "evicted_pages")}
    return lines("results.jsonl"), lines("records.jsonl"), report


def test_shard_spec_and_positions():
    assert parse_shard("0/3") == (0, 3) and parse_shard("2/3") == (2, 3)
    for bad in ("3/3", "-1/3", "1", "a/b", "0/0"):
        with pytest.raises(UserError):
            parse_shard(bad)
    env = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "2"}
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, env):
        assert parse_shard("auto") == (2, 4)
    with mock.patch.dict(os.environ, {"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "1"}):
        for k in ("SLURM_JOB_ID", "JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS"):
            os.environ.pop(k, None)
        assert parse_shard("auto") == (1, 2)
    parts = [shard_positions(7, i, 3) for i in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum(parts, [])) == list(range(7))


def test_three_shards_merge_to_the_unsharded_eval(hf_untied, tmp_path, capsys):
    from conftest import tiny_vocab_tokenizer

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"p{k}", "problem": f"What is {k}+{k % 4}?",
                                         "answer": str(k + k % 4)}) + "\n" for k in range(7)))
    base = ["eval", "--model", str(model), "--data", str(tasks), "--mode", "parallel", "--no-progress",
            "--concurrency", "4", "--max-seq-len", "64", "--decode-chunk", "8", "--prefill-chunk", "32",
            "--max-prompts", "2", "--max-branch-tokens", "8", "--max-planner-tokens", "6",
            "--max-total-tokens", "14"]
    assert main(base + ["--out", str(tmp_path / "full")]) == 0
    shards = [tmp_path / f"s{i}" for i in range(3)]
    for i, d in enumerate(shards):   # the last shard through the --mesh path (a 1-device mesh here)
        assert main(base + ["--shard", f"{i}/3", "--out", str(d)] + (["--mesh", "tensor=1"] if i == 2 else [])) == 0
    assert [len((d / "results.jsonl").read_text().splitlines()) for d in shards] == [3, 2, 2]
    merged = tmp_path / "merged"
    assert main(["eval", "merge", *map(str, shards), "--out", str(merged)]) == 0
    ref = _run_files(tmp_path / "full")
    assert ref[2]["n"] == 7 and sum(r["total_tokens"] for r in ref[0]) > 0
    assert _run_files(merged) == ref
    assert json.loads((merged / "merge.json").read_text())["shards"][2]["index"] == 2

    # shard 1 "dies": no report, a cut results file -> the merge refuses with one line, exit 2
    (shards[1] / "report.json").unlink()
    (shards[1] / "results.jsonl").write_text((shards[1] / "results.jsonl").read_text().splitlines()[0] + "\n")
    capsys.readouterr()
    assert main(["eval", "merge", *map(str, shards), "--out", str(tmp_path / "bad")]) == 2
    assert "did not finish" in capsys.readouterr().err
    # rerun that shard alone; the merge is the unsharded run again
    shutil.rmtree(shards[1])
    assert main(base + ["--shard", "1/3", "--out", str(shards[1])]) == 0
    assert main(["eval", "merge", *map(str, shards), "--out", str(tmp_path / "merged2")]) == 0
    assert _run_files(tmp_path / "merged2") == ref

    # not one split: a shard missing, a shard twice, a run that is not a shard
    assert main(["eval", "merge", str(shards[0]), str(shards[2]), "--out", str(tmp_path / "x")]) == 2
    assert "missing shard(s) 1/3" in capsys.readouterr().err
    assert main(["eval", "merge", str(shards[0]), str(shards[0]), str(shards[2]), "--out", str(tmp_path / "x")]) == 2
    assert main(["eval", "merge", str(shards[0]), str(tmp_path / "full"), "--out", str(tmp_path / "x")]) == 2
    assert main(base + ["--shard", "3/3", "--out", str(tmp_path / "x")]) == 2
    assert main(base + ["--mesh", "tensor=2", "--out", str(tmp_path / "x")]) == 2     # 2 devices asked, 1 here
    assert "devices" in capsys.readouterr().err
