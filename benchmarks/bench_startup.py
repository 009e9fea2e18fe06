"""Start-up to first answer of `switchyard up` (issue 32's figure), with its timeline, N times.

Starts `python -m clients.cli up` exactly as benchmarks/bench_generation_vllm.py does (its
config: free ports, the cpu executor only, mTLS, no trial worker; bench_generation's `medium`
Llama served as `llama-bench`), makes a team key once cluster.json is written and sends a
completion until one is answered: the start-up time is from starting the process to that
answer. Each line `up` prints is stamped with the second it came, so each run also shows the
timeline (every service's "ready" line, the state file and key, the first answer).

`--against DIR`: a checkout of the baseline (e.g. `git archive <commit> | tar -x -C DIR`)
started the same way, in turn with this one (A B A B ...): each pair's ratio this/baseline
is taken on the same machine minutes apart, which on a shared host matters more than the
spread of either. The model folder is built once, outside the timed runs. Prints min, median
and max and writes out/bench/startup.json (`--out`).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_startup.py [--runs 5] [--against DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_generation_vllm import Peer, bench_repository, prompts, start_switchyard, switchyard_key
from benchmarks.common import ROOT
from tests.processes import descendants


def follow(peer: Peer, lines: list[tuple[float, str]]) -> None:
    """Appends each line of `peer`'s log with the seconds since its start, until it exits."""
    seen = 0
    while peer.process.poll() is None or seen < peer.log.stat().st_size:
        data = peer.log.read_bytes()[seen:]
        if b"\n" not in data:
            time.sleep(0.02)
            continue
        chunk = data[: data.rindex(b"\n") + 1]
        seen += len(chunk)
        now = time.monotonic() - peer.started
        lines += [(now, line) for line in chunk.decode(errors="replace").splitlines()]


async def one_run(root: Path, checkout: Path, prompt: str, timeout_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    peer = start_switchyard(root, work, checkout)
    lines: list[tuple[float, str]] = []
    follower = threading.Thread(target=follow, args=(peer, lines), daemon=True)
    follower.start()
    marks: dict[str, float] = {}
    try:
        await switchyard_key(peer)
        marks["state_and_key"] = time.monotonic() - peer.started
        await peer.first_answer(prompt, timeout_s)
        marks["first_answer"] = peer.startup_s
        marks["cpu_s"] = tree_cpu_s(peer.process.pid)
    finally:
        peer.stop()
    await asyncio.to_thread(follower.join, 10)
    marked = (" ready after ", "starting ", "from its standby", "cluster is up")
    timeline = [(round(t, 2), line.strip()) for t, line in lines if any(m in line for m in marked)]
    shutil.rmtree(work, ignore_errors=True)
    return {"marks": marks, "timeline": timeline}


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and every process below it (reaped children too, as
    their parents' cutime/cstime): what the start-up cost the host, less noisy than its wall."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in {pid, *descendants(pid)}:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue  # ended meanwhile: its time is in its parent's cutime/cstime
        total += sum(int(f) for f in stat[stat.rindex(")") + 2 :].split()[11:15]) / tick
    return total


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "first_answer_s": spread([r["marks"]["first_answer"] for r in runs]),
        "state_and_key_s": spread([r["marks"]["state_and_key"] for r in runs]),
        "cpu_s": spread([r["marks"]["cpu_s"] for r in runs]),
        "per_run": runs,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-startup-model-"))
    directory, root = await bench_repository(work)
    prompt = prompts(directory, 1)[0]
    checkouts = {"this": ROOT, **({"baseline": args.against.resolve()} if args.against else {})}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    for i in range(args.runs):
        for name, checkout in checkouts.items():
            run = await one_run(root, checkout, prompt, args.timeout)
            runs[name].append(run)
            m = run["marks"]
            print(f"{name} run {i + 1}/{args.runs}: first answer after {m['first_answer']:.2f} s, "
                  f"{m['cpu_s']:.1f} CPU s")  # fmt: skip
            for t, line in run["timeline"]:
                print(f"  {t:6.2f} s  {line}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {"runs": args.runs, **{name: summary(r) for name, r in runs.items()}}
    if args.against:
        pairs = list(zip(runs["this"], runs["baseline"], strict=True))
        for key in ("first_answer", "cpu_s"):
            ratios = [a["marks"][key] / b["marks"][key] for a, b in pairs]
            result[f"ratio_{key}_this_over_baseline"] = {**spread(ratios), "per_pair": ratios}
    return result


def run() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="runs (of each checkout)")
    parser.add_argument("--against", type=Path, default=None, help="a baseline checkout to alternate with")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to the first answer, at most")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench" / "startup.json")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, key in (("this", "first_answer_s"), ("this", "cpu_s"), ("baseline", "first_answer_s"),
                      ("baseline", "cpu_s"), ("ratio_first_answer_this_over_baseline", ""),
                      ("ratio_cpu_s_this_over_baseline", "")):  # fmt: skip
        if name in result:
            f = result[name][key] if key else result[name]
            print(f"{name} {key}: min {f['min']:.2f}, median {f['median']:.2f}, max {f['max']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run()
