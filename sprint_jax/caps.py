"""Stage and prompt caps taken from the training data (docs/design.md "Caps from the data").

The orchestrator stops a run whose planner writes a plan past `max_stages`, and runs only the
first `max_prompts` prompts of a plan. Set below what the model was trained to write, these caps
turn runs into wrong answers; so their defaults come from the data:
  * curation reports each kept example's shape (stages, most prompts in one stage): max and p99;
  * `train` records the shape of the examples it trained on in the export's sprint_jax.json
    (`SHAPE_KEY`);
  * `infer` / `eval` / `serve` take their default caps from that record with a margin
    (`caps_from_shape`); a value the user sets (config file, --set, flags) wins;
  * eval counts a run a cap cut as `capped`, apart from wrong answers.

Shape of one example (`example_shape`): SPRINT, the number of plans (every `<Plan_i>` is a
stage the orchestrator counts against max_stages, a plan-only one too) and the most prompts in
one plan (an implicit-prompt execution runs inline, outside max_prompts); ThreadWeaver, the
number of `<Parallel>` blocks and the most outlines in one block. A serial example (RFT, a
ThreadWeaver trace with no block) has shape (0, 0).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

SHAPE_KEY = "data_shape"        # the key in MODEL/sprint_jax.json
# Margins (`caps_from_shape`). max_stages: twice the longest trajectory; a stage costs no memory,
# the cap only ends a planner that keeps planning, and the token budget bounds a run anyway.
# max_prompts: the most prompts plus a quarter, rounded up, at least one more: each prompt is an
# executor branch the engine reserves KV cache for (max_branch_tokens per branch), so the margin
# is kept small.
STAGE_FACTOR = 2
PROMPT_FACTOR = 1.25


def example_shape(completion: str, data_format: str = "sprint") -> tuple[int, int] | None:
    """(stages, most prompts in one stage) of a completion in `data_format` ("sprint" or
    "threadweaver"); None when it does not parse without problems."""
    if data_format == "threadweaver":
        from sprint_jax import threadweaver as tw
        traj, problems = tw.parse_completion(completion)
        if problems:
            return None
        return len(traj.blocks), max((len(b.outlines) for b in traj.blocks), default=0)
    if data_format != "sprint":
        raise ValueError(f"data format must be sprint or threadweaver, got {data_format!r}")
    from sprint_jax import format as fmt
    traj, problems = fmt.parse_completion(completion)
    if problems:
        return None
    return len(traj.stages), max((len(s.prompts) for s in traj.stages), default=0)


def nearest_rank(values: Sequence[int], q: float) -> int | None:
    """The q-th percentile by nearest rank: the smallest value that at least q% of `values` are
    at or below (sorted[ceil(q/100 * n) - 1]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(1, math.ceil(q / 100.0 * len(s))) - 1]


def shape_summary(shapes: Iterable[tuple[int, int]]) -> dict:
    """{"examples": n, "stages": {"max", "p99"}, "prompts": {"max", "p99"}} over per-example
    shapes (`example_shape`); max and p99 are None for no examples."""
    shapes = list(shapes)
    stages = [s for s, _ in shapes]
    prompts = [p for _, p in shapes]
    return {"examples": len(shapes),
            "stages": {"max": max(stages, default=None), "p99": nearest_rank(stages, 99)},
            "prompts": {"max": max(prompts, default=None), "p99": nearest_rank(prompts, 99)}}


def caps_from_shape(shape: dict | None) -> dict[str, int]:
    """Default `max_stages` / `max_prompts` from a `shape_summary` (the export's `SHAPE_KEY`):
    STAGE_FACTOR x the most stages, and ceil(PROMPT_FACTOR x the most prompts) but at least one
    more. A missing or empty record (or one of serial data only) gives {} (the orchestrator's own
    defaults stand). A malformed record raises ValueError naming the field."""
    if shape is None:
        return {}
    if not isinstance(shape, dict):
        raise ValueError(f"{SHAPE_KEY} must be an object, got {shape!r}")
    out = {}
    for part, name in (("stages", "max_stages"), ("prompts", "max_prompts")):
        most = (shape.get(part) or {}).get("max") if isinstance(shape.get(part) or {}, dict) else "bad"
        if most is None:
            continue
        if isinstance(most, bool) or not isinstance(most, int) or most < 0:
            raise ValueError(f"{SHAPE_KEY}.{part}.max must be an integer >= 0, got {most!r}")
        if most == 0:
            continue
        out[name] = STAGE_FACTOR * most if part == "stages" else max(most + 1, math.ceil(PROMPT_FACTOR * most))
    return out


__all__ = ["SHAPE_KEY", "STAGE_FACTOR", "PROMPT_FACTOR", "example_shape", "nearest_rank", "shape_summary",
           "caps_from_shape"]
