"""`eval --data chains`: the demo's held-out test set, so a model `sprint-jax demo` trained can be
evaluated (and compared) with `eval`; a rerun over fewer of its problems keeps the others."""
from __future__ import annotations

import json

from sprint_jax.cli import main
from sprint_jax.demo import DemoConfig
from sprint_jax.eval.cli import load_tasks
from sprint_jax.tasks import chains, task_prompt


def _demo_test_tasks(cfg: DemoConfig):
    """The held-out problems as demo.run_demo builds them from its config."""
    train_tasks = chains.generate(cfg.train_problems, cfg.seed, cfg.chains, cfg.chains, cfg.chain_length)
    seen = {tuple(t.answer["starts"]) for t in train_tasks}
    return chains.generate(cfg.test_problems, cfg.seed + 10_000, cfg.chains, cfg.chains, cfg.chain_length,
                           exclude=seen)


def _key(tasks):
    return [(t.id, t.kind, t.problem, t.answer) for t in tasks]


def test_data_chains_is_the_demos_test_set():
    cfg = DemoConfig()
    ref = _demo_test_tasks(cfg)
    got = load_tasks("chains")
    assert len(got) == cfg.test_problems == 100 and _key(got) == _key(ref)
    assert [task_prompt(t) for t in got] == [chains.prompt_for(t) for t in ref]    # the prompt the demo uses
    assert _key(load_tasks("chains", limit=7)) == _key(ref[:7])
    other = DemoConfig(seed=3)
    assert _key(load_tasks("chains", data_seed=3)) == _key(_demo_test_tasks(other))
    # none of them is a training problem of the demo
    train = {tuple(t.answer["starts"]) for t in chains.generate(cfg.train_problems, cfg.seed, 4, 4, 12)}
    assert not any(tuple(t.answer["starts"]) in train for t in got)


def test_a_demo_style_model_evaluates_on_it(hf_untied, tmp_path, capsys):
    """The tiny Qwen2 with the demo's tokenizer (random weights: the checks are that it runs on the
    demo's problems, and that a rerun over fewer of them keeps the rest)."""
    import shutil

    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model.tokenizer import VocabTokenizer

    cfg = DemoConfig()
    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    VocabTokenizer(token_vocabulary(max_prompts=cfg.chains), eos_token="<eos>", pad_token="<pad>").save(model / "vocab_tokenizer.json")
    out = tmp_path / "eval"
    base = ["eval", "--model", str(model), "--data", "chains", "--mode", "parallel", "--out", str(out),
            "--no-progress", "--concurrency", "1", "--max-seq-len", "64", "--decode-chunk", "8",
            "--prefill-chunk", "32", "--max-stages", "3", "--max-prompts", "2", "--max-branch-tokens", "6",
            "--max-planner-tokens", "6", "--max-total-tokens", "12"]
    assert main(base + ["--limit", "2"]) == 0
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [t.id for t in _demo_test_tasks(cfg)[:2]]
    assert all(r["kind"] == "chains" and r["total_tokens"] > 0 for r in rows)
    capsys.readouterr()
    assert main(base + ["--limit", "1"]) == 0
    printed = capsys.readouterr().out
    assert [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()] == rows
    assert "over the 1 problem(s) asked for (2 in " in printed and "1 of them finished earlier" in printed
    assert json.loads((out / "report.json").read_text())["n"] == 1
