"""The training-set fingerprint: which problems a model was trained on (the contamination guard).

`train` hashes the normalised prompt of every example it used (`sprint_jax.tasks.problem_hash`: the
query as the model saw it, i.e. the problem text for MATH) and stores the sorted hashes as
`train_fingerprint` in the export's metadata file OUT/hf/sprint_jax.json (one JSON object shared
with other export metadata, e.g. the layout). `eval` hashes the prompts it is about to evaluate the
same way and refuses to report on overlap unless told to (sprint_jax/eval/cli.py `check_overlap`).
A model directory without the file or the key (not trained by sprint-jax) is not checked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

KEY = "train_fingerprint"


def fingerprint(prompts: Iterable[str]) -> dict:
    """{"normalization", "n", "hashes"} over the distinct normalised prompts, each without its
    query wrapper (`schema.unwrap_query`), so it hashes as the bare task prompt eval checks."""
    from sprint_jax.schema import unwrap_query
    from sprint_jax.tasks import problem_hash
    hashes = sorted({problem_hash(unwrap_query(p)) for p in prompts})
    return {"normalization": "nfkc-lower-whitespace/sha256[:16]", "n": len(hashes), "hashes": hashes}


def read_fingerprint(model_dir: str | Path) -> set[str] | None:
    """The trained problems' hashes, or None when the model carries no fingerprint."""
    from sprint_jax.errors import UserError
    from sprint_jax.model.hf import EXPORT_META_FILE, read_export_meta
    fp = read_export_meta(model_dir).get(KEY)
    if fp is None:
        return None
    if not isinstance(fp, dict) or not isinstance(fp.get("hashes"), list):
        raise UserError(f"{Path(model_dir) / EXPORT_META_FILE}: {KEY} must be an object with a 'hashes' list")
    return set(map(str, fp["hashes"]))


__all__ = ["KEY", "fingerprint", "read_fingerprint"]
