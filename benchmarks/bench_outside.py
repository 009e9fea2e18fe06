"""The executor as an outside client sees it: tritonclient sync clients in their own
processes, closed loop, against a hand-written grpc.aio OIP server, KServe (its own venv, when
built), the switchyard executor as started by default, the executor at the documented
production tracing setting, and the router in front of the executor. Used by
benchmarks/bench_executor.py (the issue-19 case); also the entry point of the server and client
processes it starts:

    python benchmarks/bench_outside.py serve-minimal --repo R --model M
    python benchmarks/bench_outside.py load --address A --model M --threads T --seconds S ...

Every server loads the same model from the same model repository, with one torch thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMALL = "small-mlp"  # the model: 256 -> 1024 -> 1024 -> 16 with GELUs, seed 0


def build_small(repo: Path) -> None:
    """Registers the issue's 3-layer model in `repo` as a torch.export program (seed 0,
    dynamic batch), through the repository's own `add_model`."""
    import torch
    from torch import nn

    from clients.model_admin import add_model

    if (repo / SMALL / "model.toml").is_file():
        return
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 16)
    )
    module.eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    example = (torch.zeros(2, 256),)
    program = torch.export.export(module, example, dynamic_shapes=({0: batch},))
    with tempfile.TemporaryDirectory() as tmp:
        torch.export.save(program, str(Path(tmp) / "model.pt2"))
        add_model(repo, SMALL, Path(tmp), description="issue 19's 3-layer model (seed 0)")


def example_input(repo: Path, model: str) -> tuple[str, np.ndarray]:
    """The fixed probe/load input: (input name, array of one row)."""
    from switchyard.models.registry import ModelRegistry

    spec = ModelRegistry(repo).get(model)
    first = spec.inputs[0]
    rng = np.random.default_rng(0)
    if first.datatype == "INT64":
        dims = [d if d > 0 else 32 for d in first.dims]
        return first.name, rng.integers(100, 400, (1, *dims)).astype(np.int64)
    dims = [d if d > 0 else 1 for d in first.dims]
    return first.name, rng.standard_normal((1, *dims)).astype(np.float32)


# ---- the hand-written server -----------------------------------------------------------------
async def serve_minimal(repo: Path, model: str, allowed_factories: tuple[str, ...] = ()) -> None:
    """A minimal grpc.aio OIP server: decode, run the module inline, encode. No batching."""
    import torch

    from benchmarks.common import serve_minimal_oip
    from switchyard.models.registry import ModelRegistry

    torch.set_num_threads(1)
    await serve_minimal_oip(ModelRegistry(repo, allowed_factories=allowed_factories).get(model))


# ---- the load: tritonclient sync clients, closed loop --------------------------------------
def load_command(
    address: str,
    model: str,
    input_name: str,
    data_file: Path,
    threads: int,
    seconds: float,
    warmup: float,
    out: Path,
    key: str = "",
) -> list[str]:
    """The argv of one load process (`bench_outside.py load`), writing its figures to `out`."""
    return [
        sys.executable, __file__, "load", "--address", address, "--model", model,
        "--input-name", input_name, "--input", str(data_file), "--threads", str(threads),
        "--seconds", str(seconds), "--warmup", str(warmup), "--out", str(out), "--key", key,
    ]  # fmt: skip


def load(args: argparse.Namespace) -> None:
    import tritonclient.grpc as triton

    data = np.load(args.input)
    begin = time.time() + args.warmup
    end = begin + args.seconds
    latencies: list[list[float]] = [[] for _ in range(args.threads)]
    batches: list[list[int]] = [[] for _ in range(args.threads)]
    errors: list[str] = []
    answered = [0] * args.threads  # warm-up included: what the servers' CPU times cover
    headers = {"authorization": f"Bearer {args.key}"} if args.key else None

    def client(i: int) -> None:
        c = triton.InferenceServerClient(args.address)
        inp = triton.InferInput(
            args.input_name, list(data.shape), "FP32" if data.dtype == np.float32 else "INT64"
        )
        inp.set_data_from_numpy(data)
        try:
            while (now := time.time()) < end:
                start = time.perf_counter()
                result = c.infer(args.model, [inp], headers=headers)
                took = time.perf_counter() - start
                answered[i] += 1
                if now >= begin:
                    latencies[i].append(took)
                    params = result.get_response().parameters
                    if "batch_size" in params:
                        batches[i].append(params["batch_size"].int64_param)
        except Exception as exc:  # reported, not hidden: the run is then invalid
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.threads)]
    cpu = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {
        "answered": sum(answered),
        "cpu_s": time.process_time() - cpu,  # this client process's CPU while it sent them
        "latencies": [x for chunk in latencies for x in chunk],
        "batch_sizes": [x for chunk in batches for x in chunk],
        "errors": errors[:5],
    }
    Path(args.out).write_text(json.dumps(out))


def run_load(
    address: str,
    model: str,
    input_name: str,
    data_file: Path,
    clients: int,
    seconds: float,
    warmup: float,
    key: str = "",
    stats_address: str = "",
) -> dict[str, Any]:
    """`clients` closed-loop sync clients over ceil(clients/4) processes; the pooled figures.
    `stats_address`: the executor whose ModelStatistics (batch_stats) give the mean batch over
    warm-up and window, since the clients do not ask for response parameters, as users'
    clients do not."""
    before = model_statistics(stats_address, model) if stats_address else None
    procs_n = max(1, (clients + 3) // 4)
    per = [clients // procs_n + (1 if i < clients % procs_n else 0) for i in range(procs_n)]
    outs = []
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, threads in enumerate(per):
            out = Path(tmp) / f"load{i}.json"
            outs.append(out)
            args = load_command(address, model, input_name, data_file, threads, seconds, warmup, out, key)
            procs.append(subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(ROOT)}))
        for p in procs:
            p.wait(timeout=seconds + warmup + 120)
        results = [json.loads(o.read_text()) for o in outs]
    samples = sorted(x for r in results for x in r["latencies"])
    sizes = [b for r in results for b in r["batch_sizes"]]
    mean_batch = statistics.fmean(sizes) if sizes else None
    per_execution = None
    if before is not None:
        after = model_statistics(stats_address, model)
        runs = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
        rows = sum(size * n for size, n in runs.items())
        if rows:  # the batch a request ran in, on average, as the response parameter said it
            mean_batch = sum(size * size * n for size, n in runs.items()) / rows
            per_execution = rows / sum(runs.values())
    errors = [e for r in results for e in r["errors"]]
    if not samples:
        return {"errors": errors or ["no request answered"]}
    return {
        "clients": clients,
        "requests": len(samples),
        "requests_per_s": len(samples) / seconds,
        "p50_ms": samples[len(samples) // 2] * 1e3,
        "p99_ms": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3,
        "mean_ms": statistics.fmean(samples) * 1e3,
        "mean_batch_size": mean_batch,
        "mean_rows_per_execution": per_execution,
        "errors": errors,
    }


# ---- an OTLP sink for the production-tracing row -------------------------------------------------
@dataclass
class OtlpSink:
    """A local OTLP/gRPC trace collector that accepts and counts spans (the executor's exporter
    then does all its real work: batching, encoding, sending)."""

    spans: int = 0
    port: int = 0
    _server: Any = None

    def start(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc

        sink = self

        class Service(ts_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return ts.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        ts_grpc.add_TraceServiceServicer_to_server(Service(), self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)


def paired_ratio(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> float | None:
    """The median over rounds of a's requests/s over b's in the same round (rounds in order;
    a round either lacks is left out)."""
    pairs = [x["requests_per_s"] / y["requests_per_s"] for x, y in zip(a, b, strict=False)
             if "requests_per_s" in x and y.get("requests_per_s")]  # fmt: skip
    return statistics.median(pairs) if pairs else None


def production_tracing(sink: OtlpSink) -> dict[str, str]:
    """The documented production tracing setting (docs/observability.md), exporting to `sink`."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    }


# ---- servers -------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    announce: str = "serving on "
    python: str = sys.executable
    proc: subprocess.Popen[str] | None = None
    address: str = ""

    def start(self) -> None:
        # one host, plaintext: the comparison is of serving paths (the baselines have no TLS)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SWITCHYARD_SECURITY_INSECURE": "true", **self.env}
        for key in [k for k in env if k.startswith("OTEL_") and k not in self.env]:
            del env[key]
        self.proc = subprocess.Popen(
            [self.python, *self.args], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.announce in line:
                self.address = line.rsplit(" ", 1)[-1].strip()
                threading.Thread(target=self._drain, daemon=True).start()
                return
        raise RuntimeError(f"{self.name} exited ({self.proc.poll()}) before serving")

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for _ in self.proc.stdout:
            pass

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


BUCKETS = "1,2,4,8,16,32"  # the executor's batch sizes in the outside benchmarks


def executor_server(
    name: str, repo: Path, model: str, buckets: str = BUCKETS, env: dict[str, str] | None = None
) -> Server:
    # frames on (the default, --frames-port 0): a router on this host reaches it over them
    args = [
        "-m",
        "clients.cli",
        "--log-level",
        "WARNING",
        "executor",
        "serve",
        "--port",
        "0",
        "--models",
        model,
        "--model-repository",
        str(repo),
        "--buckets",
        buckets,
        "--threads",
        "1",
        "--metrics-port",
        "-1",
    ]
    return Server(name, args, env or {})


def kserve_python() -> str | None:
    """The KServe venv's interpreter when `make setup-kserve` built it, or
    SWITCHYARD_KSERVE_PYTHON: an env built from the same pins under another hash (the env's
    folder is named by requirements/kserve.txt's hash, which a comment edit changes too)."""
    given = os.environ.get("SWITCHYARD_KSERVE_PYTHON", "")
    if given:
        return given if Path(given).exists() else None
    found = subprocess.run(["make", "-s", "-C", str(ROOT), "kserve-python"], capture_output=True, text=True)
    path = found.stdout.strip()
    return path if path and Path(path).exists() and (Path(path).parent.parent / ".ready").exists() else None


def probe(address: str, model: str, name: str, data: np.ndarray, key: str = "") -> bytes:
    import tritonclient.grpc as triton

    c = triton.InferenceServerClient(address)
    try:
        inp = triton.InferInput(name, list(data.shape), "FP32" if data.dtype == np.float32 else "INT64")
        inp.set_data_from_numpy(data)
        result = c.infer(model, [inp], headers={"authorization": f"Bearer {key}"} if key else None)
        out = result.get_response().outputs[0].name
        array = result.as_numpy(out)
        assert array is not None
        return bytes(array.tobytes())
    finally:
        c.close()


def model_statistics(address: str, model: str) -> dict[int, int]:
    """Executions of `model` by batch size, from Triton's statistics extension (batch_stats)."""
    import tritonclient.grpc as triton

    c = triton.InferenceServerClient(address)
    try:
        stats = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
        return {
            int(b["batch_size"]): int(b["compute_infer"].get("count", 0))
            for b in stats.get("batch_stats", [])
        }
    finally:
        c.close()


def summarize(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rounds if "requests_per_s" in r]
    if not ok:
        return {"errors": [e for r in rounds for e in r.get("errors", [])]}
    keys = ("p50_ms", "p99_ms", "requests_per_s")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in ok) for k in keys}
    out.update({f"{k}_range": [min(r[k] for r in ok), max(r[k] for r in ok)] for k in keys})
    sizes = [r["mean_batch_size"] for r in ok if r.get("mean_batch_size")]
    out["mean_batch_size"] = statistics.fmean(sizes) if sizes else None
    per_execution = [r["mean_rows_per_execution"] for r in ok if r.get("mean_rows_per_execution")]
    out["mean_rows_per_execution"] = statistics.fmean(per_execution) if per_execution else None
    out["rounds"] = rounds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    minimal = sub.add_parser("serve-minimal")
    minimal.add_argument("--repo", required=True)
    minimal.add_argument("--model", required=True)
    minimal.add_argument("--allow-factory", action="append", default=[], help="a factory model's package")
    client = sub.add_parser("load")
    for flag in ("--address", "--model", "--input-name", "--input", "--out"):
        client.add_argument(flag, required=True)
    client.add_argument("--threads", type=int, default=1)
    client.add_argument("--seconds", type=float, default=5)
    client.add_argument("--warmup", type=float, default=2)
    client.add_argument("--key", default="")
    args = parser.parse_args()
    if args.command == "serve-minimal":
        asyncio.run(serve_minimal(Path(args.repo), args.model, tuple(args.allow_factory)))
    else:
        load(args)


if __name__ == "__main__":
    main()
