"""`sprint-jax serve`: an OpenAI-compatible HTTP server on the batched engine, with SPRINT as a
first-class mode. `Server(engine, name).start()` runs it in-process (tests, benchmarks);
`sprint-jax serve --model DIR` from the command line."""
from sprint_jax.serve.server import Server

__all__ = ["Server"]
