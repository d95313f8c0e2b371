"""`sprint-jax bench replay` at toy scale (the tiny model, two hand-written problems): the replay
decodes exactly the recorded token counts per call, the predicted times are the latency model's
for the same schedule (checked against a hand computation), bad input is one line and exit 2.
No timing assertion (benchmarks, never timed tests)."""
from __future__ import annotations

import json

import pytest

from sprint_jax.bench import replay as rp
from sprint_jax.cli import main


def ex(forced, tokens):
    return {"forced_tokens": forced, "tokens": tokens}


def stage(planner, execs=(), mode="shared", join="reprefill", sync=0):
    return {"planner_tokens": planner, "executions": [ex(*e) for e in execs], "executor_mode": mode,
            "join": join, "sync_tokens": sync}


# p1: a shared stage with a re-prefill longer than a decode chunk (a prefill call), then a merge
# stage; p2: a serial stage whose short sync rides the next decode chunk. RFT: one call each.
SPRINT = [
    dict(id="p1", mode="parallel", prompt_tokens=5, final_tokens=2,
         stages=[stage(3, [(2, 3), (2, 5)], sync=20), stage(2, [(1, 2), (1, 4)], join="merge")]),
    dict(id="p2", mode="parallel", prompt_tokens=4, final_tokens=1,
         stages=[stage(2, [(2, 2), (2, 3)], mode="serial", sync=4)]),
    dict(id="p3", mode="parallel", prompt_tokens=4, final_tokens=1, stages=[stage(2)]),   # no RFT pair
]
RFT = [dict(id="p1", mode="sequential", prompt_tokens=5, final_tokens=9, stages=[]),
       dict(id="p2", mode="sequential", prompt_tokens=4, final_tokens=6, stages=[])]
# every call the records say, in order: (call, tokens decoded or written)
EXPECTED = {
    ("sprint", "p1"): [("prefill", 5), ("planner", 3), ("fork", [3, 5]), ("extend", 20), ("planner", 2),
                       ("fork", [2, 4]), ("merge", (1 + 2) + (1 + 4)), ("final", 2)],
    ("sprint", "p2"): [("prefill", 4), ("planner", 2), ("fork", [2, 3]), ("extend", 4), ("final", 1)],
    ("rft", "p1"): [("prefill", 5), ("final", 9)],
    ("rft", "p2"): [("prefill", 4), ("final", 6)],
}
# tokens the engine's decode calls sample: every generated one but the first after a merge, which
# is sampled from the join's kept logits (p1's final call)
GENERATED = {("sprint", "p1"): 3 + 3 + 5 + 2 + 2 + 4 + 2 - 1, ("sprint", "p2"): 2 + 2 + 3 + 1,
             ("rft", "p1"): 9, ("rft", "p2"): 6}

# the chip the latency model is fed in these tests (the CLI's measurement is replaced by it)
FLOPS, BYTES_PER_S = 2e9, 1e9


def as_written(rec: dict) -> dict:
    """`rec` as eval writes it: the fields replay does not read given neutral values, and the
    token sums its stages give (the records reader refuses a line without them)."""
    stages = [{"planner_text": "", "prompts": [""] * len(st["executions"]), **st,
               "executions": [{"text": "", **e} for e in st["executions"]]} for st in rec["stages"]]
    runs = [[e["tokens"] for e in st["executions"]] for st in stages]
    return {"query": f"Q {rec['id']}", "config": {}, "final_text": "", "final_answer": None, "text": "",
            "termination": "final_answer", "problems": [], "wall_s": 0.0, **rec, "stages": stages,
            "sequential_tokens": rec["final_tokens"] + sum(st["planner_tokens"] + max(r, default=0)
                                                           for st, r in zip(stages, runs)),
            "total_tokens": rec["final_tokens"] + sum(st["planner_tokens"] + sum(r) for st, r in zip(stages, runs))}


def write_records(root):
    for name, recs in (("sprint", SPRINT), ("rft", RFT)):
        (root / name).mkdir(parents=True)
        (root / name / "records.jsonl").write_text("".join(json.dumps(as_written(r)) + "\n" for r in recs))
    return root


def hand_latency_p2() -> dict[str, float]:
    """SPRINT p2 and RFT p2 on the tiny model at FLOPS / BYTES_PER_S, from the roofline formulas
    written out. The tiny model: hidden 64, 2 layers, 4 heads of 16 dims, 2 KV heads, SwiGLU 128,
    vocab 256, fp32: matmul weights 2 x 64 x 16 x (2 x 4 + 2 x 2) + 2 x 3 x 64 x 128 + 64 x 256
    = 90112; K and V per token 2 x 2 layers x 2 heads x 16 x 4 bytes = 512; attention FLOPs per
    key 4 x 2 x 4 x 16 = 512."""
    w, kv, att = 90112, 512, 512

    def step(prefix, suffix):                       # one row
        keys = prefix + suffix + 1
        return max((2 * w + att * keys) / FLOPS, (4 * w + kv * keys) / BYTES_PER_S)

    def prefill(t, ctx):
        return max((2 * w * t + att * t * (ctx + t / 2)) / FLOPS, (4 * w + kv * (ctx + t)) / BYTES_PER_S)

    # SPRINT p2: prompt 4; planner 2 steps at 4, 5 held; executors one after another on the
    # 6-token context, each riding its 2 forced tokens then decoding (4 and 5 steps); the sync's
    # 4 tokens prefilled at 6; the final step on 6 + 4 + 5 = 15
    sprint = (prefill(4, 0) + step(4, 0) + step(5, 0) + sum(step(6, t) for t in range(4))
              + sum(step(6, t) for t in range(5)) + prefill(4, 6) + step(15, 0))
    rft = prefill(4, 0) + sum(step(4 + i, 0) for i in range(6))
    return {"sprint": sprint, "rft": rft}


def test_the_latency_model_gives_the_hand_computation():
    from sprint_jax.plan.records import predict

    cfg = rp.model_config("tiny", "float32")
    chip = rp.MeasuredChip("test", FLOPS, BYTES_PER_S)
    pred = predict({"sprint": {"p2": SPRINT[1]}, "rft": {"p2": RFT[1]}}, cfg, chip)
    hand = hand_latency_p2()
    assert pred["per_problem"]["sprint"]["p2"]["latency_s"] == pytest.approx(hand["sprint"], rel=1e-9)
    assert pred["per_problem"]["rft"]["p2"]["latency_s"] == pytest.approx(hand["rft"], rel=1e-9)


def test_capacities_hold_the_longest_replay():
    cap = rp.capacities(SPRINT + RFT)
    # p1: 5 + 3 + 20 (sync) + 2 + (1 + 2) + (1 + 4) (merged branches) + 2 = 40 planner-side tokens
    assert cap["max_seq_len"] == 40 + 8
    assert cap["max_children"] == 2
    assert cap["max_branch_tokens"] == (2 + 5 + 1) + 8


def test_the_probes_report_their_own_arithmetic():
    m = rp.measure_cpu(1, matmul_n=64, stream_rows=256)
    assert m["flops_per_s"] == pytest.approx(2 * 64 ** 3 / m["matmul_s"])
    assert m["stream_bytes"] == 256 * 256 * 4
    assert m["matvec_bytes_per_s"] == pytest.approx(m["stream_bytes"] / m["matvec_s"])


def test_the_rows_probe_reads_every_matmul_weight_of_the_model():
    cfg = rp.model_config("tiny", "float32")
    assert sum(a * b for a, b in rp.weight_shapes(cfg)) == 90112      # hand_latency_p2's figure
    probe = rp.measure_rows(cfg, [1, 3], 1)
    assert [p["rows"] for p in probe] == [1, 3]
    for p in probe:
        assert p["weights"] == 90112
        assert p["bytes_per_s"] == pytest.approx(90112 * 4 / p["s"])
        assert p["flops_per_s"] == pytest.approx(2 * 90112 * p["rows"] / p["s"])


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory):
    return write_records(tmp_path_factory.mktemp("replay") / "records")


@pytest.mark.slow
def test_the_replay_decodes_exactly_the_recorded_counts(records_dir):
    import numpy as np

    from sprint_jax.plan.records import load_records

    recs = load_records(records_dir)
    engine = rp.make_engine(rp.model_config("tiny", "float32"), [r for m in recs.values() for r in m.values()], 0)
    rng = np.random.default_rng(0)
    for (mode, key), expected in EXPECTED.items():
        before = dict(engine.stats)
        calls = rp.replay(engine, recs[mode][key], rng)
        assert [(c["call"], c["tokens"]) for c in calls] == expected, (mode, key)
        # the engine's own count of the tokens its decode calls sampled
        assert engine.stats["tokens"] - before["tokens"] == GENERATED[(mode, key)], (mode, key)
        assert engine.stats["decode_calls"] > before["decode_calls"]
        assert not engine.busy and engine.free_slots == 1          # closed, nothing left queued
    serial = [c for c in rp.replay(engine, recs["sprint"]["p2"], rng) if c["call"] == "fork"]
    assert serial[0]["serial"] is True and serial[0]["forced"] == [2, 2]


@pytest.mark.slow
def test_the_cli_replays_pairs_and_prints_the_models_prediction(records_dir, tmp_path, monkeypatch, capsys):
    figures = {"matmul_n": 1, "matmul_s": 1.0, "flops_per_s": FLOPS, "stream_bytes": 1.0, "matvec_s": 1.0,
               "matvec_bytes_per_s": BYTES_PER_S, "sum_s": 1.0, "sum_bytes_per_s": 1.0}
    monkeypatch.setattr(rp, "measure_cpu", lambda repeats: figures)
    out = tmp_path / "replay.json"
    assert main(["bench", "replay", "--records", str(records_dir), "--model-size", "tiny", "--repeats", "2",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["problem"]: r for r in report["rows"]}
    assert sorted(rows) == ["p1", "p2"]                          # p3 has no RFT record: left out
    for key, row in rows.items():
        assert [(c["call"], c["tokens"]) for c in row["sprint_calls"]] == EXPECTED[("sprint", key)]
        assert [(c["call"], c["tokens"]) for c in row["rft_calls"]] == EXPECTED[("rft", key)]
        assert len(row["sprint_samples_s"]) == len(row["rft_samples_s"]) == 2
        assert row["sprint_s"] == min(row["sprint_samples_s"]) and row["rft_s"] == min(row["rft_samples_s"])
    hand = hand_latency_p2()
    assert rows["p2"]["predicted_sprint_s"] == pytest.approx(hand["sprint"], rel=1e-9)
    assert rows["p2"]["predicted_rft_s"] == pytest.approx(hand["rft"], rel=1e-9)
    assert report["chip"] == {"name": "this CPU (%d cores)" % report["cpu_count"], "peak_flops": FLOPS,
                              "hbm_bandwidth": BYTES_PER_S}
    assert [p["rows"] for p in report["matmul_rows"]] == [1, 2]    # one row and the records' fork width
    tot = report["total"]
    assert tot["measured"]["sprint"] == pytest.approx(rows["p1"]["sprint_s"] + rows["p2"]["sprint_s"])
    assert tot["ratio"] == pytest.approx(tot["measured"]["sprint"] / tot["measured"]["rft"])
    assert tot["predicted_over_measured"]["rft"] == pytest.approx(tot["predicted"]["rft"] / tot["measured"]["rft"])
    assert "SPRINT / RFT wall clock" in capsys.readouterr().out


@pytest.mark.parametrize("make, flags, message", [
    (lambda d: None, [], "not a directory"),
    (lambda d: (d.mkdir(), (d / "records.jsonl").write_text(json.dumps(as_written(SPRINT[0])) + "\n")), [],
     "no problem has both a SPRINT record (1 found) and an RFT record (0 found)"),
    (write_records, ["--problems", "0"], "--problems must be >= 1, got 0"),
    (write_records, ["--repeats", "0"], "--repeats must be >= 1, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, flags, message):
    d = tmp_path / "recs"
    make(d)
    assert main(["bench", "replay", "--records", str(d), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
