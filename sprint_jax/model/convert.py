"""`sprint-jax convert`: HF safetensors directory <-> orbax checkpoint, both directions.

An orbax model directory holds `config.json` (the HF config, so either format describes the
model the same way), `params/` (an orbax StandardCheckpointer tree in our stacked layout) and any
tokenizer files copied from the source.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax

from sprint_jax.model.config import Qwen2Config
from sprint_jax.dtypes import DTYPE_NAMES, dtype_name, dtype_of
from sprint_jax.model.hf import CheckpointError, load_params, save_params
from sprint_jax.model.qwen2 import Qwen2, abstract_params

DESCRIPTION = """Convert a Qwen2 or Qwen3 checkpoint between the HF safetensors layout and an orbax checkpoint.

  sprint-jax convert --to orbax HF_DIR OUT_DIR     # for sharded training / fast restore
  sprint-jax convert --to hf ORBAX_DIR OUT_DIR     # for transformers / other tools

Tokenizer files (tokenizer.json, vocab.json, merges.txt, tokenizer_config.json, ...) are copied along.
"""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                    "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                    "vocab_tokenizer.json", "chat_template.jinja")


def is_orbax_dir(path: Path) -> bool:
    return (Path(path) / "params").is_dir() and (Path(path) / "config.json").exists()


def save_orbax(config: Qwen2Config, params, path: str | Path) -> None:
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    if (path / "params").exists():
        shutil.rmtree(path / "params")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params)
        ckptr.wait_until_finished()
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))


def _key_name(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _stored_shapes(ckptr, path: Path) -> dict[str, tuple]:
    """Every tensor's name and shape from the checkpoint's metadata. The shapes are checked before
    any restore, so a metadata file that cannot be read is an error, never a skipped check."""
    try:
        meta = ckptr.metadata(path / "params")
    except Exception as e:   # noqa: BLE001 - orbax raises many types for a corrupt or foreign directory
        _quiet_late_tensorstore_callbacks()
        raise CheckpointError(f"{path}: cannot read the orbax metadata of params/ "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    tree = getattr(meta, "item_metadata", meta)
    shapes = {}
    for kp, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(v, "shape", None)
        if shape is None:
            raise CheckpointError(f"{path}: the orbax metadata gives no shape for {_key_name(kp)}")
        shapes[_key_name(kp)] = tuple(shape)
    if not shapes:               # orbax logged a failed read of the metadata and gave none
        _quiet_late_tensorstore_callbacks()
        raise CheckpointError(f"{path}: cannot read the orbax metadata of params/ (it lists no tensor)")
    return shapes


def _quiet_late_tensorstore_callbacks() -> None:
    """After a failed read of an orbax checkpoint, drop the unraisable errors it leaves behind. The
    reads orbax had started for the other files finish later on tensorstore's threads, whose completion
    callback is the (by then closed) restore loop's call_soon_threadsafe: Python printed
    "Exception ignored in: None ... RuntimeError: Event loop is closed" with a traceback under
    the one-line error. Only that exact error, from no object, is dropped; any other goes on to
    the hook that was installed."""
    import sys
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop_callbacks", False):
        return

    def hook(args) -> None:
        if (args.object is None and isinstance(args.exc_value, RuntimeError)
                and str(args.exc_value) == "Event loop is closed"):
            return
        previous(args)

    hook._drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def load_orbax(path: str | Path, param_dtype=None, shardings=None) -> tuple[Qwen2Config, dict]:
    """(config, params) of an orbax model directory. `shardings` (a tree of shardings like the
    params) is the restore target: orbax reads each device's slice straight into place."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    config = Qwen2Config.from_hf_config(path / "config.json")
    if param_dtype is not None:
        config = config.replace(param_dtype=dtype_name(param_dtype))
    target = abstract_params(config)
    if shardings is not None:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        got = _stored_shapes(ckptr, path)
        want = {_key_name(kp): tuple(v.shape) for kp, v in jax.tree_util.tree_flatten_with_path(target)[0]}
        for name, shape in want.items():
            if name not in got:
                raise CheckpointError(f"{path}: missing tensor {name}")
            if got[name] != shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {got[name]}, expected {shape}")
        extra = sorted(set(got) - set(want))
        if extra:
            raise CheckpointError(f"{path}: unknown tensor {extra[0]} (config.json does not describe these params)")
        try:
            params = ckptr.restore(path / "params", target)
        except Exception as e:  # noqa: BLE001 -- orbax/tensorstore raise many types for a damaged tree
            _quiet_late_tensorstore_callbacks()
            text = (str(e).splitlines() or [""])[0][:300]
            raise CheckpointError(f"{path}: cannot read the orbax checkpoint ({type(e).__name__}: {text})") from None
    params = jax.tree.map(lambda a: a.astype(dtype_of(config.param_dtype)), params)
    return config, params


def model_dir_error(path: str | Path) -> str | None:
    """Why `path` is not a model directory (HF or orbax: a directory holding config.json), in one
    line, or None when it is one. A training run's directory points at its export, RUN/hf (a
    recipe stage's at STAGE/out/hf)."""
    path = Path(path)
    if not path.exists():
        return f"model directory not found: {path}"
    if not path.is_dir():
        return f"{path} is a file, not a model directory (an HF or orbax model directory holding config.json)"
    if not (path / "config.json").exists():
        for export in (path / "hf", path / "out" / "hf"):        # a training run's, a recipe stage's
            if (export / "config.json").is_file():
                return f"no config.json at {path / 'config.json'} (a training run's directory? its model is {export})"
        return f"no config.json at {path / 'config.json'}: not an HF or orbax model directory"
    return None


def check_model_dir(path: str | Path, flag: str = "") -> Path:
    """`path` as a Path when it is a model directory, else a UserError (`model_dir_error`),
    prefixed with the flag that named it."""
    from sprint_jax.errors import UserError

    why = model_dir_error(path)
    if why is not None:
        raise UserError(f"{flag}: {why}" if flag else why)
    return Path(path)


def load_model(path: str | Path, param_dtype=None, compute_dtype=None, shardings_fn=None) -> Qwen2:
    """A Qwen2 / Qwen3 model from either an HF directory or an orbax model directory (dtypes as in
    `from_pretrained`: float32 unless given). shardings_fn(config) -> a tree of shardings: each
    tensor goes straight to its devices, read shard by shard (HF: each safetensors tensor is put
    on its sharding as it is read; orbax: restored with the shardings as the target, so every
    device reads only its own slice), so a 7B checkpoint never sits whole on one device."""
    path = check_model_dir(path)
    if is_orbax_dir(path):
        config = Qwen2Config.from_hf_config(path / "config.json")
        shardings = shardings_fn(config) if shardings_fn is not None else None
        config, params = load_orbax(path, param_dtype=param_dtype, shardings=shardings)
    else:
        shardings = shardings_fn(Qwen2Config.from_hf_config(path)) if shardings_fn is not None else None
        config, params = load_params(path, param_dtype=param_dtype, shardings=shardings)
    if compute_dtype is not None:
        config = config.replace(dtype=dtype_name(compute_dtype))
    return Qwen2(config, params=params)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def add_arguments(p) -> None:
    p.add_argument("--to", choices=["orbax", "hf"], required=True, help="target format")
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("dst", help="output directory (created)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="parameter dtype of the output (default: keep the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="HF output: shard files past this size")


def _check_destination(src: Path, dst: Path) -> None:
    """The output must be a new or empty directory, other than the source: never a file, never
    the source itself, never a directory that already holds something (another model's weights,
    a previous conversion): nothing is overwritten or mixed in."""
    from sprint_jax.errors import UserError

    if dst.exists() or dst.is_symlink():
        if dst.exists() and src.exists() and dst.resolve() == src.resolve():
            raise UserError(f"the output {dst} is the source directory: convert writes a new directory")
        if not dst.is_dir():
            raise UserError(f"the output {dst} exists and is not a directory: give a new directory")
        if any(dst.iterdir()):
            held = "a model" if (dst / "config.json").exists() or (dst / "params").exists() else "files"
            raise UserError(f"the output {dst} already holds {held}: convert writes only into a new or empty "
                            "directory (remove it or choose another)")
    elif dst.resolve().is_relative_to(src.resolve()):
        raise UserError(f"the output {dst} is inside the source directory {src}: give a directory outside it")


def run(args) -> int:
    from sprint_jax.errors import UserError

    src, dst = Path(args.src), Path(args.dst)
    check_model_dir(src, "source")
    _check_destination(src, dst)
    dtype = args.dtype
    try:
        if args.to == "orbax":
            if is_orbax_dir(src):
                raise UserError(f"{src} is already an orbax model directory")
            config, params = load_params(src, param_dtype=dtype, progress=True)
            print(f"writing orbax checkpoint to {dst} ...", flush=True)
            save_orbax(config, params, dst)
        else:
            if not is_orbax_dir(src):
                raise UserError(f"{src} is not an orbax model directory (needs config.json and params/)")
            print(f"reading orbax checkpoint {src} ...", flush=True)
            config, params = load_orbax(src, param_dtype=dtype)
            save_params(config, params, dst, max_shard_size=args.max_shard_size, progress=True)
    except CheckpointError as e:
        raise UserError(str(e)) from e
    _copy_tokenizer(src, dst)
    print(f"done: {dst}")
    return 0
