"""`sprint-jax serve`: the OpenAI-compatible server."""
from __future__ import annotations

import sys
from pathlib import Path

from sprint_jax.serve.server import ENGINE_ON

DESCRIPTION = """Serve a model over the OpenAI API (completions, chat completions, SSE streaming) on the
batched engine: one engine loop steps every request's rows together; n > 1 forks n children
from one prefill of the prompt.

  sprint-jax serve --model runs/sft_sprint --port 8000
  curl localhost:8000/v1/models
  # any OpenAI client: base_url=http://127.0.0.1:8000/v1, api_key=the server's --api-key (or anything)

The model id NAME is the model's name (a trained export RUN/hf: the run's), or --served-model-name.
SPRINT mode: ask for model "NAME:sprint" (the ids are in /v1/models), or pass
extra_body={"sprint": {"max_stages": 4, "mode": "parallel", ...}} (OrchestratorConfig fields);
the reply's content is the whole completion and its `sprint` object the run record (stages, plans,
executions, sequential and total tokens, timings); streaming sends each stage event as it happens.
logprobs work with stream and in SPRINT mode; in SPRINT mode they list the planner's and executors' tokens
in text order with text_offset, and the tags the server inserts have no entry.
The flags below (--max-stages ...) are the server's defaults for SPRINT requests; a request's
temperature / top_p / top_k / seed / max_tokens (= max_total_tokens) override them; stop cuts the
reply as in a plain request and ends the run there. finish_reason is "length" for a run cut by a
budget (the record's termination says which). seed: an integer in [0, 2^31 - 1].

GET /health and GET /metrics (Prometheus text) report queue depth, active rows, slot use,
tokens/s and the request latency histogram.

Facing clients: --api-key (or $SPRINT_JAX_API_KEY) makes every route but /health need the header
`Authorization: Bearer KEY` (401 otherwise); listening beyond this machine without one warns.
Request fields this server does not implement get 400 naming the field, unless set to the value
that changes nothing (e.g. presence_penalty 0). Limits: --max-request-bytes (413),
--header-timeout / --body-timeout (408), --max-connections (503). SIGTERM drains: no new
connections, requests in flight get --shutdown-grace seconds, the rest end cleanly (503; a stream
gets an error event then [DONE]), and the process exits 0.
"""

API_KEY_ENV = "SPRINT_JAX_API_KEY"
EXIT_WAIT_S = 2.0        # after shutdown, how long the process waits for an engine step still running


def add_arguments(p) -> None:
    from sprint_jax.infer.infer_cli import add_run_arguments

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients ask for (NAME; NAME:sprint is SPRINT mode). Default: the model's name, "
                        "the --model directory's, or for a trained export (RUN/hf) the run directory's: "
                        "runs/demo/train/sprint/hf serves 'sprint'")
    p.add_argument("--max-seqs", type=int, default=16, help="sequence slots: requests decoded at once")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests queued beyond the slots before new ones get HTTP 429 (Retry-After)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request that sets none")
    p.add_argument("--engine-on", choices=ENGINE_ON, default="auto",
                   help="how the engine steps: 'loop' = paced by the HTTP event loop, each step on the "
                        "engine's thread while the loop serves (one hand-off per step), 'thread' = on a "
                        "thread of its own; neither holds the loop during a step or a compile. "
                        "auto (default): loop on CPU, thread on an accelerator")
    p.add_argument("--api-key", default=None,
                   help=f"clients must send 'Authorization: Bearer KEY' (every route but /health); default: "
                        f"${API_KEY_ENV} if set, else no authentication. The environment variable keeps the key "
                        f"out of the process list; the key is never logged")
    p.add_argument("--max-request-bytes", type=int, default=2 * 1024 * 1024,
                   help="largest request body accepted (default 2 MiB); a bigger one gets 413 before it is read")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections at most (default 512); a new one beyond gets 503")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers (default 10), else 408")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's body (default 30), else 408")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="on SIGTERM, seconds requests in flight get to finish (default 10); then they are ended "
                        "(503, or an SSE error event) and the process exits 0")
    add_run_arguments(p)


def _api_key(args) -> str | None:
    """The key from --api-key or the environment (the flag wins); a key that cannot travel in an
    HTTP header is a UserError (naming neither the key nor its characters)."""
    import os

    from sprint_jax.errors import UserError

    key, where = (args.api_key, "--api-key") if args.api_key is not None else (os.environ.get(API_KEY_ENV),
                                                                               f"${API_KEY_ENV}")
    if key is None:
        return None
    if not key.strip():
        raise UserError(f"{where} is empty; give a key or leave it unset (no authentication)")
    if not key.isascii() or not key.isprintable() or key != key.strip() or " " in key:
        raise UserError(f"{where} must be printable ASCII without spaces (it travels in an HTTP header)")
    return key


EXPORT_DIRS = ("hf", "out")   # the trainer's export directory (RUN/hf), a recipe stage's (STAGE/out/hf)


def model_name(model: str) -> str:
    """The default model id of `--model DIR`: the directory's name, or for a trained export (its
    name in EXPORT_DIRS) the name of the run directory that holds it."""
    path = Path(model).resolve()
    named = path
    while named.name in EXPORT_DIRS and named.parent != named:
        named = named.parent
    return named.name or path.name


def check_address(host: str, port: int) -> None:
    """Fail now (a UserError) if the server could not listen on host:port, before any weight is
    read: a host that does not resolve, a port in use or not ours to take. Binds as uvicorn
    does (every address the host resolves to, SO_REUSEADDR) and lets go at once."""
    import errno
    import socket

    from sprint_jax.errors import UserError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise UserError(f"--host {host}: not an address this machine can listen on "
                        f"({getattr(e, 'strerror', None) or e})") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}"
                                f"{' (another process holds the port)' if e.errno == errno.EADDRINUSE else ''}") from None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:                       # a host name: it may resolve beyond this machine
        return False


def run(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.infer.infer_cli import build_engine, config_from_args, export_meta
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("sprint-jax serve needs starlette and uvicorn: pip install 'sprint-jax[serve]'") from None
    from sprint_jax.serve.server import Server

    for name in ("max_seqs", "default_max_tokens"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_request_bytes", "max_connections"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(args, name) > 0 or getattr(args, name) == float("inf"):
            raise UserError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {getattr(args, name)}")
    if not 0 <= args.shutdown_grace < float("inf"):
        raise UserError(f"--shutdown-grace must be a number of seconds >= 0, got {args.shutdown_grace}")
    api_key = _api_key(args)
    if args.model:                   # a wrong --model is named first, then the address, then the model loads
        from sprint_jax.model.convert import check_model_dir
        check_model_dir(args.model, "--model")
    check_address(args.host, args.port)
    if api_key is None and not _loopback(args.host):
        print(f"sprint-jax serve: warning: listening on {args.host} without an API key: anyone who can reach "
              f"this port can use the model (set --api-key or ${API_KEY_ENV})", file=sys.stderr, flush=True)
    config = config_from_args(args)
    meta = export_meta(args.model)
    engine = build_engine(args, config, args.max_seqs)
    name = args.served_model_name or model_name(args.model)
    server = Server(engine, name, config, host=args.host, port=args.port, max_queue=args.max_queue,
                    default_max_tokens=args.default_max_tokens, log_level="info",
                    engine_on_loop=ENGINE_ON[args.engine_on], api_key=api_key,
                    max_request_bytes=args.max_request_bytes, max_connections=args.max_connections,
                    header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                    shutdown_grace_s=args.shutdown_grace, export_meta=meta)
    print(f"sprint-jax serve: model ids {name} and {name}:sprint (SPRINT mode)"
          f"{'; clients need the API key' if api_key else ''}; uvicorn reports the address", flush=True)
    try:
        server.serve_forever()
    except SystemExit as e:          # uvicorn could not listen after all (the port was taken meanwhile)
        if e.code != 3:
            raise
        raise UserError(f"cannot listen on {args.host}:{args.port} (uvicorn's reason is above)") from None
    if not server.worker.wait_idle(EXIT_WAIT_S):
        # every request is answered; the engine is still inside a step or a compile, which cannot be
        # stopped halfway: exit without it (tearing the runtime down under it could crash)
        import os

        print("sprint-jax serve: the engine is still in a step (compiling); exiting without waiting for it",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0
