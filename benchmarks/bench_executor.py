"""Executor benchmark, as an outside client sees it (issue 19), and with in-process clients.

The outside case (default): the issue's 3-layer model (256-1024-1024-16, seed 0, registered
in a model repository as a torch.export program), then `mlp` and `tiny-lm`, each served by a
hand-written grpc.aio OIP server, KServe 0.21 (its own venv, `make setup-kserve`; the small
model only), the switchyard executor as a user starts it (batching on, buckets 1-32), the
executor at the documented production tracing setting (OTLP batches to a local collector,
parent-based 1% sampling), and the router in front of the executor as deployed
(`router_to_executor`: mutual TLS to an executor and a metering of its own, Bearer keys and
usage through metering, production tracing; issue 34), with the plaintext router beside it
(`router_to_executor_plaintext`: plaintext to the default executor, no auth, no metering, no
tracing, the row as it was before); one torch thread everywhere. Load: tritonclient sync
clients in their own processes, closed loop. At 16 clients the servers are loaded one at a
time, in a new seeded order each round (the production-tracing ratio also as the median over
rounds of the two executors' ratio in the same round); at 1 client one client process
alternates between all of them in short windows, many passes
(`benchmarks/alternating.py`), with a second copy of the minimal server as a control; at 16
clients a second default executor is the production-tracing ratio's control. Every
server's output for a fixed probe input must be identical. Ratios against the minimal server
and KServe of the same run and the issue's targets are printed and written to out/bench/executor.json.

    .venv/bin/python benchmarks/bench_executor.py [--cases small-mlp mlp tiny-lm] [--seconds 8] [--rounds 2]
    .venv/bin/python benchmarks/bench_executor.py --async-clients   # the in-process client comparison below

Servers run as subprocesses (the executor via `switchyard executor serve`, the baseline via
this file's `--serve-baseline`), the clients in this process; all share this host's cores, so
absolute figures depend on what else runs. Targets (issue 2): executor p50 within 10% of the
baseline; batching >= 3x the throughput of no batching for mlp at 16 clients. Latency is also
compared on tiny-lm (`--latency-also`), with the overhead in microseconds, so a model's own
compute time cannot hide serving overhead; throughput with batching is also set against the
minimal server, so a slow "batching off" path cannot flatter the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import serve_minimal_oip, write_report  # noqa: E402
from clients.executor_client import build_infer_request  # noqa: E402
from switchyard.gen.inference import grpc_service_pb2 as oip  # noqa: E402
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc  # noqa: E402
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl  # noqa: E402
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc  # noqa: E402
from switchyard.net import free_port  # noqa: E402

# A second copy of the minimal server, measured at one client only: its ratio to the first is
# how far two identical servers differ in one run (the noise floor of the c=1 ratios).
CONTROL = "minimal_control"
# A second default executor, measured at 16 clients only: its ratio to the first is how far two
# identical executors differ in one run (the noise floor of the production-tracing ratio).
EXECUTOR_CONTROL = "executor_control"
BEHIND_ROUTER = frozenset(("executor_mtls", "metering_mtls"))  # not measured: the production router's
PATH = "cpu-bench"  # the routers' path, priced in the production router's metering


def _threads() -> int:
    return max(1, (os.cpu_count() or 1) - 1)  # the executor's default, so all three compare alike


# ---- the baseline: a minimal OIP server, one model, no batching, compute inline -----------
async def serve_baseline(model_name: str) -> None:
    import torch

    from switchyard.models.registry import ModelRegistry

    torch.set_num_threads(_threads())
    await serve_minimal_oip(ModelRegistry.with_builtins().get(model_name))


def _spawn(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    # no tracing in either server: the comparison is of serving paths, not of exporters
    # plaintext by name: this measures the executor, not TLS (benchmarks/bench_router.py measures mTLS)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SWITCHYARD_TRACES": "none",
        "SWITCHYARD_SECURITY_INSECURE": "true",
    }
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "serving on " in line:
            return proc, line.rsplit("serving on ", 1)[1].strip()
    raise RuntimeError(f"{args} exited without serving")


# ---- measurement ----------------------------------------------------------------------------
def _example(model: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if model == "mlp":
        return {"x": rng.standard_normal((1, 64)).astype(np.float32)}
    from switchyard.models import tiny_lm

    high = tiny_lm.VOCAB if model == "tiny-lm" else 2000  # MiniLM: ordinary token ids
    return {"input_ids": rng.integers(high // 2, high, (1, 32)).astype(np.int64)}


async def latency(address: str, request: oip.ModelInferRequest, n: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(min(50, n)):
            await stub.ModelInfer(request)
        samples = []
        for _ in range(n):
            start = time.perf_counter()
            await stub.ModelInfer(request)
            samples.append(time.perf_counter() - start)
    return {**_percentiles(samples), "samples": samples}


def _percentiles(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
        "requests": len(ordered),
    }


async def _client_tasks(
    address: str, model: str, tasks: int, begin: float, end: float
) -> tuple[int, list[int]]:
    """Closed-loop clients: each sends its next request when the last one is answered."""
    request = build_infer_request(model, _example(model))
    done = 0
    batch_sizes: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)

        async def client() -> None:
            nonlocal done
            while (now := time.time()) < end:
                response = await stub.ModelInfer(request)
                if now >= begin:  # before `begin` is warm-up
                    done += 1
                    if "batch_size" in response.parameters:
                        batch_sizes.append(response.parameters["batch_size"].int64_param)

        await asyncio.gather(*(client() for _ in range(tasks)))
    return done, batch_sizes


def _client_process(address: str, model: str, tasks: int, begin: float, end: float, out: Any) -> None:
    out.put(asyncio.run(_client_tasks(address, model, tasks, begin, end)))


def throughput(address: str, model: str, clients: int, seconds: float, processes: int) -> dict[str, float]:
    """`clients` concurrent clients spread over `processes` processes (one Python process
    cannot generate enough load to keep a server busy)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    begin = time.time() + 4.0  # spawn + warm-up
    end = begin + seconds
    procs = [
        ctx.Process(target=_client_process, args=(address, model, clients // processes, begin, end, out))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join()
    done = sum(r[0] for r in results)
    sizes = [b for r in results for b in r[1]]
    return {
        "requests_per_s": done / seconds,
        "requests": done,
        "seconds": seconds,
        "mean_batch_size": statistics.fmean(sizes) if sizes else 1.0,
    }


def in_process(model: str, n: int) -> dict[str, float]:
    import torch

    from switchyard.models.registry import ModelRegistry, load_module

    torch.set_num_threads(_threads())
    module = load_module(ModelRegistry.with_builtins().get(model))
    out: dict[str, float] = {}
    for batch in (1, 16):
        x = [torch.from_numpy(np.repeat(a, batch, axis=0)) for a in _example(model).values()]
        with torch.inference_mode():
            for _ in range(50):
                module(*x)
            samples = []
            for _ in range(n):
                start = time.perf_counter()
                module(*x)
                samples.append(time.perf_counter() - start)
        out[f"batch{batch}_p50_us"] = sorted(samples)[len(samples) // 2] * 1e6
    return out


async def reload(address: str, model: str, batching: bool, buckets: list[int]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await ctl_grpc.ExecutorControlStub(channel).LoadModel(
            ctl.LoadModelRequest(model_name=model, batch_buckets=buckets, dynamic_batching=batching)
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    buckets = [int(b) for b in args.buckets.split(",")]
    py = sys.executable
    models = ",".join(dict.fromkeys([args.model, *args.also, *args.latency_also]))
    executor, ex_addr = _spawn(
        [py, "-m", "clients.cli", "--log-level", "WARNING", "executor", "serve", "--port", "0",
         "--models", models, "--buckets", args.buckets, *args.executor_args.split()]
    )  # fmt: skip
    baselines = {
        m: _spawn([py, __file__, "--serve-baseline", "--model", m]) for m in [args.model, *args.latency_also]
    }
    try:
        result: dict[str, Any] = {
            "model": args.model,
            "input": {
                name: {"shape": list(a.shape), "dtype": str(a.dtype)}
                for name, a in _example(args.model).items()
            },
            "config": {
                "backend": "cpu",
                "mode": "eager",
                "precision": "fp32",
                "torch_threads": _threads(),
                "batch_buckets": buckets,
                "max_queue_delay_us": 0,
                "clients": args.clients,
                "client_processes": args.processes,
                "latency_requests_per_round": args.requests,
                "latency_rounds": args.rounds,
                "throughput_seconds": args.seconds,
                "host_cores": os.cpu_count(),
            },
            "in_process": in_process(args.model, args.requests),
        }
        # Alternate the two servers in rounds so a noisy neighbour hits both alike; the verdict
        # is the median of the per-round p50 ratios, and the pooled samples give p50/p99. The
        # added microseconds (median of per-round p50 differences) are the serving overhead
        # itself, which a model's compute time does not dilute.
        result["latency_batch1"] = {}
        for model, (_, base_addr) in baselines.items():
            request = build_infer_request(model, _example(model))
            rounds: dict[str, list[dict[str, Any]]] = {"baseline": [], "executor": []}
            for _ in range(args.rounds):
                rounds["baseline"].append(await latency(base_addr, request, args.requests))
                rounds["executor"].append(await latency(ex_addr, request, args.requests))
            pairs = list(zip(rounds["baseline"], rounds["executor"], strict=True))
            ratios = [e["p50_us"] / b["p50_us"] for b, e in pairs]
            added = [e["p50_us"] - b["p50_us"] for b, e in pairs]
            pooled = {k: _percentiles([x for r in v for x in r.pop("samples")]) for k, v in rounds.items()}
            result["latency_batch1"][model] = {
                **pooled,
                "input": {n: list(a.shape) for n, a in _example(model).items()},
                "p50_ratio_per_round": ratios,
                "p50_ratio_executor_over_baseline": statistics.median(ratios),
                "p50_added_us": statistics.median(added),
                "p99_ratio_executor_over_baseline": pooled["executor"]["p99_us"]
                / pooled["baseline"]["p99_us"],
            }
        base_addr = baselines[args.model][1]
        tp: dict[str, Any] = {
            "baseline_no_batching": throughput(
                base_addr, args.model, args.clients, args.seconds, args.processes
            )
        }
        await reload(ex_addr, args.model, False, buckets)
        tp["executor_batching_off"] = throughput(
            ex_addr, args.model, args.clients, args.seconds, args.processes
        )
        await reload(ex_addr, args.model, True, buckets)
        tp["executor_batching_on"] = throughput(
            ex_addr, args.model, args.clients, args.seconds, args.processes
        )
        tp["ratio_on_over_off"] = (
            tp["executor_batching_on"]["requests_per_s"] / tp["executor_batching_off"]["requests_per_s"]
        )
        tp["ratio_on_over_minimal_server"] = (
            tp["executor_batching_on"]["requests_per_s"] / tp["baseline_no_batching"]["requests_per_s"]
        )
        result["throughput"] = tp
        # Where compute outweighs gRPC overhead, batching pays more: the same on/off comparison.
        result["throughput_other_models"] = {}
        for other in args.also:
            figures: dict[str, Any] = {
                "input": {
                    n: {"shape": list(a.shape), "dtype": str(a.dtype)} for n, a in _example(other).items()
                }
            }
            for label, batching in (("executor_batching_off", False), ("executor_batching_on", True)):
                await reload(ex_addr, other, batching, buckets)
                figures[label] = throughput(ex_addr, other, args.clients, args.seconds, args.processes)
            figures["ratio_on_over_off"] = (
                figures["executor_batching_on"]["requests_per_s"]
                / figures["executor_batching_off"]["requests_per_s"]
            )
            result["throughput_other_models"][other] = figures
        return result
    finally:
        for proc in (executor, *(p for p, _ in baselines.values())):
            proc.terminate()
            proc.wait(timeout=30)


def report(result: dict[str, Any]) -> None:
    lat, tp, ip = result["latency_batch1"], result["throughput"], result["in_process"]
    print(f"model {result['model']} input {result['input']} config {result['config']}")
    print(
        f"in-process model time: batch 1 p50 {ip['batch1_p50_us']:.0f} us, "
        f"batch 16 p50 {ip['batch16_p50_us']:.0f} us"
    )
    for model, figures in lat.items():
        for name in ("baseline", "executor"):
            r = figures[name]
            print(
                f"{model} {figures['input']} batch-1 latency {name:9s}: p50 {r['p50_us']:.0f} us  "
                f"p99 {r['p99_us']:.0f} us  ({r['requests']} requests)"
            )
        target = " (target <= 1.10)" if model == result["model"] else ""
        print(
            f"{model} executor / minimal server: p50 x{figures['p50_ratio_executor_over_baseline']:.3f} "
            f"(median of rounds {[round(r, 3) for r in figures['p50_ratio_per_round']]}){target}, "
            f"p99 x{figures['p99_ratio_executor_over_baseline']:.3f}; "
            f"serving overhead p50 {figures['p50_added_us']:+.0f} us"
        )
    for name in ("baseline_no_batching", "executor_batching_off", "executor_batching_on"):
        r = tp[name]
        print(
            f"throughput {name:22s}: {r['requests_per_s']:.0f} req/s (mean batch {r['mean_batch_size']:.1f})"
        )
    print(
        f"batching on / off at {result['config']['clients']} clients: "
        f"x{tp['ratio_on_over_off']:.2f} (target >= 3); batching on / minimal server (no batching): "
        f"x{tp['ratio_on_over_minimal_server']:.2f}"
    )
    for other, figures in result["throughput_other_models"].items():
        off, on = figures["executor_batching_off"], figures["executor_batching_on"]
        print(
            f"{other} {figures['input']}: batching off {off['requests_per_s']:.0f} req/s, "
            f"on {on['requests_per_s']:.0f} req/s (mean batch {on['mean_batch_size']:.1f}): "
            f"x{figures['ratio_on_over_off']:.2f}"
        )


def _scratch_repository(o: Any) -> Path:
    """A fresh model repository with the built-ins and bench_outside's small model."""
    import tempfile

    from switchyard.models.repository import seed_builtins

    repo = Path(tempfile.mkdtemp(prefix="bench-repo-"))
    seed_builtins(repo)
    o.build_small(repo)
    return repo


def outside(args: argparse.Namespace) -> dict[str, Any]:
    """The issue-19 comparison; see the module docstring."""
    from benchmarks import bench_outside as o

    repo = _scratch_repository(o)
    sink = o.OtlpSink()
    sink.start()
    production = o.production_tracing(sink)
    kserve = o.kserve_python()
    result: dict[str, Any] = {
        "config": {
            "torch_threads": 1,
            "client": "tritonclient.grpc sync (2.41), closed loop, own processes (4 clients each)",
            "loads": args.loads,
            "seconds_per_window": args.seconds,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "c1": (
                f"one client process, every server in turn for {args.c1_window} s windows after "
                f"{args.c1_warmup} s, {args.c1_alternations} passes (a new seeded random order each) "
                "after one unmeasured pass; figures over the pooled windows"
            ),
            "executor_buckets": args.outside_buckets,
            "production_tracing": production | {"OTEL_EXPORTER_OTLP_ENDPOINT": "a local OTLP collector"},
            "host_cores": os.cpu_count(),
            "kserve": "0.21 (own venv)" if kserve else "not built (make setup-kserve)",
        },
        "cases": {},
    }
    for model in args.cases:
        name, data = o.example_input(repo, model)
        data_file = repo / f"{model}-probe.npy"
        np.save(data_file, data)
        minimal = [__file__.replace("bench_executor.py", "bench_outside.py"), "serve-minimal"]
        minimal += ["--repo", str(repo), "--model", model]
        servers = [
            o.Server("minimal", minimal),
            o.Server(CONTROL, minimal),  # the same server again: how far two copies differ
            o.executor_server("executor", repo, model, args.outside_buckets),
            o.executor_server(EXECUTOR_CONTROL, repo, model, args.outside_buckets),
            o.executor_server("executor_production_tracing", repo, model, args.outside_buckets, production),
        ]
        if kserve and model == o.SMALL:
            pt2 = repo / model / "1" / "model.pt2"
            servers.insert(
                1,
                o.Server(
                    "kserve",
                    [str(ROOT / "benchmarks" / "kserve_server.py"), "--pt2", str(pt2), "--name", model],
                    python=kserve,
                ),
            )
        case: dict[str, Any] = {"input": {name: {"shape": list(data.shape), "dtype": str(data.dtype)}}}
        keys: dict[str, str] = {}  # server -> the API key its clients send
        try:
            for server in servers:
                server.start()
            executor = next(s for s in servers if s.name == "executor")
            keys = _routers(o, repo, model, executor.address, production, servers)
            outputs: dict[str, str] = {}
            for server in (s for s in servers if s.name not in BEHIND_ROUTER):  # ready; the probe's answer
                deadline = time.time() + 90
                while True:
                    try:
                        key = keys.get(server.name, "")
                        outputs[server.name] = o.probe(server.address, model, name, data, key).hex()
                        break
                    except Exception:
                        if time.time() > deadline:
                            raise
                        time.sleep(1)
            case["outputs_identical"] = len(set(outputs.values())) == 1
            case["outputs_differ"] = sorted(k for k, v in outputs.items() if v != outputs["minimal"])
            measured = [s for s in servers if s.name not in BEHIND_ROUTER]
            case["servers"] = _measure(args, measured, model, name, data_file, executor.address, keys)
        finally:
            for server in servers:
                server.stop()
        case["ratios"] = outside_ratios(case["servers"], args.loads)
        result["cases"][model] = case
    sink.stop()
    result["otlp_spans_received"] = sink.spans
    return result


def _routers(
    o: Any, repo: Path, model: str, executor: str, production: dict[str, str], started: list[Any]
) -> dict[str, str]:
    """The router as deployed (`router_to_executor`): mutual TLS to an executor and a metering
    of its own that require it (certificates as `switchyard up` issues them), Bearer keys
    through metering, usage to metering, the production tracing setting on all three; and
    beside it the same router on plaintext to the plaintext `executor`, with no metering and
    no auth (`router_to_executor_plaintext`). Each is appended to `started` as it starts (the
    executor and metering behind the first too, to be stopped with the rest); returns the API
    key the first one's clients send."""
    from benchmarks import bench_router as br
    from switchyard import tls

    tmp = repo / f"{model}-router"
    pki = tls.ensure_local_pki(tmp / "tls", ["executor-cpu", "metering", "router", "operator"])
    executor_mtls = o.executor_server(
        "executor_mtls", repo, model, o.BUCKETS, {**production, tls.TLS_DIR_ENV: str(pki["executor-cpu"])}
    )
    port = free_port()
    metering = o.Server(
        "metering_mtls",
        ["-c", br.METERING, str(port), f"sqlite:///{tmp / 'ledger.db'}"],
        {**production, tls.TLS_DIR_ENV: str(pki["metering"])},
        announce="READY",
    )
    for server in (executor_mtls, metering):
        started.append(server)
        server.start()
    metering.address = f"127.0.0.1:{port}"  # it announces READY, not its address
    key = asyncio.run(_bench_key(metering.address, tls.Security.from_dir(pki["operator"]), model))
    serve = ["-m", "clients.cli", "--log-level", "WARNING", "router", "serve", "--port", "0"]
    for row, address, extra, env in (
        ("router_to_executor", executor_mtls.address,
         ["--metering", metering.address, "--spool-dir", str(tmp / "spool")],
         {**production, tls.TLS_DIR_ENV: str(pki["router"])}),
        ("router_to_executor_plaintext", executor, [], {}),
    ):  # fmt: skip
        routes = tmp / f"{row}.toml"
        routes.write_text(
            ("" if extra else "[router]\nrequire_auth = false\n\n")
            + f'[deployments.cpu]\naddress = "{address}"\npath = "{PATH}"\n\n'
            f'[routes.{model}]\npolicy = "pinned"\ntargets = ["cpu"]\n'
        )
        router = o.Server(
            row, [*serve, "--config", str(routes), "--metrics-port", "-1", *extra], env,
            announce="router serving OIP on ",
        )  # fmt: skip
        started.append(router)
        router.start()
    return {"router_to_executor": key}


async def _bench_key(metering: str, security: Any, model: str) -> str:
    """An API key of principal "bench" with `infer` on `model`, its path priced (as
    bench_router's `setup_key` makes one for its own models)."""
    from switchyard import tls
    from switchyard.gen.switchyard.v1 import metering_pb2 as mpb
    from switchyard.gen.switchyard.v1 import metering_pb2_grpc as mgrpc
    from tests.metering.metering_helpers import price_paths

    async with tls.aio_channel(metering, security=security, expect="metering") as channel:
        stub = mgrpc.MeteringStub(channel)
        await price_paths(stub, "bench-cpu", [PATH], per_hour=1_000_000, resource_class="cpu", since_us=0)
        await stub.CreatePrincipal(mpb.CreatePrincipalRequest(name="bench", kind="service", team="bench"))
        await stub.GrantRole(mpb.RoleRequest(principal="bench", role="infer", scope=f"model:{model}"))
        return str((await stub.CreateKey(mpb.CreateKeyRequest(principal="bench"))).key)


def _measure(
    args: argparse.Namespace,
    servers: list[Any],
    model: str,
    name: str,
    data_file: Path,
    executor: str,
    keys: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """Every server's figures per load: one client as alternating short windows (all servers
    but the executor's control, the minimal server's too), more clients as `args.rounds`
    interleaved rounds of one window each (all but the minimal server's control)."""
    from benchmarks import alternating
    from benchmarks import bench_outside as o

    figures: dict[str, dict[str, Any]] = {s.name: {} for s in servers}
    if 1 in args.loads:
        windows = alternating.run(
            {s.name: s.address for s in servers if s.name != EXECUTOR_CONTROL}, model, name, data_file,
            args.c1_window, args.c1_alternations, args.c1_warmup, keys,
        )  # fmt: skip
        for server, summary in alternating.summarize(windows, args.c1_window, "minimal").items():
            figures[server]["c1"] = summary
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    # the mean batch from the executor's own statistics (the plaintext router's: the executor
    # behind it; the mTLS executor answers only certificates, so the production row has none)
    stats_of = {s.name: s.address for s in servers if s.name.startswith("executor")}
    stats_of["router_to_executor_plaintext"] = executor
    loaded = [s for s in servers if s.name != CONTROL]
    for round_ in range(args.rounds):
        # a new seeded order each round: in a fixed one a server always followed the same
        # neighbour into the same slot (c16 windows here differ by up to 20% back to back)
        for server in random.Random(round_).sample(loaded, len(loaded)):
            for clients in (c for c in args.loads if c != 1):
                r = o.run_load(
                    server.address, model, name, data_file, clients, args.seconds, args.warmup,
                    key=keys.get(server.name, ""), stats_address=stats_of.get(server.name, ""),
                )  # fmt: skip
                rounds.setdefault((server.name, clients), []).append(r)
    for (server, clients), runs in rounds.items():
        figures[server][f"c{clients}"] = o.summarize(runs)
    return figures


def _paired(servers: dict[str, Any], a: str, b: str, load: str) -> float | None:
    """The median over rounds of a's requests/s over b's in the same round."""
    from benchmarks import bench_outside as o

    a_runs, b_runs = (servers.get(name, {}).get(load, {}).get("rounds", []) for name in (a, b))
    return o.paired_ratio(a_runs, b_runs)


def outside_ratios(servers: dict[str, Any], loads: list[int]) -> dict[str, Any]:
    lo, hi = f"c{min(loads)}", f"c{max(loads)}"

    def get(server: str, load: str, key: str) -> float | None:
        value = servers.get(server, {}).get(load, {}).get(key)
        return float(value) if value is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    ex, mn, ks, rt = "executor", "minimal", "kserve", "router_to_executor"
    rp = "router_to_executor_plaintext"
    out: dict[str, Any] = {
        "executor_c1_p50_over_minimal": ratio(get(ex, lo, "p50_ms"), get(mn, lo, "p50_ms")),
        "executor_c1_p50_over_minimal_median_of_passes": get(ex, lo, "p50_ratio_to_minimal"),
        "executor_c1_p50_over_control": ratio(get(ex, lo, "p50_ms"), get(CONTROL, lo, "p50_ms")),
        "control_c1_p50_over_minimal": ratio(get(CONTROL, lo, "p50_ms"), get(mn, lo, "p50_ms")),
        "control_c1_p50_over_minimal_median_of_passes": get(CONTROL, lo, "p50_ratio_to_minimal"),
        "executor_c16_rps_over_minimal": ratio(get(ex, hi, "requests_per_s"), get(mn, hi, "requests_per_s")),
        "executor_c16_rps_over_kserve": ratio(get(ex, hi, "requests_per_s"), get(ks, hi, "requests_per_s")),
        "executor_c16_p99_over_minimal": ratio(get(ex, hi, "p99_ms"), get(mn, hi, "p99_ms")),
        "router_c1_p50_added_ms_over_minimal": (
            get(rt, lo, "p50_ms") - get(mn, lo, "p50_ms")  # type: ignore[operator]
            if get(rt, lo, "p50_ms") is not None and get(mn, lo, "p50_ms") is not None
            else None
        ),
        "router_c16_rps_over_executor": ratio(get(rt, hi, "requests_per_s"), get(ex, hi, "requests_per_s")),
        "router_plaintext_c1_p50_added_ms_over_minimal": (
            get(rp, lo, "p50_ms") - get(mn, lo, "p50_ms")  # type: ignore[operator]
            if get(rp, lo, "p50_ms") is not None and get(mn, lo, "p50_ms") is not None
            else None
        ),
        "router_plaintext_c16_rps_over_executor": ratio(
            get(rp, hi, "requests_per_s"), get(ex, hi, "requests_per_s")
        ),
        "production_tracing_c16_rps_over_default": ratio(
            get("executor_production_tracing", hi, "requests_per_s"), get(ex, hi, "requests_per_s")
        ),
        "production_tracing_c16_rps_over_default_median_of_rounds": _paired(
            servers, "executor_production_tracing", ex, hi
        ),
        "executor_control_c16_rps_over_default": ratio(
            get(EXECUTOR_CONTROL, hi, "requests_per_s"), get(ex, hi, "requests_per_s")
        ),
        "executor_control_c16_rps_over_default_median_of_rounds": _paired(servers, EXECUTOR_CONTROL, ex, hi),
    }
    targets = {
        "executor_c1_p50_over_minimal": ("<=", 1.05),
        "executor_c16_rps_over_minimal": (">=", 1.2),
        "executor_c16_rps_over_kserve": (">=", 1.3),
        "executor_c16_p99_over_minimal": ("<=", 1.2),
        "router_c1_p50_added_ms_over_minimal": ("<=", 0.35),
        "router_c16_rps_over_executor": (">=", 0.8),
        "production_tracing_c16_rps_over_default": (">=", 0.97),
    }
    out["targets"] = {
        k: {
            "target": f"{op} {bound}",
            "met": (None if out[k] is None else (out[k] <= bound if op == "<=" else out[k] >= bound)),
        }
        for k, (op, bound) in targets.items()
    }
    return out


def report_outside(result: dict[str, Any]) -> None:
    print(f"config {result['config']}")
    for model, case in result["cases"].items():
        print(
            f"\n{model} {case['input']}: outputs identical for the probe: {case['outputs_identical']}"
            f"{' (differ: ' + str(case['outputs_differ']) + ')' if case['outputs_differ'] else ''}"
        )
        print(
            f"  {'server':30s} {'c1 p50 ms':>10s} {'c1 req/s':>9s} {'c16 req/s':>10s} "
            f"{'c16 p99 ms':>11s} {'batch':>6s}"
        )
        for name, loads in case["servers"].items():
            lo, hi = loads.get("c1", {}), loads.get("c16", {})
            batch = hi.get("mean_batch_size")
            print(
                f"  {name:30s} {lo.get('p50_ms', float('nan')):10.2f} "
                f"{lo.get('requests_per_s', float('nan')):9.0f} "
                f"{hi.get('requests_per_s', float('nan')):10.0f} {hi.get('p99_ms', float('nan')):11.2f} "
                f"{batch if batch is None else round(batch, 2)!s:>6s}"
            )
        for key, value in case["ratios"].items():
            if key == "targets":
                continue
            target = case["ratios"]["targets"].get(key, {})
            shown = "n/a" if value is None else f"{value:.3f}"
            print(f"  {key:48s} {shown:>8s}  target {target.get('target')}: met={target.get('met')}")
    print(f"OTLP spans received from the production-tracing executor: {result['otlp_spans_received']}")


def main() -> None:
    from benchmarks import bench_outside as o

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--requests", type=int, default=400, help="batch-1 requests per server per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per measured window")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--buckets", default="1,2,4,8,16")
    parser.add_argument("--also", nargs="*", default=["minilm-l6"], help="models for on/off throughput only")
    parser.add_argument(
        "--latency-also",
        nargs="*",
        default=["tiny-lm"],
        help="models for the latency comparison only (a lighter model shows the overhead undiluted)",
    )
    parser.add_argument("--executor-args", default="", help="extra `executor serve` arguments")
    parser.add_argument("--processes", type=int, default=4, help="client processes sharing the clients")
    parser.add_argument("--serve-baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--cases", nargs="*", default=["small-mlp", "mlp", "tiny-lm"], help="outside-client cases"
    )
    parser.add_argument("--loads", nargs="*", type=int, default=[1, 16], help="concurrent outside clients")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up before each window")
    parser.add_argument("--outside-buckets", default=o.BUCKETS)
    parser.add_argument("--c1-window", type=float, default=1.0, help="seconds per one-client window")
    parser.add_argument("--c1-warmup", type=float, default=0.2, help="seconds before each one-client window")
    parser.add_argument(
        "--c1-alternations", type=int, default=12, help="passes over all servers at one client"
    )
    parser.add_argument(
        "--async-clients", action="store_true", help="run the in-process client comparison too"
    )
    args = parser.parse_args()
    if args.serve_baseline:
        asyncio.run(serve_baseline(args.model))
        return
    result: dict[str, Any] = {"outside": outside(args)}
    report_outside(result["outside"])
    if args.async_clients:
        result["async_clients"] = asyncio.run(run(args))
        report(result["async_clients"])
    write_report("executor", result)
    differ = {
        m: c["outputs_differ"] for m, c in result["outside"]["cases"].items() if not c["outputs_identical"]
    }
    if differ:  # the comparison is void if the servers did not compute the same thing
        raise SystemExit(f"probe outputs differ from the minimal server's: {differ}")


if __name__ == "__main__":
    main()
