"""A trajectory's units as one token trie, the layout of the P-GRPO loss.

ThreadWeaver (Lian et al., arXiv 2512.07843, section 4) trains on every call of a parallel rollout.
Here each planner and executor call is a (context, completion) unit (rl/rollout.py), exactly the
units of the `trie` SFT layout (train/data.py), and the arrays follow the same convention so the
same attention rule applies (train/step.py `attention_mask`: row i sees j iff j <= i < span_end[j]):
  tokens, positions (= depth in the trie), parents (the row whose hidden state predicts this token;
  -1 = none), span_end (a token's subtree is contiguous in depth-first order).
The trie is built over token ids of one trajectory: the planner's context is shared by its
executors, and an executor's generated tokens reappear in the next planner's context as the same
trie nodes, so each generated token is predicted once, from exactly what the policy saw when it
sampled it. Completion nodes carry the trajectory's advantage and count in `mask`; context nodes
(prompt, forced openings, repairs) get no loss. Trajectories are separate tries (their shared
prompt is not merged: the same token may carry different advantages in two trajectories).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from sprint_jax.infer.requests import DecodeTrace
from sprint_jax.rl.rollout import Unit
from sprint_jax.train import data as data_lib


@dataclasses.dataclass
class TrieItem:
    tokens: np.ndarray               # int32 [n]
    positions: np.ndarray            # int32 [n]
    parents: np.ndarray              # int32 [n], -1 = nothing predicts this token
    span_end: np.ndarray             # int32 [n], exclusive
    advantages: np.ndarray           # float32 [n], 0 off completions
    mask: np.ndarray                 # float32 [n], 1 on completion tokens that have a parent
    stage: np.ndarray | None = None  # int32 [n]: the merge rule's tags (`layout_trace`; None: all 0)
    branch: np.ndarray | None = None
    rollout_logp: np.ndarray | None = None   # float32 [n]: the log-prob the rollout sampled with (0 off mask)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, n: int) -> "TrieItem":
        """The first n rows (a prefix of a depth-first layout is still a valid forest)."""
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return TrieItem(self.tokens[:n], self.positions[:n], self.parents[:n], np.minimum(self.span_end[:n], n),
                        self.advantages[:n], self.mask[:n], cut(self.stage), cut(self.branch), cut(self.rollout_logp))


def layout_units(units: Sequence[Unit], advantage: float) -> TrieItem:
    """The units of one trajectory as a depth-first token trie (see the module docstring)."""
    children: list[dict[int, int]] = [{}]      # node 0 = root; node -> {token: child}
    order: list[list[int]] = [[]]              # children in insertion (= inference) order
    token: list[int] = [-1]
    parent: list[int] = [-1]
    completion: list[bool] = [False]
    for u in units:
        cur = 0
        path = list(u.context) + list(u.completion)
        for k, t in enumerate(path):
            nxt = children[cur].get(t)
            if nxt is None:
                nxt = len(token)
                children[cur][t] = nxt
                order[cur].append(nxt)
                children.append({})
                order.append([])
                token.append(int(t))
                parent.append(cur)
                completion.append(False)
            if k >= len(u.context):
                completion[nxt] = True
            cur = nxt
    preorder: list[int] = []
    stack = list(reversed(order[0]))
    while stack:
        node = stack.pop()
        preorder.append(node)
        stack.extend(reversed(order[node]))
    n = len(preorder)
    row = {node: r for r, node in enumerate(preorder)}
    subtree = [1] * len(token)
    for node in reversed(preorder):
        if parent[node] > 0:
            subtree[parent[node]] += subtree[node]
    depth = [0] * len(token)
    for node in preorder:
        depth[node] = depth[parent[node]] + 1 if parent[node] > 0 else 0
    tokens = np.asarray([token[v] for v in preorder], np.int32)
    positions = np.asarray([depth[v] for v in preorder], np.int32)
    parents = np.asarray([row[parent[v]] if parent[v] > 0 else -1 for v in preorder], np.int32)
    span_end = np.asarray([row[v] + subtree[v] for v in preorder], np.int32)
    mask = np.asarray([completion[v] for v in preorder], np.float32) * (parents >= 0)
    adv = (mask * np.float32(advantage)).astype(np.float32)
    assert tokens.shape == (n,)
    return TrieItem(tokens, positions, parents, span_end, adv, mask)


def layout_trace(trace: DecodeTrace, advantage: float) -> TrieItem:
    """One trajectory laid out as the engine decoded it (`DecodeTrace`, any join, any layout's
    token convention): every node once, nodes that are the same computation (same parent, token,
    position, tags and predicting node: a re-prefilled execution and the child that wrote it) as
    one row, depth-first; positions as decoded; `parents` the row whose logits predicted the token;
    stage / branch the merge rule's tags; loss (mask) on the sampled tokens, with the log-prob the
    rollout sampled each with (`rollout_logp`). Row i sees row j iff j <= i < span_end[j] and the
    merge rule holds (model/attention.py), so the loss's forward gives each sampled token exactly
    the context, positions and join its decode had."""
    if not trace.exact:
        raise ValueError("the trajectory's trace missed an engine call (teacher forcing): it cannot be laid out")
    kids: dict[int, list[int]] = {}
    for v in range(len(trace)):
        kids.setdefault(trace.up[v], []).append(v)
    canon: dict[int, int] = {}                 # node -> its representative
    rep_kids: dict[int, list[int]] = {}        # representative -> representative children, in order
    key_of: dict[tuple, int] = {}
    lp: dict[int, float | None] = {}
    stack = [(v, -1) for v in reversed(kids.get(-1, []))]
    while stack:
        v, up = stack.pop()
        pred = canon[trace.pred[v]] if trace.pred[v] >= 0 else -1
        key = (up, trace.token[v], trace.pos[v], trace.stage[v], trace.branch[v], pred)
        r = key_of.get(key)
        if r is None:
            r = key_of[key] = v
            rep_kids.setdefault(up, []).append(v)
            lp[v] = trace.logprob[v]
        elif lp[r] is None:
            lp[r] = trace.logprob[v]
        canon[v] = r
        stack.extend((c, r) for c in reversed(kids.get(v, [])))
    order: list[int] = []
    todo = list(reversed(rep_kids.get(-1, [])))
    while todo:
        v = todo.pop()
        order.append(v)
        todo.extend(reversed(rep_kids.get(v, [])))
    row = {v: i for i, v in enumerate(order)}
    size = {v: 1 for v in order}
    for v in reversed(order):
        up = trace.up[v] if trace.up[v] < 0 else canon[trace.up[v]]
        if up >= 0:
            size[up] += size[v]
    n = len(order)
    parents = np.asarray([row[canon[trace.pred[v]]] if trace.pred[v] >= 0 else -1 for v in order], np.int32)
    sampled = np.asarray([lp[v] is not None for v in order], bool) & (parents >= 0)
    logp = np.asarray([lp[v] if lp[v] is not None else 0.0 for v in order], np.float32) * sampled
    mask = sampled.astype(np.float32)
    return TrieItem(np.asarray([trace.token[v] for v in order], np.int32),
                    np.asarray([trace.pos[v] for v in order], np.int32), parents,
                    np.asarray([row[v] + size[v] for v in order], np.int32).reshape(n),
                    (mask * np.float32(advantage)).astype(np.float32), mask,
                    np.asarray([trace.stage[v] for v in order], np.int32).reshape(n),
                    np.asarray([trace.branch[v] for v in order], np.int32).reshape(n), logp.astype(np.float32))


@dataclasses.dataclass
class PackedBatch:
    """Packed rows [M, R, T] (M microbatches of R rows) and what packing cost."""
    arrays: dict[str, np.ndarray]
    tokens: int                      # real (non-pad) rows of all items
    loss_tokens: int                 # completion tokens in the loss
    truncated_loss_tokens: int       # completion tokens cut off by seq_len (counted, never silent)


def pack_items(items: Sequence[TrieItem], seq_len: int, rows_per_micro: int, pad_token: int) -> PackedBatch:
    """First-fit packing in item order (train/data.py `pack`), padded to whole microbatches."""
    cut = 0
    kept = []
    for it in items:
        if len(it) > seq_len:
            cut += int(it.mask[seq_len:].sum())
            it = it.truncate(seq_len)
        kept.append(it)
    rows = data_lib.pack([len(it) for it in kept], list(range(len(kept))), seq_len, open_rows=8) if kept else []
    n_rows = max(1, -(-len(rows) // rows_per_micro)) * rows_per_micro
    b, t = n_rows, seq_len
    arr = {"tokens": np.full((b, t), pad_token, np.int32), "positions": np.zeros((b, t), np.int32),
           "parents": np.full((b, t), -1, np.int32),
           "span_end": np.broadcast_to(np.arange(1, t + 1, dtype=np.int32), (b, t)).copy(),
           "advantages": np.zeros((b, t), np.float32), "mask": np.zeros((b, t), np.float32),
           "stage": np.zeros((b, t), np.int32), "branch": np.zeros((b, t), np.int32),
           "rollout_logp": np.zeros((b, t), np.float32)}
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            it = kept[i]
            sl = slice(off, off + len(it))
            arr["tokens"][r, sl] = it.tokens
            arr["positions"][r, sl] = it.positions
            arr["parents"][r, sl] = np.where(it.parents >= 0, it.parents + off, -1)
            arr["span_end"][r, sl] = it.span_end + off
            arr["advantages"][r, sl] = it.advantages
            arr["mask"][r, sl] = it.mask
            for k in ("stage", "branch", "rollout_logp"):
                if getattr(it, k) is not None:
                    arr[k][r, sl] = getattr(it, k)
            off += len(it)
    m = n_rows // rows_per_micro
    arrays = {k: v.reshape(m, rows_per_micro, t) for k, v in arr.items()}
    return PackedBatch(arrays, sum(len(it) for it in kept), int(sum(it.mask.sum() for it in kept)), cut)


__all__ = ["TrieItem", "layout_units", "layout_trace", "PackedBatch", "pack_items"]
