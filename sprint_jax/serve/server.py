"""One process: uvicorn serving the app on one thread (its event loop), the Engine stepped by
a task on that loop (CPU default) or by an engine thread (accelerator default; see
sprint_jax/serve/worker.py). `Server.start()` returns once the socket listens (port 0 picks a free
port)."""
from __future__ import annotations

import sys
import threading
import time


HEADER_TIMEOUT_S = 10.0     # a request's head (request line + headers) must arrive within this
MAX_HEAD_BYTES = 64 * 1024  # and be at most this long (httptools sets no limit of its own)
KEEP_ALIVE_S = 5            # an idle keep-alive connection is closed after this
PROBE_S = 0.5               # after a client's EOF, how often a request not yet answered checks it still reads
ENGINE_ON = {"auto": None, "loop": True, "thread": False}      # --engine-on -> Server(engine_on_loop=...)


def uvicorn_server(app, host: str, port: int, log_level: str = "warning", header_timeout_s: float = HEADER_TIMEOUT_S,
                   max_connections: int | None = None, on_shutdown=None, **extra):
    """A uvicorn.Server for `app`, configured as `sprint-jax serve` runs: httptools (C) parses HTTP
    where it is installed (the HTTP part of a request took ~0.8 ms instead of ~1.5 ms with the
    pure-Python h11; the `serve` extra installs it), uvloop (libuv; orbax-checkpoint installs it)
    runs the event loop (asyncio's if it is missing), no access log line per request, no
    proxy-headers layer (nothing here reads the client's address).

    uvicorn bounds neither how long a client may take to send a request's head nor the number of
    connections (its limit_concurrency answers over-limit requests only once their headers are in,
    in plain text), so the protocol is `guarded_protocol`'s: a head begun but not complete within
    `header_timeout_s` (or longer than MAX_HEAD_BYTES) gets 408 (431) and the connection closes (a
    connection that sent nothing in that time is closed, as an idle keep-alive one is);
    beyond `max_connections` open connections a new one gets 503 and closes. `on_shutdown()`, when
    given, runs on the loop as the server begins to shut down (it stops listening right after).

    A client that sends EOF after a whole request (a half-close, `shutdown(SHUT_WR)`) is answered;
    see `guarded_protocol`."""
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
    protocol = guarded_protocol(uvicorn.config.HTTP_PROTOCOLS[http_impl], header_timeout_s, max_connections)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, loop=loop_impl,
                            access_log=False, proxy_headers=False, timeout_keep_alive=KEEP_ALIVE_S,
                            **{"timeout_graceful_shutdown": 2, **extra})
    server = _server_class()(config)
    server.on_shutdown = on_shutdown
    server.http_impl, server.loop_impl = http_impl, loop_impl
    return server


def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, telling the app when shutdown begins (it drains its requests)."""
        on_shutdown = None

        async def shutdown(self, sockets=None) -> None:
            if self.on_shutdown is not None:
                self.on_shutdown()
            await super().shutdown(sockets)

    return DrainingServer


def guarded_protocol(protocol, header_timeout_s: float, max_connections: int | None):
    """A subclass of uvicorn's HTTP protocol class (or its import string) with a deadline for each
    request's head, a bound on its size, and a bound on open connections (see `uvicorn_server`).

    EOF from the client: uvicorn takes it for a disconnect (the request in flight is dropped). At
    the TCP level a client that half-closed (`shutdown(SHUT_WR)`, done reading nothing yet) and one
    that left both send EOF; only a write tells them apart (the gone one's host answers it with a
    reset, and the next write fails). So with a whole request in flight the connection stays open,
    the request is answered and the connection closes after it; until the reply begins, an HTTP/1.1
    connection gets a `100 Continue` interim response (which HTTP/1.1 clients read past) at once
    and every PROBE_S, so a client that is gone is found (its request then sees a disconnect, as
    before); a streamed reply's keep-alive comments do the same. Any other EOF closes, as uvicorn
    does."""
    import asyncio

    from uvicorn.importer import import_from_string

    base = import_from_string(protocol) if isinstance(protocol, str) else protocol

    class Guarded(base):
        _head_timer: asyncio.TimerHandle | None = None
        _head_due = 0.0
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if max_connections is not None and len(self.connections) > max_connections:
                _refuse(transport, 503, f"the server holds its maximum of {max_connections} connections "
                                        f"(sprint-jax serve --max-connections); retry later", "too_many_connections")
                return
            self._watch_head(0)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_head(len(data))

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            self._stop_probe()
            super().connection_lost(exc)

        _probe_timer: asyncio.TimerHandle | None = None

        def eof_received(self):
            cycle = self.cycle
            if cycle is None or cycle.response_complete or cycle.more_body or cycle.disconnected:
                return super().eof_received()          # falsy: the transport closes
            cycle.keep_alive = False                   # answer, then close
            if getattr(self, "scope", {}).get("http_version") == "1.1":
                self._probe()
            return True                                # keep the write side open

        def _probe(self) -> None:
            self._probe_timer = None
            cycle = self.cycle
            if cycle is None or cycle.response_started or cycle.response_complete or self.transport.is_closing():
                return
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._probe_timer = asyncio.get_running_loop().call_later(PROBE_S, self._probe)

        def _stop_probe(self) -> None:
            if self._probe_timer is not None:
                self._probe_timer.cancel()
                self._probe_timer = None

        def _in_head(self) -> bool:
            """Waiting for a request's head: no request open, not idle between requests (the
            keep-alive timer runs then), not closing."""
            cycle = self.cycle
            return ((cycle is None or cycle.response_complete) and self.timeout_keep_alive_task is None
                    and not self.transport.is_closing())

        def _watch_head(self, n: int) -> None:
            if not self._in_head():
                self._head_bytes = 0
                self._stop_head_timer()
                return
            self._head_bytes += n
            if self._head_bytes > MAX_HEAD_BYTES:
                _refuse(self.transport, 431, f"the request head is longer than {MAX_HEAD_BYTES} bytes",
                        "request_header_fields_too_large")
                return
            if self._head_timer is None:
                self._arm(header_timeout_s)

        def _arm(self, delay: float) -> None:
            loop = asyncio.get_running_loop()
            self._head_due = loop.time() + delay
            self._head_timer = loop.call_later(delay, self._head_timeout)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if asyncio.get_running_loop().time() - self._head_due > 0.1:
                # late: the loop was busy (an engine step on it), and uvloop runs due timers before
                # it reads the sockets; what the client sent meanwhile is read first
                self._arm(0.01)
                return
            if not self._in_head():
                return
            if self._head_bytes == 0:    # nothing asked (a client that connects ahead): close as an idle
                self.transport.close()   # keep-alive connection is closed, with nothing to answer
                return
            _refuse(self.transport, 408, f"the request head did not arrive within {header_timeout_s:g} s",
                    "request_timeout")

    Guarded.__name__ = Guarded.__qualname__ = "Guarded" + base.__name__
    return Guarded


def _refuse(transport, status: int, message: str, code: str) -> None:
    """Answer `status` with an OpenAI-shaped error outside any request, and close the connection."""
    import http
    import json

    from sprint_jax.serve.app import APIError

    body = json.dumps(APIError(status, message, code=code).payload()).encode()
    transport.write(f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
    transport.close()


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
    """The server: `start()` on a thread of this process, or `serve_forever()` in this thread.

    Protection against clients: `api_key` (None: no authentication) is needed on every route but
    /health; a body over `max_request_bytes` gets 413, one not complete within `body_timeout_s` 408,
    a request head not complete within `header_timeout_s` 408; beyond `max_connections` open
    connections a new one gets 503. Shutdown (SIGTERM / SIGINT, or `stop()`) drains: the server
    stops listening, requests in flight get `shutdown_grace_s` seconds to finish, the rest are
    ended (a JSON 503; a stream: an SSE error event, then [DONE]). `export_meta` is the model's
    sprint_jax.json: text prompts are put in the prompt format it records."""

    def __init__(self, engine, model_name: str, sprint_config=None, host: str = "127.0.0.1", port: int = 0,
                 max_queue: int = 64, default_max_tokens: int = 256, log_level: str = "warning",
                 switch_interval_s: float | None = 0.0005, engine_on_loop: bool | None = None,
                 api_key: str | None = None, max_request_bytes: int | None = None, max_connections: int | None = 512,
                 header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = 30.0,
                 shutdown_grace_s: float = 10.0, export_meta: dict | None = None):
        from sprint_jax.infer.orchestrator import OrchestratorConfig
        from sprint_jax.serve.app import MAX_REQUEST_BYTES, ServeState, make_app
        from sprint_jax.serve.worker import EngineWorker

        if engine_on_loop is None:             # see sprint_jax/serve/worker.py: where the engine runs
            import jax
            engine_on_loop = jax.default_backend() == "cpu"
        self.engine_on_loop = engine_on_loop
        self.worker = EngineWorker(engine, max_queue=max_queue, on_loop=engine_on_loop)
        self.state = ServeState(self.worker, model_name, sprint_config or OrchestratorConfig(),
                                default_max_tokens=default_max_tokens, api_key=api_key,
                                max_request_bytes=max_request_bytes or MAX_REQUEST_BYTES, body_timeout_s=body_timeout_s,
                                export_meta=dict(export_meta or {}))
        self.app = make_app(self.state)
        self.host = host
        self.shutdown_grace_s = shutdown_grace_s
        # uvicorn cancels what is still running `timeout_graceful_shutdown` s after shutdown begins;
        # the app ends its requests itself at the grace's end, so uvicorn's limit is a backstop after it
        self._uv = uvicorn_server(self.app, host, port, log_level, header_timeout_s=header_timeout_s,
                                  max_connections=max_connections,
                                  on_shutdown=lambda: self.state.begin_drain(shutdown_grace_s),
                                  timeout_graceful_shutdown=shutdown_grace_s + 5)
        self.http_impl, self.loop_impl = self._uv.http_impl, self._uv.loop_impl
        self._thread: threading.Thread | None = None
        self.port = port
        # The engine's thread and the HTTP thread hand work to each other (every item with the
        # engine on a thread of its own, every turn with it paced by the loop); Python's default GIL
        # switch interval (5 ms) would add up to that per hand-off. Set for the process while the
        # server runs (restored by stop()); None leaves it alone.
        self._switch = switch_interval_s
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
        """Run in the calling thread until SIGTERM / SIGINT, then drain and return (uvicorn handles
        the signals; it re-raises the one it caught once it has shut down, which a SIGTERM handler
        of ours absorbs: a drained shutdown returns normally, so the process exits 0)."""
        import signal

        self._set_switch()
        self.worker.start()
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
        try:
            self._uv.run()
        finally:
            self.worker.stop()
            if main:
                signal.signal(signal.SIGTERM, old)

    def stop(self) -> None:
        """Shut down as a SIGTERM does (drained within the grace), then stop the engine."""
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(self.shutdown_grace_s + 15)
        self.worker.stop()
        if self._switch is not None:
            sys.setswitchinterval(self._old_switch)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
