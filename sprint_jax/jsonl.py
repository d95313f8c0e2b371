"""Reading jsonl files of JSON objects: one place for the line-numbered error messages."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def iter_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line; anything else raises `error` naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise error(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict):
                    raise error(f"{p}:{lineno}: expected a JSON object, got {type(record).__name__}")
                yield lineno, record
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def require_fields(record: dict, fields: tuple[str, ...], where: str, error: type[Exception] = ValueError) -> None:
    missing = [k for k in fields if k not in record]
    if missing:
        raise error(f"{where}: missing field {missing[0]!r}")
