"""`sprint-jax recipe`: the stages, their digests and skips, status, failures and bad configs.

The end-to-end test runs configs/recipe_tiny_cpu.yaml (shrunk: 800 problems, six test problems of
2 to 4 chains, two samples each) for real, reruns it (every stage skipped), changes the
comparison's bins (only compare and report rerun) and checks report.md's table, its Avg@k / pass@k
and its length bins against the eval runs' own results.jsonl, recomputed here. The bins of the
change are cut at the RFT run's own per-problem lengths, so each holds a problem whatever the small
model wrote (the config's bins assume one line per chain, which this little training need not give). The
digest tests run the real planner and state keeping with each stage's command replaced by a
writer of its outputs, so every input change can be tried in a second.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from sprint_jax.cli import main
from sprint_jax.config import CONFIG_DIR
from sprint_jax.recipe import runner
from sprint_jax.recipe.config import load_recipe_config

TINY = CONFIG_DIR / "recipe_tiny_cpu.yaml"
R1 = CONFIG_DIR / "recipe_r1_7b.yaml"
STAGES = ["curate", "train_sprint", "train_rft", "eval_sprint_chains", "eval_rft_chains", "compare_chains", "report"]


def _tiny(tmp_path: Path, name: str = "recipe.yaml", **changes) -> Path:
    """A copy of the tiny recipe shrunk to test size, with `changes` (dotted key -> value)."""
    d = yaml.safe_load(TINY.read_text())
    d["curate"]["tasks"]["n"] = 800          # ~75 steps over 3 epochs: the models write the format, not
    d["train"]["epochs"] = 3                 # always one line per chain (RFT lengths need not follow the chain count)
    d["eval"]["sets"][0]["limit"] = 6
    d["eval"]["orchestrator"]["max_total_tokens"] = 160
    args = d["eval"]["args"]
    args[args.index("--samples") + 1] = "2"
    for key, value in changes.items():
        node = d
        *path, last = key.split(".")
        for k in path:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[last] = value
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def _per_problem(rows: list[dict]) -> dict[str, dict]:
    """results.jsonl lines (one per problem and sample) -> per problem: samples, correct count,
    mean correct, mean sequential tokens."""
    out: dict[str, dict] = {}
    for r in rows:
        p = out.setdefault(r["id"], {"k": 0, "c": 0, "seq": 0.0})
        p["k"] += 1
        p["c"] += bool(r["correct"])
        p["seq"] += r["sequential_tokens"]
    for p in out.values():
        p["acc"], p["seq"] = p["c"] / p["k"], p["seq"] / p["k"]
    return out


def _started(out: Path) -> dict[str, str]:
    return {k: v["started"] for k, v in json.loads((out / "state.json").read_text())["stages"].items()}


def _status(out: Path, capsys) -> dict[str, str]:
    capsys.readouterr()
    assert main(["recipe", "status", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["stage", "status"]
    return {line.split()[0]: line.split()[1] for line in lines[1:]}


def _table_row(report: str, metric: str, after: str = "") -> list[str]:
    """The cells of the first table row named `metric` after the text `after`."""
    row = next(line for line in report[report.index(after):].splitlines() if line.startswith(f"| {metric} |"))
    return [c.strip() for c in row.strip("|").split("|")]


@pytest.mark.slow
def test_tiny_recipe_end_to_end_rerun_and_one_change(tmp_path, capsys, training_subprocesses):
    cfg, out = _tiny(tmp_path), tmp_path / "run"
    assert main(["recipe", "run", str(cfg), "--out", str(out)]) == 0
    first = _started(out)
    assert list(first) == STAGES
    for stage in STAGES:
        assert (out / stage / "log.txt").stat().st_size > 0
    assert _status(out, capsys) == {s: "done" for s in STAGES}

    # report.md's table against the eval runs' own per-problem results
    report = (out / "report.md").read_text()
    rows = {arm: [json.loads(x) for x in (out / f"eval_{arm}_chains" / "out" / "results.jsonl").read_text().splitlines()]
            for arm in ("sprint", "rft")}
    assert len(rows["sprint"]) == len(rows["rft"]) == 12                 # 6 problems x 2 samples
    assert sorted(x["sample"] for x in rows["rft"]) == [0] * 6 + [1] * 6
    acc = _table_row(report, "accuracy")
    seq = _table_row(report, "sequential tokens")
    for col, arm in ((1, "sprint"), (2, "rft")):
        r = rows[arm]
        assert acc[col] == f"{100 * sum(bool(x['correct']) for x in r) / len(r):.1f}%"
        assert seq[col] == f"{sum(x['sequential_tokens'] for x in r) / len(r):.1f}"
    sprint_row = _table_row(report, "SPRINT", "| model | samples per problem")   # samples, Avg@k, ...
    r = rows["sprint"]
    assert sprint_row[4] == (
        f"{sum(x['total_tokens'] for x in r) / sum(x['sequential_tokens'] for x in r):.3f}")   # self-parallelism
    # Avg@2 ± its standard error and pass@1, pass@2, from the per-problem sample counts
    per = {arm: _per_problem(rows[arm]) for arm in ("sprint", "rft")}
    for arm, name in (("sprint", "SPRINT"), ("rft", "RFT")):
        row = _table_row(report, name, "| model | samples per problem")
        means = [p["acc"] for p in per[arm].values()]
        avg = sum(means) / 6
        se = (sum((m - avg) ** 2 for m in means) / 5) ** 0.5 / 6 ** 0.5
        pass2 = sum(p["c"] > 0 for p in per[arm].values()) / 6        # 1 - C(2 - c, 2) / C(2, 2)
        assert row[1] == "2" and row[2] == f"{100 * avg:.1f}% ± {100 * se:.1f}"
        assert row[3] == f"@1 {100 * avg:.1f}%, @2 {100 * pass2:.1f}%"
    # the config's fixed bins by the RFT run's per-problem mean sequential tokens, with the n,
    # accuracies and sequential tokens recomputed here (a bin no problem falls in: n 0, no means)
    assert "### By RFT sequential length (fixed bins)" in report
    _check_fixed_bins(report, per, yaml.safe_load(cfg.read_text())["compare"]["bins"], populated=False)
    steps = {arm: json.loads((out / f"train_{arm}" / "out" / "summary.json").read_text())["steps"]
             for arm in ("sprint", "rft")}
    assert f"| SPRINT | train_sprint | merge | {steps['sprint']} |" in report
    stages_table = report[report.index("## Stages"):report.index("## Training")]
    assert all(f"| {s} |" in stages_table for s in STAGES)         # the report names every stage

    # the same command again: nothing runs
    capsys.readouterr()
    assert main(["recipe", "run", str(cfg), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.count("inputs unchanged: skipped") == len(STAGES) and "running" not in said
    assert _started(out) == first

    # one input changed (the comparison's bins, and its quantiles so that the change is one even
    # if the new cuts equal the old): only compare and what follows it rerun. The cuts are the
    # distinct integer parts of the RFT run's per-problem lengths past the smallest, so bin i holds
    # exactly the problems whose length has the i-th integer part: every bin is populated.
    floors = sorted({int(p["seq"]) for p in per["rft"].values()})
    assert len(floors) >= 2, f"the RFT run wrote one length for 2- to 4-chain problems: {floors}"
    cuts = ",".join(map(str, floors[1:]))
    cfg2 = _tiny(tmp_path, "recipe2.yaml", **{"compare.bins": cuts, "compare.quantiles": 3})
    assert main(["recipe", "run", str(cfg2), "--out", str(out)]) == 0
    now = _started(out)
    assert [s for s in STAGES if now[s] != first[s]] == ["compare_chains", "report"]
    _check_fixed_bins((out / "report.md").read_text(), per, cuts, populated=True)


def _check_fixed_bins(report: str, per: dict[str, dict], bins: str, populated: bool) -> None:
    """report.md's fixed-bin table (thresholds `bins`) against the per-problem results: every bin's
    n, both accuracies and both mean sequential tokens recomputed here; `populated`: no bin is empty."""
    edges = [0, *map(int, bins.split(",")), None]
    total = 0
    for lo, hi in zip(edges, edges[1:]):
        ids = [i for i, p in per["rft"].items() if p["seq"] >= lo and (hi is None or p["seq"] < hi)]
        lengths = sorted(p["seq"] for p in per["rft"].values())
        assert ids or not populated, f"bin {lo}-{hi} is empty: RFT lengths {lengths}"
        cells = _table_row(report, f"{lo}-{'inf' if hi is None else hi}", "(fixed bins)")
        if not ids:
            assert cells[1:6] == ["0", "-", "-", "-", "-"]
            continue
        expect = [str(len(ids))] + [f"{sum(per[a][i]['acc'] for i in ids) / len(ids):.3f}" for a in ("sprint", "rft")]
        expect += [f"{sum(per[a][i]['seq'] for i in ids) / len(ids):.1f}" for a in ("sprint", "rft")]
        assert cells[1:6] == expect
        total += len(ids)
    assert total == len(per["rft"])


def test_a_failing_stage_stops_with_one_line(tmp_path, capsys):
    # every example is longer than 8 tokens: training has nothing to train on and exits 2
    cfg = _tiny(tmp_path, **{"curate.tasks.n": 20, "train.data.seq_len": 8})
    out = tmp_path / "run"
    assert main(["recipe", "run", str(cfg), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    log = out / "train_sprint" / "log.txt"
    assert err == [f"sprint-jax recipe: stage train_sprint failed (exit 2); log: {log.resolve()}"]
    assert "no usable training examples" in log.read_text()
    status = _status(out, capsys)
    assert status["curate"] == "done" and status["train_sprint"] == "failed"
    assert all(status[s] == "pending" for s in STAGES[2:])


@pytest.mark.parametrize("change, match", [
    ({"train.optim.lrr": 1}, "unknown config field train.optim.lrr"),
    ({"train.data.train": ["x.jsonl"]}, "train.data.train is set by the recipe"),
    ({"eval.sets.0.data": "no/such/file.jsonl"}, "eval set chains: data 'no/such/file.jsonl' is not"),
    ({"train.epochs": -1}, "epochs must be > 0"),
    ({"curate.teacher.kind": "teachr"}, "curate.teacher.kind: 'teachr' is not one of"),
    ({"curate.tasks.max_chains": 5}, "curate.tasks.max_chains: the chains tokenizer has tags for at most 4"),
])
def test_bad_configs_are_one_line_exit_2(tmp_path, capsys, change, match):
    out = tmp_path / "run"
    assert main(["recipe", "run", str(_tiny(tmp_path, **change)), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sprint-jax recipe: error: ") and re.search(match, err[0]), err
    assert not (out / "state.json").exists()


def test_r1_recipe_needs_its_keys_from_the_environment_and_never_writes_them(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DEEPSEEK_API_KEY", raising=False)
    assert load_recipe_config(R1).eval.sets[0].data == "math500"   # loading (and `status`) needs no key
    assert main(["recipe", "run", str(R1), "--out", str(tmp_path / "run")]) == 2
    assert "DEEPSEEK_API_KEY is not set" in capsys.readouterr().err
    assert not (tmp_path / "run" / "state.json").exists()
    monkeypatch.setenv("DEEPSEEK_API_KEY", "sk-deepseek-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    cfg = load_recipe_config(R1)
    stages = runner.plan(cfg, tmp_path)
    assert [s.name for s in stages] == ["curate", "train_sprint", "train_rft", "eval_sprint_math500",
                                        "eval_rft_math500", "compare_math500", "eval_sprint_countdown",
                                        "eval_rft_countdown", "compare_countdown", "report"]
    # SPRINT's DAG model; the out-of-domain set that needs no data is on
    assert yaml.safe_load(stages[0].config)["dag"]["model"] == "gpt-4o-mini"
    from sprint_jax.config import from_dict
    from sprint_jax.train.config import TrainConfig
    for s in stages:
        assert "secret" not in (s.config or "") and "secret" not in " ".join(s.command or [])
    train = {s.name: from_dict(TrainConfig, yaml.safe_load(s.config)) for s in stages if s.name.startswith("train")}
    sprint, rft = train["train_sprint"], train["train_rft"]
    assert sprint.data.seq_len == 32768 and sprint.epochs == 5 and sprint.optim.lr == 1e-5
    # the pair: each arm trains on its own file and names the other's as its partner
    assert sprint.data.train == rft.data.paired.train and rft.data.train == sprint.data.paired.train
    assert sprint.data.train[0].endswith("sprint.jsonl") and rft.data.layout == "flat"
    assert sprint.data.layout == "merge"      # the layout docs/experiments/layouts.md's flat measurement chose
    ev = next(s for s in stages if s.name == "eval_sprint_math500")
    assert ev.command[ev.command.index("--mode") + 1] == "parallel"
    assert ev.command[ev.command.index("--samples") + 1] == "8"
    decoding = Path(ev.command[ev.command.index("--config") + 1])
    assert decoding.name == "eval_r1_distill_7b.yaml" and decoding in ev.files       # its content is an input
    orch = yaml.safe_load(decoding.read_text())
    assert (orch["temperature"], orch["top_p"], orch["max_total_tokens"]) == (0.6, 0.95, 32768)


# ---------------------------------------------------------------------------------------------
# digests and skips, with each stage's command replaced by a writer of its outputs
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fake_stages(monkeypatch):
    """Each stage 'runs' by writing outputs that depend on its inputs (as a real stage's do: its
    inputs digest, recorded in state.json before it runs), and the names of the stages that ran
    are collected; a stage named in `fail` exits 3."""
    ran, fail = [], set()

    def execute(stage, out, log):
        ran.append(stage.name)
        log.write_text(f"fake {stage.name}\n")
        if stage.name in fail:
            return 3
        for p in stage.outputs:
            body = json.loads((out / "state.json").read_text())["stages"][stage.name]["inputs"]
            if p.suffix:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(body)
            else:
                p.mkdir(parents=True, exist_ok=True)
                (p / "weights").write_text(body)
        return 0

    monkeypatch.setattr(runner, "_execute", execute)
    return ran, fail


def _run(cfg_path: Path, out: Path, *sets: str) -> int:
    return main(["recipe", "run", str(cfg_path), "--out", str(out), *[a for s in sets for a in ("--set", s)]])


def test_a_changed_input_reruns_its_stage_and_what_follows(tmp_path, fake_stages):
    ran, _ = fake_stages
    cfg, out = _tiny(tmp_path), tmp_path / "run"
    assert _run(cfg, out) == 0 and ran == STAGES
    ran.clear()
    assert _run(cfg, out) == 0 and ran == []
    # a train hyperparameter: both trainings and everything after them, not the curation
    assert _run(cfg, out, "train.optim.lr=0.002") == 0
    assert ran == STAGES[1:]
    ran.clear()
    # an eval setting: the evals, the comparison and the report
    assert _run(cfg, out, "train.optim.lr=0.002", 'eval.args=[--concurrency, "2"]') == 0
    assert ran == STAGES[3:]
    ran.clear()
    # an output changed behind the recipe's back: that stage reruns; it writes the same outputs
    # as before (same inputs), so what reads them has unchanged inputs and is not rerun
    (out / "train_rft" / "out" / "hf" / "weights").write_text("edited")
    assert _run(cfg, out, "train.optim.lr=0.002", 'eval.args=[--concurrency, "2"]') == 0
    assert ran == ["train_rft"]


def test_a_changed_task_file_is_an_input(tmp_path, fake_stages):
    ran, _ = fake_stages
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"problem": "1+1", "answer": "2"}\n')
    d = yaml.safe_load(_tiny(tmp_path).read_text())
    d["curate"] = {"tasks": {"source": "file", "path": str(tasks)}, "teacher": {"kind": "openai", "model": "m",
                   "api_key_env": ""}, "extractor": {"kind": "offline"}, "dag": {"kind": "offline"}}
    cfg, out = tmp_path / "file.yaml", tmp_path / "run"
    cfg.write_text(yaml.safe_dump(d))
    assert _run(cfg, out) == 0 and ran == STAGES
    ran.clear()
    tasks.write_text('{"problem": "1+2", "answer": "3"}\n')
    assert _run(cfg, out) == 0 and ran == STAGES


def test_a_failed_stage_resumes_with_its_outputs_kept(tmp_path, fake_stages, capsys):
    ran, fail = fake_stages
    cfg, out = _tiny(tmp_path), tmp_path / "run"
    fail.add("eval_rft_chains")
    assert _run(cfg, out) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"sprint-jax recipe: stage eval_rft_chains failed (exit 3); log: {(out / 'eval_rft_chains' / 'log.txt').resolve()}"]
    assert _status(out, capsys) == {**{s: "done" for s in STAGES[:4]}, "eval_rft_chains": "failed",
                                    "compare_chains": "pending", "report": "pending"}
    partial = out / "eval_rft_chains" / "out" / "partial.jsonl"     # what a killed eval leaves to resume from
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("{}\n")
    fail.clear()
    ran.clear()
    assert _run(cfg, out) == 0 and ran == STAGES[4:]
    assert partial.exists()                                          # same inputs: resumed, not wiped
    # a finished stage whose inputs changed starts afresh
    assert _run(cfg, out, 'eval.args=[--concurrency, "2"]') == 0 and not partial.exists()
    assert _status(out, capsys) == {s: "done" for s in STAGES}
    (out / "eval_sprint_chains" / "out" / "results.jsonl").write_text("edited\n")
    assert _status(out, capsys)["eval_sprint_chains"] == "stale"


def test_status_of_a_directory_without_a_run_is_one_line(tmp_path, capsys):
    assert main(["recipe", "status", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no recipe run" in err[0]


def test_a_moved_directory_keeps_its_stages(tmp_path, fake_stages, capsys):
    ran, _ = fake_stages
    cfg, out = _tiny(tmp_path), tmp_path / "run"
    assert _run(cfg, out) == 0 and ran == STAGES
    ran.clear()
    moved = tmp_path / "elsewhere"
    out.rename(moved)
    assert _status(moved, capsys) == {s: "done" for s in STAGES}
    assert _run(cfg, moved) == 0 and ran == []


def test_the_eval_config_file_is_an_input_of_the_evals(tmp_path, fake_stages):
    ran, _ = fake_stages
    decoding = tmp_path / "eval.yaml"
    decoding.write_text("max_stages: 3\n")
    cfg, out = _tiny(tmp_path, **{"eval.config": str(decoding)}), tmp_path / "run"
    assert _run(cfg, out) == 0 and ran == STAGES
    ran.clear()
    decoding.write_text("max_stages: 2\n")
    assert _run(cfg, out) == 0 and ran == STAGES[3:]
