"""`sprint-jax selftrain`: the kept set, the training records and the per-round figures, checked
against values computed here from the files the run wrote; bad configs; a resumed round 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sprint_jax.cli import main
from sprint_jax.schema import Example
from sprint_jax.selftrain_cli import heldout_figures, keep_samples, training_records, yield_figures
from test_eval_sampling import _run_seed


def _s(pid, sample, correct=True, valid=True, seq=10, text=None):
    return {"id": pid, "sample": sample, "correct": correct, "format_valid": valid, "sequential_tokens": seq,
            "total_tokens": 2 * seq, "prompt": f"Q: {pid}\n", "text": text or f"<t {pid} {sample}>",
            "gold": {"value": 1}}


SAMPLES = [
    _s("a", 0, seq=30), _s("a", 1, seq=20), _s("a", 2, seq=20), _s("a", 3, correct=False, seq=5),
    _s("b", 0, valid=False, seq=3), _s("b", 1, correct=False, seq=4),
    _s("c", 0, seq=12), _s("c", 1, seq=11, valid=False),
]


def test_fastest_keeps_one_correct_well_formed_sample_per_problem_lowest_index_on_ties():
    kept = keep_samples(SAMPLES, "fastest")
    # a: samples 1 and 2 tie at 20 (3 is faster but wrong) -> 1; b: none valid and correct; c: 0
    assert [(s["id"], s["sample"]) for s in kept] == [("a", 1), ("c", 0)]
    assert [(s["id"], s["sample"]) for s in keep_samples(SAMPLES, "all")] == [("a", 0), ("a", 1), ("a", 2), ("c", 0)]


def test_the_default_filter_is_threadweavers_every_correct_well_formed_rollout():
    from sprint_jax.selftrain_cli import SelftrainConfig

    # format-valid and correct, every sample of a problem (a0, a1, a2; b has none; c0 but not c1)
    assert SelftrainConfig().keep == "all"
    assert [(s["id"], s["sample"]) for s in keep_samples(SAMPLES)] == [("a", 0), ("a", 1), ("a", 2), ("c", 0)]


def test_rounds_train_in_the_start_models_tag_format_and_layout(tmp_path):
    from sprint_jax.selftrain_cli import SelftrainConfig, train_config
    from conftest import make_hf_checkpoint

    model = make_hf_checkpoint(tmp_path / "m")
    (model / "sprint_jax.json").write_text(json.dumps({"layout": "trie", "format": "threadweaver"}))
    cfg = SelftrainConfig(model=str(model), train={"epochs": 1})
    tc = train_config(cfg, str(model), tmp_path / "train.jsonl", check_only=True)
    assert (tc.data.format, tc.data.layout, tc.epochs) == ("threadweaver", "trie", 1)


def test_yield_and_heldout_figures_are_the_hand_counts():
    kept = keep_samples(SAMPLES, "fastest")
    fig = yield_figures(SAMPLES, kept)
    assert (fig["sampled"], fig["kept"], fig["problems"], fig["problems_with_kept"]) == (8, 2, 3, 2)
    assert fig["yield"] == 0.25
    assert fig["kept_mean_sequential_tokens"] == 16.0                  # (20 + 12) / 2
    assert fig["sampled_mean_sequential_tokens"] == 105 / 8            # 30+20+20+5+3+4+12+11
    rows = [{"correct": True, "sequential_tokens": 10, "format_valid": True},
            {"correct": False, "sequential_tokens": 13, "format_valid": False},
            {"correct": True, "sequential_tokens": 16, "format_valid": True}]
    assert heldout_figures(rows) == {"heldout_n": 3, "accuracy": 2 / 3, "mean_sequential_tokens": 13.0,
                                     "format_valid": 2 / 3}


def test_training_records_parse_as_examples_with_the_trajectory_text():
    kept = keep_samples(SAMPLES, "fastest")
    recs = training_records(kept, "sprint", 2)
    for rec, s in zip(recs, kept):
        ex = Example.from_record(json.loads(json.dumps(rec)), "train.jsonl:1")
        assert (ex.kind, ex.prompt, ex.completion) == ("sprint", s["prompt"], s["text"])
        assert ex.meta["selftrain_round"] == 2 and ex.meta["sample"] == s["sample"]
    assert len({r["id"] for r in recs}) == len(recs)


# ---------------------------------------------------------------------------------------------
# Bad configs: one line, exit 2
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, match", [
    ({"samplez": 3}, "unknown config field samplez"),
    ({"samples": 0}, "samples must be >= 1"),
    ({"keep": "slowest"}, "keep: 'slowest' is not one of"),
    ({"orchestrator": {"temperature": 0.0}}, "identical; set orchestrator.temperature"),
    ({"orchestrator": {"max_stagez": 2}}, "unknown config field orchestrator.max_stagez"),
    ({"train": {"optim": {"lr": "fast"}}}, "train.optim.lr: expected a number"),
    ({"train": {"model": {"name": "x"}}}, "train.model.name is set by selftrain"),
    ({"model": "no/such/dir"}, "model: no/such/dir is not a directory"),
    ({"heldout_tasks": {"data": "nope"}}, "heldout_tasks: --data 'nope' is not"),
])
def test_bad_configs_are_one_line_exit_2(tmp_path, capsys, change, match):
    from sprint_jax.config import CONFIG_DIR

    model = tmp_path / "model"          # a model directory as far as the config checks read it
    model.mkdir()
    (model / "config.json").write_text((CONFIG_DIR / "model_tiny.json").read_text())
    cfg = {"model": str(model), "rounds": 1, "samples": 2, "orchestrator": {"temperature": 1.0}, **change}
    if "orchestrator" in change and "temperature" not in change["orchestrator"]:
        cfg["orchestrator"] = {"temperature": 1.0, **change["orchestrator"]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc = main(["selftrain", "--config", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and match in err, err


# ---------------------------------------------------------------------------------------------
# End to end on a tiny chains task with a tiny model trained here
# ---------------------------------------------------------------------------------------------
CHAINS, LENGTH, N = 2, 1, 6


@pytest.fixture(scope="module")
def chains_model(tmp_path_factory) -> Path:
    """A 1-layer Qwen2 that has memorised N two-chain problems (SPRINT, merge layout), trained with
    the project's trainer on examples written here in the demo's curated shape."""
    from sprint_jax.config import from_dict
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks import chains
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    d = tmp_path_factory.mktemp("chains_model")
    tasks = chains.generate(3000, 0, CHAINS, CHAINS, LENGTH)[:N]
    lines = []
    for t in tasks:
        starts = t.answer["starts"]
        plan = " ".join(f"<prompt_1.{j + 1}> Chain {s}: </prompt_1.{j + 1}>" for j, s in enumerate(starts))
        execs = "\n".join(f"<execution_1.{j + 1}> {chains.chain(s, LENGTH)} </execution_1.{j + 1}>"
                          for j, s in enumerate(starts))
        completion = (f"<Plan_1> {plan} </Plan_1>\n{execs}\n<Plan_2> {chains.COMBINE} </Plan_2>\n"
                      f"<Final Answer> {t.answer['value']} </Final Answer>")
        lines.append(json.dumps({"id": t.id, "kind": "sprint", "prompt": chains.prompt_for(t),
                                 "completion": completion, "answer": t.answer}))
    (d / "sft.jsonl").write_text("\n".join(lines) + "\n")
    tok = VocabTokenizer(chains.token_vocabulary(max_prompts=CHAINS), eos_token="<eos>", pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "loss_chunk": 0},
        "data": {"train": [str(d / "sft.jsonl")], "layout": "merge", "seq_len": 128},
        "optim": {"lr": 1e-2, "warmup_steps": 5, "batch_size": 4},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "steps": 120, "log_every": 40, "tensorboard": False, "plot": False})
    return Path(train(tc, d / "run", tokenizer=tok, progress=False)["export_dir"])


def _config(tmp_path: Path, model: Path, rounds: int, **extra) -> Path:
    tasks = {"data": "chains-train", "limit": N, "chains": CHAINS, "chain_length": LENGTH}
    cfg = {"model": str(model), "rounds": rounds, "samples": 3, "keep": "fastest",
           "train_tasks": tasks, "heldout_tasks": tasks, "allow_overlap": True,
           "orchestrator": {"max_stages": 3, "max_prompts": CHAINS, "max_planner_tokens": 24,
                            "max_branch_tokens": 8, "max_total_tokens": 128, "temperature": 0.8, "seed": 0},
           "train": {"steps": 3, "data": {"seq_len": 128}, "optim": {"lr": 1e-3, "batch_size": 4}},
           "concurrency": 4, "max_seq_len": 128, "prefill_chunk": 32, "decode_chunk": 8, **extra}
    path = tmp_path / "selftrain.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_rounds_end_to_end_then_resume_into_round_2(tmp_path, capsys, chains_model):
    out = tmp_path / "out"
    assert main(["selftrain", "--config", str(_config(tmp_path, chains_model, 1)), "--out", str(out),
                 "--no-progress"]) == 0
    samples = _jsonl(out / "round_1" / "samples.jsonl")
    assert len(samples) == 3 * N and {(s["id"], s["sample"]) for s in samples} == {
        (f"chains-0-{i}", k) for i in range(N) for k in range(3)}
    # the kept set, computed here: correct and format-valid, fewest sequential tokens per problem
    best = {}
    for s in samples:
        if s["correct"] and s["format_valid"]:
            key = (s["sequential_tokens"], s["sample"])
            if s["id"] not in best or key < best[s["id"]][0]:
                best[s["id"]] = (key, s)
    assert best, "the memorised model should solve some of its own training problems"
    train = _jsonl(out / "round_1" / "train.jsonl")
    assert len(train) == len(best)
    for rec in train:
        ex = Example.from_record(rec, "train.jsonl")
        pid = ex.id.rsplit("-r1-", 1)[0]
        sample = best[pid][1]
        assert (ex.prompt, ex.completion, ex.meta["sample"]) == (sample["prompt"], sample["text"], sample["sample"])
        assert ex.prompt.startswith("Q: ") and ex.completion.startswith("<Plan_1>")
    # the samples file agrees with the eval files it was written from
    results = _jsonl(out / "round_1" / "sampling_eval" / "results.jsonl")
    assert [(r["correct"], r["sequential_tokens"]) for r in results] == [
        (s["correct"], s["sequential_tokens"]) for s in samples]
    # every sample drew with its own problem's seed (the rule by hand on orchestrator.seed 0), so
    # problems draw independently; the greedy held-out runs keep the config's seed
    seeds = {(r["id"], r["sample"]): r["config"]["seed"]
             for r in _jsonl(out / "round_1" / "sampling_eval" / "records.jsonl")}
    assert seeds == {(s["id"], s["sample"]): _run_seed(0, s["id"], s["sample"]) for s in samples}
    assert len(set(seeds.values())) == 3 * N
    assert {r["config"]["seed"] for r in _jsonl(out / "round_1" / "heldout_eval" / "records.jsonl")} == {0}
    done = json.loads((out / "round_1" / "done.json").read_text())
    assert (done["sampled"], done["kept"], done["problems_with_kept"]) == (3 * N, len(best), len(best))
    assert done["yield"] == len(best) / (3 * N)
    rows = _jsonl(out / "round_1" / "eval.jsonl")
    assert done["heldout_n"] == len(rows) == N
    assert done["accuracy"] == sum(r["correct"] for r in rows) / N
    assert done["mean_sequential_tokens"] == sum(r["sequential_tokens"] for r in rows) / N
    assert (out / "round_1" / "model" / "hf" / "config.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [0, 1]

    # resume: round 1 is read from its done marker, round 2 samples with round 1's model
    before = (out / "round_1" / "samples.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["selftrain", "--config", str(_config(tmp_path, chains_model, 2)), "--out", str(out),
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "[round 0/2] done earlier" in text and "[round 1/2] done earlier" in text
    assert (out / "round_1" / "samples.jsonl").stat().st_mtime_ns == before
    assert f"with {out / 'round_1' / 'model' / 'hf'}" in text
    assert (out / "round_2" / "done.json").exists() and (out / "round_2" / "train.jsonl").exists()
    assert [r["round"] for r in json.loads((out / "summary.json").read_text())["rounds"]] == [0, 1, 2]

    # another config into the same directory is refused with one line
    assert main(["selftrain", "--config", str(_config(tmp_path, chains_model, 2, samples=2)), "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "differs in: samples" in err
