"""`switchyard paths list|register`: the ledger's accelerator paths, for operators.

Routers register their deployments' paths themselves (services/router/path_registrar.py) and the
trial worker those of its trials, so these commands are for looking, and for a path used by
something else (a batch job that records usage itself, say).

    switchyard paths list
    switchyard paths register cpu-eager@node1 --executor executor-cpu-0.executor-cpu:8101
    switchyard paths register gpu-a@node2 --backend cuda --resource-class gpu-h200 \\
        --price-key cuda/gpu-h200 --host node2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

DEFAULT_ADDRESS = "127.0.0.1:8201"
EXAMPLES = __doc__.split("\n\n", 2)[2] if __doc__ else ""


def _client(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metering",
        default=os.environ.get("SWITCHYARD_METERING_ADDRESS", DEFAULT_ADDRESS),
        help="metering service address, host:port (default $SWITCHYARD_METERING_ADDRESS or %(default)s)",
    )


def _channel(address: str) -> Any:
    """The operator's certificate (or explicit plaintext), and SWITCHYARD_API_KEY if set."""
    from switchyard import tls

    return tls.aio_channel(address, api_key=os.environ.get("SWITCHYARD_API_KEY", ""), expect=tls.METERING)


async def _list(args: argparse.Namespace) -> int:
    from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
    from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

    async with _channel(args.metering) as channel:
        reply = await mgrpc.MeteringStub(channel).ListPaths(mpb.ListPathsRequest(), timeout=args.timeout)
    rows = [("path", "backend", "resource class", "price key", "host", "priced")]
    rows += [
        (p.path, p.backend, p.resource_class, p.price_key, p.host, "yes" if p.priced else "NO (unpriced)")
        for p in reply.paths
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    if any(not p.priced for p in reply.paths):
        print("note: usage on an unpriced path is recorded without an amount until `switchyard prices set`")
    return 0


async def _register(args: argparse.Namespace) -> int:
    from switchyard.gen.switchyard.v1 import executor_pb2, executor_pb2_grpc
    from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
    from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

    backend, resource_class, price_key, host = args.backend, args.resource_class, args.price_key, args.host
    if args.executor:
        async with _channel(args.executor) as channel:
            d = await executor_pb2_grpc.ExecutorControlStub(channel).Describe(
                executor_pb2.DescribeRequest(), timeout=args.timeout
            )
        backend = backend or d.device.backend
        resource_class = resource_class or d.resource_class
        price_key = price_key or d.price_key
        host = host or d.host
    if not backend:
        print("switchyard paths register: give --executor HOST:PORT, or --backend", file=sys.stderr)
        return 2
    resource_class = resource_class or backend
    price_key = price_key or f"{backend}/{resource_class}"
    request = mpb.RegisterPathRequest(
        path_info=mpb.PathInfo(
            path=args.path, backend=backend, resource_class=resource_class, price_key=price_key, host=host
        ),
        actor=mpb.Actor(principal=args.actor, source="cli"),
    )
    async with _channel(args.metering) as channel:
        info = await mgrpc.MeteringStub(channel).RegisterPath(request, timeout=args.timeout)
    print(
        f"path {info.path}: backend {info.backend}, resource class {info.resource_class}, "
        f"price key {info.price_key}, host {info.host or '-'}"
    )
    return 0


def register(sub: argparse._SubParsersAction[Any]) -> None:
    paths = sub.add_parser(
        "paths",
        help="the ledger's accelerator paths (routers register theirs themselves)",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="examples:\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    psub = paths.add_subparsers(dest="paths_command", required=True, metavar="COMMAND")
    listing = psub.add_parser("list", help="every registered path and whether a price is in force")
    _client(listing)
    listing.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for metering")
    listing.set_defaults(func=lambda a: asyncio.run(_list(a)))

    reg = psub.add_parser(
        "register",
        help="register a path (idempotent; paths are immutable once registered)",
        epilog="examples:\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    reg.add_argument("path", help="the path id usage is charged to, e.g. cpu-eager@node1")
    reg.add_argument(
        "--executor", default="", help="executor host:port whose Describe fills the fields not given"
    )
    reg.add_argument("--backend", default="", help="cpu | cuda | xla | tpu (default: the executor's)")
    reg.add_argument(
        "--resource-class", default="", help="pricing class, e.g. gpu-h200 (default: the executor's)"
    )
    reg.add_argument(
        "--price-key",
        default="",
        help="key into the price book (default: the executor's, else BACKEND/CLASS)",
    )
    reg.add_argument("--host", default="", help="host id; paths on one host never measure at once")
    reg.add_argument(
        "--as", dest="actor", default=os.environ.get("USER", "cli"), help="who acts, for the audit trail"
    )
    reg.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each call")
    _client(reg)
    reg.set_defaults(func=lambda a: asyncio.run(_register(a)))
