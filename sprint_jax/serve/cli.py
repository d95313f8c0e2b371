"""`sprint-jax serve`: the OpenAI-compatible server."""
from __future__ import annotations

from pathlib import Path

DESCRIPTION = """Serve a model over the OpenAI API (completions, chat completions, SSE streaming) on the
batched engine: one engine loop steps every request's rows together; n > 1 forks n children
from one prefill of the prompt.

  sprint-jax serve --model runs/sft_sprint --port 8000
  curl localhost:8000/v1/models
  # any OpenAI client: base_url=http://127.0.0.1:8000/v1, api_key=anything

SPRINT mode: ask for model "NAME:sprint" (the ids are in /v1/models), or pass
extra_body={"sprint": {"max_stages": 4, "mode": "parallel", ...}} (OrchestratorConfig fields);
the reply's content is the whole completion and its `sprint` object the run record (stages, plans,
executions, sequential and total tokens, timings); streaming sends each stage event as it happens.
The flags below (--max-stages ...) are the server's defaults for SPRINT requests; a request's
temperature / top_p / top_k / seed / max_tokens (= max_total_tokens) override them.

GET /health and GET /metrics (Prometheus text) report queue depth, active rows, slot use,
tokens/s and the request latency histogram.
"""


ENGINE_ON = {"auto": None, "loop": True, "thread": False}      # --engine-on -> Server(engine_on_loop=...)


def add_arguments(p) -> None:
    from sprint_jax.infer.infer_cli import add_run_arguments

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients ask for (default: the directory name)")
    p.add_argument("--max-seqs", type=int, default=16, help="sequence slots: requests decoded at once")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests queued beyond the slots before new ones get HTTP 429 (Retry-After)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request that sets none")
    p.add_argument("--engine-on", choices=ENGINE_ON, default="auto",
                   help="where the engine steps: 'loop' = on the HTTP event loop (no thread hand-offs: the "
                        "least overhead per request; /health and new requests wait while a step runs), "
                        "'thread' = a thread of its own (the loop stays responsive during long steps); "
                        "auto (default): loop on CPU, thread on an accelerator")
    add_run_arguments(p)


def run(args) -> int:
    from sprint_jax.errors import UserError
    from sprint_jax.infer.infer_cli import build_batch_engine, config_from_args
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
    config = config_from_args(args)
    engine = build_batch_engine(args, config, args.max_seqs)
    name = args.served_model_name or Path(args.model).resolve().name
    server = Server(engine, name, config, host=args.host, port=args.port, max_queue=args.max_queue,
                    default_max_tokens=args.default_max_tokens, log_level="info",
                    engine_on_loop=ENGINE_ON[args.engine_on])
    print(f"sprint-jax serve: model ids {name} and {name}:sprint; uvicorn reports the address", flush=True)
    server.serve_forever()
    return 0
