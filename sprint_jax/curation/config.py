"""The curation run config (docs/design.md "Curation"; paper §4-5): one dataclass tree, loaded with
`sprint_jax.config.load_config` from `configs/curate_*.yaml` plus `--set a.b=value` overrides.

API keys never appear here: an endpoint names the *environment variable* that holds its key
(`api_key_env`), and the key is read from the environment only when a call has to be made.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from sprint_jax.config import ConfigError, load_config, to_dict


@dataclasses.dataclass
class EndpointConfig:
    """An OpenAI-compatible chat-completions endpoint and how to call it politely."""
    base_url: str = "https://api.openai.com/v1"   # any OpenAI-compatible server (vLLM, SGLang, ...)
    model: str = ""                                # model name sent with every request
    api_key_env: str = "OPENAI_API_KEY"            # NAME of the env var holding the key; "" = no key
    temperature: float = 0.0                       # sampling temperature (part of the request hash)
    max_tokens: int = 4096                         # completion token cap (part of the request hash)
    concurrency: int = 8                           # requests in flight at once
    max_retries: int = 6                           # retries on 429 / 5xx / timeouts / connection errors
    timeout_s: float = 120.0                       # per-request timeout
    backoff_base_s: float = 1.0                    # first backoff; doubles per retry, with jitter
    backoff_max_s: float = 60.0                    # cap on one computed backoff
    max_retry_after_s: float = 600.0               # a server asking to wait longer than this is an error

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff_base_s and backoff_max_s must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    def api_key(self, section: str) -> str:
        """The key from the environment; a clear error naming the variable when it is missing."""
        if not self.api_key_env:
            return "no-key"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"environment variable {self.api_key_env} is not set ({section}.api_key_env names it); "
                f"export it with the API key for {self.base_url}")
        return key


@dataclasses.dataclass
class TasksConfig:
    """Where problems come from (sprint_jax.tasks): a local file, a Hugging Face dataset, or generated.

    file        `path`: .jsonl / .parquet / .arrow, or a `datasets` save_to_disk directory
    hf_dataset  `path`: a dataset name (hub) or a save_to_disk directory, with `split` / `name`
                (needs the `[datasets]` extra)
    countdown / chains  generated (`n`, `seed`)
    Curate the MATH *train* split, never MATH-500: that is the evaluation set.
    """
    source: Literal["file", "hf_dataset", "countdown", "chains"] = "countdown"
    path: str = ""                  # file / hf_dataset: where the records are
    kind: Literal["math", "choice"] = "math"   # file / hf_dataset: what the records are
    split: str = "train"            # hf_dataset (and save_to_disk directories holding several splits)
    name: str | None = None         # hf_dataset: the dataset's config name, if it has several
    n: int = 64                     # countdown: number of generated instances
    seed: int = 0                   # countdown: generator seed
    chain_length: int = 12         # chains: digit-map steps per chain (the demo family)
    min_chains: int = 4             # chains: chains per problem, drawn from min_chains..max_chains
    max_chains: int = 4
    held_out: int = 0               # chains: keep out the start digits of the first `held_out` problems of
    #                                 `eval --data chains --chains MIN-MAX` (chains.mixed_test_set)
    limit: int | None = None        # keep only the first `limit` tasks (None = all)

    def __post_init__(self) -> None:
        if self.source in ("file", "hf_dataset") and not self.path:
            raise ValueError(f"path is required when source is {self.source}")
        if self.source in ("countdown", "chains") and self.path:
            raise ValueError(f"path {self.path!r} is set but source is {self.source}, which generates its problems "
                             f"and reads no file: set source: file (or hf_dataset) to read it, or drop path")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be >= 1 (or null for all)")
        if not 1 <= self.min_chains <= self.max_chains or self.held_out < 0:
            raise ValueError(f"need 1 <= min_chains <= max_chains and held_out >= 0, got "
                             f"{self.min_chains}, {self.max_chains}, {self.held_out}")
        if self.held_out > sum(10 ** k for k in range(self.min_chains, min(self.max_chains, 9) + 1)):
            raise ValueError(f"held_out {self.held_out}: more than the distinct start digits of "
                             f"{self.min_chains}..{self.max_chains} chains")


@dataclasses.dataclass
class TeacherConfig(EndpointConfig):
    """Serial-trace source: an LLM endpoint, or the offline Countdown solver (`programmatic`)."""
    kind: Literal["openai", "programmatic"] = "programmatic"


@dataclasses.dataclass
class ExtractorConfig(EndpointConfig):
    """Step extraction (P_i, E_i): a prompted LLM with JSON-schema output, or the offline heuristic."""
    kind: Literal["llm", "offline"] = "offline"


@dataclasses.dataclass
class DagConfig(EndpointConfig):
    """Dependency edges between steps: a prompted LLM, or the offline heuristic builder."""
    kind: Literal["llm", "offline"] = "offline"
    invalid_edge_policy: Literal["drop", "reject"] = "drop"   # forward edges, self-loops, unknown ids, cycles


@dataclasses.dataclass
class RewriterConfig(EndpointConfig):
    """`restructure: rewrite` / `threadweaver_rewrite`: the LLM that rewrites each correct serial
    trace into SPRINT tags (one call), or into ThreadWeaver's format (five calls, one per step)."""


@dataclasses.dataclass
class CurateConfig:
    """One curation run; everything it writes goes to `out` (or the CLI's --out)."""
    tasks: TasksConfig = dataclasses.field(default_factory=TasksConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)
    extractor: ExtractorConfig = dataclasses.field(default_factory=ExtractorConfig)
    dag: DagConfig = dataclasses.field(default_factory=DagConfig)
    # how correct traces become SPRINT examples: `dag` = extract steps -> dependency DAG -> σ packing
    # -> ρ filter (paper §4-5); `rewrite` = the `rewriter` LLM restructures the whole trace in one
    # call, and the reply is checked (well-formed, parallel, no executor using a sibling's result,
    # the same correct final answer); `threadweaver_rewrite` = ThreadWeaver's five steps (spans,
    # thread boundaries, rewrite for independence, outlines, format validation), each reply checked,
    # producing ThreadWeaver-format examples (curation/tw_rewrite.py)
    restructure: Literal["dag", "rewrite", "threadweaver_rewrite"] = "dag"
    rewriter: RewriterConfig = dataclasses.field(default_factory=RewriterConfig)
    merge_min_chars: int = 80       # executions shorter than this merge into their plan (E_i := empty)
    min_ratio: float = 1.5          # keep a trace if rho = |S| / #stages >= this (paper §5)
    rft_source: Literal["sprint", "correct"] = "sprint"  # RFT set: the traces kept for SPRINT, or every correct one
    # how each example's prompt is written: the task prompt as it is (`none`), or inside SPRINT's
    # `<query> ... </query>` (`query_tags`; its trailing whitespace kept after the closing tag).
    # The teacher always sees the bare task prompt; `train` records the wrapper in the export
    prompt_wrapper: Literal["none", "query_tags"] = "none"
    seed: int = 0                   # seeds the programmatic teacher
    out: str = "runs/curate"        # output directory (store, jsonl files, report)

    def __post_init__(self) -> None:
        if self.merge_min_chars < 0:
            raise ValueError("merge_min_chars must be >= 0")
        if self.min_ratio < 1.0:
            raise ValueError("min_ratio must be >= 1.0 (rho is never below 1)")
        if self.teacher.kind == "openai" and not self.teacher.model:
            raise ValueError("teacher.model is required when teacher.kind is openai")
        if self.extractor.kind == "llm" and not self.extractor.model:
            raise ValueError("extractor.model is required when extractor.kind is llm")
        if self.dag.kind == "llm" and not self.dag.model:
            raise ValueError("dag.model is required when dag.kind is llm")
        if self.restructure in ("rewrite", "threadweaver_rewrite") and not self.rewriter.model:
            raise ValueError(f"rewriter.model is required when restructure is {self.restructure}")
        if self.teacher.kind == "programmatic" and self.tasks.source not in ("countdown", "chains"):
            raise ValueError("teacher.kind programmatic only solves generated tasks "
                             "(tasks.source: countdown or chains)")


# Fields that change how a run is executed but not what it produces; they may differ on resume.
EXECUTION_ONLY = frozenset({"out", "concurrency", "max_retries", "timeout_s", "backoff_base_s",
                            "backoff_max_s", "max_retry_after_s", "api_key_env", "base_url"})
# Top-level fields only one restructuring path reads (config `restructure`).
PATH_ONLY = {"dag": frozenset({"restructure", "rewriter"}),
             "rewrite": frozenset({"extractor", "dag", "merge_min_chars", "min_ratio"}),
             "threadweaver_rewrite": frozenset({"extractor", "dag", "merge_min_chars", "min_ratio"})}


CHAINS_DEFAULTS = {"min_chains": 4, "max_chains": 4, "held_out": 0}


def data_fingerprint(cfg: CurateConfig) -> dict:
    """The config with execution-only fields and the fields the other restructuring path reads
    removed: a resumed run must match it exactly. (A `dag` run's fingerprint has no `restructure`
    or `rewriter`, so stores written before those fields existed still resume.)"""
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in EXECUTION_ONLY}
        return node
    out = {k: v for k, v in strip(to_dict(cfg)).items() if k not in PATH_ONLY[cfg.restructure]}
    for k, v in CHAINS_DEFAULTS.items():      # at their defaults: stores written before they existed resume
        if out["tasks"].get(k) == v:
            del out["tasks"][k]
    if out.get("prompt_wrapper") == "none":   # likewise
        del out["prompt_wrapper"]
    return out


def load_curate_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> CurateConfig:
    return load_config(CurateConfig, path, overrides)
