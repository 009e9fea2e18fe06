"""Generation trials end to end on a real Temporal dev server, real executors (cpu in-process,
xla in its own environment on PJRT CPU), evaluator and ledger: the Llama-style test model
(tests/gen_models.py) as `llama-tiny`, added and validated by the commands docs/generation.md
shows and started from the Temporal CLI, greedy under the divergence rule, every serving metric
of vLLM's `bench serve`, cost per million output tokens; a perturbed variant is REJECTED with
its first diverging position named."""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as triton

from clients.cli import main as switchyard
from switchyard.models.manifest import file_sha256, read_model_toml
from tests.conftest import IN_CI
from tests.gen_models import LLAMA_TINY_SIZES, build_llama, token_inputs
from tests.trial.stack import ROOT, Stack
from tests.trial.trial_helpers import captured_workload, connections, run_trial
from workflows import codec_server
from workflows.report.render import render
from workflows.temporal_codec import Keyring
from workflows.worker import build_worker

TEMPORAL = Path(sys.executable).with_name("temporal")
# what `models add` makes of LLAMA_TINY_SIZES: two graphs to compile on the xla path
GENERATION = {
    "max_context": 64,
    "max_new_tokens": 40,
    "prompt_buckets": [16],
    "decode_slots": 4,
    "decode_buckets": [4],
}
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def llama(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`llama-tiny` in the repository both executors read, added and validated on the cpu by the
    commands docs/generation.md shows (`switchyard models add|validate`), and a `perturbed`
    version: the same weights plus seeded noise."""
    if (stack.repository / "llama-tiny").exists():
        return "llama-tiny"
    directory = build_llama(tmp_path_factory.mktemp("llama") / "weights")
    for argv in add_and_validate(str(directory), "--repository", str(stack.repository)):
        assert switchyard(argv) == 0, argv
    folder = stack.repository / "llama-tiny"
    assert read_model_toml(folder).generation_table() == GENERATION  # no more graphs to compile
    # `perturbed` is a planted defect, no version a user adds: model.toml's perturb_seed makes
    # the loader add seeded noise to the weights, which the trial must REJECT
    files = "\n".join(f'"{f.name}" = "{file_sha256(f)}"' for f in sorted(directory.iterdir()) if f.is_file())
    (folder / "perturbed").mkdir()
    for f in directory.iterdir():
        if f.is_file():
            (folder / "perturbed" / f.name).write_bytes(f.read_bytes())
    toml = folder / "model.toml"
    toml.write_text(
        toml.read_text()
        + f"\n[versions.perturbed]\nperturb_seed = 1234\n\n[versions.perturbed.files]\n{files}\n"
    )
    return "llama-tiny"


def add_and_validate(folder: str, *repository: str) -> list[list[str]]:
    """The chain's first commands (`switchyard` argv): add the folder as llama-tiny, sized, and
    validate it on the cpu."""
    return [
        ["models", "add", "llama-tiny", folder, *LLAMA_TINY_SIZES, *repository],
        ["models", "validate", "llama-tiny", *repository],
    ]


def start_trial(queue: str, trial_id: str, spec_file: str) -> list[str]:
    """`temporal` argv that starts a trial, as a user types it."""
    return [
        "workflow", "start", "--task-queue", queue, "--type", "TrialWorkflow",
        "--workflow-id", trial_id, "--input-file", spec_file,
    ]  # fmt: skip


def test_the_docs_type_the_commands_these_tests_run() -> None:
    page = (ROOT / "docs" / "generation.md").read_text()
    for argv in add_and_validate("./llama-tiny"):
        assert " ".join(["switchyard", *argv]) in page, argv
    # tests/xla/test_xla_validate_generation.py validates the same on xla
    assert "switchyard models validate llama-tiny --backend xla" in page
    start = start_trial("switchyard-trials", "llama-gen-1", "deploy/local/trials/llama-generation.json")
    assert " ".join(["temporal", *start]) in page, start


def generation_spec(paths: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "llama-tiny"},
        "inputs": {
            "seed": 11,
            "prompts": {
                "count": 4,
                "length": {"distribution": "uniform", "min": 4, "max": 12},
                "max_tokens": 12,
                "low": 1,
                "high": 320,
            },
        },
        "paths": paths,
        "reference": paths[0]["name"],
        "criteria": {"top_k": 5},
        "performance": {
            "warmup": 2,
            "generation": {
                "requests": 8,
                "concurrency": [1, 4],
                "request_rates": [8.0],
                "prompt_len": {"distribution": "uniform", "min": 4, "max": 16},
                "output_len": {"distribution": "normal", "mean": 10, "std": 3},
            },
        },
        # latency is not the subject here (a shared 2-core host); correctness and the metrics are
        "policy": {
            "max_ttft_p99_regression": 100.0,
            "max_tpot_p99_regression": 100.0,
            "min_output_token_cost_saving": -0.99,
            "slo_ttft_ms": 2000,
            "slo_tpot_ms": 500,
        },
        "timeouts": {"heartbeat_s": 30, "activity_s": 900, "max_attempts": 2},
        "team": "test",
    }
    spec.update(extra)
    return spec


def check_metrics(report: dict[str, Any], path: str, levels: int) -> None:
    perf = report["paths"][path]["performance"]
    assert set(perf["definitions"]) >= {"ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "request_goodput"}
    assert "(e2e - ttft) / (output_tokens - 1)" in perf["definitions"]["tpot_ms"]
    assert len(perf["levels"]) == levels, perf
    for level in perf["levels"]:
        assert level["completed"] == 8 and level["failed"] == 0, level
        assert level["load"]["arrival"] in ("concurrency", "poisson")
        for metric in METRICS:
            stats = level[metric]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (metric, stats)
        assert level["ttft_ms"]["p50"] < level["e2el_ms"]["p50"]
        assert level["request_throughput"] > 0 and level["output_throughput"] > 0
        assert level["total_token_throughput"] > level["output_throughput"]
        assert 4 <= level["input_tokens"]["min"] <= level["input_tokens"]["max"] <= 16
        assert level["output_tokens"]["min"] >= 1  # ignore_eos: every request generated
        assert level["goodput"]["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 500.0}
        assert level["goodput"]["request_goodput"] is not None
    assert perf["compilations_after"] == perf["compilations_before"]
    assert perf["output_tokens"] == sum(lv["output_tokens"]["total"] for lv in perf["levels"])
    econ = report["paths"][path]["economics"]
    assert econ["jobs_completed"] >= 8 * levels  # every generation request is a job
    # the ledger counted the tokens the trial's jobs generated, and prices them
    assert econ["output_tokens"] == perf["output_tokens"] and econ["prompt_tokens"] == perf["prompt_tokens"]
    assert econ["cost_per_million_output_tokens_micros"] > 0


def check_perturbed(report: dict[str, Any], path: str) -> None:
    verdict = report["verdicts"][path]
    assert verdict["verdict"] == "REJECT", verdict["line"]
    corr = verdict["criteria"]["correctness"]
    assert corr["result"] == "fail" and "first divergence at position" in corr["figure"], corr
    rule = report["paths"][path]["correctness"]
    assert rule["rule"] == "generation" and not rule["passed"]
    assert rule["first_divergence"] >= 0 and rule["diverged"]
    failed = [s for s in rule["sequences"] if not s["passed"]]
    assert failed, rule["sequences"]
    first = min(failed, key=lambda s: s["first_divergence"])
    assert f"position {first['first_divergence']}" in corr["figure"]
    assert f"position {first['first_divergence']}: reference token" in first["reason"]
    assert verdict["criteria"]["latency"]["result"] == "skipped"


@pytest.mark.alone  # an identical path must pass on latency: the host to itself (tests/conftest.py)
async def test_cpu_generation_trial_applies_the_rule_and_measures(stack: Stack, llama: str) -> None:
    spec = generation_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-again", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-perturbed", "executor": "cpu", "mode": "eager", "version": "perturbed"},
        ]
    )
    report = await run_trial(stack, spec, "gen-cpu")
    assert report["status"] == "completed", report
    for name in ("cpu-eager", "cpu-again"):
        assert not report["paths"][name]["errors"], report["paths"][name]["errors"]
        check_metrics(report, name, 3)
    same = report["verdicts"]["cpu-again"]
    assert same["criteria"]["correctness"]["result"] == "pass", same["line"]
    assert same["criteria"]["correctness"]["figure"].startswith("tokens identical"), same["line"]
    latency = same["criteria"]["latency"]
    assert latency["result"] == "pass" and "p99" in latency["figure"], latency
    # one host: the paths alternate blocks of each level; a level of 8 requests at concurrency 1
    # is 8 blocks with an interval, at concurrency 4 (or Poisson 8/s) too few blocks of its load
    levels = {
        lv["load"].get("concurrency", "poisson"): lv
        for lv in report["paths"]["cpu-again"]["performance"]["levels"]
    }
    assert levels[1]["interleaved"] and len(levels[1]["blocks"]) == 8, levels[1]
    assert levels[4]["blocks"] == [] and levels["poisson"]["blocks"] == []
    assert "measured in alternating blocks" in latency["reason"], latency
    assert "p99 TTFT ratio" in latency["reason"] and "noise floor (reference A/A)" in latency["reason"]
    assert "judged on the two figures" in latency["reason"]  # the levels without blocks say so
    assert "per million output tokens" in same["criteria"]["cost"]["figure"], same["line"]
    assert "cost ratio" in same["criteria"]["cost"]["figure"], same["criteria"]["cost"]
    own = report["paths"]["cpu-eager"]["correctness"]
    assert own["golden"] and own["against_float64"]["passed"], own
    assert own["against_float64"]["metrics"]["logprob_positions"] > 0
    check_perturbed(report, "cpu-perturbed")
    page = render(report, "md")
    for text in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "concurrency 4", "Poisson 8 req/s",
                 "cost per million output tokens", "first divergence", "bench serve"):  # fmt: skip
        assert text in page, text
    html = render(report, "html")
    assert html.startswith("<!DOCTYPE html>") and "TTFT" in html and "first divergence at position" in html


async def _cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(TEMPORAL), *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 1500)
    return int(process.returncode or 0), out.decode(), err.decode()


async def test_xla_generation_trial_from_the_temporal_cli(stack: Stack, llama: str, tmp_path: Path) -> None:
    if not stack.xla:
        if IN_CI:
            pytest.fail("no XLA executor: the XLA environment or backend is missing (make setup-xla)")
        pytest.skip("NOTICE: no XLA executor here (XLA environment or backend missing)")
    spec = generation_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "xla", "executor": "xla", "mode": "lazy"},
            {"name": "xla-perturbed", "executor": "xla", "mode": "lazy", "version": "perturbed"},
        ]
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    queue, trial_id = f"gen-{uuid.uuid4().hex[:8]}", f"gen-xla-{uuid.uuid4().hex[:8]}"
    conns = connections(stack)
    # the stack's client seals payloads (tests/trial/conftest.py): the CLI reads the report
    # through a codec endpoint with the same keys, as an operator's does through `up`'s
    codec = codec_server.serve(Keyring.load(Path(stack.codec_key_file)), "")
    threading.Thread(target=codec.serve_forever, daemon=True).start()
    try:
        async with build_worker(stack.env.client, conns, task_queue=queue):
            address = (
                "--address",
                stack.temporal,
                "--codec-endpoint",
                f"http://127.0.0.1:{codec.server_address[1]}",
            )
            code, out, err = await _cli(*start_trial(queue, trial_id, str(path)), *address)
            assert code == 0, out + err
            code, out, err = await _cli(
                "workflow", "result", *address, "--workflow-id", trial_id, "-o", "json"
            )
            assert code == 0, out[-3000:] + err[-3000:]
    finally:
        await conns.close()
        codec.shutdown()
        codec.server_close()
    result = json.loads(out)
    report = result.get("result", result)
    assert report["status"] == "completed"
    for name in ("cpu-eager", "xla"):
        assert not report["paths"][name]["errors"], report["paths"][name]["errors"]
        check_metrics(report, name, 3)
    xla = report["verdicts"]["xla"]
    assert xla["criteria"]["correctness"]["result"] == "pass", xla["line"]
    rule = report["paths"]["xla"]["correctness"]
    assert rule["rule"] == "generation" and rule["metrics"]["logprob_positions"] > 0
    assert rule["metrics"]["allowed_rmse"] > 0 and "float64" in rule["justification"]
    assert (
        xla["criteria"]["latency"]["result"] in ("pass", "fail")
        and "p99" in xla["criteria"]["latency"]["figure"]
    )
    assert xla["criteria"]["cost"]["result"] in ("pass", "fail"), xla["line"]
    check_perturbed(report, "xla-perturbed")
    print("\n".join(f"{p}: {v['line']}" for p, v in report["verdicts"].items()))


def _greedy(max_tokens: int) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}


def _send_generations(address: str, prompts: list[list[int]], max_tokens: list[int]) -> None:
    """The first request unary (ModelInfer), the others streamed (ModelStreamInfer, a response
    per token), each to its final response."""
    client = triton.InferenceServerClient(address)
    got: queue.Queue[Any] = queue.Queue()
    try:
        client.infer("llama-tiny", token_inputs(prompts[0], False, _greedy(max_tokens[0])))
        client.start_stream(lambda result, error: got.put(error or result))
        for prompt, n in zip(prompts[1:], max_tokens[1:], strict=True):
            client.async_stream_infer("llama-tiny", token_inputs(prompt, True, _greedy(n)))
            responses = 0
            while True:
                item = got.get(timeout=120)
                assert not isinstance(item, Exception), item
                responses += 1
                if item.get_response().parameters["triton_final_response"].bool_param:
                    break
            assert responses >= 2  # streamed: more than the one answer a unary call gets
    finally:
        client.stop_stream()
        client.close()


async def test_lengths_from_a_captured_workload(
    stack: Stack, llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generations captured at the router, one unary and two streamed, replayed as the
    generation scenario: each request's prompt as captured and the output length it had."""
    prompts = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44]]
    max_tokens = [3, 7, 5]

    def send(address: str) -> None:
        _send_generations(address, prompts, max_tokens)

    workload = await captured_workload(stack, llama, "cpu-capture", send, tmp_path, monkeypatch)
    spec = generation_spec(
        [
            {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
            {"name": "cpu-again", "executor": "cpu", "mode": "eager"},
        ]
    )
    spec["performance"] = {
        "warmup": 1,
        "generation": {
            "requests": 6,
            "concurrency": [2],
            "workload": workload["id"],
            "sha256": workload["sha256"],
        },
    }
    report = await run_trial(stack, spec, "gen-workload")
    assert report["status"] == "completed", report
    (level,) = report["paths"]["cpu-again"]["performance"]["levels"]
    assert level["completed"] == 6 and level["load"] == {"arrival": "concurrency", "concurrency": 2}
    # the captured requests, cycled: prompt lengths 3, 9, 5 and output lengths 3, 7, 5, twice
    assert level["input_tokens"] == {"mean": 17 / 3, "min": 3, "max": 9, "total": 34}
    assert level["output_tokens"] == {"mean": 5.0, "min": 3, "max": 7, "total": 30}
    assert report["verdicts"]["cpu-again"]["criteria"]["correctness"]["result"] == "pass"
