"""The router's CPU time per request, as deployed, in a same-run A/B (issue 34).

`bench_router.py` measures every hop; this measures the router alone, where its CPU goes, and
what a change to it saves. Processes as `bench_router.py` runs them: an executor and a
metering on mutual TLS, every service at the documented production tracing setting (OTLP to a
local collector, parent-based 1% sampling), and `router` (`switchyard router serve`, frames
over TLS, Bearer auth and usage to metering over mTLS) from this tree; beside it
`router_plaintext`, the same on plaintext hops to a plaintext executor and metering, and, with
`--baseline TREE`, `router_baseline`: the production router run from another source tree (a
`git worktree` of the commit before a change), against the same executor and metering. The
routers alternate in rounds (order rotating) at each concurrency, so the machine's drifting
load hits each alike, and each one's CPU time per request (all threads, schedstat) is the
figure: on a shared host it moves far less than wall-clock latency. `--py-spy SECONDS`
records the production router (or `--py-spy-targets`, in turn) with py-spy (`--py-spy-bin`,
250 Hz, idle samples left out) during extra windows at the highest concurrency, and writes
each one's collapsed stacks beside the JSON (<out>.<router>.pyspy.txt); `--py-spy-native`
adds the C frames (uvloop, gRPC's Cython, libc), which shows the system calls under a line.

py-spy sees only threads that run Python, so each router's CPU per request is also split by
thread (`threads`: the event loop's main thread, the other Python threads, chiefly gRPC's
completion-queue poller, and gRPC's core `event_engine` threads, with each one's voluntary and
involuntary context switches per request from /proc), and `--strace` counts each
router's system calls per request at each concurrency (`syscalls`; strace slows the router, so
that window is apart from the others): a count does not drift with the host's load.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_router_cpu.py [--baseline <tree>] \\
        [--rounds 8] [--requests 400] [--py-spy 15 [--py-spy-native]] [--strace]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import bench_router as br
from benchmarks.bench_outside import OtlpSink, production_tracing
from switchyard import tls
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.net import free_port

ROOT = br.ROOT


async def _spawn(args: list[str], env: dict[str, str], log: Path, tree: Path = ROOT) -> Any:
    with log.open("wb") as sink:
        return await asyncio.create_subprocess_exec(
            sys.executable, *args, env={**env, "PYTHONPATH": str(tree)}, cwd=tree, stdout=sink, stderr=sink
        )


def _body() -> bytes:
    x = np.random.default_rng(0).standard_normal((1, br.SMALL)).astype(np.float32)
    req = pb.ModelInferRequest(model_name="small")
    req.inputs.add(name="x", datatype="FP32", shape=[1, br.SMALL])
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


def _py_spy(binary: str, pid: int, seconds: float, out: Path, native: bool) -> subprocess.Popen[bytes]:
    args = [binary, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250", "-f", "raw"]
    if native:
        args.append("--native")  # the C frames too (uvloop's, gRPC's Cython, ssl)
    return subprocess.Popen([*args, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="router-cpu-"))
    sink = OtlpSink()
    sink.start()
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_SECURITY_", "OTEL_"))}
    base = {**inherited, "SWITCHYARD_TRACES": "none", **production_tracing(sink)}
    plain = {**base, tls.INSECURE_ENV: "true"}
    pki = tls.ensure_local_pki(tmp / "tls", ["executor-cpu", "metering", "router", "operator"])
    mtls = {name: {**base, tls.TLS_DIR_ENV: str(folder)} for name, folder in pki.items()}
    names = [
        "executor",
        "metering",
        "executor_mtls",
        "metering_mtls",
        *br.ROUTERS,
        "router",
        "router_baseline",
    ]
    addr = {name: f"127.0.0.1:{free_port()}" for name in names}
    br._write_route_files(tmp, addr, br.CAPTURE_SHARE)
    br.write_block_means_repository(tmp / "models")
    children = {
        "executor": (br.EXECUTOR, str(tmp / "models"), plain),
        "metering": (br.METERING, f"sqlite:///{tmp / 'ledger.db'}", plain),
        "executor_mtls": (br.EXECUTOR, str(tmp / "models"), mtls["executor-cpu"]),
        "metering_mtls": (br.METERING, f"sqlite:///{tmp / 'ledger-mtls.db'}", mtls["metering"]),
    }
    procs = {
        name: await _spawn(["-c", script, addr[name].rsplit(":", 1)[1], arg], env, tmp / f"{name}.log")
        for name, (script, arg, env) in children.items()
    }
    operator = tls.Security.from_dir(pki["operator"])

    async def router(name: str, routes: str, metering: str, env: dict[str, str], tree: Path = ROOT) -> None:
        procs[name] = await _spawn(
            ["-m", "clients.cli", "router", "serve", "--port", addr[name].rsplit(":", 1)[1],
             "--config", str(tmp / f"routes-{routes}.toml"), "--metering", addr[metering],
             "--spool-dir", str(tmp / f"spool-{name}")],
            env, tmp / f"{name}.log", tree,
        )  # fmt: skip
        await br.wait_serving(addr[name])

    try:
        await br.wait_serving(addr["executor"])
        await br.wait_serving(addr["executor_mtls"], operator)
        await br.wait_serving(addr["metering"])
        await br.wait_serving(addr["metering_mtls"], operator, expect=tls.METERING)
        await br.wait_models_ready(addr["executor"], br.MODELS)
        await br.wait_models_ready(
            addr["executor_mtls"], br.MODELS, security=tls.Security.from_dir(pki["router"])
        )
        key = await br.setup_key(addr["metering"], tls.Security.plaintext())
        key_mtls = await br.setup_key(addr["metering_mtls"], operator)
        await router("router", "mtls", "metering_mtls", mtls["router"])
        await router("router_plaintext", "frames", "metering", plain)
        targets = [
            ("router", addr["router"], [("authorization", f"Bearer {key_mtls}")], None),
            ("router_plaintext", addr["router_plaintext"], [("authorization", f"Bearer {key}")], None),
        ]
        if args.baseline:
            await router("router_baseline", "mtls", "metering_mtls", mtls["router"], Path(args.baseline))
            targets.append(("router_baseline", addr["router_baseline"], targets[0][2], None))
        cells = await _measure(args, targets, {name: procs[name].pid for name, *_ in targets})
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.terminate()
        for proc in procs.values():
            await proc.wait()
        sink.stop()
    return {
        "benchmark": "router_cpu",
        "configuration": {
            "tracing": production_tracing(sink) | {"otlp_spans_received": sink.spans},
            "rounds": args.rounds,
            "requests_per_round": args.requests,
            "baseline": args.baseline or None,
            "host_cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "cells": cells,
    }


async def _measure(args: argparse.Namespace, targets: list[Any], pids: dict[str, int]) -> dict[str, Any]:
    """Every concurrency's cell (the routers alternating in rounds), then the py-spy window."""
    paths = {name: {"router": pid} for name, pid in pids.items()}
    body = _body()
    cells: dict[str, Any] = {}
    for concurrency in args.concurrency:
        n = args.requests * args.rounds * (4 if concurrency > 1 else 1)
        results = await br.measure_cell(targets, body, concurrency, n, args.rounds, "1KB", len(body), paths)
        cells[f"c{concurrency}"] = {r.target: _figures(r) for r in results}
        for r in results:
            print(br._row(r, "1KB", concurrency), flush=True)
    cells["threads"] = await _thread_split(targets, body, max(args.concurrency), args.requests * 4, paths)
    if args.strace:
        cells["syscalls"] = {
            c: await _syscalls(targets, body, c, args.requests * 4, paths) for c in args.concurrency
        }
    for name in args.py_spy_targets if args.py_spy else ():
        target = [t for t in targets if t[0] == name]
        out = Path(args.out).with_suffix(f".{name}.pyspy.txt")
        spy = _py_spy(args.py_spy_bin, pids[name], args.py_spy, out, args.py_spy_native)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.py_spy
        while loop.time() < deadline:
            await br.measure_cell(target, body, max(args.concurrency), 400, 1, "1KB", len(body), paths)
        spy.wait()
    return cells


SWITCHES = ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")


def thread_usage(pid: int) -> dict[str, tuple[int, int, int]]:
    """Each thread of `pid` by its name (threads of one name summed; the main thread, the
    event loop's, as "main"): its CPU time in ns, and its voluntary and involuntary context
    switches (a loop woken more, or a GIL handed round more, shows in the first)."""
    found: dict[str, tuple[int, int, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
            switches = [int(status[key]) for key in SWITCHES]
        except (OSError, ValueError, IndexError, KeyError):  # a thread that just ended
            continue
        before = found.get(name, (0, 0, 0))
        found[name] = (before[0] + ns, before[1] + switches[0], before[2] + switches[1])
    return found


async def _thread_split(
    targets: list[Any], body: bytes, concurrency: int, count: int, paths: dict[str, dict[str, int]]
) -> dict[str, dict[str, Any]]:
    """Each router's CPU and context switches per request by thread (the event loop's, gRPC's poller and
    EventEngine threads, ...), one window of `count` requests each: py-spy sees only threads
    that run Python, and gRPC's core threads run none."""
    split: dict[str, dict[str, Any]] = {}
    for target in targets:
        pid = paths[target[0]]["router"]
        before = thread_usage(pid)
        results = await br.measure_cell([target], body, concurrency, count, 1, "1KB", len(body), paths)
        after = thread_usage(pid)
        n = results[0].requests
        was = {name: before.get(name, (0, 0, 0)) for name in after}
        busy = sorted(
            (name for name in after if after[name][0] > was[name][0]), key=lambda k: was[k][0] - after[k][0]
        )
        split[target[0]] = {
            "cpu_us_per_request": {
                name: round((after[name][0] - was[name][0]) / 1000 / n, 1) for name in busy
            },
            "switches_per_request": {  # voluntary, involuntary
                name: [round((after[name][i] - was[name][i]) / n, 2) for i in (1, 2)] for name in busy
            },
        }
        print(f"threads of {target[0]} at c={concurrency} (us/request; voluntary, involuntary switches): "
              f"{split[target[0]]}", flush=True)  # fmt: skip
    return split


async def _syscalls(
    targets: list[Any], body: bytes, concurrency: int, count: int, paths: dict[str, dict[str, int]]
) -> dict[str, dict[str, float]]:
    """Each router's system calls per request (`strace -c -f` attached for one window of
    `count` requests): a count, so it does not drift with the host's load as CPU time does
    (strace slows the router; the other figures are taken without it)."""
    found: dict[str, dict[str, float]] = {}
    for target in targets:
        pid = paths[target[0]]["router"]
        out = Path(tempfile.mkdtemp(prefix="strace-")) / "summary.txt"
        spy = await asyncio.create_subprocess_exec(
            "strace", "-c", "-f", "-p", str(pid), "-o", str(out), stderr=subprocess.DEVNULL
        )
        await asyncio.sleep(1.0)  # attached to every thread
        results = await br.measure_cell([target], body, concurrency, count, 1, "1KB", len(body), paths)
        spy.send_signal(signal.SIGINT)  # detach and write the summary
        await spy.wait()
        calls: dict[str, float] = {}
        for line in out.read_text().splitlines():
            cols = line.split()
            if len(cols) >= 5 and cols[0][0].isdigit() and cols[-1] != "total":
                calls[cols[-1]] = round(int(cols[3]) / results[0].requests, 2)
        found[target[0]] = {
            "total": round(sum(calls.values()), 1),
            **dict(sorted(calls.items(), key=lambda kv: -kv[1])[:8]),
        }
        print(f"system calls of {target[0]} at c={concurrency} per request: {found[target[0]]}", flush=True)
    return found


def _figures(r: br.Result) -> dict[str, float]:
    return {
        "router_cpu_us_per_request": r.cpu_us_per_request["router"],
        "client_cpu_us_per_request": r.cpu_us_per_request["client"],
        "p50_ms": r.p50_ms,
        "p99_ms": r.p99_ms,
        "throughput_rps": r.throughput_rps,
        "router_own_p50_us": r.router_own_p50_us,
        "requests": r.requests,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--baseline", default="", help="a source tree to run router_baseline from")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--requests", type=int, default=300, help="requests per target per round at c=1 (x4 at c>1)"
    )
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16])
    parser.add_argument(
        "--py-spy", type=float, default=0.0, help="seconds of py-spy on the production router"
    )
    parser.add_argument("--py-spy-bin", default="py-spy")
    parser.add_argument("--strace", action="store_true", help="count each router's system calls per request")
    parser.add_argument("--py-spy-native", action="store_true", help="record native frames too")
    parser.add_argument("--py-spy-targets", nargs="*", default=["router"], help="routers to record, in turn")
    parser.add_argument("--out", default=str(ROOT / "out" / "bench" / "router-cpu.json"))
    args = parser.parse_args()
    report = asyncio.run(run(args))
    for cell, rows in report["cells"].items():
        if cell in ("threads", "syscalls"):
            continue
        for name, f in rows.items():
            ratio = f["router_cpu_us_per_request"] / rows["router"]["router_cpu_us_per_request"]
            cpu = f["router_cpu_us_per_request"]
            print(f"{cell} {name:17s} router CPU {cpu:7.0f} us/request (x{ratio:.3f} of router's)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
