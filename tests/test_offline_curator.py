"""Offline curator + reformat: steps, edges, σ, SPRINT and RFT examples, end to end on Countdown."""
from __future__ import annotations

import pytest

from sprint_jax import format as sf
from sprint_jax.curation import offline, packing, reformat
from sprint_jax.tasks import countdown
from sprint_jax.schema import Example, Step
from sprint_jax.tasks import grade

TRACE = """We need the area of two rooms.

Compute the first room: it is 12 by 10, so 12 * 10 = 120 square metres in total.

Compute the second room. It is 9 by 7, so 9 * 7 = 63 square metres.

So the total is 120 + 63 = 183.

Answer 183."""


def test_extract_steps_splits_paragraphs_into_plan_and_execution():
    steps = offline.extract_steps(TRACE)
    assert [s.plan for s in steps] == ["We need the area of two rooms.", "Compute the first room:",
                                       "Compute the second room.", "So the total is 120 + 63 = 183.",
                                       "Answer 183."]
    assert steps[1].execution == "it is 12 by 10, so 12 * 10 = 120 square metres in total."
    assert steps[0].plan_only and steps[3].plan_only
    # no blank lines: one step per line
    assert len(offline.extract_steps("a. b\nc. d\ne. f")) == 3
    assert offline.extract_steps("") == []


def test_merge_short():
    steps = [Step("Plan a.", "tiny"), Step("Plan b.", "a long enough execution text"), Step("Plan c.", "")]
    merged = offline.merge_short(steps, min_chars=10)
    assert merged == [Step("Plan a. tiny", ""), Step("Plan b.", "a long enough execution text"), Step("Plan c.", "")]
    assert steps[0].execution == "tiny"                      # inputs untouched
    assert offline.merge_short(steps, 0) == steps


def test_build_edges_value_flow_and_back_references():
    steps = offline.merge_short(offline.extract_steps(TRACE), 10)
    # step 4 uses 120 (from step 2) and 63 (from step 3), and opens with "So"; step 5 uses 183,
    # which step 4 wrote in its *plan* (plan-only step: no execution, so it produces nothing)
    assert offline.build_edges(steps) == [(2, 4), (3, 4)]
    # values that the query already contains are not dependencies
    independent = [Step("Try a.", "5 + 6 = 11 and 11 * 3 = 33"), Step("Try b.", "uses 33 and 11 again")]
    assert offline.build_edges(independent) == [(1, 2)]
    assert offline.build_edges(independent, query="numbers 33 and 11") == []
    # a value a step produces itself is not an input
    assert offline.build_edges([Step("A.", "x = 40"), Step("B.", "y = 40, so 40 / 2 = 20")]) == []
    # back references point at the step just before
    assert offline.build_edges([Step("A.", "x"), Step("B.", "y"), Step("Check the result found above.", "z")]) == [(2, 3)]


def test_to_sprint_follows_the_design_rule():
    # the paper's 5-step shape, with a plan-only step 3 sharing stage 2
    steps = [Step("Set up.", "s1"), Step("Do A.", "a"), Step("Note B.", ""), Step("Do C.", "c"), Step("Join.", "j")]
    edges = [(1, 2), (1, 3), (1, 4), (2, 5), (3, 5), (4, 5)]
    traj = reformat.to_sprint("Q?", steps, edges, "42")
    assert sf.render_completion(traj) == (
        "<Plan_1> <prompt_1.1> Set up. </prompt_1.1> </Plan_1>\n"
        "<execution_1.1> s1 </execution_1.1>\n"
        "<Plan_2> <prompt_2.1> Do A. </prompt_2.1> Note B. <prompt_2.2> Do C. </prompt_2.2> </Plan_2>\n"
        "<execution_2.1> a </execution_2.1>\n"
        "<execution_2.2> c </execution_2.2>\n"
        "<Plan_3> <prompt_3.1> Join. </prompt_3.1> </Plan_3>\n"
        "<execution_3.1> j </execution_3.1>\n"
        "<Final Answer> 42 </Final Answer>")
    assert sf.parse(sf.render(traj)) == (traj, [])
    with pytest.raises(ValueError, match="parent must come before child"):
        reformat.to_sprint("Q?", steps, [(3, 2)], "42")
    with pytest.raises(ValueError, match="no steps"):
        reformat.to_sprint("Q?", [], [], "42")


def test_rft_completion_and_examples():
    completion = reformat.to_rft("Q?", "Q? think hard.\n\nDone.", "7")
    assert completion == "think hard.\n\nDone.\n<Final Answer> 7 </Final Answer>"
    traj, problems = sf.parse_completion(completion)
    assert traj.final_answer == "7" and len(problems) == 1          # the untagged serial trace
    assert set(sf.span_labels("Q?", completion)[2:2 + len("think hard.")]) == {"plan"}
    with pytest.raises(ValueError, match="SPRINT tag"):
        reformat.to_rft("Q?", "oops <Plan_1>", "7")
    ex = Example("id1", "rft", "Q?", reformat.to_rft("Q?", "think.", "7"), answer="7", meta={"rho": 1.0})
    assert Example.from_json(ex.to_json()) == ex
    traj = reformat.to_sprint("Q?", [Step("A.", "a"), Step("B.", "b")], [], "7")
    assert sf.parse_completion(sf.render_completion(traj)) == (sf.Trajectory("", traj.stages, "7"), [])


def test_countdown_end_to_end_offline():
    """generate -> solve_trace -> grade -> extract -> merge -> edges -> σ -> ρ -> reformat -> render -> parse."""
    tasks = countdown.generate(40, seed=11)
    rhos = []
    for k, task in enumerate(tasks):
        trace = countdown.solve_trace(task, seed=k)
        assert grade(task, trace.final_answer)
        query = countdown.prompt_for(task)
        steps = offline.merge_short(offline.extract_steps(trace.text), min_chars=40)
        edges = offline.build_edges(steps, query=query)
        sigma = packing.stage_numbers([s.plan_only for s in steps], edges)
        rhos.append(packing.parallelization_ratio(sigma))
        traj = reformat.to_sprint(query, steps, edges, trace.final_answer)
        parsed, problems = sf.parse(sf.render(traj))
        assert problems == [] and parsed == traj
        assert grade(task, parsed.final_answer)
        # attempts are independent: they share stage 1 and run as parallel executors there
        first = traj.stages[0]
        assert len(first.prompts) == len(first.executions) >= 2
        assert all("does not work" in e or "works" in e for e in first.executions)
        # the check depends on the successful attempt, the conclusion on the check
        assert [len(s.executions) for s in traj.stages[1:]] == [1, 0]
        assert sf.parse_completion(sf.render_completion(traj))[1] == []
    assert sum(r >= 1.5 for r in rhos) >= 0.9 * len(rhos)
