"""The recipe config: one YAML file naming the curation, the shared SFT settings, the optional
self-training and RL stages, the eval sets and the comparison (configs/recipe_*.yaml), loaded with
the project's config system.

The curate and train sections are the `sprint-jax curate` and `sprint-jax train` configs themselves
(sprint_jax.curation.config.CurateConfig, sprint_jax.train.config.TrainConfig) and are checked
against them when the recipe loads, before any stage runs; so are the selftrain and rl sections
(`sprint-jax selftrain` / `sprint-jax rl` configs). The recipe fills in what it owns: the
curation's output directory, each arm's data files, layout, format and pairing, each stage's start
model and each arm's mode (the parallel arm samples in parallel, the sequential baseline
sequentially, with the same settings otherwise).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from sprint_jax.config import ConfigError, from_dict, load_config
from sprint_jax.format import Layout

# the built-in eval sets `sprint-jax eval --data` knows by name; anything else is a file, or a
# Hugging Face dataset named "hf:OWNER/NAME" (fetched by a data_SET stage into a task file)
BUILTIN_DATA = ("math500", "countdown", "chains")
HF_PREFIX = "hf:"
# §E.2 of the ThreadWeaver paper: the staged curriculum of its initial SFT, as (fraction of the
# epoch's examples in parallel form, epochs): 2 sequential epochs, 4 mixed (90/10, 50/50, 50/50,
# 10/90 sequential/parallel), 2 parallel
STAGED_CURRICULUM = ((0.0, 2), (0.1, 1), (0.5, 1), (0.5, 1), (0.9, 1), (1.0, 2))
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
    split: str = "test"                        # hf:NAME only: the dataset split
    subset: str | None = None                  # hf:NAME only: the dataset's configuration name

    @property
    def hf(self) -> str | None:
        """The Hugging Face dataset name of an "hf:OWNER/NAME" set (None for a file or a built-in)."""
        return self.data[len(HF_PREFIX):] if self.data.startswith(HF_PREFIX) else None

    def __post_init__(self) -> None:
        if self.data.startswith(HF_PREFIX) and not self.data[len(HF_PREFIX):]:
            raise ValueError(f"eval set {self.name}: data {self.data!r} names no dataset (hf:OWNER/NAME)")
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
    names: str = "SPRINT,RFT"                  # `eval compare --names`: the parallel arm's, then the sequential's

    def __post_init__(self) -> None:
        if self.quantiles < 0:
            raise ValueError(f"quantiles must be >= 0, got {self.quantiles}")
        if len(self.names.split(",")) != 2 or not all(n.strip() for n in self.names.split(",")):
            raise ValueError(f"names must be two comma-separated names, got {self.names!r}")


@dataclasses.dataclass
class CurriculumSection:
    """How the parallel arm's initial SFT mixes the sequential and parallel forms of each curated
    example over its epochs (the sequential arm trains on the sequential form throughout).
    none: every epoch parallel. staged: ThreadWeaver's §E.2 (STAGED_CURRICULUM: 8 epochs).
    gradual: the parallel fraction rises linearly over train.epochs epochs, from 0 in the first to
    1 in the last (our reading of the paper's gradual variant). Each phase is a train stage that
    starts from the previous one's export, on a file where each problem appears once, in parallel
    form with the phase's probability (drawn with `seed`), so the learning-rate schedule restarts
    with every phase; the two arms are then not paired (each trains on every problem it has)."""
    kind: Literal["none", "staged", "gradual"] = "none"
    seed: int = 0

    def phases(self, epochs: float | None) -> list[tuple[float, float]]:
        """(parallel fraction, epochs) per train stage of the parallel arm."""
        if self.kind == "none":
            return [(1.0, epochs)]
        if self.kind == "staged":
            return [(p, float(e)) for p, e in STAGED_CURRICULUM]
        n = int(epochs or 0)
        return [(k / (n - 1), 1.0) for k in range(n)]


@dataclasses.dataclass
class RecipeConfig:
    curate: dict[str, Any] = dataclasses.field(default_factory=dict)   # a CurateConfig (its `out` is the recipe's)
    train: dict[str, Any] = dataclasses.field(default_factory=dict)    # a TrainConfig for both arms (data.train,
    #                                                                    data.layout and data.paired are the recipe's)
    sprint_layout: Layout = "flat"             # the SPRINT arm's data.layout (the RFT arm trains flat)
    tokenizer: Literal["config", "chains"] = "config"   # chains: a word-level tokenizer of the digit-chains family
    #                                                      (the demo's), written to DIR/tokenizer and trained with
    format: Literal["sprint", "threadweaver"] = "sprint"   # both arms' tag format: threadweaver adds a
    #                                            `convert` stage (ThreadWeaver text; curated examples already
    #                                            in it pass through) and trains and evaluates in it
    prompts: str | None = None                 # a task file of training prompts (e.g. Polaris-53K): fills
    #                                            curate.tasks.path, selftrain.train_tasks.data and
    #                                            rl.tasks.source where those are unset
    curriculum: CurriculumSection = dataclasses.field(default_factory=CurriculumSection)
    selftrain: dict[str, Any] = dataclasses.field(default_factory=dict)   # a SelftrainConfig (model, mode, out:
    #                                            the recipe's); {} or rounds 0: no self-training stages
    rl: dict[str, Any] = dataclasses.field(default_factory=dict)          # an RLConfig (policy.path, rollout.mode:
    #                                            the recipe's; the sequential arm: reward.rho 0); {}: no RL stages
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    compare: CompareSection = dataclasses.field(default_factory=CompareSection)

    def __post_init__(self) -> None:
        if self.prompts is not None:
            self._fill_prompts()
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
            if s.data not in BUILTIN_DATA and s.hf is None and not Path(s.data).exists():
                raise ValueError(f"eval set {s.name}: data {s.data!r} is not {', '.join(BUILTIN_DATA)}, "
                                 f"hf:OWNER/NAME or an existing file")
        epochs = self.train.get("epochs") or 0
        if self.curriculum.kind == "gradual" and (epochs < 2 or epochs != int(epochs)):
            raise ValueError("curriculum gradual needs train.epochs >= 2 (a whole number: one phase per epoch)")
        if self.curriculum.kind == "staged" and self.train.get("epochs") not in (None, 8):
            raise ValueError(f"curriculum staged is 8 epochs (2 sequential, 4 mixed, 2 parallel); remove "
                             f"train.epochs (got {self.train.get('epochs')}) or set it to 8")
        self._check_selftrain()
        self._check_rl()

    @property
    def selftrain_rounds(self) -> int:
        return int(self.selftrain.get("rounds", 2)) if self.selftrain else 0

    def _fill_prompts(self) -> None:
        tasks = dict(self.curate.get("tasks") or {})
        tasks.setdefault("source", "file")
        tasks.setdefault("path", self.prompts)
        self.curate = {**self.curate, "tasks": tasks}
        if self.selftrain:
            tt = dict(self.selftrain.get("train_tasks") or {})
            tt.setdefault("data", self.prompts)
            self.selftrain = {**self.selftrain, "train_tasks": tt}
        if self.rl:
            rt = dict(self.rl.get("tasks") or {})
            rt.setdefault("source", self.prompts)
            self.rl = {**self.rl, "tasks": rt}

    def _check_selftrain(self) -> None:
        if not self.selftrain_rounds:
            return
        from sprint_jax.recipe.selftrain_config import SelftrainConfig

        for owned in ("model", "mode", "out"):
            if owned in self.selftrain:
                raise ValueError(f"selftrain.{owned} is set by the recipe (each arm's SFT model and mode); remove it")
        for owned in ("model.name", "model.init", "data.train", "data.layout", "data.format"):
            head, tail = owned.split(".")
            if tail in ((self.selftrain.get("train") or {}).get(head) or {}):
                raise ValueError(f"selftrain.train.{owned} is set by the recipe; remove it")
        from_dict(SelftrainConfig, {**self.selftrain, "model": "-"}, prefix="selftrain.")

    def _check_rl(self) -> None:
        if not self.rl:
            return
        from sprint_jax.rl.config import RLConfig

        if "path" in (self.rl.get("policy") or {}):
            raise ValueError("rl.policy.path is set by the recipe (each arm's model before RL); remove it")
        for owned in ("mode", "layout", "format"):
            if owned in (self.rl.get("rollout") or {}):
                raise ValueError(f"rl.rollout.{owned} is set by the recipe (each arm's); remove it")
        from_dict(RLConfig, self.rl, prefix="rl.")


def check_api_keys(cfg: RecipeConfig) -> None:
    """ConfigError naming the variable when an endpoint the curation calls has no key in the
    environment: at the start of a run, not hours later when the stage reaches it."""
    from sprint_jax.curation.config import CurateConfig

    curate = from_dict(CurateConfig, cfg.curate, prefix="curate.")
    for section, endpoint, used in (("teacher", curate.teacher, curate.teacher.kind == "openai"),
                                    ("extractor", curate.extractor, curate.extractor.kind == "llm"),
                                    ("dag", curate.dag, curate.dag.kind == "llm"),
                                    ("rewriter", curate.rewriter, curate.restructure != "dag")):
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
