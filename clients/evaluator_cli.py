"""`switchyard evaluator serve`: the evaluator service as its own process."""

from __future__ import annotations

import argparse
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    from services.evaluator.evaluator_server import run
    from switchyard import metrics_endpoint, telemetry
    from switchyard.grpcio import ServerOptions

    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-evaluator"))
    with metrics_endpoint.serving([], args.host, args.metrics_port, "evaluator"):
        return run(ServerOptions(host=args.host, port=args.port))


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Adds `evaluator serve`."""
    evaluator = sub.add_parser("evaluator", help="the evaluator service (compares outputs and loss curves)")
    commands = evaluator.add_subparsers(dest="evaluator_command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve the evaluator over gRPC")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8301, help="port (default 8301; 0 picks a free one)")
    serve.add_argument("--metrics-port", type=int, default=None)  # help: clients.cli_help
    serve.set_defaults(func=_serve)
