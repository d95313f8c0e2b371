"""ThreadWeaver's recipe: configs/recipe_threadweaver_qwen3_8b.yaml against the paper's App. C and
§E.2 values, read from the stage configs the recipe generates (what each stage would run); the
curriculum's phase files; an eval set fetched from a Hugging Face dataset directory; and the tiny
CPU twin end to end, its report naming every stage."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from sprint_jax.cli import main
from sprint_jax.config import CONFIG_DIR, from_dict
from sprint_jax.recipe import runner
from sprint_jax.recipe.config import load_recipe_config

QWEN3 = CONFIG_DIR / "recipe_threadweaver_qwen3_8b.yaml"
TINY = CONFIG_DIR / "recipe_threadweaver_tiny_cpu.yaml"
PROMPTS = "/data/polaris_53k.jsonl"


def _stages(tmp_path: Path, *sets: str) -> dict:
    cfg = load_recipe_config(QWEN3, [f"prompts={PROMPTS}", *sets])
    return {s.name: s for s in runner.plan(cfg, tmp_path / "run")}


def _conf(stage) -> dict:
    return yaml.safe_load(stage.config)


def _arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_the_qwen3_recipe_has_every_app_c_value(tmp_path):
    from sprint_jax.rl.config import RLConfig
    from sprint_jax.selftrain_cli import SelftrainConfig
    from sprint_jax.train.config import TrainConfig

    stages = _stages(tmp_path)
    # the prompts the user supplies feed the curation, the self-training and P-GRPO
    assert _conf(stages["curate"])["tasks"]["path"] == PROMPTS
    assert _conf(stages["curate"])["restructure"] == "threadweaver_rewrite"

    # initial SFT: 8 epochs (the staged curriculum's), AdamW lr 1e-5, batch 16, max length 40,960,
    # ThreadWeaver's format in the trie layout; the sequential baseline the same, 8 epochs
    mix = _conf(stages["mix"])
    assert [(p["parallel_fraction"], p["epochs"]) for p in mix["phases"]] == [
        (0.0, 2.0), (0.1, 1.0), (0.5, 1.0), (0.5, 1.0), (0.9, 1.0), (1.0, 2.0)]      # §E.2
    sft = [from_dict(TrainConfig, _conf(stages[f"train_sprint_{k}"])) for k in range(1, 7)]
    rft = from_dict(TrainConfig, _conf(stages["train_rft"]))
    assert sum(t.epochs for t in sft) == 8 and rft.epochs == 8
    for t in sft + [rft]:
        assert (t.optim.lr, t.optim.batch_size, t.data.seq_len, t.data.format) == (1e-5, 16, 40960, "threadweaver")
        assert t.optim.weight_decay > 0                       # AdamW: decoupled weight decay
    assert {t.data.layout for t in sft} == {"trie"}
    for k in range(2, 7):                                     # each phase from the previous one's export
        assert sft[k - 1].model.name == str(tmp_path.resolve() / "run" / f"train_sprint_{k - 1}" / "out" / "hf")

    # self-training: 1 epoch with the same SFT settings, every rollout with a valid format and a
    # correct answer, rollouts at 40k tokens across branches; the sequential arm samples sequentially
    for arm, mode, start in (("sprint", "parallel", "train_sprint_6"), ("rft", "sequential", "train_rft")):
        st = _conf(stages[f"selftrain_{arm}"])
        cfg = from_dict(SelftrainConfig, st)
        assert (cfg.keep, cfg.mode, cfg.model) == ("all", mode, str(tmp_path.resolve() / "run" / start / "out" / "hf"))
        assert cfg.train_tasks.data == PROMPTS
        assert cfg.train["epochs"] == 1 and cfg.train["optim"]["lr"] == 1e-5
        assert cfg.train["optim"]["batch_size"] == 16 and cfg.train["data"]["seq_len"] == 40960
        assert cfg.orchestrator["max_total_tokens"] == 40960

    # P-GRPO: 8 samples per prompt, 128 prompts per step, Adam lr 5e-6, 350 steps, no KL, the
    # advantage centred on each prompt's group mean (no std division), 40k-token rollouts; the
    # sequential baseline's RL is the same but for its rollout mode and the acceleration bonus
    rl = {arm: _conf(stages[f"rl_{arm}"]) for arm in ("sprint", "rft")}
    for arm, mode, start in (("sprint", "parallel", "selftrain_sprint"), ("rft", "sequential", "selftrain_rft")):
        c = from_dict(RLConfig, rl[arm])
        assert (c.rollout.group_size, c.rollout.prompts_per_step, c.steps) == (8, 128, 350)
        assert (c.optim.lr, c.optim.weight_decay, c.loss.kl_coef, c.reward.std_normalise) == (5e-6, 0.0, 0.0, False)
        assert c.rollout.orchestrator.max_total_tokens == 40960 and c.tasks.source == PROMPTS
        assert c.rollout.mode == mode and c.policy.path.endswith(f"{start}/out/round_1/model/hf")
    assert rl["rft"]["reward"]["rho"] == 0.0 and rl["sprint"]["reward"]["rho"] == 0.5
    strip = lambda d: {**d, "policy": {**d["policy"], "path": None}, "rollout": {**d["rollout"], "mode": None},  # noqa: E731
                       "reward": {**d["reward"], "rho": None}}
    assert strip(rl["sprint"]) == strip(rl["rft"])

    # evaluation on the six benchmarks, 40k tokens across branches, each arm's RL model
    names = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
    for n in names:
        for arm, mode in (("sprint", "parallel"), ("rft", "sequential")):
            cmd = stages[f"eval_{arm}_{n}"].command
            assert _arg(cmd, "--model").endswith(f"rl_{arm}/out/hf") and _arg(cmd, "--mode") == mode
            assert "max_total_tokens=40960" in cmd
    assert [s for s in stages if s.startswith("data_")] == [f"data_{n}" for n in names if n != "math500"]


def test_the_gradual_curriculum_raises_the_parallel_share_by_epoch(tmp_path):
    stages = _stages(tmp_path, "curriculum.kind=gradual")
    phases = _conf(stages["mix"])["phases"]
    assert [p["parallel_fraction"] for p in phases] == [k / 7 for k in range(8)]
    assert [p["epochs"] for p in phases] == [1.0] * 8 and "train_sprint_8" in stages
    stages = _stages(tmp_path, "curriculum.kind=none")
    assert "mix" not in stages and _conf(stages["train_sprint"])["epochs"] == 8


@pytest.mark.parametrize("change, match", [
    (["curriculum.kind=staged", "train.epochs=3"], "curriculum staged is 8 epochs"),
    (["curriculum.kind=gradual", "train.epochs=2.5"], "curriculum gradual needs train.epochs >= 2"),
    (["selftrain.mode=parallel"], "selftrain.mode is set by the recipe"),
    (["rl.rollout.mode=sequential"], "rl.rollout.mode is set by the recipe"),
    (["rl.rollout.group_size=1"], "rollout.group_size must be >= 2"),
    (["selftrain.keep=best"], "selftrain.keep: 'best' is not one of"),
])
def test_bad_recipe_sections_are_one_line(tmp_path, capsys, change, match):
    import re
    args = ["recipe", "run", str(QWEN3), "--out", str(tmp_path / "run")]
    assert main(args + [a for c in change for a in ("--set", c)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(match, err[0]), err


def test_curriculum_phase_files_draw_each_problem_once_in_the_phases_share(tmp_path):
    par, seq = tmp_path / "par.jsonl", tmp_path / "seq.jsonl"
    n = 200
    par.write_text("".join(json.dumps({"id": str(i), "kind": "sprint"}) + "\n" for i in range(n)))
    seq.write_text("".join(json.dumps({"id": str(i), "kind": "rft"}) + "\n" for i in range(n)))
    fracs = [0.0, 0.1, 0.5, 1.0]
    spec = {"parallel": [str(par)], "sequential": [str(seq)], "seed": 7,
            "phases": [{"parallel_fraction": f, "epochs": 1, "file": str(tmp_path / f"p{k}.jsonl")}
                       for k, f in enumerate(fracs)]}
    runner.write_curriculum(spec, tmp_path / "mix.json")
    summary = json.loads((tmp_path / "mix.json").read_text())["phases"]
    for k, f in enumerate(fracs):
        rows = [json.loads(x) for x in (tmp_path / f"p{k}.jsonl").read_text().splitlines()]
        assert sorted(int(r["id"]) for r in rows) == list(range(n))           # every problem once
        draws = np.random.default_rng((7, k)).random(n)                       # the rule, redrawn here
        assert [r["kind"] for r in rows] == ["sprint" if u < f else "rft" for u in draws]
        assert summary[k]["parallel"] == int((draws < f).sum())
    assert summary[0]["parallel"] == 0 and summary[3]["sequential"] == 0


def test_an_eval_set_named_by_a_hugging_face_dataset_is_fetched_into_a_task_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    from sprint_jax.tasks import load_task_file

    d = tmp_path / "aime"
    datasets.Dataset.from_dict({"problem": ["1+1?", "2+3?"], "answer": ["2", "5"]}).save_to_disk(str(d / "test"))
    ds = datasets.DatasetDict({"test": datasets.load_from_disk(str(d / "test"))})
    ds.save_to_disk(str(d / "dict"))
    runner.fetch_hf_tasks({"dataset": str(d / "dict"), "split": "test", "subset": None}, tmp_path / "t.jsonl")
    tasks = load_task_file(tmp_path / "t.jsonl", "math")
    assert [(t.problem, t.answer) for t in tasks] == [("1+1?", "2"), ("2+3?", "5")]
    from sprint_jax.recipe.config import EvalSet
    with pytest.raises(ValueError, match="names no dataset"):
        EvalSet("aime", "hf:")


@pytest.mark.slow
def test_tiny_threadweaver_recipe_end_to_end(tmp_path, capsys, monkeypatch, training_subprocesses):
    # compile-bound: the arms' stages meet the same shapes (the two SFT phases, both RL updates), so
    # the stages share a persistent XLA cache
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "xla"))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    out = tmp_path / "run"
    assert main(["recipe", "run", str(TINY), "--out", str(out)]) == 0
    cfg = load_recipe_config(TINY)
    names = [s.name for s in runner.plan(cfg, out)]
    assert names == ["curate", "convert", "mix", "train_sprint_1", "train_sprint_2", "train_rft",
                     "selftrain_sprint", "selftrain_rft", "rl_sprint", "rl_rft", "eval_sprint_chains",
                     "eval_rft_chains", "compare_chains", "report"]
    state = json.loads((out / "state.json").read_text())["stages"]
    assert all(state[n]["status"] == "done" for n in names)
    report = (out / "report.md").read_text()
    stages_table = report[report.index("## Stages"):report.index("## Training")]
    for n in names:                                    # the report names every stage
        assert f"| {n} |" in stages_table
    # the data really is ThreadWeaver's: every training example parses in its grammar
    from sprint_jax import threadweaver as tw
    for line in (out / "convert" / "out" / "sprint.jsonl").read_text().splitlines()[:50]:
        _, problems = tw.parse_completion(json.loads(line)["completion"])
        assert not problems
    # self-training kept exactly the well-formed, correct rollouts, all of them
    for arm in ("sprint", "rft"):
        d = out / f"selftrain_{arm}" / "out" / "round_1"
        samples = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
        kept = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
        assert [k["completion"] for k in kept] == [s["text"] for s in samples if s["correct"] and s["format_valid"]]
    # P-GRPO ran on each arm from its self-trained model, the sequential one with sequential rollouts
    for arm, mode in (("sprint", "parallel"), ("rft", "sequential")):
        conf = yaml.safe_load((out / f"rl_{arm}" / "config.yaml").read_text())
        assert conf["rollout"]["mode"] == mode
        assert conf["policy"]["path"].endswith(f"selftrain_{arm}/out/round_1/model/hf")
        assert json.loads((out / f"rl_{arm}" / "out" / "summary.json").read_text())["last"]["step"] == 2
    assert "# ThreadWeaver against Sequential" in report


def test_the_qwen3_recipe_needs_the_rewriters_key_from_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(["recipe", "run", str(QWEN3), "--out", str(tmp_path / "run"), "--set", f"prompts={PROMPTS}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OPENAI_API_KEY" in err[0] and "curate.rewriter" in err[0], err
