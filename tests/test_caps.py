"""Caps from the data (sprint_jax/caps.py): curation reports each kept example's stages and prompts
per stage (max, p99), `train` records the shape of its data in the export, eval's default
max_stages / max_prompts come from that record with a margin (a user's setting wins), and a run
a cap cut is counted `capped`, apart from wrong answers."""
from __future__ import annotations

import json
import types

import pytest

from sprint_jax import caps
from sprint_jax.cli import main
from sprint_jax.curation.pipeline import example_shapes
from sprint_jax.eval.evaluate import evaluate
from sprint_jax.eval.report import compare, format_compare_table, make_report
from sprint_jax.infer.orchestrator import OrchestratorConfig
from sprint_jax.schema import Example
from test_eval import ANSWERS, TASKS, _prompt, _sprint_script
from test_orchestrator import DRUG_EXECUTORS, DRUG_PLANNER, ScriptedEngine

# shapes counted by hand: (plans, most prompts in one plan) / (blocks, most outlines in one block)
SPRINT_3x3 = ("<Plan_1> Split. <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> <prompt_1.3> c </prompt_1.3> "
              "</Plan_1>\n<execution_1.1> 1 </execution_1.1>\n<execution_1.2> 2 </execution_1.2>\n"
              "<execution_1.3> 3 </execution_1.3>\n<Plan_2> <prompt_2.1> sum </prompt_2.1> </Plan_2>\n"
              "<execution_2.1> 6 </execution_2.1>\n<Plan_3> So it is 6. </Plan_3>\n<Final Answer> 6 </Final Answer>")
# an implicit-prompt plan (one execution, no prompt) runs inline: it counts as a stage, not a prompt
SPRINT_2x2 = ("<Plan_1> <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> </Plan_1>\n"
              "<execution_1.1> 1 </execution_1.1>\n<execution_1.2> 2 </execution_1.2>\n<Plan_2> Add. </Plan_2>\n"
              "<execution_2.1> 3 </execution_2.1>\n<Final Answer> 3 </Final Answer>")
SPRINT_1x2 = ("<Plan_1> <prompt_1.1> a </prompt_1.1> <prompt_1.2> b </prompt_1.2> </Plan_1>\n"
              "<execution_1.1> 1 </execution_1.1>\n<execution_1.2> 2 </execution_1.2>\n<Final Answer> 3 </Final Answer>")
TW_2x4 = ("<think>\nFirst.\n<Parallel>\n<Outlines>\n<Outline>1: a</Outline>\n<Outline>2: b</Outline>\n</Outlines>\n"
          "<Thread>1: x</Thread>\n<Thread>2: y</Thread>\n</Parallel>\n<Parallel>\n<Outlines>\n"
          "<Outline>1: c</Outline>\n<Outline>2: d</Outline>\n<Outline>3: e</Outline>\n<Outline>4: f</Outline>\n"
          "</Outlines>\n<Thread>1: p</Thread>\n<Thread>2: q</Thread>\n<Thread>3: r</Thread>\n<Thread>4: s</Thread>\n"
          "</Parallel>\nDone.\n</think>\n6")


def _record(completion: str, fmt: str | None = None) -> dict:
    return {"id": "x", "kind": "sprint", "prompt": "Q", "completion": completion,
            "meta": {"format": fmt} if fmt else {}}


def test_example_shapes_count_stages_and_prompts_as_by_hand():
    assert caps.example_shape(SPRINT_3x3) == (3, 3)
    assert caps.example_shape(SPRINT_2x2) == (2, 2)
    assert caps.example_shape(TW_2x4, "threadweaver") == (2, 4)
    assert caps.example_shape(TW_2x4) is None                     # not SPRINT text
    # 197 one-plan examples and three longer ones: by nearest rank the 99th percentile is the 198th
    # of the 200 sorted values (stages: 197 x 1, 2, 2, 3 -> 2; prompts: 198 x 2, 3, 4 -> 2)
    records = ([_record(SPRINT_1x2)] * 197 + [_record(SPRINT_3x3), _record(SPRINT_2x2), _record(TW_2x4, "threadweaver")]
               + [_record("<Plan_1> never closed")])              # an unparsable record is left out
    assert example_shapes(records) == {
        "examples": 200,
        "stages": {"max": 3, "p99": 2, "histogram": {"1": 197, "2": 2, "3": 1}},
        "prompts": {"max": 4, "p99": 2, "histogram": {"2": 198, "3": 1, "4": 1}}}
    # a few examples: p99 is the largest
    assert example_shapes([_record(SPRINT_3x3), _record(SPRINT_2x2)])["stages"] == {
        "max": 3, "p99": 3, "histogram": {"2": 1, "3": 1}}
    assert caps.shape_summary([]) == {"examples": 0, "stages": {"max": None, "p99": None},
                                      "prompts": {"max": None, "p99": None}}


def test_train_records_the_shape_of_the_examples_it_used(monkeypatch, tmp_path):
    from sprint_jax.train import data as D
    from sprint_jax.train import trainer
    from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT

    exs = [Example("a", "sprint", "Q1\n", SPRINT_3x3), Example("b", "sprint", "Q2\n", SPRINT_2x2),
           Example("c", "sprint", "Q3\n", "<Plan_1> broken"),                      # skipped: not counted
           Example("d", "rft", "Q4\n", "serial work\n<Final Answer> 3 </Final Answer>")]   # serial: (0, 0)
    _, stats = D.build_items(exs, D.byte_tokenizer(), "trie", 4096, "drop", SPAN_WEIGHTS_DEFAULT)
    assert stats.used == 3 and stats.used_shapes == [(3, 3), (2, 2), (0, 0)]
    assert "used_shapes" not in stats.as_dict()
    seen = {}
    monkeypatch.setattr(trainer, "export_hf", lambda *a, meta=None, **kw: seen.update(meta))
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(layout="trie", format="sprint"),
                                export=types.SimpleNamespace(dtype="float32"))
    trainer._export(cfg, None, None, None, "bytes", stats, tmp_path)
    assert seen[caps.SHAPE_KEY] == {"examples": 3, "stages": {"max": 3, "p99": 3}, "prompts": {"max": 3, "p99": 3}}
    # inference's default caps from it: 2 x 3 stages; 3 prompts + a quarter, rounded up -> 4
    assert caps.caps_from_shape(seen[caps.SHAPE_KEY]) == {"max_stages": 6, "max_prompts": 4}


def test_caps_from_shape_margins_by_hand():
    shape = lambda s, p: {"stages": {"max": s, "p99": s}, "prompts": {"max": p, "p99": p}}  # noqa: E731
    assert caps.caps_from_shape(shape(3, 4)) == {"max_stages": 6, "max_prompts": 5}     # ceil(5.0) = 5
    assert caps.caps_from_shape(shape(1, 1)) == {"max_stages": 2, "max_prompts": 2}     # at least one more
    assert caps.caps_from_shape(shape(5, 2)) == {"max_stages": 10, "max_prompts": 3}    # ceil(2.5) = 3
    assert caps.caps_from_shape(shape(20, 8)) == {"max_stages": 40, "max_prompts": 10}
    assert caps.caps_from_shape(shape(0, 0)) == {}                 # serial data: the defaults stand
    assert caps.caps_from_shape(None) == {} and caps.caps_from_shape({"examples": 0}) == {}
    with pytest.raises(ValueError, match="data_shape.stages.max"):
        caps.caps_from_shape(shape("3", 2))


def _model_dir(tmp_path, meta: dict | None):
    model = tmp_path / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 131072,
                                                   "vocab_size": 64, "hidden_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "num_key_value_heads": 1,
                                                   "intermediate_size": 16}))
    if meta is not None:
        (model / "sprint_jax.json").write_text(json.dumps(meta))
    return model


def test_eval_defaults_its_caps_from_the_models_data_and_a_users_setting_wins(tmp_path, monkeypatch, capsys):
    import sprint_jax.infer.infer_cli as infer_cli
    from sprint_jax.errors import UserError

    seen = []

    def fake_build_engine(args, config, concurrency=1):
        seen.append((config.max_stages, config.max_prompts))
        raise UserError("stop here: no model to load")
    monkeypatch.setattr(infer_cli, "build_engine", fake_build_engine)
    model = _model_dir(tmp_path, {"layout": "trie", caps.SHAPE_KEY: {
        "examples": 40, "stages": {"max": 7, "p99": 5}, "prompts": {"max": 6, "p99": 4}}})
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "problem": "What is 1+1?", "answer": "2"}) + "\n")
    base = ["eval", "--model", str(model), "--data", str(tasks), "--mode", "parallel"]
    for extra in ([], ["--config", "configs/eval_r1_distill_7b.yaml"], ["--max-stages", "3"],
                  ["--set", "max_prompts=2"]):
        assert main(base + ["--out", str(tmp_path / f"o{len(seen)}")] + extra) == 2
    # 2 x 7 stages; 6 prompts + a quarter, rounded up: 8. The shipped 7B config no longer overrides
    # them; a flag or --set does.
    assert seen == [(14, 8), (14, 8), (3, 8), (14, 2)]
    # a model without the record: the orchestrator's defaults
    assert infer_cli.model_defaults(str(_model_dir(tmp_path / "old", {"layout": "flat"}))) == {"layout": "flat"}
    bad = _model_dir(tmp_path / "bad", {caps.SHAPE_KEY: {"stages": {"max": -1}}})
    capsys.readouterr()
    assert main(base[:2] + [str(bad)] + base[3:] + ["--out", str(tmp_path / "ob")]) == 2
    err = capsys.readouterr().err
    assert "data_shape.stages.max must be an integer >= 0" in err and "Traceback" not in err


def test_a_run_stopped_at_max_stages_is_capped_not_wrong(tmp_path):
    # every scripted run writes three plans; with max_stages=2 the third ends it unanswered
    engine = ScriptedEngine(DRUG_PLANNER[:3] * len(TASKS), DRUG_EXECUTORS)
    results, report = evaluate(engine, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "capped",
                               orchestrator_config=OrchestratorConfig(max_stages=2), progress=False)
    assert [r["termination"] for r in results] == ["max_stages"] * 5
    assert [r["outcome"] for r in results] == ["capped"] * 5
    assert report["outcomes"] == {"correct": 0, "wrong": 0, "context_full": 0, "capped": 5}
    assert report["samples"]["per_problem"][0]["capped"] == 1
    # uncapped, the same scripts answer: one wrong answer (task m3), counted wrong
    engine = ScriptedEngine([line for a in ANSWERS for line in _sprint_script(a)], DRUG_EXECUTORS)
    free, report = evaluate(engine, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "free", progress=False)
    assert report["outcomes"] == {"correct": 4, "wrong": 1, "context_full": 0, "capped": 0}
    # max_prompts=2: plan 2's third prompt gets no executor; the runs go on and answer, and the
    # one that is not correct is capped, not wrong
    engine = ScriptedEngine([line for a in ANSWERS for line in _sprint_script(a)], DRUG_EXECUTORS)
    cut, report = evaluate(engine, TASKS, "parallel", prompt_fn=_prompt, out_dir=tmp_path / "cut",
                           orchestrator_config=OrchestratorConfig(max_prompts=2), progress=False)
    assert [r["prompts_dropped"] for r in cut] == [1] * 5
    assert report["outcomes"] == {"correct": 4, "wrong": 0, "context_full": 0, "capped": 1}
    # eval compare carries the share, like context_full's
    table = compare(results, free, "capped", "free")
    assert table["summary"]["capped"]["capped"] == 1.0 and table["summary"]["free"]["capped"] == 0.0
    assert "capped (cut by a cap)" in format_compare_table(table)
    # a results line of an older run (no prompts_dropped) is read the same way
    old = {k: v for k, v in results[0].items() if k not in ("prompts_dropped", "outcome")}
    assert make_report([old], "parallel")["outcomes"]["capped"] == 1
