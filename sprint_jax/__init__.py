"""sprint-jax: SPRINT (Biju et al., 2025) in JAX/Flax.

Subpackages: model (Qwen2 port, HF checkpoints), infer (engine, orchestrator), train (sharded SFT),
tasks (per task kind: loader, prompt, grader; shared by curation and eval), curation (traces ->
SPRINT examples), eval (runs, reports), bench, kernels (Pallas); data/ holds the package data
(MATH-500, the Qwen2 BPE files; see data/SOURCES.md).
"""
__version__ = "0.1.0"
