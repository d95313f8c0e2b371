"""Tokenizers: from a checkpoint directory, or the Qwen2 BPE built from ../shared/data.

transformers 5 silently ignores `vocab_file=`/`merges_file=`; we pass `vocab=`/`merges=` and
register the special tokens, which are not in vocab.json (see shared/data/SOURCES.md).
"""
from __future__ import annotations

import os
from pathlib import Path

from sprint_jax.config import REPO_ROOT

# Qwen2.5 special tokens, ids 151643.. in this order (SOURCES.md: same ids up to 151664).
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)


def shared_data_dir() -> Path:
    """../shared/data beside the repo, or $SPRINT_JAX_DATA."""
    env = os.environ.get("SPRINT_JAX_DATA")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


def qwen2_tokenizer(extra_special_tokens: list[str] | tuple[str, ...] = ()):
    """The Qwen2 byte-level BPE tokenizer (151,643 merges vocabulary) + its special tokens."""
    from transformers import Qwen2Tokenizer

    d = shared_data_dir() / "qwen2_tokenizer"
    vocab, merges = d / "vocab.json", d / "merges.txt"
    for f in (vocab, merges):
        if not f.exists():
            raise FileNotFoundError(f"Qwen2 tokenizer file missing: {f} (set SPRINT_JAX_DATA to the data dir)")
    tok = Qwen2Tokenizer(vocab=str(vocab), merges=str(merges), unk_token=None, bos_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    specials = [t for t in QWEN2_SPECIAL_TOKENS if t not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": specials + list(extra_special_tokens)})
    return tok


def load_tokenizer(path: str | Path):
    """AutoTokenizer from a checkpoint directory."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer directory not found: {p}")
    return AutoTokenizer.from_pretrained(str(p))
