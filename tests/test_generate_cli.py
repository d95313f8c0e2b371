"""`sprint-jax generate` end to end on a real transformers checkpoint, against HF generate."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from conftest import load_hf

pytestmark = pytest.mark.slow   # runs subprocesses (the `slow` marker: pyproject.toml)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sprint_jax.cli", "generate", *args], capture_output=True, text=True)


def test_generate_token_ids_match_hf_generate(hf_untied):
    prompt = [5, 17, 101, 44, 9]
    r = _cli("--model", str(hf_untied), "--token-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    ids = [int(x) for x in re.search(r"ids: \[([0-9, ]*)\]", r.stdout).group(1).split(",")]
    with torch.no_grad():
        ref = load_hf(hf_untied).generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                          eos_token_id=None, pad_token_id=0, min_new_tokens=8).numpy()[0, 5:]
    assert ids == [int(t) for t in ref]


def test_generate_user_errors_are_one_line(hf_untied, tmp_path):
    r = _cli("--model", str(hf_untied), "--token-ids", "1,99999", "--max-new-tokens", "2")
    assert r.returncode == 2 and "outside the model's vocabulary" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--model", str(tmp_path / "missing"), "--token-ids", "1")
    assert r.returncode == 2 and "not found" in r.stderr


def test_generate_prompt_outside_the_tokenizers_vocabulary_is_one_line(hf_untied, tmp_path):
    import shutil

    from conftest import tiny_vocab_tokenizer
    from sprint_jax.model.tokenizer import VOCAB_TOKENIZER_FILE

    model = tmp_path / "model"
    shutil.copytree(hf_untied, model)
    tiny_vocab_tokenizer().save(model / VOCAB_TOKENIZER_FILE)     # printable ASCII only
    r = _cli("--model", str(model), "hello ☃ world", "--max-new-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "cannot encode the prompt" in r.stderr and "'☃'" in r.stderr
