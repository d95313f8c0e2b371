"""One process: uvicorn serving the app on one thread (its event loop), the BatchEngine stepped by
a task on that loop (CPU default) or by an engine thread (accelerator default; see
sprint_jax/serve/worker.py). `Server.start()` returns once the socket listens (port 0 picks a free
port)."""
from __future__ import annotations

import sys
import threading
import time


def uvicorn_server(app, host: str, port: int, log_level: str = "warning", **extra):
    """A uvicorn.Server for `app`, configured as `sprint-jax serve` runs: httptools (C) parses HTTP
    where it is installed (the HTTP part of a request took ~0.8 ms instead of ~1.5 ms with the
    pure-Python h11; the `serve` extra installs it), uvloop (libuv; orbax-checkpoint installs it)
    runs the event loop (asyncio's if it is missing), no access log line per request, no
    proxy-headers layer (nothing here reads the client's address). `bench serve --http` runs its
    bare stack-floor app through this too, so the two are configured alike."""
    import uvicorn

    try:
        import httptools  # noqa: F401
        http_impl = "httptools"
    except ImportError:
        http_impl = "h11"
    try:
        import uvloop  # noqa: F401
        loop_impl = "uvloop"
    except ImportError:
        loop_impl = "asyncio"
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http_impl,
                                         loop=loop_impl, access_log=False, proxy_headers=False,
                                         timeout_graceful_shutdown=2, **extra))


def run_in_thread(uv, name: str, timeout: float = 60.0) -> tuple[threading.Thread, int]:
    """Run uvicorn.Server `uv` on a daemon thread; returns (the thread, the port it listens on)
    once it listens. OSError if it did not start within `timeout` s."""
    thread = threading.Thread(target=uv.run, name=name, daemon=True)
    thread.start()
    t_end = time.monotonic() + timeout
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > t_end:
            raise OSError(f"the HTTP server ({name}) did not start")
        time.sleep(0.02)
    return thread, uv.servers[0].sockets[0].getsockname()[1]


class Server:
    def __init__(self, engine, model_name: str, sprint_config=None, host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = 64, default_max_tokens: int = 256, log_level: str = "warning",
                 switch_interval_s: float | None = 0.0005, engine_on_loop: bool | None = None):
        from sprint_jax.infer.orchestrator import OrchestratorConfig
        from sprint_jax.serve.app import ServeState, make_app
        from sprint_jax.serve.worker import EngineWorker

        if engine_on_loop is None:             # see sprint_jax/serve/worker.py: where the engine runs
            import jax
            engine_on_loop = jax.default_backend() == "cpu"
        self.engine_on_loop = engine_on_loop
        self.worker = EngineWorker(engine, max_queue=max_queue, on_loop=engine_on_loop)
        self.state = ServeState(self.worker, model_name, sprint_config or OrchestratorConfig(),
                                default_max_tokens=default_max_tokens)
        self.app = make_app(self.state)
        self.host = host
        self._uv = uvicorn_server(self.app, host, port, log_level)
        self.http_impl, self.loop_impl = self._uv.config.http, self._uv.config.loop
        self._thread: threading.Thread | None = None
        self.port = port
        # With the engine on a thread of its own, it and the HTTP thread hand work to each other
        # many times per request; Python's default GIL switch interval (5 ms) would add up to that
        # per hand-off. Set for the process while the server runs (restored by stop()); None leaves
        # it alone, and so does an engine on the loop (one thread: no hand-off to speed up, and a
        # short interval would only make any other thread of the process preempt it more often).
        self._switch = None if engine_on_loop else switch_interval_s
        self._old_switch = sys.getswitchinterval()

    def _set_switch(self) -> None:
        if self._switch is not None:
            sys.setswitchinterval(self._switch)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "Server":
        self._set_switch()
        self.worker.start()
        try:
            self._thread, self.port = run_in_thread(self._uv, "sprint-jax-http", timeout)
        except OSError:
            self.worker.stop()
            raise OSError(f"the HTTP server did not start on {self.host}:{self.port}") from None
        return self

    def serve_forever(self) -> None:
        """Run in the calling thread until interrupted (uvicorn handles SIGINT / SIGTERM)."""
        self._set_switch()
        self.worker.start()
        try:
            self._uv.run()
        finally:
            self.worker.stop()

    def stop(self) -> None:
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.worker.stop()
        if self._switch is not None:
            sys.setswitchinterval(self._old_switch)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
