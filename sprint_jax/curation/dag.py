"""Dependency edges between steps (paper §4): D = {(i, j) : step j uses a result of step i}, i < j.

A prompted LLM (JSON schema + pydantic + one repair turn, like the extractor) or the offline
heuristic `offline.build_edges` proposes edges; `validate_edges` checks them with networkx before
σ packing relies on them. Edges pointing from a later step to an earlier or the same one (j <= i),
unknown step ids and cycles are errors, handled by the configured policy:
`drop` removes the offending edges and counts them by reason; `reject` discards the trace.
Edges inside a cycle that do point forward in the trace (i < j) are kept under `drop`: once the
backward edges are gone every remaining edge goes from an earlier step to a later one, so the
graph is acyclic by construction (and checked).
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import pydantic

from sprint_jax.curation.llm import CachedChat, Discarded, structured
from sprint_jax.schema import Step

SCHEMA_NAME = "step_dependencies"

SYSTEM_PROMPT = (
    "You find the dependencies between the numbered steps of a solution. Step j depends on an "
    "earlier step i when step j uses a result, value or conclusion that step i produces. A step "
    "that only needs the problem statement has no dependencies; steps that could be carried out "
    "independently of each other (for example, trying different cases or candidates) must not "
    "depend on each other. List only direct dependencies, always with parent < child. Reply with a "
    "JSON object {\"edges\": [{\"parent\": i, \"child\": j}, ...]} (an empty list when no step "
    "depends on another)."
)

# Severity order used to name the reason a trace is rejected.
EDGE_ERRORS = ("cycle", "forward_edge", "self_loop", "unknown_step")


class EdgeModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    parent: int = pydantic.Field(description="the earlier step whose result is used")
    child: int = pydantic.Field(description="the later step that uses it")


class EdgeList(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    edges: list[EdgeModel]


class DagFailed(Discarded):
    """A discard of this stage (`Discarded`)."""


@dataclasses.dataclass
class DagResult:
    edges: list[tuple[int, int]]                       # valid edges, sorted
    dropped: list[tuple[tuple[int, int], str]]         # (edge, reason) for each invalid proposal


def render_steps(steps: list[Step]) -> str:
    parts = []
    for i, s in enumerate(steps, 1):
        execution = s.execution if not s.plan_only else "(none: this step is planning only)"
        parts.append(f"Step {i}\nPlan: {s.plan}\nExecution: {execution}")
    return "\n\n".join(parts)


def dag_messages(problem: str, steps: list[Step]) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Problem:\n{problem}\n\nSteps (1 to {len(steps)}):\n\n{render_steps(steps)}"}]


def propose_llm(chat: CachedChat, problem: str, steps: list[Step]) -> list[tuple[int, int]]:
    """Edges proposed by the DAG model, unvalidated. A single step cannot have edges: no call."""
    if len(steps) < 2:
        return []
    result = structured(chat, dag_messages(problem, steps), EdgeList, SCHEMA_NAME)
    if result.value is None:
        raise DagFailed("invalid_json", result.error)
    return [(e.parent, e.child) for e in result.value.edges]


def propose_offline(steps: list[Step], query: str = "") -> list[tuple[int, int]]:
    """The heuristic builder; numbers given in the query are inputs, not results of a step."""
    from sprint_jax.curation import offline
    return [tuple(e) for e in offline.build_edges(steps, query=query)]


def validate_edges(n_steps: int, proposed: list[tuple[int, int]], policy: str) -> DagResult:
    """Classify every proposed edge; drop the invalid ones (policy "drop") or raise DagFailed naming
    the most severe problem (policy "reject"). Duplicates collapse silently."""
    if policy not in ("drop", "reject"):
        raise ValueError(f"invalid_edge_policy must be drop or reject, got {policy!r}")
    unique = list(dict.fromkeys((int(a), int(b)) for a, b in proposed))
    dropped: list[tuple[tuple[int, int], str]] = []
    candidates = []
    for i, j in unique:
        if not (1 <= i <= n_steps and 1 <= j <= n_steps):
            dropped.append(((i, j), "unknown_step"))
        elif i == j:
            dropped.append(((i, j), "self_loop"))
        else:
            candidates.append((i, j))
    graph = nx.DiGraph()
    graph.add_nodes_from(range(1, n_steps + 1))
    graph.add_edges_from(candidates)
    component = {}
    for k, scc in enumerate(nx.strongly_connected_components(graph)):
        for node in scc:
            component[node] = k
    kept = []
    for i, j in candidates:
        if i < j:
            kept.append((i, j))
        elif component[i] == component[j]:
            dropped.append(((i, j), "cycle"))
        else:
            dropped.append(((i, j), "forward_edge"))
    if dropped and policy == "reject":
        worst = min((why for _, why in dropped), key=EDGE_ERRORS.index)
        raise DagFailed(worst, "; ".join(f"({i},{j}) {why}" for (i, j), why in dropped))
    dag = nx.DiGraph()
    dag.add_nodes_from(range(1, n_steps + 1))
    dag.add_edges_from(kept)
    assert nx.is_directed_acyclic_graph(dag), "edges with i < j cannot form a cycle"
    return DagResult(edges=sorted(kept), dropped=dropped)
