"""The tensor kind's report sections: the inputs, the correctness per output (the reference's own
error against float64, a candidate's error against its allowed error), every scenario with its
sizes, and the latency charts. workflows/report/render.py places them.
"""

from __future__ import annotations

from typing import Any

from workflows.pipeline.kind import Rows
from workflows.report import charts


class TensorRender:
    def inputs(self, inputs: dict[str, Any]) -> str:
        tensors = ", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in inputs["tensors"])
        return tensors or str(inputs["file"])

    def correctness(self, corr: dict[str, Any]) -> list[str]:
        return _correctness_lines(corr)

    def performance(self, perf: dict[str, Any]) -> list[str]:
        lines = []
        for s in perf.get("scenarios", []):
            sizes = ", ".join(f"{k} {v}" for k, v in s["input_sizes"].items())
            lines.append(
                f"- performance: {s['scenario']} batch {s['batch_size']} x{s['concurrency']}: "
                f"p50 {s['p50_ms']:.3f} ms, p90 {s['p90_ms']:.3f}, p95 {s['p95_ms']:.3f}, "
                f"p99 {s['p99_ms']:.3f} ms; "
                f"{s['throughput']:.1f} {s['throughput_unit']} ({s['iterations']} requests in "
                f"{s['seconds']:.2f} s; inputs {sizes}; {s['failed']} failed{_stalls(s)})"
            )
        if perf.get("memory_total_bytes"):
            used = perf["memory_total_bytes"] - perf["memory_min_available_bytes"]
            lines.append(
                f"- performance: device memory: peak in use while measuring {used / 2**20:,.0f} MiB of "
                f"{perf['memory_total_bytes'] / 2**20:,.0f} MiB (device-wide, sampled via Describe)"
            )
        return lines

    def training(self, training: dict[str, Any]) -> list[str]:
        return []

    def cost(self, state: dict[str, Any]) -> list[str]:
        return []

    def appendix(self, rows: Rows) -> list[str]:
        return []

    def charts(self, rows: Rows) -> list[str]:
        return _latency_charts(rows)


TENSOR_RENDER = TensorRender()


def _stalls(s: dict[str, Any]) -> str:
    n = s.get("stalled", 0)
    return f", {n} stalled for up to {s.get('longest_stall_ms', 0.0) / 1e3:.1f} s" if n else ""


def _correctness_lines(corr: dict[str, Any]) -> list[str]:
    out = []
    for o in (corr.get("against_float64") or {}).get("outputs", []):
        m = o["metrics"]
        out.append(
            f"- own error against the float64 run `{o['output']}`: rmse {m['reference_rmse']:.3g}, "
            f"deterministic {m['reference_deterministic']} (repeat max abs diff "
            f"{m['reference_repeat_max_abs']:.3g})"
        )
    for o in corr.get("outputs", []):
        m = o["metrics"]
        out.append(
            f"- correctness `{o['output']}`: {'PASS' if o['passed'] else 'FAIL'}; max abs "
            f"{m['max_abs_error']:.3g}, "
            f"rmse {m['rmse']:.3g} (allowed {m['allowed_rmse']:.3g}), cosine {m['cosine']:.6f}"
        )
        out.append(f"  - tolerance: {o['justification']}")
    return out


def _latency_charts(rows: Rows) -> list[str]:
    """Percentiles per scenario across paths, then each path's single-stream histogram."""
    svgs: list[str] = []
    scenario_keys: list[tuple[str, int]] = []
    for _, s in rows:
        for sc in (s.get("performance") or {}).get("scenarios", []):
            key = (sc["scenario"], sc["batch_size"])
            if key not in scenario_keys:
                scenario_keys.append(key)
    for scenario, batch in scenario_keys:
        series: dict[str, list[float | None]] = {}
        for name, s in rows:
            found = [x for x in (s.get("performance") or {}).get("scenarios", [])
                     if (x["scenario"], x["batch_size"]) == (scenario, batch)]  # fmt: skip
            series[name] = [found[0][k] if found else None for k in ("p50_ms", "p90_ms", "p95_ms", "p99_ms")]
        svgs.append(
            charts.bar_chart(f"Latency, {scenario} batch {batch}", "ms", ["p50", "p90", "p95", "p99"], series)
        )
    for i, (name, s) in enumerate(rows):
        for sc in (s.get("performance") or {}).get("scenarios", []):
            if sc["scenario"] == "single-stream":
                svgs.append(charts.histogram(f"Latency distribution, {name} single-stream batch 1",
                                             sc["histogram_ms"], sc["histogram_counts"], i))  # fmt: skip
    return svgs
