"""Shared fixtures: tiny real HF Qwen2 checkpoints written by transformers itself."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sprint_jax.config import CONFIG_DIR

# The one tiny test model: configs/model_tiny.json (`Qwen2Config.preset("tiny")`). Odd sizes catch
# transposes (STYLE.md habit 5). Here as HF Qwen2Config keyword arguments.
TINY_HF = {k: v for k, v in json.loads((CONFIG_DIR / "model_tiny.json").read_text()).items()
           if k not in ("model_type", "tie_word_embeddings")}


def make_hf_checkpoint(path: Path, tied: bool = False, seed: int = 0, **overrides) -> Path:
    """Build a random Qwen2ForCausalLM with transformers (random biases and norms too) and save it."""
    import torch
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = HFConfig(**{**TINY_HF, **overrides}, tie_word_embeddings=tied, attn_implementation="eager",
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return Path(path)


def load_hf(path: Path, dtype=None):
    import torch
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(path, attn_implementation="eager",
                                            dtype=dtype or torch.float32).eval()


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_untied"), tied=False, seed=0)


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf_tied"), tied=True, seed=1)


def tiny_vocab_tokenizer(size: int = 307):
    """A VocabTokenizer covering every id of the tiny model (random models emit any id)."""
    import string

    from sprint_jax.model.tokenizer import VocabTokenizer

    base = ["<pad>", "<bos>", "<eos>"] + list(string.printable[:95]) + ["\n"]
    extra = [f"<t{i}>" for i in range(size - len(base))]
    return VocabTokenizer(base + extra, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")
