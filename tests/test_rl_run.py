"""P-GRPO end to end on a tiny SPRINT model trained here by the real trainer: rollouts are the
`eval` path's runs under the same seeds, `sprint-jax rl` runs and resumes bit for bit."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

CHAINS, LENGTH = 2, 2


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    """A tiny SPRINT model (trie layout) on 2 chains of 2 steps: good enough to plan, fork and
    answer, not good enough to be always right (the RL signal needs mixed groups)."""
    from sprint_jax import format as fmt
    from sprint_jax.config import from_dict
    from sprint_jax.tasks import chains
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    root = tmp_path_factory.mktemp("rl_sft")
    tasks = chains.generate(300, 1, CHAINS, CHAINS, LENGTH)
    with open(root / "sprint.jsonl", "w") as f:
        for t in tasks:
            starts = t.answer["starts"]
            traj = fmt.Trajectory(stages=[
                fmt.Stage(1, [fmt.Prompt(f"Chain {s}:") for s in starts], [chains.chain(s, LENGTH) for s in starts]),
                fmt.Stage(2, [chains.COMBINE])], final_answer=str(t.answer["value"]))
            f.write(json.dumps({"id": t.id, "kind": "sprint", "prompt": chains.prompt_for(t),
                                "completion": fmt.render_completion(traj)}) + "\n")
    # SPRINT's entries only: the model this fixture trains is tuned to be right only sometimes, and a
    # vocabulary with ThreadWeaver's tags (more output ids, other initial weights) gave one whose
    # groups all agreed (no reward spread)
    tok = VocabTokenizer(token_vocabulary(max_prompts=CHAINS, threadweaver=False), eos_token="<eos>",
                         pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "loss_chunk": 0},
        "data": {"train": [str(root / "sprint.jsonl")], "layout": "trie", "seq_len": 128},
        "optim": {"lr": 1e-2, "warmup_steps": 5, "batch_size": 8},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "steps": 60, "log_every": 20, "tensorboard": False, "plot": False})
    summary = train(tc, root / "train", tokenizer=tok, progress=False)
    return Path(summary["export_dir"])


def _sets(model: Path) -> list[str]:
    """The tiny run's --set overrides of configs/rl_tiny_cpu.yaml."""
    return [f"policy.path={model}", f"tasks.chains={CHAINS}", f"tasks.chain_length={LENGTH}", "tasks.n=300",
            "tasks.seed=1", "tasks.eval_n=4", "rollout.group_size=4", "rollout.prompts_per_step=2",
            "rollout.orchestrator.max_prompts=2", "rollout.orchestrator.max_planner_tokens=24",
            "rollout.orchestrator.max_branch_tokens=8", "rollout.orchestrator.max_total_tokens=96",
            "rollout.max_seq_len=160", "rollout.prefill_chunk=64", "loss.seq_len=128", "loss.rows_per_micro=4",
            "optim.lr=0.003", "checkpoint.every=0", "eval.every=0", "tensorboard=false", "plot=false",
            "export.enabled=false"]


def _rl_config(model: Path, **over):
    from sprint_jax.config import CONFIG_DIR
    from sprint_jax.rl.config import load_rl_config
    return load_rl_config(CONFIG_DIR / "rl_tiny_cpu.yaml", _sets(model) + [f"{k}={v}" for k, v in over.items()])


def _argv(model: Path, out: Path, *sets: str) -> list[str]:
    """`sprint-jax rl` on the tiny run (one step unless `sets` says otherwise)."""
    from sprint_jax.config import CONFIG_DIR
    return ["rl", "--config", str(CONFIG_DIR / "rl_tiny_cpu.yaml"), "--out", str(out), "--no-progress"] + \
        [x for s in [*_sets(model), "steps=1", *sets] for x in ("--set", s)]


def test_rollouts_are_eval_runs_at_concurrency(sft_model, tmp_path):
    """All G x prompts runs of a step at once on the engine, each with its own seed == `evaluate`
    at concurrency 3 (the `sprint-jax eval --concurrency` path), one eval per config seed (which
    draws problem t with `run_seed(seed, t.id, 0)`, so the rollouts take those seeds); each call's
    recorded completion is what the record says it wrote."""
    from sprint_jax.eval.evaluate import default_prompt, evaluate, run_seed
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model.convert import load_model
    from sprint_jax.model.tokenizer import load_tokenizer
    from sprint_jax.rl.rollout import Rollouts
    from sprint_jax.rl.trainer import load_tasks, rollout_seed

    cfg = _rl_config(sft_model)
    tok = load_tokenizer(sft_model)
    ro = cfg.rollout
    engine = Engine(load_model(sft_model), tok, max_seqs=6, max_children=2, max_seq_len=ro.max_seq_len,
                    max_branch_tokens=ro.orchestrator.max_branch_tokens + 32, prefill_chunk=ro.prefill_chunk)
    tasks = load_tasks(cfg)[0][:3]
    seeds = [rollout_seed(0, 0, 0, g) for g in range(2)]
    queries = [default_prompt(t) for s in seeds for t in tasks]
    run_seeds = [run_seed(s, str(t.id), 0) for s in seeds for t in tasks]
    trajs = Rollouts(engine, ro.orchestrator).run(queries, run_seeds, "parallel")
    strip = lambda d: {k: v for k, v in d.items() if not k.endswith("_s") and k != "stages"}  # noqa: E731
    n_exec = 0
    for g, s in enumerate(seeds):
        out = tmp_path / f"seed{g}"
        evaluate(engine, tasks, "parallel", orchestrator_config=dataclasses.replace(ro.orchestrator, seed=s),
                 out_dir=out, progress=False, concurrency=3)
        evs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
        for t, ev, tr in zip(tasks, evs, trajs[g * len(tasks):(g + 1) * len(tasks)]):
            assert tr.seed == run_seed(s, str(t.id), 0)
            mine = tr.record.to_json()
            assert strip(ev) == {**strip(mine), "id": t.id, "sample": 0}     # eval numbers its samples
            assert [[e["text"] for e in st["executions"]] for st in ev["stages"]] == \
                [[e.text for e in st.executions] for st in tr.record.stages]
            planners = [u for u in tr.units if u.kind == "planner"]
            execs = [u for u in tr.units if u.kind == "executor"]
            assert [tok.decode(u.completion) for u in planners][:len(tr.record.stages)] == \
                [st.planner_text for st in tr.record.stages]
            forked = [e for st in tr.record.stages if st.executor_mode == "shared" for e in st.executions]
            assert len(execs) == len(forked)
            for u, e in zip(execs, forked):
                assert len(u.completion) == e.tokens
                text = tok.decode(u.completion[:-1] if e.stop_reason == "eos" else u.completion)
                assert text.startswith(e.text) if e.stop_reason == "stop" else text == e.text
            assert sum(len(u.completion) for u in tr.units) == tr.record.total_tokens
            for u in tr.units:                                   # every call starts from the query's tokens
                assert u.context[:len(engine.encode(default_prompt(t)))] == engine.encode(default_prompt(t))
            n_exec += len(execs)
    assert n_exec > 0, "the tiny SFT model never forked: the test would not cover executors"
    assert len({json.dumps(strip(tr.record.to_json())) for tr in trajs}) > len(tasks), "seeds made no difference"


def test_rl_resume_is_bitwise_and_cli(sft_model, tmp_path):
    """4 steps straight (through `sprint-jax rl`) == 2 steps, stop, resume to 4 (metrics bit for bit,
    timings aside); the RL signal is there (some groups mixed) and the held-out eval is written."""
    from sprint_jax.cli import main
    from sprint_jax.rl.trainer import TIMING_KEYS, run_rl

    cfg = _rl_config(sft_model, steps=4)
    assert main(_argv(sft_model, tmp_path / "straight", "steps=4", "export.enabled=true")) == 0
    assert run_rl(cfg, tmp_path / "split", progress=False, stop_after=2) == {"stopped_at": 2}
    run_rl(cfg, tmp_path / "split", progress=False)

    def rows(d):
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
                for line in (d / "metrics.jsonl").read_text().splitlines()]
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "split")
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert a == b
    steps = [r for r in a if "reward" in r]
    assert any(r["adv_abs_mean"] > 0 for r in steps), "no group had a reward spread: nothing was learnt"
    assert len({r["mean_logp"] for r in steps}) == len(steps)       # the policy moved between steps
    for r in steps:                          # per-shape metrics: the shape mix covers the runs, accuracy adds up
        shapes = [k.split("/", 1)[1] for k in r if k.startswith("shape_frac/")]
        assert shapes and abs(sum(r[f"shape_frac/{s}"] for s in shapes) - 1) < 1e-9
        assert abs(sum(r[f"shape_frac/{s}"] * r[f"shape_acc/{s}"] for s in shapes) - r["accuracy"]) < 1e-9
    ev0 = a[0]
    shapes = [k.split("/", 1)[1] for k in ev0 if k.startswith("eval_shape_frac/")]
    assert shapes and abs(sum(ev0[f"eval_shape_frac/{s}"] * ev0[f"eval_shape_acc/{s}"] for s in shapes)
                          - ev0["eval_accuracy"]) < 1e-9
    assert (tmp_path / "straight" / "eval" / "report.json").exists()
    assert (tmp_path / "straight" / "eval_start" / "results.jsonl").exists()
    # the export says how to run it: the policy's prompt format and tokenizer, the rollouts' layout,
    # and a fingerprint holding the policy's problems and every RL training problem
    from sprint_jax.eval.cli import check_overlap
    from sprint_jax.model.hf import read_export_meta
    from sprint_jax.rl.trainer import load_tasks
    from sprint_jax.train.fingerprint import read_fingerprint
    export, policy = read_export_meta(tmp_path / "straight" / "hf"), read_export_meta(sft_model)
    assert export["layout"] == "trie" == policy["layout"]
    assert {k: export.get(k) for k in ("prompt_format", "tokenizer")} == \
        {k: policy.get(k) for k in ("prompt_format", "tokenizer")}
    assert read_fingerprint(sft_model) <= read_fingerprint(tmp_path / "straight" / "hf")
    train_tasks = load_tasks(cfg)[0]
    assert check_overlap(tmp_path / "straight" / "hf", train_tasks, allow=True)["overlap"] == len(train_tasks)


def test_rl_cli_rejects_a_missing_model(tmp_path, capsys):
    from sprint_jax.cli import main
    from sprint_jax.config import CONFIG_DIR

    rc = main(["rl", "--config", str(CONFIG_DIR / "rl_tiny_cpu.yaml"), "--out", str(tmp_path / "x"),
               "--set", f"policy.path={tmp_path / 'nope'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "policy.path" in err and "Traceback" not in err


# ---- refusals before anything is allocated or written ---------------------------------------------

class _EngineReached(Exception):
    """Raised in place of building the rollout engine: every check before it passed."""


@pytest.fixture
def no_engine(monkeypatch):
    from sprint_jax.infer.engine import Engine

    def refuse(*args, **kw):
        raise _EngineReached
    monkeypatch.setattr(Engine, "__init__", refuse)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_rl_refuses_an_out_directory_in_use(sft_model, tmp_path, capsys):
    """Two runs into one --out both ran to the end (metrics.jsonl steps 1, 1, 2, 2; both wrote
    checkpoints): the second now stops at once, naming the holder, as `train`, `eval`, `curate` do."""
    from conftest import start_lock_holder
    from sprint_jax.cli import main

    out = tmp_path / "out"
    holder = start_lock_holder(out)
    try:
        rc = main(_argv(sft_model, out))
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2
    line = _one_line(capsys)
    assert f"rl --out {out} is in use by another run (pid {holder.pid}" in line
    assert sorted(p.name for p in out.iterdir()) == [".sprint-jax.lock"]       # nothing written


def test_rl_refuses_a_max_seq_len_without_room_after_the_prompts(sft_model, tmp_path, capsys, no_engine):
    """rollout.max_seq_len must hold the longest prompt (training or held-out) plus a generated
    token; below that every rollout ended before its first token and the run 'succeeded'."""
    from sprint_jax.cli import main
    from sprint_jax.model.tokenizer import load_tokenizer
    from sprint_jax.tasks import chains

    tok = load_tokenizer(sft_model)
    longest = max(len(tok.encode(f"Q: {' '.join(map(str, t.answer['starts']))}\n", add_special_tokens=False))
                  for t in chains.generate(300, 1, CHAINS, CHAINS, LENGTH))
    assert main(_argv(sft_model, tmp_path / "a", f"rollout.max_seq_len={longest}")) == 2
    line = _one_line(capsys)
    assert f"rollout.max_seq_len = {longest} cannot hold the prompts" in line and f"at least {longest + 1}" in line
    assert not (tmp_path / "a" / "config.yaml").exists()
    with pytest.raises(_EngineReached):                               # one token of room is enough
        main(_argv(sft_model, tmp_path / "b", f"rollout.max_seq_len={longest + 1}"))


def test_rl_refuses_a_kv_cache_larger_than_free_memory(sft_model, tmp_path, capsys, monkeypatch, no_engine):
    """`rollout.concurrency=100000` was killed by the kernel; now the KV cache `eval` would allocate
    for it is checked against the free memory first. The estimate, from config.json by hand: K and V
    of every layer and KV head for 100000 runs, each 160 + 16 (a decode chunk) planner positions
    in 11 pages of 16 and 2 branches of 8 + 32 + 16 positions in 4 pages and a copy of the page
    the fork splits, fp32."""
    from sprint_jax.cli import main
    from sprint_jax.model import capacity

    c = json.loads((sft_model / "config.json").read_text())
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * 4
    need = per_token * 100_000 * 16 * (11 + 2 * (4 + 1))
    monkeypatch.setattr(capacity, "available_memory_bytes", lambda: need)
    with pytest.raises(_EngineReached):                               # exactly enough: it goes on
        main(_argv(sft_model, tmp_path / "a", "rollout.concurrency=100000"))
    monkeypatch.setattr(capacity, "available_memory_bytes", lambda: need - 1)
    assert main(_argv(sft_model, tmp_path / "b", "rollout.concurrency=100000")) == 2
    line = _one_line(capsys)
    assert f"needs about {need / 2 ** 30:.1f} GiB" in line and "rollout KV cache" in line
    assert "rollout.concurrency" in line


def test_rl_refuses_a_loss_row_past_the_models_positions(sft_model, tmp_path, capsys, no_engine):
    """loss.seq_len is checked against max_position_embeddings (256 here) as `train` checks
    data.seq_len: rows past it would train positions the model never had."""
    from sprint_jax.cli import main

    assert main(_argv(sft_model, tmp_path / "a", "loss.seq_len=257")) == 2
    assert "loss.seq_len = 257 is more than the model's max_position_embeddings (256)" in _one_line(capsys)
    with pytest.raises(_EngineReached):
        main(_argv(sft_model, tmp_path / "b", "loss.seq_len=256"))


def test_rl_refuses_the_removed_rollout_engine_key_in_one_line(sft_model, tmp_path, capsys, no_engine):
    """Every rollout runs on the one engine: a config that still sets rollout.engine (batch | single)
    is refused in one line naming the key, before anything is built."""
    from sprint_jax.cli import main

    assert main(_argv(sft_model, tmp_path / "out", "rollout.engine=batch")) == 2
    assert "rollout.engine" in _one_line(capsys)
