"""Where the CPU of a streamed token goes through `switchyard up`, process by process (issue 32).

Brings up bench_generation_vllm's switchyard (the `medium` Llama as `llama-bench`, the cpu
executor only, reached through the router's OpenAI port with a team key), warms it with one
pass at 32 streams, then runs `--runs` times its two loads (8 requests at 1 stream, 64 at 32
streams: 32-token prompts, 64 output tokens with `ignore_eos`, greedy, the official `openai`
client in this process). For each it prints output tok/s, TTFT p50/p99 and ITL p50, and the
user + system CPU per output token of every process of the cluster, by role (router,
executor, its engine process, metering, ...: the /proc tree below `up`), and of the client;
and the seconds each role's threads waited for a core (the run queue, /proc schedstat): on a
loaded 2-core host that is where the rest of the wall time goes.

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_generation_cpu.py [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from benchmarks import bench_generation_vllm as peer_bench
from tests.processes import descendants

TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("engine_child", "executor", "router", "metering", "evaluator", "temporal")
Usage = dict[str, tuple[float, float]]  # role -> (CPU s, run-queue wait s)


def _role(pid: int) -> str:
    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return next((r for r in ROLES if r in command), "other")


def _usage(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            wait += int((task / "schedstat").read_text().split()[1])
        except OSError:  # the thread ended
            continue
    return (int(fields[11]) + int(fields[12])) / TICK, wait / 1e9


def usage(root: int) -> dict[int, tuple[str, float, float]]:
    """pid -> (role, CPU s, run-queue wait s) for `root` and every process below it."""
    out = {}
    for pid in descendants(root) | {root}:
        try:
            out[pid] = (_role(pid), *_usage(pid))
        except OSError:  # it ended
            continue
    return out


def by_role(before: dict[int, tuple[str, float, float]], after: dict[int, tuple[str, float, float]]) -> Usage:
    roles: dict[str, tuple[float, float]] = {}
    for pid, (role, cpu, wait) in after.items():
        _, cpu0, wait0 = before.get(pid, (role, 0.0, 0.0))
        was = roles.get(role, (0.0, 0.0))
        roles[role] = (was[0] + cpu - cpu0, was[1] + wait - wait0)
    return roles


async def measure(peer: peer_bench.Peer, texts: list[str], streams: int) -> str:
    before, client, load = usage(peer.process.pid), time.process_time(), os.getloadavg()[0]
    result = await peer_bench.load(peer, texts, streams)
    roles = by_role(before, usage(peer.process.pid))
    roles["client"] = (time.process_time() - client, 0.0)
    tokens = result["output_tokens"]
    cpu = ", ".join(f"{r} {c / tokens * 1e6:.0f}" for r, (c, _) in roles.items() if c > 0.005)
    waits = ", ".join(f"{r} {w:.2f}" for r, (_, w) in roles.items() if w > 0.01)
    return (
        f"{streams} streams (load {load:.1f}): {result['output_tokens_per_s']:.0f} tok/s, TTFT p50 "
        f"{result['ttft_s']['p50'] * 1e3:.1f} p99 {result['ttft_s']['p99'] * 1e3:.1f} ms, ITL p50 "
        f"{result['itl_s']['p50'] * 1e3:.1f} ms, {result['wall_s']:.1f} s\n"
        f"  CPU us per output token: {cpu}\n  run-queue wait s: {waits}"
    )


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-gen-cpu-"))
    directory, root = await peer_bench.bench_repository(work)
    texts = peer_bench.prompts(directory, 1 + 8 + 64)
    sets = {1: texts[1:9], 32: texts[9:]}
    peer = peer_bench.start_switchyard(root, work)
    try:
        await peer_bench.switchyard_key(peer)
        await peer.first_answer(texts[0], args.startup_timeout)
        await peer_bench.load(peer, sets[32][:32], 32)  # warm-up, not measured
        for _ in range(args.runs):
            for streams in (1, 32):
                print(await measure(peer, sets[streams], streams), flush=True)
    finally:
        peer.stop()


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=2, help="times to run the 1- and 32-stream loads")
    parser.add_argument("--startup-timeout", type=float, default=300)
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    run()
