"""`eval --mode parallel` (the default) or `serial` on a model whose sprint_jax.json records that it
was trained on serial traces only (an RFT model) is refused in one line naming --mode sequential:
it never writes a plan, and would be scored ~0 as a SPRINT model."""
from __future__ import annotations

import json
import shutil

import pytest

from sprint_jax import caps
from sprint_jax.cli import main
from sprint_jax.model.hf import update_export_meta

RFT_TRACE = "3 + 4 = 7, and 7 * 2 = 14.\n<Final Answer>\n14\n</Final Answer>"
SPRINT_TRACE = ("<Plan_1>\nTwo parts.\n<prompt_1.1>3 + 4</prompt_1.1>\n<prompt_1.2>5 + 6</prompt_1.2>\n</Plan_1>\n"
                "<execution_1.1>7</execution_1.1>\n<execution_1.2>11</execution_1.2>\n"
                "<Final Answer>\n18\n</Final Answer>")


def _model(tmp_path, hf_untied, *completions):
    from conftest import tiny_vocab_tokenizer

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    # the shapes `train` records: a SPRINT example's parsed shape, (0, 0) for an RFT one
    shapes = [(0, 0) if c == RFT_TRACE else caps.example_shape(c) for c in completions]
    assert None not in shapes
    update_export_meta(model, layout="flat", **{caps.SHAPE_KEY: caps.shape_summary(shapes)})
    return model


def test_a_sequential_model_is_not_evaluated_as_sprint(hf_untied, tmp_path, capsys):
    model = _model(tmp_path, hf_untied, RFT_TRACE, RFT_TRACE)
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"id": "a", "problem": "What is 1+1?", "answer": "2"}) + "\n")
    for mode in ([], ["--mode", "parallel"], ["--mode", "serial"]):
        assert main(["eval", "--model", str(model), "--data", str(data), *mode, "--out", str(tmp_path / "o"),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a sequential model" in err[0] and "--mode sequential" in err[0], err
        assert "none of its 2 training examples has a plan" in err[0]
    assert not (tmp_path / "o" / "results.jsonl").exists()


@pytest.mark.parametrize("completions, mode", [
    ((SPRINT_TRACE, RFT_TRACE), "parallel"),    # trained on plans (and serial traces beside them)
    ((RFT_TRACE,), "sequential"),               # the mode it was trained for
    ((), "parallel"),                           # no examples recorded: nothing to go on
])
def test_models_that_plan_or_modes_that_fit_are_not_refused(hf_untied, tmp_path, completions, mode):
    from sprint_jax.eval.cli import check_mode_fits_model

    check_mode_fits_model(str(_model(tmp_path, hf_untied, *completions)), mode)
    check_mode_fits_model(str(hf_untied), "parallel")     # no sprint_jax.json at all
