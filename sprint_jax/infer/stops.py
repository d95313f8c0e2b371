"""Incremental stop-string detection over a growing token sequence.

Decoding the whole generation after every chunk, and then every prefix of it, costs O(n^2) host
work on long traces. `StopScanner` decodes only the tokens since its last anchor (plus a few
tokens of left context, so tokenizers that treat the first token specially decode the same
text), and keeps the last `len(longest stop) - 1` characters before the anchor, which is all a
stop string ending in the new text can reach back to. The anchor moves forward after every
feed unless the text ends in an incomplete UTF-8 character ("\\ufffd"), so the decoded window
stays a few tokens long however long the generation grows.

The answer is the same as the quadratic definition: the smallest k such that
decode(tokens[:k]) contains a stop string (tests/test_stops.py checks it against that).
"""
from __future__ import annotations

from typing import Callable, Sequence

_CONTEXT_TOKENS = 4   # tokens of left context decoded with every window


class StopScanner:
    """Feed generated tokens chunk by chunk; `feed` returns where the first stop string ends.

    `decode` maps token ids to text (the tokenizer's decode). `chars_decoded` counts the
    characters every decode call returned (what the flat-cost test measures).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self._decode = decode
        self.stops = [s for s in stops if s]
        self._keep = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self._anchor = 0          # text of tokens[:anchor] is final
        self._ctx = 0             # decode windows start here (<= anchor)
        self._ctx_text = ""       # decode(tokens[ctx:anchor])
        self._tail = ""           # last `keep` characters of decode(tokens[:anchor])
        self.chars_decoded = 0

    def _text(self, end: int) -> str:
        """decode(tokens[anchor:end]) as it appears inside decode(tokens[:end])."""
        window = self._decode(self.tokens[self._ctx:end])
        self.chars_decoded += len(window)
        if window.startswith(self._ctx_text):
            return window[len(self._ctx_text):]
        # the context decodes differently with the new tokens after it (rare): decode from 0
        full = self._decode(self.tokens[:end])
        head = self._decode(self.tokens[:self._anchor])
        self.chars_decoded += len(full) + len(head)
        return full[len(head):] if full.startswith(head) else full

    def _hit(self, text: str) -> bool:
        window = self._tail + text
        return any(s in window for s in self.stops)

    def feed(self, new_tokens: Sequence[int]) -> int | None:
        """Append new tokens. Returns k, the token count whose text first contains a stop (the
        stop ends in token k-1, which is among the new tokens), or None."""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in new_tokens)
        if not self.stops or len(self.tokens) == start:
            return None
        text = self._text(len(self.tokens))
        if self._hit(text):
            for k in range(start + 1, len(self.tokens) + 1):
                if self._hit(self._text(k)):
                    return k
            return len(self.tokens)  # pragma: no cover - the whole window hit, so some k does
        if not text.endswith("\ufffd"):
            self._advance(text)
        return None

    def _advance(self, text: str) -> None:
        self._tail = (self._tail + text)[-self._keep:] if self._keep else ""
        self._anchor = len(self.tokens)
        self._ctx = max(0, self._anchor - _CONTEXT_TOKENS)
        self._ctx_text = self._decode(self.tokens[self._ctx:self._anchor])
        self.chars_decoded += len(self._ctx_text)
