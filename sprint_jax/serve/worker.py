"""The engine's driver: one place owns the Engine and steps it; requests arrive through a
queue and their tokens / events / results leave through per-request channels.

Where the engine runs (`on_loop`):
  thread  an engine thread of its own (default on accelerators): the HTTP side's event loop stays
          responsive while a step runs; items reach the loop by `loop.call_soon_threadsafe`, so a
          request crosses threads twice (loop -> engine thread -> loop).
  loop    a task on the HTTP side's event loop (default on CPU) paces the engine: one turn (take
          what arrived, one engine step, hand out what it produced) at a time, each run on a
          thread of its own while the task awaits it, then the requests whose handlers ran
          meanwhile join the next turn. The turn is off the loop because a step can take any
          time: XLA compiles a program the first time it meets a shape (seconds to minutes),
          and the loop must keep answering (/health, new requests, a shutdown's grace) meanwhile.
          One hand-off per turn; the engine thread runs only while the task waits for it.

A job is one request:
  plain   open(prompt) -> generate (n = 1) or fork of n empty prefixes (n > 1: the n children
          share the prompt's one prefill) -> close. Streaming jobs get their new tokens after
          every engine step (`Engine.progress`).
  sprint  the orchestrator's generator (`Orchestrator.steps`), its calls answered by the driver
          `orchestrator.run_many` uses (`infer.drive.RunDriver`), so SPRINT runs and plain
          requests share every engine step; its stage events are forwarded as they happen. The
          server's own parts plug in as the driver's hooks: log-probs per token (and the log of
          generated calls they are placed by), and ending a run at a stop string of the request.
A job whose client went away is cancelled: `Engine.abort` drops its rows and frees its slot
before the next engine step. A job that raises ends alone (its client gets an "error" item whose
`status` is 400 for input it should have refused, 500 for a bug, logged with its traceback); the
engine serves on.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from collections import deque
from typing import Any

from sprint_jax.errors import UserError
from sprint_jax.infer.drive import RunDriver
from sprint_jax.infer.requests import EngineError
from sprint_jax.infer.sampling import Sampling

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# `Engine.page_stats` walks the radix tree (~2 ms per 10k cached pages on a CPU): while requests
# run, the pool figures of /metrics are renewed at most this often; at every idle turn always
POOL_STATS_EVERY_S = 1.0
STOP_TERMINATION = "stop_string"     # a SPRINT run ended at a stop string of its request


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the first stop string (excluded, as OpenAI does), and whether one was found."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


def _running_on(loop) -> bool:
    """Whether the caller runs on `loop` (its thread, inside it), not on another thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _settle(fut: asyncio.Future, out, exc) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(out)


class Failure(str):
    """An "error" item's message, with the HTTP status the request gets (`status`): 400 when the
    job should have been refused (a UserError, an EngineError), 500 for a bug."""

    status: int

    def __new__(cls, message: str, status: int = 500) -> "Failure":
        out = super().__new__(cls, message)
        out.status = status
        return out


@dataclasses.dataclass
class Progress:
    """What a streaming SPRINT job's current engine call has decoded so far: `kind` generate (the
    planner; `tokens` its tokens) or fork (the executors; `tokens` executor 1's), with that row's
    stop strings; when the request asked for log-probs, that row's log-probs and alternatives."""
    kind: str
    tokens: list[int]
    stops: list[str]
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list | None = None


def _settled(text: str, stops: list[str]) -> str:
    """The part of a call's text so far that later tokens cannot change: up to the end of the first
    stop string in it, else all but what could still begin a stop (and a trailing partial
    character)."""
    ends = [text.find(s) + len(s) for s in stops if s and s in text]
    if ends:
        return text[:min(ends)]
    safe = len(text) - (max((len(s) for s in stops), default=1) - 1)
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return text[:max(safe, 0)]


def executor_opening(format_name: str, i: int, j: int) -> str:
    """The text the orchestrator forces before executor j of stage i in the model's tag format
    (`sprint`: `<execution_i.j>`; `threadweaver`: the block gap and `<Thread>j:`)."""
    from sprint_jax import format as fmt
    from sprint_jax import threadweaver as tw
    from sprint_jax.infer.orchestrator import execution_opening

    return fmt.BLOCK_GAP + tw.thread_opening(j) if format_name == "threadweaver" else execution_opening(i, j)


class SprintText:
    """A streaming SPRINT reply's text, in the order of the final completion: the run's committed
    pieces (`text` events) and, ahead of them, what the planner call or executor 1 has decoded so
    far (`Progress`), each sent only as far as it cannot change. `event` / `progress` return the
    new deltas as (text, stage index or None, executor index or None); `rest(final_text)` is what
    the final text adds to everything sent. With the request's `stops`, nothing from the first
    stop string on is sent, nor the characters that could still begin one."""

    def __init__(self, decode, format_name: str = "sprint", stops: list[str] | None = None):
        self.decode = decode
        self.format_name = format_name   # the model's tag format: where executor 1's forced opening is
        self.stops = list(stops or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stopped = False             # a stop string was sent up to: nothing more goes out
        self.committed = ""              # the run's committed pieces so far
        self.sent = ""                   # everything returned so far (committed + a preview)
        self.stage: int | None = None    # the stage whose executors decode now

    def _to(self, target: str, stage: int | None, executor: int | None) -> list[tuple[str, int | None, int | None]]:
        if self.stopped:
            return []
        if self.stops:
            target, self.stopped = cut_at_stop(target, self.stops)
            if not self.stopped:
                target = target[:len(target) - self.hold]
        if len(target) <= len(self.sent) or not target.startswith(self.sent):
            return []
        delta, self.sent = target[len(self.sent):], target
        return [(delta, stage, executor)]

    def event(self, ev) -> list[tuple[str, int | None, int | None]]:
        if ev.kind == "executors_start":
            self.stage = ev.stage.index
        if ev.kind != "text":
            return []
        self.committed += ev.text
        return self._to(self.committed, ev.stage.index if ev.stage is not None else None, ev.executor)

    def progress(self, p: Progress) -> list[tuple[str, int | None, int | None]]:
        text = _settled(self.decode(p.tokens), p.stops)
        if p.kind == "generate":
            return self._to(self.committed + text, None, None)
        if self.stage is None:
            return []
        return self._to(self.committed + executor_opening(self.format_name, self.stage, 1) + text, self.stage, 1)

    def rest(self, final_text: str) -> str:
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else ""


@dataclasses.dataclass
class TokenEntry:
    """One generated token as a reply's log-probs list it: the token decoded alone, where its text
    begins in the choice's text (characters), its log-prob, and its alternatives ((decoded id,
    log-prob), most likely first)."""
    token: str
    offset: int
    logprob: float
    top: list[tuple[str, float]]


class TokenCursor:
    """One choice's token log-probs, listed in order: `take` lists the tokens not yet listed whose
    text begins before `upto` (a streamed chunk's end, or the end of the returned text), placing
    each at `base` + the characters of the tokens before it in the same call (each decoded alone).
    A token past a stop string or EOS (text past the end) is never listed."""

    def __init__(self, decode, top: int, base: int = 0):
        self.decode, self.top = decode, top
        self.listed = 0
        self.at = base

    def take(self, tokens, logprobs, tops, upto: int) -> list[TokenEntry]:
        out = []
        while self.listed < min(len(tokens), len(logprobs)) and self.at < upto:
            k = self.listed
            s = self.decode([tokens[k]])
            alts = [(self.decode([i]), float(v)) for i, v in tops[k][:self.top]] if self.top and tops else []
            out.append(TokenEntry(s, self.at, float(logprobs[k]), alts))
            self.at += len(s)
            self.listed += 1
        return out


def sprint_token_layout(layout: list, text: str, decode, top: int) -> list[TokenEntry]:
    """The generated tokens of a SPRINT run's returned `text`, in text order, from the run's log
    (`Job.layout`). Generated calls come in text order (planner call, its executors 1..k, the next
    planner call, ...) and each committed `text` piece tells where its call's text lies: a planner
    piece is its call's kept output; an executor's piece is its forced opening, its body, and the
    close the orchestrator may add. Listed: every token of a planner call or executor body whose
    text begins inside what the returned text keeps of it (as a plain reply: not the tokens past a
    stop string, not EOS); an executor whose work never reached the text (the run ended before
    its join) lists nothing. Text the orchestrator writes (openings, repairs, gaps, the join tail)
    has no entry: each entry's `offset` says where it sits, and the uncovered characters are that
    text. The last planner call, never committed by an event, takes the rest of the text."""
    out: list[TokenEntry] = []
    at = 0                            # characters committed so far
    planner = None                    # a generate call's result whose text is not placed yet
    branches: list = []
    for item in layout:
        if item[0] == "call":
            if isinstance(item[1], list):
                branches = item[1]
            else:
                planner = item[1]
            continue
        _, piece, executor, opening, kept = item
        if executor is None and planner is not None:
            out += TokenCursor(decode, top, at).take(planner.tokens, planner.logprobs, planner.top_logprobs,
                                                     at + len(piece))
            planner = None
        elif executor is not None and 0 < executor <= len(branches):
            g = branches[executor - 1]
            out += TokenCursor(decode, top, at + opening).take(g.tokens, g.logprobs, g.top_logprobs,
                                                               at + opening + kept)
        at += len(piece)
    if planner is not None:
        out += TokenCursor(decode, top, at).take(planner.tokens, planner.logprobs, planner.top_logprobs, len(text))
    return out


def _text_piece(job: "Job", ev) -> tuple:
    """A `text` event as `Job.layout` logs it: ("text", piece, executor, characters of its forced
    opening, characters of its generated body); the last two 0 for a planner's or a forced piece."""
    if ev.executor is None or ev.stage is None:
        return ("text", ev.text, None, 0, 0)
    i, j = ev.stage.index, ev.executor
    opening = executor_opening(getattr(job.config, "format", "sprint"), i, j)
    body = next((e.text for e in ev.stage.executions if e.index == j), "")
    if not ev.text.startswith(opening):       # not the piece the orchestrator documents: place nothing
        return ("text", ev.text, None, 0, 0)
    return ("text", ev.text, j, len(opening), len(body))


def _progress_logprobs(engine, op) -> list[tuple[list[float], list | None]]:
    """Per choice of a streaming generate / fork op, the log-probs and alternatives of the tokens
    `engine.progress(op)` reports: a finished row's from its Generation, a decoding row's from the
    scheduler's running lists (Row.lps / Row.tops, kept in step with Row.gen; `Engine.running_rows`),
    read the way `Engine.progress` reads Row.gen."""
    def of(g):
        return (list(g.logprobs), list(g.top_logprobs) if g.top_logprobs is not None else None)

    def running(row):
        return (list(row.lps), list(row.tops)) if row is not None else ([], None)
    if op.done:
        return [of(op.result)] if op.kind == "generate" else [of(g) for g in op.result]
    rows = engine.running_rows(op)
    if op.kind == "generate":
        return [running(rows[0])]
    return [of(g) if g is not None else running(r) for g, r in zip(op.result, rows)]


class Channel:
    """Engine thread -> one request handler. Items: ("tokens", [[ids] per choice], log-probs)
    (streaming; log-probs: None, or per choice (log-probs, alternatives or None) of those ids, when
    the request asked), ("event", Event, the job's layout so far when it asked for log-probs) and ("progress", Progress) (SPRINT streaming), ("done",
    result), ("error", Failure)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._held = None           # an item taken while coalescing "tokens", given out next

    def put(self, item) -> None:
        if _running_on(self.loop):  # the engine runs on the loop: no thread to cross
            self.queue.put_nowait(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:        # the loop is closed: nobody listens any more
            pass

    async def get(self):
        """The next item; "tokens" items waiting back to back give only the last (each holds
        every token so far): a handler that fell behind the engine catches up in one write."""
        item, self._held = self._held, None
        if item is None:
            item = await self.queue.get()
        while item[0] == "tokens" and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if nxt[0] != "tokens":
                self._held = nxt
                break
            item = nxt
        return item


@dataclasses.dataclass
class Job:
    kind: str                               # plain | sprint
    channel: Channel
    prompt: list[int] = dataclasses.field(default_factory=list)     # plain
    n: int = 1
    max_tokens: int = 16
    stop: list[str] = dataclasses.field(default_factory=list)
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    stream: bool = False
    logprobs: bool = False                  # the reply carries token log-probs
    top_logprobs: int = 0                   # alternatives per token the engine reports
    query: str = ""                         # sprint
    mode: str = "parallel"
    config: Any = None                      # sprint: OrchestratorConfig
    # engine-thread state
    op: Any = None
    seq: Any = None
    steps: Any = None
    sent: list[int] = dataclasses.field(default_factory=list)      # streamed tokens per choice
    # sprint with logprobs: the run's generated calls and committed text, in the order they happened
    # (`sprint_token_layout` reads them): ("call", Generation or [Generation]) for each generate /
    # branches result, ("text", piece, executor, opening chars, kept chars) for each `text` event
    layout: list = dataclasses.field(default_factory=list)
    call: Any = None                        # sprint: the engine call `op` answers (`RunDriver`)
    context: list[int] = dataclasses.field(default_factory=list)   # RunDriver's; the server asks for none
    committed: str = ""                     # sprint with stop strings: the run's committed text so far
    stop_hit: bool = False                  # ... holds one of them: the run ends at its next call
    cancelled: bool = False
    finished: bool = False


class EngineWorker:
    """Owns `engine` (an Engine) on its own thread (`start()`), or as a task on an event loop
    (`on_loop=True`, `start_on_loop()` from that loop). `try_submit(job)` and `cancel(job)` may be
    called from any thread; everything else about the engine happens where the engine runs."""

    def __init__(self, engine, max_queue: int = 64, on_loop: bool = False):
        self.engine = engine
        self.max_queue = max_queue
        self.on_loop = on_loop
        self._event_loop: asyncio.AbstractEventLoop | None = None  # on_loop: the loop it runs on
        self._wake: asyncio.Event | None = None                  # on_loop: set by a submit / cancel
        self._task: asyncio.Task | None = None
        self._ended = threading.Event()                          # on_loop: the task has ended
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._pending = 0                    # submitted, not finished (read by the HTTP side)
        self._arrivals: list[Job] = []       # submitted on the event loop, not yet handed over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sprint-jax-engine", daemon=True)
        self._turns: queue.SimpleQueue = queue.SimpleQueue()    # on_loop: turns for the engine thread
        self.busy = False                    # the engine is inside a turn (a step, maybe a compile)
        self.error: str | None = None        # set if the engine thread / task died
        self._tok_window: deque[tuple[float, int]] = deque()
        # prompt tokens of the sequences this worker opened (requests' prompts, SPRINT runs'
        # prompts), counted when admitted: when the engine's radix tree counts their cache hits
        self.prompt_tokens = 0
        self._pool = engine.page_stats()
        self._pool_t, self._pool_prompt = time.perf_counter(), 0
        self._hits_before = self._pool["prefix_hit_tokens"]       # hits of opens before this worker
        self.metrics = dict(queue_depth=0, active_rows=0, slots_used=0, slots_total=engine.max_seqs,
                            running_jobs=0, tokens_total=0, tokens_per_s=0.0, steps=0, cancelled=0,
                            prefill_calls=engine.stats["prefill_calls"], decode_calls=engine.stats["decode_calls"],
                            **self._pool_metrics())
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.requests: dict[str, int] = {}   # status code -> count
        # SPRINT jobs' calls: answered as run_many answers them, with the server's hooks
        self._driver = RunDriver(engine, on_answer=self._answered, on_done=lambda job, rec: self._end(job, ("done", rec)),
                                 interrupt=self._stop_hit,
                                 top_logprobs=lambda job: job.top_logprobs if job.logprobs else 0)

    # ---- any thread ---------------------------------------------------------------------------
    def start(self) -> "EngineWorker":
        if not self.on_loop:
            self._thread.start()
        return self

    def start_on_loop(self) -> None:
        """on_loop: start the engine task on the running loop (the server's startup does), and the
        thread its turns run on."""
        if self.on_loop and self._task is None:
            self._event_loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._thread = threading.Thread(target=self._run_turns, name="sprint-jax-engine", daemon=True)
            self._thread.start()
            self._task = self._event_loop.create_task(self._run_on_loop())

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the engine to leave the turn it is in (a step or a compile
        does not stop halfway); whether it is out."""
        t_end = time.monotonic() + timeout
        while self.busy and time.monotonic() < t_end:
            time.sleep(0.01)
        return not self.busy

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if not self.on_loop:
            self._inbox.put(None)
            self._thread.join(timeout)
            return
        if self._task is None:
            return
        self._turns.put(None)         # the turn thread ends after the turn it is in
        self._notify()
        if not _running_on(self._event_loop) and self._event_loop.is_running():
            self._ended.wait(timeout)

    @property
    def alive(self) -> bool:
        if self.on_loop:
            return self._task is not None and not self._ended.is_set() and self.error is None
        return self._thread.is_alive() and self.error is None

    def _notify(self) -> None:
        """on_loop: wake the engine task (from the loop or from another thread)."""
        if not self.on_loop or self._wake is None:
            return
        if _running_on(self._event_loop):
            self._wake.set()
            return
        try:
            self._event_loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:        # the loop is closed
            pass

    @property
    def capacity(self) -> int:
        """Requests held at once (running + queued) before new ones get 429."""
        return self.engine.max_seqs + self.max_queue

    def try_submit(self, job: Job) -> bool:
        """Queue the job unless the server already holds `capacity` requests."""
        with self._lock:
            if self._pending >= self.capacity:
                return False
            self._pending += 1
        if self.on_loop:              # the engine task takes it at its next turn, with the others
            self._inbox.put(("submit", job))       # submitted before that turn
            self._notify()
            return True
        if not _running_on(job.channel.loop):
            self._inbox.put(("submit", job))
            return True
        # On the HTTP side's event loop: hand the job over when the loop has run the handlers that
        # are ready now, in one item with every request submitted meanwhile (requests that arrive
        # together reach the engine thread together and share their first step; one waking the
        # engine thread while the others are still parsed would start a step without them)
        self._arrivals.append(job)
        if len(self._arrivals) == 1:
            job.channel.loop.call_soon(self._hand_over)
        return True

    def _hand_over(self) -> None:
        jobs, self._arrivals = self._arrivals, []
        self._inbox.put(("submit", jobs))

    def cancel(self, job: Job) -> None:
        self._inbox.put(("cancel", job))
        self._notify()

    def observe(self, status: int, seconds: float | None) -> None:
        """Count a finished HTTP request (its status) and, for a served one, its latency."""
        with self._lock:
            self.requests[str(status)] = self.requests.get(str(status), 0) + 1
            if seconds is not None:
                i = next((k for k, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
                self.latency_counts[i] += 1
                self.latency_sum += seconds

    # ---- where the engine runs -----------------------------------------------------------------
    def _loop(self) -> None:
        """The engine thread."""
        try:
            stalled = False
            while not self._stop.is_set():
                # wait for work only when there is nothing to step (idle), or when the last step
                # could not move (opens wait for slots that idle sequences hold): a submission or
                # cancel wakes the wait at once; otherwise take what has arrived and step
                try:
                    if not self._jobs or stalled:
                        item = self._inbox.get(timeout=0.1 if not self._jobs else 0.005)
                    else:
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
                if item is not None:
                    self._handle(item)
                stalled = self._turn()
        except Exception as e:
            self._failed(e)
            raise

    async def _run_on_loop(self) -> None:
        """The engine task (on_loop): one turn (take what arrived, one engine step) on the turn
        thread while the loop serves the sockets, then yield to the loop twice: the first lets it
        poll the sockets, the second lets the handlers of requests that arrived run, so their
        requests join the next step instead of waiting for it."""
        try:
            stalled = False
            while not self._stop.is_set():
                if (not self._jobs or stalled) and self._inbox.empty():
                    self._wake.clear()
                    try:            # idle: until a submission; stalled: at most 5 ms
                        await asyncio.wait_for(self._wake.wait(), 0.005 if self._jobs else None)
                    except asyncio.TimeoutError:
                        pass
                    if not self._jobs and self._inbox.empty():
                        continue
                stalled = await self._off_loop(self._turn)
                await asyncio.sleep(0)
                await asyncio.sleep(0)
        except asyncio.CancelledError:   # the loop ends (the server has shut down) while a turn runs
            pass
        except Exception as e:
            self._failed(e)
            traceback.print_exc()
        finally:
            self._ended.set()

    def _off_loop(self, fn) -> asyncio.Future:
        """fn() on the turn thread; a future of its result, on this loop."""
        fut = self._event_loop.create_future()
        self._turns.put((fn, fut))
        return fut

    def _run_turns(self) -> None:
        """The turn thread (on_loop): runs each turn the engine task hands it, and passes back
        its result (or exception) to the loop; ends at stop()."""
        loop = self._event_loop
        while True:
            item = self._turns.get()
            if item is None:
                return
            fn, fut = item
            try:
                out, exc = fn(), None
            except Exception as e:        # noqa: BLE001  (raised on the loop, in the engine task)
                out, exc = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, out, exc)
            except RuntimeError:          # the loop has closed: nobody waits for this turn
                return

    def _turn(self) -> bool:
        """Take every queued submission / cancel, step the engine once, hand out what finished.
        Returns whether the step was stalled (nothing could move)."""
        self.busy = True
        try:
            return self._turn_once()
        finally:
            self.busy = False

    def _turn_once(self) -> bool:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._handle(item)
        stalled = False
        if self._jobs:
            try:
                moved = self.engine.step()
            except Exception as e:           # noqa: BLE001  (no one job to blame: those in the step end)
                log.error("an engine step failed; the requests in it end (the server serves on)", exc_info=e)
                failure = Failure(f"internal error: the engine step failed: {type(e).__name__}: {e}", 500)
                for job in list(self._jobs):
                    self._job_failed(job, None, failure)
                self._update_metrics()
                return False
            for job in list(self._jobs):
                try:
                    if job.stream and job.kind == "sprint":
                        self._progress(job)
                    self._poll(job)
                except Exception as e:       # noqa: BLE001  (this job ends; the engine serves on)
                    self._job_failed(job, e)
            stalled = not moved and not any(j.op is not None and j.op.done for j in self._jobs)
        self._update_metrics()
        return stalled

    def _failed(self, e: Exception) -> None:
        """The engine failed: every open request learns why."""
        self.error = f"engine {'task' if self.on_loop else 'thread'} stopped: {type(e).__name__}: {e}"
        for job in self._jobs:
            job.channel.put(("error", self.error))

    def _handle(self, item) -> None:
        if item is None:
            return
        what, job = item
        if what == "submit" and isinstance(job, list):
            for j in job:
                self._handle(("submit", j))
        elif what == "submit":
            if job.finished:                  # cancelled before the engine took it
                return
            self._jobs.append(job)
            try:
                if job.kind == "plain":
                    job.op = self.engine.open(job.prompt)
                    job.seq = job.op.seq
                    job.sent = [0] * job.n
                    # admitted (a slot was free): generate / fork now, so the prompt is written
                    # in the same step as the first decode chunk (as forced tokens when short)
                    # instead of a step of its own
                    self._poll(job)
                else:
                    from sprint_jax.infer.orchestrator import Orchestrator
                    # events only for a streaming client, a log-prob layout or stop strings (a run
                    # emits them at every stage)
                    on_event = (lambda ev, job=job: self._event(job, ev)) \
                        if job.stream or job.logprobs or job.stop else None
                    job.steps = Orchestrator(self.engine, job.config, on_event=on_event).steps(job.query, job.mode)
                    self._driver.advance(job)
            except Exception as e:            # noqa: BLE001  (this job ends; the engine serves on)
                self._job_failed(job, e)
        elif what == "cancel" and not job.finished:
            job.cancelled = True
            self._release(job)
            self.metrics["cancelled"] += 1
            self._end(job, None)

    def _release(self, job: Job) -> None:
        """Drop whatever the job holds in the engine, now: its operation in flight, its rows and its
        slot (`Engine.abort`), and a SPRINT run's generator."""
        job.op = None
        if job.steps is not None:
            try:
                job.steps.close()            # a SPRINT run: its generator ends here
            except Exception:                # noqa: BLE001  (a run that fails to close is ended anyway)
                log.exception("closing a SPRINT run failed")
        if job.seq is not None and not job.seq.closed:
            self.engine.abort(job.seq)

    def _job_failed(self, job: Job, e: Exception | None, failure: Failure | None = None) -> None:
        """One job raised `e`: it ends with an error item (400: input it should have refused; 500:
        a bug, logged with its traceback) and releases what it held; the other jobs go on.
        `failure` instead of `e`: the item to send (already logged)."""
        if failure is None and isinstance(e, (UserError, EngineError)):
            failure = Failure(str(e), 400)
        elif failure is None:
            failure = Failure(f"internal error: {type(e).__name__}: {e}", 500)
            log.error("a request failed in the engine (the server serves on): %s", failure, exc_info=e)
        try:
            self._release(job)
        except Exception:                    # noqa: BLE001
            log.exception("releasing a failed request's slot failed")
        self._end(job, ("error", failure))

    def _event(self, job: Job, ev) -> None:
        if job.logprobs and ev.kind == "text":
            job.layout.append(_text_piece(job, ev))
        if job.stop and ev.kind == "text" and not job.stop_hit:
            # the committed text is the reply's beginning: a stop string in it is where the reply ends
            job.committed += ev.text
            job.stop_hit = cut_at_stop(job.committed, job.stop)[1]
        if job.stream:      # with log-probs, the layout so far: where the tokens of its text lie
            job.channel.put(("event", ev, list(job.layout) if job.logprobs else None))

    def _progress(self, job: Job) -> None:
        """A streaming SPRINT job: what its planner call (or its first executor) decoded so far,
        sent when it grew (before the run reacts to the call's end, so a finished call's last
        tokens arrive before the events that follow it)."""
        op = job.op
        if op is None or op.kind not in ("generate", "fork"):
            return
        toks = self.engine.progress(op)[0]
        key = [id(op), len(toks)]
        if toks and job.sent != key:
            job.sent = key
            lps, tops = _progress_logprobs(self.engine, op)[0] if job.logprobs else ([], None)
            job.channel.put(("progress", Progress(op.kind, list(toks), list(op.stops[0]), lps, tops)))

    def _end(self, job: Job, item) -> None:
        if job.finished:
            return
        job.finished = True
        if job in self._jobs:
            self._jobs.remove(job)
        if job.seq is not None and not job.seq.closed and job.seq.op is None:
            self.engine.close(job.seq)
        with self._lock:
            self._pending -= 1
        if item is not None:
            job.channel.put(item)

    def _poll(self, job: Job) -> None:
        if job.finished or job.op is None:
            return
        if job.kind == "sprint":
            self._driver.poll(job)
            return
        op = job.op
        if op.kind in ("generate", "fork") and job.stream:
            prog = self.engine.progress(op)
            if any(len(t) > s for t, s in zip(prog, job.sent)):
                job.channel.put(("tokens", prog, _progress_logprobs(self.engine, op) if job.logprobs else None))
                job.sent = [len(t) for t in prog]
        if not op.done:
            return
        if op.kind == "open":              # an EngineError here ends the job (`_job_failed`: a 400)
            self.prompt_tokens += len(job.prompt)
            top = {"top_logprobs": job.top_logprobs} if job.top_logprobs else {}
            if job.n == 1:
                job.op = self.engine.generate(job.seq, job.max_tokens, job.stop, job.sampling, **top)
            else:
                job.op = self.engine.fork(job.seq, [[]] * job.n, job.max_tokens, job.stop, job.sampling, **top)
            return
        gens = [op.result] if op.kind == "generate" else list(op.result)
        job.op = None
        self._end(job, ("done", gens))

    def _answered(self, job: Job, call, context, value) -> None:
        """RunDriver's on_answer: a run's prompt counts as prompt tokens once its sequence is
        open; with log-probs, each generate / branches result is logged in `job.layout` before
        the run sees it (`sprint_token_layout` places the tokens by it)."""
        if call.kind == "prefill":
            self.prompt_tokens += len(call.tokens)
        if job.logprobs and call.kind in ("generate", "branches"):
            job.layout.append(("call", value))

    @staticmethod
    def _stop_hit(job: Job):
        """RunDriver's interrupt: once the run's committed text holds a stop string of the request,
        the run ends at the call it asks for next (`RunEnded`: its record as a budget ends it,
        termination STOP_TERMINATION)."""
        if not job.stop_hit:
            return None
        from sprint_jax.infer.orchestrator import RunEnded
        return RunEnded(STOP_TERMINATION, "the reply reached a stop string of the request")

    def _update_metrics(self) -> None:
        e = self.engine
        now = time.perf_counter()
        total = e.stats["tokens"]
        self._tok_window.append((now, total))
        while len(self._tok_window) > 2 and now - self._tok_window[0][0] > 10.0:
            self._tok_window.popleft()
        t_old, n_old = self._tok_window[0]
        rate = (total - n_old) / (now - t_old) if now > t_old else 0.0
        waiting_jobs = sum(1 for j in self._jobs if j.op is not None and j.op.kind == "open" and not j.op.done
                           and j.seq is not None and j.seq.slot is None)
        self.metrics = dict(queue_depth=waiting_jobs + self._inbox.qsize(), active_rows=e.live_rows,
                            slots_used=e.max_seqs - e.free_slots, slots_total=e.max_seqs,
                            running_jobs=len(self._jobs), tokens_total=total, tokens_per_s=rate,
                            steps=e.stats["steps"], cancelled=self.metrics["cancelled"],
                            prefill_calls=e.stats["prefill_calls"], decode_calls=e.stats["decode_calls"],
                            **self._pool_metrics(now))

    def _pool_metrics(self, now: float | None = None) -> dict:
        """The KV pool's figures (`Engine.page_stats`: pages in all / free / held by live
        sequences / cached only, page size, prefix tokens taken from the cache, evicted pages) and
        the prompt tokens of this worker's opens: taken from the cache (the radix tree's hits since
        the worker started) and prefilled (the rest; a prompt's last token is always run, so a
        whole-prompt hit still prefills one). Renewed when idle or every POOL_STATS_EVERY_S."""
        if now is not None and (not self._jobs or now - self._pool_t >= POOL_STATS_EVERY_S):
            self._pool, self._pool_t, self._pool_prompt = self.engine.page_stats(), now, self.prompt_tokens
        cached = self._pool["prefix_hit_tokens"] - self._hits_before
        # the prompt tokens as of the same moment as the hits (both count at admission)
        return dict(self._pool, prompt_tokens=self._pool_prompt, prompt_tokens_cached=cached,
                    prompt_tokens_prefilled=self._pool_prompt - cached)
