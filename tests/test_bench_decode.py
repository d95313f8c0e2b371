"""Smoke test of `sprint-jax bench decode` at the smallest settings: every JSON field present,
times positive, step counts and greedy agreement with HF as the model dictates, cache bytes equal
to the capacities the engine allocated. No timing assertion (benchmarks,
never timed tests), and no re-derivation of the bench's own arithmetic."""
from __future__ import annotations

import argparse
import json

import pytest

from sprint_jax.bench.decode import MODES, add_decode_arguments, evaluate_targets, run_decode_bench
from sprint_jax.cli import main
from sprint_jax.errors import UserError
from sprint_jax.model import Qwen2Config

N_NEW = 6
P = 24


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_decode_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "decode.json"
    args = _args("--preset", "tiny", "--branches", "1,2", "--prefix-lens", str(P), "--new-tokens", str(N_NEW),
                 "--repeats", "1", "--hf-repeats", "2", "--decode-chunk", "4", "--join-tokens", "5", "--out", str(out))
    import torch
    threads = torch.get_num_threads()
    assert run_decode_bench(args) == 0
    assert torch.get_num_threads() == threads  # the HF row's thread setting is restored
    return json.loads(out.read_text())


def test_report_fields_and_times(report):
    for key in ("benchmark", "device_kind", "backend", "jax_version", "torch_version", "loadavg_start",
                "loadavg_end", "model", "settings", "capacities", "timing", "rows", "ratios", "hf", "targets"):
        assert key in report, key
    assert report["model"]["param_count"] > 0 and report["settings"]["dtype"] == "float32"
    assert len(report["rows"]) == len(MODES) * 2
    for r in report["rows"]:
        assert r["prefix_len"] == P and r["new_tokens"] == N_NEW
        assert r["stage_ms"] > 0 and r["one_token_stage_ms"] > 0 and r["compile_s"] >= 0
        assert r["stage_ms"] == min(r["stage_ms_samples"])
        # eos disabled, no stops: every branch decodes exactly N tokens
        assert r["steps"] == (r["branches"] * N_NEW if r["mode"] == "serial" else N_NEW)
        if r["step_ms"] is not None:  # None only when load noise swamps the N-vs-1 difference
            assert r["step_ms"] > 0 and r["tokens_per_s"] > 0


def test_join_rows(report):
    """The join rows: 8 executors of N tokens; re-prefill runs all 8N tokens, merge none
    (each executor generated its last token in a join fork, which ran it: the merge is the copy);
    both times positive, best of the samples, with the process CPU time beside them."""
    (row,) = report["join"]
    assert row["executors"] == 8 and row["tokens_per_executor"] == 5
    assert row["reprefill_tokens"] == 40 and row["merge_tokens_run"] == 0
    for m in ("reprefill", "merge"):
        assert row[f"{m}_ms"] > 0 and row[f"{m}_ms"] == min(row["samples_ms"][m])
        assert row[f"{m}_cpu_ms"] == min(row["samples_cpu_ms"][m]) >= 0
    assert row["merge_over_reprefill"] == row["merge_ms"] / row["reprefill_ms"]
    assert row["merge_host_ms"] == min(row["samples_merge_host_ms"]) > 0


def test_cache_bytes_match_allocated_capacities(report):
    c = Qwen2Config(**{k: v for k, v in report["model"]["config"].items()})
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4   # K and V, fp32
    cap = report["capacities"][0]
    # the 23 cached context tokens (P - 1; the last is pending) as a step reads them: the slot
    # engine's used-length bucket (min 64) capped at the parent slot; the copy baseline copies that many
    prefix_slots = min(64, cap["seq_capacity"])
    by = {(r["mode"], r["branches"]): r["cache_bytes"] for r in report["rows"]}
    for n in (1, 2):
        assert by[("shared", n)] == (prefix_slots + n * cap["suffix_capacity"]) * per_token
        assert by[("copy", n)] == n * (prefix_slots + cap["suffix_capacity"]) * per_token
        assert by[("serial", n)] == by[("shared", n)]   # the same child slots, one after another
    assert cap["seq_capacity"] >= cap["max_seq_len"] == P + 4 + N_NEW


def test_ratios_cover_every_point_and_sharing_saves_memory(report):
    by_n = {q["branches"]: q for q in report["ratios"]}
    assert sorted(by_n) == [1, 2] and all(q["prefix_len"] == P for q in by_n.values())
    assert by_n[1]["shared_over_copy_bytes"] == 1.0          # one branch: a fork is a copy
    assert by_n[2]["shared_over_copy_bytes"] < 1.0           # two: the prefix is stored once
    for q in by_n.values():
        assert q["shared_over_copy_stage"] > 0 and q["shared_speedup_vs_serial_stage"] > 0


def test_hf_row_same_weights(report):
    (h,) = report["hf"]
    assert h["prefix_len"] == P and h["new_tokens"] == N_NEW
    assert h["hf_torch_threads"] == 1  # the CPU default (see decode._torch_threads)
    for name in ("engine", "hf"):
        assert h[f"{name}_tokens_generated"] == N_NEW
        assert h[f"{name}_e2e_ms"] > 0 and h[f"{name}_e2e_tokens_per_s"] > 0
    assert h["engine_over_hf_e2e_tokens_per_s"] > 0
    # the same weights through both stacks: greedy decoding agrees token for token (fp32)
    assert h["greedy_tokens_agree"] == N_NEW


def test_targets_section(report):
    names = [t["name"] for t in report["targets"]]
    assert len(names) == 5
    met = {t["name"]: t["met"] for t in report["targets"]}
    # branches 1,2 only: the two 8-branch targets cannot be judged, the others can
    assert met[names[0]] is None and met[names[2]] is None
    assert met[names[1]] in (True, False) and met[names[3]] in (True, False) and met[names[4]] in (True, False)


def test_target_rules():
    def ratio(p, n, step1, sc_step, sc_bytes, vs_serial):
        return dict(prefix_len=p, branches=n, shared_step_vs_one_branch=step1, shared_over_copy_step=sc_step,
                    shared_over_copy_stage=sc_step, shared_over_copy_bytes=sc_bytes,
                    shared_speedup_vs_serial_stage=vs_serial, shared_over_serial_tokens_per_s=vs_serial)
    good = [ratio(64, 1, 1.0, 1.0, 1.0, 1.0), ratio(64, 8, 1.5, 0.5, 0.3, 4.0),
            ratio(512, 1, 1.0, 1.0, 1.0, 1.0), ratio(512, 8, 1.9, 0.8, 0.2, 3.5)]
    hf = [dict(prefix_len=64, engine_over_hf_e2e_tokens_per_s=2.0, engine_over_hf_decode_tokens_per_s=3.0)]
    assert [t["met"] for t in evaluate_targets(good, hf)] == [True, True, True, True, None]
    bad = [ratio(64, 1, 1.0, 1.0, 1.0, 1.0), ratio(64, 8, 2.5, 0.5, 0.3, 4.0),
           ratio(512, 1, 1.0, 1.0, 1.0, 1.0), ratio(512, 8, 1.5, 1.2, 0.2, 2.0)]
    hf_bad = [dict(prefix_len=64, engine_over_hf_e2e_tokens_per_s=0.9, engine_over_hf_decode_tokens_per_s=None)]
    assert [t["met"] for t in evaluate_targets(bad, hf_bad)] == [False, False, False, False, None]
    join = [dict(tokens_per_executor=64, merge_over_reprefill=0.05), dict(tokens_per_executor=512, merge_over_reprefill=0.2)]
    assert evaluate_targets(good, hf, join[:1])[4]["met"] is True
    assert evaluate_targets(good, hf, join)[4]["met"] is False
    assert [t["met"] for t in evaluate_targets(good, [])][3] is None


@pytest.mark.parametrize("argv, message", [
    (["--branches", "0"], "--branches"),
    (["--prefix-lens", "a,b"], "--prefix-lens"),
    (["--new-tokens", "1"], "--new-tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--hf-repeats", "0"], "--hf-repeats"),
    (["--hf-threads", "-1"], "--hf-threads"),
])
def test_bad_flags_are_user_errors(argv, message):
    with pytest.raises(UserError, match=message):
        run_decode_bench(_args(*argv))


def test_cli_reports_bad_flag_in_one_line(capsys):
    assert main(["bench", "decode", "--branches", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--branches" in err[0]


def test_checkpoint_directory_model(tmp_path, hf_untied):
    """--model DIR: a real HF checkpoint written by transformers, loaded by the engine."""
    out = tmp_path / "ckpt.json"
    args = _args("--model", str(hf_untied), "--branches", "2", "--prefix-lens", "8", "--new-tokens", "3",
                 "--repeats", "1", "--decode-chunk", "4", "--hf", "off", "--join-tokens", "off",
                 "--out", str(out))
    assert run_decode_bench(args) == 0
    rep = json.loads(out.read_text())
    assert rep["model"]["kind"] == "checkpoint" and rep["model"]["config"]["hidden_size"] == 72
    assert rep["hf"] == [] and len(rep["rows"]) == len(MODES)


def test_qwen3_checkpoint_hf_peer_is_qwen3(tmp_path, hf_qwen3_tied):
    """A Qwen3 checkpoint: the HF row loads Qwen3ForCausalLM and greedy agrees with the engine."""
    out = tmp_path / "q3.json"
    args = _args("--model", str(hf_qwen3_tied), "--branches", "1", "--prefix-lens", "8", "--new-tokens", "3",
                 "--repeats", "1", "--hf-repeats", "1", "--decode-chunk", "4", "--hf", "on",
                 "--join-tokens", "off", "--out", str(out))
    assert run_decode_bench(args) == 0
    rep = json.loads(out.read_text())
    assert rep["model"]["config"]["model_type"] == "qwen3"
    (h,) = rep["hf"]
    assert h["greedy_tokens_agree"] == 3


def test_bad_checkpoint_directory_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"num_key_value_heads": 1, "vocab_size": 16}')
    with pytest.raises(UserError, match="safetensors"):
        run_decode_bench(_args("--model", str(tmp_path), "--hf", "off"))
