"""The prompt format travels with the model: `train` records how its training prompts end
(MODEL/sprint_jax.json prompt_format) and `infer` / `generate` give a query to the model that way,
so "Q: 8 5 2 1" typed in a shell reaches a model trained on "Q: 8 5 2 1\\n" as exactly that."""
from __future__ import annotations

import json

import pytest

from sprint_jax.cli import main
from sprint_jax.schema import apply_prompt_format, prompt_format_of

NEWLINE = {"prompt_format": {"trailing": "\n"}}


def test_prompt_format_is_the_common_trailing_whitespace_of_the_training_prompts():
    assert prompt_format_of(["Q: 1 2\n", "Q: 3 4\n"]) == {"trailing": "\n"}
    assert prompt_format_of(["What is 2+2?", "Solve x."]) == {"trailing": ""}
    assert prompt_format_of(["a\n", "b"]) is None          # prompts that end differently: no format
    assert prompt_format_of([]) is None


@pytest.mark.parametrize("text, expected", [
    ("Q: 8 5 2 1", "Q: 8 5 2 1\n"),
    ("Q: 8 5 2 1\n", "Q: 8 5 2 1\n"),            # already in the format: unchanged
    ("Q: 8 5 2 1 \n\n", "Q: 8 5 2 1\n"),
    ("   ", "   "),                             # nothing but whitespace: left for the empty-query check
])
def test_apply_prompt_format_sets_the_trailing_whitespace_and_is_idempotent(text, expected):
    once = apply_prompt_format(text, NEWLINE)
    assert once == expected
    assert apply_prompt_format(once, NEWLINE) == once


def test_a_model_without_the_field_gets_the_text_as_written():
    for meta in ({}, {"layout": "trie"}, {"prompt_format": None}):
        assert apply_prompt_format("Q: 8 5 2 1", meta) == "Q: 8 5 2 1"
    assert apply_prompt_format("What?\n", {"prompt_format": {"trailing": ""}}) == "What?"
    with pytest.raises(ValueError, match="prompt_format"):
        apply_prompt_format("x", {"prompt_format": {"trailing": "Q"}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(export dir, curated prompts) of a tiny model trained for 2 steps by the real trainer on
    curated digit-chains examples, as the demo trains its models."""
    from sprint_jax.config import from_dict
    from sprint_jax.curation.config import CurateConfig
    from sprint_jax.curation.pipeline import run_pipeline
    from sprint_jax.tasks.chains import token_vocabulary
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.train.config import TrainConfig
    from sprint_jax.train.trainer import train

    out = tmp_path_factory.mktemp("prompt_format")
    run_pipeline(from_dict(CurateConfig, {
        "tasks": {"source": "chains", "n": 2, "seed": 0, "chain_length": 3},
        "teacher": {"kind": "programmatic"}, "extractor": {"kind": "offline"}, "dag": {"kind": "offline"},
        "merge_min_chars": 4, "min_ratio": 1.5, "seed": 0, "out": str(out / "curate")}), out / "curate", progress=False)
    prompts = [json.loads(line)["prompt"] for line in (out / "curate" / "sprint.jsonl").read_text().splitlines()]
    tok = VocabTokenizer(token_vocabulary(max_prompts=4), eos_token="<eos>", pad_token="<pad>")
    model = {"model_type": "qwen2", "vocab_size": (len(tok) + 7) // 8 * 8, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id}
    tc = from_dict(TrainConfig, {
        "model": {"name": model, "init": "scratch", "dtype": "float32", "remat": "none", "init_seed": 0},
        "data": {"train": [str(out / "curate" / "sprint.jsonl")], "layout": "merge", "seq_len": 256, "seed": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 1, "batch_size": 2},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1}, "checkpoint": {"every": 0, "resume": False},
        "steps": 2, "log_every": 1, "seed": 0, "tensorboard": False, "plot": False})
    summary = train(tc, out / "train", tokenizer=tok, progress=False)
    return summary["export_dir"], prompts


def test_train_writes_the_prompt_format_into_the_export(trained):
    from sprint_jax.model.hf import read_export_meta

    export, prompts = trained
    assert prompts and all(p.startswith("Q: ") and p[-1] == "\n" and not p[-2].isspace() for p in prompts)
    assert read_export_meta(export)["prompt_format"] == {"trailing": "\n"}


def _first_prefills(monkeypatch, argv_list) -> list[list[int]]:
    """The tokens of the first sequence the engine opens in each of the runs."""
    from sprint_jax.infer.engine import Engine

    seen: list[list[int]] = []
    original = Engine.open

    def spy(self, token_ids, *a, **kw):
        seen.append([int(t) for t in token_ids])
        return original(self, token_ids, *a, **kw)

    monkeypatch.setattr(Engine, "open", spy)
    firsts = []
    for argv in argv_list:
        seen.clear()
        assert main(argv) == 0
        firsts.append(list(seen[0]))
    return firsts


def test_infer_and_generate_give_the_engine_the_same_tokens_with_or_without_the_newline(trained, monkeypatch,
                                                                                      capsys):
    from sprint_jax.model.tokenizer import load_tokenizer

    export, _ = trained
    expected = load_tokenizer(export).encode("Q: 8 5 2 1\n")   # the query in the trained format
    assert expected[-1] == load_tokenizer(export).encode("\n")[0]
    flags = ["--model", export, "--mode", "sequential", "--max-total-tokens", "2", "--max-prompts", "1",
             "--max-branch-tokens", "4", "--max-seq-len", "32", "--decode-chunk", "2", "--prefill-chunk", "16"]
    bare, newline = _first_prefills(monkeypatch, [["infer", "Q: 8 5 2 1", *flags], ["infer", "Q: 8 5 2 1\n", *flags]])
    assert bare == newline == expected
    err = capsys.readouterr().err
    assert err.count("note: the query now ends in '\\n'") == 1       # said once: only the bare query changed
    gen = ["generate", "--model", export, "--max-new-tokens", "1"]
    bare, newline = _first_prefills(monkeypatch, [[*gen, "Q: 8 5 2 1"], [*gen, "Q: 8 5 2 1\n"]])
    assert bare == newline == expected
    assert capsys.readouterr().err.count("note: the prompt now ends in '\\n'") == 1


def test_a_prompt_outside_the_vocabulary_is_one_line_even_where_the_format_applies(trained, capsys):
    export, _ = trained
    for command in ("generate", "infer"):
        assert main([command, "--model", export, "hello world", "--max-seq-len" if command == "infer" else
                     "--max-new-tokens", "8"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot encode" in err[0] and "'h'" in err[0], err


def test_eval_gives_each_task_to_the_model_in_its_prompt_format(trained, tmp_path, monkeypatch):
    from sprint_jax.infer.engine import Engine

    export, _ = trained
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0", "problem": "Q: 8 5 2 1", "answer": "1"}) + "\n")   # no newline
    seen: list[str] = []
    original = Engine.encode
    monkeypatch.setattr(Engine, "encode", lambda self, text: (seen.append(text), original(self, text))[1])
    assert main(["eval", "--model", export, "--data", str(tasks), "--out", str(tmp_path / "out"), "--mode",
                 "sequential", "--max-total-tokens", "2", "--max-seq-len", "32", "--decode-chunk", "2",
                 "--prefill-chunk", "16", "--no-progress"]) == 0
    assert seen and all(t == "Q: 8 5 2 1\n" for t in seen)


def test_serve_gives_a_bare_prompt_to_the_model_in_its_prompt_format(trained):
    import openai

    from sprint_jax.infer.engine import Engine
    from sprint_jax.model import from_pretrained
    from sprint_jax.model.hf import read_export_meta
    from sprint_jax.model.tokenizer import load_tokenizer
    from sprint_jax.serve import Server

    export, _ = trained
    tok = load_tokenizer(export)
    engine = Engine(from_pretrained(export), tok, max_seqs=2, max_children=2, max_seq_len=64,
                    max_branch_tokens=8, decode_chunk=2, prefill_chunk=16)
    with Server(engine, "m", export_meta=read_export_meta(export)).start() as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        usage = [client.completions.create(model="m", prompt=p, max_tokens=1, temperature=0).usage.prompt_tokens
                 for p in ("Q: 8 5 2 1", "Q: 8 5 2 1\n")]
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q: 8 5 2 1"}],
                                              max_tokens=1, temperature=0).usage.prompt_tokens
    assert usage == [len(tok.encode("Q: 8 5 2 1\n"))] * 2 and chat == usage[0]
