"""Training on ThreadWeaver examples (`data.format: threadweaver`) in every layout: the cut into
inference calls checked against a hand-written example and against the SPRINT version of the same
examples, loss masks against the completion text itself, a train step per layout, the CLI run and
its export meta, and the format guard on `meta.format`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sprint_jax import format as sf
from sprint_jax import threadweaver as tw
from sprint_jax.config import ConfigError
from sprint_jax.schema import Example
from sprint_jax.train import data as D
from sprint_jax.train.config import SPAN_WEIGHTS_DEFAULT, load_train_config

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
TW_FILE = DATA / "sft_tiny_threadweaver.jsonl"
W = dict(SPAN_WEIGHTS_DEFAULT)
TW = "threadweaver"


@pytest.fixture(scope="module")
def tok():
    return D.byte_tokenizer()


# ---------------------------------------------------------------------------------------------
# (a) a hand-written example: pieces, forced flags, units and labels written out by hand
# ---------------------------------------------------------------------------------------------
HAND_PROMPT = "Q?\n"
# (piece text, forced, stage, branch, labels as (kind, text) runs covering the piece)
HAND_PIECES = [
    ("<think>\nplan A\n<Parallel>\n<Outlines>\n<Outline>1: x</Outline>\n<Outline>2: y</Outline>\n</Outlines>",
     False, 1, 0,
     [("tag", "<think>"), ("plan", "\nplan A\n"), ("tag", "<Parallel>"), ("plan", "\n"), ("tag", "<Outlines>"),
      ("plan", "\n"), ("tag", "<Outline>1:"), ("prompt", " x"), ("tag", "</Outline>"), ("plan", "\n"),
      ("tag", "<Outline>2:"), ("prompt", " y"), ("tag", "</Outline>"), ("plan", "\n"), ("tag", "</Outlines>")]),
    ("\n<Thread>1:", True, 1, 1, [("plan", "\n"), ("tag", "<Thread>1:")]),
    (" a</Thread>", False, 1, 1, [("execution", " a"), ("tag", "</Thread>")]),
    ("\n<Thread>2:", True, 1, 2, [("plan", "\n"), ("tag", "<Thread>2:")]),
    (" b</Thread>", False, 1, 2, [("execution", " b"), ("tag", "</Thread>")]),
    ("\n</Parallel>", True, 2, 0, [("plan", "\n"), ("tag", "</Parallel>")]),
    ("\nmore\n<Parallel>\n<Outlines>\n<Outline>1: z</Outline>\n</Outlines>", False, 2, 0,
     [("plan", "\nmore\n"), ("tag", "<Parallel>"), ("plan", "\n"), ("tag", "<Outlines>"), ("plan", "\n"),
      ("tag", "<Outline>1:"), ("prompt", " z"), ("tag", "</Outline>"), ("plan", "\n"), ("tag", "</Outlines>")]),
    ("\n<Thread>1:", True, 2, 1, [("plan", "\n"), ("tag", "<Thread>1:")]),
    (" c</Thread>", False, 2, 1, [("execution", " c"), ("tag", "</Thread>")]),
    ("\n</Parallel>", True, 3, 0, [("plan", "\n"), ("tag", "</Parallel>")]),
    ("\nend\n</think>\nans 7", False, 3, 0, [("plan", "\nend\n"), ("tag", "</think>"), ("answer", "\nans 7")]),
]
# pieces: 0 prompt, 1 plan 1, 2-3 thread 1.1, 4-5 thread 1.2, 6 join, 7 plan 2, 8-9 thread 2.1, 10 join, 11 end
HAND_UNITS = [(0, 1), (0, 1, 2, 3), (0, 1, 4, 5), (0, 1, 2, 3, 4, 5, 6, 7), (0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
              (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)]
HAND_KINDS = ["planner", "executor", "executor", "planner", "executor", "planner"]


def _hand_example(kind: str = "sprint") -> Example:
    return Example("hand", kind, HAND_PROMPT, "".join(p[0] for p in HAND_PIECES), meta={"format": TW})


def test_threadweaver_hand_written_pieces_forced_flags_and_labels():
    ex = _hand_example()
    traj, why = D.check_example(ex, TW)
    assert why is None and isinstance(traj, tw.TWTrajectory)
    pieces = D.split_pieces(ex.prompt, ex.completion, traj)
    assert pieces.texts == [HAND_PROMPT] + [p[0] for p in HAND_PIECES]
    assert pieces.forced == [False] + [p[1] for p in HAND_PIECES]
    assert pieces.stage == [0] + [p[2] for p in HAND_PIECES]
    assert pieces.branch == [0] + [p[3] for p in HAND_PIECES]
    assert pieces.units == HAND_UNITS and pieces.unit_kinds == HAND_KINDS
    labels = D.char_labels(ex, TW)
    for text, start, (_, _, _, _, runs) in zip(pieces.texts[1:], pieces.starts[1:], HAND_PIECES):
        assert "".join(t for _, t in runs) == text
        assert labels[start:start + len(text)] == [k for k, t in runs for _ in t], text
    assert labels[:len(HAND_PROMPT)] == ["query"] * len(HAND_PROMPT)


def test_threadweaver_hand_written_layouts_train_only_what_calls_write(tok):
    """Byte tokens are characters: the loss-bearing tokens are exactly the calls' outputs (plans,
    thread bodies, the end + EOS), never the query, a forced `<Thread>j:` opening or the join."""
    ex = _hand_example()
    eos = tok.eos_token_id
    written = [p[0] for p in HAND_PIECES if not p[1]]
    merge = D.layout_example(tok, ex, "merge", W, data_format=TW)
    assert tok.decode(merge.tokens[merge.weights > 0][:-1].tolist()) == "".join(written)
    assert merge.tokens[-1] == eos and merge.weights[-1] > 0
    # join pieces: planner text (branch 0) of the next stage, past the longest thread of the block
    join = len(HAND_PROMPT) + len(HAND_PIECES[0][0]) + sum(len(p[0]) for p in HAND_PIECES[1:5])
    assert merge.stage[join] == 2 and merge.branch[join] == 0
    fork = len(HAND_PROMPT) + len(HAND_PIECES[0][0])
    longest = max(len(HAND_PIECES[1][0] + HAND_PIECES[2][0]), len(HAND_PIECES[3][0] + HAND_PIECES[4][0]))
    assert merge.positions[join] == fork + longest
    trie = D.layout_example(tok, ex, "trie", W, data_format=TW)
    runs = _runs(trie)
    assert sorted(tok.decode(r) for r in runs if r[-1] != eos) == sorted(written[:-1])
    assert [tok.decode(r[:-1]) for r in runs if r[-1] == eos] == [written[-1]]


# The merge layout of a small ThreadWeaver example on the demo's word-level tokenizer, derived by
# hand: one run per piece, (its tokens, first position, stage, branch, parent of its first row,
# trained). Rows are the pieces in text order; a row's parent is the row before it except where
# given. The fork is after </Outlines> (row 26, position 26): both threads start at position 27;
# thread 1 is 6 tokens and thread 2 is 8, so </Parallel>'s gap sits at 27 + 8 = 35 and the answer
# follows it.
MERGE_TABLE = [
    (["Q:", " ", "3", " ", "8", "\n"], 0, 0, 0, -1, False),                                  # rows 0-5
    (["<think>", "\n", "<Parallel>", "\n", "<Outlines>", "\n", "<Outline>1:", " ", "Chain ", "3", ":",
      "</Outline>", "\n", "<Outline>2:", " ", "Chain ", "8", ":", "</Outline>", "\n", "</Outlines>"],
     6, 1, 0, 5, True),                                                                      # rows 6-26
    (["\n", "<Thread>1:"], 27, 1, 1, 26, False),                                             # rows 27-28
    ([" ", "3", "9", "</Thread>"], 29, 1, 1, 28, True),                                      # rows 29-32
    (["\n", "<Thread>2:"], 27, 1, 2, 26, False),                                             # rows 33-34
    ([" ", "8", "2", "6", "4", "</Thread>"], 29, 1, 2, 34, True),                            # rows 35-40
    (["\n", "</Parallel>"], 35, 2, 0, 40, False),                                            # rows 41-42
    (["\n", "So the answer is the largest last digit.", "\n", "</think>", "\n", "6", "<eos>"],
     37, 2, 0, 42, True),                                                                    # rows 43-49
]


def test_threadweaver_merge_layout_positions_stage_branch_equal_the_hand_derived_table():
    """The merge item of `MERGE_TABLE`'s example: tokens, positions, stage, branch, parents and
    which rows carry loss, row for row; one span (the example's end) for every row."""
    from sprint_jax.model.tokenizer import VocabTokenizer
    from sprint_jax.tasks import chains

    vocab_tok = VocabTokenizer(chains.token_vocabulary(max_prompts=2), eos_token="<eos>", pad_token="<pad>")
    completion = ("<think>\n<Parallel>\n<Outlines>\n<Outline>1: Chain 3:</Outline>\n<Outline>2: Chain 8:</Outline>\n"
                  "</Outlines>\n<Thread>1: 39</Thread>\n<Thread>2: 8264</Thread>\n</Parallel>\n"
                  f"{chains.COMBINE}\n</think>\n6")
    it = D.layout_example(vocab_tok, Example("t", "sprint", "Q: 3 8\n", completion), "merge", W, data_format=TW)
    want = {k: [] for k in ("tokens", "positions", "stage", "branch", "parents", "trained")}
    row = 0
    for toks, pos, stage, branch, parent, trained in MERGE_TABLE:
        n = len(toks)
        want["tokens"] += toks
        want["positions"] += list(range(pos, pos + n))
        want["stage"] += [stage] * n
        want["branch"] += [branch] * n
        want["parents"] += [parent] + list(range(row, row + n - 1))
        want["trained"] += [trained] * n
        row += n
    assert [vocab_tok.vocab[t] for t in it.tokens] == want["tokens"]
    for k in ("positions", "stage", "branch", "parents"):
        assert getattr(it, k).tolist() == want[k], k
    assert (it.weights > 0).tolist() == want["trained"]
    assert it.span_end.tolist() == [len(it)] * len(it) == [50] * 50


def _runs(item: D.Item) -> list[list[int]]:
    """Maximal runs of consecutive loss-bearing rows, as token lists."""
    out: list[list[int]] = []
    prev = False
    for t, w in zip(item.tokens.tolist(), item.weights.tolist()):
        if w > 0:
            if not prev:
                out.append([])
            out[-1].append(t)
        prev = w > 0
    return out


# ---------------------------------------------------------------------------------------------
# check_example: the rules per kind
# ---------------------------------------------------------------------------------------------
def test_threadweaver_check_example_rules():
    ok = "<think>\ntrace\n</think>\n42"
    assert D.check_example(Example("r", "rft", "Q\n", ok), TW)[1] is None
    assert D.check_example(Example("s", "sprint", "Q\n", ok), TW)[1] is None       # sequential baseline
    assert D.check_example(Example("r", "rft", "Q\n", "<think>\ntrace"), TW)[1] == "missing </think>"
    assert "<Parallel>" in D.check_example(_hand_example("rft"), TW)[1]
    bad = _hand_example().completion.replace("<Thread>2: b</Thread>\n", "")
    why = D.check_example(Example("s", "sprint", "Q\n", bad), TW)[1]
    assert why and "outline 2" in why
    # a SPRINT completion is not ThreadWeaver text, and the reverse
    sprint_ex = D.read_examples([DATA / "sft_tiny_sprint.jsonl"], 1)[0]
    assert D.check_example(sprint_ex, TW)[1] is not None
    assert D.check_example(_hand_example(), "sprint")[1] is not None
    with pytest.raises(ValueError, match="data format"):
        D.check_example(_hand_example(), "Threadweaver")


def test_threadweaver_rft_example_is_one_planner_call(tok):
    ex = Example("r", "rft", "Q\n", "<think>\nserial trace\n</think>\n42")
    traj, _ = D.check_example(ex, TW)
    pieces = D.split_pieces(ex.prompt, ex.completion, traj)
    assert pieces.texts == ["Q\n", ex.completion] and pieces.units == [(0, 1)] and pieces.forced == [False, False]


# ---------------------------------------------------------------------------------------------
# (b) the ThreadWeaver version's calls correspond one to one to the SPRINT version's
# ---------------------------------------------------------------------------------------------
def _calls(pieces: D.Pieces) -> list[tuple]:
    """The pieces other than ThreadWeaver's joins, as (stage, branch, forced, is a unit's output)."""
    outputs = {u[-1] for u in pieces.units}
    joins = {p for p, (f, b) in enumerate(zip(pieces.forced, pieces.branch)) if f and b == 0}
    return [(s, b, f, p in outputs) for p, (s, b, f) in enumerate(zip(pieces.stage, pieces.branch, pieces.forced))
            if p not in joins]


def _strip_tags(text: str, pattern) -> str:
    return " ".join(pattern.sub(" ", re.sub(r"<Outline>\d+:|<Thread>\d+:", " ", text)).split())


def _pairs() -> list[tuple[Example, Example]]:
    sprint = {e.id: e for e in D.read_examples([DATA / "sft_tiny_sprint.jsonl"])}
    tws = D.read_examples([TW_FILE], data_format=TW)
    assert len(tws) == 16           # the 8 implicit-prompt examples have no ThreadWeaver form
    # a trailing plan-only stage: a convertible shape the bundled file lacks
    traj = sf.Trajectory("Q", [sf.Stage(1, ["Split.", sf.Prompt("a"), sf.Prompt("b")], ["A", "B"]),
                               sf.Stage(2, ["Combine A and B."])], "AB")
    extra = Example("extra", "sprint", "Q\n", sf.render_completion(traj))
    return [(sprint[e.id], e) for e in tws] + [(extra, tw.convert_example(extra, TW))]


def test_threadweaver_pieces_correspond_to_the_sprint_versions_pieces():
    """Planner calls, executor calls and forced openings pair up in order, with the same stage,
    branch, forced flag and content (tags aside); ThreadWeaver adds one forced join per block. A
    trailing plan-only SPRINT stage and the final answer are two planner calls in SPRINT and one in
    ThreadWeaver (the text after the last block is not cut from the answer)."""
    sprint_tags = sf.TAG_PATTERN
    tw_tags = tw.TAG_PATTERN
    for s_ex, t_ex in _pairs():
        s_traj, s_why = D.check_example(s_ex)
        t_traj, t_why = D.check_example(t_ex, TW)
        assert s_why is None and t_why is None, (s_ex.id, s_why, t_why)
        sp = D.split_pieces(s_ex.prompt, s_ex.completion, s_traj)
        tp = D.split_pieces(t_ex.prompt, t_ex.completion, t_traj)
        s_calls, t_calls = _calls(sp), _calls(tp)
        trailing = not s_traj.stages[-1].executions
        if trailing:      # merge SPRINT's last two planner calls into one for the comparison
            assert s_calls[-2:] == [(len(s_traj.stages), 0, False, True), (len(s_traj.stages) + 1, 0, False, True)]
            s_calls = s_calls[:-2] + [(len(s_traj.stages), 0, False, True)]
        assert s_calls == t_calls, s_ex.id
        blocks = len(t_traj.blocks)
        assert sum(f and b == 0 for f, b in zip(tp.forced, tp.branch)) == blocks
        assert [k for k in tp.unit_kinds] == [k for k in sp.unit_kinds][:len(tp.unit_kinds)]
        # content: pieces other than the joins, tags and numbers removed, are the same words
        s_texts = [_strip_tags(t, sprint_tags) for t in sp.texts[1:]]
        t_texts = [_strip_tags(t, tw_tags) for p, t in enumerate(tp.texts) if p and not (tp.forced[p] and
                                                                                      tp.branch[p] == 0)]
        if trailing:
            s_texts = s_texts[:-2] + [" ".join(s_texts[-2:])]
        assert s_texts == t_texts, s_ex.id


# ---------------------------------------------------------------------------------------------
# (c) every layout on a small ThreadWeaver jsonl: the loss is exactly what the calls write
# ---------------------------------------------------------------------------------------------
FORCED = re.compile(r"\n<Thread>[1-9][0-9]*:|\n</Parallel>")    # what the orchestrator forces


def _tw_examples(tmp_path) -> list[Example]:
    rft = tmp_path / "rft_tw.jsonl"
    stats = tw.convert_examples(DATA / "sft_tiny_rft.jsonl", rft, TW)
    assert stats.written == 24
    return D.read_examples([TW_FILE], data_format=TW)[:6] + D.read_examples([rft], 4, data_format=TW)


@pytest.mark.parametrize("layout", ["flat", "trie", "merge"])
def test_threadweaver_every_layout_trains_exactly_the_written_text(tok, tmp_path, layout):
    exs = _tw_examples(tmp_path)
    items, stats = D.build_items(exs, tok, layout, 1024, "drop", W, data_format=TW)
    assert stats.used == len(exs) == 10 and not stats.first_skip_reasons
    eos = tok.eos_token_id
    for ex, item in zip(exs, items):
        lossy = item.tokens[item.weights > 0].tolist()
        assert lossy.count(eos) == 1
        if layout != "trie":
            assert lossy[-1] == eos
        if layout == "flat":                       # the whole completion, nothing forced removed
            assert tok.decode(lossy[:-1]) == ex.completion
        elif layout == "merge":                    # the completion without the forced text
            assert tok.decode(lossy[:-1]) == FORCED.sub("", ex.completion)
        else:                                      # each call's output once (the trie's order)
            calls = [c for c in FORCED.split(ex.completion) if c]
            runs = _runs(item)
            got = sorted(tok.decode(r[:-1]) if r[-1] == eos else tok.decode(r) for r in runs)
            assert got == sorted(calls), ex.id
    # flat and merge hold every token once; the trie repeats context
    if layout != "trie":
        assert stats.tokens == sum(len(e.prompt) + len(e.completion) + 1 for e in exs)


def test_threadweaver_paired_runs_keep_the_problems_both_formats_hold(tok, tmp_path):
    """An RFT run in ThreadWeaver form paired with the ThreadWeaver SPRINT file keeps the 16
    problems the converter could express and drops the 8 implicit-prompt ones as unpaired."""
    rft = tmp_path / "rft_tw.jsonl"
    tw.convert_examples(DATA / "sft_tiny_rft.jsonl", rft, TW)
    partner = D.Paired(D.read_examples([TW_FILE], data_format=TW), "trie", data_format=TW)
    _, stats = D.build_items(D.read_examples([rft], data_format=TW), tok, "flat", 1024, "drop", W,
                             paired=partner, data_format=TW)
    assert (stats.read, stats.used, stats.dropped_paired) == (24, 16, 8)


def test_threadweaver_trie_whole_trajectory_is_the_flat_example(tok):
    ex = _hand_example()
    flat = D.layout_example(tok, ex, "flat", W, data_format=TW)
    trie = D.layout_example(tok, ex, "trie", W, whole_trajectory=True, data_format=TW)
    plain = D.layout_example(tok, ex, "trie", W, data_format=TW)
    n = len(ex.completion) + 1                     # the whole-trajectory unit is the last subtree
    np.testing.assert_array_equal(trie.tokens[-n:], flat.tokens[len(HAND_PROMPT):])
    np.testing.assert_array_equal(trie.positions[-n:], flat.positions[len(HAND_PROMPT):])
    np.testing.assert_array_equal(trie.weights[-n:], flat.weights[len(HAND_PROMPT):])
    assert trie.parents[-n] == len(HAND_PROMPT) - 1            # predicted from the prompt's last row
    assert len(trie) == len(plain) + n


# ---------------------------------------------------------------------------------------------
# config, the format guard, and a train step per layout
# ---------------------------------------------------------------------------------------------
def test_threadweaver_config_field_and_defaults(tmp_path):
    base = ["model.name=tiny", f"data.train=[{TW_FILE}]", "data.tokenizer=bytes"]
    assert load_train_config(None, base).data.format == "sprint"
    cfg = load_train_config(None, base + ["data.format=threadweaver"])
    assert cfg.data.format == TW and cfg.data.paired_format == TW
    cfg = load_train_config(None, base + ["data.format=threadweaver", "data.paired.format=sprint"])
    assert cfg.data.paired_format == "sprint"
    with pytest.raises(ConfigError, match="data.format"):
        load_train_config(None, base + ["data.format=thread"])
    assert load_train_config(ROOT / "configs" / "sft_tiny_cpu_threadweaver.yaml").data.format == TW


def test_threadweaver_file_read_as_sprint_is_an_error_naming_file_and_line(tmp_path):
    with pytest.raises(D.DataError, match=rf"{re.escape(str(TW_FILE))}:1: .*'threadweaver' format.*'sprint'"):
        D.read_examples([TW_FILE])
    mixed = tmp_path / "mixed.jsonl"
    lines = TW_FILE.read_text().splitlines()[:2]
    d = json.loads(lines[1])
    d["meta"]["format"] = "sprint"
    mixed.write_text(lines[0] + "\n" + json.dumps(d) + "\n")
    with pytest.raises(D.DataError, match=r"mixed.jsonl:2: .*'sprint' format.*'threadweaver'"):
        D.read_examples([mixed], data_format=TW)
    assert len(D.read_examples([DATA / "sft_tiny_sprint.jsonl"], data_format=TW)) == 24   # no claim, no error


def test_threadweaver_cli_on_a_threadweaver_file_as_sprint_exits_2(tmp_path, capsys):
    from sprint_jax.cli import main

    rc = main(["train", "--config", str(ROOT / "configs" / "sft_tiny_cpu_threadweaver.yaml"), "--set",
               "data.format=sprint", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "sft_tiny_threadweaver.jsonl:1:" in err and "data.format" in err


def test_threadweaver_bundled_file_is_the_converted_sprint_file(tmp_path):
    out = tmp_path / "tw.jsonl"
    stats = tw.convert_examples(DATA / "sft_tiny_sprint.jsonl", out, TW)
    assert stats.written == 16 and stats.skipped == {"an implicit prompt": 8}
    assert out.read_text() == TW_FILE.read_text()


def test_threadweaver_one_train_step_per_layout(tok):
    """One optimizer step of the trainer's step function on the tiny model, on a packed row of
    ThreadWeaver examples in each layout: a finite loss over exactly the row's loss-bearing tokens.
    The rows share one width and carry stage / branch (zeros for flat and trie, where the merge
    rule is then true everywhere), so one compiled step serves every layout."""
    import jax
    import jax.numpy as jnp

    from sprint_jax.model import Qwen2Config, init_params
    from sprint_jax.model.tokenizer import pad_id
    from sprint_jax.train.config import OptimSection
    from sprint_jax.train.step import make_optimizer, make_step_fn

    cfg = Qwen2Config.preset("tiny")
    tx, schedule = make_optimizer(OptimSection(lr=1e-3, batch_size=1), 1)
    step = jax.jit(make_step_fn(cfg, tx, schedule))
    params = init_params(cfg, jax.random.key(0))
    exs = D.read_examples([TW_FILE], 1, data_format=TW)       # two blocks, of two threads and one
    for layout in ("flat", "trie", "merge"):
        items, _ = D.build_items(exs, tok, layout, 512, "drop", W, data_format=TW)
        batch = D.RowStream(items, 512, 0, pad_id(tok)).rows([0]).as_dict()
        batch.setdefault("stage", np.zeros_like(batch["tokens"]))
        batch.setdefault("branch", np.zeros_like(batch["tokens"]))
        state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params),
                 "rng": jax.random.key_data(jax.random.key(0))}
        _, metrics = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
        assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) > 0, layout
        assert int(metrics["loss_tokens"]) == sum(int((it.weights > 0).sum()) for it in items), layout
        assert np.isfinite(float(metrics["grad_norm"])), layout


@pytest.mark.slow
def test_threadweaver_sprint_jax_train_config_end_to_end(tmp_path):
    """`sprint-jax train --config configs/sft_tiny_cpu_threadweaver.yaml`: a real run; every
    example used, finite losses, and the export's sprint_jax.json names the format and layout."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "sprint_jax.cli", "train", "--config",
                        str(ROOT / "configs" / "sft_tiny_cpu_threadweaver.yaml"), "--set", "steps=2",
                        "--set", "log_every=1", "--set", "tensorboard=false", "--set", "plot=false",
                        "--out", str(out), "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 2 and all(np.isfinite(losses))
    stats = json.loads((out / "data_stats.json").read_text())
    assert stats["used"] == 16 and stats["dropped_total"] == 0
    meta = json.loads((out / "hf" / "sprint_jax.json").read_text())
    assert meta["format"] == TW and meta["layout"] == "trie"
