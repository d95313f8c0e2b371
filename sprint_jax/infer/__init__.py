"""Inference: the decoding engine (KV cache, sampling, branch-batched decode) and the orchestrator."""
from sprint_jax.infer.engine import DecodeState, Engine, EngineError, Generation, KVCache
from sprint_jax.infer.sampling import Sampling

__all__ = ["Engine", "EngineError", "DecodeState", "Generation", "KVCache", "Sampling"]
