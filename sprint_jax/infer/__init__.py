"""Inference: the engine (slot KV cache, sampling, batched decode), single-run calls over it and the
orchestrator."""
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.requests import EngineError, Generation, Op, Seq
from sprint_jax.infer.sampling import Sampling
from sprint_jax.infer.single import SingleRun
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunRecord, run_many, run_query  # noqa: E402

__all__ = ["Engine", "EngineError", "Generation", "Op", "Seq", "Sampling", "SingleRun", "Orchestrator",
           "OrchestratorConfig", "RunRecord", "run_many", "run_query"]
