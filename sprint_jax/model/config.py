"""Decoder config for the Qwen2 and Qwen3 families: built from an HF `config.json`, presets in configs/.

The two families share one model code; `FAMILIES` holds what differs (q/k/v biases, the per-head
q/k RMSNorm, HF's default head_dim). Only what the architecture needs is kept; HF features we do
not implement (sliding-window attention switched on, rope scaling, Qwen3 attention_bias) are
rejected with an error that names the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from sprint_jax.config import CONFIG_DIR, ConfigError
from sprint_jax.dtypes import DType


@dataclasses.dataclass(frozen=True)
class Family:
    """What one HF `model_type` changes in the shared decoder."""
    architecture: str               # HF class written into an exported config.json
    qkv_bias: bool                  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool                   # per-head RMSNorm on q and k before RoPE (Qwen3)
    default_head_dim: int | None    # HF's head_dim when config.json has none (None: hidden / heads)


FAMILIES: dict[str, Family] = {
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, default_head_dim=None),
    "qwen3": Family("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, default_head_dim=128),
}

# HF's storage dtype of the checkpoint files (transformers writes "dtype" or "torch_dtype"). It is
# not our compute dtype (nor our parameter dtype): those are chosen by the caller, e.g.
# from_pretrained(param_dtype=..., compute_dtype=...), and default to float32.
_HF_STORAGE_DTYPE_KEYS = ("dtype", "torch_dtype")


def check_values(cfg) -> None:
    """Values that cannot be right, rejected by name (bad input: `rope_theta: "nan"` and
    `rms_norm_eps: -1` used to load, and every output was NaN)."""
    def number(name: str) -> float:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{name} must be a number, got {v!r}")
        return float(v)
    for name in ("rope_theta", "rms_norm_eps"):
        v = number(name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{name} must be a finite number > 0, got {getattr(cfg, name)!r}")
    if not isinstance(cfg.tie_word_embeddings, bool):
        raise ConfigError(f"tie_word_embeddings must be true or false, got {cfg.tie_word_embeddings!r}")
    if isinstance(cfg.max_position_embeddings, bool) or not isinstance(cfg.max_position_embeddings, int) \
            or cfg.max_position_embeddings < 1:
        raise ConfigError(f"max_position_embeddings must be a positive integer, got {cfg.max_position_embeddings!r}")
    for name in ("bos_token_id", "eos_token_id"):
        v = getattr(cfg, name)
        for i in (v if isinstance(v, (tuple, list)) else () if v is None else (v,)):
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.vocab_size:
                raise ConfigError(f"{name} {i!r} is not a token id of a {cfg.vocab_size}-token vocabulary")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """One decoder of either family (`model_type`); the name predates Qwen3 and is kept for imports."""

    vocab_size: int                    # rows of the embedding table (152064 for the 7B models)
    hidden_size: int                   # model width E
    intermediate_size: int             # SwiGLU inner width
    num_hidden_layers: int             # decoder layers L (stacked under lax.scan)
    num_attention_heads: int           # query heads H
    num_key_value_heads: int           # KV heads (grouped-query attention: H % Hkv == 0)
    model_type: str = "qwen2"          # decoder family, a key of FAMILIES ("qwen2" | "qwen3")
    head_dim: int = 0                  # per-head width; 0 means hidden_size // num_attention_heads
    rope_theta: float = 10000.0        # RoPE base
    rms_norm_eps: float = 1e-6         # RMSNorm epsilon
    tie_word_embeddings: bool = False  # lm_head shares the embedding table
    max_position_embeddings: int = 32768  # longest position the model was trained for
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    param_dtype: DType = "float32"     # dtype the parameters are held in
    dtype: DType = "float32"           # compute dtype: activations and the KV cache (bf16 for speed)

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type must be one of {', '.join(map(repr, FAMILIES))}, "
                              f"got {self.model_type!r}")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        check_values(self)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    def replace(self, **kw) -> "Qwen2Config":
        return dataclasses.replace(self, **kw)

    # ---- HF config.json <-> Qwen2Config ----------------------------------------------------
    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | dict[str, Any], **overrides) -> "Qwen2Config":
        """Build from an HF config.json (a path to the file or its directory, or the dict)."""
        if isinstance(path_or_dict, dict):
            d, where = dict(path_or_dict), "config"
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                # a training run's directory: its model is RUN/hf (a recipe stage's: STAGE/out/hf)
                export = next((e for e in (p.parent / "hf", p.parent / "out" / "hf") if (e / "config.json").is_file()), None)
                hint = f" (a training run's directory? its model is {export})" if export else ""
                raise ConfigError(f"no config.json at {p}{hint}" if not p.exists() else f"{p} is not a file")
            try:
                d = json.loads(p.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}: not valid JSON: {e}") from e
            if not isinstance(d, dict):
                raise ConfigError(f"{p}: expected a JSON object, got {type(d).__name__}")
            where = str(p)
        mt = d.get("model_type", "qwen2")
        if mt not in FAMILIES:
            raise ConfigError(f"{where}: model_type must be one of {', '.join(map(repr, FAMILIES))}, "
                              f"got {mt!r}")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported "
                              "(sliding-window attention is not implemented)")
        sliding = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
        if sliding:
            raise ConfigError(f"{where}: layer_types holds {', '.join(map(repr, sliding))}; only "
                              "'full_attention' is supported (sliding-window attention is not implemented)")
        if mt == "qwen3" and d.get("attention_bias"):
            raise ConfigError(f"{where}: attention_bias=true is not supported for qwen3 "
                              "(biases on q/k/v/o projections are not implemented)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act must be 'silu', got {act!r}")
        theta = d.get("rope_theta")
        for key in ("rope_scaling", "rope_parameters"):
            rp = d.get(key)
            if rp:
                rtype = rp.get("rope_type", rp.get("type", "default"))
                if rtype != "default":
                    raise ConfigError(f"{where}: {key}.rope_type={rtype!r} is not supported "
                                      "(only plain RoPE is implemented)")
                theta = rp.get("rope_theta", theta)
        # other HF keys (bookkeeping, generation settings) carry nothing the architecture needs;
        # the architectural ones we do not implement were rejected above
        known = {f.name for f in dataclasses.fields(cls)} - set(_HF_STORAGE_DTYPE_KEYS)
        kwargs = {k: v for k, v in d.items() if k in known}
        # every rope_theta written (top level and inside rope_parameters) must be usable, not just the one read
        thetas = [v for v in (d.get("rope_theta"), *(rp.get("rope_theta") for rp in
                  (d.get("rope_scaling"), d.get("rope_parameters")) if isinstance(rp, dict))) if v is not None]
        for v in thetas:
            try:
                ok = not isinstance(v, bool) and math.isfinite(float(v)) and float(v) > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ConfigError(f"{where}: rope_theta must be a finite number > 0, got {v!r}")
        kwargs["model_type"] = mt
        if d.get("head_dim") is None and FAMILIES[mt].default_head_dim is not None:
            kwargs["head_dim"] = FAMILIES[mt].default_head_dim
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
        kwargs["tie_word_embeddings"] = tie
        kwargs.update(overrides)
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from e

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json transformers needs to load the exported checkpoint."""
        out = {
            "architectures": [self.family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "torch_dtype": self.param_dtype,
            "attention_dropout": 0.0,
        }
        if not self.qkv_bias:
            out["attention_bias"] = False  # Qwen3's flag for biases on q/k/v/o
        return out

    @classmethod
    def preset(cls, name: str, **overrides) -> "Qwen2Config":
        """A model preset from configs/ by name, e.g. 'r1-distill-qwen-7b', 'qwen3-8b', 'tiny'."""
        path = CONFIG_DIR / f"model_{name}.json"
        if not path.exists():
            names = sorted(p.stem[len("model_"):] for p in CONFIG_DIR.glob("model_*.json"))
            raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(names)}")
        return cls.from_hf_config(path, **overrides)


def resolve_model_config(spec: str | dict, **overrides) -> Qwen2Config:
    """A preset name, a path to config.json / an HF directory, or a dict."""
    if isinstance(spec, dict):
        return Qwen2Config.from_hf_config(spec, **overrides)
    p = Path(spec)
    if p.exists():
        return Qwen2Config.from_hf_config(p, **overrides)
    return Qwen2Config.preset(spec, **overrides)
