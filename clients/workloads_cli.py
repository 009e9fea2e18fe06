"""`switchyard workloads list|show|export`: captured workloads (switchyard/judge/capture_format.py).

The folder is `--dir` (default `[router] workloads_dir`, var/workloads). Workload files hold
request inputs and may be sensitive: exported copies are written 0600, and each command first
asks metering's Authorize (`--metering`) for `workloads:read` with SWITCHYARD_API_KEY, else
the operator's certificate (`show` and `export` on the workload's route, `list` on every
route: scope *), audited as `workloads.read`. Only an explicitly insecure setup without a key
skips the check (nothing is authenticated there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser("workloads", help="workloads captured at the router, for trial replay")
    commands = parser.add_subparsers(dest="workloads_command", required=True, metavar="SUBCOMMAND")
    listing = commands.add_parser("list", help="captured workloads: id, route, requests, sha256")
    listing.add_argument("--json", action="store_true")
    show = commands.add_parser("show", help="one workload: request count, shape and size distribution")
    show.add_argument("workload")
    export = commands.add_parser("export", help="copy a workload file out (prints its sha256)")
    export.add_argument("workload")
    export.add_argument("-o", "--output", required=True)
    for p in (listing, show, export):
        p.add_argument("--dir", default="var/workloads", help="the router's workloads_dir")
        p.add_argument(
            "--metering",
            default=os.environ.get("SWITCHYARD_METERING", "127.0.0.1:8201"),
            help="metering, which checks workloads:read (default SWITCHYARD_METERING or 127.0.0.1:8201)",
        )
    listing.set_defaults(func=_list)
    show.set_defaults(func=_show)
    export.set_defaults(func=_export)


def may_read(args: argparse.Namespace, scope: str, resource: str) -> bool:
    """True when the caller holds workloads:read on `scope` (or nothing is authenticated here);
    prints metering's refusal and returns False otherwise."""
    import asyncio

    import grpc

    from switchyard import tls
    from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
    from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc

    key = os.environ.get("SWITCHYARD_API_KEY", "")
    security = tls.current()
    if security.insecure and not key:
        return True

    async def ask() -> None:
        async with tls.aio_channel(
            args.metering, security=security, api_key=key, expect=tls.METERING
        ) as channel:
            await mgrpc.MeteringStub(channel).Authorize(
                mpb.AuthorizeRequest(
                    roles=["workloads:read"],
                    scope=scope,
                    action="workloads.read",
                    resource=resource,
                    actor=mpb.Actor(source="switchyard workloads"),
                ),
                timeout=30,
            )

    try:
        asyncio.run(ask())
    except grpc.aio.AioRpcError as err:
        print(f"workloads: {err.code().name}: {err.details()}", file=sys.stderr)
        return False
    return True


def _route_scope(workload: str) -> str:
    from switchyard.judge.capture_format import workload_route

    return f"model:{workload_route(workload)}"


def _list(args: argparse.Namespace) -> int:
    from switchyard.judge.capture_format import list_workloads

    if not may_read(args, "*", f"workloads/{args.dir}"[:200]):
        return 2

    rows = list_workloads(Path(args.dir))
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    print(f"{'workload':<40} {'requests':>8} {'bytes':>10}  sha256")
    for r in rows:
        print(f"{r['id']:<40} {r['requests']:>8} {r['bytes']:>10}  {r['sha256']}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from switchyard.gen.inference import grpc_service_pb2 as pb
    from switchyard.judge.capture_format import distribution, find_workload, read_records

    if not may_read(args, _route_scope(args.workload), f"workload/{args.workload}"[:200]):
        return 2
    path, entry = find_workload(Path(args.dir), args.workload)
    summary = {
        "workload": entry["id"],
        "sha256": entry["sha256"],
        **distribution(read_records(path, entry["sha256"], pb.ModelInferRequest.FromString)),
    }
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _export(args: argparse.Namespace) -> int:
    from switchyard.judge.capture_format import find_workload, read_records

    if not may_read(args, _route_scope(args.workload), f"workload/{args.workload}"[:200]):
        return 2
    path, entry = find_workload(Path(args.dir), args.workload)
    read_records(path, entry["sha256"], bytes)  # refuses a file that changed since capture
    out = Path(args.output)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f, path.open("rb") as src:
        shutil.copyfileobj(src, f)
    print(f"{entry['id']} -> {out} ({entry['requests']} requests) sha256 {entry['sha256']}")
    return 0
