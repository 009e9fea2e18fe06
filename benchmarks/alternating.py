"""The one-client comparison as many short windows that alternate between the servers.

One tritonclient sync client, in its own process, keeps a connection to every server and
measures each in turn for `window` seconds (after `warmup` seconds on that server), in a new
random order every pass (seeded), for `alternations` passes after one unmeasured pass. Drift on the
host (another process's burst, a frequency or placement change) then lands on every server
alike, where one long window per server lets it land on one: in two-round runs of 8 s windows
a server's c=1 median moved by up to 0.4 ms between rounds, more than the 5% being measured.

Each server's figures are over all its windows pooled (p50, p99, requests/s), with the
per-window medians; `ratio_to` gives the median over passes of a server's window median over
the reference server's in the same pass. Used by benchmarks/bench_executor.py; also the
client process's entry point:

    python benchmarks/alternating.py --targets JSON --model M --input-name N --input F.npy \
        --window 1 --alternations 12 --warmup 0.2 --out OUT.json
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


def alternate(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """Per server, the latencies (seconds) of each measured window, in pass order."""
    import tritonclient.grpc as triton

    data = np.load(args.input)
    targets: dict[str, str] = json.loads(args.targets)
    keys: dict[str, str] = json.loads(args.keys)  # server -> the API key it asks for
    datatype = "FP32" if data.dtype == np.float32 else "INT64"
    calls = {}
    for name, address in targets.items():
        inp = triton.InferInput(args.input_name, list(data.shape), datatype)
        inp.set_data_from_numpy(data)
        headers = {"authorization": f"Bearer {keys[name]}"} if name in keys else None
        calls[name] = (triton.InferenceServerClient(address), inp, headers)
    windows: dict[str, list[list[float]]] = {name: [] for name in targets}
    order = random.Random(0)
    try:
        for turn in range(-1, args.alternations):  # turn -1: each server once, not measured
            names = list(targets)
            order.shuffle(names)  # no server keeps a place in the pass, or a neighbour
            for name in names:
                client, inp, headers = calls[name]
                until = time.perf_counter() + args.warmup
                while time.perf_counter() < until:
                    client.infer(args.model, [inp], headers=headers)
                samples = []
                until = time.perf_counter() + args.window
                while (start := time.perf_counter()) < until:
                    client.infer(args.model, [inp], headers=headers)
                    samples.append(time.perf_counter() - start)
                if turn >= 0:
                    windows[name].append(samples)
    finally:
        for client, *_ in calls.values():
            client.close()
    return windows


def run(
    targets: dict[str, str],
    model: str,
    input_name: str,
    data_file: Path,
    window: float,
    alternations: int,
    warmup: float,
    keys: dict[str, str] | None = None,
) -> dict[str, list[list[float]]]:
    """Runs the client process; its windows. `keys`: server -> the API key it asks for."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "alternating.json"
        argv = [
            sys.executable, __file__, "--targets", json.dumps(targets), "--model", model,
            "--input-name", input_name, "--input", str(data_file), "--window", str(window),
            "--alternations", str(alternations), "--warmup", str(warmup), "--out", str(out),
            "--keys", json.dumps(keys or {}),
        ]  # fmt: skip
        subprocess.run(argv, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        windows: dict[str, list[list[float]]] = json.loads(out.read_text())
    return windows


def _median_ms(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2] * 1e3


def summarize(windows: dict[str, list[list[float]]], window: float, reference: str) -> dict[str, Any]:
    """Per server: pooled p50/p99/mean and requests/s, the window medians, and the median
    over passes of its window median over `reference`'s (`p50_ratio_to_<reference>`)."""
    out: dict[str, Any] = {}
    for name, runs in windows.items():
        pooled = sorted(x for run in runs for x in run)
        medians = [_median_ms(run) for run in runs]
        ratios = [m / _median_ms(r) for m, r in zip(medians, windows[reference], strict=True)]
        out[name] = {
            "clients": 1,
            "requests": len(pooled),
            "requests_per_s": len(pooled) / (window * len(runs)),
            "p50_ms": pooled[len(pooled) // 2] * 1e3,
            "p99_ms": pooled[min(len(pooled) - 1, int(len(pooled) * 0.99))] * 1e3,
            "mean_ms": statistics.fmean(pooled) * 1e3,
            "p50_ms_range": [min(medians), max(medians)],
            f"p50_ratio_to_{reference}": statistics.median(ratios),
            f"p50_ratio_to_{reference}_range": [min(ratios), max(ratios)],
            "window_p50_ms": medians,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    for flag in ("--targets", "--model", "--input-name", "--input", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--alternations", type=int, default=12)
    parser.add_argument("--warmup", type=float, default=0.2)
    parser.add_argument("--keys", default="{}", help="JSON: server -> API key")
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(alternate(args)))


if __name__ == "__main__":
    main()
