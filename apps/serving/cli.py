"""`specsuite serve`: the OpenAI-compatible server (apps/serving/server.py) on one model."""

from __future__ import annotations

import argparse
import sys
import threading

from specsuite.apps import limits
from specsuite.models import DEFAULT_MODEL

from .server import DEFAULT_BATCH_SIZE, DEFAULT_MAX_QUEUE


def build_app(args: argparse.Namespace):
    """Load the model and build the server the flags describe (one process, or one Ray Serve
    replica): (service, app). Raises ValueError, RuntimeError or OSError with a message for the user."""
    from specsuite.models import load_model

    from .server import ChatService, create_app

    adapter = "auto" if args.adapter in ("gec", "rag") else args.adapter
    model, tokenizer = load_model(args.model, dtype=args.dtype, adapter=adapter,
                                  task=args.adapter if args.adapter in ("gec", "rag") else None)
    index = None
    if args.index:
        from specsuite.retrieval import PassageIndex

        index = PassageIndex.load(args.index)
    from specsuite.core.model.backend import requested_kind

    service = ChatService.from_loaded(model, tokenizer, index, batch_size=args.batch_size,
                                      backend=requested_kind(False, args.exact, "fast"),
                                      time_budget_s=args.time_budget, max_queue=args.max_queue,
                                      model_name=args.model_name)
    if args.time_budget:
        limits.step_cost(model, service.corrector.backend)  # admission's cost estimate, measured before the port says ready
    return service, create_app(service, ui=not args.no_ui, api_key=limits.api_key(args.api_key),
                               allowed_hosts=limits.allowed_hosts(args.allowed_hosts, args.host))


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    if warning := limits.exposure_warning(args.host, limits.api_key(args.api_key)):
        print(warning, file=sys.stderr)
    if args.ray:
        from .ray_serve import serve_on_ray

        return serve_on_ray(args)
    from .server import loading_app

    # The port answers 503 while the model loads, so clients can wait for it (Retry-After).
    loading = uvicorn.Server(uvicorn.Config(loading_app(args.model), host=args.host, port=args.port, log_level="warning"))
    thread = threading.Thread(target=loading.run, daemon=True)
    thread.start()
    try:
        service, app = build_app(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        loading.should_exit = True
        thread.join()
    print(f"serving {', '.join(service.models)} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    # SIGTERM or Ctrl-C: uvicorn stops taking connections and lets the requests in flight finish,
    # for at most --drain-timeout seconds, then exits.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout)
    return 0


def _positive(text: str) -> int:
    return limits.token_limit_arg(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/chat/completions) with the GEC and RAG apps")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset name or local model directory (default {DEFAULT_MODEL})")
    p.add_argument("--model-name", help="the name clients use for plain chat (default: --model)")
    p.add_argument("--adapter", default="gec", help="the one adapter merged into the one model: gec (the GEC adapter "
                   "shipped for the preset, default), rag, none (the base model), or a folder written by "
                   "`specsuite train`; for both specialists at full quality run two servers")
    p.add_argument("--index", help="a passage index (`specsuite rag index`): serves the specsuite-rag model")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default: bf16 where the CPU supports it")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", help=limits.API_KEY_HELP)
    p.add_argument("--allowed-hosts", metavar="NAMES", help="comma-separated Host names the server answers to, "
                   "400 otherwise ('*': any); default: localhost, 127.0.0.1 and ::1 when bound to loopback, any otherwise")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--batch-size", type=_positive, default=DEFAULT_BATCH_SIZE,
                   help=f"sequences decoded together in the one running batch (default {DEFAULT_BATCH_SIZE})")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests waiting beyond the batch before 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--time-budget", type=limits.time_budget_arg, default=limits.DEFAULT_TIME_BUDGET_S, metavar="S",
                   help="seconds a request may take, waiting included (default 180; 0: no limit): 408 past it")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds the requests in flight may take to finish before exit (default 30)")
    p.add_argument("--ray", metavar="ADDRESS", help="run as a Ray Serve deployment on this cluster ('auto': the one "
                   "`ray start` made here, 'local': a new one on this machine); the model loads in every replica")
    p.add_argument("--replicas", type=_positive, default=1, help="with --ray: replicas, one model each (default 1)")
    p.add_argument("--replica-cpus", type=float, metavar="N",
                   help="with --ray: CPUs a replica takes (default: the cluster's CPUs shared among the replicas)")
    p.add_argument("--exact", action="store_true", help="the model's own numerics (backend exact) instead of the "
                   "default fast one (int8 linear layers where this CPU has a fast int8 kernel that sums exactly)")
    p.add_argument("--no-ui", action="store_true", help="do not mount the Gradio apps at /gec and /rag")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_serve)
