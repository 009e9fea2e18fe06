"""What the trial's method costs: an A/A trial's wall time with the full method against the
method before it, for the same spec, in one run (issue 30, "Must show").

Starts the stack of benchmarks/bench_aa.py (a real Temporal dev server, the evaluator,
metering with a price, a CPU executor, an in-process trial worker) and runs RUNS pairs of A/A
trials per model (cpu-eager against cpu-eager, the spec defaults otherwise):

- full: the defaults: the two paths alternate blocks (ABAB...) and the measurement extends
  itself while the latency interval straddles its bound (`performance.max_extra_requests`);
- old: `performance.interleave: false` and `max_extra_requests: 0`: one path measured after
  the other, the planned requests only (the method before alternating blocks).

The two alternate, in ABBA order (pair i runs full first when i is even), each pair with its
own seed, so a change of the host's load lands on both alike. Printed and written: the wall
time ratio full / old with a paired bootstrap interval over the pairs (the mean ratio,
workflows/tensor/intervals.py), the A/A spread (each method's odd runs against its even ones,
the same interval, with 8 runs or more; and its run-to-run ratios), and per run the verdict,
the latency interval and what the extension measured.

With `--methods full,old,alternating`, a third method alternates too: blocks alternate but
the measurement does not extend (`max_extra_requests: 0`), so the extension's own share of
the cost is told apart from the alternation's.

Usage: python benchmarks/bench_method_cost.py [--runs 8] [--models mlp] [--name method-cost]
       [--methods full,old]
Writes out/bench/NAME.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
import uuid
from typing import Any

from benchmarks.bench_aa import INPUTS, _row, spec, trial_stack
from benchmarks.common import write_report
from workflows.spec.trial_io import TrialInput
from workflows.tensor.intervals import MIN_BLOCKS, RatioInterval, mean, ratio_interval
from workflows.trial import TrialWorkflow

METHODS = {
    "full": {},  # interleaved, extension at its default budget
    "old": {"interleave": False, "max_extra_requests": 0},
    "alternating": {"max_extra_requests": 0},  # --methods: the share of the extension alone
}


def method_spec(model: str, seed: int, method: str) -> dict[str, Any]:
    out = spec(model, seed)
    if METHODS[method]:
        out["performance"] = dict(METHODS[method])
    return out


async def _trial(env: Any, model: str, i: int, method: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    report = await env.client.execute_workflow(
        TrialWorkflow.run,
        TrialInput.from_json(method_spec(model, i + 1, method)),
        id=f"cost-{model}-{method}-{i}-{uuid.uuid4().hex[:6]}",
        task_queue="cost",
    )
    data = json.loads(json.dumps(report.to_json()))
    row = _row(model, i, time.perf_counter() - t0, data, method)
    single = [
        s
        for s in data["paths"]["same"]["performance"].get("scenarios", [])
        if s["scenario"] == "single-stream"
    ]
    ext = (single[0].get("extension") if single else None) or {}
    row["single_stream_requests"] = single[0]["iterations"] if single else None
    row["extra_requests"] = ext.get("extra_requests", 0)
    row["extension_stopped"] = ext.get("stopped", "")
    row["load_average"] = round(os.getloadavg()[0], 1)
    print(
        f"{method} {model} run {i}: {row['verdict']} latency {row['latency']} "
        f"({row['ratio']} [{row['low']}, {row['high']}]), +{row['extra_requests']} requests "
        f"({row['extension_stopped'] or 'not extended'}), {row['wall_s']} s, load {row['load_average']}",
        flush=True,
    )
    return row


def _interval(mine: list[float], theirs: list[float]) -> dict[str, Any] | None:
    """The paired bootstrap interval of mean(mine) / mean(theirs), run i against run i."""
    if min(len(mine), len(theirs)) < MIN_BLOCKS:
        return None
    iv: RatioInterval = ratio_interval([[v] for v in mine], [[v] for v in theirs], stat=mean)
    return {
        "ratio": round(iv.ratio, 3),
        "low": round(iv.low, 3),
        "high": round(iv.high, 3),
        "pairs": iv.blocks,
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model: each method's wall times and verdicts, its wall ratio to old with the
    interval, and each method's A/A spread (odd runs against even ones)."""
    out: dict[str, Any] = {}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    for model in sorted({r["model"] for r in rows}):
        walls = {m: [r["wall_s"] for r in rows if r["model"] == model and r["method"] == m] for m in methods}
        n = min(len(w) for w in walls.values())
        entry: dict[str, Any] = {"pairs": n}
        for one, other in (("full", "old"), ("alternating", "old"), ("full", "alternating")):
            if one in walls and other in walls:
                entry[f"wall_ratio_{one}_to_{other}"] = _interval(walls[one][:n], walls[other][:n])
        for method, wall in walls.items():
            mine = [r for r in rows if r["model"] == model and r["method"] == method]
            steps = [b / a for a, b in itertools.pairwise(wall)]
            entry[method] = {
                "runs": len(mine),
                "wall_s_median": statistics.median(wall) if wall else None,
                "wall_s_mean": round(statistics.fmean(wall), 2) if wall else None,
                "wall_s_range": [min(wall), max(wall)] if wall else None,
                "aa_spread_odd_to_even": _interval(wall[1::2], wall[0::2]),
                "run_to_run_ratio_range": [round(min(steps), 3), round(max(steps), 3)] if steps else None,
                "rejects": sum(r["verdict"] == "REJECT" for r in mine),
                "latency": {
                    k: sum(r["latency"] == k for r in mine) for k in ("pass", "inconclusive", "fail")
                },
                "covers_1": sum(r["covers_1"] for r in mine),
                "extended": sum(r["extra_requests"] > 0 for r in mine),
                "extra_requests_mean": round(statistics.fmean(r["extra_requests"] for r in mine), 1)
                if mine
                else 0,
                "stopped": {s: sum(r["extension_stopped"] == s for r in mine) for s in ("decided", "budget")},
            }
        out[model] = entry
    return out


def _plan(models: list[str], runs: int, methods: list[str]) -> list[tuple[str, int, str]]:
    """ABBA: round i runs the methods in order when i is even, reversed when it is odd."""
    order = []
    for model in models:
        for i in range(runs):
            order += [(model, i, m) for m in (methods if i % 2 == 0 else methods[::-1])]
    return order


async def main(runs: int, models: list[str], name: str, methods: list[str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    configuration = {
        "paths": "cpu-eager vs cpu-eager, one executor (its own process), one loaded instance (A/A)",
        "methods": {m: METHODS[m] or "spec defaults (interleave, max_extra_requests 100)" for m in methods},
        "spec": "defaults: warmup 5, min_iterations 50, min_seconds 2.0, single-stream + offline [1, 8]",
        "inputs": {m: INPUTS[m] for m in models},
        "order": "ABBA by pair, one seed per pair",
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(v, 1) for v in os.getloadavg()],
    }
    async with trial_stack("cost") as env:
        for model, i, method in _plan(models, runs, methods):
            rows.append(await _trial(env, model, i, method))
            partial = {"benchmark": name, "partial": True, "summary": summary(rows), "runs": rows}
            write_report(name, partial)
    configuration["load_average_at_end"] = [round(v, 1) for v in os.getloadavg()]
    return {"benchmark": name, "configuration": configuration, "summary": summary(rows), "runs": rows}


def _print(result: dict[str, Any]) -> None:
    for model, s in result["summary"].items():
        for key in (k for k in s if k.startswith("wall_ratio_")):
            ratio = s[key]
            shown = f"{ratio['ratio']} [{ratio['low']}, {ratio['high']}]" if ratio else "too few pairs"
            what = key.removeprefix("wall_ratio_").replace("_to_", " / ")
            print(f"{model}: wall time {what} {shown} over {s['pairs']} pairs")
        for method in (m for m in METHODS if m in s):
            m = s[method]
            aa = m["aa_spread_odd_to_even"]
            spread = f"{aa['ratio']} [{aa['low']}, {aa['high']}]" if aa else "fewer than 8 runs"
            print(
                f"  {method}: median {m['wall_s_median']} s, range {m['wall_s_range']}, A/A spread {spread}, "
                f"run-to-run {m['run_to_run_ratio_range']}; {m['rejects']} REJECT, latency {m['latency']}, "
                f"extended {m['extended']} (mean +{m['extra_requests_mean']}, {m['stopped']})"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=8, help="pairs per model")
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--name", default="method-cost")
    parser.add_argument("--methods", default="full,old", help=f"a comma list of {', '.join(METHODS)}")
    args = parser.parse_args()
    result = asyncio.run(main(args.runs, args.models.split(","), args.name, args.methods.split(",")))
    _print(result)
    write_report(args.name, result)
