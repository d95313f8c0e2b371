"""Inference: the decoding engine (KV cache, sampling, branch-batched decode) and the orchestrator."""
from sprint_jax.infer.engine import DecodeState, Engine, EngineError, Generation, KVCache
from sprint_jax.infer.sampling import Sampling

__all__ = ["Engine", "EngineError", "DecodeState", "Generation", "KVCache", "Sampling"]
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunRecord, run_query  # noqa: E402

__all__ += ["Orchestrator", "OrchestratorConfig", "RunRecord", "run_query"]
