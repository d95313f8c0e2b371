"""The model's prompt format, carried with the model in its export's sprint_jax.json.

`sprint-jax train` records how the prompts it trained on end (`prompt_format_of`); whatever hands a
user's text to the model (`infer`, `generate`, `eval`, `serve`) passes it through
`apply_prompt_format` first, so "Q: 8 5 2 1" typed in a shell reaches a model trained on
"Q: 8 5 2 1\\n" as exactly that.

Only the trailing whitespace is recorded: it is invisible, hard to type as a shell argument, and
part of the format (the body starts on the next line); a visible character every training prompt
happens to end with ("?") is content, which the user's text may rightly lack.
"""
from __future__ import annotations

from typing import Any, Iterable

META_KEY = "prompt_format"      # the key in MODEL/sprint_jax.json


def prompt_format_of(prompts: Iterable[str]) -> dict[str, str] | None:
    """The format of a training set's prompts: {"trailing": S} when every prompt ends in the same
    whitespace S ("" included: none of them ends in whitespace); None when they differ or there
    are no prompts (nothing to apply)."""
    endings = {p[len(p.rstrip()):] for p in prompts}
    return {"trailing": endings.pop()} if len(endings) == 1 else None


def apply_prompt_format(text: str, meta: dict[str, Any]) -> str:
    """`text` as the model was trained to see it: its trailing whitespace replaced by the one of
    `meta["prompt_format"]` (`meta` is the export's sprint_jax.json). Idempotent: a text already in
    the format is unchanged; so is any text for a model without the field (or with null), and a
    text that is only whitespace. A malformed field raises ValueError naming it."""
    fmt = meta.get(META_KEY)
    if fmt is None:
        return text
    trailing = fmt.get("trailing") if isinstance(fmt, dict) else None
    if not isinstance(trailing, str) or trailing.strip():
        raise ValueError(f"{META_KEY} must be {{\"trailing\": WHITESPACE}}, got {fmt!r}")
    if not text.strip():
        return text
    return text.rstrip() + trailing


__all__ = ["META_KEY", "prompt_format_of", "apply_prompt_format"]
