"""`switchyard router serve`: the OIP front door on port 8001; and its admin commands.

`switchyard router routes | set-route | delete-route | deployments | shadow` call a running
router's RouterAdmin API (changing a route needs a key with role `admin`). The key comes from
SWITCHYARD_API_KEY, never a flag (flags show in `ps` and shell history). Answers print as JSON.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.router.router_config import RouterConfig


def register(sub: argparse._SubParsersAction[Any]) -> None:
    router = sub.add_parser("router", help="the OIP front door: routing, failover, shadow, auth, usage")
    commands = router.add_subparsers(dest="router_command", required=True, metavar="SUBCOMMAND")
    _add_serve(commands)
    _add_admin(commands)


def _add_serve(commands: argparse._SubParsersAction[Any]) -> None:
    serve = commands.add_parser("serve", help="serve OIP on --port, forwarding to the configured executors")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8001)
    serve.add_argument(
        "--config", required=True, help="routes TOML file (deployments, routes, [router] limits)"
    )
    serve.add_argument("--metering", default="", help="metering HOST:PORT (auth and usage)")
    serve.add_argument(
        "--openai-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port, e.g. 8000 ([router] openai_port; -1 off)",
    )
    serve.add_argument(
        "--evaluator", default="", help="evaluator HOST:PORT for shadow pairs (default: local)"
    )
    serve.add_argument("--spool-dir", default="", help="durable usage spool (default: [router] spool_dir)")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus metrics port (GET /metrics; default $SWITCHYARD_METRICS_PORT, else 0 = any "
        "free port, logged; -1 = none)",
    )
    serve.add_argument(
        "--tls-cert", default="", help="PEM certificate chain: TLS on the public port (with --tls-key)"
    )
    serve.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    serve.set_defaults(func=_serve)


def _add_admin(commands: argparse._SubParsersAction[Any]) -> None:
    def admin(name: str, help: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help)
        parser.add_argument("--address", default="127.0.0.1:8001", help="router (default 127.0.0.1:8001)")
        parser.add_argument("--timeout", type=float, default=10.0)
        parser.add_argument("--tls-ca", default="", help="CA (PEM) of a router serving TLS on its port")
        parser.set_defaults(func=_admin, admin=name)
        return parser

    admin("routes", help="list the routes in force")
    set_route = admin("set-route", help="add or replace a model's route (role admin; audited)")
    set_route.add_argument("model")
    set_route.add_argument(
        "--policy",
        default="failover",
        help="pinned | weighted | failover | least_loaded | cheapest (default failover)",
    )
    set_route.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="DEPLOYMENT[:WEIGHT]",
        help="a configured deployment, in order; repeat for more (weights for `weighted`)",
    )
    set_route.add_argument("--shadow-share", type=float, default=0.0, help="share mirrored to candidates")
    set_route.add_argument(
        "--shadow-candidate", action="append", default=[], metavar="DEPLOYMENT", help="repeatable"
    )
    set_route.add_argument(
        "--max-in-flight",
        type=int,
        default=0,
        help="requests in flight at once on the route; 0: [router] max_in_flight",
    )
    delete_route = admin("delete-route", help="remove a model's route (role admin; audited)")
    delete_route.add_argument("model")
    admin("deployments", help="each deployment's health, load, transport and price")
    shadow = admin("shadow", help="shadow divergence per model and candidate")
    shadow.add_argument("--model", default="")


def _serve(args: argparse.Namespace) -> int:
    from switchyard import transport

    transport.prefer_low_latency()  # before anything imports grpc
    from pathlib import Path

    from services.router import router_metrics
    from services.router.router_server import start_router
    from switchyard import metrics_endpoint as prometheus
    from switchyard import telemetry
    from switchyard.errors import SwitchyardError
    from switchyard.grpcio import ServerOptions, run_service, stop_signal

    try:
        cfg, public_tls = _read_config(args)
    except OSError as exc:
        print(f"switchyard router: cannot read {exc.filename}: {exc.strerror}")
        return 2
    except SwitchyardError as exc:
        print(f"switchyard router: {exc}")
        return 2
    telemetry.setup(telemetry.TelemetryConfig.from_env("switchyard-router"))
    metrics_port = prometheus.metrics_port(args.metrics_port)

    async def run() -> None:
        stop = stop_signal()  # before the address is announced: see stop_signal
        running = await start_router(
            cfg,
            args.metering,
            ServerOptions(host=args.host, port=args.port, public_tls=public_tls),
            Path(args.spool_dir) if args.spool_dir else None,
        )
        endpoint = prometheus.serve(
            [router_metrics.collector(running.router)], args.host, metrics_port, "router"
        )
        print(f"router serving OIP on {running.address}", flush=True)
        if running.openai is not None:
            print(f"router serving the OpenAI API on http://{args.host}:{running.openai.port}/v1", flush=True)
        await running.serve_until_signal(stop)
        if endpoint is not None:
            endpoint.close()

    try:
        run_service(run())
    except SwitchyardError as exc:
        print(f"switchyard router: {exc}")
        return 2
    return 0


def _read_config(args: argparse.Namespace) -> tuple[RouterConfig, tuple[bytes, bytes] | None]:
    """The routes file with the flags' overrides, and the public port's TLS (chain, key)."""
    import dataclasses
    from pathlib import Path

    from services.router import router_config
    from switchyard.errors import InvalidArgument

    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidArgument("give --tls-cert and --tls-key together (or neither)")
    public_tls = (
        (Path(args.tls_cert).read_bytes(), Path(args.tls_key).read_bytes()) if args.tls_cert else None
    )
    cfg = router_config.load(Path(args.config))
    if args.openai_port is not None:
        cfg = dataclasses.replace(
            cfg, settings=dataclasses.replace(cfg.settings, openai_port=args.openai_port)
        )
    if args.evaluator:
        cfg = dataclasses.replace(cfg, settings=dataclasses.replace(cfg.settings, evaluator=args.evaluator))
    return cfg, public_tls


def _target(spec: str) -> Any:
    from switchyard.errors import InvalidArgument
    from switchyard.gen.switchyard.v1 import router_pb2 as rpb

    name, _, weight = spec.partition(":")
    try:
        return rpb.Target(deployment=name, weight=float(weight) if weight else 1.0)
    except ValueError:
        raise InvalidArgument(f"--target {spec!r}: the weight after ':' must be a number") from None


def _admin(args: argparse.Namespace) -> int:
    import json
    import os

    import grpc
    from google.protobuf.json_format import MessageToDict

    from switchyard.gen.switchyard.v1 import router_pb2 as rpb
    from switchyard.gen.switchyard.v1 import router_pb2_grpc as rgrpc

    key = os.environ.get("SWITCHYARD_API_KEY", "")
    metadata = (("authorization", f"Bearer {key}"),) if key else None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as ca:
            credentials = grpc.ssl_channel_credentials(ca.read())
        channel = grpc.secure_channel(args.address, credentials)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        stub = rgrpc.RouterAdminStub(channel)
        call: dict[str, Any] = {"timeout": args.timeout, "metadata": metadata}
        reply: Any
        if args.admin == "routes":
            reply = stub.ListRoutes(rpb.ListRoutesRequest(), **call)
        elif args.admin == "set-route":
            route = rpb.Route(
                model=args.model,
                policy=args.policy,
                targets=[_target(t) for t in args.target],
                max_in_flight=args.max_in_flight,
            )
            if args.shadow_share or args.shadow_candidate:
                route.shadow.share = args.shadow_share
                route.shadow.candidates.extend(rpb.Target(deployment=c) for c in args.shadow_candidate)
            reply = stub.SetRoute(rpb.SetRouteRequest(route=route), **call)
        elif args.admin == "delete-route":
            reply = stub.DeleteRoute(rpb.DeleteRouteRequest(model=args.model), **call)
        elif args.admin == "deployments":
            reply = stub.ListDeployments(rpb.ListDeploymentsRequest(), **call)
        else:
            reply = stub.ShadowReport(rpb.ShadowReportRequest(model=args.model), **call)
    print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2))
    return 0
