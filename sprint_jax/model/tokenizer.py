"""Tokenizers: from a checkpoint directory, the Qwen2 BPE the package carries, one token per byte
(`byte_tokenizer`) or per listed string (`VocabTokenizer`); and what every tokenizer is asked
through the HF call convention (`eos_id`, `pad_id`, `encode_with_offsets`).

The Qwen2 vocab.json + merges.txt ship as package data (sprint_jax/data/qwen2_tokenizer, Apache-2.0;
sprint_jax/data/SOURCES.md). transformers 5 silently ignores `vocab_file=`/`merges_file=`; we pass
`vocab=`/`merges=` and register the special tokens, which are not in vocab.json.
"""
from __future__ import annotations

import os
from pathlib import Path

from sprint_jax.errors import UserError

DATA_ENV = "SPRINT_JAX_DATA"

# Qwen2.5 special tokens, ids 151643.. in this order (SOURCES.md: same ids up to 151664).
QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)


def data_dir() -> Path:
    """The data files the package carries (sprint_jax/data), or $SPRINT_JAX_DATA when set (a
    directory with the same layout: math500.jsonl, qwen2_tokenizer/{vocab.json,merges.txt})."""
    env = os.environ.get(DATA_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "data"


def data_file(relative: str) -> Path:
    """A file under `data_dir()`; a missing one is a UserError naming where it was looked for."""
    path = data_dir() / relative
    if not path.is_file():
        where = f"${DATA_ENV}={os.environ[DATA_ENV]}" if os.environ.get(DATA_ENV) else "the package data"
        raise UserError(f"{relative} not found at {path} ({where}); reinstall sprint-jax or fix ${DATA_ENV}")
    return path


def qwen2_tokenizer(extra_special_tokens: list[str] | tuple[str, ...] = ()):
    """The Qwen2 byte-level BPE tokenizer (151,643 merges vocabulary) + its special tokens."""
    from transformers import Qwen2Tokenizer

    vocab, merges = data_file("qwen2_tokenizer/vocab.json"), data_file("qwen2_tokenizer/merges.txt")
    tok = Qwen2Tokenizer(vocab=str(vocab), merges=str(merges), unk_token=None, bos_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    specials = [t for t in QWEN2_SPECIAL_TOKENS if t not in tok.get_vocab()]
    tok.add_special_tokens({"additional_special_tokens": specials + list(extra_special_tokens)})
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what a ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer():
    """An HF fast tokenizer with one token per UTF-8 byte (id = byte value) + EOS 256 and PAD 257.

    For tiny models trained from scratch (vocab >= 258) with real text: no merges, exact offsets,
    and `save_pretrained` writes a directory that `AutoTokenizer` reloads.
    """
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    assert fast.eos_token_id == 256 and fast.pad_token_id == 257, (fast.eos_token_id, fast.pad_token_id)
    return fast


def eos_id(tokenizer) -> int:
    """The tokenizer's EOS id; a tokenizer without one is a UserError (the trainer ends every
    completion with EOS)."""
    e = getattr(tokenizer, "eos_token_id", None)
    if e is None:
        raise UserError("the tokenizer has no eos_token_id; the trainer appends EOS after every completion")
    return int(e)


def pad_id(tokenizer) -> int:
    """The tokenizer's padding id, or its EOS id when it has none."""
    p = getattr(tokenizer, "pad_token_id", None)
    return eos_id(tokenizer) if p is None else int(p)


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and (start, end) character offsets, through the HF call convention."""
    if not text:
        return [], []
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [tuple(map(int, o)) for o in enc["offset_mapping"]]
    if len(ids) != len(offsets):
        raise UserError("tokenizer returned a different number of ids and offsets")
    return ids, offsets


VOCAB_TOKENIZER_FILE = "vocab_tokenizer.json"


def load_tokenizer(path: str | Path):
    """The tokenizer saved in a checkpoint directory: our VocabTokenizer file or an HF tokenizer."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer directory not found: {p}")
    if (p / VOCAB_TOKENIZER_FILE).exists():
        return VocabTokenizer.load(p / VOCAB_TOKENIZER_FILE)
    if p.is_dir() and not has_tokenizer_files(p):
        raise FileNotFoundError(f"{p} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


class VocabTokenizer:
    """A small tokenizer over an explicit vocabulary: greedy longest match, one token per entry.

    For tiny models trained from scratch (tests, the demo): whole SPRINT tags can be single
    tokens, which keeps sequences short. It offers the slice of the HF tokenizer API the project
    uses: encode / decode / __call__(..., return_offsets_mapping=True) / eos_token_id / len().
    Characters outside the vocabulary raise a ValueError naming them.
    """

    def __init__(self, vocab: list[str], eos_token: str = "<eos>", pad_token: str = "<pad>",
                 bos_token: str | None = None):
        if len(set(vocab)) != len(vocab):
            dup = sorted({t for t in vocab if vocab.count(t) > 1})
            raise ValueError(f"duplicate vocabulary entries: {dup[:5]}")
        for t in (eos_token, pad_token):
            if t not in vocab:
                raise ValueError(f"special token {t!r} is not in the vocabulary")
        self.vocab = list(vocab)
        self.ids = {t: i for i, t in enumerate(vocab)}
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        self.eos_token_id = self.ids[eos_token]
        self.pad_token_id = self.ids[pad_token]
        self.bos_token_id = self.ids.get(bos_token) if bos_token else None
        self._specials = {eos_token, pad_token} | ({bos_token} if bos_token else set())
        self._maxlen = max(len(t) for t in vocab)
        self._by_first: dict[str, list[str]] = {}
        for t in sorted(vocab, key=len, reverse=True):
            if t:
                self._by_first.setdefault(t[0], []).append(t)

    def __len__(self) -> int:
        return len(self.vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.ids)

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets, i = [], [], 0
        while i < len(text):
            for cand in self._by_first.get(text[i], ()):
                if text.startswith(cand, i):
                    ids.append(self.ids[cand])
                    offsets.append((i, i + len(cand)))
                    i += len(cand)
                    break
            else:
                raise ValueError(f"character {text[i]!r} at offset {i} is not in the tokenizer's vocabulary")
        return ids, offsets

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenize(text)[0]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            t = self.vocab[int(i)]
            if skip_special_tokens and t in self._specials:
                continue
            out.append(t)
        return "".join(out)

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False):
        ids, offsets = self._tokenize(text)
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        return out

    def save(self, path) -> None:
        import json
        from pathlib import Path
        Path(path).write_text(json.dumps({"type": "VocabTokenizer", "vocab": self.vocab, "eos_token": self.eos_token,
                                          "pad_token": self.pad_token, "bos_token": self.bos_token}))

    @classmethod
    def load(cls, path) -> "VocabTokenizer":
        import json
        from pathlib import Path
        d = json.loads(Path(path).read_text())
        return cls(d["vocab"], d["eos_token"], d["pad_token"], d.get("bos_token"))


# ---------------------------------------------------------------------------------------------
# Does a tokenizer fit a model? (one check, called by every command that pairs the two)
# ---------------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", VOCAB_TOKENIZER_FILE)


def has_tokenizer_files(path: str | Path) -> bool:
    """Whether a directory holds a tokenizer's vocabulary. transformers builds an EMPTY tokenizer
    from a directory with none (every text encodes to zero tokens), so this is checked first."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_size(tokenizer) -> int:
    """The number of ids the tokenizer can produce: its largest id + 1 (added tokens included)."""
    n = len(tokenizer)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max([n] + [int(i) + 1 for i in vocab.values()])


def check_tokenizer_fits(tokenizer, vocab_size: int, what: str = "the model",
                         fix: str = "pass the model's own tokenizer with --tokenizer DIR") -> None:
    """Raise UserError unless every id the tokenizer produces is a row of the model's embedding.

    A larger tokenizer feeds ids past the table: garbage, silently (jit clamps the gather).
    Used by train, infer, eval and generate."""
    from sprint_jax.errors import UserError

    n = tokenizer_size(tokenizer)
    if n > vocab_size:
        raise UserError(f"the tokenizer has {n} tokens but {what}'s vocab_size is {vocab_size}: tokenizer and "
                        f"model do not match ({fix})")
