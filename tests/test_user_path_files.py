"""Files and directories on a user's path: an output directory that cannot be written (one line,
exit 2, what was written kept), `convert` never writing over or into another model, a `--model`
that is a file or a training run's directory, and a `curate` that fails before doing any work
leaving nothing behind. Each through the real command."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sprint_jax.cli import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sft_tiny_sprint.jsonl"
CURATE = ROOT / "configs" / "curate_countdown_offline.yaml"


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# ---- an output directory the user cannot write -------------------------------------------------

# Run ARGV (a python command line) with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from the
# bounding set, so that a root process (as CI runs) is held to permission bits like any user: a
# fresh wrapper process does it and execs (not a preexec_fn: forking this multithreaded process
# to run Python in the child can deadlock).
AS_USER = r"""
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:          # PR_CAPBSET_DROP
            sys.exit(f"prctl(PR_CAPBSET_DROP): {os.strerror(ctypes.get_errno())}")
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def _as_user(*argv: str) -> subprocess.CompletedProcess:
    """`sprint-jax ARGV` in a process that permission bits apply to."""
    return subprocess.run([sys.executable, "-c", AS_USER, "-m", "sprint_jax.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)


@pytest.fixture
def read_only_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    probe = subprocess.run([sys.executable, "-c", AS_USER, "-c", f"open({str(d / 'probe')!r}, 'w')"],
                           capture_output=True, text=True, timeout=60)
    if "PermissionError" not in probe.stderr:
        pytest.skip(f"cannot run a process that permission bits apply to: {probe.stderr.strip()[-200:]}")
    yield d
    d.chmod(0o755)


def _one_error_line(p: subprocess.CompletedProcess, command: str) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-3000:])
    ours = [line for line in p.stderr.splitlines() if line.startswith("sprint-jax")]
    assert len(ours) == 1 and ours[0].startswith(f"sprint-jax {command}: error: "), p.stderr[-3000:]
    return ours[0]


def _sft_config(tmp_path: Path, **changes) -> Path:
    cfg = {"model": {"name": "tiny", "dtype": "float32", "remat": "none", "loss_chunk": 0},
           "data": {"train": [str(DATA)], "layout": "trie", "seq_len": 256, "overlong": "truncate",
                    "tokenizer": "bytes"},
           "optim": {"lr": 3e-3, "warmup_steps": 2, "batch_size": 2},
           "checkpoint": {"every": 2}, "steps": 4, "log_every": 1, "tensorboard": False, **changes}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_unwritable_out_is_one_line_for_train_eval_curate(read_only_dir, hf_untied, tmp_path):
    """PermissionError tracebacks (rc 1) at mkdir and at the lock file: one line naming the
    directory, exit 2, for a new directory under a read-only one and for the read-only one."""
    from conftest import tiny_vocab_tokenizer

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / "vocab_tokenizer.json")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    for out in (read_only_dir / "new", read_only_dir):
        line = _one_error_line(_as_user("curate", "--config", str(CURATE), "--set", "tasks.n=2", "--out", str(out),
                                        "--no-progress"), "curate")
        assert f"{out} is not writable" in line, line
    line = _one_error_line(_as_user("train", "--config", str(_sft_config(tmp_path)), "--out",
                                    str(read_only_dir / "run"), "--no-progress"), "train")
    assert f"{read_only_dir / 'run'} is not writable" in line, line
    line = _one_error_line(_as_user("eval", "--model", str(model), "--data", str(tasks), "--out", str(read_only_dir),
                                    "--no-progress"), "eval")
    assert f"{read_only_dir} is not writable" in line, line
    assert list(read_only_dir.iterdir()) == []
    # a curation directory made read-only after a run: the store cannot be written (it read as
    # "not a readable curation store ... may be damaged")
    done = tmp_path / "curated"
    assert main(["curate", "--config", str(CURATE), "--set", "tasks.n=2", "--out", str(done), "--no-progress"]) == 0
    kept = {p.name: p.read_bytes() for p in done.iterdir() if p.name != ".sprint-jax.lock"}
    done.chmod(0o555)
    try:
        line = _one_error_line(_as_user("curate", "--config", str(CURATE), "--set", "tasks.n=2", "--out", str(done),
                                        "--no-progress"), "curate")
    finally:
        done.chmod(0o755)
    assert f"cannot write the curation store {done / 'curation.sqlite'}" in line, line
    assert {p.name: p.read_bytes() for p in done.iterdir() if p.name != ".sprint-jax.lock"} == kept


def test_a_write_refused_mid_run_is_one_line_and_keeps_what_was_written(read_only_dir, tmp_path):
    """matplotlib's savefig raised PermissionError at the end of training (rc 1, a traceback):
    here loss.png cannot be written; the checkpoints and metrics written before it stay."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "loss.png").write_bytes(b"")
    (out / "loss.png").chmod(0o444)
    p = _as_user("train", "--config", str(_sft_config(tmp_path, plot=True)), "--out", str(out), "--no-progress")
    line = _one_error_line(p, "train")
    assert f"permission denied on {out / 'loss.png'}" in line and "kept" in line, line
    assert sorted(int(c.name) for c in (out / "checkpoints").glob("[0-9]*")) == [2, 4]
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


# ---- convert -----------------------------------------------------------------------------------

def test_convert_never_writes_over_or_into_a_model(hf_untied, hf_tied, tmp_path, capsys):
    """Writing onto a file was a FileExistsError traceback, source == destination a
    shutil.SameFileError one, and converting into another model's HF directory added params/
    beside its weights."""
    src = tmp_path / "src"
    shutil.copytree(hf_untied, src)
    other = tmp_path / "other"
    shutil.copytree(hf_tied, other)
    before = sorted(p.name for p in other.iterdir())
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for to, dst, message in (("orbax", a_file, "exists and is not a directory"),
                             ("orbax", src, "is the source directory"),
                             ("orbax", other, "already holds a model"),
                             ("orbax", src / "inside", "inside the source directory")):
        assert main(["convert", "--to", to, str(src), str(dst)]) == 2, (to, dst)
        line = _err_line(capsys)
        assert message in line, line
    assert sorted(p.name for p in other.iterdir()) == before and a_file.read_text() == "x"
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in hf_untied.iterdir())
    # an orbax model converted back into the HF directory it came from: refused too
    orbax = tmp_path / "orbax"
    assert main(["convert", "--to", "orbax", str(src), str(orbax)]) == 0
    capsys.readouterr()
    assert main(["convert", "--to", "hf", str(orbax), str(src)]) == 2
    assert "already holds a model" in _err_line(capsys)
    assert main(["convert", "--to", "hf", str(orbax), str(orbax)]) == 2
    assert "is the source directory" in _err_line(capsys)


# ---- --model that is not a model directory -------------------------------------------------------

def test_model_flag_names_a_file_and_points_a_run_directory_at_its_export(hf_untied, tmp_path, capsys):
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"x")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n")
    for argv in (["generate", "--model", str(a_file), "hi"], ["infer", "--model", str(a_file), "hi"],
                 ["eval", "--model", str(a_file), "--data", str(tasks), "--out", str(tmp_path / "e")],
                 ["serve", "--model", str(a_file)], ["convert", "--to", "orbax", str(a_file), str(tmp_path / "o")]):
        assert main(argv) == 2, argv
        line = _err_line(capsys)
        assert f"{a_file} is a file, not a model directory" in line, (argv, line)
    run = tmp_path / "run"              # a training run: its model is run/hf
    shutil.copytree(hf_untied, run / "hf")
    for argv in (["generate", "--model", str(run), "hi"],
                 ["eval", "--model", str(run), "--data", str(tasks), "--out", str(tmp_path / "e")],
                 ["convert", "--to", "orbax", str(run), str(tmp_path / "o")]):
        assert main(argv) == 2, argv
        line = _err_line(capsys)
        assert f"its model is {run / 'hf'}" in line, (argv, line)
    stage = tmp_path / "recipe" / "train_sprint"       # a recipe stage: its model is STAGE/out/hf
    shutil.copytree(hf_untied, stage / "out" / "hf")
    assert main(["generate", "--model", str(stage), "hi"]) == 2
    assert f"its model is {stage / 'out' / 'hf'}" in _err_line(capsys)
    cfg = _sft_config(tmp_path, model={"name": str(run), "init": "pretrained"})
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "t"), "--no-progress"]) == 2
    assert f"its model is {run / 'hf'}" in _err_line(capsys)


# ---- curate ---------------------------------------------------------------------------------------

def test_curate_that_fails_before_any_work_leaves_nothing_and_reruns(tmp_path, capsys):
    """A missing tasks file left curation.sqlite and the lock behind, and the corrected rerun was
    refused ("holds a run curated with a different config")."""
    from sprint_jax.outlock import LOCK_FILE

    tasks = tmp_path / "tasks.jsonl"
    argv = ["curate", "--config", str(ROOT / "configs" / "curate_math_rewrite_openai.yaml"), "--set",
            f"tasks.path={tasks}", "--no-progress"]
    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()
    for out in (new, existing):
        assert main(argv + ["--out", str(out)]) == 2
        assert "no such file" in _err_line(capsys)
    assert not new.exists() and list(existing.iterdir()) == []
    # another command into the same directory runs (the leftover store refused it)
    assert main(["curate", "--config", str(CURATE), "--set", "tasks.n=2", "--out", str(new), "--no-progress"]) == 0
    assert (new / "curation.sqlite").exists() and (new / LOCK_FILE).exists()
    # a failure after work was stored keeps the store (it is what a resume needs)
    capsys.readouterr()
    assert main(argv + ["--out", str(new)]) == 2
    assert "different config" in _err_line(capsys) and (new / "curation.sqlite").exists()


def test_curate_refuses_a_tasks_path_its_source_does_not_read(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["curate", "--config", str(CURATE), "--set", f"tasks.path={tmp_path}", "--out", str(out),
                 "--no-progress"]) == 2
    line = _err_line(capsys)
    assert "tasks" in line and "path" in line and "source is countdown" in line, line
    assert not out.exists()
