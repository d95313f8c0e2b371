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
# "Q: 8 5 2 1\n" as exactly that. Recorded: the trailing whitespace (invisible, hard to type as a
# shell argument, and part of the format: the body starts on the next line), and a known query
# wrapper (`QUERY_WRAPPERS`, e.g. SPRINT's `<query> ... </query>`) when every prompt is written in
# it. Any other text every training prompt happens to share ("Q: ", a final "?") is content, which
# the user's text may rightly lack or differ in.
META_KEY = "prompt_format"      # the key in MODEL/sprint_jax.json
# curation's `prompt_wrapper` names -> (prefix, suffix) written around the task prompt
QUERY_WRAPPERS = {"query_tags": ("<query> ", " </query>")}


def _wrapped(body: str, prefix: str, suffix: str) -> bool:
    core = body.strip()
    return core.startswith(prefix.strip()) and core.endswith(suffix.strip()) and \
        len(core) >= len(prefix.strip()) + len(suffix.strip())


def wrap_query(text: str, prefix: str, suffix: str) -> str:
    """`text` inside the wrapper: prefix + the text stripped + suffix, then the text's own trailing
    whitespace. A text already wrapped (stripped, it starts with the stripped prefix and ends with
    the stripped suffix) is returned unchanged, so wrapping never doubles; so is an all-whitespace
    text."""
    body = text.rstrip()
    if not body or _wrapped(body, prefix, suffix):
        return text
    return prefix + body.strip() + suffix + text[len(body):]


def unwrap_query(text: str) -> str:
    """`text` with a `QUERY_WRAPPERS` wrapper taken off (the inner text stripped, then the text's
    trailing whitespace); any other text unchanged. What a wrapped training prompt asks, for
    comparing it with a bare task prompt (the training fingerprint)."""
    body = text.rstrip()
    for prefix, suffix in QUERY_WRAPPERS.values():
        if body and _wrapped(body, prefix, suffix):
            core = body.strip()
            return core[len(prefix.strip()):len(core) - len(suffix.strip())].strip() + text[len(body):]
    return text


def prompt_format_of(prompts: Iterable[str]) -> dict[str, str] | None:
    """The format of a training set's prompts: {"trailing": S} when every prompt ends in the same
    whitespace S ("" included: none of them ends in whitespace), plus {"prefix": P, "suffix": X}
    when every prompt, without that whitespace, is exactly P + text + X for one of
    `QUERY_WRAPPERS`; None when there is neither (no prompts, endings differing and no wrapper)."""
    prompts = list(prompts)
    endings = {p[len(p.rstrip()):] for p in prompts}
    out = {"trailing": endings.pop()} if len(endings) == 1 else {}
    for prefix, suffix in QUERY_WRAPPERS.values():
        if prompts and all(p.rstrip().startswith(prefix) and p.rstrip().endswith(suffix)
                           and len(p.rstrip()) > len(prefix) + len(suffix) for p in prompts):
            out.update(prefix=prefix, suffix=suffix)
            break
    return out or None


def _checked(fmt: Any) -> dict[str, str]:
    ok = isinstance(fmt, dict) and set(fmt) <= {"trailing", "prefix", "suffix"} and \
        ("prefix" in fmt) == ("suffix" in fmt) and bool(fmt) and all(isinstance(v, str) for v in fmt.values())
    if ok and "trailing" in fmt:
        ok = not fmt["trailing"].strip()
    if ok and "prefix" in fmt:
        ok = bool(fmt["prefix"].strip() and fmt["suffix"].strip())
    if not ok:
        raise ValueError(f"{META_KEY} must be {{\"trailing\": WHITESPACE}} with optional non-blank "
                         f"\"prefix\" and \"suffix\" strings, got {fmt!r}")
    return fmt


def apply_prompt_format(text: str, meta: dict[str, Any]) -> str:
    """`text` as the model was trained to see it (`meta` is the export's sprint_jax.json): inside
    the recorded query wrapper if there is one (`wrap_query`: a text already wrapped is left as
    it is, never wrapped twice), then its trailing whitespace replaced by the recorded one.
    Idempotent: a text already in the format is unchanged; so is any text for a model without
    the field (or with null), and a text that is only whitespace. A malformed field raises
    ValueError naming it."""
    fmt = meta.get(META_KEY)
    if fmt is None:
        return text
    fmt = _checked(fmt)
    if not text.strip():
        return text
    if "prefix" in fmt:
        text = wrap_query(text, fmt["prefix"], fmt["suffix"])
    return text.rstrip() + fmt["trailing"] if "trailing" in fmt else text


__all__ = ["Step", "Example", "META_KEY", "QUERY_WRAPPERS", "wrap_query", "unwrap_query", "prompt_format_of", "apply_prompt_format"]
