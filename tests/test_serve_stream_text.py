"""The streamed text of a SPRINT-mode reply (`serve.worker.SprintText`) for a ThreadWeaver-format
model: the orchestrator's events and the engine's previews of each planner call and of each block's
first thread, replayed as the server's worker sends them, give deltas that concatenate to the
run's final text, with thread 1's preview placed after the `<Thread>1:` the orchestrator forces.
The run is the hand-counted two-block run of test_threadweaver_orchestrator.py on its scripted
engine; the final text is its hand-written TW_TEXT."""
from __future__ import annotations

from sprint_jax import threadweaver as tw
from sprint_jax.infer.orchestrator import run_query
from sprint_jax.serve.worker import Progress, SprintText
from test_threadweaver_orchestrator import TW, TW_PLANNER, TW_QUERY, TW_TEXT, TW_THREADS, tw_engine


def _replay(format_name: str):
    """(deltas, the SprintText, the record): the run's events in order, with the previews the
    worker sends while a call decodes: a planner call's (its whole output) before its `planner`
    event, thread 1's (its whole output, close tag included) before its block's `executors` event
    (the fork ends there)."""
    engine = tw_engine()
    events = []
    record = run_query(engine, TW_QUERY, "parallel", TW, on_event=events.append)
    assert record.text == TW_TEXT
    text = SprintText(engine.decode_text, format_name)
    deltas = []
    for ev in events:
        if ev.kind in ("planner", "final"):
            out = TW_PLANNER[ev.stage.index - 1] if ev.stage is not None else TW_PLANNER[-1]
            deltas += text.progress(Progress("generate", engine.tokenizer.encode(out), tw.sequential_stop_strings()))
        if ev.kind == "executors":
            body = TW_THREADS[(ev.stage.index, 1)]
            deltas += text.progress(Progress("fork", engine.tokenizer.encode(body), [tw.THREAD_CLOSE]))
        deltas += text.event(ev)
    return deltas, text, record


def test_threadweaver_streamed_sprint_text_is_the_final_text_with_thread_previews_in_place():
    deltas, text, record = _replay("threadweaver")
    assert "".join(d for d, _, _ in deltas) + text.rest(record.text) == TW_TEXT
    # each block's thread 1 arrived as a preview: its own delta, tagged (block, 1), that opens
    # with the thread's forced opening and carries the body through the close
    previews = [d for d, stage, executor in deltas if executor == 1]
    assert previews == ["\n<Thread>1: So 2+3 = 5.</Thread>", "\n<Thread>1: 5*9 = 45.</Thread>"]
    # the last call's text streamed as it decoded: the final chunk holds only what a stop string
    # could still have cut
    assert len(text.rest(record.text)) < max(len(s) for s in tw.sequential_stop_strings())


def test_threadweaver_stream_read_with_sprints_opening_loses_the_text():
    """The check above fails when the previews are placed after SPRINT's `<execution_i.1>`: the
    preview is not a prefix of the final text, so nothing after it is sent."""
    deltas, text, record = _replay("sprint")
    assert "".join(d for d, _, _ in deltas) + text.rest(record.text) != TW_TEXT
