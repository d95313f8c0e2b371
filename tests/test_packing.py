"""σ packing (paper §4-5) against the paper's examples and an independent longest-path reference."""
from __future__ import annotations

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sprint_jax.curation.packing import parallelization_ratio, stage_numbers, stages

PAPER_EDGES = [(1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5)]


def test_paper_five_step_example():
    sigma = stage_numbers([False] * 5, PAPER_EDGES)
    assert sigma == [1, 2, 2, 2, 3]
    assert stages(sigma) == {1: [1], 2: [2, 3, 4], 3: [5]}
    assert parallelization_ratio(sigma) == pytest.approx(5 / 3)


def test_plan_only_parent_does_not_advance_the_stage():
    # step 1 plan-only: its children share its stage
    sigma = stage_numbers([True, False, False, False, False], PAPER_EDGES)
    assert stages(sigma) == {1: [1, 2, 3, 4], 2: [5]}
    # a plan-only step in the middle of a chain
    assert stage_numbers([False, True, False], [(1, 2), (2, 3)]) == [1, 2, 2]
    # max over parents: one executing parent is enough to advance
    assert stage_numbers([True, False, False], [(1, 3), (2, 3)]) == [1, 1, 2]


def test_chain_has_ratio_one_and_is_filtered():
    sigma = stage_numbers([False] * 6, [(i, i + 1) for i in range(1, 6)])
    assert sigma == [1, 2, 3, 4, 5, 6]
    assert parallelization_ratio(sigma) == 1.0 < 1.5


def test_no_edges_is_one_stage():
    assert stage_numbers([False] * 4, []) == [1, 1, 1, 1]
    assert parallelization_ratio([1, 1, 1, 1]) == 4.0
    assert stage_numbers([], []) == []
    with pytest.raises(ValueError, match="zero steps"):
        parallelization_ratio([])


@pytest.mark.parametrize("edges, match", [
    ([(2, 1)], "parent must come before child"),
    ([(1, 1)], "parent must come before child"),
    ([(0, 2)], r"1\.\.3"),
    ([(1, 4)], r"1\.\.3"),
    ([(1,)], "pair"),
    ([("1", 2)], "ints"),
])
def test_invalid_edges_raise_clear_errors(edges, match):
    with pytest.raises(ValueError, match=match):
        stage_numbers([False] * 3, edges)


@st.composite
def dags(draw):
    n = draw(st.integers(1, 9))
    plan_only = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    pairs = [(p, c) for c in range(1, n + 1) for p in range(1, c)]
    edges = draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    return plan_only, edges


def reference_sigma(plan_only, edges):
    """1 + the heaviest path ending at each step, edge weight 1(parent executes), via networkx."""
    g = nx.DiGraph()
    g.add_nodes_from(range(1, len(plan_only) + 1))
    for p, c in edges:
        g.add_edge(p, c, w=0 if plan_only[p - 1] else 1)
    out = []
    for i in g.nodes:
        sub = g.subgraph(nx.ancestors(g, i) | {i})
        # every node of `sub` reaches i and weights are >= 0, so the heaviest path ends at i
        out.append(1 + nx.dag_longest_path_length(sub, weight="w", default_weight=0))
    return out


@settings(max_examples=80, deadline=None)
@given(dags())
def test_sigma_matches_longest_path_and_definition(dag):
    plan_only, edges = dag
    sigma = stage_numbers(plan_only, edges)
    assert sigma == reference_sigma(plan_only, edges)
    parents = {c: [p for p, cc in edges if cc == c] for c in range(1, len(plan_only) + 1)}
    for c, ps in parents.items():
        bumps = [sigma[p - 1] + (not plan_only[p - 1]) for p in ps]
        for b in bumps:
            assert sigma[c - 1] >= b
        assert sigma[c - 1] == (max(bumps) if bumps else 1)
    groups = stages(sigma)
    assert list(groups) == list(range(1, len(groups) + 1))        # stages are contiguous
    assert sorted(i for g in groups.values() for i in g) == list(range(1, len(plan_only) + 1))
    assert parallelization_ratio(sigma) == pytest.approx(len(plan_only) / len(groups))
