"""A scaled-down demo (tiny budget): every stage produces its artifact and the report is sane."""
from __future__ import annotations

import json

from sprint_jax.config import from_dict
from sprint_jax.demo import DemoConfig, run_demo
from sprint_jax.model.hf import read_export_meta


def test_scaled_down_demo_produces_every_artifact(tmp_path, capsys):
    cfg = from_dict(DemoConfig, {
        "train_problems": 24, "test_problems": 3, "steps": 3, "batch_size": 4, "seq_len": 256,
        "warmup_steps": 1, "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "num_key_value_heads": 1},
        "layouts": ["trie", "merge"], "out": str(tmp_path)})
    report = run_demo(cfg, tmp_path, progress=False)

    for f in ("curate/sprint.jsonl", "curate/rft.jsonl", "curate/curation_report.json", "report.json",
              "plots/loss_curves.png", "plots/tokens.png", "plots/wall_clock.png"):
        assert (tmp_path / f).exists(), f
    for run, layout in (("sprint", "trie"), ("rft", "flat"), ("sprint_merge", "merge")):
        assert (tmp_path / "train" / run / "metrics.jsonl").exists()
        assert (tmp_path / "train" / run / "hf" / "model.safetensors").exists()
        meta = read_export_meta(tmp_path / "train" / run / "hf")     # train records how it trained
        assert meta["layout"] == layout and meta["tokenizer"] == "VocabTokenizer"
    sprint = [json.loads(x) for x in (tmp_path / "curate/sprint.jsonl").read_text().splitlines()]
    assert len(sprint) == 24 and all("<Plan_1>" in r["completion"] for r in sprint)

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["elapsed_s"] > 0
    for name in ("sprint_parallel", "sprint_serial", "rft_sequential"):
        r = on_disk[name]
        assert 0.0 <= r["accuracy"] <= 1.0
        assert 0 < r["mean_sequential_tokens"] <= r["mean_total_tokens"]
        assert r["wall_s"] > 0
        if name.startswith("sprint"):
            assert 0.0 <= r["format_valid"] <= 1.0
            assert 0.0 <= r["executions_exact"] <= 1.0 and 0.0 <= r["answer_matches_executions"] <= 1.0
        run_config = json.loads((tmp_path / "eval" / name / "report.json").read_text())["meta"]["config"]
        assert run_config["layout"] == ("trie" if name.startswith("sprint") else "flat")   # read from the export
        results = [json.loads(x) for x in (tmp_path / "eval" / name / "results.jsonl").read_text().splitlines()]
        assert len(results) == 3
        assert abs(sum(x["sequential_tokens"] for x in results) / 3 - r["mean_sequential_tokens"]) < 1e-9
    # the merge model: its evaluation ran with the join its export selects, on the same
    # budget; merge trains every token once, like flat, and fewer than the trie
    merge = on_disk["sprint_merge_parallel"]
    cfg_merge = json.loads((tmp_path / "eval" / "sprint_merge_parallel" / "report.json").read_text())["meta"]["config"]
    assert cfg_merge["layout"] == "merge" and cfg_merge["join"] is None     # None: resolved from the layout
    assert merge["join"] in ("merge", None)                                  # None: no stage ran executors
    assert on_disk["training"]["sprint_merge"]["steps"] == on_disk["training"]["sprint"]["steps"]
    per = on_disk["train_tokens_per_example"]
    assert per["merge"] == per["flat"] < per["trie"]
    assert merge["train_tokens_per_example"] > 0
    # the RFT baseline decodes plainly: sequential == total
    assert on_disk["rft_sequential"]["mean_sequential_tokens"] == on_disk["rft_sequential"]["mean_total_tokens"]
    assert report["test_problems"] == 3
    _check_printout(capsys.readouterr().out, tmp_path, cfg)


def _check_printout(text: str, out, cfg) -> None:
    """Numbered stage labels, a plain summary, and next commands that run as printed."""
    import re
    import shlex

    from sprint_jax.cli import main
    from sprint_jax.tasks import chains

    labels = [(int(a), int(b)) for a, b in re.findall(r"^\[(\d+)/(\d+)\]", text, re.M)]
    n = labels[-1][1]
    assert {b for _, b in labels} == {n} and [a for a, _ in labels] == sorted(a for a, _ in labels)
    assert {a for a, _ in labels} == set(range(1, n + 1)) and labels[-1][0] == n
    assert "vs RFT" not in text and "exec ok" not in text
    assert "seq/RFT: sequential tokens relative to the RFT baseline's" in text
    assert "per-call overheads" in text and "docs/design.md" in text
    # the next commands: this run's models, a query of its test set (drawn here as the demo draws it)
    seen = {tuple(t.answer["starts"]) for t in chains.generate(cfg.train_problems, cfg.seed, cfg.chains,
                                                                cfg.chains, cfg.chain_length)}
    first = chains.generate(1, cfg.seed + 10_000, cfg.chains, cfg.chains, cfg.chain_length, exclude=seen)[0]
    query = "Q: " + " ".join(map(str, first.answer["starts"]))
    commands = [shlex.split(line) for line in text.splitlines() if re.match(r"^  \S*sprint", line)]
    by_cmd = {}
    for argv in commands:
        i = next(k for k, a in enumerate(argv) if a in ("infer", "eval", "serve"))
        by_cmd.setdefault(argv[i], []).append(argv[i:])
    sprint_export = str(out / "train" / "sprint" / "hf")
    assert [a[-1] for a in by_cmd["infer"]] == [query, query]
    assert all(a[a.index("--model") + 1] == sprint_export for a in (by_cmd["infer"][0], by_cmd["eval"][0],
                                                                   by_cmd["serve"][0]))
    compare = [a for a in by_cmd["eval"] if a[1] == "compare"]
    evals = [a for a in by_cmd["eval"] if a[1] != "compare"]
    assert all("--data" in a and a[a.index("--data") + 1] == "chains" for a in evals)
    # eval compare names the two evals' --out, SPRINT's first
    assert len(compare) == 1 and compare[0][2:] == [a[a.index("--out") + 1] for a in evals]
    assert "its test set differs" in text             # this run's task shape is not the default one
    assert main(by_cmd["infer"][0]) == 0              # runs exactly as printed
    assert main(evals[1]) == 0
    import argparse
    from sprint_jax.serve import cli as serve_cli
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    p.parse_args(by_cmd["serve"][0][1:])


def test_execution_quality_counts_exact_chains_and_consistent_answers(tmp_path):
    from sprint_jax.tasks.chains import chain
    from sprint_jax.demo import _execution_quality

    starts = [7, 3, 9, 2]
    bodies = [chain(s, 12) for s in starts]
    bodies[1] = bodies[1][:-1] + "0"                       # one wrong execution (last digit changed)
    lasts = [int(b[-1]) for b in bodies]
    rec = {"query": "Q: 7 3 9 2\n", "final_answer": str(max(lasts)),
           "stages": [{"executions": [{"text": f" {b} </execution_1.{j}>"} for j, b in enumerate(bodies, 1)]}]}
    rec2 = dict(rec, final_answer=str((max(lasts) + 1) % 10))  # answer not from the executions
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps(rec2) + "\n")
    q = _execution_quality(path, 12)
    assert q == {"executions_exact": 6 / 8, "answer_matches_executions": 0.5}


def test_demo_config_missing_path_is_an_error_and_the_default_is_embedded(tmp_path, capsys):
    from sprint_jax.cli import main
    from sprint_jax.config import CONFIG_DIR, load_config

    assert main(["demo", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.yaml: no such file" in err[0]
    assert not (tmp_path / "o").exists()
    # without --config the embedded defaults run; configs/demo.yaml says the same
    assert load_config(DemoConfig, CONFIG_DIR / "demo.yaml") == DemoConfig()
