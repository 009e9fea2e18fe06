"""Executor benchmark: in-process model time, batch-1 latency against a minimal grpc.aio OIP
server (the floor for Python gRPC), and throughput at N concurrent clients with dynamic
batching on versus off. Prints ratios against baselines measured in the same run and writes
out/bench/executor.json.

    .venv/bin/python benchmarks/executor.py [--model mlp] [--requests 1000] [--seconds 5]

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

from benchmarks.common import write_report  # noqa: E402
from clients.executor import build_infer_request  # noqa: E402
from switchyard.gen.inference import grpc_service_pb2 as oip  # noqa: E402
from switchyard.gen.inference import grpc_service_pb2_grpc as oip_grpc  # noqa: E402
from switchyard.gen.switchyard.v1 import executor_pb2 as ctl  # noqa: E402
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as ctl_grpc  # noqa: E402


def _threads() -> int:
    return max(1, (os.cpu_count() or 1) - 1)  # the executor's default, so all three compare alike


# ---- the baseline: a minimal OIP server, one model, no batching, compute inline -----------
async def serve_baseline(model_name: str) -> None:
    import torch

    from switchyard import codec
    from switchyard.models.registry import ModelRegistry, load_module

    torch.set_num_threads(_threads())
    spec = ModelRegistry.with_builtins().get(model_name)
    module = load_module(spec)

    class Minimal(oip_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request: oip.ModelInferRequest, context: Any) -> oip.ModelInferResponse:
            tensors = [
                codec.to_torch(codec.decode(i.name, i.datatype, i.shape, raw).array, i.datatype)
                for i, raw in zip(request.inputs, request.raw_input_contents, strict=True)
            ]
            with torch.inference_mode():
                out = module(*tensors)
            datatype, raw = codec.encode_torch(out)
            response = oip.ModelInferResponse(model_name=model_name)
            response.outputs.add(name=spec.outputs[0].name, datatype=datatype, shape=out.shape)
            response.raw_output_contents.append(raw)
            return response

    server = grpc.aio.server()
    oip_grpc.add_GRPCInferenceServiceServicer_to_server(Minimal(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def _spawn(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    # no tracing in either server: the comparison is of serving paths, not of exporters
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SWITCHYARD_TRACES": "none"}
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
        [py, "-m", "switchyard", "--log-level", "WARNING", "executor", "serve", "--port", "0",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--requests", type=int, default=400, help="batch-1 requests per server per round")
    parser.add_argument("--rounds", type=int, default=4, help="alternating latency rounds")
    parser.add_argument("--seconds", type=float, default=5.0)
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
    args = parser.parse_args()
    if args.serve_baseline:
        asyncio.run(serve_baseline(args.model))
        return
    result = asyncio.run(run(args))
    report(result)
    write_report("executor", result)


if __name__ == "__main__":
    main()
