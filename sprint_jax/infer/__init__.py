"""Inference: the decoding engine (slot KV cache, sampling, batched decode) and the orchestrator."""
from sprint_jax.infer.engine import Engine as _Engine
from sprint_jax.infer.requests import EngineError, Generation, Op, Seq
from sprint_jax.infer.sampling import Sampling
from sprint_jax.infer.single import SingleRun
from sprint_jax.infer.orchestrator import Orchestrator, OrchestratorConfig, RunRecord, run_many, run_query  # noqa: E402
from sprint_jax.infer.batch import BatchEngine  # noqa: E402


def Engine(model, tokenizer, *, max_branches: int = 8, prefill_chunk: int = 512, **kw) -> SingleRun:
    """Temporary: the former single-run engine's constructor, a SingleRun over a one-slot Engine."""
    return SingleRun(_Engine(model, tokenizer, max_seqs=1, max_children=max_branches, prefill_chunk=prefill_chunk,
                             **kw))


__all__ = ["Engine", "EngineError", "Generation", "Op", "Seq", "Sampling", "SingleRun", "BatchEngine", "Orchestrator",
           "OrchestratorConfig", "RunRecord", "run_many", "run_query"]
