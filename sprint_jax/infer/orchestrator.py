"""The SPRINT orchestrator: planner -> parallel executors -> sync, stage after stage (paper §10).

One stage (docs/design.md "The orchestrator and its accounting"):

1. The planner decodes on its own KV cache until `</Plan_i>` or `</Final Answer>`
   (`format.planner_stop_strings(i)`).
2. The prompts of `Plan_i` are read with `format.parse_plan`.
3. The planner state is forked after `</Plan_i>`: executor j starts from the forced opening
   (block gap + `<execution_i.j>`) and every executor of the stage decodes in one batched fork
   (`engine.fork`), each stopping at its own `</execution_i.j>`.
4. Sync (`config.join`, default from the layout): `reprefill` appends the openings and
   executions in prompt order and prefills only those tokens onto the planner cache
   (`engine.extend`); `merge` (the default for a merge-layout model) places each executor's KV after
   the fork point without running the model (`engine.merge`: only tokens a branch never computed
   run, in their branch), and the planner continues at fork + the longest executor. The two are
   different computations and coincide only when the stage has one executor. The planner
   continues with stage i+1.

The text the planner ends up holding is exactly `format.render_completion` of the trajectory when
the model writes canonical blocks (the forced openings and repairs use the gaps `render_completion`
writes), because training data is rendered that way.

Token boundaries. With a BPE tokenizer the tokens of forced text depend on the text
next to it (Qwen2 writes `>\n` as one token), so wherever forced text meets generated text
(fork, sync, repair) the orchestrator re-tokenizes a small window the way the model's training
layout did (`config.layout`, written by `train` into the export) and rolls the state back to the
longest common token prefix before prefilling the rest (`engine.truncate` + `extend`):
  flat  one string: tokenize(query) + tokenize(completion) (train/data.py `layout_flat`). The
        window starts a few tokens before the last boundary; after a sync the block gap is
        forced too, since a flat model saw `</execution_i.j>` and the gap as one token.
  trie  the pieces of train/data.py `split_pieces`, each tokenized on its own: every planner call
        (cut after its stop), each forced opening, each execution body. The planner is settled
        after every call, so the window is always the current piece.
So after every fork and every sync, a model that writes what it was trained on holds exactly
its training tokens: the flat prefix, or the trie unit's context.

Formats (`config.format`, from the model's training): `sprint` (above) or `threadweaver`
(`sprint_jax.threadweaver`, one level of parallelism): a stage is one `<Parallel>` block. The main
sequence decodes to `</Outlines>`; its last block's outlines are the prompts; thread j is forced
open with `BLOCK_GAP + <Thread>j:` and stops at `</Thread>` (a repair adds `</Thread>` alone); the
sync appends the threads in order, then `BLOCK_GAP + </Parallel>` (+ `BLOCK_GAP` for a flat model),
which is `threadweaver.render_completion`'s text. The answer follows `</think>` and runs to EOS, so
a call that ends (EOS) after `</think>` is the final one (a call cut by its limit is not). There is
no implicit prompt: a block with no outline is closed with no thread (reported). Accounting is the
same (a block's planner tokens + its longest thread). Both joins: a merge join places the threads
side by side from the fork, then prefills the forced `BLOCK_GAP + </Parallel>` as planner text past
the longest thread (train/data.py `layout_merge` puts it there).
The per-format strings and parsing sit in one grammar object per run (`_SprintGrammar`,
`_ThreadWeaverGrammar`).

Modes:
  parallel    executors of a stage decode together over a shared-prefix fork (`mode="shared"`).
  serial      the same executors one after another on the planner's cache (`mode="serial"`):
              under the same sampling it yields the identical trajectory, only slower.
  sequential  plain decoding, no orchestration (the RFT baseline, or a SPRINT model run as an
              ordinary model): one call until `</Final Answer>` / EOS / the budget.

Policies for malformed output (the loop never raises on model output; every policy is recorded
as a problem string, and every run ends with one of TERMINATIONS):
  * planner stops at EOS or at its token limit without closing its plan or answer: the run ends
    (`eos`, `planner_token_limit`, or the budget that bound the call).
  * plan problems (unclosed prompt, prompts out of order, duplicate numbers, foreign tags):
    reported from `parse_plan`; the prompts are taken in order of appearance and executor j gets
    `<execution_i.j>` for the j-th prompt, whatever number the model wrote.
  * more prompts than `min(config.max_prompts, engine.max_branches)`: the first ones run, the rest
    get no execution (the planner context then holds prompts without executions).
  * a plan with no prompt: the planner keeps the turn. If its next output opens
    `<execution_i.1>` (the paper's implicit prompt) and closes it, that is stage i's single
    execution, decoded inline on the planner cache; otherwise the output is the next stage's plan.
  * an executor that runs into its token limit or ends with EOS: its text is kept (EOS dropped)
    and the sync closes it with the canonical `</execution_i.j>` so the planner's context stays
    well-formed; the forced tags are prefilled, not counted as generated tokens.
  * tags inside an execution: kept as written and reported by the final parse.
  * the final answer is the `<Final Answer>` of the planner call that closed it (an executor
    writing one does not end the run).

Budgets (OrchestratorConfig): stages, prompts per plan, tokens per planner call and per branch,
total generated tokens, wall clock (checked between engine calls, so a run may overrun the limit
by one call). max_stages counts plans whose executors run; after the last one the planner may
still answer, and a further plan ends the run (`max_stages`). Per-call limits are clipped so no call can exceed the total budget or the engine's
capacities; a stage's branches share the remaining budget equally.

Accounting (docs/design.md "The orchestrator and its accounting"): sequential_tokens = Σ_stages
(planner tokens + max executor tokens), plus the final planner call; total_tokens = Σ planner + Σ
executors. Counted tokens are generated tokens (decode steps); forced openings and repairs are
prefilled in one pass and not counted. A sequential run has sequential_tokens == total_tokens ==
generated tokens.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from sprint_jax import format as fmt
from sprint_jax import threadweaver as tw
from sprint_jax.infer.drive import EngineCall, Run, RunDriver, submit_call
from sprint_jax.infer.requests import EngineError, common_prefix
from sprint_jax.infer.sampling import Sampling, user_seed

MODES = ("parallel", "serial", "sequential")
JOINS = ("reprefill", "merge")
FORMATS = tw.FORMATS            # the model's tag format: sprint (sprint_jax.format) | threadweaver
_BRANCH_MODE = {"parallel": "shared", "serial": "serial"}

TERMINATIONS = {
    "final_answer": "the planner closed </Final Answer> (threadweaver: the model ended (EOS) after </think>)",
    "eos": "the model ended its output (EOS) without a final answer",
    "planner_token_limit": "a planner call reached max_planner_tokens without closing its plan or answer "
                           "(threadweaver: its outlines, or its answer with EOS)",
    "token_budget": "the total generated-token budget (max_total_tokens) was used up",
    "max_stages": "max_stages plans (threadweaver: parallel blocks) ran and the planner wrote another "
                  "instead of answering",
    "context_full": "the planner context reached the engine's max_seq_len (or a branch its capacity)",
    "wall_clock": "the wall-clock limit (time_limit_s) passed",
    "malformed": "the planner stopped at a tag it may not write there (e.g. closed an execution it never opened), "
                 "or the run needed text the tokenizer cannot encode (message in problems)",
    "engine_error": "the engine refused a request (message in problems)",
}


_FLAT_MARGIN = 8                # flat: tokens re-tokenized before the last boundary


def execution_opening(i: int, j: int) -> str:
    """The forced start of executor j of stage i: what render_completion writes before its content."""
    return fmt.BLOCK_GAP + fmt.execution_open(i, j)


# ---------------------------------------------------------------------------------------------
# Tag formats: what the stage loop writes, stops at and parses (one grammar chosen per run)
# ---------------------------------------------------------------------------------------------
class _SprintGrammar:
    """SPRINT's tags (sprint_jax.format): numbered plans, prompts and executions, a closed final
    answer, and the implicit prompt."""
    implicit_prompts = True          # a prompt-less plan may get one inline execution
    strips_eos = False               # the answer has a closing tag: an EOS after it is not read
    unit = "execution"
    sequential_stops = [fmt.FINAL_CLOSE]
    unfinished = f"without {fmt.FINAL_CLOSE}"

    def planner_stops(self, i: int) -> list[str]:
        return fmt.planner_stop_strings(i)

    def plan_close(self, i: int) -> str:
        return fmt.plan_close(i)

    def awaited(self, i: int) -> str:
        return f"{fmt.plan_close(i)} or {fmt.FINAL_CLOSE}"

    def is_final(self, g, which: str | None, text: str) -> bool:
        """Whether a planner call (text: its output) wrote the final answer."""
        return which == fmt.FINAL_CLOSE

    def sequential_final(self, g, text: str) -> bool:
        return g.stop_reason == "stop"

    def answer(self, text: str) -> str | None:
        return fmt.parse_completion(text)[0].final_answer

    def read_plan(self, g, piece: str, i: int, context: Callable[[], str]) -> tuple[str, list[str], list[str]] | None:
        """(free plan text, prompts, problems) of a planner call stopped at its plan's close."""
        pieces, prompts, problems = fmt.parse_plan(g.text, i)
        return " ".join(p for p in pieces if isinstance(p, str)), prompts, problems

    def opening(self, i: int, j: int) -> str:
        return execution_opening(i, j)

    def close(self, i: int, j: int) -> str:
        return fmt.execution_close(i, j)

    def repair(self, text: str, close: str) -> str:
        return ("" if (not text or text[-1].isspace()) else fmt.CLOSE_GAP) + close

    def join_tail(self, trie: bool) -> str:
        """Forced after the last execution: a flat model saw its close tag and the next block's
        gap together."""
        return "" if trie else fmt.BLOCK_GAP

    def final_parse(self, text: str) -> tuple[bool, str | None, list[str]]:
        """(has stages, final answer, problems) of a whole completion."""
        traj, problems = fmt.parse_completion(text)
        return bool(traj.stages), traj.final_answer, problems


class _ThreadWeaverGrammar:
    """ThreadWeaver's tags (sprint_jax.threadweaver): a stage is one `<Parallel>` block, its
    outlines are the prompts, its threads the executions; the answer follows `</think>` and runs
    to EOS. No implicit prompt; a block with no outline is closed with no thread."""
    implicit_prompts = False
    strips_eos = True                # the answer runs to EOS: the EOS token is not part of the text
    unit = "thread"
    sequential_stops: list[str] = []
    unfinished = f"without ending (EOS) after {tw.THINK_CLOSE}"

    def planner_stops(self, i: int) -> list[str]:
        return tw.sequential_stop_strings()

    def plan_close(self, i: int) -> str:
        return tw.OUTLINES_CLOSE

    def awaited(self, i: int) -> str:
        return f"{tw.OUTLINES_CLOSE} or {tw.THINK_CLOSE} and EOS"

    def is_final(self, g, which: str | None, text: str) -> bool:
        return g.stop_reason == "eos" and tw.THINK_CLOSE in text

    def sequential_final(self, g, text: str) -> bool:
        return self.is_final(g, None, text)

    def answer(self, text: str) -> str | None:
        return tw.parse_completion(text)[0].answer

    def read_plan(self, g, piece: str, i: int, context: Callable[[], str]) -> tuple[str, list[str], list[str]] | None:
        """The block whose outlines the call closed, read in the completion so far (`context()`,
        which ends with this call's output up to `</Outlines>`): (its text before, its outlines,
        the problems the call added); None when the call opened no new block."""
        full = context()
        prior = full[:len(full) - len(piece)]
        before, old = tw.parse_completion(prior)
        traj, _ = tw.parse_completion(full)
        if len(traj.blocks) != len(before.blocks) + 1:
            return None
        block = traj.blocks[-1]
        # the block closed as the orchestrator will close it, so that only the call's own faults remain
        closed = full + "".join(fmt.BLOCK_GAP + tw.thread_opening(j) + tw.THREAD_CLOSE
                                for j in range(1, len(block.outlines) + 1)) + self.join_tail(True)
        _, problems = tw.parse_completion(closed)
        return block.before, block.outlines, [p for p in problems if p not in old]

    def opening(self, i: int, j: int) -> str:
        return fmt.BLOCK_GAP + tw.thread_opening(j)

    def close(self, i: int, j: int) -> str:
        return tw.THREAD_CLOSE

    def repair(self, text: str, close: str) -> str:
        return close                 # `<Thread>j: text</Thread>`: no gap before the close tag

    def join_tail(self, trie: bool) -> str:
        """Forced after the last thread: the block's close after a gap, as `tw.render` writes it; a
        trie model's next main-sequence call writes the gap after it, a flat one is handed it (it
        saw the close and the gap together)."""
        return fmt.BLOCK_GAP + tw.PARALLEL_CLOSE + ("" if trie else fmt.BLOCK_GAP)

    def final_parse(self, text: str) -> tuple[bool, str | None, list[str]]:
        traj, problems = tw.parse_completion(text)
        return bool(traj.blocks), traj.answer, problems


_GRAMMARS = {"sprint": _SprintGrammar(), "threadweaver": _ThreadWeaverGrammar()}


# ---------------------------------------------------------------------------------------------
# Config and records
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OrchestratorConfig:
    """Budgets and sampling of one run (loadable with sprint_jax.config.load_config)."""
    max_stages: int = 12                 # plans whose executors run; the planner may still answer after
    max_prompts: int = 8                 # executors per stage (also capped by engine.max_branches)
    max_planner_tokens: int = 1024       # generated tokens per planner call
    max_branch_tokens: int = 1024        # generated tokens per executor
    max_total_tokens: int = 16384        # Σ planner + Σ executor tokens of the whole run
    time_limit_s: float | None = None    # wall clock per run, checked between engine calls
    temperature: float = 0.0             # 0 = greedy
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # 1 = off
    seed: int = 0                        # each engine call gets its own seed derived from this
    layout: fmt.Layout = "flat"          # the model's training layout: token convention at boundaries
    join: str | None = None              # reprefill | merge; None: merge for a merge-layout model, else reprefill
    format: tw.Format = "sprint"         # the model's tag format: sprint | threadweaver (from its training)

    def __post_init__(self) -> None:
        for name in ("max_stages", "max_prompts", "max_planner_tokens", "max_branch_tokens", "max_total_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.layout not in fmt.LAYOUTS:
            raise ValueError(f"layout must be one of {list(fmt.LAYOUTS)}, got {self.layout!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.format!r}")
        if self.join is not None and self.join not in JOINS:
            raise ValueError(f"join must be one of {list(JOINS)} or null, got {self.join!r}")
        if self.resolved_join == "merge" and self.layout not in fmt.PIECEWISE_LAYOUTS:
            raise ValueError("join='merge' needs a model trained with the trie or merge layout (its pieces "
                             "are tokenized on their own); a flat model re-prefills (join='reprefill')")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0 or null, got {self.time_limit_s!r}")
        # the sampling fields, checked where a bad one would otherwise fail inside the engine; the
        # seed in the range where each one gives its own calls' seeds (derived modulo 2^31)
        Sampling(self.temperature, self.top_k, self.top_p, user_seed(self.seed))

    @property
    def resolved_join(self) -> str:
        """The join that runs: `join`, or the one the training layout implies."""
        return self.join or ("merge" if self.layout == "merge" else "reprefill")

    def to_json(self) -> dict[str, Any]:
        """The fields as a record stores them. `format` is left out when it is the default, sprint,
        so SPRINT records (and the eval --out resume check, which compares them) read as before."""
        d = dataclasses.asdict(self)
        if self.format == "sprint":
            d.pop("format")
        return d

    def sampling(self, call: int) -> Sampling:
        """Sampling for the call-th engine call: branches of one call fold in their index on top."""
        return Sampling(self.temperature, self.top_k, self.top_p, (int(self.seed) * 1_000_003 + call) % (2 ** 31))


@dataclasses.dataclass
class ExecutionRecord:
    index: int                    # j of <execution_i.j>
    prompt: str
    text: str                     # generated text (EOS dropped), up to and including its close tag
    tokens: int                   # generated tokens (EOS included: it was decoded)
    stop_reason: str              # stop | eos | length
    forced_tokens: int            # the opening (and repair) tokens prefilled for it
    repaired: bool = False        # the sync added the close tag
    logprobs: list[float] = dataclasses.field(default_factory=list)   # per generated token (Generation.logprobs)


@dataclasses.dataclass
class StageRecord:
    index: int                    # i of <Plan_i>
    planner_text: str             # the planner call's output, as generated
    planner_tokens: int
    planner_stop: str             # which stop string ended the call, or eos / length
    plan: str = ""                # free planning text (prompts left out)
    prompts: list[str] = dataclasses.field(default_factory=list)
    executions: list[ExecutionRecord] = dataclasses.field(default_factory=list)
    executor_mode: str = "none"   # shared | serial | inline (implicit prompt) | none
    join: str = ""                # how the executors joined the planner: reprefill | merge ("" none ran)
    sync_tokens: int = 0          # tokens the sync ran through the model (merge: only never-computed ones)
    planner_s: float = 0.0
    executors_s: float = 0.0
    sync_s: float = 0.0
    branch_cache_bytes: int | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    planner_logprobs: list[float] = dataclasses.field(default_factory=list)   # per planner token generated

    @property
    def executor_tokens(self) -> list[int]:
        return [e.tokens for e in self.executions]

    @property
    def sequential_tokens(self) -> int:
        return self.planner_tokens + max(self.executor_tokens, default=0)

    @property
    def total_tokens(self) -> int:
        return self.planner_tokens + sum(self.executor_tokens)


@dataclasses.dataclass
class RunRecord:
    """Everything one run did; `to_json()` is what eval writes per problem."""
    query: str
    mode: str
    config: dict
    join: str = ""                # the join of this run's stages: reprefill | merge
    prompt_tokens: int = 0
    stages: list[StageRecord] = dataclasses.field(default_factory=list)
    final_text: str = ""          # the planner call that wrote the answer (sequential: everything)
    final_tokens: int = 0
    final_s: float = 0.0
    final_answer: str | None = None
    final_logprobs: list[float] = dataclasses.field(default_factory=list)   # per token of the final call
    text: str = ""                # the whole completion (the planner's context after the prompt)
    termination: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    @property
    def sequential_tokens(self) -> int:
        return sum(s.sequential_tokens for s in self.stages) + self.final_tokens

    @property
    def total_tokens(self) -> int:
        return sum(s.total_tokens for s in self.stages) + self.final_tokens

    @property
    def format_valid(self) -> bool:
        """No problem at all. A sequential run with no stage (an RFT trace) is valid when it has a
        final answer: untagged reasoning before it is that format, not a fault."""
        if self.mode == "sequential" and not self.stages:
            return self.final_answer is not None and self.termination == "final_answer"
        return not self.problems and self.termination == "final_answer"

    def to_json(self) -> dict[str, Any]:
        """The record as eval writes it, without the per-token log-probs (for in-process readers
        such as RL: one float per token would double a records file, and their last bits depend on
        the batch the call shared, where the records of a run are otherwise reproducible)."""
        d = dataclasses.asdict(self)
        d.pop("final_logprobs")
        for sd, s in zip(d["stages"], self.stages):
            sd.pop("planner_logprobs")
            for e in sd["executions"]:
                e.pop("logprobs")
            sd["sequential_tokens"] = s.sequential_tokens
            sd["total_tokens"] = s.total_tokens
        d.update(sequential_tokens=self.sequential_tokens, total_tokens=self.total_tokens,
                 format_valid=self.format_valid, n_stages=len(self.stages))
        return d


@dataclasses.dataclass
class Event:
    """A live-display notification. kinds: start, planner, executors_start, executors, sync,
    implicit_execution, final, end, and text. `stage` is the StageRecord concerned (None for
    start/final/end).

    A `text` event commits the next piece of the completion, in order: a planner call's output
    once the run goes on from it, then (after the sync) each execution as the planner's context
    holds it (opening, body, repair; `executor` = j), then any gap the layout adds. Their
    concatenation is a prefix of the final `record.text`; the rest is the last planner call's
    output (or whatever the run ended on)."""
    kind: str
    record: RunRecord
    stage: StageRecord | None = None
    text: str = ""
    executor: int | None = None


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
class _Stop(Exception):
    """Ends the loop with a termination reason (internal control flow, never escapes run())."""

    def __init__(self, reason: str, problem: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.problem = problem


class RunEnded(_Stop):
    """Thrown into a run's `steps` generator in place of a call's answer: the run ends there, as a
    budget ends it, and returns its record with termination `reason` (a driver's own limit)."""


def _which_stop(text: str, stops: list[str]) -> str | None:
    found = [(text.find(s) + len(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


class Orchestrator:
    """Runs SPRINT stages over an engine (`drive.RunDriver` answers the stage loop's calls). Only the
    engine's public interface is used: encode, decode_text, open, extend, truncate, generate, fork,
    merge, close, step, max_seqs, max_seq_len, max_branches, max_branch_tokens (and flush_sync,
    last_join_tokens, last_branch_stats when present), so a test double can stand in."""

    def __init__(self, engine: Any, config: OrchestratorConfig | None = None,
                 on_event: Callable[[Event], None] | None = None):
        self.engine = engine
        self.config = config or OrchestratorConfig()
        self.on_event = on_event
        self._g = _GRAMMARS[self.config.format]

    # -- helpers ------------------------------------------------------------------------------
    def _emit(self, kind: str, record: RunRecord, stage: StageRecord | None = None, text: str = "",
              executor: int | None = None) -> None:
        if self.on_event is not None:
            self.on_event(Event(kind, record, stage, text, executor))

    def _check_clock(self, t0: float) -> None:
        limit = self.config.time_limit_s
        if limit is not None and time.perf_counter() - t0 > limit:
            raise _Stop("wall_clock", f"wall-clock limit {limit} s passed")

    def _planner_limit(self, state, used: int) -> tuple[int, str]:
        """Tokens the next planner call may generate, and the termination if it runs out."""
        cfg = self.config
        options = [(cfg.max_total_tokens - used, "token_budget"),
                    (self.engine.max_seq_len - len(state.tokens), "context_full"),
                    (cfg.max_planner_tokens, "planner_token_limit")]
        limit, reason = min(options, key=lambda o: o[0])
        if limit < 1:
            raise _Stop(reason, f"no room for another planner call ({reason})")
        return limit, reason

    def _text_of(self, tokens: list[int]) -> str:
        return self.engine.decode_text(tokens) if tokens else ""

    def _said(self, g) -> str:
        """A call's text as the completion keeps it: without the EOS text where the format's answer
        runs to EOS (an engine that decodes EOS to text, such as a test double, would add it)."""
        return self._text_of(g.tokens[:-1]) if self._g.strips_eos and g.stop_reason == "eos" else g.text

    def _context(self, state, cut: int) -> str:
        """The completion so far (the planner state's text after the query), less its last `cut`
        characters (decoded past a stop)."""
        text = self._text_of(list(state.tokens)[self._prompt_len:])
        return text[:len(text) - cut]

    def _completion_tokens(self, state) -> list[int]:
        tokens = list(state.tokens)[self._prompt_len:]
        if self._g.strips_eos and tokens and tokens[-1] in set(getattr(self.engine, "eos_token_ids", ())):
            tokens = tokens[:-1]
        return tokens

    # -- token boundaries (see the module docstring) --------------------------------------------
    def _window(self, state, cut: int) -> tuple[int, str]:
        """(w, head): a token index of the planner state where the layout's tokenization cuts, and
        the state's text from there less its last `cut` characters (decoded past a stop).

        trie: the mark (the current piece starts there). flat: _FLAT_MARGIN tokens before the
        mark, kept when re-tokenizing its text gives back the token at w (so w is a cut the
        tokenizer makes), else the whole completion."""
        tokens = list(state.tokens)
        starts = [self._mark]
        if self.config.layout == "flat":
            starts = sorted({max(self._prompt_len, self._mark - _FLAT_MARGIN), self._prompt_len}, reverse=True)
        for w in starts:
            text = self._text_of(tokens[w:])
            head = text[:len(text) - cut]
            if w in (self._mark, self._prompt_len) or self._encode(head)[:1] == tokens[w:w + 1]:
                break
        return w, head

    def _encode(self, text: str) -> list[int]:
        """The tokens of text the run writes or re-tokenizes; text the tokenizer cannot encode (a
        forced tag numbered past its vocabulary, sampled text a greedy vocabulary cannot re-split)
        ends the run as malformed, with the text named in its problems."""
        try:
            return self.engine.encode(text)
        except ValueError as e:
            raise _Stop("malformed", f"the tokenizer cannot encode {text[:80]!r} ({e})") from None

    def _canonical(self, pieces: list[str]) -> list[int]:
        """The tokens the training layout gives consecutive text pieces (see the module docstring)."""
        if self.config.layout == "flat":
            return self._encode("".join(pieces))
        return [t for p in pieces if p for t in self._encode(p)]

    def _rejoin(self, state, w: int, tails: list[list[str]]) -> tuple[int, list[list[int]]]:
        """Where the state's tokens from w stop agreeing with each canonical window (w's text is
        tails[k][0..]), and per window the tokens to force after that point."""
        have = list(state.tokens)[w:]
        windows = [self._canonical(t) for t in tails]
        keep = w + min(common_prefix(have, c) for c in windows)
        return keep, [c[keep - w:] for c in windows]

    def _settle(self, state, w: int, pieces: list[str]):
        """Make the state's tokens from w the canonical tokens of `pieces`; the mark moves to the end."""
        keep, (tail,) = self._rejoin(state, w, [pieces])
        if keep + len(tail) >= self.engine.max_seq_len:
            raise _Stop("context_full", f"adding {len(tail)} tokens would fill the planner context "
                                        f"(max_seq_len={self.engine.max_seq_len})")
        if keep < len(state.tokens):
            state = yield EngineCall("truncate", state, n=keep)
        if tail:
            state = yield EngineCall("extend", state, tokens=tail)
        self._mark = len(state.tokens)
        return state, len(tail)

    # -- entry --------------------------------------------------------------------------------
    def run(self, query: str, mode: str = "parallel") -> RunRecord:
        """One run of `query` (the text the model sees before its completion): `run_many` at
        concurrency 1. Model output never raises; a bad mode, an empty query, or a query the
        tokenizer cannot encode does."""
        return run_many(self.engine, [query], mode, self.config, concurrency=1, on_event=self.on_event)[0]

    def steps(self, query: str, mode: str = "parallel"):
        """The run as a generator: it yields `EngineCall`s, receives each call's result (or has the
        engine's EngineError thrown in), and returns the RunRecord. `run_many` answers the calls."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not query:
            raise ValueError("the query is empty")
        join = self.config.resolved_join
        if join == "merge" and mode == "serial":
            raise ValueError("mode 'serial' runs executors on the planner's own cache, so there are no "
                             "branches to merge; use mode 'parallel' or join='reprefill'")
        record = RunRecord(query=query, mode=mode, config=self.config.to_json(),
                           join=join if mode != "sequential" else "")
        t0 = time.perf_counter()
        self._emit("start", record)
        state = None
        prompt_ids = self.engine.encode(query)
        record.prompt_tokens = len(prompt_ids)
        try:
            if not prompt_ids:
                raise _Stop("context_full", "the query encodes to no tokens")
            if len(prompt_ids) >= self.engine.max_seq_len:
                raise _Stop("context_full", f"the query has {len(prompt_ids)} tokens; max_seq_len is "
                                            f"{self.engine.max_seq_len}")
            state = yield EngineCall("prefill", tokens=prompt_ids)
            self._prompt_len = self._mark = len(prompt_ids)
            if mode == "sequential":
                yield from self._sequential(state, record)
            else:
                yield from self._stages(state, record, t0, _BRANCH_MODE[mode])
        except _Stop as stop:
            record.termination = stop.reason
            if stop.problem:
                record.problems.append(stop.problem)
        except EngineError as e:
            record.termination = "engine_error"
            record.problems.append(f"engine error: {e}")
        if state is not None:
            record.text = self._text_of(self._completion_tokens(state))
        self._finish(record)
        record.wall_s = time.perf_counter() - t0
        self._emit("end", record)
        return record

    def _finish(self, record: RunRecord) -> None:
        """The final parse of the whole completion: the format problems of the model's output
        (a plan's problems found by parse_plan stay in its StageRecord; this parse reports them
        again for the run, with positions in the whole text)."""
        staged, answer, problems = self._g.final_parse(record.text)
        if record.mode == "sequential":
            record.final_answer = answer
            if not staged and not self._g.strips_eos:   # an RFT trace: untagged reasoning, then the answer block
                return
        record.problems += [f"format: {p}" for p in problems]

    # -- sequential ---------------------------------------------------------------------------
    def _sequential(self, state, record: RunRecord) -> None:
        """One call: the per-call planner limit does not apply, the total budget does."""
        limit, reason = min((self.config.max_total_tokens, "token_budget"),
                            (self.engine.max_seq_len - len(state.tokens), "context_full"), key=lambda o: o[0])
        t = time.perf_counter()
        g = yield EngineCall("generate", state, limits=[limit], stops=[list(self._g.sequential_stops)],
                             sampling=self.config.sampling(0))
        record.final_s = time.perf_counter() - t
        record.final_tokens = len(g.tokens)
        record.final_text = self._said(g)
        record.final_logprobs = _logprobs(g)
        self._emit("final", record, text=record.final_text)
        if self._g.sequential_final(g, record.final_text):
            record.termination = "final_answer"
        elif g.stop_reason == "eos":
            record.termination = "eos"
        else:
            record.termination = reason
            record.problems.append(f"the output reached {limit} tokens {self._g.unfinished}")

    # -- SPRINT stages ------------------------------------------------------------------------
    def _stages(self, state, record: RunRecord, t0: float, branch_mode: str) -> None:
        """The stage loop: a planner call, then by what it stopped at the final answer, an inline
        execution of a prompt-less plan, or a plan whose executors fork, decode and join."""
        cfg = self.config
        tally = _Tally()
        i = 1
        implicit: StageRecord | None = None   # a prompt-less plan that may get <execution_i.1>
        while True:
            self._check_clock(t0)
            limit, limit_reason = self._planner_limit(state, tally.used)
            stops = self._g.planner_stops(i)
            if implicit is not None:
                stops = stops + [fmt.execution_close(implicit.index, 1)]
            t = time.perf_counter()
            g = yield EngineCall("generate", state, limits=[limit], stops=[stops], sampling=cfg.sampling(tally.call))
            dt = time.perf_counter() - t
            tally.call += 1
            tally.used += len(g.tokens)
            which = _which_stop(g.text, stops) if g.stop_reason == "stop" else None
            cut = len(g.text) - _stop_end(g.text, which) if which else 0   # characters decoded past the stop
            # the call's text as the context keeps it: a piecewise layout settles it without the
            # characters past the stop; a flat one keeps them unless a fork or sync re-tokenizes
            piece = g.text[:len(g.text) - cut]
            if implicit is not None:
                inline, implicit = implicit, None
                if self._is_inline_execution(inline, g, which):
                    state = yield from self._inline_execution(state, record, inline, g, dt, cut, piece)
                    continue
            if self._g.is_final(g, which, self._said(g)):
                self._final(record, g, dt)
            stage = self._plan(record, i, g, which, dt, limit, limit_reason, piece, state)
            w, head = self._window(state, cut)
            if not stage.prompts and not self._g.implicit_prompts:
                state = yield from self._close_empty(state, record, stage, w, head, piece)
            elif not stage.prompts:
                if self._trie:   # the plan is a piece of its own; the planner's next call starts a new one
                    state, _ = yield from self._settle(state, w, [head])
                self._emit("text", record, stage, piece if self._trie else g.text)
                implicit = stage
            else:
                sync, openings = yield from self._fork(state, record, stage, w, head, piece, tally, t0, branch_mode)
                state = yield from self._join(state, record, stage, w, sync, openings, t0)
            i += 1

    def _close_empty(self, state, record: RunRecord, stage: StageRecord, w: int, head: str, piece: str):
        """A block with no outline (a format without implicit prompts): closed as it is, no thread runs."""
        tail = self._g.join_tail(self._trie)
        _problem(record, stage, f"stage {stage.index}: a block with no prompt; closed with {tail.strip()!r}, "
                                f"no {self._g.unit} ran")
        t = time.perf_counter()
        state, stage.sync_tokens = yield from self._settle(state, w, [head, tail])
        stage.sync_s = time.perf_counter() - t
        self._emit("text", record, stage, piece)
        self._emit("text", record, stage, tail)
        return state

    @property
    def _trie(self) -> bool:
        """trie and merge layouts: pieces are tokenized on their own."""
        return self.config.layout in fmt.PIECEWISE_LAYOUTS

    @staticmethod
    def _is_inline_execution(stage: StageRecord, g, which: str | None) -> bool:
        """Whether the call after a prompt-less plan was its single inline execution: it opens with
        <execution_i.1> and stops at its close."""
        return (fmt.find_tags(g.text)[:1] == [fmt.execution_open(stage.index, 1)]
                and which == fmt.execution_close(stage.index, 1))

    def _inline_execution(self, state, record: RunRecord, stage: StageRecord, g, dt: float, cut: int, piece: str):
        """Record the planner's own call as the prompt-less plan's execution 1; the state after."""
        stage.executions.append(ExecutionRecord(1, stage.plan, g.text, len(g.tokens), "stop", 0, logprobs=_logprobs(g)))
        stage.executor_mode = "inline"
        stage.executors_s = dt
        if self._trie:   # trained as two pieces: the opening, then the body
            w, head = self._window(state, cut)
            opening = fmt.execution_open(stage.index, 1)
            at = head.index(opening) + len(opening)
            state, _ = yield from self._settle(state, w, [head[:at], head[at:]])
        self._emit("text", record, stage, piece if self._trie else g.text)
        self._emit("implicit_execution", record, stage, g.text)
        return state

    def _final(self, record: RunRecord, g, dt: float) -> None:
        """The planner closed the final answer: record it and end the run."""
        record.final_text, record.final_tokens, record.final_s = self._said(g), len(g.tokens), dt
        record.final_logprobs = _logprobs(g)
        record.final_answer = self._g.answer(record.final_text)
        self._emit("final", record, text=record.final_text)
        if record.final_answer is None:
            raise _Stop("malformed", f"the planner closed {fmt.FINAL_CLOSE} without opening it")
        raise _Stop("final_answer")

    def _plan(self, record: RunRecord, i: int, g, which: str | None, dt: float, limit: int,
              limit_reason: str, piece: str, state) -> StageRecord:
        """Stage i's record from a planner call that should have closed its plan; ends the run when
        it did not, or when the stage is past max_stages."""
        stage = StageRecord(i, g.text, len(g.tokens), which or g.stop_reason, planner_s=dt,
                            planner_logprobs=_logprobs(g))
        record.stages.append(stage)
        plan = None
        if which == self._g.plan_close(i):
            plan = self._g.read_plan(g, piece, i, lambda: self._context(state, len(g.text) - len(piece)))
        if plan is None:
            self._emit("planner", record, stage, g.text)
            if g.stop_reason == "eos":
                raise _Stop("eos", f"stage {i}: the planner ended (EOS) without {self._g.awaited(i)}")
            if g.stop_reason == "length":
                raise _Stop(limit_reason, f"stage {i}: the planner call reached {limit} tokens without "
                                          f"{self._g.awaited(i)}")
            raise _Stop("malformed", f"stage {i}: the planner stopped at {which!r} with no matching opening")
        stage.plan, prompts, problems = plan
        stage.prompts = prompts
        stage.problems += [f"stage {i} plan: {p}" for p in problems]
        self._emit("planner", record, stage, g.text)
        if i > self.config.max_stages:
            raise _Stop("max_stages", f"stage {i}: a plan beyond max_stages={self.config.max_stages}; not run")
        return stage

    def _branch_limits(self, stage: StageRecord, openings: list[list[int]], keep: int, used: int) -> list[int]:
        """Tokens each executor may generate: its share of the run's budget, the per-call cap, and
        the room the engine has for a branch and for the planner's context."""
        cfg, k = self.config, len(openings)
        room = cfg.max_total_tokens - used
        if room // k < 1:
            raise _Stop("token_budget", f"stage {stage.index}: no token budget left for {k} executors")
        limits = []
        for o in openings:
            m = min(cfg.max_branch_tokens, room // k, self.engine.max_branch_tokens - len(o) - 1,
                    self.engine.max_seq_len - keep - len(o))
            if m < 1:
                raise _Stop("context_full", f"stage {stage.index}: no room for executor tokens")
            limits.append(m)
        return limits

    def _fork(self, state, record: RunRecord, stage: StageRecord, w: int, head: str, piece: str, tally: "_Tally",
              t0: float, branch_mode: str):
        """Run the stage's executors in one fork; returns the sync pieces (the plan's text, then per
        executor its opening and its closed body) and each executor's forced opening tokens."""
        cfg, i = self.config, stage.index
        cap = min(cfg.max_prompts, self.engine.max_branches)
        if len(stage.prompts) > cap:
            _problem(record, stage, f"stage {i}: {len(stage.prompts)} prompts; only the first {cap} run "
                                    f"(max_prompts={cfg.max_prompts}, engine max_branches={self.engine.max_branches})")
        run_prompts = stage.prompts[:cap]
        k = len(run_prompts)
        # fork: roll the planner back to where every executor's canonical context agrees with it
        keep, openings = self._rejoin(state, w, [[head, self._g.opening(i, j)] for j in range(1, k + 1)])
        limits = self._branch_limits(stage, openings, keep, tally.used)
        self._check_clock(t0)
        self._emit("executors_start", record, stage, f"{k} executor(s), {branch_mode} fork")
        t = time.perf_counter()
        if keep < len(state.tokens):
            state = yield EngineCall("truncate", state, n=keep)
        self._emit("text", record, stage, piece)
        gens = yield EngineCall("branches", state, prefixes=openings, limits=limits,
                                stops=[[self._g.close(i, j)] for j in range(1, k + 1)],
                                sampling=cfg.sampling(tally.call), mode=branch_mode,
                                join=cfg.resolved_join == "merge")
        stage.executors_s = time.perf_counter() - t
        stats = getattr(self.engine, "last_branch_stats", None)
        stage.branch_cache_bytes = getattr(stats, "cache_bytes", None)
        stage.executor_mode = branch_mode
        tally.call += 1
        sync = [head]
        for j, (prompt, o, gen, m) in enumerate(zip(run_prompts, openings, gens, limits), start=1):
            tally.used += len(gen.tokens)
            text, repair = self._closed_body(record, stage, j, gen, m)
            sync += [self._g.opening(i, j), text + repair]
            stage.executions.append(ExecutionRecord(j, prompt, text, len(gen.tokens), gen.stop_reason,
                                                    len(o) + len(self._encode(repair) if repair else []),
                                                    bool(repair), _logprobs(gen)))
        self._emit("executors", record, stage)
        if self._g.join_tail(self._trie):
            sync.append(self._g.join_tail(self._trie))
        return sync, openings

    def _closed_body(self, record: RunRecord, stage: StageRecord, j: int, gen, m: int) -> tuple[str, str]:
        """Executor j's body up to its close tag, and the text the orchestrator adds to close it
        when the executor did not (empty when it did)."""
        close = self._g.close(stage.index, j)
        if gen.stop_reason == "stop" and close in gen.text:
            return gen.text[:_stop_end(gen.text, close)], ""
        text = self._text_of(gen.tokens[:-1]) if gen.stop_reason == "eos" else gen.text
        how = {"eos": "ended (EOS)", "length": f"reached its {m}-token limit"}.get(gen.stop_reason, "stopped")
        _problem(record, stage, f"stage {stage.index}: {self._g.unit} {stage.index}.{j} {how} before {close}; "
                                f"closed by the orchestrator")
        return text, self._g.repair(text, close)

    def _join(self, state, record: RunRecord, stage: StageRecord, w: int, sync: list[str],
              openings: list[list[int]], t0: float):
        """Bring the executors' outputs into the planner's context (merge their KV rows, or
        re-prefill the sync text); the state after."""
        self._check_clock(t0)
        t = time.perf_counter()
        merge = self.config.resolved_join == "merge"
        stage.join = "merge" if merge else "reprefill"
        if merge:
            # each executor's tokens after the fork as the layout tokenizes them: its forced
            # opening (already canonical) and its body piece; the engine runs only the tokens
            # a branch never computed and places the rest without running the model
            branches = [list(o) + self._canonical([b]) for o, b in zip(openings, sync[2::2])]
            state = yield EngineCall("merge", state, prefixes=branches)
            stage.sync_tokens = getattr(self.engine, "last_join_tokens", 0)
            tail = self._g.join_tail(self._trie)
            if tail:
                # ThreadWeaver's forced `gap </Parallel>`: planner text after the join, placed past
                # the longest thread and seeing every thread, as the merge layout trains it
                tokens = self._canonical([tail])
                state = yield EngineCall("extend", state, tokens=tokens)
                stage.sync_tokens += len(tokens)
            self._mark = len(state.tokens)
        else:
            state, stage.sync_tokens = yield from self._settle(state, w, sync)
        if hasattr(self.engine, "flush_sync"):    # the sync's queued tokens written now
            self.engine.flush_sync(state)
        stage.sync_s = time.perf_counter() - t
        for j in range(1, len(openings) + 1):            # the planner's context holds them now
            self._emit("text", record, stage, "".join(sync[2 * j - 1: 2 * j + 1]), executor=j)
        if self._g.join_tail(self._trie):
            self._emit("text", record, stage, self._g.join_tail(self._trie))
        self._emit("sync", record, stage)
        return state


@dataclasses.dataclass
class _Tally:
    """A run's running counts: generated tokens (Σ planner + Σ executors) and engine calls (seeds)."""
    used: int = 0
    call: int = 0


def _logprobs(g) -> list[float]:
    """A call's per-token log-probs (the engine's Generation.logprobs; none from an engine without)."""
    return list(getattr(g, "logprobs", None) or [])


def _stop_end(text: str, stop: str) -> int:
    """Where the first occurrence of `stop` in `text` ends."""
    return text.index(stop) + len(stop)


def _problem(record: RunRecord, stage: StageRecord, message: str) -> None:
    """An orchestrator policy was applied: recorded on the stage and on the run."""
    stage.problems.append(message)
    record.problems.append(message)


# ---------------------------------------------------------------------------------------------
# Many runs on one engine
# ---------------------------------------------------------------------------------------------
def run_many(engine: Any, queries: list[str], mode: str = "parallel", config: OrchestratorConfig | None = None,
             concurrency: int | None = None, on_event: Callable[[Event], None] | None = None,
             on_record: Callable[[int, RunRecord], None] | None = None,
             configs: list[OrchestratorConfig] | None = None,
             on_call: Callable[[int, EngineCall, list[int], Any], None] | None = None) -> list[RunRecord]:
    """Many runs at once on an `Engine`: up to `concurrency` runs (default: the engine's
    sequence slots) advance together; each engine step serves the calls of all of them (prefill
    chunks, every planner and executor decoding in one batched step). A run's records, accounting
    and policies are those of `Orchestrator.run` (the same generator); its wall_s includes the
    time it shared the engine. `on_record(i, record)` is called as each run ends.
    `configs` (optional) gives run i its own config (e.g. its own sampling seed) instead of `config`.
    `on_call(i, call, context, result)` (optional) is called as each call of run i is answered
    (not when the engine refuses it): `context` is the state's tokens when the call was issued,
    `result` what the run receives (RL records the sampled tokens of every call this way).
    The calls are answered by `drive.RunDriver`; this adds admission up to `concurrency`, the
    engine steps, and closing each run's sequence when it ends."""
    if configs is not None and len(configs) != len(queries):
        raise ValueError(f"configs has {len(configs)} entries for {len(queries)} queries")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    concurrency = concurrency or engine.max_seqs
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[RunRecord | None] = [None] * len(queries)
    runs: dict[int, Run] = {}                   # run index -> its generator, sequence, op in flight
    todo = list(range(len(queries)))[::-1]

    def done(run: Run, record: RunRecord) -> None:
        records[run.key] = record
        if run.seq is not None and not run.seq.closed:
            engine.close(run.seq)
        del runs[run.key]
        if on_record is not None:
            on_record(run.key, record)

    answer = (lambda run, call, context, value: on_call(run.key, call, context, value)) \
        if on_call is not None else None
    driver = RunDriver(engine, on_answer=answer, on_done=done, context=on_call is not None)
    while todo or runs:
        while todo and len(runs) < concurrency:
            i = todo.pop()
            cfg = configs[i] if configs is not None else config
            runs[i] = Run(Orchestrator(engine, cfg, on_event).steps(queries[i], mode), key=i)
            driver.advance(runs[i])
        if not runs:
            continue
        engine.step_or_raise()
        for run in [r for r in runs.values() if r.op is not None and r.op.done]:
            driver.poll(run)
    return records


def run_query(engine: Any, query: str, mode: str = "parallel", config: OrchestratorConfig | None = None,
              on_event: Callable[[Event], None] | None = None) -> RunRecord:
    """One run of `query` (the text the model sees before its completion)."""
    return Orchestrator(engine, config, on_event).run(query, mode)


__all__ = ["MODES", "TERMINATIONS", "execution_opening", "OrchestratorConfig",
           "ExecutionRecord", "StageRecord", "RunRecord", "Event", "Orchestrator", "run_query",
           "EngineCall", "submit_call", "run_many"]
