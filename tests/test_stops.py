"""Incremental stop detection against the quadratic definition, and its cost.

A byte-level BPE tokenizer (transformers' Qwen2Tokenizer over the 256 byte symbols, built here)
splits multi-byte characters across tokens, so windows that end inside a character are exercised.
"""
from __future__ import annotations

import numpy as np
import pytest

from sprint_jax.infer.stops import StopScanner


@pytest.fixture(scope="module")
def byte_bpe():
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[i]: i for i in range(256)}
    merges = [("<", "/"), ("e", "x"), ("/", "ex"), ("ex", ">"), ("Ġ", "t")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=None,
                          pad_token=None)


def _reference(decode, tokens, stops):
    """The definition: the smallest k such that decode(tokens[:k]) contains a stop string."""
    for k in range(1, len(tokens) + 1):
        text = decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return None


WORDS = ["the", " t", "</ex>", "é", "日本", " ✓", "</", "ex", ">", "\n", " sum", "ex>"]


def test_scanner_equals_the_quadratic_definition(byte_bpe):
    decode = lambda ids: byte_bpe.decode(ids)  # noqa: E731
    rng = np.random.default_rng(0)
    hits = 0
    for trial in range(150):
        text = "".join(rng.choice(WORDS) for _ in range(int(rng.integers(1, 25))))
        tokens = byte_bpe.encode(text, add_special_tokens=False)
        stops = [str(s) for s in rng.choice(["</ex>", "日本", "é ✓", "\n</", "zzz", "x>\n", "t"],
                                            size=int(rng.integers(1, 3)), replace=False)]
        scanner = StopScanner(decode, stops)
        got, pos = None, 0
        while pos < len(tokens) and got is None:
            n = int(rng.integers(1, 9))
            got = scanner.feed(tokens[pos: pos + n])
            pos += n
        assert got == _reference(decode, tokens, stops), (text, stops)
        hits += got is not None
    assert 30 < hits < 150  # both outcomes are exercised


def test_host_work_per_chunk_stays_flat_over_20k_tokens(byte_bpe):
    """Characters decoded per 16-token chunk: the last chunks of a 20k-token generation cost what
    the first ones do (the old scan decoded the whole generation every chunk: ~1000x more)."""
    rng = np.random.default_rng(1)
    text = "".join(rng.choice(WORDS[:3] + WORDS[4:6] + WORDS[9:11]) for _ in range(9000))
    tokens = byte_bpe.encode(text, add_special_tokens=False)[:20000]
    assert len(tokens) == 20000
    scanner = StopScanner(byte_bpe.decode, ["</Plan_1>", "</Final Answer>"])
    per_chunk = []
    for pos in range(0, len(tokens), 16):
        before = scanner.chars_decoded
        assert scanner.feed(tokens[pos: pos + 16]) is None
        per_chunk.append(scanner.chars_decoded - before)
    early, late = np.mean(per_chunk[:100]), np.mean(per_chunk[-100:])
    assert late <= 1.3 * early, (early, late)
    # linear in total: a bounded number of characters decoded per character generated
    assert scanner.chars_decoded <= 4 * len(byte_bpe.decode(tokens))
