"""ThreadWeaver's per-problem speedup distribution as numbers in `eval compare` (median, max, the
max over problems both runs solved, the share faster), checked against hand computations."""
from __future__ import annotations

import pytest

from sprint_jax.eval.report import compare, format_compare_table, speedup_summary


def _row(pid, correct, seq, sample=None):
    row = {"id": pid, "correct": correct, "sequential_tokens": seq, "total_tokens": seq, "wall_s": 1.0}
    if sample is not None:
        row["sample"] = sample
    return row


# (A = the parallel run, B = the sequential baseline); speedup = B's sequential tokens / A's
PAIRS = [(_row("p1", True, 1000), _row("p1", True, 1500)),     # 1.5, both solved
         (_row("p2", False, 2000), _row("p2", True, 6000)),    # 3.0, A wrong
         (_row("p3", True, 4000), _row("p3", True, 3000)),     # 0.75, both solved, A slower
         (_row("p4", True, 0), _row("p4", True, 900)),         # A generated nothing: left out
         (_row("p5", True, 500), _row("p5", True, 1000))]      # 2.0, both solved


def test_threadweaver_metrics_speedup_summary_by_hand():
    s = speedup_summary(PAIRS)
    # kept speedups 1.5, 3.0, 0.75, 2.0 -> sorted 0.75, 1.5, 2.0, 3.0
    assert s["n"] == 4
    assert s["min"] == pytest.approx(0.75) and s["max"] == pytest.approx(3.0)
    assert s["median"] == pytest.approx((1.5 + 2.0) / 2)          # even n: the middle two's mean
    assert s["faster"] == pytest.approx(3 / 4)                     # all but p3
    # solved by both: p1 (1.5), p3 (0.75), p5 (2.0); p2's 3.0 is A's wrong answer
    assert s["max_both_solved"] == pytest.approx(2.0) and s["n_both_solved"] == 3
    assert speedup_summary(PAIRS[:3])["median"] == pytest.approx(1.5)   # odd n: the middle one


def test_threadweaver_metrics_nothing_to_summarise_is_none():
    s = speedup_summary([PAIRS[3]])
    assert s == {"n": 0, "min": None, "median": None, "max": None, "faster": None,
                 "max_both_solved": None, "n_both_solved": 0}
    # A solved nothing that B solved: the distribution exists, its both-solved maximum does not
    assert speedup_summary([PAIRS[1]])["max_both_solved"] is None


def test_threadweaver_metrics_in_compare_of_sampled_runs():
    """Through `compare` (whose table `eval compare` writes to compare.json and prints): a sampled
    run enters by its per-problem means (of tokens and of correct)."""
    a = [_row("p1", True, 800, 0), _row("p1", True, 1200, 1),      # mean 1000, solved (2 of 2)
         _row("p2", True, 1000, 0), _row("p2", False, 3000, 1),    # mean 2000, not solved (1 of 2: not > half)
         _row("p3", True, 250, 0), _row("p3", True, 750, 1)]       # mean 500, solved
    b = [_row("p1", True, 1500, 0), _row("p1", True, 1500, 1),     # 1500 -> 1.5
         _row("p2", True, 5000, 0), _row("p2", True, 7000, 1),     # 6000 -> 3.0
         _row("p3", True, 400, 0), _row("p3", True, 400, 1)]       # 400 -> 0.8
    t = compare(a, b)
    s = t["speedup_summary"]
    assert s["n"] == 3 and s["median"] == pytest.approx(1.5) and s["max"] == pytest.approx(3.0)
    assert s["min"] == pytest.approx(0.8) and s["faster"] == pytest.approx(2 / 3)
    assert s["max_both_solved"] == pytest.approx(1.5) and s["n_both_solved"] == 2
    text = format_compare_table(t)
    assert "per-problem speedup: median 1.500, max 3.000 (max 1.500 over the 2 both solved), 66.7% of problems " \
           "faster" in text
