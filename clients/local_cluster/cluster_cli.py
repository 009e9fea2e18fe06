"""`switchyard up`, `switchyard demo` (the main job, what `make run` runs) and `switchyard health`.

Registration only adds arguments; the commands import the cluster modules when they run, so
the CLI still starts in the XLA environment (which has neither temporalio nor tritonclient).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default="", help="TOML config file (default: $SWITCHYARD_CONFIG, then built-in)"
    )
    parser.add_argument("--state-dir", default="", help="where the ledger, Temporal database and logs go")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext between services and no caller checks (security.insecure; tests only)",
    )


def _load(args: argparse.Namespace) -> Any:
    from clients.local_cluster.cluster_config import load_config

    overrides: dict[str, Any] = {}
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    if args.insecure:
        overrides["security"] = {"insecure": True}
    return load_config(args.config or None, overrides=overrides)


def _reported(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Expected errors (bad config, a port in use, a service that would not start) print
    their message, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        from switchyard.errors import SwitchyardError

        try:
            return fn(args)
        except SwitchyardError as exc:
            print(f"switchyard {args.command}: {exc}", file=sys.stderr)
            return 2

    return run


@_reported
def _up(args: argparse.Namespace) -> int:
    import time

    began = time.monotonic()  # before the cluster's imports: they are part of its start-up
    from clients.local_cluster.up import up

    return asyncio.run(up(_load(args), began))


@_reported
def _up_status(args: argparse.Namespace) -> int:
    from clients.local_cluster.up import format_table, status_rows

    rows = asyncio.run(status_rows(_load(args).state_dir.resolve()))
    print(format_table(rows))
    return 0 if all(r.health in ("SERVING", "-") for r in rows) else 1


@_reported
def _demo(args: argparse.Namespace) -> int:
    from clients.local_cluster.demo import DemoOptions, demo

    options = DemoOptions(keep=args.keep, requests=args.requests, concurrency=args.concurrency)
    return asyncio.run(demo(_load(args), options))


def _health(args: argparse.Namespace) -> int:
    from clients.local_cluster.health import health_main

    return health_main(args)


def register(sub: argparse._SubParsersAction[Any]) -> None:
    up = sub.add_parser(
        "up",
        help="start the whole cluster on this machine; Ctrl-C stops it",
        description="Starts every service, restarts one that crashes (with back-off, up to a "
        "crash-loop limit), and stops them all on Ctrl-C or SIGTERM.",
        epilog="examples:\n  switchyard up\n  switchyard up --config cluster.toml\n"
        "  switchyard up status            # from another shell: health, restarts, last exit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config_args(up)
    up.set_defaults(func=_up)
    up_sub = up.add_subparsers(dest="up_command", metavar="COMMAND")
    status = up_sub.add_parser(
        "status",
        help="the running cluster's services: health, restarts, last exit (exit 1 unless all SERVING)",
    )
    _config_args(status)
    status.set_defaults(func=_up_status)

    demo = sub.add_parser("demo", help="bring the cluster up and run the main job end to end (make run)")
    _config_args(demo)
    demo.add_argument("--keep", action="store_true", help="leave the cluster up afterwards (until Ctrl-C)")
    demo.add_argument("--requests", type=int, default=300, help="inference requests through the router")
    demo.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    demo.set_defaults(func=_demo)

    health = sub.add_parser("health", help="grpc.health.v1 check of ADDRESS; exit 0 when SERVING")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help='health service name ("" = the server)')
    health.add_argument("--timeout", type=float, default=2.0, help="seconds")
    health.add_argument(
        "--identity",
        default="",
        help="the service ADDRESS must prove it is (metering, executor, ...; default: the one whose "
        "certificate this process holds, as a container checking itself)",
    )
    health.set_defaults(func=_health)
