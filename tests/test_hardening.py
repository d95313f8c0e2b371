"""Hardening against bad input: what a hostile user broke, each checked through the real command
or loader: one line and exit code 2 for a mistake, never a traceback, never a silent wrong
result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sprint_jax.cli import main
from sprint_jax.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# ---- YAML numbers ---------------------------------------------------------------------------

def test_yaml_numbers_without_a_dot_are_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads `2e-5` and `1.0e6` as strings, so the README's own
    `--set optim.lr=2e-5` was refused. A number field takes what the text spells."""
    from sprint_jax.train.config import TrainConfig

    f = tmp_path / "c.yaml"
    f.write_text("data: {train: [x.jsonl]}\noptim: {lr: 2e-5, eps: 1.0e-8}\n")
    cfg = load_config(TrainConfig, f, ["optim.b2=1e-1", "steps=1e3", "data.seq_len=4096"])
    assert cfg.optim.lr == 2e-5 and cfg.optim.eps == 1e-8 and cfg.optim.b2 == 0.1
    assert cfg.steps == 1000 and isinstance(cfg.steps, int)
    with pytest.raises(ConfigError, match=r"^steps: expected an integer, got 2.5"):
        load_config(TrainConfig, f, ["steps=2.5"])
    with pytest.raises(ConfigError, match=r"optim.lr: expected a finite number"):
        load_config(TrainConfig, f, ["optim.lr=.nan"])
    with pytest.raises(ConfigError, match=r"optim.lr: expected a number, got 'fast'"):
        load_config(TrainConfig, f, ["optim.lr=fast"])


# ---- demo ------------------------------------------------------------------------------------

def test_demo_rejects_bad_settings_before_curating(tmp_path, capsys):
    assert main(["demo", "--set", "steps=-1", "--out", str(tmp_path / "d"), "--no-progress"]) == 2
    assert "steps must be >= 1, got -1" in _err_line(capsys)
    assert main(["demo", "--set", "model.num_attention_heads=3", "--out", str(tmp_path / "d"), "--no-progress"]) == 2
    assert "num_attention_heads (3) must be a multiple" in _err_line(capsys)
    assert not (tmp_path / "d").exists()                               # no curation happened


# ---- tokenizer and model that do not fit -------------------------------------------------------

def test_model_dir_without_tokenizer_is_an_error_naming_dir_and_flag(hf_untied, capsys):
    """transformers builds an EMPTY tokenizer from a directory with no tokenizer files: every
    query encoded to nothing (0% accuracy, exit 0)."""
    assert main(["infer", "--model", str(hf_untied), "What is 1+1?"]) == 2
    line = _err_line(capsys)
    assert str(hf_untied) in line and "no tokenizer files" in line and "--tokenizer" in line


def test_tokenizer_larger_than_the_model_is_refused(hf_untied, tmp_path, capsys):
    """A 400-token tokenizer on a 307-row embedding: ids past the table are clamped by jit's
    gather, so eval ran on garbage with exit 0."""
    import shutil

    from conftest import tiny_vocab_tokenizer

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer(400).save(model / "vocab_tokenizer.json")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    assert main(["eval", "--model", str(model), "--data", str(tasks), "--out", str(tmp_path / "e"),
                 "--no-progress"]) == 2
    line = _err_line(capsys)
    assert "tokenizer has 400 tokens" in line and "vocab_size is 307" in line
    assert main(["generate", "--model", str(model), "hello", "--max-new-tokens", "2"]) == 2
    assert "tokenizer has 400 tokens" in _err_line(capsys)


# ---- config values that cannot be right ------------------------------------------------------

def _model_copy(src: Path, dst: Path, **config_changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"rope_theta": "nan"}, "rope_theta must be a finite number > 0, got 'nan'"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a finite number > 0, got -1"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings: true but the checkpoint has an lm_head.weight that differs"),
])
def test_model_config_values_that_cannot_be_right(hf_untied, tmp_path, capsys, changes, message):
    """Each used to load: NaN rotary angles, a negative epsilon (NaN norms), and a real lm_head
    silently replaced by the embedding."""
    model = _model_copy(hf_untied, tmp_path / "m", **changes)
    assert main(["generate", "--model", str(model), "--token-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert message in _err_line(capsys)


def test_tied_checkpoint_with_an_identical_head_copy_loads(hf_tied, tmp_path):
    """The tie check refuses a different head only: a copy of the embedding (as some exporters
    write it) is the same model."""
    from sprint_jax.model.hf import SafetensorsFile, load_params, write_safetensors

    model = _model_copy(hf_tied, tmp_path / "m")
    f = SafetensorsFile(model / "model.safetensors")
    tensors = {k: f.get(k) for k in f.keys()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    write_safetensors(model / "model.safetensors", tensors)
    cfg, params = load_params(model)
    assert cfg.tie_word_embeddings


# ---- malformed safetensors headers -----------------------------------------------------------

def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    import struct

    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize("header, data, message", [
    (b'{"a": \xff\xfe}', b"", "not UTF-8"),
    (b'[1, 2, 3]', b"", "a JSON list, not an object"),
    (b'{"w": {"dtype": "F32", "shape": [1048576, 1048576], "data_offsets": [0, 4398046511104]}}', b"\0" * 16,
     "lie outside the file's 16 data bytes"),                    # the 931 GiB-style allocation
    (b'{"w": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 16]}}', b"\0" * 16,
     "needs 60 bytes but data_offsets span 16"),
    (b'{"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}', b"\0" * 8, "bad shape"),
    (b'{"w": "x"}', b"", "header entry is not an object"),
])
def test_malformed_safetensors_headers_are_checkpoint_errors(tmp_path, header, data, message):
    from sprint_jax.model.hf import CheckpointError, SafetensorsFile

    path = _safetensors(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match="model.safetensors") as e:
        SafetensorsFile(path)
    assert message in str(e.value)


def test_header_longer_than_the_file(tmp_path):
    import struct

    from sprint_jax.model.hf import CheckpointError, SafetensorsFile

    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match=r"claims 1000000000000 bytes but the file has 10 bytes"):
        SafetensorsFile(path)


def test_corrupt_checkpoints_in_generate_infer_eval_are_one_line(hf_untied, tmp_path, capsys):
    """CheckpointError used to escape the model loader of these commands as a traceback."""
    from conftest import tiny_vocab_tokenizer

    model = _model_copy(hf_untied, tmp_path / "m")
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    _safetensors(model / "model.safetensors", b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [307, 72], '
                                               b'"data_offsets": [0, 99999999]}}', b"\0" * 64)
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    for argv in (["generate", "--model", str(model), "--token-ids", "1", "--max-new-tokens", "1"],
                 ["infer", "--model", str(model), "hi", "--max-seq-len", "64"],
                 ["eval", "--model", str(model), "--data", str(tasks), "--out", str(tmp_path / "e"), "--max-seq-len", "64"]):
        assert main(argv) == 2, argv
        line = _err_line(capsys)
        assert "model.safetensors" in line and "outside the file" in line, line


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_orbax_model_is_one_line(hf_untied, tmp_path, capsys):
    import time

    from sprint_jax.model.convert import is_orbax_dir

    orbax = tmp_path / "orbax"
    assert main(["convert", "--to", "orbax", str(hf_untied), str(orbax)]) == 0
    capsys.readouterr()
    assert is_orbax_dir(orbax)
    for f in (orbax / "params").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"")                              # data files emptied
    assert main(["generate", "--model", str(orbax), "--token-ids", "1", "--max-new-tokens", "1"]) == 2
    assert "cannot read the orbax" in _err_line(capsys)   # its metadata or its data
    # the failed restore's other reads end later on tensorstore's threads and call its closed loop:
    # that error is dropped, not printed as "Exception ignored ... Event loop is closed" (it came
    # within this wait in every try; it used to surface in the next test)
    time.sleep(1.0)


# ---- config files ----------------------------------------------------------------------------

def test_config_file_that_is_a_directory_or_not_utf8(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "is not a file" in _err_line(capsys)
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"steps: 3\nname: \xff\xfe\n")
    for cmd in (["train", "--config", str(bad), "--out", str(tmp_path / "o")],
                ["curate", "--config", str(bad)],
                ["infer", "--model", str(tmp_path), "--config", str(bad), "hi"]):
        assert main(cmd) == 2, cmd
        assert "not UTF-8" in _err_line(capsys)


def test_model_config_json_not_utf8_or_not_an_object(hf_untied, tmp_path, capsys):
    model = _model_copy(hf_untied, tmp_path / "m")
    for content, message in ((b'{"model_type": "qwen2\xff"}', "not UTF-8"), (b"[1, 2]", "expected a JSON object")):
        (model / "config.json").write_bytes(content)
        assert main(["generate", "--model", str(model), "--token-ids", "1", "--max-new-tokens", "1"]) == 2
        assert message in _err_line(capsys)


# ---- generate flags, capacities, output paths ------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["", "--max-new-tokens", "3"], "the prompt is empty"),
    (["--token-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--token-ids", "1", "--temperature", "-1"], "temperature must be >= 0"),
    (["--token-ids", "1", "--top-k", "-1"], "top_k must be >= 0"),
    (["--token-ids", "1", "--stop", ""], '--stop ""'),
    (["--token-ids", "1", "--max-new-tokens", "100000"], "more than the model's max_position_embeddings (4096)"),
])
def test_generate_flags_are_checked(hf_untied, capsys, argv, message):
    assert main(["generate", "--model", str(hf_untied), *argv]) == 2
    assert message in _err_line(capsys)


def test_capacities_are_checked_before_allocating(hf_untied, tmp_path, capsys):
    assert main(["infer", "--model", str(hf_untied), "hi", "--max-seq-len", "1000000000"]) == 2
    assert "--max-seq-len = 1000000000 is more than the model's max_position_embeddings (4096)" in _err_line(capsys)
    # a model that claims 2**31 positions: the KV cache estimate is what refuses (no weights are read:
    # the directory has only its config.json)
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 4096, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 2 ** 31}))
    assert main(["infer", "--model", str(big), "hi", "--max-seq-len", "1000000000"]) == 2
    line = _err_line(capsys)
    assert "the KV cache" in line and "GiB" in line and "lower --max-seq-len" in line
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"data: {{train: [{ROOT / 'tests/data/sft_tiny_sprint.jsonl'}], tokenizer: bytes}}\nsteps: 1\n")
    assert main(["train", "--config", str(cfg), "--set", "data.seq_len=1048576", "--out", str(tmp_path / "o")]) == 2
    assert "data.seq_len = 1048576 is more than the model's max_position_embeddings (4096)" in _err_line(capsys)
    assert not (tmp_path / "o" / "checkpoints").exists()                # refused before training


def test_output_paths_are_checked_up_front(hf_untied, tmp_path, capsys):
    from conftest import tiny_vocab_tokenizer

    model = _model_copy(hf_untied, tmp_path / "m")
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    assert main(["infer", "--model", str(model), "hi", "--record", str(tmp_path)]) == 2
    assert "is a directory" in _err_line(capsys)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    assert main(["eval", "--model", str(model), "--data", str(tasks), "--out", str(a_file)]) == 2
    assert "is not a directory" in _err_line(capsys)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"data: {{train: [{ROOT / 'tests/data/sft_tiny_sprint.jsonl'}], tokenizer: bytes}}\nsteps: 1\n")
    assert main(["train", "--config", str(cfg), "--out", str(a_file)]) == 2
    assert "is not a directory" in _err_line(capsys)


# ---- curation stores that are not stores ------------------------------------------------------

def test_curate_status_and_run_on_files_that_are_not_stores(tmp_path, capsys):
    """garbage, a truncated store, another program's SQLite and a 0-byte file: one line each, and
    nothing written into them (status used to write the schema into a 0-byte file)."""
    import sqlite3

    from sprint_jax.curation.pipeline import DB_NAME

    good = tmp_path / "good"
    cfg = ROOT / "configs" / "curate_countdown_offline.yaml"
    assert main(["curate", "--config", str(cfg), "--set", "tasks.n=6", "--out", str(good), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["curate", "status", str(good)]) == 0          # a real store reads fine, read-only
    assert "reformat" in capsys.readouterr().out
    store_bytes = (good / DB_NAME).read_bytes()

    def make(name: str, content: bytes | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        if content is not None:
            (d / DB_NAME).write_bytes(content)
        return d

    garbage = make("garbage", b"this is not a database at all" * 100)
    truncated = make("truncated", store_bytes[: len(store_bytes) // 3])
    empty = make("empty", b"")
    foreign = make("foreign")
    con = sqlite3.connect(foreign / DB_NAME)
    con.execute("CREATE TABLE customers (id INTEGER, name TEXT)")
    con.commit()
    con.close()
    for d in (garbage, truncated, empty, foreign):
        before = (d / DB_NAME).read_bytes()
        assert main(["curate", "status", str(d)]) == 2, d
        line = _err_line(capsys)
        assert str(d / DB_NAME) in line, line
        assert (d / DB_NAME).read_bytes() == before, f"status wrote into {d}"
    for d in (garbage, truncated, foreign):
        before = (d / DB_NAME).read_bytes()
        assert main(["curate", "--config", str(cfg), "--set", "tasks.n=6", "--out", str(d), "--no-progress"]) == 2
        assert str(d / DB_NAME) in _err_line(capsys)
        assert (d / DB_NAME).read_bytes() == before


# ---- eval compare on a run killed mid-write ------------------------------------------------------

def test_eval_compare_uses_complete_lines_of_a_cut_results_file(tmp_path, capsys):
    rows = [{"id": f"p{i}", "correct": i % 2 == 0, "sequential_tokens": 10 + i, "total_tokens": 20 + i,
             "wall_s": 1.0} for i in range(4)]
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    (a / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    full_b = "".join(json.dumps({**r, "sequential_tokens": 30}) + "\n" for r in rows)
    (b / "results.jsonl").write_text("".join(json.dumps({**r, "sequential_tokens": 30}) + "\n" for r in rows[:3])
                                     + json.dumps(rows[3])[:25])      # the kill cut the 4th line
    assert main(["eval", "compare", str(a), str(b)]) == 0
    captured = capsys.readouterr()
    assert "3 problems" in captured.out
    assert "skipped 1 incomplete last line" in captured.err and "3 complete ones" in captured.err
    # a broken line that is not the cut end is still an error naming the line
    (b / "results.jsonl").write_text("{broken\n" + full_b)
    assert main(["eval", "compare", str(a), str(b)]) == 2
    assert "results.jsonl:1: not valid JSON" in _err_line(capsys)


# ---- one run per output directory (eval, curate; train in test_train_guards.py) --------------------

def test_eval_and_curate_refuse_a_directory_held_by_another_run(tmp_path, capsys):
    import os
    import signal

    from sprint_jax.tasks.types import Task
    from sprint_jax.eval.evaluate import evaluate
    from sprint_jax.outlock import DirectoryLocked
    from test_orchestrator import ScriptedEngine

    out = tmp_path / "held"
    from conftest import start_lock_holder
    holder = start_lock_holder(out)
    try:
        with pytest.raises(DirectoryLocked, match=f"pid {holder.pid}"):
            evaluate(ScriptedEngine(["<Final Answer> 1 </Final Answer>"]), [Task("a", "math", "1?", "1")],
                     "sequential", out_dir=out, progress=False)
        assert not (out / "results.jsonl").exists()
        cfg = ROOT / "configs" / "curate_countdown_offline.yaml"
        assert main(["curate", "--config", str(cfg), "--set", "tasks.n=2", "--out", str(out), "--no-progress"]) == 2
        line = _err_line(capsys)
        assert "in use by another run" in line and f"pid {holder.pid}" in line and "started" in line
        assert not (out / "curation.sqlite").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(out / ".sprint-jax.lock")
