"""`switchyard router serve`: the OIP front door on port 8001."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    router = sub.add_parser("router", help="the OIP front door: routing, failover, shadow, auth, usage")
    commands = router.add_subparsers(dest="router_command", required=True, metavar="SUBCOMMAND")
    serve = commands.add_parser("serve", help="serve OIP on --port, forwarding to the configured executors")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8001)
    serve.add_argument(
        "--config", required=True, help="routes TOML file (deployments, routes, [router] limits)"
    )
    serve.add_argument("--metering", default="", help="metering HOST:PORT (auth and usage)")
    serve.add_argument(
        "--evaluator", default="", help="evaluator HOST:PORT for shadow pairs (default: local)"
    )
    serve.add_argument("--spool-dir", default="", help="durable usage spool (default: [router] spool_dir)")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from switchyard import transport

    transport.prefer_low_latency()  # before anything imports grpc
    import dataclasses
    from pathlib import Path

    from services.router import config
    from services.router.server import start_router
    from switchyard import telemetry
    from switchyard.errors import SwitchyardError
    from switchyard.grpcio import ServerOptions, run_service, stop_signal

    try:
        cfg = config.load(Path(args.config))
        if args.evaluator:
            cfg = dataclasses.replace(
                cfg, settings=dataclasses.replace(cfg.settings, evaluator=args.evaluator)
            )
    except SwitchyardError as exc:
        print(f"switchyard router: {exc}")
        return 2
    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-router"))

    async def run() -> None:
        stop = stop_signal()  # before the address is announced: see stop_signal
        running = await start_router(
            cfg,
            args.metering,
            ServerOptions(host=args.host, port=args.port),
            Path(args.spool_dir) if args.spool_dir else None,
        )
        print(f"router serving OIP on {running.address}", flush=True)
        await running.serve_until_signal(stop)

    try:
        run_service(run())
    except SwitchyardError as exc:
        print(f"switchyard router: {exc}")
        return 2
    return 0
