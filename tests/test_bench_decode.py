"""Smoke test of `sprint-jax bench decode` at the smallest settings: every JSON field present,
times positive, step counts and greedy agreement with HF as the model dictates, cache bytes equal
to the pages the fork holds (counted by hand), the paged vs slot step section's rows and bytes
(counted by hand). No timing assertion (benchmarks, never timed tests)."""
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
                 "--repeats", "1", "--hf-repeats", "2", "--decode-chunk", "4", "--join-tokens", "5",
                 "--step-repeats", "2", "--out", str(out))
    import torch
    threads = torch.get_num_threads()
    assert run_decode_bench(args) == 0
    assert torch.get_num_threads() == threads  # the HF row's thread setting is restored
    return json.loads(out.read_text())


def test_report_fields_and_times(report):
    for key in ("benchmark", "device_kind", "backend", "jax_version", "torch_version", "loadavg_start",
                "loadavg_end", "model", "settings", "capacities", "timing", "rows", "ratios", "hf", "join",
                "paged_step", "targets"):
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


def _per_token(report) -> int:
    c = Qwen2Config(**{k: v for k, v in report["model"]["config"].items()})
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4   # K and V, fp32, every layer


def test_cache_bytes_are_the_pages_held(report):
    per_token = _per_token(report)
    cap = report["capacities"][0]
    assert cap["page_size"] == 16
    page = 16 * per_token
    # the context: P - 1 = 23 tokens written (the last one is pending): pages 0 and 1 (16 + 7
    # tokens), held once whatever the branch count
    context_pages = 2
    # a branch (4 forced tokens, N_NEW = 6 generated, decode_chunk 4): its first decode call starts
    # at position 23 and reserves its pending token + 4 forced - 1 + a chunk of 4 = 8 positions,
    # 23..30; its second starts at 31 (23 + 4 forced + 4 generated) and reserves 4, 31..34. Its
    # own pages: its copy of the partly filled page 1, and page 2 (positions 32..47)
    own_pages = 2
    # the copy baseline: the context's 23 slots as the slot engine's step read them (its used-length
    # bucket, min 64, capped at the parent slot), copied into each branch, + each branch's suffix
    prefix_slots = min(64, cap["seq_capacity"])
    assert cap["seq_capacity"] == 38 and cap["suffix_capacity"] == 15   # max_seq_len 34 / 11 + the chunk 4
    by = {(r["mode"], r["branches"]): r["cache_bytes"] for r in report["rows"]}
    for n in (1, 2):
        assert by[("shared", n)] == (context_pages + n * own_pages) * page
        assert by[("copy", n)] == n * (prefix_slots + cap["suffix_capacity"]) * per_token
        assert by[("serial", n)] == by[("shared", n)]   # the same fork, its branches one after another
    assert cap["max_seq_len"] == P + 4 + N_NEW


def test_ratios_cover_every_point_and_sharing_saves_memory(report):
    by_n = {q["branches"]: q for q in report["ratios"]}
    assert sorted(by_n) == [1, 2] and all(q["prefix_len"] == P for q in by_n.values())
    # pages held (see test_cache_bytes_are_the_pages_held) over the copy's slots, in tokens: one
    # branch holds whole pages past what it uses (4 x 16 vs 38 + 15); at two the context is held once
    assert by_n[1]["shared_over_copy_bytes"] == pytest.approx(64 / 53)
    assert by_n[2]["shared_over_copy_bytes"] == pytest.approx(96 / 106)
    assert by_n[2]["shared_over_copy_bytes"] < 1.0
    for q in by_n.values():
        assert q["shared_over_copy_stage"] > 0 and q["shared_speedup_vs_serial_stage"] > 0


def test_paged_vs_slot_step_rows(report):
    """The side-by-side step section at P = 24 (bytes and read widths counted by hand from the
    tiny model: 3 layers, 6 query heads, 2 KV heads, head dim 12, fp32; pages of 16 tokens)."""
    rows = {(r["kind"], r["branches"]): r for r in report["paged_step"]}
    assert sorted(rows) == [("fork", 1), ("fork", 2), ("generate", 1)]
    layers, kv_row, q_row = 3, 2 * 2 * 12 * 4, 6 * 12 * 4       # per layer: a token's K + V, a row's query
    page = 16 * kv_row
    c = 4                                                        # each child's own tokens: its forced prefix
    for (kind, n), r in rows.items():
        assert r["prefix_len"] == P and r["chunk"] == 4 and r["page_size"] == 16
        for impl in ("paged", "slot"):
            assert r[f"{impl}_steps"] == [4, 1]                  # a budget of 4 tokens vs 1, same shapes
            for clock in ("", "cpu_"):
                assert len(r[f"{impl}_call_{clock}ms_samples"]) == len(r[f"{impl}_one_step_{clock}ms_samples"]) == 2
                assert r[f"{impl}_{clock}ms"] is None or r[f"{impl}_{clock}ms"] > 0
        for clock in ("", "_cpu"):
            a, b = r[f"paged{clock}_ms"], r[f"slot{clock}_ms"]
            assert r[f"paged_over_slot{clock}"] == (pytest.approx(a / b) if a is not None and b is not None else None)
        # the slot cache: a parent slot of 24 + 4 + 6 + 4 = 38, child slots of 4 + 1 + 6 + 4 = 15
        if kind == "generate":
            assert r["used_length"] == P
            # 24 tokens: slots 24 read once (a group of one); pages 0-1 whole (2 pages)
            assert r["slot_bytes"] == layers * (24 * kv_row + q_row)
            assert r["paged_bytes"] == layers * (2 * page + q_row)
            assert r["slot_prefix_kv_bytes"] == layers * 24 * kv_row and r["paged_prefix_kv_bytes"] == layers * 2 * page
            assert r["slot_widths"]["s_b"] == 38                  # 24 + chunk 4 -> bucket 64, capped at 38
            # 2 pages -> the 64-token floor, 4 pages, capped at the parent's 38 tokens: 3 pages
            assert r["paged_widths"]["ma"] == 3
            continue
        assert r["used_length"] == P + c
        # slots: the parent's 24 tokens once for the group, each child its own 4
        assert r["slot_prefix_bytes"] == layers * (24 * kv_row + n * q_row)
        assert r["slot_own_bytes"] == layers * n * (c * kv_row + q_row)
        # pages: the one full page (16 tokens) once for the group, each child its copy of the
        # partly filled page (8 tokens) and its 4: 12 tokens, one page
        assert r["paged_prefix_bytes"] == layers * (page + n * q_row)
        assert r["paged_own_bytes"] == layers * n * (page + q_row)
        for impl in ("paged", "slot"):
            assert r[f"{impl}_bytes"] == r[f"{impl}_prefix_bytes"] + r[f"{impl}_own_bytes"]
        # the prefix's K/V is read once whatever n
        assert r["slot_prefix_kv_bytes"] == layers * 24 * kv_row and r["paged_prefix_kv_bytes"] == layers * page
        assert r["slot_widths"] == {"w": n, "s_b": 38, "c_b": 15}
        # the 64-token floor (4 pages) capped: the shared prefix at the parent's 38 tokens (3
        # pages), a child's own pages at a page + its 15 tokens (2 pages)
        assert r["paged_widths"] == {"w": n, "mg": 3, "mr": 2}


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
    assert len(names) == 7
    met = {t["name"]: t["met"] for t in report["targets"]}
    # branches 1,2 only: the two 8-branch targets cannot be judged, the others can
    assert met[names[0]] is None and met[names[2]] is None
    for i in (1, 3, 4, 5):
        assert met[names[i]] in (True, False)
    assert "1.15x" in names[5] and set(report["targets"][5]["figures"]) == {"generate P=24", "fork P=24,n=1",
                                                                           "fork P=24,n=2"}
    assert met[names[6]] is True          # the prefix's K/V bytes do not grow with the branch count


def test_target_rules():
    def ratio(p, n, step1, sc_step, sc_bytes, vs_serial):
        return dict(prefix_len=p, branches=n, shared_step_vs_one_branch=step1, shared_over_copy_step=sc_step,
                    shared_over_copy_stage=sc_step, shared_over_copy_bytes=sc_bytes,
                    shared_speedup_vs_serial_stage=vs_serial, shared_over_serial_tokens_per_s=vs_serial)
    good = [ratio(64, 1, 1.0, 1.0, 1.0, 1.0), ratio(64, 8, 1.5, 0.5, 0.3, 4.0),
            ratio(512, 1, 1.0, 1.0, 1.0, 1.0), ratio(512, 8, 1.9, 0.8, 0.2, 3.5)]
    hf = [dict(prefix_len=64, engine_over_hf_e2e_tokens_per_s=2.0, engine_over_hf_decode_tokens_per_s=3.0)]
    assert [t["met"] for t in evaluate_targets(good, hf)] == [True, True, True, True, None, None, None]
    bad = [ratio(64, 1, 1.0, 1.0, 1.0, 1.0), ratio(64, 8, 2.5, 0.5, 0.3, 4.0),
           ratio(512, 1, 1.0, 1.0, 1.0, 1.0), ratio(512, 8, 1.5, 1.2, 0.2, 2.0)]
    hf_bad = [dict(prefix_len=64, engine_over_hf_e2e_tokens_per_s=0.9, engine_over_hf_decode_tokens_per_s=None)]
    assert [t["met"] for t in evaluate_targets(bad, hf_bad)] == [False, False, False, False, None, None, None]
    join = [dict(tokens_per_executor=64, merge_over_reprefill=0.05), dict(tokens_per_executor=512, merge_over_reprefill=0.2)]
    assert evaluate_targets(good, hf, join[:1])[4]["met"] is True
    assert evaluate_targets(good, hf, join)[4]["met"] is False
    assert [t["met"] for t in evaluate_targets(good, [])][3] is None

    def step(kind, n, ratio, prefix_kv=(100, 120)):
        return dict(kind=kind, prefix_len=64, branches=n, paged_over_slot=ratio,
                    paged_prefix_kv_bytes=prefix_kv[0], slot_prefix_kv_bytes=prefix_kv[1])
    steps = [step("generate", 1, 1.1), step("fork", 1, 0.9), step("fork", 8, 1.15)]
    assert [t["met"] for t in evaluate_targets(good, hf, join[:1], steps)][5:] == [True, True]
    slow = steps[:2] + [step("fork", 8, 1.2)]
    assert [t["met"] for t in evaluate_targets(good, hf, join[:1], slow)][5:] == [False, True]
    swamped = steps[:2] + [step("fork", 8, None)]           # no step time: not met
    assert evaluate_targets(good, hf, join[:1], swamped)[5]["met"] is False
    per_branch = steps[:2] + [step("fork", 8, 1.0, (800, 120))]   # a prefix read per branch
    assert evaluate_targets(good, hf, join[:1], per_branch)[6]["met"] is False
    assert [t["met"] for t in evaluate_targets(good, hf)][5:] == [None, None]


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
