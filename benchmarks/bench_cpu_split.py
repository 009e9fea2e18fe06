"""CPU per request by component (issue 19): where a request's CPU goes, server thread by thread.

Serves the issue's small model (`small-mlp`) with the hand-written minimal server, the
executor as a user starts it, and the router in front of that executor; loads each with the
same tritonclient sync clients as `bench_executor.py` (1 and 16 clients, own processes). For
each window it reads every server thread's on-CPU and run-queue time from
/proc/<pid>/task/<tid>/schedstat, and the client processes' own CPU, and divides by the
requests answered (warm-up included, since the threads' times are too):

    .venv/bin/python benchmarks/bench_cpu_split.py [--rounds 2] [--seconds 6]
    .venv/bin/python benchmarks/bench_cpu_split.py --tracing --rounds 8   # what tracing costs

`--tracing` measures the cost of the documented production tracing setting instead, at 16
clients: the executor as a user starts it, the same executor again (a control: how far two
identical executors differ), and one at the production setting (OTLP batches to a local
collector, parent-based 1% sampling), in a new seeded order each round; it prints each one's
median server CPU per request and its ratio to the default's, and the median over rounds of
its requests/s over the default's in the same round.

Run-queue time is time a thread was ready to run but waited for a core: on a shared host it
is where the tail goes. Linux only. Writes out/bench/cpu_split.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_outside as o  # noqa: E402
from benchmarks.common import write_report  # noqa: E402

Times = dict[str, tuple[str, float, float]]  # tid -> (thread name, on-CPU s, run-queue s)


def thread_times(pid: int) -> Times:
    out: Times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            sched = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except FileNotFoundError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        label = "main (event loop)" if tid == str(pid) else f"{name} {tid}"
        out[tid] = (label, int(sched[0]) / 1e9, int(sched[1]) / 1e9)
    return out


def load(address: str, data_file: Path, clients: int, seconds: float, warmup: float) -> dict[str, Any]:
    """`bench_outside.py load` processes (4 clients each); their answers, latencies and CPU."""
    procs_n = max(1, (clients + 3) // 4)
    per = [clients // procs_n + (1 if i < clients % procs_n else 0) for i in range(procs_n)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"load{i}.json" for i in range(procs_n)]
        procs = [
            subprocess.Popen(
                o.load_command(address, o.SMALL, "input", data_file, threads, seconds, warmup, out), env=env
            )
            for threads, out in zip(per, outs, strict=True)
        ]
        for p in procs:
            p.wait(timeout=seconds + warmup + 120)
        results = [json.loads(out.read_text()) for out in outs]
    samples = sorted(x for r in results for x in r["latencies"])
    return {
        "answered": sum(r["answered"] for r in results),
        "client_cpu_s": sum(r["cpu_s"] for r in results),
        "requests_per_s": len(samples) / seconds,
        "p50_ms": samples[len(samples) // 2] * 1e3,
        "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3,
    }


def measure(
    name: str, address: str, pids: dict[str, int], data_file: Path, clients: int, args: argparse.Namespace
) -> dict[str, Any]:
    before = {k: thread_times(pid) for k, pid in pids.items()}
    r = load(address, data_file, clients, args.seconds, args.warmup)
    after = {k: thread_times(pid) for k, pid in pids.items()}
    answered = max(1, r["answered"])
    cpu_us: dict[str, float] = {"clients (tritonclient processes)": r["client_cpu_s"] / answered * 1e6}
    queue_s: dict[str, float] = {}
    for server, threads in after.items():
        for tid, (label, cpu, queued) in threads.items():
            if tid not in before[server]:
                continue
            used, waited = cpu - before[server][tid][1], queued - before[server][tid][2]
            if used * 1e6 / answered >= 1 or waited >= 0.01:
                cpu_us[f"{server}: {label}"] = used / answered * 1e6
                queue_s[f"{server}: {label}"] = waited
    servers_us = sum(v for k, v in cpu_us.items() if not k.startswith("clients"))
    return {
        "server": name,
        "clients": clients,
        **{k: r[k] for k in ("requests_per_s", "p50_ms", "p99_ms", "answered")},
        "cpu_us_per_request": {k: round(v) for k, v in cpu_us.items()},
        "server_cpu_us_per_request": round(servers_us),
        "run_queue_wait_s": {k: round(v, 3) for k, v in queue_s.items()},
    }


def tracing_cost(repo: Path, data_file: Path, args: argparse.Namespace) -> None:
    """`--tracing`: see the module docstring."""
    sink = o.OtlpSink()
    sink.start()
    servers = [
        o.executor_server("executor", repo, o.SMALL),
        o.executor_server("executor_control", repo, o.SMALL),
        o.executor_server("executor_production_tracing", repo, o.SMALL, env=o.production_tracing(sink)),
    ]
    rows: list[dict[str, Any]] = []
    try:
        for server in servers:
            server.start()
        for round_ in range(args.rounds):
            order = list(servers)
            random.Random(round_).shuffle(order)
            for server in order:
                assert server.proc is not None
                pids = {server.name: server.proc.pid}
                row = measure(server.name, server.address, pids, data_file, 16, args)
                rows.append(row)
                print(
                    f"{row['server']:28s} c=16 {row['requests_per_s']:6.0f} req/s  server CPU "
                    f"{row['server_cpu_us_per_request']} us/request",
                    flush=True,
                )
    finally:
        for server in servers:
            server.stop()
        sink.stop()
    of = {s.name: [r for r in rows if r["server"] == s.name] for s in servers}  # in round order
    default_cpu = statistics.median(r["server_cpu_us_per_request"] for r in of["executor"])
    summary: dict[str, dict[str, float]] = {}
    for name, runs in of.items():
        cpu = statistics.median(r["server_cpu_us_per_request"] for r in runs)
        rps = statistics.median(r["requests_per_s"] for r in runs)
        paired = o.paired_ratio(runs, of["executor"])
        assert paired is not None  # every round answered (measure raises otherwise)
        summary[name] = {
            "median_server_cpu_us": cpu,
            "cpu_over_default": cpu / default_cpu,
            "median_requests_per_s": rps,
            "rps_over_default_median_of_rounds": paired,
        }
        print(
            f"{name:28s} median {cpu:6.0f} us/request (x{cpu / default_cpu:.3f} the default's), "
            f"{rps:6.0f} req/s (x{paired:.3f} the default's, paired by round)"
        )
    print(f"OTLP spans received: {sink.spans}")
    write_report(
        "cpu_split_tracing",
        {"model": o.SMALL, "clients": 16, "host_cores": os.cpu_count(), "rounds": args.rounds,
         "seconds": args.seconds, "warmup_s": args.warmup, "otlp_spans": sink.spans,
         "summary": summary, "rows": rows},
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tracing", action="store_true", help="the cost of production tracing instead")
    args = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="bench-repo-"))
    from switchyard.models.repository import seed_builtins

    seed_builtins(repo)
    o.build_small(repo)
    input_name, data = o.example_input(repo, o.SMALL)
    data_file = repo / "probe.npy"
    np.save(data_file, data)
    if args.tracing:
        tracing_cost(repo, data_file, args)
        return
    script = str(ROOT / "benchmarks" / "bench_outside.py")
    minimal = o.Server("minimal", [script, "serve-minimal", "--repo", str(repo), "--model", o.SMALL])
    executor = o.executor_server("executor", repo, o.SMALL)
    servers = [minimal, executor]
    rows: list[dict[str, Any]] = []
    try:
        for server in servers:
            server.start()
        routes = repo / "routes.toml"
        routes.write_text(
            "[router]\nrequire_auth = false\n\n"
            f'[deployments.cpu]\naddress = "{executor.address}"\npath = "cpu"\n\n'
            f'[routes.{o.SMALL}]\npolicy = "pinned"\ntargets = ["cpu"]\n'
        )
        router = o.Server(
            "router_to_executor",
            ["-m", "clients.cli", "--log-level", "WARNING", "router", "serve", "--port", "0",
             "--config", str(routes), "--metrics-port", "-1"],
            announce="router serving OIP on ",
        )  # fmt: skip
        router.start()
        servers.append(router)
        for server in servers:  # ready: one answer each
            deadline = time.time() + 90
            while True:
                try:
                    o.probe(server.address, o.SMALL, input_name, data)
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.5)
        pids = {s.name: s.proc.pid for s in servers if s.proc is not None}
        for _ in range(args.rounds):
            for server in servers:
                watched = {server.name: pids[server.name]}
                if server is router:
                    watched["executor"] = pids["executor"]
                for clients in (1, 16):
                    row = measure(server.name, server.address, watched, data_file, clients, args)
                    rows.append(row)
                    print(
                        f"{row['server']:20s} c={clients:2d} {row['requests_per_s']:6.0f} req/s "
                        f"p50 {row['p50_ms']:6.2f} ms p99 {row['p99_ms']:7.2f} ms  server CPU "
                        f"{row['server_cpu_us_per_request']} us/request  {row['cpu_us_per_request']}",
                        flush=True,
                    )
    finally:
        for server in servers:
            server.stop()
    write_report("cpu_split", {"model": o.SMALL, "host_cores": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
