"""SPRINT's query wrapper: curation's `prompt_wrapper: query_tags` writes each prompt as
`<query> PROMPT </query>` (then the task prompt's own trailing whitespace), `train` records the
wrapper in the export's prompt format, and the one prompt function infer / generate / eval /
serve / RL share wraps a bare query and leaves a wrapped one alone. Without the option, and for
an export without the fields, everything is as before."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sprint_jax.cli import main
from sprint_jax.schema import QUERY_WRAPPERS, apply_prompt_format, prompt_format_of, unwrap_query, wrap_query

WRAPPED = {"prompt_format": {"trailing": "\n", "prefix": "<query> ", "suffix": " </query>"}}


def _curate(out, wrapper: str | None):
    from sprint_jax.config import from_dict
    from sprint_jax.curation.config import CurateConfig
    from sprint_jax.curation.pipeline import run_pipeline

    cfg = {"tasks": {"source": "chains", "n": 2, "seed": 0, "chain_length": 3},
           "teacher": {"kind": "programmatic"}, "extractor": {"kind": "offline"}, "dag": {"kind": "offline"},
           "merge_min_chars": 4, "min_ratio": 1.5, "seed": 0, "out": str(out)}
    if wrapper is not None:
        cfg["prompt_wrapper"] = wrapper
    run_pipeline(from_dict(CurateConfig, cfg), out, progress=False)
    return {kind: [json.loads(line) for line in (out / f"{kind}.jsonl").read_text().splitlines()]
            for kind in ("sprint", "rft")}


@pytest.fixture(scope="module")
def curated(tmp_path_factory):
    """(examples without the option, examples with query_tags, the wrapped run's directory)."""
    root = tmp_path_factory.mktemp("query_wrapper")
    return _curate(root / "bare", None), _curate(root / "wrapped", "query_tags"), root / "wrapped"


def test_wrap_query_by_hand():
    tags = QUERY_WRAPPERS["query_tags"]
    assert wrap_query("Q: 7 3 9 2\n", *tags) == "<query> Q: 7 3 9 2 </query>\n"
    assert wrap_query("What is 2+2?", *tags) == "<query> What is 2+2? </query>"
    assert wrap_query("  What is 2+2? \n\n", *tags) == "<query> What is 2+2? </query> \n\n"   # its own ending
    assert wrap_query("<query> What is 2+2? </query>", *tags) == "<query> What is 2+2? </query>"   # never twice
    assert wrap_query("   ", *tags) == "   "
    assert unwrap_query("<query> Q: 7 3 9 2 </query>\n") == "Q: 7 3 9 2\n"
    assert unwrap_query("Q: 7 3 9 2\n") == "Q: 7 3 9 2\n"


def test_curation_with_query_tags_writes_wrapped_prompts(curated):
    bare, wrapped, _ = curated
    for kind in ("sprint", "rft"):
        assert wrapped[kind] and len(wrapped[kind]) == len(bare[kind])
        for b, w in zip(bare[kind], wrapped[kind]):
            starts = " ".join(str(s) for s in w["answer"]["starts"])
            assert b["prompt"] == f"Q: {starts}\n"                     # the default: unchanged
            assert w["prompt"] == f"<query> Q: {starts} </query>\n"    # SPRINT's wrapper, the newline after it
            assert w["completion"] == b["completion"]                  # only the prompt differs
    assert prompt_format_of(e["prompt"] for e in bare["sprint"]) == {"trailing": "\n"}      # as before: no new keys
    assert prompt_format_of(e["prompt"] for e in wrapped["sprint"]) == WRAPPED["prompt_format"]


def test_the_wrapper_is_in_the_curation_fingerprint_only_when_set():
    from sprint_jax.config import from_dict
    from sprint_jax.curation.config import CurateConfig, data_fingerprint

    base = {"tasks": {"source": "chains", "n": 2}, "teacher": {"kind": "programmatic"}}
    assert "prompt_wrapper" not in data_fingerprint(from_dict(CurateConfig, base))   # older stores still resume
    assert data_fingerprint(from_dict(CurateConfig, {**base, "prompt_wrapper": "query_tags"}))["prompt_wrapper"] \
        == "query_tags"


def test_prompt_format_records_a_wrapper_only_when_every_prompt_has_it():
    assert prompt_format_of(["<query> a </query>", "<query> b </query>"]) == \
        {"trailing": "", "prefix": "<query> ", "suffix": " </query>"}
    assert prompt_format_of(["<query> a </query>", "b"]) == {"trailing": ""}
    assert prompt_format_of(["<query> a </query>\n", "<query> b </query>"]) == \
        {"prefix": "<query> ", "suffix": " </query>"}               # endings differ: the wrapper alone
    assert prompt_format_of(["Q: 1\n", "Q: 2\n"]) == {"trailing": "\n"}   # shared text is content


@pytest.mark.parametrize("text", ["Q: 8 5 2 1", "Q: 8 5 2 1\n", "  Q: 8 5 2 1 \n\n", "<query> Q: 8 5 2 1 </query>",
                                  "<query> Q: 8 5 2 1 </query>\n"])
def test_the_shared_prompt_function_wraps_a_bare_query_once(text):
    once = apply_prompt_format(text, WRAPPED)
    assert once == "<query> Q: 8 5 2 1 </query>\n"
    assert apply_prompt_format(once, WRAPPED) == once
    # the wrapper alone (training prompts ended differently): the text keeps its own ending
    assert apply_prompt_format(text, {"prompt_format": {"prefix": "<query> ", "suffix": " </query>"}}).rstrip() \
        == "<query> Q: 8 5 2 1 </query>"


def test_an_export_without_the_fields_behaves_as_before(tmp_path):
    from sprint_jax.errors import UserError
    from sprint_jax.infer.infer_cli import export_meta

    for meta in ({}, {"prompt_format": None}):
        assert apply_prompt_format("Q: 8 5 2 1", meta) == "Q: 8 5 2 1"
    old = {"prompt_format": {"trailing": "\n"}}
    assert apply_prompt_format("Q: 8 5 2 1", old) == "Q: 8 5 2 1\n"
    assert apply_prompt_format("<query> Q: 8 5 2 1 </query>", old) == "<query> Q: 8 5 2 1 </query>\n"   # not unwrapped
    (tmp_path / "sprint_jax.json").write_text(json.dumps({"layout": "trie", **old}))
    assert export_meta(str(tmp_path))["prompt_format"] == {"trailing": "\n"}
    for bad in ({"trailing": "\n", "prefix": "<query> "}, {"prefix": " ", "suffix": " "}, {"trailing": "\n", "x": 1}):
        (tmp_path / "sprint_jax.json").write_text(json.dumps({"prompt_format": bad}))
        with pytest.raises(UserError, match="prompt_format"):
            export_meta(str(tmp_path))


def test_rl_rollouts_and_serve_put_the_query_in_the_policy_format(tmp_path):
    from sprint_jax.rl.trainer import prompt_fn
    from sprint_jax.serve.app import ServeState
    from sprint_jax.tasks.chains import generate

    (tmp_path / "sprint_jax.json").write_text(json.dumps(WRAPPED))
    task = generate(1, seed=0, length=3)[0]
    starts = " ".join(str(s) for s in task.answer["starts"])
    cfg = SimpleNamespace(tasks=SimpleNamespace(source="chains"), policy=SimpleNamespace(path=str(tmp_path)))
    assert prompt_fn(cfg)(task) == f"<query> Q: {starts} </query>\n"
    assert ServeState.formatted(SimpleNamespace(export_meta=WRAPPED), "Q: 1 2") == \
        "<query> Q: 1 2 </query>\n"


# ---------------------------------------------------------------------------------------------
# A tiny model trained on the wrapped examples (a 1-layer model, 2 steps)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(curated):
    from sprint_jax.config import from_dict
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    _, wrapped, curate_dir = curated
    tok = VocabTokenizer(token_vocabulary(max_prompts=4) + ["<query> ", " </query>"], eos_token="<eos>",
                         pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "init_seed": 0},
        "data": {"train": [str(curate_dir / "sprint.jsonl")], "layout": "merge", "seq_len": 256, "seed": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 1, "batch_size": 2},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "steps": 1, "log_every": 1, "seed": 0, "tensorboard": False, "plot": False})
    summary = train(tc, curate_dir.parent / "train", tokenizer=tok, progress=False)
    return summary["export_dir"], wrapped


def test_train_records_the_wrapper_and_eval_still_finds_its_problems(trained):
    from sprint_jax.errors import UserError
    from sprint_jax.eval.cli import check_overlap
    from sprint_jax.model.hf import read_export_meta
    from sprint_jax.tasks import Task

    export, wrapped = trained
    assert read_export_meta(export)["prompt_format"] == WRAPPED["prompt_format"]
    # the contamination guard hashes the bare task prompt; the fingerprint must match it
    tasks = [Task(id=e["id"], kind="chains", problem="", answer=e["answer"]) for e in wrapped["sprint"]]
    with pytest.raises(UserError, match="training data"):
        check_overlap(export, tasks, allow=False)


def test_infer_and_eval_give_the_model_the_wrapped_query(trained, tmp_path, monkeypatch, capsys):
    from sprint_jax.infer.engine import Engine
    from sprint_jax.model.tokenizer import load_tokenizer

    export, _ = trained
    expected = load_tokenizer(export).encode("<query> Q: 8 5 2 1 </query>\n")
    opened: list[list[int]] = []
    original_open = Engine.open
    monkeypatch.setattr(Engine, "open", lambda self, ids, *a, **kw: (opened.append([int(t) for t in ids]),
                                                                     original_open(self, ids, *a, **kw))[1])
    flags = ["--model", export, "--mode", "sequential", "--max-total-tokens", "2", "--max-prompts", "1",
             "--max-branch-tokens", "4", "--max-seq-len", "32", "--decode-chunk", "2", "--prefill-chunk", "16"]
    firsts = []
    for query in ("Q: 8 5 2 1", "<query> Q: 8 5 2 1 </query>\n"):
        opened.clear()
        assert main(["infer", query, *flags]) == 0
        firsts.append(opened[0])
    assert firsts == [expected, expected]
    assert capsys.readouterr().err.count("note: the query is now '<query> Q: 8 5 2 1 </query>\\n'") == 1

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0", "problem": "Q: 8 5 2 1", "answer": "1"}) + "\n")
    seen: list[str] = []
    original_encode = Engine.encode
    monkeypatch.setattr(Engine, "encode", lambda self, text: (seen.append(text), original_encode(self, text))[1])
    assert main(["eval", "--model", export, "--data", str(tasks), "--out", str(tmp_path / "out"), "--mode",
                 "sequential", "--max-total-tokens", "2", "--max-seq-len", "32", "--decode-chunk", "2",
                 "--prefill-chunk", "16", "--no-progress"]) == 0
    assert seen and all(t == "<query> Q: 8 5 2 1 </query>\n" for t in seen)
