"""`switchyard workloads list|show|export`: captured workloads (services/router/capture.py).

The folder is `--dir` (default `[router] workloads_dir`, var/workloads). Workload files hold
request inputs and may be sensitive: exported copies are written 0600.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    listing.set_defaults(func=_list)
    show.set_defaults(func=_show)
    export.set_defaults(func=_export)


def _list(args: argparse.Namespace) -> int:
    from services.router.capture import list_workloads

    rows = list_workloads(Path(args.dir))
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return 0
    print(f"{'workload':<40} {'requests':>8} {'bytes':>10}  sha256")
    for r in rows:
        print(f"{r['id']:<40} {r['requests']:>8} {r['bytes']:>10}  {r['sha256']}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from services.router.capture import distribution, find_workload, read_requests

    path, entry = find_workload(Path(args.dir), args.workload)
    summary = {
        "workload": entry["id"],
        "sha256": entry["sha256"],
        **distribution(read_requests(path, entry["sha256"])),
    }
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _export(args: argparse.Namespace) -> int:
    from services.router.capture import find_workload, read_requests

    path, entry = find_workload(Path(args.dir), args.workload)
    read_requests(path, entry["sha256"])  # refuses a file that changed since capture
    out = Path(args.output)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f, path.open("rb") as src:
        shutil.copyfileobj(src, f)
    print(f"{entry['id']} -> {out} ({entry['requests']} requests) sha256 {entry['sha256']}")
    return 0
