"""Generation serving metrics, named and defined as vLLM's `bench serve` defines them.

From one record per request (when it was sent, when each streamed chunk arrived, its prompt
and output token counts): TTFT, TPOT, ITL and E2E latency with mean, p50, p90 and p99;
request, output-token and total-token throughput over the benchmark's duration; and goodput,
the requests per second that met every SLO of the policy. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The report prints these beside the figures (vLLM benchmarks/serve.py, benchmark_serving).
DEFINITIONS = {
    "ttft_ms": "time to first token: from sending the request to receiving its first streamed token",
    "tpot_ms": "time per output token, excluding the first: (e2e - ttft) / (output_tokens - 1), "
    "per request with more than one output token",
    "itl_ms": "inter-token latency: every gap between consecutive streamed chunks of a request, "
    "pooled over all requests",
    "e2el_ms": "end-to-end latency: from sending the request to receiving its last response",
    "request_throughput": "completed requests / benchmark duration (req/s)",
    "output_throughput": "output tokens of completed requests / benchmark duration (tok/s)",
    "total_token_throughput": "(prompt + output tokens) of completed requests / benchmark duration (tok/s)",
    "request_goodput": "completed requests meeting every SLO of the policy (their own TTFT, TPOT "
    "and E2E at most the SLO) / benchmark duration (req/s)",
    "duration_s": "from the first request sent to the last response received",
}
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request of a generation run; times in seconds from the run's start."""

    prompt_tokens: int
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival of each response carrying tokens
    output_tokens: int = 0
    ok: bool = True
    compute_us: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.chunk_s[-1] - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives for goodput; 0 = not set."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2el_ms: float = 0.0

    def met(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return (
            (not self.ttft_ms or r.ttft_s * 1e3 <= self.ttft_ms)
            and (not self.tpot_ms or tpot is None or tpot * 1e3 <= self.tpot_ms)
            and (not self.e2el_ms or r.e2e_s * 1e3 <= self.e2el_ms)
        )

    def as_dict(self) -> dict[str, float]:
        return {
            k: v
            for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2el_ms", self.e2el_ms))
            if v
        }


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 in milliseconds (numpy's linear percentiles, as vLLM's); None if empty."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s) * 1e3
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def _lengths(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "min": 0, "max": 0, "total": 0}
    return {"mean": float(np.mean(values)), "min": min(values), "max": max(values), "total": sum(values)}


def summarize(
    records: list[RequestRecord], duration_s: float, load: dict[str, Any], slo: Slo
) -> dict[str, Any]:
    """Every metric of one load level, with the lengths and the load beside it."""
    done = [r for r in records if r.ok and r.chunk_s]
    duration = max(duration_s, 1e-9)
    prompt = [r.prompt_tokens for r in done]
    output = [r.output_tokens for r in done]
    good = [r for r in done if slo.met(r)]
    return {
        "load": dict(load),
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "input_tokens": _lengths(prompt),
        "output_tokens": _lengths(output),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(output) / duration,
        "total_token_throughput": (sum(prompt) + sum(output)) / duration,
        "ttft_ms": stats_ms([r.ttft_s for r in done]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": stats_ms([r.e2e_s for r in done]),
        "goodput": {
            "slo": slo.as_dict(),
            "good": len(good) if slo.as_dict() else None,
            "request_goodput": len(good) / duration if slo.as_dict() else None,
            "share": len(good) / len(done) if slo.as_dict() and done else None,
        },
        "compute_us": sum(r.compute_us for r in done),
    }


def load_label(load: dict[str, Any]) -> str:
    """The load beside every figure: "concurrency 4" or "Poisson 2 req/s"."""
    if load.get("arrival") == "poisson":
        return f"Poisson {load['request_rate']:g} req/s"
    return f"concurrency {load['concurrency']}"


def lengths_label(summary: dict[str, Any]) -> str:
    i, o = summary["input_tokens"], summary["output_tokens"]
    return f"in {i['mean']:.1f} tok ({i['min']}-{i['max']}), out {o['mean']:.1f} tok ({o['min']}-{o['max']})"
