"""Paths side by side: cpu-eager, cpu-compile (inductor) and xla (torch_xla on PJRT CPU).

For `mlp` and `tiny-lm`, each path loads the model through the executor's own load code
(`LoadedModel.load`: checkpoint load, to-device, compile/warm-up of buckets 1 and 8, each timed
after a device sync), then measures steady-state latency of one batch at batch 1 and 8: host
tensors -> device, forward, device sync, outputs -> host (what the executor does per batch,
minus gRPC). It prints p50/p99, each path's ratio to cpu-eager measured in the same run, and
proof that nothing compiled while measuring: the model's compile counter and the backend's
process-wide counters (XLA's UncachedCompile) are read before and after, and any change fails
the run (exit 1).

Paths run one after another, never overlapping (they share the host's cores), each in its own
process; xla runs under the XLA environment's interpreter ($SWITCHYARD_XLA_PYTHON).
Writes out/bench/paths.json. Default run: well under 2 minutes on 2 cores.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_paths.py [--iters 100] [--min-seconds 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PATHS = {"cpu-eager": ("cpu", "eager"), "cpu-compile": ("cpu", "compile"), "xla": ("xla", "lazy")}
BATCHES = (1, 8)
BASELINE = "cpu-eager"


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _infer_once(loaded: Any, tensors: list[Any]) -> None:
    """One batch as the executor runs it: to device, forward, sync, outputs to host."""
    backend, device, dtype = loaded.backend, loaded.backend.device(), loaded.dtype
    moved = [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in tensors]
    with backend.inference_context():
        result = loaded.prepared.run(moved)
    backend.synchronize()
    for r in result if isinstance(result, tuple | list) else [result]:
        r.to("cpu")


def _measure_model(backend: Any, spec: Any, mode: str, iters: int, min_s: float) -> dict[str, Any]:
    import torch

    from services.executor.load_phases import LoadOptions
    from services.executor.loaded_model import LoadedModel

    loaded = LoadedModel(spec, backend, LoadOptions(mode, "fp32", BATCHES, 0, 64, False))
    loaded.load()
    assert loaded.prepared is not None
    model_before, process_before = loaded.prepared.counters(), backend.counters()
    latency: dict[str, Any] = {}
    for batch in BATCHES:
        inputs = spec.example_inputs(batch, torch.Generator().manual_seed(batch))
        for _ in range(5):
            _infer_once(loaded, inputs)
        samples: list[float] = []
        start = time.perf_counter()
        while len(samples) < iters or time.perf_counter() - start < min_s:
            t0 = time.perf_counter()
            _infer_once(loaded, inputs)
            samples.append(time.perf_counter() - t0)
        latency[str(batch)] = {
            "p50_ms": _percentile(samples, 50) * 1e3,
            "p99_ms": _percentile(samples, 99) * 1e3,
            "iterations": len(samples),
            "input_shapes": [list(t.shape) for t in inputs],
            "input_dtypes": [str(t.dtype).replace("torch.", "") for t in inputs],
        }
    model_delta = loaded.prepared.counters().since(model_before)
    process_delta = backend.counters().since(process_before)
    found = loaded.findings.during_load
    return {
        "load_s": loaded.times.checkpoint_load_s,
        "to_device_s": loaded.times.to_device_s,
        "compile_s": loaded.times.compile_s,
        "compilations_during_load": found.compilations,
        "backend_compile_time_s": found.compile_time_s,
        "fallback_ops": dict(found.fallback_ops),
        "adaptations": list(loaded.findings.adaptations),
        "latency": latency,
        "compilations_while_measuring": model_delta.compilations + max(0, process_delta.compilations),
        "recompiles_while_measuring": model_delta.recompiles,
    }


def measure_path(backend_name: str, mode: str, models: list[str], iters: int, min_s: float) -> dict[str, Any]:
    """Runs inside the path's own process (and environment)."""
    from services.executor.device import select_backend
    from switchyard.models.registry import ModelRegistry

    backend = select_backend(backend_name)
    registry = ModelRegistry.with_builtins()
    out: dict[str, Any] = {"versions": backend.versions(), "device": backend.describe_device().device_name}
    for name in models:
        out[name] = _measure_model(backend, registry.get(name), mode, iters, min_s)
    return out


def _run_child(path: str, python: str, models: list[str], iters: int, min_s: float) -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), "--worker", path, "--models", ",".join(models)]
    cmd += ["--iters", str(iters), "--min-seconds", str(min_s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{path} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--models", default="mlp,tiny-lm")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--iters", type=int, default=100, help="minimum timed iterations per batch size")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="minimum timed seconds per batch size")
    parser.add_argument("--out", default=str(ROOT / "out" / "bench" / "paths.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.worker:
        backend, mode = PATHS[args.worker]
        print(json.dumps(measure_path(backend, mode, models, args.iters, args.min_seconds)))
        return 0

    xla_python = os.environ.get("SWITCHYARD_XLA_PYTHON", "")
    paths = [p for p in args.paths.split(",") if p]
    results: dict[str, Any] = {}
    load_before = os.getloadavg()[0]
    for path in paths:
        python = xla_python if PATHS[path][0] == "xla" else sys.executable
        if not python or not Path(python).exists():
            raise SystemExit(f"{path}: SWITCHYARD_XLA_PYTHON is not set or missing; run `make setup-xla`")
        results[path] = _run_child(path, python, models, args.iters, args.min_seconds)
    report = _report(results, models, paths, args)
    # shared cores: other work on the host inflates every path; say how busy it was
    report["config"]["host_load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"host 1-minute load average before/after: {report['config']['host_load_1min']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0 if report["nothing_compiled_while_measuring"] else 1


def _report(results: dict[str, Any], models: list[str], paths: list[str], args: Any) -> dict[str, Any]:
    print(
        f"paths benchmark: fp32, buckets {list(BATCHES)} warmed at load, >= {args.iters} iterations and "
        f">= {args.min_seconds}s per batch size; host cores: {os.cpu_count()}; serial, one process per path"
    )
    ok = True
    for name in models:
        first = results[paths[0]][name]["latency"]
        sizes = ", ".join(
            f"b{b}: {first[str(b)]['input_shapes']} {first[str(b)]['input_dtypes']}" for b in BATCHES
        )
        print(f"\n== {name}  (inputs {sizes})")
        print(
            f"{'path':<12} {'load s':>7} {'to-dev s':>8} {'compile s':>9} {'#comp':>5} "
            + " ".join(f"{'p50 b' + str(b):>9} {'p99 b' + str(b):>9} {'x eager':>7}" for b in BATCHES)
            + "  compiled while measuring"
        )
        for path in paths:
            r = results[path][name]
            cols = []
            for b in BATCHES:
                lat = r["latency"][str(b)]
                base = results.get(BASELINE, {}).get(name, {}).get("latency", {}).get(str(b))
                ratio = lat["p50_ms"] / base["p50_ms"] if base else float("nan")
                lat["ratio_p50_to_cpu_eager"] = ratio
                cols.append(f"{lat['p50_ms']:>8.3f}m {lat['p99_ms']:>8.3f}m {ratio:>6.2f}x")
            clean = r["compilations_while_measuring"] == 0 and r["recompiles_while_measuring"] == 0
            ok = ok and clean
            print(
                f"{path:<12} {r['load_s']:>7.3f} {r['to_device_s']:>8.4f} {r['compile_s']:>9.3f} "
                f"{r['compilations_during_load']:>5} "
                + " ".join(cols)
                + ("  0 (ok)" if clean else "  YES: FAIL")
            )
            if r["fallback_ops"]:
                print(f"{'':<12} fallback ops: {r['fallback_ops']}")
    print("\nratios: p50 of the path / p50 of cpu-eager at the same batch size, same run, same host")
    return {
        "benchmark": "paths",
        "config": {
            "batches": list(BATCHES),
            "iters": args.iters,
            "min_seconds": args.min_seconds,
            "precision": "fp32",
            "cores": os.cpu_count(),
            "baseline": BASELINE,
        },
        "results": results,
        "nothing_compiled_while_measuring": ok,
    }


if __name__ == "__main__":
    sys.exit(main())
