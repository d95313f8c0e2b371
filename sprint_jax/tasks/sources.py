"""Where task records come from: local files (JSON lines, parquet, arrow) and Hugging Face datasets.

Every reader yields `(where, record)` pairs, `where` naming the file and line/row for error messages.
- `.jsonl` / `.json` (one object per line), `.parquet`, `.arrow` / `.feather`, or a directory written
  by `datasets.Dataset.save_to_disk`: `read_file_records`;
- `source: hf_dataset` (the `datasets` library, the `[datasets]` extra): a hub name (where a hub is
  reachable) or a `save_to_disk` directory, with a split: `read_hf_records`.
A source that cannot be read is a TaskFileError (one line, exit 2), never a traceback.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from sprint_jax.tasks.types import TaskFileError

Records = Iterator[tuple[str, dict]]
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".feather")


def _need(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TaskFileError(f"reading this task source needs the `{module.split('.')[0]}` package: "
                            f"pip install 'sprint-jax[datasets]'") from None


def _rows(rows, where: str) -> Records:
    for i, rec in enumerate(rows):
        if not isinstance(rec, dict):
            raise TaskFileError(f"{where} row {i}: expected a record, got {type(rec).__name__}")
        yield f"{where} row {i}", rec


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def _load_from_disk(p: Path, split: str | None):
    datasets = _need("datasets")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:   # a corrupt or foreign directory
        raise TaskFileError(f"{p}: not a readable saved dataset ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise TaskFileError(f"{p}: a dataset with splits {sorted(ds)}; choose one (split: ...)")
        ds = ds[split]
    return ds


def read_file_records(path: str | Path, split: str | None = None) -> Records:
    """Records of a local task file or saved-dataset directory (see the module docstring)."""
    p = Path(path)
    if _is_saved_dataset(p):
        yield from _rows(_load_from_disk(p, split), str(p))
        return
    if not p.is_file():
        raise TaskFileError(f"task file {str(p)!r} does not exist" if not p.exists()
                            else f"task file {str(p)!r} is not a file (nor a saved dataset directory)")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ""):
        from sprint_jax.jsonl import iter_objects
        for lineno, rec in iter_objects(p, TaskFileError):
            yield f"{p}:{lineno}", rec
        return
    if suffix not in FILE_SUFFIXES:
        raise TaskFileError(f"task file {p}: unknown format {suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")
    pa = _need("pyarrow")
    try:
        if suffix == ".parquet":
            table = _need("pyarrow.parquet").read_table(p)
        else:
            ipc = _need("pyarrow.ipc")
            try:
                table = ipc.open_file(p).read_all()
            except pa.ArrowInvalid:          # datasets writes the streaming form
                table = ipc.open_stream(p).read_all()
    except (pa.ArrowException, OSError) as e:
        raise TaskFileError(f"task file {p}: not readable as {suffix[1:]} ({e})") from None
    yield from _rows(table.to_pylist(), str(p))


def read_hf_records(path: str, split: str = "train", name: str | None = None) -> Records:
    """`source: hf_dataset`: a `save_to_disk` directory, or a dataset name `datasets` can load."""
    p = Path(path)
    if p.is_dir():
        if not _is_saved_dataset(p):
            yield from read_file_records(p, split)    # reports what is wrong with it
            return
        yield from _rows(_load_from_disk(p, split), str(p))
        return
    datasets = _need("datasets")
    try:
        ds = datasets.load_dataset(path, name, split=split)
    except Exception as e:   # unknown name, no network, bad split
        raise TaskFileError(f"hf_dataset {path!r} (split {split!r}): cannot load ({type(e).__name__}: {e})") from None
    yield from _rows(ds, f"{path}[{split}]")


def first_record(path: str | Path) -> dict | None:
    """The first record of a file (None for an empty one): what `--task-kind auto` looks at."""
    for _, rec in read_file_records(path):
        return rec
    return None


__all__ = ["FILE_SUFFIXES", "read_file_records", "read_hf_records", "first_record"]
