"""What training data and a trained model's prompts look like, for every stage that writes or reads them.

Curation writes `Example`s (sprint.jsonl / rft.jsonl) built from `Step`s; training reads them and
records in the model's export how its prompts end (`prompt_format_of`, under `META_KEY`); whatever
hands a user's text to the model passes it through `apply_prompt_format` first. The SPRINT tag
grammar inside a completion is `sprint_jax.format`'s.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable


# ---------------------------------------------------------------------------------------------
# Training examples
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Step:
    """S_i = (P_i, E_i) (paper §4): a plan and an execution; execution == "" means plan-only."""
    plan: str
    execution: str = ""

    @property
    def plan_only(self) -> bool:
        return not self.execution.strip()


@dataclasses.dataclass
class Example:
    """One SFT example as written to sprint.jsonl / rft.jsonl.

    `prompt` is the query as the model sees it; `completion` is what the model must write (the
    tagged SPRINT body, or the serial RFT trace + final answer). The trainer labels prompt tokens
    "query" and derives every other label from sprint_jax.format.span_labels(completion).
    """
    id: str
    kind: str                        # "sprint" | "rft"
    prompt: str
    completion: str
    answer: Any = None
    meta: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Example":
        return cls(**d)

    @classmethod
    def from_record(cls, d: dict, where: str, error: type[Exception] = ValueError) -> "Example":
        """A jsonl record read from a training file, checked: id, kind ("sprint" or "rft"), prompt
        and completion (strings) present, meta an object or absent; other keys are ignored. A bad
        record raises `error` naming `where` (file:line)."""
        missing = [k for k in ("id", "kind", "prompt", "completion") if k not in d]
        if missing:
            raise error(f"{where}: missing field {missing[0]!r}")
        for k in ("prompt", "completion"):
            if not isinstance(d[k], str):
                raise error(f"{where}: field {k!r} must be a string")
        if d["kind"] not in ("sprint", "rft"):
            raise error(f"{where}: kind must be 'sprint' or 'rft', got {d['kind']!r}")
        if d.get("meta") is not None and not isinstance(d["meta"], dict):
            raise error(f"{where}: field 'meta' must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and not (k == "meta" and v is None)})


# ---------------------------------------------------------------------------------------------
# The prompt format, carried with the model in its export's sprint_jax.json
# ---------------------------------------------------------------------------------------------
# `sprint-jax train` records how the prompts it trained on end; `infer`, `generate`, `eval` and
# `serve` apply that to a user's text, so "Q: 8 5 2 1" typed in a shell reaches a model trained on
# "Q: 8 5 2 1\n" as exactly that. Only the trailing whitespace is recorded: it is invisible, hard
# to type as a shell argument, and part of the format (the body starts on the next line); a
# visible character every training prompt happens to end with ("?") is content, which the user's
# text may rightly lack.
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


__all__ = ["Step", "Example", "META_KEY", "prompt_format_of", "apply_prompt_format"]
