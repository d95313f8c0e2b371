"""Inference: the decoding engine (KV cache, sampling, branch-batched decode) and the orchestrator."""
from sprint_jax.infer.engine import DecodeState, Engine, EngineError, Generation, KVCache
from sprint_jax.infer.sampling import Sampling

__all__ = ["Engine", "EngineError", "DecodeState", "Generation", "KVCache", "Sampling"]
from sprint_jax.infer.batch import BatchEngine  # noqa: E402
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunRecord, run_many, run_query  # noqa: E402

__all__ += ["BatchEngine", "Orchestrator", "OrchestratorConfig", "RunRecord", "run_many", "run_query"]
