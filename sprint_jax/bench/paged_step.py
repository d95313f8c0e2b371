"""One decode step on the paged KV pool vs the slot cache, side by side (`sprint-jax bench decode`).

Why. The engine moved from a two-level slot cache (a parent slot per sequence, a child slot per
branch) to a pool of fixed-size pages. This measures what a decode step costs on each at the
same used length: `programs.decode` (pages) against `slot_programs.decode` (slots), the same
rows, the same chunk, on random cache contents, greedy, and the bytes each reads per step.

Points.
  fork      n children of one fork decode together over a context of P tokens. Each child holds
            c = branch prefix tokens of its own. Pages: the context's full pages (P // ps * ps
            tokens) are the group's shared prefix (b_gtable, read once per step for the n rows);
            each child's own table starts at the partly filled page (its copy: P % ps tokens)
            and holds its c tokens. Slots: the parent slot holds the P tokens (b_fork = P), read
            once per step for the group; each child slot its c tokens.
  generate  one sequence of P tokens decoding on itself (the planner's row): its whole page
            table / its parent slot.
The table widths and read lengths are what the engine's scheduler gives these rows (pages:
`Scheduler._decode`'s page buckets; slots: the slot engine's s_b / c_b buckets, min_bucket
64), the page ids a random permutation of the pool (a pool in use is not contiguous).

Timing. Each program is called with every row's budget at N (= the chunk) and at 1, the same
compiled shapes, and step_ms = (wall(N) - wall(1)) / (N - 1), as the rest of `bench decode`;
every call rewrites the same positions, so every repeat runs at the same used length. Each
repeat runs every point's four calls in turn (paged N, paged 1, slot N, slot 1) so load on a
shared machine hits both alike; the best of the repeats is kept and every sample is in the JSON.
The same difference of the process CPU time (`*_cpu_ms`, XLA's threads included) stands beside
it: on a machine other processes hold, a call that loses its core gains wall time, not CPU time.

Bytes. Per step, by the kernels' formulas (`sprint_jax.kernels.parent_prefix.group_bytes_read` for slots,
`sprint_jax.kernels.paged_prefix.paged_group_bytes_read` for pages; both per layer, times the layers): the
shared prefix once for its group (the n children's queries ride along) plus each child's own
tokens (a group of one each). prefix_kv_bytes is the prefix's K/V alone: the same at any n.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

SLOT_MIN_BUCKET = 64     # the slot engine's min_bucket (its s_b / c_b floor)


# ---------------------------------------------------------------------------------------------
# rows: what each engine's scheduler builds for a point
# ---------------------------------------------------------------------------------------------
def _pages(tokens: int, ps: int) -> int:
    return -(-tokens // ps)


def page_bucket(n_pages: int, page_size: int, cap_tokens: int | None = None, min_bucket: int = SLOT_MIN_BUCKET) -> int:
    """A page table width as the paged scheduler picks it (`Scheduler._page_bucket`: capped at the
    pages of cap_tokens, never below n_pages)."""
    from sprint_jax.infer.buckets import bucket_fine, page_bucket as bucket_of
    if cap_tokens is None:
        return bucket_fine(max(n_pages, 1), max(1, min_bucket // page_size))
    return bucket_of(n_pages, page_size, min_bucket, cap_tokens)


def _fill(rows, budget: int, pending: np.ndarray) -> None:
    """Every row active and greedy, no stop ids, `budget` tokens to go."""
    rows.active[:] = True
    rows.remaining[:] = budget
    rows.pending[:] = pending
    rows.temperature[:] = 0.0


def group_width(n: int, max_children: int) -> int:
    """Rows of a sibling group of n children, as both schedulers pick it (padding rows idle)."""
    from sprint_jax.infer.buckets import bucket
    return min(bucket(n, 1), max_children)


def paged_rows(kind: str, p: int, n: int, c: int, chunk: int, page_size: int, max_children: int,
               perm: np.ndarray, budget: int, pending: np.ndarray, parent_cap: int | None = None,
               child_cap: int | None = None):
    """`programs.DecodeRows` of one point (kind "fork": n children with c own tokens over a P-token
    context; "generate": one row of P tokens) over the pool pages `perm` (a permutation of the
    pool's page ids), `budget` tokens per row, pending tokens `pending` [rows]. Returns (packed,
    layout, widths). parent_cap / child_cap: the engine's capacities, which cap the widths as the
    scheduler caps them."""
    from sprint_jax.infer.programs import DecodeRows
    ps = page_size
    if kind == "generate":
        ma = page_bucket(_pages(p + chunk, ps), ps, parent_cap)      # start + len(feed) - 1 + chunk
        r = DecodeRows.empty(1, 0, 1, chunk, ma, 1, 1)
        held = _pages(p + chunk, ps)
        r.a_table[0, :held] = perm[:held]
        r.lengths[0] = p
        widths = dict(ma=ma)
    else:
        w = group_width(n, max_children)
        shared = p // ps * ps                                        # the context's full pages
        mg = page_bucket(shared // ps, ps, parent_cap)
        own = p + c - shared                                         # the copied partial page + c
        mr = page_bucket(_pages(own + 1 + chunk, ps), ps,            # start + len(feed) + chunk - shared
                         None if child_cap is None else ps + child_cap)
        r = DecodeRows.empty(0, 1, w, chunk, 1, mg, mr)
        r.b_gtable[0, : shared // ps] = perm[: shared // ps]
        r.b_glen[0] = shared
        per_child = _pages(own + chunk, ps)                          # what a decode call reserves
        at = shared // ps
        for j in range(n):
            r.b_table[j, :per_child] = perm[at: at + per_child]
            at += per_child
        r.lengths[:n] = own
        widths = dict(w=w, mg=mg, mr=mr)
    _fill(r, budget, pending)
    if kind == "fork":                                               # padding children (w > n) idle
        r.active[n:] = False
    packed, layout = r.pack()
    return packed, layout, widths


def slot_rows(kind: str, p: int, n: int, c: int, chunk: int, parent_cap: int, child_cap: int, max_children: int,
              budget: int, pending: np.ndarray):
    """`slot_programs.DecodeRows` of the same point on the slot cache (one parent slot, its
    children's slots 0..w-1). Returns (packed, layout, widths with s_b and c_b)."""
    from sprint_jax.infer.buckets import bucket_fine
    from sprint_jax.bench.slot_programs import DecodeRows
    if kind == "generate":
        r = DecodeRows.empty(1, 0, 1, chunk, 1, 1)
        r.a_slot[0] = 0
        r.lengths[0] = p
        s_b, c_b, w = min(bucket_fine(p + chunk, SLOT_MIN_BUCKET), parent_cap), 1, 1
    else:
        w = group_width(n, max_children)
        r = DecodeRows.empty(0, 1, w, chunk, 1, max_children)
        r.b_pslot[0], r.b_fork[0] = 0, p
        r.b_cslot[:] = np.arange(w)
        r.lengths[:n] = c
        s_b = min(bucket_fine(max(p, 1), SLOT_MIN_BUCKET), parent_cap)
        c_b = min(bucket_fine(c + chunk, SLOT_MIN_BUCKET), child_cap)
    _fill(r, budget, pending)
    if kind == "fork":
        r.active[n:] = False
    packed, layout = r.pack()
    return packed, layout, dict(w=w, s_b=s_b, c_b=c_b)


# ---------------------------------------------------------------------------------------------
# bytes per step (the kernels' formulas)
# ---------------------------------------------------------------------------------------------
def step_bytes(config, kind: str, p: int, n: int, c: int, page_size: int) -> dict[str, int]:
    """Bytes one decode step reads from the KV cache, all layers, by the formulas: the shared
    prefix once per group with its rows' queries (`*_prefix_bytes`), each row's own tokens as a
    group of one (`*_own_bytes`), their sum (`*_bytes`), and the prefix's K/V alone
    (`*_prefix_kv_bytes`: the formula minus its queries; the same at any n)."""
    from sprint_jax.kernels.paged_prefix import paged_group_bytes_read
    from sprint_jax.kernels.parent_prefix import group_bytes_read
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    layers, dt, ps = config.num_hidden_layers, config.dtype, page_size

    def slot(lens, width):
        return layers * group_bytes_read(lens, width, *heads, dt)

    def paged(lens, width):
        return layers * paged_group_bytes_read(lens, width, *heads, ps, dt)

    if kind == "generate":                  # one row over its own tokens (a group of one)
        sp, so = slot([p], 1), 0
        pp, po = paged([p], 1), 0
        skv, pkv = sp - slot([0], 1), pp - paged([0], 1)
    else:
        shared = p // ps * ps
        sp, so = slot([p], n), slot([c] * n, 1)
        pp, po = paged([shared], n), paged([p + c - shared] * n, 1)
        skv, pkv = sp - slot([0], n), pp - paged([0], n)
    return dict(slot_prefix_bytes=sp, slot_own_bytes=so, slot_bytes=sp + so, slot_prefix_kv_bytes=skv,
                paged_prefix_bytes=pp, paged_own_bytes=po, paged_bytes=pp + po, paged_prefix_kv_bytes=pkv)


# ---------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------
def step_points(prefix_lens: list[int], branches: list[int]) -> list[tuple[str, int, int]]:
    """(kind, P, n): a generate row and every branch count's fork, per context length."""
    return [pt for p in prefix_lens for pt in [("generate", p, 1)] + [("fork", p, n) for n in branches]]


def bench_paged_vs_slot(params, config, s: dict[str, Any], page_size: int, rng) -> list[dict[str, Any]]:
    """Rows of the side-by-side section (see the module docstring), one per `step_points`."""
    import jax

    from sprint_jax.bench import slot_programs
    from sprint_jax.infer import programs
    from sprint_jax.infer.pages import KVPages
    from sprint_jax.bench.slot_cache import SlotCache
    from sprint_jax.model.qwen2 import UNROLL_MAX_LAYERS, dtype_of, per_layer

    # the weights as the engine runs them on one device (`Engine`'s per_layer_weights default)
    step_params = per_layer(params) if config.num_hidden_layers <= UNROLL_MAX_LAYERS else params
    chunk, c, n_new, bp = s["decode_chunk"], s["branch_prefix_len"], s["new_tokens"], s["branch_prefix_len"]
    children = max(s["branches"])
    ps = page_size
    dt = dtype_of(config.dtype)
    rows_out = []
    for p in s["prefix_lens"]:
        # the capacities `bench decode` builds its engine with for this context
        parent_cap = p + bp + n_new + chunk
        child_cap = bp + 1 + n_new + chunk
        num_pages = _pages(parent_cap, ps) + children * (_pages(child_cap, ps) + 1)
        rkeys = iter(jax.random.split(jax.random.key(int(rng.integers(1 << 31))), 6))
        pool = KVPages.zeros(config, num_pages, ps)
        slots = SlotCache.zeros(config, 1, children, parent_cap, child_cap)
        rand = lambda a: jax.random.normal(next(rkeys), a.shape, dt)          # noqa: E731
        state = {"pool": KVPages(rand(pool.k), rand(pool.v)),
                 "slots": SlotCache(rand(slots.pk), rand(slots.pv), rand(slots.ck), rand(slots.cv))}
        del pool, slots
        perm = rng.permutation(num_pages).astype(np.int32)
        calls = {}
        meta = {}
        for kind, _, n in step_points([p], s["branches"]):
            b = 1 if kind == "generate" else group_width(n, children)
            pending = rng.integers(2, config.vocab_size, b)
            for budget in (chunk, 1):
                pk, pl, pw = paged_rows(kind, p, n, c, chunk, ps, children, perm, budget, pending, parent_cap,
                                        child_cap)
                sk, sl, sw = slot_rows(kind, p, n, c, chunk, parent_cap, child_cap, children, budget, pending)
                calls[(kind, n, "paged", budget)] = (pk, pl)
                calls[(kind, n, "slot", budget)] = (sk, sl)
            meta[(kind, n)] = dict(paged_widths=pw, slot_widths=sw)

        def call(kind, n, impl, budget):
            packed, layout = calls[(kind, n, impl, budget)]
            t0, c0 = time.perf_counter(), time.process_time()
            if impl == "paged":
                res = programs.decode(step_params, config, state["pool"], packed, layout=layout, chunk=chunk)
                state["pool"] = res.pool
            else:
                res = slot_programs.decode(step_params, config, state["slots"], packed, layout=layout, chunk=chunk,
                                           s_b=meta[(kind, n)]["slot_widths"]["s_b"],
                                           c_b=meta[(kind, n)]["slot_widths"]["c_b"])
                state["slots"] = res.cache
            _, steps = jax.device_get((res.tokens, res.steps))      # what the engine reads back
            jax.block_until_ready(state["pool"] if impl == "paged" else state["slots"])
            return time.perf_counter() - t0, time.process_time() - c0, int(steps)

        keys = [(kind, n, impl, budget) for kind, _, n in step_points([p], s["branches"])
                for impl in ("paged", "slot") for budget in (chunk, 1)]
        first = {k: call(*k)[0] for k in keys}
        samples: dict[tuple, list[float]] = {k: [] for k in keys}
        cpu: dict[tuple, list[float]] = {k: [] for k in keys}
        steps: dict[tuple, int] = {}
        for _ in range(s["step_repeats"]):
            for k in keys:
                dt_s, dc_s, steps[k] = call(*k)
                samples[k].append(dt_s)
                cpu[k].append(dc_s)
        for kind, _, n in step_points([p], s["branches"]):
            row: dict[str, Any] = dict(kind=kind, prefix_len=p, branches=n,
                                       own_tokens=0 if kind == "generate" else c, chunk=chunk, page_size=ps,
                                       used_length=p + (0 if kind == "generate" else c), **meta[(kind, n)])
            for impl in ("paged", "slot"):
                long, short = samples[(kind, n, impl, chunk)], samples[(kind, n, impl, 1)]
                extra = steps[(kind, n, impl, chunk)] - steps[(kind, n, impl, 1)]
                for suffix, (a, b) in (("ms", (long, short)),
                                       ("cpu_ms", (cpu[(kind, n, impl, chunk)], cpu[(kind, n, impl, 1)]))):
                    d = (min(a) - min(b)) / extra if extra > 0 else 0.0    # chunk 1: nothing to difference
                    row[f"{impl}_{suffix}"] = d * 1e3 if d > 0 else None
                row[f"{impl}_steps"] = (steps[(kind, n, impl, chunk)], steps[(kind, n, impl, 1)])
                row[f"{impl}_call_ms_samples"] = [x * 1e3 for x in long]
                row[f"{impl}_one_step_ms_samples"] = [x * 1e3 for x in short]
                row[f"{impl}_call_cpu_ms_samples"] = [x * 1e3 for x in cpu[(kind, n, impl, chunk)]]
                row[f"{impl}_one_step_cpu_ms_samples"] = [x * 1e3 for x in cpu[(kind, n, impl, 1)]]
                row[f"{impl}_compile_s"] = max(0.0, first[(kind, n, impl, chunk)] - min(long)) + max(
                    0.0, first[(kind, n, impl, 1)] - min(short))
            for suffix in ("", "_cpu"):
                a, b = row[f"paged{suffix}_ms"], row[f"slot{suffix}_ms"]
                row[f"paged_over_slot{suffix}"] = a / b if a is not None and b else None
            row.update(step_bytes(config, kind, p, n, c, ps))
            rows_out.append(row)
            _print_step(row)
        state.clear()                            # the caches go before the next context
    return rows_out


STEP_HEADER = (f"{'kind':>8} {'P':>6} {'n':>3} {'paged_ms':>9} {'slot_ms':>8} {'paged/slot':>10} {'cpu ratio':>9} "
               f"{'paged KiB':>10} {'slot KiB':>9} {'prefix KV KiB (paged/slot)':>26}")


def _print_step(r: dict) -> None:
    def f(x, spec):
        return "-" if x is None else format(x, spec)
    print(f"{r['kind']:>8} {r['prefix_len']:>6} {r['branches']:>3} {f(r['paged_ms'], '.3f'):>9} "
          f"{f(r['slot_ms'], '.3f'):>8} {f(r['paged_over_slot'], '.3f'):>10} {f(r['paged_over_slot_cpu'], '.3f'):>9} "
          f"{r['paged_bytes'] / 1024:>10.1f} "
          f"{r['slot_bytes'] / 1024:>9.1f} "
          f"{str(round(r['paged_prefix_kv_bytes'] / 1024, 1)) + ' / ' + str(round(r['slot_prefix_kv_bytes'] / 1024, 1)):>26}",
          flush=True)
