"""Triton's own perf_analyzer (tritonclient[all]==2.41.0) against an executor and the router:
it runs, and prints its server-side section from our ModelStatistics.

The executor and the router run as their own processes, started by their CLI commands with
a metrics port each (whose /metrics must parse too). perf_analyzer lives in its own
environment (`make setup-perf`: it pins numpy<2), built here when missing; it links
libcudart.so.12 (from the nvidia-cuda-runtime-cu12 wheel, on LD_LIBRARY_PATH) and Debian's
libb64-0d, and uses no GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    make = ["make", "-s", "-C", str(ROOT)]
    built = subprocess.run([*make, "setup-perf"], capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    path = subprocess.run([*make, "perf-analyzer-path"], capture_output=True, text=True, timeout=60)
    binary = Path(path.stdout.strip())
    assert binary.exists(), path.stdout + path.stderr
    return binary


def _spawn(args: list[str], announce: str) -> tuple[subprocess.Popen[str], str, str]:
    """A service CLI process; returns it, its address and its metrics URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "clients.cli", "--log-level", "WARNING", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    metrics = address = ""
    for line in proc.stdout:
        if line.startswith("metrics on "):
            metrics = line.split()[-1]
        if announce in line:
            address = line.rsplit(" ", 1)[-1].strip()
            break
    assert address and metrics, f"{args[0]} exited ({proc.poll()}) without announcing itself"
    return proc, address, metrics


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("perf")
    procs = []
    try:
        executor, ex_addr, ex_metrics = _spawn(
            ["executor", "serve", "--port", "0", "--frames-port", "-1", "--models", "mlp",
             "--model-repository", str(tmp / "models"), "--metrics-port", "0", "--threads", "1"],
            "serving on",
        )  # fmt: skip
        procs.append(executor)
        routes = tmp / "routes.toml"
        routes.write_text(
            "[router]\nrequire_auth = false\n\n"
            f'[deployments.cpu]\naddress = "{ex_addr}"\npath = "cpu-perf"\n\n'
            '[routes.mlp]\npolicy = "pinned"\ntargets = ["cpu"]\n'
        )
        router, rt_addr, rt_metrics = _spawn(
            ["router", "serve", "--port", "0", "--config", str(routes), "--metrics-port", "0",
             "--spool-dir", str(tmp / "spool")],
            "router serving OIP on",
        )  # fmt: skip
        procs.append(router)
        yield {
            "executor": ex_addr,
            "router": rt_addr,
            "executor_metrics": ex_metrics,
            "router_metrics": rt_metrics,
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def _run(binary: Path, address: str) -> str:
    libs = binary.parent.parent / "lib" / "python3.11" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    proc = subprocess.run(
        # count windows with a loose stability bound: a shared, noisy host must not make it
        # fail to settle; what is checked is the server-side section, not the speed
        [str(binary), "-m", "mlp", "-i", "grpc", "-u", address, "--concurrency-range", "2",
         "--measurement-mode", "count_windows", "--measurement-request-count", "60",
         "--stability-percentage", "1000", "--max-trials", "10"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _server_section(output: str) -> dict[str, float]:
    section = output.split("  Server: ", 1)[1]
    numbers = {}
    for key in ("Inference count", "Execution count", "Successful request count"):
        numbers[key] = float(re.search(rf"{key}: (\d+)", section).group(1))  # type: ignore[union-attr]
    latency = re.search(r"Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec", section)
    compute = re.search(
        r"compute input (\d+) usec \+ compute infer (\d+) usec \+ compute output (\d+) usec", section
    )
    assert latency and compute, section
    numbers["request_us"], numbers["infer_us"] = float(latency.group(1)), float(compute.group(2))
    return numbers


@pytest.mark.parametrize("target", ["executor", "router"])
def test_perf_analyzer_prints_server_side_statistics(
    perf_analyzer: Path, services: dict[str, str], target: str
) -> None:
    output = _run(perf_analyzer, services[target])
    print(output)  # the report, for the log
    assert "Client: " in output and "Server: " in output, output
    server = _server_section(output)
    assert server["Successful request count"] > 0 and server["Inference count"] > 0
    assert server["Execution count"] <= server["Inference count"]
    assert 0 < server["infer_us"] <= server["request_us"]


def test_service_processes_serve_metrics_that_parse(services: dict[str, str]) -> None:
    for name in ("executor_metrics", "router_metrics"):
        text = urllib.request.urlopen(services[name], timeout=10).read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert "process_cpu_seconds" in names, name
        wanted = (
            "nv_inference_request_success" if name == "executor_metrics" else "switchyard_router_requests"
        )
        assert wanted in names, (name, sorted(names))
