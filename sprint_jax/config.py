"""One config system for the whole project: dataclasses + YAML + dotted overrides.

Every run config (curate, sft, eval, demo) and the model config are dataclasses. `load_config`
builds one from a YAML file and `--set key=value` overrides, and rejects unknown or ill-typed
fields with an error that names the dotted field (docs/design.md "Reliability contract").
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
# configs/ sits at the top of a checkout and installs as sprint_jax/configs (setup.py)
_INSTALLED_CONFIGS = Path(__file__).resolve().parent / "configs"
CONFIG_DIR = _INSTALLED_CONFIGS if _INSTALLED_CONFIGS.is_dir() else REPO_ROOT / "configs"
# the package data (MATH-500, the Qwen2 BPE files, the shipped configs' example data)
DATA_DIR = Path(__file__).resolve().parent / "data"


class ConfigError(ValueError):
    """A config value is missing, unknown or of the wrong type. The message names the field."""


# A decimal number as people write it. PyYAML follows YAML 1.1, which reads `2e-5` and `1.0e6`
# (no dot, or no exponent sign) as strings: a number field takes them as the number they spell.
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _number_from_text(value: Any) -> Any:
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.strip())
    return value


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_dict(annotation, value, prefix=where + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
    if annotation is float:
        value = _number_from_text(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, str):
            number = _number_from_text(value)          # "1e9" -> 1000000000, "2.5" stays an error
            if isinstance(number, float) and math.isfinite(number) and number.is_integer():
                value = int(number)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict, prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and bad types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config field {prefix}{unknown[0]!s}"
            + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + f"; known fields: {', '.join(prefix + k for k in fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config field {prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested mapping, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def config_flags(cls) -> list[tuple[str, str, type, tuple | None]]:
    """(flag, field, type, choices) for every scalar field of dataclass `cls`: command-line flags
    are derived from the config (`max_stages` -> `--max-stages`), never retyped."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        choices = None
        if typing.get_origin(kind) is typing.Literal:
            kind, choices = type(args[0]), tuple(args)
        elif args and typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = args[0]
        if kind in (int, float, str):
            out.append(("--" + f.name.replace("_", "-"), f.name, kind, choices))
    return out


def add_config_flags(parser, cls, defaults: dict[str, str] | None = None) -> None:
    """One flag per scalar field of `cls` (see config_flags); unset flags stay None so the config
    file and --set decide. `defaults` replaces the default shown in --help for some fields."""
    shown = {f.name: f.default for f in dataclasses.fields(cls)} | (defaults or {})
    for flag, field, kind, choices in config_flags(cls):
        parser.add_argument(flag, dest=field, type=kind, default=None, choices=choices,
                            help=f"{cls.__name__}.{field} (default {shown[field]})")


def flag_overrides(args, cls) -> list[str]:
    """`field=value` overrides for the flags of `cls` that were given."""
    return [f"{field}={getattr(args, field)}" for _, field, _, _ in config_flags(cls)
            if getattr(args, field, None) is not None]


def resolve_config_path(path: str | Path) -> Path:
    """`path` as given when it exists; else a relative `configs/NAME` is the shipped config NAME
    (so the README's `--config configs/...` works from any directory of an installed copy)."""
    return resolve_shipped_path(path)


def resolve_shipped_path(path: str | Path) -> Path:
    """A path a command or a shipped config names, resolved as in a checkout from any directory of
    an installed copy: `path` as given when it exists; else a relative `configs/NAME` is the
    shipped config NAME (CONFIG_DIR) and a relative `data/NAME` the package's data file NAME
    (DATA_DIR: the shipped configs' example data); else a path relative to a checkout's root
    (REPO_ROOT). When none exists, `path` as given (the caller says it is missing)."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    shipped = {"configs": CONFIG_DIR, "data": DATA_DIR}.get(path.parts[0]) if path.parts else None
    for candidate in ([shipped.joinpath(*path.parts[1:])] if shipped else []) + [REPO_ROOT / path]:
        if candidate.exists():
            return candidate
    return path


def read_yaml(path: str | Path) -> dict:
    path = resolve_config_path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = (),
                data: dict | None = None) -> T:
    """YAML file (optional) + dotted overrides -> validated dataclass `cls`."""
    merged = dict(data or {})
    if path is not None:
        merged.update(read_yaml(path))
    apply_overrides(merged, overrides)
    return from_dict(cls, merged)
