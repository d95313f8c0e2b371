"""Reading jsonl files of JSON objects: one place for the line-numbered error messages."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def _objects(p: Path, lines, error: type[Exception]) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line of `lines`; anything else raises `error` naming file:line."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise error(f"{p}:{lineno}: expected a JSON object, got {type(record).__name__}")
        yield lineno, record


def iter_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-blank line; anything else raises `error` naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such file" if not p.exists() else f"{p}: not a file")
    try:
        with p.open(encoding="utf-8") as f:
            yield from _objects(p, f, error)
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def require_fields(record: dict, fields: tuple[str, ...], where: str, error: type[Exception] = ValueError) -> None:
    missing = [k for k in fields if k not in record]
    if missing:
        raise error(f"{where}: missing field {missing[0]!r}")


def read_objects_tolerating_cut_end(path: str | Path, error: type[Exception] = ValueError
                                    ) -> tuple[list[tuple[int, dict]], int]:
    """Like `iter_objects`, for a file written line by line by a process that may have been killed:
    a last line with no newline after it that is not valid JSON is skipped. Returns (rows, skipped)."""
    p = Path(path)
    if p.is_file():
        with p.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 1))
            cut = size > 0 and f.read(1) != b"\n"
        if cut:
            lines = p.read_bytes().split(b"\n")
            try:
                json.loads(lines[-1])
            except ValueError:        # JSONDecodeError or not UTF-8: the cut tail of a write
                rows = list(_iter_text(p, b"\n".join(lines[:-1]) + b"\n", error))
                return rows, 1
    return list(iter_objects(p, error)), 0


def _iter_text(p: Path, data: bytes, error: type[Exception]) -> Iterator[tuple[int, dict]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    yield from _objects(p, text.splitlines(), error)
