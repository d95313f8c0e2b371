"""Shape buckets: the few lengths and widths the engine's programs are compiled at."""
from __future__ import annotations


def bucket(n: int, lo: int) -> int:
    """The smallest lo * 2^k >= n (few shapes compile)."""
    b = lo
    while b < n:
        b *= 2
    return b


def bucket_fine(n: int, lo: int) -> int:
    """The smallest of lo * 2^k and 1.5 * lo * 2^k >= n: prefill lengths and attention reads
    (padding <= 1/3: 80 used slots read as 96, not 128)."""
    b = lo
    while b < n:
        if b * 3 // 2 >= n and (b * 3) % 2 == 0:
            return b * 3 // 2
        b *= 2
    return b


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // page_size)


def page_bucket(n_pages: int, page_size: int, min_bucket: int, cap_tokens: int) -> int:
    """A decode / prefill page-table width for n_pages pages: few shapes compile (`bucket_fine`
    from min_bucket tokens' pages), capped at the pages of `cap_tokens` (the most such a table can
    need: a read past them is pure over-read), never below n_pages."""
    width = bucket_fine(max(n_pages, 1), max(1, min_bucket // page_size))
    return max(min(width, pages_for(cap_tokens, page_size)), n_pages)


def merge_pages(tokens: int, page_size: int, min_bucket: int, cap_tokens: int) -> int:
    """A merge join's page-table width for `tokens` positions: powers of two from min_bucket
    tokens' pages (few shapes), capped at the pages of `cap_tokens` (the parent capacity: no
    merged sequence holds more), never below the pages `tokens` need."""
    need = pages_for(tokens, page_size)
    return max(min(bucket(need, max(1, min_bucket // page_size)), pages_for(cap_tokens, page_size)), need)
