"""SFT examples -> token rows with per-token loss weights, in the `flat`, `trie` or `merge` layout.

Paper §8-9: SPRINT is next-token SFT on the restructured sequence, with the loss on what the model
writes (plans, prompts, executions, the final answer and their tags) and never on the query.
Labels come from `sprint_jax.format.span_labels` (per character) and `format.token_labels`
(per token, through the tokenizer's offset mapping), so the loss mask and the grammar cannot drift.

Every laid-out example ("item") is a forest of token chains described by four arrays:
  tokens, positions, parents (the row index whose hidden state predicts this token; -1 = none),
  span_end (token j is visible to rows j..span_end[j]-1), weights (loss weight of this token).
Attention: row i may attend to j iff j <= i < span_end[j]. This one description covers both
layouts, so the train step has a single attention mask and a single loss:
  * flat (the paper): prompt + completion + EOS as one causal chain; parents = i - 1, span_end =
    end of the example, positions = 0..n-1.
  * trie (train exactly what inference runs): every planner and executor call of the orchestrator
    (paper §10) is a (context, completion) unit; units are stored as a prefix trie of text pieces
    in depth-first order, so a token's subtree is contiguous and "j is an ancestor of i" is exactly
    j <= i < span_end[j]; positions are depths; only unit completions carry loss. Executor (k, j)
    sees the planner context, `<Plan_k> ... </Plan_k>` and its forced `<execution_k.j>`, never
    its siblings; planner k+1 sees every execution of stage k in prompt order, as after sync.
    With `whole_trajectory` (config `data.trie_whole_trajectory`, ThreadWeaver) the trie also holds
    the whole trajectory as one more unit, a child of the prompt: exactly the flat layout's tokens,
    positions and loss (prompt + completion tokenized as in flat + EOS), so the same model also runs
    as an ordinary sequential decoder without the orchestrator.
  * merge (train what the merge join runs; docs/design.md "Layouts: flat, trie, merge"): the trie's
    pieces, each once, in text order; the executors of a stage all start at the fork position and
    the planner resumes at fork + the longest executor. Items also carry `stage` and `branch` per
    token (branch 0 = planner text, j = executor j of that stage) and the attention adds the merge
    rule: row i sees j iff j <= i < span_end[j] and (branch[j] == 0 or stage[j] < stage[i] or
    (stage, branch) of i and j are equal). span_end is the end of the example (packing). flat / trie
    items have no stage / branch (the merge rule is then true everywhere).
Formats (`data.format`): the examples are SPRINT text (`sprint_jax.format`) or ThreadWeaver text
(`sprint_jax.threadweaver`); parsing, span labels and the cut into inference calls follow the format,
and every layout above is then built from the same pieces and labels. ThreadWeaver's calls: the main
sequence through `</Outlines>` of block k is planner call k; thread j of the block is forced open with
`gap <Thread>j:` and its body through `</Thread>` is an executor call; after the threads the join
forces `gap </Parallel>` (context, like an opening), and the main sequence goes on to the next
`</Outlines>` or to the end (EOS).
Paired sets (paper §9: SPRINT and RFT train on the same problems): `build_items(paired=...)` drops an
example whose partner (same id in the other set) is unusable or over-long there, and counts it.
Several items are packed into one row (first-fit, deterministic order from the seed); items never
see each other because their spans do not overlap. With length buckets (`BucketStream`) an item is
packed into a row of the smallest bucket that holds it and each batch comes from one bucket.
Every example that is not trained on is counted by reason (`DataStats.dropped`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from sprint_jax.jsonl import iter_objects
from sprint_jax import caps
from sprint_jax import format as fmt
from sprint_jax import threadweaver as tw
from sprint_jax.errors import UserError
from sprint_jax.model.tokenizer import byte_tokenizer, encode_with_offsets, eos_id
from sprint_jax.schema import Example

LABEL_IDS = {k: i for i, k in enumerate(fmt.SPAN_KINDS)}
EOS_LABEL = "tag"   # EOS ends the model's output like a closing tag; it is written, so it is learnt
DATA_FORMATS = tw.FORMATS           # `data.format`: the text format of the training examples
assert tw.SPAN_KINDS == fmt.SPAN_KINDS      # one label table for both formats (LABEL_IDS, span_weights)


def _check_format(data_format: str) -> None:
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data format must be one of {', '.join(DATA_FORMATS)}, got {data_format!r}")


def char_labels(ex: Example, data_format: str = "sprint") -> list[str]:
    """One label from SPAN_KINDS per character of `ex.prompt + ex.completion`, by the format's
    grammar (`format.span_labels` or `threadweaver.span_labels`)."""
    _check_format(data_format)
    labels = tw.span_labels if data_format == "threadweaver" else fmt.span_labels
    return labels(ex.prompt, ex.completion)


class DataError(UserError):
    """Training data that cannot be used (unreadable file, malformed record): names file and line."""


# ---------------------------------------------------------------------------------------------
# The configured tokenizer (the helpers every tokenizer shares are in sprint_jax.model.tokenizer)
# ---------------------------------------------------------------------------------------------
def resolve_tokenizer(spec: str, model_name: Any = None, pretrained: bool = False):
    """`data.tokenizer`: auto (the checkpoint's own tokenizer when fine-tuning one, else Qwen2's),
    qwen2, bytes, or a directory."""
    from sprint_jax.model.tokenizer import load_tokenizer, qwen2_tokenizer

    if spec == "auto":
        if pretrained and isinstance(model_name, str) and Path(model_name).is_dir():
            # fine-tuning a checkpoint: its own tokenizer or an error, never a silent substitute
            try:
                return load_tokenizer(model_name)
            except (OSError, ValueError) as e:
                raise DataError(f"data.tokenizer=auto: cannot load the tokenizer of {model_name} ({e}); "
                                "set data.tokenizer to qwen2, bytes or a tokenizer directory") from None
        return qwen2_tokenizer()
    if spec == "qwen2":
        return qwen2_tokenizer()
    if spec == "bytes":
        return byte_tokenizer()
    if not Path(spec).exists():
        raise DataError(f"data.tokenizer: {spec!r} is not auto/qwen2/bytes nor an existing directory")
    return load_tokenizer(spec)


# ---------------------------------------------------------------------------------------------
# Reading examples
# ---------------------------------------------------------------------------------------------
def read_examples(paths: Iterable[str | Path], limit: int | None = None,
                  data_format: str = "sprint") -> list[Example]:
    """Examples from jsonl files; a malformed line is an error naming the file and line, and so is
    an example whose `meta.format` (written by `threadweaver.convert_examples`) names another
    format than `data_format` (no `meta.format`: no claim, read as `data_format`)."""
    _check_format(data_format)
    out: list[Example] = []
    from sprint_jax.config import resolve_shipped_path

    for path in paths:
        path = resolve_shipped_path(path)      # a shipped config's data/NAME is the package's, from anywhere
        if not path.exists():
            raise DataError(f"training data file not found: {path}")
        for n, d in iter_objects(path, DataError):
            where = f"{path}:{n}"
            ex = Example.from_record(d, where, DataError)
            claimed = ex.meta.get(tw.FORMAT_META_KEY)
            if claimed is not None and claimed != data_format:
                raise DataError(f"{where}: the example is in the {claimed!r} format (meta.{tw.FORMAT_META_KEY}) "
                                f"but data.format is {data_format!r}: set data.format to match, or convert "
                                "the file (threadweaver.convert_examples)")
            out.append(ex)
            if limit is not None and len(out) >= limit:
                return out
    return out


# ---------------------------------------------------------------------------------------------
# Pieces and units (the inference calls of paper §10)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Pieces:
    """An example cut into text pieces; piece 0 is the prompt.

    Piece boundaries are the points where inference switches between generated and forced text.
    SPRINT: a planner piece is `gap <Plan_k> ... </Plan_k>` (or the final-answer block + trailing
    text), an opening piece is `gap <execution_k.j>` (forced by the orchestrator), a body piece is
    `content </execution_k.j>`. ThreadWeaver: a planner piece runs through `</Outlines>` of its
    block (or to the end), an opening piece is `gap <Thread>j:` (forced), a body piece is
    `content </Thread>`, and a join piece `gap </Parallel>` (forced) follows a block's threads.
    `units` are paths of piece indices: every piece but the last is context, the last is the
    completion the call writes. `forced[p]`: the orchestrator writes piece p (never in the loss).
    """
    texts: list[str]
    starts: list[int]            # character offset of each piece in prompt + completion
    units: list[tuple[int, ...]]
    unit_kinds: list[str]        # "planner" | "executor" per unit
    stage: list[int]             # per piece: the stage it belongs to (prompt 0, final answer last + 1)
    branch: list[int]            # per piece: 0 = planner text, j = executor j of its stage
    forced: list[bool]           # per piece: the orchestrator writes it (the prompt: False)


@dataclasses.dataclass(frozen=True)
class _Block:
    """One fork of the orchestrator, as the tags that end each call: the planner call stops after
    `stop`; executor j is forced open through `openings[j-1]` and stops after `closes[j-1]`; the
    join forces text through `join` (None: nothing forced)."""
    stage: int
    stop: str
    openings: list[str]
    closes: list[str]
    join: str | None


def _blocks(trajectory: fmt.Trajectory | tw.TWTrajectory) -> list[_Block]:
    if isinstance(trajectory, tw.TWTrajectory):
        return [_Block(k, tw.OUTLINES_CLOSE, [tw.thread_opening(j) for j in range(1, len(b.threads) + 1)],
                       [tw.THREAD_CLOSE] * len(b.threads), tw.PARALLEL_CLOSE)
                for k, b in enumerate(trajectory.blocks, start=1)]
    return [_Block(st.index, fmt.plan_close(st.index),
                   [fmt.execution_open(st.index, j) for j in range(1, len(st.executions) + 1)],
                   [fmt.execution_close(st.index, j) for j in range(1, len(st.executions) + 1)], None)
            for st in trajectory.stages]


def split_pieces(prompt: str, completion: str, trajectory: fmt.Trajectory | tw.TWTrajectory) -> Pieces:
    """Cut a checked completion (`check_example`: SPRINT's `Trajectory` or ThreadWeaver's
    `TWTrajectory`; an RFT one has no stage / block) into pieces, one per inference call's output
    or forced text."""
    texts, starts, p_stage, p_branch, p_forced = [prompt], [0], [0], [0], [False]
    base = len(prompt)
    cursor = 0

    def add(end: int, stage: int, branch: int = 0, forced: bool = False) -> int:
        nonlocal cursor
        texts.append(completion[cursor:end])
        starts.append(base + cursor)
        p_stage.append(stage)
        p_branch.append(branch)
        p_forced.append(forced)
        cursor = end
        return len(texts) - 1

    def through(tag: str) -> int:
        at = completion.find(tag, cursor)
        if at < 0:
            raise ValueError(f"tag {tag} not found after char {cursor}")
        return at + len(tag)

    units: list[tuple[int, ...]] = []
    kinds: list[str] = []
    trunk: list[int] = [0]                      # the planner's context so far
    blocks = _blocks(trajectory)
    for block in blocks:
        k = block.stage
        plan = add(through(block.stop), k)
        units.append(tuple(trunk + [plan]))
        kinds.append("planner")
        trunk.append(plan)
        after_plan = list(trunk)
        for j, (opening_tag, close_tag) in enumerate(zip(block.openings, block.closes), start=1):
            opening = add(through(opening_tag), k, j, forced=True)
            body = add(through(close_tag), k, j)
            units.append(tuple(after_plan + [opening, body]))
            kinds.append("executor")
            trunk += [opening, body]            # sync: executions join the planner in prompt order
        if block.join is not None:              # forced after the join: the next planner's context
            trunk.append(add(through(block.join), k + 1, forced=True))
    final = add(len(completion), (blocks[-1].stage if blocks else 0) + 1)
    units.append(tuple(trunk + [final]))
    kinds.append("planner")
    return Pieces(texts, starts, units, kinds, p_stage, p_branch, p_forced)


# ---------------------------------------------------------------------------------------------
# Items: one example laid out as arrays
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Item:
    """One example laid out (see the module docstring); parents and span_end are item-relative."""
    tokens: np.ndarray           # int32 [n]
    positions: np.ndarray        # int32 [n]
    parents: np.ndarray          # int32 [n], -1 = nothing predicts this token
    span_end: np.ndarray         # int32 [n], exclusive
    weights: np.ndarray          # float32 [n]
    labels: np.ndarray           # int8 [n], index into SPAN_KINDS
    stage: np.ndarray | None = None    # int32 [n], merge layout only (see the module docstring)
    branch: np.ndarray | None = None   # int32 [n], merge layout only: 0 = planner, j = executor j

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, n: int) -> "Item":
        """The first n tokens (a prefix of a depth-first or merge layout is still valid)."""
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return Item(self.tokens[:n], self.positions[:n], self.parents[:n], np.minimum(self.span_end[:n], n),
                    self.weights[:n], self.labels[:n], cut(self.stage), cut(self.branch))


@dataclasses.dataclass
class _Tok:
    ids: list[int]
    labels: list[str]


def _tokenize_piece(tokenizer, text: str, start: int, char_labels: list[str]) -> _Tok:
    ids, offsets = encode_with_offsets(tokenizer, text)
    labels = fmt.token_labels(char_labels, [(a + start, b + start) for a, b in offsets])
    return _Tok(ids, labels)


def _weights(labels: Sequence[str], span_weights: dict[str, float]) -> np.ndarray:
    return np.asarray([span_weights[l] for l in labels], np.float32)


def layout_flat(tokenizer, ex: Example, span_weights: dict[str, float], data_format: str = "sprint") -> Item:
    """prompt + completion (tokenized separately, so the boundary is exact) + EOS, one chain."""
    labels = char_labels(ex, data_format)
    p = _tokenize_piece(tokenizer, ex.prompt, 0, labels)
    c = _tokenize_piece(tokenizer, ex.completion, len(ex.prompt), labels)
    ids = p.ids + c.ids + [eos_id(tokenizer)]
    labels = p.labels + c.labels + [EOS_LABEL]
    n = len(ids)
    w = _weights(labels, span_weights)
    w[0] = 0.0                                  # nothing precedes the first token
    return Item(np.asarray(ids, np.int32), np.arange(n, dtype=np.int32), np.arange(-1, n - 1, dtype=np.int32),
                np.full(n, n, np.int32), w, np.asarray([LABEL_IDS[l] for l in labels], np.int8))


def tokenize_pieces(tokenizer, ex: Example, pieces: Pieces, data_format: str = "sprint") -> list[_Tok]:
    """The token convention of the piecewise layouts (`format.PIECEWISE_LAYOUTS`: trie, merge):
    every piece of `split_pieces` tokenized on its own, EOS after the last piece (the final
    answer). Pieces are what the orchestrator forces or a call writes: the prompt; each planner
    call's output `gap <Plan_k> ... </Plan_k>` (and the final `gap <Final Answer> ... </Final
    Answer>`), cut right after its stop tag; each forced opening `gap <execution_k.j>`; each
    execution body `content </execution_k.j>`. So no token spans a piece boundary; inference
    follows the same cut (orchestrator "token boundaries": encode each piece alone). ThreadWeaver
    pieces (`split_pieces`) follow the same convention."""
    labels = char_labels(ex, data_format)
    toks = [_tokenize_piece(tokenizer, t, s, labels) for t, s in zip(pieces.texts, pieces.starts)]
    last = pieces.units[-1][-1]
    toks[last] = _Tok(toks[last].ids + [eos_id(tokenizer)], toks[last].labels + [EOS_LABEL])
    return toks


def layout_trie(tokenizer, ex: Example, pieces: Pieces, span_weights: dict[str, float],
                whole_trajectory: bool = False, data_format: str = "sprint") -> Item:
    """The units of `pieces` as a prefix trie of pieces, depth-first; loss on unit completions only
    (a forced piece is never a unit's completion: `split_pieces`).
    `whole_trajectory`: one more unit, the completion as one piece after the prompt (the flat chain)."""
    toks = tokenize_pieces(tokenizer, ex, pieces, data_format)
    units = list(pieces.units)
    if whole_trajectory and len(units) > 1:     # one unit already is the whole trajectory
        whole = _tokenize_piece(tokenizer, ex.completion, len(ex.prompt), char_labels(ex, data_format))
        toks.append(_Tok(whole.ids + [eos_id(tokenizer)], whole.labels + [EOS_LABEL]))
        units.append((0, len(toks) - 1))

    # trie over piece paths (node = (parent node, piece)); children in insertion (= inference) order
    node_of: dict[tuple[int, int], int] = {}
    node_piece: list[int] = [-1]                # node 0 is the empty root
    node_parent: list[int] = [-1]
    children: list[list[int]] = [[]]
    is_completion: list[bool] = [False]
    for path in units:
        cur = 0
        for piece in path:
            key = (cur, piece)
            if key not in node_of:
                node_of[key] = len(node_piece)
                node_piece.append(piece)
                node_parent.append(cur)
                children.append([])
                is_completion.append(False)
                children[cur].append(node_of[key])
            cur = node_of[key]
        is_completion[cur] = True

    preorder: list[int] = []
    stack = list(reversed(children[0]))
    while stack:
        node = stack.pop()
        preorder.append(node)
        stack.extend(reversed(children[node]))
    size = [len(toks[p].ids) if p >= 0 else 0 for p in node_piece]
    subtree = list(size)
    for node in reversed(preorder):
        if node_parent[node] > 0:
            subtree[node_parent[node]] += subtree[node]

    ids: list[int] = []
    lab: list[str] = []
    pos: list[int] = []
    par: list[int] = []
    end: list[int] = []
    wts: list[np.ndarray] = []
    depth_after = {0: 0}                        # node -> depth just past its last token
    last_row = {0: -1}                          # node -> row of its last token (or its ancestor's)
    for node in preorder:
        t = toks[node_piece[node]]
        parent = node_parent[node]
        first, n, depth = len(ids), size[node], depth_after[parent]
        ids.extend(t.ids)
        lab.extend(t.labels)
        pos.extend(range(depth, depth + n))
        par.extend(([last_row[parent]] + list(range(first, first + n - 1))) if n else [])
        end.extend([first + subtree[node]] * n)
        wts.append(_weights(t.labels, span_weights) if is_completion[node] else np.zeros(n, np.float32))
        depth_after[node] = depth + n
        last_row[node] = first + n - 1 if n else last_row[parent]

    weights = np.concatenate(wts) if wts else np.zeros(0, np.float32)
    parents = np.asarray(par, np.int32)
    weights[parents < 0] = 0.0
    return Item(np.asarray(ids, np.int32), np.asarray(pos, np.int32), parents, np.asarray(end, np.int32),
                weights, np.asarray([LABEL_IDS[l] for l in lab], np.int8))


def layout_merge(tokenizer, ex: Example, pieces: Pieces, span_weights: dict[str, float],
                 data_format: str = "sprint") -> Item:
    """The pieces once each, in text order (docs/design.md "Layouts: flat, trie, merge"):
      * positions: planner text continues its own count; the executors of stage k all start at the
        fork position F (just after `</Plan_k>`) and the planner resumes at F + max_j len(executor j)
        (opening + body; the repair the orchestrator may add is never in training data);
      * stage / branch per token: planner pieces (query 0, `Plan_k` k, final answer last + 1) have
        branch 0; executor j of stage k has (k, j);
      * parents: the previous row, except an executor's first token, predicted from the fork row
        (the last token of `</Plan_k>`), as every branch of the stage is. The planner's first token
        after a join is predicted from the row before it, the last executor's close tag;
      * weights: the trie's: what a call writes (plans, bodies, the final answer + EOS) carries the
        span weights; the query and the forced pieces (`Pieces.forced`: openings, ThreadWeaver's
        `</Parallel>` join) carry none;
      * span_end: the end of the example (examples packed into one row never see each other).
    With a tokenizer that never merges across a piece boundary (the byte tokenizer) the tokens are
    exactly the flat layout's."""
    toks = tokenize_pieces(tokenizer, ex, pieces, data_format)
    opening_pieces = {path[-2] for path, kind in zip(pieces.units, pieces.unit_kinds) if kind == "executor"}
    ids: list[int] = []
    lab: list[str] = []
    pos: list[int] = []
    par: list[int] = []
    stg: list[int] = []
    brn: list[int] = []
    wts: list[np.ndarray] = []
    cursor = 0                                  # the planner's next position
    fork: tuple[int, int, int] | None = None    # (stage, fork position, fork row) of the open block
    branch_end = 0                              # the largest position past an executor of the block
    at = 0                                      # the current branch's next position
    for p, t in enumerate(toks):
        k, j, n = pieces.stage[p], pieces.branch[p], len(t.ids)
        first = len(ids)
        if j == 0:
            if fork is not None:                # the join: the planner resumes past the longest branch
                cursor, fork = branch_end, None
            start, parent = cursor, first - 1
            cursor += n
        else:
            if fork is None or fork[0] != k:
                fork, branch_end = (k, cursor, first - 1), cursor
            if p in opening_pieces:             # a new branch starts at the fork
                at, parent = fork[1], fork[2]
            else:
                parent = first - 1
            start = at
            at += n
            branch_end = max(branch_end, at)
        ids.extend(t.ids)
        lab.extend(t.labels)
        pos.extend(range(start, start + n))
        par.extend(([parent] + list(range(first, first + n - 1))) if n else [])
        stg.extend([k] * n)
        brn.extend([j] * n)
        trained = p > 0 and not pieces.forced[p]
        wts.append(_weights(t.labels, span_weights) if trained else np.zeros(n, np.float32))
    n = len(ids)
    weights = np.concatenate(wts) if wts else np.zeros(0, np.float32)
    parents = np.asarray(par, np.int32)
    weights[parents < 0] = 0.0
    return Item(np.asarray(ids, np.int32), np.asarray(pos, np.int32), parents, np.full(n, n, np.int32),
                weights, np.asarray([LABEL_IDS[l] for l in lab], np.int8),
                np.asarray(stg, np.int32), np.asarray(brn, np.int32))


def check_example(ex: Example, data_format: str = "sprint"
                  ) -> tuple[fmt.Trajectory | tw.TWTrajectory | None, str | None]:
    """(trajectory, None) if `ex` can be trained on, else (None, why). SPRINT examples must parse
    with no problem; RFT examples (a serial trace, paper §9) need a final answer and no stage.
    ThreadWeaver (`data_format="threadweaver"`, a `TWTrajectory`): a "sprint" example must parse
    with no problem (`<think>`, `</think>`, well-formed blocks; a trace with no block is
    ThreadWeaver's sequential baseline, as a SPRINT plan-only stage converts to); an "rft" one
    needs `</think>` (the answer follows it) and no `<Parallel>` block."""
    _check_format(data_format)
    if data_format == "threadweaver":
        tw_traj, problems = tw.parse_completion(ex.completion)
        if ex.kind == "sprint":
            return (None, problems[0]) if problems else (tw_traj, None)
        if tw_traj.answer is None:
            return None, f"missing {tw.THINK_CLOSE}"
        if tw_traj.blocks:
            return None, f"an RFT example contains a {tw.PARALLEL_OPEN} block"
        return tw_traj, None
    traj, problems = fmt.parse_completion(ex.completion)
    if ex.kind == "sprint":
        if problems:
            return None, problems[0]
        if not traj.stages:
            return None, "no <Plan_1>"
        return traj, None
    if traj.final_answer is None:
        return None, f"missing {fmt.FINAL_OPEN}"
    if traj.stages:
        return None, "an RFT example contains SPRINT stages"
    return traj, None


def layout_example(tokenizer, ex: Example, layout: str, span_weights: dict[str, float],
                   whole_trajectory: bool = False, data_format: str = "sprint") -> Item:
    """`ex` checked (`check_example`, ValueError naming why not) and laid out in `layout`."""
    traj, why = check_example(ex, data_format)
    if traj is None:
        raise ValueError(why)
    if layout == "flat":
        return layout_flat(tokenizer, ex, span_weights, data_format)
    pieces = split_pieces(ex.prompt, ex.completion, traj)
    if layout == "merge":
        return layout_merge(tokenizer, ex, pieces, span_weights, data_format)
    return layout_trie(tokenizer, ex, pieces, span_weights, whole_trajectory, data_format)


# ---------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DataStats:
    read: int = 0
    used: int = 0
    skipped_unparsable: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    dropped_paired: int = 0              # usable here, but the partner set's example is not (or is missing)
    paired_with: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    loss_tokens: int = 0
    dropped_empty: int = 0               # laid out to no token at all (nothing to train)
    first_skip_reasons: list[str] = dataclasses.field(default_factory=list)
    tokens_by_label: dict[str, int] = dataclasses.field(default_factory=dict)
    max_len: int = 0                     # the longest row (data.seq_len): longer examples are over-long
    buckets: dict[str, dict] = dataclasses.field(default_factory=dict)  # per row length: examples, tokens

    used_prompts: list[str] = dataclasses.field(default_factory=list, repr=False)  # for the fingerprint
    used_shapes: list[tuple[int, int]] = dataclasses.field(default_factory=list, repr=False)  # caps.example_shape

    @property
    def dropped(self) -> dict[str, int]:
        """Examples read but not trained on, by reason (truncated ones are trained, so not here)."""
        return {"unparsable": self.skipped_unparsable, "overlong": self.dropped_overlong,
                "paired": self.dropped_paired, "empty": self.dropped_empty}

    def drop_line(self) -> str:
        """One line for the run's start: 'dropped 3 of 1200 examples: 2 longer than 32768 tokens,
        1 unparsable' ('dropped 0 of N examples' when every example is used)."""
        words = {"unparsable": "unparsable", "overlong": f"longer than {self.max_len} tokens",
                 "paired": "unusable in the paired set", "empty": "empty"}
        parts = [f"{n} {words[k]}" for k, n in self.dropped.items() if n]
        total = sum(self.dropped.values())
        return f"dropped {total} of {self.read} examples" + (": " + ", ".join(parts) if parts else "")

    @property
    def tokens_per_example(self) -> float:
        """Training tokens per used example: what a layout costs (merge == flat; trie repeats the
        executions of a stage in the planner's context)."""
        return self.tokens / self.used if self.used else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        del d["used_prompts"], d["used_shapes"]
        d["tokens_per_example"] = self.tokens_per_example
        d["dropped"] = self.dropped
        d["dropped_total"] = sum(self.dropped.values())
        return d


@dataclasses.dataclass
class Paired:
    """The partner set of a paired run (SPRINT <-> RFT) and the layout and format its own run uses."""
    examples: Sequence[Example]
    layout: str
    whole_trajectory: bool = False
    files: list[str] = dataclasses.field(default_factory=list)
    data_format: str = "sprint"


def usable_ids(examples: Sequence[Example], tokenizer, layout: str, seq_len: int, overlong: str,
               span_weights: dict[str, float], whole_trajectory: bool = False,
               data_format: str = "sprint") -> set[str]:
    """Ids of the examples `build_items` would keep with these settings (parsable; within seq_len
    unless over-long ones are truncated)."""
    keep = set()
    for ex in examples:
        try:
            item = layout_example(tokenizer, ex, layout, span_weights, whole_trajectory, data_format)
        except ValueError:
            continue
        if len(item) <= seq_len or overlong == "truncate":
            keep.add(ex.id)
    return keep


def build_items(examples: Sequence[Example], tokenizer, layout: str, seq_len: int, overlong: str,
                span_weights: dict[str, float], vocab_size: int | None = None,
                whole_trajectory: bool = False, paired: Paired | None = None,
                data_format: str = "sprint") -> tuple[list[Item], DataStats]:
    """Lay out every example; unparsable (and empty) ones are counted and skipped, over-long ones
    dropped or truncated per `overlong`, counted (never silently: `DataStats.dropped` by reason).
    With `paired`, an example whose partner (same id in `paired.examples`, laid out in
    `paired.layout` with the same seq_len) is missing, unparsable or over-long is dropped too
    (`dropped_paired`): both runs of the pair, each naming the other, keep exactly the same
    problems. `seq_len` is the longest row (the last length bucket). `data_format`: the examples'
    text format (`check_example`)."""
    _check_format(data_format)
    stats = DataStats(read=len(examples), max_len=seq_len)
    partner_ok = None
    if paired is not None:
        partner_ok = usable_ids(paired.examples, tokenizer, paired.layout, seq_len, overlong, span_weights,
                                paired.whole_trajectory, paired.data_format)
        stats.paired_with = list(paired.files)
    items: list[Item] = []
    for ex in examples:
        try:
            item = layout_example(tokenizer, ex, layout, span_weights, whole_trajectory, data_format)
        except ValueError as e:
            stats.skipped_unparsable += 1
            if len(stats.first_skip_reasons) < 5:
                stats.first_skip_reasons.append(f"{ex.id}: {e}")
            continue
        if len(item) == 0:
            stats.dropped_empty += 1
            continue
        if len(item) > seq_len and overlong == "drop":
            stats.dropped_overlong += 1
            continue
        if partner_ok is not None and ex.id not in partner_ok:
            stats.dropped_paired += 1
            continue
        if len(item) > seq_len:
            item = item.truncate(seq_len)
            stats.truncated += 1
        if vocab_size is not None and len(item) and int(item.tokens.max()) >= vocab_size:
            raise DataError(f"example {ex.id}: token id {int(item.tokens.max())} >= the model's vocab_size "
                            f"{vocab_size}: the tokenizer does not match the model")
        items.append(item)
        stats.used_prompts.append(ex.prompt)
        stats.used_shapes.append((caps.example_shape(ex.completion, data_format) or (0, 0)) if ex.kind == "sprint"
                                 else (0, 0))
        stats.tokens += len(item)
        stats.loss_tokens += int((item.weights > 0).sum())
        for k, i in LABEL_IDS.items():
            stats.tokens_by_label[k] = stats.tokens_by_label.get(k, 0) + int((item.labels == i).sum())
    stats.used = len(items)
    return items, stats


# ---------------------------------------------------------------------------------------------
# Packing and the deterministic row stream
# ---------------------------------------------------------------------------------------------
def pack(lengths: Sequence[int], order: Sequence[int], seq_len: int, open_rows: int) -> list[list[int]]:
    """First-fit over at most `open_rows` open rows, in `order`; returns rows of item indices.

    When a new row would exceed the limit, the oldest open row is closed. Deterministic.
    """
    rows: list[list[int]] = []
    open_: list[tuple[list[int], int]] = []     # (items, used length)
    for i in order:
        n = lengths[i]
        for k, (members, used) in enumerate(open_):
            if used + n <= seq_len:
                members.append(i)
                open_[k] = (members, used + n)
                break
        else:
            open_.append(([i], n))
            if len(open_) > open_rows:
                rows.append(open_.pop(0)[0])
    rows.extend(m for m, _ in open_)
    return rows


def trim_bucket(seq_len: int, loss_chunk: int = 0) -> int:
    """Width granularity of `data.trim_rows`: a quarter of seq_len rounded up to a multiple of 64
    (and of loss_chunk when that divides seq_len, so the chunked loss keeps its chunks), hence at
    most 4 distinct row widths, i.e. at most 4 compiled train steps."""
    unit = loss_chunk if 0 < loss_chunk < seq_len and seq_len % loss_chunk == 0 else 64
    unit = unit * 64 // int(np.gcd(unit, 64))
    return int(-(-(-(-seq_len // 4)) // unit) * unit)


@dataclasses.dataclass
class Rows:
    """A batch of packed rows as numpy arrays, [B, T] each (stage / branch: merge layout only)."""
    tokens: np.ndarray
    positions: np.ndarray
    parents: np.ndarray
    span_end: np.ndarray
    weights: np.ndarray
    stage: np.ndarray | None = None
    branch: np.ndarray | None = None

    def as_dict(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class RowStream:
    """An endless, deterministic stream of packed rows over epochs.

    Epoch e visits the items in `numpy.random.default_rng((seed, e)).permutation` order and packs
    them; row r of the stream is a pure function of (items, seed, seq_len, r), so the data
    position saved in a checkpoint is a single integer and every process agrees on every row.
    """

    def __init__(self, items: Sequence[Item], seq_len: int, seed: int, pad_token: int, open_rows: int = 8):
        if not items:
            raise DataError("no usable training examples (all were skipped or dropped)")
        self.items = list(items)
        self.seq_len = seq_len
        self.seed = seed
        self.pad_token = pad_token
        self.open_rows = open_rows
        self._lengths = [len(it) for it in self.items]
        self.merge = self.items[0].stage is not None        # rows carry stage / branch
        if any((it.stage is not None) != self.merge for it in self.items):
            raise DataError("merge-layout items cannot be packed with flat / trie items")
        self._epochs: dict[int, list[list[int]]] = {}
        self._starts: list[int] = [0]           # first stream row of each epoch

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            order = np.random.default_rng((self.seed, epoch)).permutation(len(self.items))
            self._epochs[epoch] = pack(self._lengths, order.tolist(), self.seq_len, self.open_rows)
            for e in [k for k in self._epochs if k < epoch - 1]:
                del self._epochs[e]
        return self._epochs[epoch]

    def locate(self, row: int) -> tuple[int, int]:
        """Stream row -> (epoch, row within the epoch)."""
        while self._starts[-1] <= row:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + len(self.epoch_rows(e)))
        e = int(np.searchsorted(self._starts, row, side="right")) - 1
        return e, row - self._starts[e]

    def row_items(self, row: int) -> list[int]:
        e, r = self.locate(row)
        return self.epoch_rows(e)[r]

    def row_length(self, row: int) -> int:
        """Tokens of items in stream row `row` (the rest of its seq_len is padding)."""
        return sum(self._lengths[i] for i in self.row_items(row))

    def width(self, row_ids: Sequence[int], bucket: int) -> int:
        """The row width a batch of these rows needs: its longest row rounded up to a multiple of
        `bucket`, at most seq_len (`bucket` <= 0: always seq_len). Every process computes the same
        value from the row ids alone. Cutting the trailing padding changes nothing a real token
        sees or predicts: padding is never attended to (span_end = its own row + 1) and carries
        no loss weight."""
        if bucket <= 0:
            return self.seq_len
        longest = max((self.row_length(r) for r in row_ids), default=1)
        return min(self.seq_len, max(1, -(-longest // bucket)) * bucket)

    def rows(self, row_ids: Sequence[int], width: int | None = None) -> Rows:
        """Materialise the given stream rows (and only those) as arrays, `width` (default
        seq_len) tokens wide; every row's items must fit in `width`."""
        b, t = len(row_ids), self.seq_len if width is None else width
        tokens = np.full((b, t), self.pad_token, np.int32)
        positions = np.zeros((b, t), np.int32)
        parents = np.full((b, t), -1, np.int32)
        span_end = np.broadcast_to(np.arange(1, t + 1, dtype=np.int32), (b, t)).copy()
        weights = np.zeros((b, t), np.float32)
        stage = np.zeros((b, t), np.int32) if self.merge else None    # padding: planner text that
        branch = np.zeros((b, t), np.int32) if self.merge else None   # sees only itself (span_end)
        for r, row in enumerate(row_ids):
            off = 0
            for i in self.row_items(row):
                it = self.items[i]
                n = len(it)
                if off + n > t:
                    raise ValueError(f"stream row {row} holds {self.row_length(row)} tokens, more than width {t}")
                sl = slice(off, off + n)
                tokens[r, sl] = it.tokens
                positions[r, sl] = it.positions
                parents[r, sl] = np.where(it.parents >= 0, it.parents + off, -1)
                span_end[r, sl] = it.span_end + off
                weights[r, sl] = it.weights
                if self.merge:
                    stage[r, sl] = it.stage
                    branch[r, sl] = it.branch
                off += n
        return Rows(tokens, positions, parents, span_end, weights, stage, branch)

    def epoch_of(self, row: int) -> int:
        return self.locate(row)[0]


# ---------------------------------------------------------------------------------------------
# Length buckets: rows of a few lengths, each step's batch from one of them
# ---------------------------------------------------------------------------------------------
def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """Index of the smallest bucket (row length) that holds `length` tokens; -1 if none does."""
    for k, b in enumerate(buckets):
        if length <= b:
            return k
    return -1


def bucket_rows_per_step(buckets: Sequence[int], batch_size: int) -> list[int]:
    """Rows per step of each bucket: `batch_size` rows of the longest bucket, and as many rows of
    a shorter one as hold the same number of tokens (batch_size * longest / length; buckets divide
    the longest, config.py checks), so every step trains on about the same token budget."""
    top = buckets[-1]
    return [batch_size * top // b for b in buckets]


class BucketStream:
    """Packed rows in length buckets; every step's batch comes from one bucket.

    Each item goes to the smallest bucket that holds it. Each non-empty bucket k is a `RowStream`
    of its items (row length `buckets[k]`, the same seed: epoch e visits them in
    `default_rng((seed, e))` order and packs first-fit). The position is one row cursor per bucket
    (`cursors`). The next batch comes from the bucket whose next batch is centred earliest in its
    own epoch, i.e. the smallest (cursor + rows per step / 2) / rows in epoch 0, ties to the
    shorter bucket: buckets advance through their epochs at the same pace, each visited in proportion to
    its rows, and the choice is a function of the cursors alone, so the saved cursors resume the
    stream exactly. With one bucket the batches are rows cursor .. cursor + batch_size - 1 of one
    `RowStream` over every item: exactly the unbucketed stream.
    """

    def __init__(self, items: Sequence[Item], buckets: Sequence[int], batch_size: int, seed: int,
                 pad_token: int, open_rows: int = 8):
        if not items:
            raise DataError("no usable training examples (all were skipped or dropped)")
        merge = items[0].stage is not None
        if any((it.stage is not None) != merge for it in items):
            raise DataError("merge-layout items cannot be packed with flat / trie items")
        self.buckets = [int(b) for b in buckets]
        self.rows_per_step = bucket_rows_per_step(self.buckets, batch_size)
        members: list[list[int]] = [[] for _ in self.buckets]
        for i, it in enumerate(items):
            k = bucket_of(len(it), self.buckets)
            if k < 0:   # build_items drops or truncates what exceeds seq_len (= the last bucket)
                raise ValueError(f"item {i} has {len(it)} tokens, more than the largest bucket {self.buckets[-1]}")
            members[k].append(i)
        self.members = members                  # item indices (into `items`) per bucket
        self.streams: list[RowStream | None] = [
            RowStream([items[i] for i in m], b, seed, pad_token, open_rows) if m else None
            for b, m in zip(self.buckets, members)]
        self._epoch_rows = [len(s.epoch_rows(0)) if s is not None else 0 for s in self.streams]

    def next_bucket(self, cursors: Sequence[int]) -> int:
        """The bucket the batch after position `cursors` comes from (see the class docstring)."""
        best, key = -1, None
        for k, s in enumerate(self.streams):
            if s is None:
                continue
            # (cursor + n / 2) / R, the middle of the bucket's next batch within its epoch, compared
            # exactly as cross-multiplied integers
            cand = (2 * cursors[k] + self.rows_per_step[k], 2 * self._epoch_rows[k])
            if key is None or cand[0] * key[1] < key[0] * cand[1]:
                best, key = k, cand
        return best

    def start(self) -> list[int]:
        """The position before the first batch."""
        return [0] * len(self.buckets)

    def advance(self, cursors: Sequence[int]) -> tuple[int, range, list[int]]:
        """(bucket, its stream rows for the next batch, the position after it)."""
        k = self.next_bucket(cursors)
        n = self.rows_per_step[k]
        rows = range(cursors[k], cursors[k] + n)
        after = list(cursors)
        after[k] += n
        return k, rows, after

    def position_after(self, batches: int) -> list[int]:
        """The position after the first `batches` batches (what an uninterrupted run reaches)."""
        cur = self.start()
        for _ in range(batches):
            cur = self.advance(cur)[2]
        return cur

    def epoch_of(self, cursors: Sequence[int]) -> int:
        """Epochs every bucket has completed at position `cursors` (one bucket: the RowStream's
        epoch of its cursor)."""
        return min(s.epoch_of(c) for s, c in zip(self.streams, cursors) if s is not None)

    def tokens(self, k: int, rows: Sequence[int]) -> int:
        """Item tokens (padding excluded) in the given rows of bucket k."""
        s = self.streams[k]
        return sum(s.row_length(r) for r in rows)

    def describe(self) -> dict[str, dict]:
        """Per bucket (keyed by its row length): examples, item tokens, rows per step and rows in
        epoch 0 (for data_stats.json)."""
        out = {}
        for k, b in enumerate(self.buckets):
            s = self.streams[k]
            out[str(b)] = {"examples": len(self.members[k]),
                           "tokens": int(sum(s._lengths)) if s is not None else 0,
                           "rows_per_step": self.rows_per_step[k], "rows_per_epoch": self._epoch_rows[k]}
        return out
