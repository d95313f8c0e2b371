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
