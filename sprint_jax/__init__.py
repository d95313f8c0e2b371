"""sprint-jax: SPRINT (Biju et al., 2025) in JAX/Flax.

Subpackages: model (Qwen2 port, HF checkpoints), infer (engine, orchestrator), train (sharded SFT),
curation (traces -> SPRINT examples), eval (graders, reports), bench, kernels (Pallas).
"""
__version__ = "0.1.0"
