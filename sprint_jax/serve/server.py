"""One process: uvicorn serving the app on one thread (its event loop), the BatchEngine stepped by
a task on that loop (CPU default) or by an engine thread (accelerator default; see
sprint_jax/serve/worker.py). `Server.start()` returns once the socket listens (port 0 picks a free
port)."""
from __future__ import annotations

import sys
import threading
import time


class Server:
    def __init__(self, engine, model_name: str, sprint_config=None, host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = 64, default_max_tokens: int = 256, log_level: str = "warning",
                 switch_interval_s: float | None = 0.0005, engine_on_loop: bool | None = None):
        import uvicorn

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
        # httptools (C): the HTTP part of a request took ~0.8 ms instead of ~1.5 ms with h11 (pure Python);
        # h11 when httptools is not installed (the `serve` extra installs it)
        try:
            import httptools  # noqa: F401
            self.http_impl = "httptools"
        except ImportError:
            self.http_impl = "h11"
        # uvloop (libuv; orbax-checkpoint installs it) runs the event loop, asyncio's if it is missing;
        # no access log line per request; no proxy-headers layer (nothing here reads the client's address)
        try:
            import uvloop  # noqa: F401
            self.loop_impl = "uvloop"
        except ImportError:
            self.loop_impl = "asyncio"
        self._uv = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level=log_level,
                                                 http=self.http_impl, loop=self.loop_impl,
                                                 access_log=False, proxy_headers=False,
                                                 timeout_graceful_shutdown=2))
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
        self._thread = threading.Thread(target=self._uv.run, name="sprint-jax-http", daemon=True)
        self._thread.start()
        t_end = time.monotonic() + timeout
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                self.worker.stop()
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self._uv.servers[0].sockets[0].getsockname()[1]
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
