"""sprint_jax.tasks: task sources (jsonl, parquet, arrow, HF datasets saved to disk), the loaders'
bad-input errors, answer extraction, grader errors counted, and the package carrying its own data
with no path outside the repository."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sprint_jax.errors import UserError
from sprint_jax.tasks import (Task, TaskFileError, extract_answer, grade, grade_result, load_hf_dataset,
                              load_math500, load_task_file, problem_hash, task_prompt)

REPO = Path(__file__).resolve().parents[1]
RECORDS = [{"problem": "What is 1+1?", "answer": "2", "solution": None, "level": 1},   # columnar formats
           {"problem": "Compute $3^2$.", "answer": None, "solution": r"It is $\boxed{9}$.", "level": 2},
           {"problem": "Half of 1?", "answer": r"\frac{1}{2}", "solution": None, "level": 3}]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def _expected(stem: str) -> list[tuple]:
    return [(f"{stem}-1", "What is 1+1?", "2"), (f"{stem}-2", "Compute $3^2$.", "9"),
            (f"{stem}-3", "Half of 1?", r"\frac{1}{2}")]


# ---------------------------------------------------------------------------------------------
# sources: every format gives the same tasks as the jsonl (built independently with pyarrow /
# datasets, read back through our loader)
# ---------------------------------------------------------------------------------------------
def test_jsonl_parquet_arrow_give_the_same_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, tmp_path / "math.parquet")
    feather.write_feather(table, tmp_path / "math.arrow")
    rows = {}
    for name in ("math.parquet", "math.arrow"):
        rows[name] = [(t.id, t.problem, t.answer) for t in load_task_file(tmp_path / name)]
    assert rows["math.parquet"] == _expected("math") == rows["math.arrow"]
    jl = load_task_file(_jsonl(tmp_path / "math.jsonl", RECORDS))
    assert [(t.id, t.problem, t.answer) for t in jl] == _expected("math")
    assert load_task_file(tmp_path / "math.parquet", limit=2)[1].meta["level"] == 2


def test_hf_dataset_saved_to_disk(tmp_path):
    import datasets

    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "ds"))
    got = load_hf_dataset(str(tmp_path / "ds"), "math", "train")
    assert [(t.id, t.problem, t.answer) for t in got] == _expected("ds")
    # a DatasetDict with splits: the split is chosen, a missing one is named
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:2]),
                          "test": datasets.Dataset.from_list(RECORDS[2:])}).save_to_disk(str(tmp_path / "dd"))
    assert [t.answer for t in load_hf_dataset(str(tmp_path / "dd"), "math", "test")] == [r"\frac{1}{2}"]
    with pytest.raises(TaskFileError, match=r"splits \['test', 'train'\]"):
        load_hf_dataset(str(tmp_path / "dd"), "math", "validation")
    # the same directory is also a task *file* for eval --data / tasks.source: file
    assert [t.problem for t in load_task_file(tmp_path / "ds")] == [r["problem"] for r in RECORDS]


def test_curation_reads_an_hf_dataset(tmp_path):
    import datasets

    from sprint_jax.curation.config import load_curate_config
    from sprint_jax.curation.pipeline import load_tasks

    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "ds"))
    cfg = load_curate_config(None, ["tasks.source=hf_dataset", f"tasks.path={tmp_path / 'ds'}", "tasks.limit=2",
                                    "teacher.kind=openai", "teacher.model=m"])
    assert [t.answer for t in load_tasks(cfg)] == ["2", "9"]


def test_unreadable_sources_are_one_line_errors(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TaskFileError, match="not readable as parquet"):
        load_task_file(tmp_path / "bad.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TaskFileError, match="unknown format '.csv'"):
        load_task_file(tmp_path / "x.csv")


# ---------------------------------------------------------------------------------------------
# the task loaders' bad input (each failed before the fix)
# ---------------------------------------------------------------------------------------------
def test_choice_loader_rejects_duplicate_ids(tmp_path):
    p = _jsonl(tmp_path / "mc.jsonl", [{"id": "q", "question": "a?", "choices": ["x", "y"], "answer": "A"},
                                       {"id": "q", "question": "b?", "choices": ["x", "y"], "answer": "B"}])
    with pytest.raises(TaskFileError, match=r"mc\.jsonl:2: duplicate task id 'q' \(first at .*mc\.jsonl:1\)"):
        load_task_file(p, "choice")


def test_non_utf8_file_under_auto_is_one_line(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"problem": "caf\u00e9?", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(TaskFileError, match="not UTF-8"):
        load_task_file(p, "auto")
    proc = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "eval", "--model", str(tmp_path), "--data", str(p),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("kind, record, field", [
    ("math", {"problem": "", "answer": "1"}, "problem"),
    ("math", {"problem": "   \n", "answer": "1"}, "problem"),
    ("math", {"problem": "p", "answer": " "}, "answer"),
    ("choice", {"question": "", "choices": ["x", "y"], "answer": "A"}, "question"),
])
def test_empty_problem_text_is_an_error(tmp_path, kind, record, field):
    with pytest.raises(TaskFileError, match=rf":1: field '{field}' is empty"):
        load_task_file(_jsonl(tmp_path / "t.jsonl", [record]), kind)


def test_id_zero_is_kept(tmp_path):
    math = load_task_file(_jsonl(tmp_path / "m.jsonl", [{"id": 0, "problem": "p", "answer": "1"},
                                                        {"id": 1, "problem": "q", "answer": "2"}]), "math")
    assert [t.id for t in math] == ["0", "1"]
    mc = load_task_file(_jsonl(tmp_path / "c.jsonl", [{"id": 0, "question": "a", "choices": ["x", "y"],
                                                       "answer": "A"}]), "choice")
    assert mc[0].id == "0"
    # 0 and the fallback name for record 1 are different ids; a real clash is still caught
    with pytest.raises(TaskFileError, match="duplicate task id '0'"):
        load_task_file(_jsonl(tmp_path / "d.jsonl", [{"id": 0, "problem": "p", "answer": "1"},
                                                     {"id": "0", "problem": "q", "answer": "2"}]), "math")
    with pytest.raises(TaskFileError, match="must be a string or an integer"):
        load_task_file(_jsonl(tmp_path / "e.jsonl", [{"id": [1], "problem": "p", "answer": "1"}]), "math")


# ---------------------------------------------------------------------------------------------
# answer extraction; grader errors are counted, not silently wrong
# ---------------------------------------------------------------------------------------------
def test_answer_extraction_modes():
    text = r"Thinking... so $x = \boxed{3}$, no wait, $\boxed{\frac{1}{2}}$."
    assert extract_answer(None, text, "final_answer") is None
    assert extract_answer(None, text, "boxed_last") == r"\boxed{\frac{1}{2}}"
    assert extract_answer(None, text, "auto") == r"\boxed{\frac{1}{2}}"
    assert extract_answer("7", text, "auto") == "7" and extract_answer("7", text, "final_answer") == "7"
    assert extract_answer("7", text, "boxed_last") == r"\boxed{\frac{1}{2}}"
    assert extract_answer(None, "no box", "auto") is None
    task = Task("t", "math", "Half of 1?", "0.5")
    assert grade(task, extract_answer(None, text, "boxed_last"))      # math-verify: 1/2 == 0.5
    with pytest.raises(ValueError, match="final_answer, boxed_last, auto"):
        extract_answer(None, text, "last")


def test_grader_error_is_reported_and_logged(caplog):
    broken = Task("cd-1", "countdown", "p", {"numbers": [1, 2]})          # no target: the grader fails
    with caplog.at_level(logging.WARNING, logger="sprint_jax.tasks"):
        result = grade_result(broken, "1 + 2")
    assert result.correct is False and result.error.startswith("KeyError")
    assert "grader error on task cd-1" in caplog.text
    with pytest.raises(KeyError):
        grade(broken, "1 + 2")                                          # the plain grader raises
    assert grade_result(Task("m", "math", "p", "2"), None).error is None  # no answer: wrong, not an error


def test_problem_hash_normalises_spacing_and_case():
    assert problem_hash("What is  1+1?\n") == problem_hash("what is 1+1?")
    assert problem_hash("What is 1+2?") != problem_hash("What is 1+1?")
    assert task_prompt(Task("t", "math", "P?", "1")) == "P?"


# ---------------------------------------------------------------------------------------------
# the package carries its data; nothing refers to a directory beside the repository
# ---------------------------------------------------------------------------------------------
def test_package_data_is_inside_the_package():
    import hashlib

    import sprint_jax
    from sprint_jax.model.tokenizer import data_dir
    pkg = Path(sprint_jax.__file__).resolve().parent
    assert data_dir() == pkg / "data"
    m500 = (pkg / "data" / "math500.jsonl").read_bytes()
    assert hashlib.sha256(m500).hexdigest() == "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
    tasks = load_math500()
    assert len(tasks) == 500 and tasks[0].id == "test/precalculus/807.json"
    pyproject = (REPO / "pyproject.toml").read_text()
    for f in ("data/math500.jsonl", "data/qwen2_tokenizer/vocab.json", "data/qwen2_tokenizer/merges.txt",
              "data/SOURCES.md"):
        assert (pkg / f).is_file() and f'"{f}"' in pyproject, f


def test_sprint_jax_data_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRINT_JAX_DATA", str(tmp_path))
    with pytest.raises(UserError, match=r"math500\.jsonl not found at .*SPRINT_JAX_DATA="):
        load_math500()
    _jsonl(tmp_path / "math500.jsonl", RECORDS[:1])
    assert [t.answer for t in load_math500()] == ["2"]


def test_nothing_refers_to_a_directory_beside_the_repo():
    pattern = re.compile(r"\.\./shared|shared/data|/work/shared")
    roots = [REPO / "sprint_jax", REPO / "configs", REPO / "tests", REPO / "kernels", REPO / ".ci"]
    files = [REPO / "README.md", REPO / "dev.sh", REPO / "pyproject.toml"]
    for root in roots:
        files += [p for p in root.rglob("*") if p.is_file() and p.suffix not in (".pyc", ".json", ".txt")
                  and "__pycache__" not in p.parts]
    assert len(files) > 50
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(REPO)}:{n}" for p in files if p.resolve() != me
            for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if pattern.search(line)]
    assert hits == []


def test_chains_token_vocabulary_covers_every_demo_text_once():
    """Every chain word and every tag of the SPRINT bodies a chains model writes is one token; no
    string twice (a VocabTokenizer maps strings to ids)."""
    from sprint_jax import format as fmt
    from sprint_jax.tasks import chains

    vocab = chains.token_vocabulary(max_prompts=4)
    assert vocab[:2] == ["<pad>", "<eos>"] and len(set(vocab)) == len(vocab)
    assert set(chains.vocabulary()) <= set(vocab)
    for tag in fmt.tag_vocabulary(max_stages=3, max_prompts=4):
        assert tag in vocab
        assert (" " + tag if tag.startswith("</") else tag if tag.startswith("<execution") else tag + " ") in vocab
    assert "<Plan_4>" not in vocab and "<Plan_4>" in chains.token_vocabulary(4, max_stages=4)


# sha256 of json.dumps(chains.token_vocabulary(max_prompts, max_stages)) as it was before
# ThreadWeaver's entries were appended (the ids of demo models trained then), and its length
_SPRINT_VOCABULARY = {(4, 3): (118, "e6fdacf674930b208f97e9eb4b64eeff306fbfefbe8135f491596f404591ef6c"),
                      (2, 3): (76, "485a9fa4d403596758f717e412cffd6dbaa9032e2104654a288ec4de068167d2"),
                      (4, 4): (150, "b2d921916bb12387b7ba904edca2b71bc9a9297ea8794ae4f7bda3cfe54e18c3")}


def test_chains_token_vocabulary_keeps_every_sprint_id_and_writes_threadweaver_tags_as_one_token():
    """The SPRINT entries are the vocabulary a demo model was trained with, unchanged (the recorded
    hash); ThreadWeaver's come after them; a rendered ThreadWeaver example of the demo task
    round-trips and every tag in it is one token (the tag, or `<Outline>j:` / `<Thread>j:`)."""
    import hashlib
    import json

    from sprint_jax import format as fmt
    from sprint_jax import threadweaver as tw
    from sprint_jax.model.tokenizer import VocabTokenizer, encode_with_offsets
    from sprint_jax.tasks import chains

    for (prompts, stages), (n, digest) in _SPRINT_VOCABULARY.items():
        vocab = chains.token_vocabulary(prompts, max_stages=stages)
        assert hashlib.sha256(json.dumps(vocab[:n]).encode()).hexdigest() == digest
        assert vocab[:n] == chains.token_vocabulary(prompts, max_stages=stages, threadweaver=False)
        extra = vocab[n:]
        assert len(extra) == 10 + 2 * prompts and len(set(vocab)) == len(vocab)
        assert set(tw.tag_vocabulary()) <= set(extra)
        assert {f"<Outline>{j}:" for j in range(1, prompts + 1)} | {f"<Thread>{j}:" for j in range(1, prompts + 1)} \
            <= set(extra)

    task = chains.generate(1, 0)[0]
    starts = task.answer["starts"]
    traj = tw.from_sprint(fmt.Trajectory(stages=[
        fmt.Stage(1, [fmt.Prompt(f"Chain {s}:") for s in starts], [chains.chain(s, 12) for s in starts]),
        fmt.Stage(2, [chains.COMBINE])], final_answer=str(task.answer["value"])))
    text = chains.prompt_for(task) + tw.render_completion(traj)
    tok = VocabTokenizer(chains.token_vocabulary(max_prompts=4), eos_token="<eos>", pad_token="<pad>")
    ids, offsets = encode_with_offsets(tok, text)
    assert tok.decode(ids) == text
    tags = list(tw.TAG_PATTERN.finditer(text))
    assert len(tags) == 2 + 2 + 2 + 2 * 4 + 2 * 4      # think, Parallel, Outlines, 4 outlines, 4 threads
    for m in tags:
        holding = [(a, b) for a, b in offsets if a < m.end() and b > m.start()]
        assert len(holding) == 1, (m.group(0), holding)
        a, b = holding[0]
        token = text[a:b]
        assert a == m.start() and (token == m.group(0) or re.fullmatch(r"<(Outline|Thread)>[1-4]:", token)), token


# ---------------------------------------------------------------------------------------------
# digit chains of mixed lengths: the held-out set, the training set kept out of it
# ---------------------------------------------------------------------------------------------
def _demo_draws(n: int, seed: int, exclude=frozenset()) -> list[tuple[int, ...]]:
    """The demo's start tuples written out independently: four random.Random(seed) digits per
    problem (randint(4, 4) still consumes its draw), tuples in `exclude` skipped."""
    import random

    rng, out = random.Random(seed), []
    while len(out) < n:
        rng.randint(4, 4)
        starts = tuple(rng.randrange(10) for _ in range(4))
        if starts not in exclude:
            out.append(starts)
    return out


def test_the_demos_chains_problems_are_unchanged():
    from sprint_jax.curation.config import data_fingerprint, load_curate_config
    from sprint_jax.curation.pipeline import load_tasks as curate_tasks
    from sprint_jax.tasks import chains

    cfg = load_curate_config(None, ["tasks.source=chains", "tasks.n=300", "teacher.kind=programmatic"])
    train = [tuple(t.answer["starts"]) for t in curate_tasks(cfg)]
    assert train == _demo_draws(300, 0)
    test = [tuple(t.answer["starts"]) for t in chains.demo_test_set(n=50, train_problems=300)]
    assert test == _demo_draws(50, 10_000, set(train))
    # the new fields at their defaults leave a store's fingerprint as it was (old stores resume)
    assert not {"min_chains", "max_chains", "held_out"} & set(data_fingerprint(cfg)["tasks"])


def test_mixed_test_set_is_distinct_mixed_and_prefix_stable():
    from sprint_jax.tasks import chains

    tasks = chains.mixed_test_set(300, seed=0, min_chains=2, max_chains=4)
    starts = [tuple(t.answer["starts"]) for t in tasks]
    assert len(set(starts)) == 300 and {len(s) for s in starts} == {2, 3, 4}
    assert sum(len(s) == 2 for s in starts) > 60                # about a third of the draws
    assert [t.id for t in chains.mixed_test_set(40, 0, 2, 4)] == [t.id for t in tasks[:40]]
    for t in tasks[:20]:                                        # answers by hand: the cycle walked
        s = t.answer["starts"]
        last = [chains.CYCLE[(chains.CYCLE.index(d) + 12) % 10] for d in s]
        assert t.answer["value"] == max(last) and t.problem == "Q: " + " ".join(map(str, s)) + "\n"
    # all 100 two-chain tuples: the 101st is refused, not looped for
    assert len(chains.generate(100, 0, 2, 2, distinct=True)) == 100
    with pytest.raises(ValueError, match="only 100 start tuples"):
        chains.generate(101, 0, 2, 2, distinct=True)


def test_curated_mixed_problems_keep_out_of_the_held_out_set(tmp_path, capsys):
    from sprint_jax.curation.config import data_fingerprint, load_curate_config
    from sprint_jax.curation.pipeline import load_tasks as curate_tasks
    from sprint_jax.eval.cli import mixed_chains_tasks

    cfg = load_curate_config(None, ["tasks.source=chains", "tasks.n=2000", "tasks.min_chains=2",
                                    "tasks.max_chains=4", "tasks.held_out=100", "teacher.kind=programmatic"])
    train = {tuple(t.answer["starts"]) for t in curate_tasks(cfg)}
    assert {len(s) for s in train} == {2, 3, 4}
    assert data_fingerprint(cfg)["tasks"]["held_out"] == 100
    def args(data="chains", chains="2-4", limit=None):       # eval's parsed arguments, as mixed_chains_tasks reads them
        return SimpleNamespace(data=data, chains=chains, limit=limit, chain_length=12, data_seed=0)

    held = mixed_chains_tasks(args(limit=None))             # --limit unset: 100 problems
    held_starts = {tuple(t.answer["starts"]) for t in held}
    assert len(held) == 100 and {len(s) for s in held_starts} == {2, 3, 4} and not held_starts & train
    # without held_out, 2000 draws take every one of the 100 two-chain tuples
    cfg0 = load_curate_config(None, ["tasks.source=chains", "tasks.n=2000", "tasks.min_chains=2",
                                     "tasks.max_chains=4", "teacher.kind=programmatic"])
    assert held_starts & {tuple(t.answer["starts"]) for t in curate_tasks(cfg0)}
    for bad, match in ((args(chains="4-2"), "MIN-MAX with 1 <= MIN <= MAX"),
                       (args(chains="2"), "MIN-MAX with 1 <= MIN <= MAX"),
                       (args(data="math500"), "needs --data chains"),
                       (args(chains="2-2", limit=101), "only 100 start tuples")):
        with pytest.raises(UserError, match=match):
            mixed_chains_tasks(bad)
    with pytest.raises(ValueError, match="min_chains <= max_chains"):
        load_curate_config(None, ["tasks.source=chains", "tasks.min_chains=3", "tasks.max_chains=2"])


def test_a_held_out_larger_than_its_tuple_space_is_a_config_error():
    from sprint_jax.curation.config import load_curate_config

    with pytest.raises(ValueError, match="held_out 101: more than the distinct start digits of 2..2 chains"):
        load_curate_config(None, ["tasks.source=chains", "tasks.min_chains=2", "tasks.max_chains=2",
                                  "tasks.held_out=101"])
    assert load_curate_config(None, ["tasks.min_chains=2", "tasks.max_chains=2", "tasks.held_out=100"])
