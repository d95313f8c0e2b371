"""The recipe config: one YAML file naming the curation, the shared SFT settings, the eval sets and
the comparison (configs/recipe_*.yaml), loaded with the project's config system.

The curate and train sections are the `sprint-jax curate` and `sprint-jax train` configs themselves
(sprint_jax.curation.config.CurateConfig, sprint_jax.train.config.TrainConfig) and are checked
against them when the recipe loads, before any stage runs. The recipe fills in what it owns: the
curation's output directory, each arm's data files, layout and pairing.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from sprint_jax.config import ConfigError, from_dict, load_config
from sprint_jax.format import Layout

# the built-in eval sets `sprint-jax eval --data` knows by name; anything else is a file
BUILTIN_DATA = ("math500", "countdown", "chains")
# prompts per plan the recipe's chains tokenizer has tags for (the demo's vocabulary: its ids are fixed)
CHAINS_TOKENIZER_PROMPTS = 4


@dataclasses.dataclass
class EvalSet:
    """One evaluation of both models, compared: stages eval_sprint_NAME, eval_rft_NAME, compare_NAME."""
    name: str                                  # stage suffix and report heading, e.g. math500
    data: str                                  # `eval --data`: math500 | countdown | chains | a task file
    task_kind: Literal["auto", "math", "choice"] = "auto"   # `eval --task-kind` for a file
    limit: int | None = None                   # `eval --limit`: the first N problems (None: all)
    args: list[str] = dataclasses.field(default_factory=list)   # more `sprint-jax eval` flags, this set only

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"name must be letters, digits, - and _ (it names stage directories), got {self.name!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (or null: all), got {self.limit}")


@dataclasses.dataclass
class EvalSection:
    sets: list[EvalSet] = dataclasses.field(default_factory=lambda: [EvalSet("math500", "math500")])
    sprint_mode: Literal["parallel", "serial"] = "parallel"   # the SPRINT model runs its executors side by side
    rft_mode: Literal["sequential"] = "sequential"            # the RFT baseline decodes one sequence
    config: str | None = None                  # `eval --config`: an OrchestratorConfig YAML, e.g.
    #                                            configs/eval_r1_distill_7b.yaml (its content is an input)
    orchestrator: dict[str, Any] = dataclasses.field(default_factory=dict)  # OrchestratorConfig fields (`eval --set`)
    args: list[str] = dataclasses.field(default_factory=list)  # more `sprint-jax eval` flags, every set

    def __post_init__(self) -> None:
        if not self.sets:
            raise ValueError("sets is empty: give at least one eval set")
        if self.config is not None:
            from sprint_jax.config import resolve_config_path
            if not resolve_config_path(self.config).is_file():
                raise ValueError(f"config {self.config!r}: no such file")
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ValueError(f"set names must differ, got {names}")


@dataclasses.dataclass
class CompareSection:
    bins: str = "2000,4000,8000"               # `eval compare --bins`: the paper's length thresholds
    quantiles: int = 4                         # `eval compare --quantiles`

    def __post_init__(self) -> None:
        if self.quantiles < 0:
            raise ValueError(f"quantiles must be >= 0, got {self.quantiles}")


@dataclasses.dataclass
class RecipeConfig:
    curate: dict[str, Any] = dataclasses.field(default_factory=dict)   # a CurateConfig (its `out` is the recipe's)
    train: dict[str, Any] = dataclasses.field(default_factory=dict)    # a TrainConfig for both arms (data.train,
    #                                                                    data.layout and data.paired are the recipe's)
    sprint_layout: Layout = "flat"             # the SPRINT arm's data.layout (the RFT arm trains flat)
    tokenizer: Literal["config", "chains"] = "config"   # chains: a word-level tokenizer of the digit-chains family
    #                                                      (the demo's), written to DIR/tokenizer and trained with
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    compare: CompareSection = dataclasses.field(default_factory=CompareSection)

    def __post_init__(self) -> None:
        from sprint_jax.curation.config import CurateConfig
        from sprint_jax.train.config import TrainConfig

        from_dict(CurateConfig, self.curate, prefix="curate.")
        data = dict(self.train.get("data") or {})
        for owned in ("train", "layout", "paired"):
            if owned in data:
                raise ValueError(f"train.data.{owned} is set by the recipe (the curated files, sprint_layout); "
                                 f"remove it")
        from_dict(TrainConfig, {**self.train, "data": {**data, "train": ["curated.jsonl"]}}, prefix="train.")
        if self.tokenizer == "chains" and data.get("tokenizer", "auto") != "auto":
            raise ValueError("tokenizer: chains sets train.data.tokenizer; remove it from train.data")
        tasks = self.curate.get("tasks") or {}
        if self.tokenizer == "chains" and int(tasks.get("max_chains", 4)) > CHAINS_TOKENIZER_PROMPTS:
            raise ValueError(f"curate.tasks.max_chains: the chains tokenizer has tags for at most "
                             f"{CHAINS_TOKENIZER_PROMPTS} prompts per plan (one per chain), got {tasks['max_chains']}")
        for s in self.eval.sets:
            if s.data not in BUILTIN_DATA and not Path(s.data).exists():
                raise ValueError(f"eval set {s.name}: data {s.data!r} is not {', '.join(BUILTIN_DATA)} "
                                 f"or an existing file")


def check_api_keys(cfg: RecipeConfig) -> None:
    """ConfigError naming the variable when an endpoint the curation calls has no key in the
    environment: at the start of a run, not hours later when the stage reaches it."""
    from sprint_jax.curation.config import CurateConfig

    curate = from_dict(CurateConfig, cfg.curate, prefix="curate.")
    for section, endpoint, used in (("teacher", curate.teacher, curate.teacher.kind == "openai"),
                                    ("extractor", curate.extractor, curate.extractor.kind == "llm"),
                                    ("dag", curate.dag, curate.dag.kind == "llm")):
        if used:
            endpoint.api_key(f"curate.{section}")


def load_recipe_config(path: str | Path | None, overrides=()) -> RecipeConfig:
    """YAML + dotted `--set` overrides -> RecipeConfig; ConfigError names the bad field."""
    try:
        return load_config(RecipeConfig, path, overrides)
    except ConfigError:
        raise
    except ValueError as e:        # a section's own check, raised while building RecipeConfig
        raise ConfigError(str(e)) from e
