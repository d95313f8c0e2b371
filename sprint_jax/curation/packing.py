"""σ packing: steps of a dependency DAG -> SPRINT stages (paper §4-5).

    σ(S_i) = 1                                   if S_i has no parents
    σ(S_i) = max_{p ∈ parents(i)} σ(S_p) + 1(E_p ≠ ∅)   otherwise

Stage k = {i : σ(S_i) = k}; ρ = |S| / #stages. A plan-only parent (E_p = ∅) adds no execution
round, so its child may share its stage: the child's prompt is written in the same plan, after the
parent's planning text. Steps are numbered 1..n in trace order and every edge (p, c) has p < c
(a topological order), so one forward pass computes σ.
"""
from __future__ import annotations

from typing import Sequence


def _check_edges(n: int, edges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for k, edge in enumerate(edges):
        try:
            p, c = edge
        except (TypeError, ValueError):
            raise ValueError(f"edge #{k} {edge!r} is not a (parent, child) pair") from None
        if isinstance(p, bool) or isinstance(c, bool) or not isinstance(p, int) or not isinstance(c, int):
            raise ValueError(f"edge #{k} {edge!r}: step ids must be ints")
        if not (1 <= p <= n and 1 <= c <= n):
            raise ValueError(f"edge #{k} {edge!r}: step ids must be in 1..{n}")
        if p >= c:
            raise ValueError(f"edge #{k} {edge!r}: parent must come before child (p < c); "
                             "cycles, self-loops and forward references are not a DAG in trace order")
        out.append((p, c))
    return out


def stage_numbers(plan_only: Sequence[bool], edges: Sequence[tuple[int, int]]) -> list[int]:
    """σ for steps 1..n. `plan_only[i-1]` is True when E_i = ∅; edges are 1-based (parent, child)."""
    n = len(plan_only)
    parents: list[list[int]] = [[] for _ in range(n + 1)]
    for p, c in _check_edges(n, edges):
        parents[c].append(p)
    sigma = [0] * (n + 1)
    for i in range(1, n + 1):
        sigma[i] = max((sigma[p] + (0 if plan_only[p - 1] else 1) for p in parents[i]), default=1)
    return sigma[1:]


def stages(sigma: Sequence[int]) -> dict[int, list[int]]:
    """{stage k: [1-based step ids with σ = k, in trace order]}, keys ascending."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(sigma, start=1):
        out.setdefault(int(k), []).append(i)
    return dict(sorted(out.items()))


def parallelization_ratio(sigma: Sequence[int]) -> float:
    """ρ = |S| / #stages (paper §5). A pure chain has ρ = 1; the paper keeps traces with ρ ≥ 1.5."""
    if len(sigma) == 0:
        raise ValueError("parallelization ratio of zero steps is undefined")
    return len(sigma) / len(set(sigma))


__all__ = ["stage_numbers", "stages", "parallelization_ratio"]
