"""`specsuite serve --ray ADDRESS --replicas N`: the server app (apps/serving/server.py) as a Ray Serve
deployment. Each replica loads its own model and runs its own batch, with the same routes, key,
limits and admission as one `specsuite serve` process; Ray Serve's proxy spreads the requests."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import ray
from ray import serve

from specsuite.apps import limits
from .cli import build_app

APP_NAME = "specsuite"


@serve.ingress()
class Replica:
    """One model and its batch; the ASGI app Ray Serve's proxy hands this replica's requests to."""

    def __init__(self, args: argparse.Namespace):
        self._asgi = build_app(args)[1]  # not `app`: Ray's ingress wrapper owns that name

    def __serve_build_asgi_app__(self):
        return self._asgi


def deploy(args: argparse.Namespace):
    """Run the replicas on the connected cluster (`ray.init` done) and wait until they are ready;
    the proxy listens on --host:--port."""
    cpus = args.replica_cpus or max(1.0, ray.cluster_resources().get("CPU", 1.0) // args.replicas)
    serve.start(http_options={"host": args.host, "port": args.port})
    deployment = serve.deployment(
        Replica, name=APP_NAME, num_replicas=args.replicas,
        # The app admits and queues by itself (429 past its queue): Ray's own queue stays out of the way.
        max_ongoing_requests=args.batch_size + args.max_queue,
        graceful_shutdown_timeout_s=args.drain_timeout, ray_actor_options={"num_cpus": cpus})
    serve.run(deployment.bind(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})),
              name=APP_NAME, route_prefix="/")


def serve_on_ray(args: argparse.Namespace) -> int:
    """Deploy, then serve until SIGTERM or Ctrl-C; then the replicas drain (--drain-timeout)."""
    # The key as this process sees it (flag or environment): a replica on another node has its own environment.
    args = argparse.Namespace(**{**vars(args), "api_key": limits.api_key(args.api_key)})
    ray.init(address=args.ray, include_dashboard=False, log_to_driver=False)
    try:
        deploy(args)
    except (RuntimeError, ValueError) as e:  # a replica that cannot load its model fails the deployment
        print(f"error: {e} (the replicas' tracebacks are in Ray's logs: "
              f"/tmp/ray/session_latest/logs/serve/ on their node)", file=sys.stderr)
        serve.shutdown()
        ray.shutdown()
        return 2
    print(f"serving on http://{args.host}:{args.port}/v1 with {args.replicas} replica(s) on Ray at {args.ray}",
          file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)  # waits for the replicas' requests in flight, up to --drain-timeout
        serve.shutdown()
        ray.shutdown()
    return 0
