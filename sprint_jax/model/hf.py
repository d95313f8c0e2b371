"""HF checkpoints <-> our params: safetensors read one tensor at a time, written in HF layout.

The conversion is the PARAM_SPECS table in qwen2.py (HF name, transpose or not, our shape):
no per-tensor special cases here. Every tensor's shape is checked before it is reshaped, and a
bad checkpoint (missing tensor, wrong shape, unknown key, config mismatch) fails naming the
tensor and both shapes.

Reading parses the safetensors header ourselves and reads one tensor at a time (pread into a
fresh buffer, no memory map whose touched pages would stay resident), copying it into its slot
of the stacked [layers, ...] host buffer; each finished parameter goes to its devices (with a
target sharding when given) before the next is read: peak host memory stays near one copy.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from sprint_jax.errors import UserError
from sprint_jax.model.config import Qwen2Config
from sprint_jax.dtypes import dtype_name, dtype_of
from sprint_jax.model.qwen2 import Params, ParamSpec, Qwen2, param_specs, tree_get, tree_set

_ST_DTYPES = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(UserError, ValueError):
    """A checkpoint is unreadable or does not match the model: the message names the file or the
    tensor (and both shapes). A UserError, so every command prints it as one line (exit code 2)."""


# ---------------------------------------------------------------------------------------------
# safetensors files
# ---------------------------------------------------------------------------------------------
class SafetensorsFile:
    """Reads tensors from one .safetensors file on demand, each with a plain read into a fresh
    buffer (no memory map)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:      # checked before reading: a crafted length must not allocate
                raise CheckpointError(f"{self.path}: corrupt safetensors header: it claims {n} bytes but the "
                                      f"file has {size} bytes")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: not UTF-8 ({e.reason} at byte "
                                      f"{8 + e.start})") from None
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header: a JSON {type(header).__name__}, "
                                  f"not an object")
        self.header = {k: v for k, v in header.items() if k != "__metadata__"}
        self.offset = 8 + n
        for name, meta in self.header.items():
            self._check_entry(name, meta, size - self.offset)

    def _check_entry(self, name: str, meta: Any, data_bytes: int) -> None:
        """Every tensor's entry is well formed and its bytes lie inside the file (so a crafted header
        can neither allocate past the file nor read another tensor's bytes as its own)."""
        def bad(why: str) -> CheckpointError:
            return CheckpointError(f"{self.path}: tensor {name}: {why}")
        if not isinstance(meta, dict):
            raise bad("header entry is not an object")
        shape, offsets, dtype = meta.get("shape"), meta.get("data_offsets"), meta.get("dtype")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise bad(f"bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise bad(f"bad data_offsets {offsets!r}")
        start, end = offsets
        if not 0 <= start <= end <= data_bytes:
            raise bad(f"data_offsets {offsets} lie outside the file's {data_bytes} data bytes")
        dt = _ST_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if dt is not None:
            want = math.prod(shape) * dt.itemsize
            if end - start != want:
                raise bad(f"shape {shape} of {dtype} needs {want} bytes but data_offsets span {end - start}")

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        meta = self.header[name]
        dt = _ST_DTYPES.get(meta["dtype"])
        if dt is None:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        buf = np.empty(end - start, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset + start)
            got = f.readinto(memoryview(buf))
        if got != end - start:
            raise CheckpointError(f"{self.path}: tensor {name} is truncated")
        return buf.view(dt).reshape(meta["shape"])


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write a .safetensors file (atomically: temp file + rename)."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for name, arr in tensors.items():
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
    os.replace(tmp, path)


def _open_checkpoint(path: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the file holding it (single file or sharded with an index)."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files: dict[str, SafetensorsFile] = {}
        out = {}
        for name, fname in weight_map.items():
            if fname not in files:
                fp = path / fname
                if not fp.exists():
                    raise CheckpointError(f"{index} names {fname} (for {name}) but the file is missing")
                files[fname] = SafetensorsFile(fp)
            out[name] = files[fname]
        return out
    if single.exists():
        f = SafetensorsFile(single)
        return {k: f for k in f.keys()}
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


# ---------------------------------------------------------------------------------------------
# conversion table
# ---------------------------------------------------------------------------------------------
def _from_hf(spec: ParamSpec, config: Qwen2Config, name: str, w: np.ndarray) -> np.ndarray:
    want = spec.hf_shape(config)
    if tuple(w.shape) != tuple(want):
        raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(w.shape)} != expected {tuple(want)} "
                              f"(from config: hidden {config.hidden_size}, heads {config.num_attention_heads}, "
                              f"kv_heads {config.num_key_value_heads}, vocab {config.vocab_size})")
    return (w.T if spec.transpose else w).reshape(spec.shape(config))


def _to_hf(spec: ParamSpec, config: Qwen2Config, p: np.ndarray) -> np.ndarray:
    hs = spec.hf_shape(config)
    if spec.transpose:
        return np.ascontiguousarray(p.reshape(hs[::-1]).T)
    return np.ascontiguousarray(p.reshape(hs))


def hf_names(spec: ParamSpec, config: Qwen2Config) -> list[str]:
    if spec.per_layer:
        return [spec.hf_name.format(i=i) for i in range(config.num_hidden_layers)]
    return [spec.hf_name]


_IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)


def _check_tied_head(where: dict[str, SafetensorsFile], path: Path) -> None:
    """tie_word_embeddings: true means lm_head IS the embedding. A checkpoint that also carries an
    lm_head tensor of other values was trained untied: loading it tied would silently drop its
    head, so it is refused (an identical copy, as some exporters write, is fine)."""
    emb = where["model.embed_tokens.weight"].get("model.embed_tokens.weight")
    head = where["lm_head.weight"].get("lm_head.weight")
    same = emb.shape == head.shape and (np.array_equal(emb.view(np.uint8), head.view(np.uint8))
                                        if emb.dtype == head.dtype else
                                        np.array_equal(emb.astype(np.float32), head.astype(np.float32)))
    if not same:
        raise CheckpointError(f"{path}: config.json says tie_word_embeddings: true but the checkpoint has an "
                              f"lm_head.weight that differs from model.embed_tokens.weight; set "
                              f"tie_word_embeddings: false to use it")


def load_params(path: str | Path, config: Qwen2Config | None = None, param_dtype=None,
                shardings: Params | None = None, progress: bool = False) -> tuple[Qwen2Config, Params]:
    """Read an HF checkpoint directory into (config, params dict).

    param_dtype: the dtype the parameters are held in (default: the config's param_dtype,
    float32 unless `config` says otherwise; the file's storage dtype does not decide it).
    shardings: an optional tree of jax.sharding.Sharding matching the params; each tensor then
    goes straight to its devices.
    """
    path = Path(path)
    file_cfg = Qwen2Config.from_hf_config(path)
    if config is None:
        config = file_cfg
    else:
        for f in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
            if getattr(config, f) != getattr(file_cfg, f):
                raise CheckpointError(f"config mismatch: {f} = {getattr(config, f)} but the checkpoint's "
                                      f"config.json says {getattr(file_cfg, f)}")
    if param_dtype is not None:
        config = config.replace(param_dtype=dtype_name(param_dtype))
    np_dtype = np.dtype(dtype_of(config.param_dtype))
    where = _open_checkpoint(path)
    specs = param_specs(config)
    required: set[str] = set()
    for spec in specs:
        required.update(hf_names(spec, config))
    allowed = required | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if config.tie_word_embeddings and "lm_head.weight" in where:
        _check_tied_head(where, path)
    unknown = sorted(k for k in where if k not in allowed and not k.endswith(_IGNORED_HF_TENSORS))
    if unknown:
        raise CheckpointError(f"unknown tensor {unknown[0]} in {path}"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    missing = sorted(k for k in required if k not in where)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]} in {path}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    params: Params = {}
    it: Iterable = specs
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(len(hf_names(s, config)) for s in specs), desc="loading", unit="tensor")
    for spec in it:
        names = hf_names(spec, config)
        buf = np.empty(spec.full_shape(config), np_dtype)
        for i, name in enumerate(names):
            w = _from_hf(spec, config, name, where[name].get(name))
            if spec.per_layer:
                buf[i] = w.astype(np_dtype)
            else:
                buf[...] = w.astype(np_dtype)
            if bar:
                bar.update(1)
        if shardings is not None:
            arr = jax.device_put(buf, tree_get(shardings, spec.path))
        else:
            arr = jnp.asarray(buf)
        del buf
        tree_set(params, spec.path, arr)
    if bar:
        bar.close()
    return config, params


def from_pretrained(path: str | Path, *, param_dtype=None, compute_dtype=None, config: Qwen2Config | None = None,
                    shardings: Params | None = None, progress: bool = False) -> Qwen2:
    """Load a local HF Qwen2 / Qwen3 directory (config.json + model.safetensors[.index.json]) as `Qwen2`.

    param_dtype: what the parameters are held in; compute_dtype: what activations and the KV
    cache are computed in (logits are float32 either way). Each defaults to the config's value,
    float32, whatever dtype the checkpoint files store. A bf16 model: both bfloat16.
    """
    config, params = load_params(path, config=config, param_dtype=param_dtype, shardings=shardings,
                                 progress=progress)
    if compute_dtype is not None:
        config = config.replace(dtype=dtype_name(compute_dtype))
    return Qwen2(config, params=params)


def parse_size(s: int | str) -> int:
    """A byte count: an int as is, or a string such as "5GB", "500MB", "64KB", "10B" or "1234"
    (decimal units, HF's `max_shard_size` convention). A malformed string raises ValueError."""
    if isinstance(s, int):
        return s
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def save_params(config: Qwen2Config, params: Params, path: str | Path, max_shard_size: int | str = "5GB",
                dtype=None, progress: bool = False) -> None:
    """Write params as an HF checkpoint directory that `transformers` loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    limit = parse_size(max_shard_size)
    out_dtype = np.dtype(dtype_of(dtype)) if dtype is not None else None
    hf_cfg = config.to_hf_config()
    current: dict[str, np.ndarray] = {}       # the shard being filled
    size = 0
    shard_files: list[Path] = []

    def flush():
        nonlocal current, size
        if current:
            tmpname = path / f"_shard{len(shard_files)}.safetensors"
            write_safetensors(tmpname, current)
            shard_files.append(tmpname)
            current, size = {}, 0

    weight_map: dict[str, int] = {}
    specs = param_specs(config)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(len(hf_names(s, config)) for s in specs), desc="saving", unit="tensor")
    for spec in specs:
        full = np.asarray(jax.device_get(tree_get(params, spec.path)))
        if out_dtype is not None:
            full = full.astype(out_dtype)
        for i, name in enumerate(hf_names(spec, config)):
            t = _to_hf(spec, config, full[i] if spec.per_layer else full)
            nbytes = t.size * t.dtype.itemsize
            if size and size + nbytes > limit:
                flush()
            current[name] = t
            weight_map[name] = len(shard_files)
            size += nbytes
            if bar:
                bar.update(1)
        del full
    flush()
    if bar:
        bar.close()
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if len(shard_files) == 1:
        os.replace(shard_files[0], path / "model.safetensors")
    else:
        n = len(shard_files)
        names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for f, nm in zip(shard_files, names):
            os.replace(f, path / nm)
        total = sum((path / nm).stat().st_size for nm in names)
        index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in weight_map.items()}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if out_dtype is not None:
        hf_cfg["torch_dtype"] = dtype_name(out_dtype)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))


def save_pretrained(model: Qwen2, path: str | Path, max_shard_size: int | str = "5GB", dtype=None,
                    progress: bool = False) -> None:
    """Write an nnx `Qwen2` as HF safetensors (sharded with an index past max_shard_size)."""
    save_params(model.config, model.params, path, max_shard_size=max_shard_size, dtype=dtype, progress=progress)


# ---------------------------------------------------------------------------------------------
# What sprint-jax knows about an export beyond the HF files
# ---------------------------------------------------------------------------------------------
EXPORT_META_FILE = "sprint_jax.json"   # one dict written by `train` into its HF export


def read_export_meta(path: str | Path) -> dict[str, Any]:
    """The export's sprint_jax.json; {} for a directory without one (an older export, or a
    checkpoint sprint-jax did not train). Readers use `.get(key)` with their documented default."""
    f = Path(path) / EXPORT_META_FILE
    if not f.is_file():
        return {}
    try:
        meta = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{f}: expected a JSON object")
    return meta


def update_export_meta(path: str | Path, **fields: Any) -> None:
    """Add `fields` to the export's sprint_jax.json (other keys are kept)."""
    meta = read_export_meta(path)
    meta.update(fields)
    from sprint_jax.fsutil import write_atomic
    write_atomic(Path(path) / EXPORT_META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
