"""Temporary: the former name of the engine (`sprint_jax.infer.engine.Engine`), with the one
convenience call its remaining users make, until they import the engine directly."""
from sprint_jax.infer.engine import Engine
from sprint_jax.infer.single import SingleRun


class BatchEngine(Engine):
    def generate_one(self, prompt, max_new_tokens, stop=(), sampling=None):
        run = SingleRun(self)
        try:
            return [run.generate(run.prefill(prompt), max_new_tokens, stop, sampling)]
        finally:
            run.close()
