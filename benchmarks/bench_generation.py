"""Generation: the executor's continuous batching against Hugging Face `generate()` with static
batching of the same requests (the floor), on a Llama-style model with seeded weights.

Models (`--model`): `tiny`, the test Llama (tests/gen_models.py: hidden 64, 2 layers, vocab
320), where a decode step is a few ms and the serving cost per token dominates; `medium`
(hidden 512, 4 layers, GQA 8/4 heads, vocab 8192, ~21M parameters), where the model's own
steps dominate and what the engine's scheduling buys shows.

`--requests` N seeded requests (default 128): prompts 8..60 tokens (uniform), output lengths
log-normal with median max_new_tokens / 4 and sigma 1, rounded and clipped to
[2, max_new_tokens] (right-skewed with a long tail, as completion lengths in chat traces are;
the clip is a request's max_tokens), EOS ignored so every request makes exactly its length.
They go
- to `model.generate()` in-process, greedy, in static batches of C (8 and 32) in request
  order (left-padded; a batch runs until its longest request is done, as static batching
  does); output tokens/s counts each request's own tokens only;
- to a real executor in its own process (gRPC, port 0; cpu eager fp32 in this environment,
  its generation engine in a process of its own, the default; or `--backend xla`: in the XLA
  environment) over ModelStreamInfer (stream=true, a response per token, or per several when
  the stream's writer lags), as a closed loop of C streams (1, 8, 32): each stream sends the
  next waiting request when its previous one finished, until all N are done (the 1-stream run
  takes the first `--one-stream` requests only);
- on cpu, at 1 and 32 streams, to a second executor with its engine in process
  (`--generation-engine inline`: its steps on the device thread, sharing the executor's GIL):
  what the engine process changes, in the same run.
- to the bare streamer, a peer in its own process on the executor's transport and event loop
  (gRPC's EventEngine endpoints off, uvloop) that computes nothing: for each request it
  streams max_tokens responses back to back to the same client, at 1 and 32 streams, each
  with the token in `output_ids` and only the parameters the client reads (the executor's
  also carry the text and its load and timing parameters: over 330 bytes against 94). Its
  output tokens/s at 32 streams is about what a grpc.aio server sending
  a message per token could reach on this host at best, and its 1-stream TTFT is the
  transport's own first-message time: `prefill_plus_bare_ttft_p50_over_prefill_p50` is the
  best TTFT ratio a server paying it could reach. (Its runs' `executor_cpu_*` figures are the
  bare server's CPU.)
The measurements are interleaved: each of `--rounds` rounds runs the two floors, the
in-process prefill with the 1-stream run, the 8- and 32-stream runs, the bare streamer's two
runs and the in-process engine's two once, in an order
rotated by one each round, so a host whose load drifts moves both sides of every ratio
alike. Each ratio is taken within a round; the report gives every round's and their median.
Per concurrency: TTFT, TPOT ((e2e - ttft) / (output_tokens - 1)), ITL (gaps between streamed
responses) and E2E with p50/p90/p99, request and output-token throughput, and the
compilations after warm-up the responses report. The 1-stream TTFT is compared with the
in-process prefill time of the same prompts (the model's own forward), measured just before
it. Targets (issue 18): 32 streams >= 2x the floor's output tokens/s (static batches of 32);
1-stream TTFT p50 <= 1.25x the prefill p50; 0 compilations after warm-up (checked on every
backend, the point on xla). Each target is reported met or not, as measured. Writes
out/bench/generation-<model>[-xla].json.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_generation.py [--model tiny|medium]
        [--rounds 5] [--requests 128] [--backend xla]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from benchmarks.common import write_report
from switchyard import codec, oip_params
from switchyard.gen.inference import grpc_service_pb2 as pb
from tests.processes import stop_child

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
GENERATION = {
    "max_context": 128,
    "max_new_tokens": 64,
    "prompt_buckets": [16, 32, 64],
    "decode_slots": 32,
}
# LlamaConfig sizes over tests/gen_models.py's tiny Llama (hidden 64, 2 layers, vocab 320)
MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "medium": {
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}
CONCURRENCY = (1, 8, 32)
FLOOR_BATCHES = (8, 32)  # the static-batch floor of the 8- and 32-stream runs


def quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "n": len(values)}


def length_stats(values: list[int]) -> dict[str, float]:
    return {**quantiles([float(v) for v in values]), "mean": sum(values) / len(values),
            "min": min(values), "max": max(values)}  # fmt: skip


def build_model(directory: Path, model: str) -> Path:
    from tests.gen_models import build_llama

    return build_llama(directory, **MODELS[model])


def output_length(rng: random.Random, limit: int) -> int:
    """Log-normal, median limit / 4, sigma 1, clipped to [2, limit]: most requests short, a
    long tail, the longest cut at the limit (a request's max_tokens)."""
    return max(2, min(limit, round(rng.lognormvariate(math.log(limit / 4), 1.0))))


def workload(n: int, vocab: int, limit: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(8, 60))]
        requests.append((prompt, output_length(rng, limit)))
    return requests


def static_useful_fraction(requests: list[tuple[list[int], int]], batch: int) -> float:
    """Requested tokens over the rows x steps static batches of `batch` decode (each batch runs
    to its longest): the bound of what refilling slots can gain at equal step cost is 1/this."""
    groups = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    return sum(n for _, n in requests) / sum(len(g) * max(n for _, n in g) for g in groups)


def load_reference(directory: Path) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    model.train(False)
    pad = int(model.config.eos_token_id)  # type: ignore[arg-type]
    with torch.no_grad():  # warm once
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    return model


def hf_floor(model: Any, requests: list[tuple[list[int], int]], batch: int) -> dict[str, Any]:
    pad = int(model.config.eos_token_id)
    useful = 0
    with torch.no_grad():
        cpu = time.process_time()
        begin = time.perf_counter()
        for i in range(0, len(requests), batch):
            group = requests[i : i + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, (p, _) in enumerate(group):
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            longest = max(n for _, n in group)
            model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
            useful += sum(n for _, n in group)
        seconds = time.perf_counter() - begin
        cpu = time.process_time() - cpu
    return {
        "batch": batch,
        "seconds": seconds,
        "output_tokens": useful,
        "output_tokens_per_s": useful / seconds,
        "cpu_s": cpu,
        "cpu_us_per_output_token": cpu / useful * 1e6,
    }


def prefill_times(model: Any, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    """The model's own forward over each prompt, in-process: what TTFT cannot beat. Only the
    last position's logits are computed (`logits_to_keep=1`), as the engine's prefill does:
    the whole sequence's would add the LM head over every prompt position (~25% of the
    medium model's prefill) to the baseline and flatter the ratio."""
    times = []
    with torch.no_grad():
        for p, _ in requests:
            start = time.perf_counter()
            model(torch.tensor([p]), logits_to_keep=1)
            times.append(time.perf_counter() - start)
    return quantiles(times)


def _request(prompt: list[int], max_tokens: int, rid: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="llama-bench", id=rid)
    request.inputs.add(name="input_ids", datatype="INT64", shape=[len(prompt)])
    request.raw_input_contents.append(np.asarray(prompt, np.int64).tobytes())
    request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    request.raw_input_contents.append(np.array([True]).tobytes())
    sampling = json.dumps({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(codec.encode_bytes([sampling.encode()]))
    return request


async def executor_run(
    address: str,
    requests: list[tuple[list[int], int]],
    concurrency: int,
    cpu_s: Callable[[], tuple[float, float]],
) -> dict[str, Any]:
    channel = grpc.aio.insecure_channel(address)
    open_stream = channel.stream_stream(
        STREAM,
        request_serializer=pb.ModelInferRequest.SerializeToString,
        response_deserializer=pb.ModelStreamInferResponse.FromString,
    )
    queue: asyncio.Queue[tuple[int, tuple[list[int], int]]] = asyncio.Queue()
    for item in enumerate(requests):
        queue.put_nowait(item)
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tokens = 0
    compilations: set[int] = set()

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            i, (prompt, n) = queue.get_nowait()
            call = open_stream()
            start = time.perf_counter()
            await call.write(_request(prompt, n, str(i)))
            await call.done_writing()
            stamps = []
            count = 0
            async for message in call:
                assert not message.error_message, message.error_message
                stamps.append(time.perf_counter())
                params = message.infer_response.parameters
                count = params[oip_params.NUM_OUTPUT_TOKENS].int64_param
                compilations.add(params[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param)
                if params[oip_params.FINAL].bool_param:
                    break
            assert count == n, (count, n)
            tokens += count
            ttft.append(stamps[0] - start)
            e2e.append(stamps[-1] - start)
            if count > 1:
                tpot.append((stamps[-1] - stamps[0]) / (count - 1))
            itl.extend(b - a for a, b in itertools.pairwise(stamps))

    cpu, loop = cpu_s()
    client_cpu = time.process_time()  # this process runs nothing else meanwhile
    begin = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - begin
    client_cpu = time.process_time() - client_cpu
    total, main_thread = cpu_s()
    cpu, loop = total - cpu, main_thread - loop
    await channel.close()
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "requests_per_s": len(requests) / seconds,
        "executor_cpu_s": cpu,
        "executor_cpu_us_per_output_token": cpu / tokens * 1e6,
        "executor_loop_thread_cpu_us_per_output_token": loop / tokens * 1e6,
        # the client's share of the host: with the servers', what a token costs the 2 cores
        "client_cpu_us_per_output_token": client_cpu / tokens * 1e6,
        "ttft_s": quantiles(ttft),
        "tpot_s": quantiles(tpot),
        "itl_s": quantiles(itl),
        "e2e_s": quantiles(e2e),
        "compilations_after_warmup": sorted(compilations),
    }


BARE = (1, 32)  # the bare streamer's concurrencies: the TTFT and the throughput a message per token allows
INLINE = (1, 32)  # the executor with its engine in process (cpu): what the engine process changes
STEPS = (*(f"floor-{b}" for b in FLOOR_BATCHES), *(str(c) for c in CONCURRENCY), *(f"bare-{c}" for c in BARE))


def steps(servers: dict[str, ServerProcess]) -> tuple[str, ...]:
    """Every step of a round: the in-process engine's runs too where it runs (on cpu; an
    accelerator's engine is always in process)."""
    return STEPS + tuple(f"inline-{c}" for c in INLINE) if "inline" in servers else STEPS


def rotation(round_: int, every: tuple[str, ...]) -> tuple[str, ...]:
    k = round_ % len(every)
    return every[k:] + every[:k]


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class ServerProcess:
    """A server in its own process, announcing " serving on <address>" in its output: the
    executor as it is deployed (`executor_process`) or the bare streamer (`bare_process`). The
    client (this process) never shares its interpreter, GIL or event loop."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.address = ""

    def cpu_s(self) -> tuple[float, float]:
        """User + system CPU seconds used so far by the process and its children (the executor's
        engine process): all their threads; and the main thread's of the process itself (the
        event loop's: gRPC, building responses, and in process the engine's scheduling)."""

        def used(stat: str) -> float:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        def tree(pid: int) -> list[int]:  # the process and its descendants, whichever thread started them
            tasks = Path(f"/proc/{pid}/task").iterdir()
            children = [int(c) for task in tasks for c in (task / "children").read_text().split()]
            return [pid, *(p for child in children for p in tree(child))]

        pid = self.process.pid
        return sum(used(f"/proc/{p}/stat") for p in tree(pid)), used(f"/proc/{pid}/task/{pid}/stat")

    async def start(self, timeout_s: float = 900) -> str:
        out = self.process.stdout
        assert out is not None
        deadline = time.monotonic() + timeout_s
        said: list[str] = []
        while time.monotonic() < deadline:
            line = await asyncio.to_thread(out.readline)
            said = [*said[-20:], line.rstrip()]
            if not line:
                tail = "\n".join(said)
                raise SystemExit(f"the executor exited ({self.process.wait()}) before serving:\n{tail}")
            if " serving on " in line:
                self.address = line.rsplit(" serving on ", 1)[1].strip()
                threading.Thread(target=out.read, daemon=True).start()  # drained, so it never blocks
                return self.address
        raise SystemExit(f"the executor did not serve within {timeout_s:.0f} s")

    def stop(self) -> None:
        stop_child(self.process)


def executor_process(root: Path, backend: str, mode: str = "", engine: str = "process") -> ServerProcess:
    """An executor serving the benchmark's repository on a free loopback port, plaintext:
    `--backend cpu` in this environment (its generation engine in a process of its own, or
    `engine` "inline"), `--backend xla` in the XLA environment (SWITCHYARD_XLA_PYTHON),
    PJRT_DEVICE as set (CPU when unset)."""
    python = sys.executable
    env = dict(os.environ)
    if backend == "xla":
        python = os.environ.get("SWITCHYARD_XLA_PYTHON", "")
        if not python:
            raise SystemExit("--backend xla needs SWITCHYARD_XLA_PYTHON (the XLA environment's python)")
        env["PJRT_DEVICE"] = os.environ.get("PJRT_DEVICE", "CPU")
    cmd = [python, "-m", "clients.cli", "executor", "serve", "--backend", backend, "--port", "0"]
    cmd += ["--models", "llama-bench", "--model-repository", str(root)]
    cmd += ["--mode", mode] if mode else []
    cmd += ["--generation-engine", engine] if backend == "cpu" else []
    env["SWITCHYARD_SECURITY_INSECURE"] = "true"  # loopback only
    return ServerProcess(cmd, env)


def bare_process() -> ServerProcess:
    """The bare streamer (`--serve-bare`) on the executor's transport and event loop."""
    from switchyard.transport import LOW_LATENCY_EXPERIMENTS

    env = {**os.environ, "GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS", LOW_LATENCY_EXPERIMENTS)}
    return ServerProcess([sys.executable, "-m", "benchmarks.bench_generation", "--serve-bare"], env)


def _max_tokens(request: pb.ModelInferRequest) -> int:
    names = [t.name for t in request.inputs]
    raw = request.raw_input_contents[names.index("sampling_parameters")]
    return int(json.loads(codec.decode("p", "BYTES", [1], raw).array[0])["max_tokens"])


async def bare_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    """ModelStreamInfer with no model: for each request, max_tokens responses back to back,
    each built per token (a token id in `output_ids`, the running count, `final` on the last,
    the compilations the client checks). What a message per token costs through grpc.aio on
    this host, and nothing else."""
    token = np.array([7], np.int64).tobytes()
    async for request in requests:
        n = _max_tokens(request)
        for i in range(1, n + 1):
            message = pb.ModelStreamInferResponse()
            r = message.infer_response
            r.model_name, r.id = request.model_name, request.id
            r.outputs.add(name="output_ids", datatype="INT64", shape=[1])
            r.raw_output_contents.append(token)
            r.parameters[oip_params.NUM_OUTPUT_TOKENS].int64_param = i
            r.parameters[oip_params.COMPILATIONS_AFTER_WARMUP].int64_param = 0
            r.parameters[oip_params.FINAL].bool_param = i == n
            yield message


async def serve_bare() -> None:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        bare_stream,
        request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString,
    )
    service = STREAM.split("/")[1]
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {"ModelStreamInfer": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"bare streamer serving on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


async def one_round(
    r: int,
    reference: Any,
    servers: dict[str, ServerProcess],
    requests: list[tuple[list[int], int]],
    one: int,
) -> dict[str, Any]:
    """Every step once, in round r's rotated order; the ratios of this round's figures."""
    order = rotation(r, steps(servers))
    result: dict[str, Any] = {"order": list(order), "load_1m_before": os.getloadavg()[0], "floor": {},
                              "executor": {}, "bare": {}, "inline": {}}  # fmt: skip
    for step in order:
        if step.startswith("floor-"):
            batch = int(step.removeprefix("floor-"))
            result["floor"][str(batch)] = await asyncio.to_thread(hf_floor, reference, requests, batch)
            continue
        kind, _, streams = step.rpartition("-")
        server = servers[kind or "executor"]
        subset = requests[:one] if streams == "1" else requests
        if step == "1":  # the baseline of the 1-stream TTFT, just before it
            result["prefill_s"] = await asyncio.to_thread(prefill_times, reference, subset)
        run = await executor_run(server.address, subset, int(streams), server.cpu_s)
        result[kind or "executor"][streams] = run
    floor, served, bare = result["floor"], result["executor"], result["bare"]
    prefill = result["prefill_s"]["p50"]
    result["ratios"] = {
        **{f"output_tokens_per_s_{b}_streams_over_floor": served[str(b)]["output_tokens_per_s"]
           / floor[str(b)]["output_tokens_per_s"] for b in FLOOR_BATCHES},
        "ttft_p50_1_stream_over_prefill_p50": served["1"]["ttft_s"]["p50"] / prefill,
        # what a message per token allows at all: the bare streamer computes nothing
        "output_tokens_per_s_bare_32_streams_over_floor": bare["32"]["output_tokens_per_s"]
        / floor["32"]["output_tokens_per_s"],
        "output_tokens_per_s_32_streams_over_bare_32": served["32"]["output_tokens_per_s"]
        / bare["32"]["output_tokens_per_s"],
        # the best TTFT ratio a server paying this transport's first-message time could reach
        "prefill_plus_bare_ttft_p50_over_prefill_p50": (prefill + bare["1"]["ttft_s"]["p50"]) / prefill,
    }  # fmt: skip
    if result["inline"]:  # the engine process against the engine on the executor's device thread
        inline = result["inline"]
        result["ratios"]["output_tokens_per_s_32_streams_over_inline_32"] = (
            served["32"]["output_tokens_per_s"] / inline["32"]["output_tokens_per_s"]
        )
        result["ratios"]["ttft_p50_1_stream_over_inline_1"] = (
            served["1"]["ttft_s"]["p50"] / inline["1"]["ttft_s"]["p50"]
        )
    # not a target: CPU time per output token, which the host's load moves far less
    result["cpu_per_token_floor_over_streams"] = {
        str(b): floor[str(b)]["cpu_us_per_output_token"] / served[str(b)]["executor_cpu_us_per_output_token"]
        for b in FLOOR_BATCHES
    }
    result["load_1m_after"] = os.getloadavg()[0]
    return result


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over rounds of each step's headline figures."""

    def over(get: Any) -> float:
        return median([get(r) for r in rounds])

    out: dict[str, Any] = {}
    for b in FLOOR_BATCHES:
        out[f"floor_{b}_output_tokens_per_s"] = over(lambda r, b=b: r["floor"][str(b)]["output_tokens_per_s"])
    out["prefill_p50_s"] = over(lambda r: r["prefill_s"]["p50"])
    for c in CONCURRENCY:
        for key, get in (
            ("output_tokens_per_s", lambda x: x["output_tokens_per_s"]),
            ("ttft_p50_s", lambda x: x["ttft_s"]["p50"]),
            ("tpot_p50_s", lambda x: x["tpot_s"]["p50"]),
            ("executor_cpu_us_per_output_token", lambda x: x["executor_cpu_us_per_output_token"]),
            (
                "executor_loop_thread_cpu_us_per_output_token",
                lambda x: x["executor_loop_thread_cpu_us_per_output_token"],
            ),
        ):
            out[f"streams_{c}_{key}"] = over(lambda r, c=c, get=get: get(r["executor"][str(c)]))
    for kind, runs in (("bare", BARE), ("inline", INLINE)):
        for c in runs if rounds[0][kind] else ():
            out[f"{kind}_{c}_output_tokens_per_s"] = over(
                lambda r, k=kind, c=c: r[k][str(c)]["output_tokens_per_s"]
            )
            out[f"{kind}_{c}_ttft_p50_s"] = over(lambda r, k=kind, c=c: r[k][str(c)]["ttft_s"]["p50"])
    return out


def targets(ratios: dict[str, float], compilations: list[int], backend: str) -> dict[str, Any]:
    throughput = ratios["output_tokens_per_s_32_streams_over_floor"]
    ttft = ratios["ttft_p50_1_stream_over_prefill_p50"]
    return {
        "output_tokens_per_s_32_streams_over_floor": {
            "target": ">= 2", "measured": throughput, "met": throughput >= 2,
        },
        "ttft_p50_1_stream_over_prefill_p50": {"target": "<= 1.25", "measured": ttft, "met": ttft <= 1.25},
        "compilations_after_warmup": {
            "target": "0 on every response", "measured": compilations, "met": compilations == [0],
            "backend": backend,
        },
    }  # fmt: skip


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from switchyard.models.repository import seed_builtins
    from tests.gen_models import add_generative

    # the executor's thread count (services/executor/device.py) for the floor too: the same cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    work = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    directory = await asyncio.to_thread(build_model, work / "llama", args.model)
    config = json.loads((directory / "config.json").read_text())
    limit = int(GENERATION["max_new_tokens"])  # type: ignore[call-overload]
    requests = workload(args.requests, int(config["vocab_size"]), limit)
    reference = await asyncio.to_thread(load_reference, directory)
    root = work / "repo"
    seed_builtins(root, ["tiny-lm"])
    add_generative(root, "llama-bench", directory, GENERATION, "hf")
    servers = {"executor": executor_process(root, args.backend, args.mode), "bare": bare_process()}
    if args.backend == "cpu":
        servers["inline"] = executor_process(root, args.backend, args.mode, "inline")
    rounds: list[dict[str, Any]] = []
    try:
        for server in servers.values():
            await server.start()
        for r in range(args.rounds):
            rounds.append(await one_round(r, reference, servers, requests, args.one_stream))
            print(
                f"round {r + 1}/{args.rounds} ({', '.join(rounds[-1]['order'])}; load "
                f"{rounds[-1]['load_1m_after']:.1f}): "
                + ", ".join(f"{k} x{v:.2f}" for k, v in rounds[-1]["ratios"].items()),
                flush=True,
            )
    finally:
        for server in servers.values():
            server.stop()
    ratios = {k: median([r["ratios"][k] for r in rounds]) for k in rounds[0]["ratios"]}
    compilations = sorted(
        {c for r in rounds for run in r["executor"].values() for c in run["compilations_after_warmup"]}
    )
    shape = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size")  # fmt: skip
    return {
        "model": {"case": args.model, **{k: config.get(k) for k in shape},
                  "dtype": str(next(reference.parameters()).dtype),
                  "parameters": sum(p.numel() for p in reference.parameters())},
        "generation": GENERATION,
        "backend": args.backend,
        "workload": {
            "requests": len(requests), "one_stream_requests": args.one_stream, "seed": 0,
            "ignore_eos": True, "concurrency": list(CONCURRENCY), "floor_batches": list(FLOOR_BATCHES),
            "prompt_tokens": "uniform 8..60",
            "output_tokens": f"log-normal, median {limit / 4:g}, sigma 1, rounded, clipped to [2, {limit}]",
            "lengths": {"prompt_tokens": length_stats([len(p) for p, _ in requests]),
                        "output_tokens": length_stats([n for _, n in requests]),
                        "one_stream_output_tokens": length_stats([n for _, n in requests[: args.one_stream]
                                                                  ])},
            "static_batch_useful_fraction": {str(b): static_useful_fraction(requests, b)
                                             for b in FLOOR_BATCHES},
        },
        "rounds": rounds,
        "medians": medians(rounds),
        "ratios_median": ratios,
        "ratios_per_round": {k: [r["ratios"][k] for r in rounds] for k in ratios},
        "cpu_per_token_floor_over_streams": {
            str(b): {"median": median([r["cpu_per_token_floor_over_streams"][str(b)] for r in rounds]),
                     "per_round": [r["cpu_per_token_floor_over_streams"][str(b)] for r in rounds]}
            for b in FLOOR_BATCHES
        },
        "targets": targets(ratios, compilations, args.backend),
        "host": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "executor_torch_threads": "cores - 1 (services/executor/device.py)",
            "load_1m": [r[k] for r in rounds for k in ("load_1m_before", "load_1m_after")],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }  # fmt: skip


def run() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="the model case")
    parser.add_argument("--requests", type=int, default=128, help="requests of the 8- and 32-stream runs")
    parser.add_argument("--one-stream", type=int, default=8, help="requests of the 1-stream run")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds (each runs every step once)"
    )
    parser.add_argument("--backend", choices=("cpu", "xla"), default="cpu", help="the executor's backend")
    parser.add_argument("--mode", default="", help="the executor's mode (default: the backend's first)")
    parser.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)  # the peer's process
    args = parser.parse_args()
    if args.serve_bare:
        from switchyard.grpcio import run_service

        run_service(serve_bare())
        return
    report = asyncio.run(main(args))
    last = report["rounds"][-1]
    for b, floor in last["floor"].items():
        print(
            f"last round: floor (HF generate, static batches of {b}): "
            f"{floor['output_tokens_per_s']:.1f} output tok/s "
            f"({floor['cpu_us_per_output_token']:.0f} us CPU/token)"
        )
    print(f"last round: in-process prefill p50 {last['prefill_s']['p50'] * 1e3:.1f} ms")
    labels = {"executor": f"executor ({report['backend']})", "inline": "executor, engine in process",
              "bare": "bare streamer (no model)"}  # fmt: skip
    for kind, label in labels.items():
        for c, r in last[kind].items():
            print(
                f"last round: {label} {c:>2} streams: {r['output_tokens_per_s']:.1f} tok/s "
                f"({r['executor_cpu_us_per_output_token']:.0f} us CPU/token, "
                f"{r['executor_loop_thread_cpu_us_per_output_token']:.0f} of them the loop's; the "
                f"client's {r['client_cpu_us_per_output_token']:.0f}), TTFT p50 "
                f"{r['ttft_s']['p50'] * 1e3:.2f} ms p99 {r['ttft_s']['p99'] * 1e3:.1f} ms, "
                f"TPOT p50 {r['tpot_s']['p50'] * 1e3:.2f} ms"
            )
    for b, cpu in report["cpu_per_token_floor_over_streams"].items():
        print(
            f"CPU time per output token, floor / executor (its child processes included) at {b} streams "
            f"(not a target): "
            f"x{cpu['median']:.2f} (rounds: {', '.join(f'x{v:.2f}' for v in cpu['per_round'])})"
        )
    for k, rounds in report["ratios_per_round"].items():
        t = report["targets"].get(k)
        verdict = f", target {t['target']}: {'met' if t['met'] else 'NOT met'}" if t else " (not a target)"
        each = ", ".join(f"x{v:.2f}" for v in rounds)
        print(f"{k}: x{report['ratios_median'][k]:.2f} (rounds: {each}){verdict}")
    c = report["targets"]["compilations_after_warmup"]
    verdict = "met" if c["met"] else "NOT met"
    print(f"compilations after warm-up: {c['measured']}, target {c['target']}: {verdict}")
    write_report("generation-" + args.model + ("-xla" if args.backend == "xla" else ""), report)


if __name__ == "__main__":
    run()
