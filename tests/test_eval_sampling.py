"""The papers' decoding at eval: k samples per problem (each its own seed, keyed on the problem's id
and the sample index) with Avg@k, its standard
error, pass@k and per-problem means; runs cut by the context or the token budget counted as
context_full; the checkpoint's own chat template; and `eval compare`'s mean per-problem speedup,
self-parallelism and activation ratios. Every figure is checked against a hand computation."""
from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction

import pytest

from sprint_jax.cli import main
from sprint_jax.eval.evaluate import evaluate, untimed
from sprint_jax.eval.report import compare, make_report, pass_at_k
from sprint_jax.infer.orchestrator import OrchestratorConfig
from sprint_jax.tasks.types import Task
from test_orchestrator import ScriptedEngine


# ---------------------------------------------------------------------------------------------
# pass@k, Avg@k and its standard error
# ---------------------------------------------------------------------------------------------
def test_pass_at_k_matches_math_comb_and_a_hand_computation():
    # by hand: n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6; n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(3, 2, 2) == 1.0                    # n - c < k: every k-subset holds a correct one
    assert pass_at_k(6, 0, 3) == 0.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)    # pass@1 is the share correct
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)
    for bad in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def _run(pid, sample, correct, seq=10, total=None, termination="final_answer", forks=0, mode="parallel", wall=1.0):
    return {"id": pid, "sample": sample, "correct": correct, "sequential_tokens": seq,
            "total_tokens": seq if total is None else total, "wall_s": wall, "stages": 1, "format_valid": correct,
            "termination": termination, "forks": forks, "mode": mode}


def test_avg_at_k_its_standard_error_and_pass_at_k_by_hand():
    # three problems x four samples: p1 4/4 correct, p2 1/4 (one of its wrong runs used up the
    # token budget), p3 2/4 (one wrong run hit the context)
    rows = ([_run("p1", s, True) for s in range(4)]
            + [_run("p2", 0, True)] + [_run("p2", s, False) for s in (1, 2)] + [_run("p2", 3, False, termination="token_budget")]
            + [_run("p3", 0, False, termination="context_full"), _run("p3", 1, True), _run("p3", 2, False),
               _run("p3", 3, True)])
    report = make_report(rows, "parallel")
    s = report["samples"]
    assert s["problems"] == 3 and s["samples_per_problem"] == {"min": 4, "max": 4}
    # per-problem means 1, 1/4, 1/2: Avg@4 = 7/12; deviations 5/12, -4/12, -1/12, squares sum 42/144,
    # sample variance 7/48, standard error sqrt(7/48) / sqrt(3) = sqrt(7) / 12
    assert [p["mean"] for p in s["per_problem"]] == [1.0, 0.25, 0.5]
    assert s["avg_at_k"] == pytest.approx(7 / 12) and report["accuracy"] == pytest.approx(7 / 12)
    assert s["avg_at_k_se"] == pytest.approx(math.sqrt(7) / 12)
    # the per-sample estimator (std of the 12 0/1 outcomes / sqrt(12)) is a different number: not it
    flat = [1.0] * 4 + [1.0, 0, 0, 0] + [0, 1.0, 0, 1.0]
    per_sample = math.sqrt(sum((x - 7 / 12) ** 2 for x in flat) / 11) / math.sqrt(12)
    assert abs(s["avg_at_k_se"] - per_sample) > 0.05
    # pass@2: p1 1, p2 1 - C(3,2)/C(4,2) = 1/2, p3 1 - C(2,2)/C(4,2) = 5/6 -> 7/9; pass@4: all 1
    assert s["pass_at_k"] == pytest.approx({"1": 7 / 12, "2": 7 / 9, "4": 1.0})
    assert [p["context_full"] for p in s["per_problem"]] == [0, 1, 1]
    assert report["outcomes"] == {"correct": 7, "wrong": 3, "context_full": 2, "capped": 0}
    # a run cut by the budget that still got graded correct is correct, not context_full
    assert make_report([_run("x", 0, True, termination="token_budget")], "parallel")["outcomes"] == {
        "correct": 1, "wrong": 0, "context_full": 0, "capped": 0}


# ---------------------------------------------------------------------------------------------
# eval --samples on the batched engine: seeds, records, resume
# ---------------------------------------------------------------------------------------------
QUERIES = {"a": "What is 1/2?", "b": "2+2?"}
TASKS = [Task("a", "math", QUERIES["a"], "\\frac{1}{2}"), Task("b", "math", QUERIES["b"], "4")]
CONFIG = OrchestratorConfig(temperature=0.6, top_p=0.95, seed=7, max_total_tokens=16)
ANSWER = "<Final Answer> {} </Final Answer>"
LONG = "and so on " * 12                 # no answer within the 16-token budget


def _run_seed(seed: int, pid: str, s: int) -> int:
    """The documented rule, written out: the first 8 bytes (big-endian) of the sha256 of the JSON
    text `[seed, "id", sample]`, mod 2^31."""
    text = f'[{seed}, "{pid}", {s}]'
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 2 ** 31


def _engine_seed(pid: str, s: int) -> int:
    """The seed the engine sees for sample s of problem pid: that of the one call of a sequential
    run under the config with the run's seed (the public `sampling` API)."""
    return OrchestratorConfig(temperature=0.6, top_p=0.95, seed=_run_seed(7, pid, s)).sampling(0).seed


def test_run_seeds_by_hand_differ_across_problems_and_leave_greedy_alone():
    from sprint_jax.eval.evaluate import run_config, run_seed

    # the rule by hand for one case: sha256(b'[7, "a", 0]') starts b4af85c8 0133f267; its first 8
    # bytes mod 2^31 are the low 31 bits of 0x0133f267
    assert hashlib.sha256(b'[7, "a", 0]').hexdigest()[:16] == "b4af85c80133f267"
    assert run_seed(7, "a", 0) == 0x0133f267 == 20181607 == _run_seed(7, "a", 0)
    seeds = {(p, s): run_seed(7, p, s) for p in ("a", "b", "chains-0-1", "chains-0-10") for s in range(4)}
    assert seeds == {k: _run_seed(7, *k) for k in seeds}
    assert len(set(seeds.values())) == len(seeds)          # no two (problem, sample) runs share a seed
    assert run_seed(8, "a", 0) != run_seed(7, "a", 0)     # the config seed still moves every run
    assert run_config(CONFIG, "b", 2).seed == _run_seed(7, "b", 2)
    greedy = OrchestratorConfig(seed=7)
    assert run_config(greedy, "a", 3) is greedy           # greedy: no draw, the config as it is


# what the model writes, per problem and sample: a is right in samples 0 and 2; b right in sample
# 1, cut by the token budget in sample 3
SCRIPT = {("a", 0): ANSWER.format("0.5"), ("a", 1): ANSWER.format("3"), ("a", 2): ANSWER.format("1/2"),
          ("a", 3): ANSWER.format("2"), ("a", 4): ANSWER.format("0.5"), ("a", 5): ANSWER.format("9"),
          ("b", 0): ANSWER.format("5"), ("b", 1): ANSWER.format("4"), ("b", 2): ANSWER.format("22"),
          ("b", 3): LONG, ("b", 4): ANSWER.format("4"), ("b", 5): ANSWER.format("4")}


class SeededEngine(ScriptedEngine):
    """A plain-decoding model whose output depends on the sampling seed of the call: the seed names
    the (problem, sample) it was derived for, and the model writes that sample's script (problem c
    has a's query and a's script). Records the (problem, sample) of every call; a seed derived for
    another problem than the query's fails the run."""

    def __init__(self):
        super().__init__()
        self.run_of = {_engine_seed(p, s): (p, s) for p in "abc" for s in range(6)}
        self.ran: list[tuple[str, int]] = []

    def generate(self, state, max_new_tokens, stop=(), sampling=None, tag=None):
        pid, s = self.run_of[sampling.seed]
        script_pid = "a" if pid == "c" else pid
        assert self.decode_text(state.tokens) == QUERIES[script_pid], (pid, s)
        self.ran.append((pid, s))
        self.planner = [SCRIPT[(script_pid, s)]]
        return super().generate(state, max_new_tokens, stop, sampling, tag)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_samples_get_their_own_seeds_keep_their_index_and_resume(tmp_path):
    engine = SeededEngine()
    results, report = evaluate(engine, TASKS, "sequential", prompt_fn=lambda t: t.problem, orchestrator_config=CONFIG,
                               out_dir=tmp_path, progress=False, samples=4)
    assert sorted(engine.ran) == [(p, s) for p in "ab" for s in range(4)]          # each sample its own seed
    assert [(r["id"], r["sample"]) for r in results] == [(p, s) for p in "ab" for s in range(4)]
    assert [r["correct"] for r in results] == [True, False, True, False, False, True, False, False]
    assert [r["outcome"] for r in results][4:] == ["wrong", "correct", "wrong", "context_full"]
    assert results[7]["termination"] == "token_budget" and results[7]["sequential_tokens"] == 16
    records = _lines(tmp_path / "records.jsonl")
    assert [(r["id"], r["sample"], r["config"]["seed"]) for r in records] == [
        (p, s, _run_seed(7, p, s)) for p in "ab" for s in range(4)]
    # Avg@4 = (2/4 + 1/4) / 2; standard error: |1/2 - 1/4| / sqrt(2) / sqrt(2) = 1/8
    assert report["samples"]["avg_at_k"] == pytest.approx(3 / 8)
    assert report["samples"]["avg_at_k_se"] == pytest.approx(1 / 8)
    assert report["outcomes"] == {"correct": 3, "wrong": 4, "context_full": 1, "capped": 0}
    assert report["meta"]["samples"] == 4 and report["n"] == 8

    # killed during the sixth run: five complete lines and a cut one; the rerun runs the other three
    full = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    rec = (tmp_path / "records.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("".join(full[:5]) + full[5][:20])
    (tmp_path / "records.jsonl").write_text("".join(rec[:5]))
    engine = SeededEngine()
    again, report2 = evaluate(engine, TASKS, "sequential", prompt_fn=lambda t: t.problem, orchestrator_config=CONFIG,
                              out_dir=tmp_path, progress=False, samples=4)
    assert sorted(engine.ran) == [("b", 1), ("b", 2), ("b", 3)]
    assert [untimed(r) for r in again] == [untimed(r) for r in json.loads(json.dumps(results))]
    assert report2["resumed_problems"] == 5 and report2["samples"]["avg_at_k"] == pytest.approx(3 / 8)

    # more samples later: only the new ones run; the report covers 6 per problem
    engine = SeededEngine()
    more, report3 = evaluate(engine, TASKS, "sequential", prompt_fn=lambda t: t.problem, orchestrator_config=CONFIG,
                             out_dir=tmp_path, progress=False, samples=6)
    assert sorted(engine.ran) == [("a", 4), ("a", 5), ("b", 4), ("b", 5)]
    assert [(r["id"], r["sample"]) for r in more] == [(p, s) for p in "ab" for s in range(6)]
    # a: 3/6, b: 3/6 -> Avg@6 = 1/2 with a standard error of 0
    assert report3["samples"]["avg_at_k"] == pytest.approx(0.5) and report3["samples"]["avg_at_k_se"] == 0.0
    assert len(_lines(tmp_path / "results.jsonl")) == 12 and report3["problems_in_out"] == 2


def test_a_problem_keeps_its_seeds_whatever_its_order_limit_or_neighbours(tmp_path):
    from sprint_jax.errors import UserError

    def run(tasks, out, samples=2):
        engine = SeededEngine()
        results, _ = evaluate(engine, tasks, "sequential", prompt_fn=lambda t: t.problem,
                              orchestrator_config=CONFIG, out_dir=tmp_path / out, progress=False, samples=samples)
        seeds = {(r["id"], r["sample"]): r["config"]["seed"] for r in _lines(tmp_path / out / "records.jsonl")}
        return {(r["id"], r["sample"]): untimed(r) for r in results}, seeds, engine.ran

    ab, seeds_ab, _ = run(TASKS, "ab")
    # two problems at the same sample index draw with different seeds, each the rule's
    assert seeds_ab == {(p, s): _run_seed(7, p, s) for p in "ab" for s in range(2)}
    assert seeds_ab[("a", 0)] != seeds_ab[("b", 0)] and seeds_ab[("a", 1)] != seeds_ab[("b", 1)]
    # the other order: the same seeds and outputs per (problem, sample)
    ba, seeds_ba, ran = run(TASKS[::-1], "ba")
    assert ran[:2] == [("b", 0), ("b", 1)] and seeds_ba == seeds_ab and ba == ab
    # b alone (as --limit 1 of the order [b, a] would give): b's own seeds and outputs
    b, seeds_b, _ = run(TASKS[1:], "b")
    assert seeds_b == {k: v for k, v in seeds_ab.items() if k[0] == "b"} and b == {k: ab[k] for k in b}
    # resumed with a added: only a's runs are new, under a's seeds
    both, seeds_both, ran = run(TASKS, "b")
    assert sorted(ran) == [("a", 0), ("a", 1)] and seeds_both == seeds_ab and both == ab
    # a directory written under another seeding rule (no "seeds" in its eval_run.json) is refused
    path = tmp_path / "ab" / "eval_run.json"
    saved = json.loads(path.read_text())
    assert saved["run"]["seeds"] == "sha256 of [seed, problem id, sample]"
    del saved["run"]["seeds"]
    path.write_text(json.dumps(saved))
    with pytest.raises(UserError, match="differs in: seeds"):
        run(TASKS, "ab", samples=3)


def test_samples_need_sampling_and_a_count(tmp_path, capsys):
    with pytest.raises(ValueError, match="identical"):
        evaluate(SeededEngine(), TASKS, "sequential", prompt_fn=lambda t: t.problem, samples=2, progress=False)
    with pytest.raises(ValueError, match="samples"):
        evaluate(SeededEngine(), TASKS, "sequential", prompt_fn=lambda t: t.problem, orchestrator_config=CONFIG,
                 samples=0, progress=False)
    model = tmp_path / "m"
    model.mkdir()
    base = ["eval", "--model", str(model), "--data", "math500", "--out", str(tmp_path / "o")]
    assert main(base + ["--samples", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "greedy" in err[0] and "Traceback" not in err[0]
    assert main(base + ["--samples", "0", "--temperature", "0.6"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# eval compare on hand-written sampled runs
# ---------------------------------------------------------------------------------------------
# SPRINT (A), two samples per problem: (correct, sequential, total, forks, termination)
A_RUNS = {"p1": [(True, 1000, 1500, 2, "final_answer"), (True, 1200, 1800, 1, "final_answer")],
          "p2": [(False, 3000, 3000, 0, "final_answer"), (True, 2000, 4000, 1, "final_answer")],
          "p3": [(True, 6000, 9000, 3, "final_answer"), (False, 8000, 8000, 0, "token_budget")]}
# RFT (B), plain decoding
B_RUNS = {"p1": [(True, 1500, 1500, 0, "final_answer"), (True, 1700, 1700, 0, "final_answer")],
          "p2": [(True, 4000, 4000, 0, "final_answer"), (True, 5000, 5000, 0, "final_answer")],
          "p3": [(True, 9000, 9000, 0, "final_answer"), (False, 12000, 12000, 0, "context_full")]}


def _rows(runs, mode):
    return [_run(pid, s, c, seq, tot, term, forks, mode) for pid, samples in runs.items()
            for s, (c, seq, tot, forks, term) in enumerate(samples)]


def test_compare_sampled_runs_speedup_parallelism_and_the_8k_bin_by_hand(tmp_path, capsys):
    for name, rows in (("a", _rows(A_RUNS, "parallel")), ("b", _rows(B_RUNS, "sequential"))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp"
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    t = json.loads((out / "compare.json").read_text())
    assert t["n"] == 3                                     # problems, not runs
    # per-problem means: A seq 1100, 2500, 7000 (correct 1, 1/2, 1/2); B seq 1600, 4500, 10500 (1, 1, 1/2)
    acc = {r["key"]: r for r in t["rows"]}["accuracy"]
    assert acc["SPRINT"] == pytest.approx(2 / 3) and acc["RFT"] == pytest.approx(5 / 6)
    # Avg@2 standard errors: means (1, 1/2, 1/2) and (1, 1, 1/2) both have sample variance 1/12: 1/6
    assert t["samples"]["SPRINT"]["avg_at_k_se"] == pytest.approx(1 / 6)
    assert t["samples"]["RFT"]["avg_at_k_se"] == pytest.approx(1 / 6)
    # mean per-problem speedup (B / A sequential tokens): over all (1600/1100 + 4500/2500 + 10500/7000) / 3;
    # solved by both (more than half of the samples correct in each run): p1 alone
    ms = t["mean_speedup"]
    assert ms["all"] == pytest.approx((1600 / 1100 + 4500 / 2500 + 10500 / 7000) / 3) and ms["n_all"] == 3
    assert ms["both_solved"] == pytest.approx(1600 / 1100) and ms["n_both_solved"] == 1
    # self-parallelism: Σ total / Σ sequential over A's six runs = 27300 / 21200; per run mean 8.5 / 6
    pa, pb = t["parallelism"]["SPRINT"], t["parallelism"]["RFT"]
    assert pa["self_parallelism"]["ratio_of_sums"] == pytest.approx(27300 / 21200)
    assert pa["self_parallelism"]["mean_per_run"] == pytest.approx(8.5 / 6)
    assert pb["self_parallelism"]["ratio_of_sums"] == 1.0
    # activation: p1 forked in 2 of 2 samples, p2 in 1 of 2, p3 in 1 of 2 -> 2/3; RFT never forks
    assert pa["activation_ratio"] == pytest.approx(2 / 3) and pb["activation_ratio"] == 0.0
    # the > 8k bin (by RFT's mean sequential length) holds p3
    last = t["length_bins"]["fixed"][-1]
    assert (last["min_baseline_tokens"], last["max_baseline_tokens"], last["n"]) == (8000, None, 1)
    assert last["a"]["accuracy"] == 0.5 and last["b"]["mean_sequential_tokens"] == 10500
    assert last["sequential_ratio"] == pytest.approx(7000 / 10500)
    assert last["context_full"] == {"a": 0.5, "b": 0.5}
    assert t["summary"]["SPRINT"]["context_full"] == pytest.approx(1 / 6)
    assert "activation ratio" in printed and "mean per-problem speedup" in printed
    assert "Avg@2 ± s.e. (%)             66.7±16.7   83.3±16.7" in printed
    # a problem's sample listed twice is refused, naming it
    rows = _rows(A_RUNS, "parallel")
    (tmp_path / "a" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
    assert main(["eval", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "'p1' (sample 0) twice" in capsys.readouterr().err


def test_unsampled_compare_is_unchanged_and_counts_forks_for_activation():
    a = [_run("p1", 0, True, 100, 150, forks=1), _run("p2", 0, True, 300, 300, forks=0)]
    b = [_run("p1", 0, True, 200, mode="sequential"), _run("p2", 0, False, 600, mode="sequential")]
    for r in a + b:
        del r["sample"]                        # lines of a run written before samples existed
    t = compare(a, b)
    assert t["summary"]["SPRINT"]["accuracy"] == 1.0 and t["summary"]["RFT"]["accuracy"] == 0.5
    assert t["mean_speedup"] == {"all": pytest.approx((2 + 2) / 2), "n_all": 2, "both_solved": pytest.approx(2.0),
                                 "n_both_solved": 1}
    assert t["parallelism"]["SPRINT"]["activation_ratio"] == 0.5
    del a[0]["forks"]                          # a parallel line without it: unknown, not 0
    assert compare(a, b)["parallelism"]["SPRINT"]["activation_ratio"] is None


# ---------------------------------------------------------------------------------------------
# the checkpoint's own chat template
# ---------------------------------------------------------------------------------------------
BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
# the shape of R1-Distill's template for one user turn: its generation prompt ends in "<think>\n"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '" + USER + "' + m['content'] }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '" + ASSISTANT + "<think>\\n' }}{% endif %}")


def _save_chat_tokenizer(path, size: int = 307) -> None:
    """A character-level HF tokenizer with R1-style special tokens and `TEMPLATE`, `size` entries
    (every id of the tiny model decodes), written with save_pretrained."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", BOS, EOS, USER, ASSISTANT, "<unk>"] + list(string.printable[:95]) + ["\n"]
    vocab = {t: i for i, t in enumerate(base + [f"<t{i}>" for i in range(size - len(base))])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=[USER, ASSISTANT])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def test_chat_template_equals_transformers_own_and_applies_where_it_should(tmp_path):
    from transformers import AutoTokenizer

    from conftest import tiny_vocab_tokenizer
    from sprint_jax.errors import UserError
    from sprint_jax.eval.cli import chat_prompt, model_prompt_fn
    from sprint_jax.model.hf import update_export_meta
    from sprint_jax.model.tokenizer import load_tokenizer
    from sprint_jax.tasks import task_prompt

    _save_chat_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    task = Task("a", "math", "What is 1/2?", "1/2")
    text = task_prompt(task)
    expected = f"{BOS}{USER}{text}{ASSISTANT}<think>\n"                 # the template, applied by hand
    own = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    assert own == expected
    assert chat_prompt(tok, text) == expected
    # auto: a checkpoint not trained here (no sprint_jax.json) gets its template
    assert model_prompt_fn(str(tmp_path), tok, "auto")(task) == expected
    assert model_prompt_fn(str(tmp_path), tok, "off")(task) == text
    # a model trained here saw the raw task text: auto leaves it; on forces the template
    update_export_meta(tmp_path, layout="flat")
    assert model_prompt_fn(str(tmp_path), tok, "auto")(task) == text
    assert model_prompt_fn(str(tmp_path), tok, "on")(task) == expected
    with pytest.raises(UserError, match="no chat template"):
        model_prompt_fn(str(tmp_path), tiny_vocab_tokenizer(), "on")
    # --instruction: after the task text and a blank line, inside the user turn; r1-math by name
    r1 = "Please reason step by step, and put your final answer within \\boxed{}."
    assert model_prompt_fn(str(tmp_path), tok, "on", "r1-math")(task) == \
        f"{BOS}{USER}What is 1/2?\n\n{r1}{ASSISTANT}<think>\n"
    assert model_prompt_fn(str(tmp_path), tok, "off", " Be brief. ")(task) == "What is 1/2?\n\nBe brief."


@pytest.mark.slow
def test_eval_samples_with_the_chat_template_on_the_batched_engine(hf_untied, tmp_path, capsys):
    """The command end to end on a tiny real checkpoint whose tokenizer has a chat template: two
    samples per problem in one batch, the template in every query, eval's context sized by the
    token budget (12 + 2048 positions, under the model's 4096), runs cut by the budget counted as
    context_full; a rerun, and a run over the problems in the other order, give the same tokens."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    _save_chat_tokenizer(model)
    rows = [json.dumps({"id": f"t{k}", "problem": f"What is {k}+{k}?", "answer": str(2 * k)}) + "\n" for k in (1, 2)]
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(rows))

    def eval_into(out, tasks=task_file, concurrency=4):
        return main(["eval", "--model", str(model), "--data", str(tasks), "--mode", "sequential", "--limit", "2",
                     "--samples", "2", "--temperature", "0.6", "--top-p", "0.95", "--out", str(out), "--no-progress",
                     "--decode-chunk", "8", "--prefill-chunk", "32", "--max-prompts", "1", "--max-branch-tokens",
                     "8", "--max-total-tokens", "12", "--concurrency", str(concurrency)])

    def texts(out):
        return {(r["id"], r["sample"]): r["text"] for r in _lines(out / "records.jsonl")}

    out = tmp_path / "eval"
    assert eval_into(out) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert "over the 2 problem(s) x 2 samples asked for: accuracy 0.0% (0/4 runs)" in printed
    assert "Avg@2: 0.0% ± 0.0 (standard error over 2 problems)" in printed
    assert report["meta"]["chat_template"] is True and report["meta"]["max_seq_len"] == 12 + 2048
    records = _lines(out / "records.jsonl")
    # each run's seed: the rule by hand on (--seed 0, id, sample); the two problems' sample 0 differ
    assert [(r["id"], r["sample"], r["config"]["seed"]) for r in records] == [
        (p, s, _run_seed(0, p, s)) for p in ("t1", "t2") for s in range(2)]
    assert records[0]["config"]["seed"] != records[2]["config"]["seed"]
    assert records[0]["query"] == f"{BOS}{USER}What is 1+1?{ASSISTANT}<think>\n"
    assert records[0]["text"] != records[1]["text"]          # two seeds, two samples
    results = _lines(out / "results.jsonl")
    for r in results:                                         # a random model never answers in 12 tokens
        cut = r["termination"] == "token_budget"
        assert r["outcome"] == ("context_full" if cut else "wrong") and r["sequential_tokens"] <= 12
    assert report["outcomes"]["context_full"] == sum(r["termination"] == "token_budget" for r in results)
    assert report["samples"]["samples_per_problem"] == {"min": 2, "max": 2}
    # a rerun of the same command reproduces every run
    assert eval_into(tmp_path / "rerun") == 0
    assert texts(tmp_path / "rerun") == texts(out)
    # a sample is its problem's and its seed's: the problems in the other order, one at a time,
    # give each (problem, sample) the same tokens
    reversed_file = tmp_path / "reversed.jsonl"
    reversed_file.write_text("".join(rows[::-1]))
    assert eval_into(tmp_path / "again", reversed_file, concurrency=1) == 0
    assert [r["id"] for r in _lines(tmp_path / "again" / "records.jsonl")] == ["t2", "t2", "t1", "t1"]
    assert texts(tmp_path / "again") == texts(out)


def test_wall_clock_per_problem_counts_all_of_a_problem_s_samples(tmp_path):
    from sprint_jax.eval.report import wall_clock_summary

    rows = [_run("p1", 0, True, wall=2.0), _run("p1", 1, False, wall=2.0), _run("p2", 0, True, wall=1.0),
            _run("p2", 1, True, wall=3.0)]
    for r, end in zip(rows, (2.0, 3.0, 4.0, 6.0)):
        r.update(invocation=1, finished_s=end, concurrency=2)
    # intervals [0, 2], [1, 3], [3, 4], [3, 6]: 6 s covered; 2 problems, 3 correct runs
    s = wall_clock_summary(tmp_path, rows)
    assert s["wall_clock_s"] == pytest.approx(6.0)
    assert s["wall_per_problem_s"] == pytest.approx(3.0) and s["wall_per_correct_s"] == pytest.approx(2.0)


def test_shards_of_a_sampled_eval_merge_to_the_unsharded_one(tmp_path):
    from sprint_jax.eval.shards import merge_shards, shard_meta

    tasks = TASKS + [Task("c", "math", QUERIES["a"] + " ", "1/2")]     # a third problem (a's script)

    def prompt(t):
        return t.problem.strip()
    whole, _ = evaluate(SeededEngine(), tasks, "sequential", prompt_fn=prompt, orchestrator_config=CONFIG,
                        out_dir=tmp_path / "whole", progress=False, samples=3, meta={"data": "x"})
    for i in range(2):
        sh = shard_meta(len(tasks), i, 2)
        evaluate(SeededEngine(), [tasks[k] for k in sh["positions"]], "sequential", prompt_fn=prompt,
                 orchestrator_config=CONFIG, out_dir=tmp_path / f"s{i}", progress=False, samples=3,
                 meta={"data": "x", "shard": sh})
    report = merge_shards([tmp_path / "s1", tmp_path / "s0"], tmp_path / "merged")
    merged = _lines(tmp_path / "merged" / "results.jsonl")
    assert [(r["id"], r["sample"]) for r in merged] == [(p, s) for p in "abc" for s in range(3)]
    assert [untimed(r) for r in merged] == [untimed(r) for r in json.loads(json.dumps(whole))]
    # a: 2 of 3 correct (samples 0, 2), b: 1 of 3, c: as a -> Avg@3 = 5/9
    assert report["samples"]["avg_at_k"] == pytest.approx(5 / 9) and report["problems_in_out"] == 3
    # a shard missing one sample of a problem is incomplete
    lines = (tmp_path / "s0" / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "s0" / "results.jsonl").write_text("".join(lines[:-1]))
    from sprint_jax.errors import UserError
    with pytest.raises(UserError, match="incomplete"):
        merge_shards([tmp_path / "s0", tmp_path / "s1"], tmp_path / "merged2")


# ---------------------------------------------------------------------------------------------
# the 7B eval config
# ---------------------------------------------------------------------------------------------
def test_the_7b_eval_config_samples_with_no_cap_below_its_budget_and_its_memory_figures_hold():
    import re

    from sprint_jax.config import CONFIG_DIR, load_config
    from sprint_jax.eval.cli import default_max_seq_len
    from sprint_jax.model.capacity import engine_cache_tokens, kv_cache_bytes
    from sprint_jax.model.config import Qwen2Config

    path = CONFIG_DIR / "eval_r1_distill_7b.yaml"
    cfg = load_config(OrchestratorConfig, path)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_total_tokens) == (0.6, 0.95, 0, 32768)
    assert cfg.max_planner_tokens >= cfg.max_total_tokens and cfg.max_branch_tokens >= cfg.max_total_tokens
    model_json = CONFIG_DIR / "model_r1-distill-qwen-7b.json"
    # eval's context without --max-seq-len: the budget + 2048; never past the model's 131072 positions
    assert default_max_seq_len(str(model_json), cfg) == 32768 + 2048
    assert default_max_seq_len(str(model_json), OrchestratorConfig(max_total_tokens=200_000)) == 131072
    # the KV figures in the config's comments, by hand: 2 (K, V) x 28 layers x 4 KV heads x 128 x 2 bytes
    per_position = 2 * 28 * 4 * 128 * 2
    mcfg = Qwen2Config.from_hf_config(model_json).replace(dtype="bfloat16")
    assert kv_cache_bytes(mcfg, 1) == per_position == 56 * 1024
    text = path.read_text()
    run = 34816 + 8 * (32768 + 32)
    assert engine_cache_tokens(1, 34816, 8, 32768) == run == 297_216 and "297,216 positions" in text
    for figure, positions in (("15.9 GiB", run), ("63.5 GiB", 4 * run), ("127.0 GiB", 8 * run),
                              ("3.6 GiB", 34816 + 32768 + 32)):
        assert figure in text and f"{positions * per_position / 2 ** 30:.1f} GiB" == figure
    assert "67,616 positions" in text and re.search(r"huggingface\.co/deepseek-ai/DeepSeek-R1", text)


def test_eval_sizes_its_engine_by_the_budget_and_a_sequential_run_with_one_branch(tmp_path, monkeypatch):
    import sprint_jax.infer.infer_cli as infer_cli
    from sprint_jax.errors import UserError

    seen = []

    def fake_build_engine(args, config, concurrency=1):
        seen.append((args.mode, config.max_prompts, args.max_seq_len, config.max_total_tokens))
        raise UserError("stop here: no model to load")
    monkeypatch.setattr(infer_cli, "build_engine", fake_build_engine)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 131072,
                                                   "vocab_size": 64, "hidden_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "num_key_value_heads": 1,
                                                   "intermediate_size": 16}))
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "t1", "problem": "What is 1+1?", "answer": "2"}) + "\n")
    for mode in ("sequential", "parallel"):
        assert main(["eval", "--model", str(model), "--data", str(tasks), "--mode", mode, "--out",
                     str(tmp_path / mode), "--config", "configs/eval_r1_distill_7b.yaml"]) == 2
    # the context holds the 32768-token budget + 2048; only a forking run gets 8 branches per slot
    assert seen == [("sequential", 1, 34816, 32768), ("parallel", 8, 34816, 32768)]
