"""Capacities checked against the model and the machine before anything is allocated.

A row length or cache size far past what the machine holds would take its memory until the kernel
kills the process, and a context past the model's `max_position_embeddings` builds a cache no
position of which the model was trained for. These checks run first and fail with one line naming
the setting.
"""
from __future__ import annotations

import os

from sprint_jax.errors import UserError

GiB = 1024 ** 3


def check_positions(config, tokens: int, setting: str) -> None:
    """`tokens` positions (a context or row length) must be within the model's trained range."""
    if tokens < 1:
        raise UserError(f"{setting} must be >= 1, got {tokens}")
    if tokens > config.max_position_embeddings:
        raise UserError(f"{setting} = {tokens} is more than the model's max_position_embeddings "
                        f"({config.max_position_embeddings}): the model has no trained positions past that")


def kv_cache_bytes(config, tokens: int) -> int:
    """Bytes of K and V for `tokens` positions over every layer, in the compute dtype."""
    itemsize = 2 if config.dtype == "bfloat16" else 4
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * tokens * itemsize


BRANCH_TAG_ROOM = 32    # positions an executor branch holds beyond its token budget: the forced opening tag


def engine_cache_tokens(seqs: int, max_seq_len: int, max_prompts: int, max_branch_tokens: int) -> int:
    """KV positions of an engine for `seqs` concurrent runs: each a context of `max_seq_len` plus
    `max_prompts` executor branches of `max_branch_tokens` (and the forced opening tag)."""
    return seqs * (max_seq_len + max_prompts * (max_branch_tokens + BRANCH_TAG_ROOM))


def available_memory_bytes() -> int | None:
    """Free memory of the first device (accelerator memory, or host RAM on CPU); None if unknown."""
    try:
        import jax

        dev = jax.devices()[0]
        if dev.platform != "cpu":
            stats = dev.memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            return None
        pages, page = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return int(pages) * int(page)
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def check_memory(needed: int, what: str, fix: str) -> None:
    """Refuse an allocation of `needed` bytes that cannot fit in the device's free memory."""
    free = available_memory_bytes()
    if free is not None and needed > free:
        raise UserError(f"{what} needs about {needed / GiB:.1f} GiB but the device has {free / GiB:.1f} GiB free; {fix}")


__all__ = ["check_positions", "kv_cache_bytes", "BRANCH_TAG_ROOM", "engine_cache_tokens", "available_memory_bytes", "check_memory"]
