"""Chapter 13: ``minillm route``, a prefix-aware router in front of several engine instances.

    minillm route --instances 2 [--model PATH] [engine flags] [--port 8000]    # starts the instances
    minillm route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 [--block-size 16]
    minillm route --instances 2 --policy round_robin                           # the baseline

With ``--instances N`` the router starts ``N`` ``minillm serve`` processes on free ports of
127.0.0.1, passing the engine flags through (``--block-size``, ``--kv-cache-mb``, ...), each on
``cpu_count / N`` torch threads, and stops them when it stops. With ``--backend`` (repeated)
it routes to instances already running; give it their ``--block-size`` if not the default.
"""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from minillm.cli import add_engine_arguments, add_model_argument

    add_model_argument(parser)
    add_engine_arguments(parser)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--instances", type=int, help="start this many instances of the model (minillm serve)")
    group.add_argument("--backend", action="append", metavar="URL", help="an instance already running (repeatable)")
    parser.add_argument("--policy", default="prefix", choices=["prefix", "round_robin"],
                        help="prefix: the instance most likely to cache the prompt's prefix (default); "
                             "round_robin: each instance in turn")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="requests in flight at which an instance counts as saturated and the next best is "
                             "used (default: the engine's --max-num-seqs)")
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from minillm.cli import engine_flag_values
    from minillm.router.app import create_router_app
    from minillm.router.launch import engine_argv, spawn_instances, stop_instances

    if args.instances is not None and args.instances < 1:
        print("minillm route: --instances must be >= 1", file=sys.stderr)
        return 2
    procs = []
    if args.backend:
        urls = args.backend
    else:
        flags = engine_argv(engine_flag_values(args))
        threads = max(1, (os.cpu_count() or 1) // args.instances)
        print(f"minillm route: starting {args.instances} instances of {args.model} ({threads} threads each)",
              flush=True)
        procs = spawn_instances(args.instances, args.model, flags, threads=threads)
        urls = [p.url for p in procs]
    try:
        app = create_router_app(urls, args.model, policy=args.policy, block_size=args.block_size,
                                max_in_flight=args.max_in_flight or args.max_num_seqs,
                                health_interval=args.health_interval)
        print(f"minillm route: {args.policy} routing at http://{args.host}:{args.port}/v1 over "
              + ", ".join(urls), flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        stop_instances(procs)
    return 0
