"""The planted-defect suite: a trial of cpu-eager against xla must name each defect.

One trial on the shared stack (real Temporal dev server, executors, evaluator, ledger): the
reference path runs the honest model on cpu-eager, and each candidate path runs one planted
version (tests/trial/planted.py) on the xla executor, where alone its defect applies. Every
candidate must get its verdict with the named reason, and the honest control is never
REJECTED on correctness or compatibility.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clients.model_admin import add_model
from tests.conftest import IN_CI
from tests.trial import planted
from tests.trial.stack import Stack
from tests.trial.trial_helpers import run_trial
from workflows.report.render import render

MODEL = "planted"


def _register(stack: Stack, work: Path) -> None:
    """Each defect as a version of one factory-format entry in the executors' repository."""
    for defect in planted.DEFECTS:
        source = planted.write_version(work / defect, defect)
        add_model(stack.repository, MODEL, source, version=defect, allowed_factories=("tests",))


def _spec() -> dict[str, Any]:
    return {
        "model": {"name": MODEL, "version": "honest"},
        "inputs": {"seed": 7, "tensors": [{"name": "x", "datatype": "FP32", "shape": [1, planted.FEATURES]}]},
        "paths": [{"name": "cpu-eager", "executor": "cpu", "mode": "eager"}]
        + [{"name": d, "executor": "xla", "mode": "lazy", "version": d} for d in planted.DEFECTS],
        "reference": "cpu-eager",
        "performance": {
            "warmup": 1,
            "min_iterations": 8,
            "min_seconds": 0.0,
            "scenarios": ["single-stream"],
            "batch_sizes": [1],
        },
        # PJRT on the host CPU pays a per-call overhead that cpu eager does not (the honest
        # path measured +2335% on a busy 2-core host): the allowance is wide, and the sleep
        # (p95 at least SLEEP_S, +19482% there) still fails it unless cpu-eager's p95 > 27 ms
        "policy": {"max_p95_regression": 10.0},
        "timeouts": {"heartbeat_s": 10, "activity_s": 300, "max_attempts": 2},
        "team": "test",
    }


def _criteria(report: dict[str, Any], path: str) -> dict[str, dict[str, str]]:
    criteria: dict[str, dict[str, str]] = report["verdicts"][path]["criteria"]
    return criteria


def _assert_bias(report: dict[str, Any], lines: str) -> None:
    """A constant bias: wrong, but the same every run."""
    verdicts = report["verdicts"]
    bias = _criteria(report, "bias")
    assert verdicts["bias"]["verdict"] == "REJECT", lines
    assert bias["correctness"]["result"] == "fail"
    assert bias["correctness"]["reason"].startswith("wrong but stable: y: "), bias["correctness"]
    assert bias["correctness"]["figure"].startswith("wrong but stable: rmse ")
    assert bias["compatibility"]["result"] == "pass" and bias["latency"]["result"] == "skipped"


def _assert_noise(report: dict[str, Any], lines: str) -> None:
    """Fresh noise per call: named non-deterministic, with the repeat error."""
    verdicts = report["verdicts"]
    noise = _criteria(report, "noise")
    assert verdicts["noise"]["verdict"] == "REJECT", lines
    assert noise["correctness"]["reason"].startswith("non-deterministic: "), noise["correctness"]
    noise_out = report["paths"]["noise"]["correctness"]["outputs"][0]
    repeat = noise_out["metrics"]["candidate_repeat_max_abs"]
    assert repeat > planted.NOISE_STD and noise_out["finding"] == "non-deterministic"
    assert noise["correctness"]["figure"] == f"non-deterministic: repeats differ by up to {repeat:.3g}"
    assert noise["compatibility"]["result"] == "pass"


def _assert_median(report: dict[str, Any], lines: str) -> None:
    """An op with no XLA lowering: correct, but REJECTED on compatibility, the op named per request."""
    verdicts = report["verdicts"]
    median = _criteria(report, "median")
    assert verdicts["median"]["verdict"] == "REJECT", lines
    assert median["correctness"]["result"] == "pass", median["correctness"]
    assert median["compatibility"]["result"] == "fail"
    assert "aten::median.dim_values 1 call per request" in median["compatibility"]["reason"]
    assert "aten::median.dim_values 1/request" in median["compatibility"]["figure"]
    # decided on the p95 ratio's interval: 8 requests per path may leave it undecided
    assert median["latency"]["result"] in ("pass", "fail", "inconclusive")
    # a regression that coincides with the fallback says so (on a busy host the reference's
    # few timings can be the slower ones: then there is no regression to explain)
    p95 = {p: report["paths"][p]["performance"]["scenarios"][0]["p95_ms"] for p in ("cpu-eager", "median")}
    named = "coincides with host fallback: aten::median.dim_values 1 call per request"
    assert (named in median["latency"]["reason"]) == (p95["median"] > p95["cpu-eager"]), median["latency"]


def _assert_shapes(report: dict[str, Any], lines: str) -> None:
    """Data-dependent shapes: correct values, but XLA recompiles on the trial's own inputs."""
    verdicts = report["verdicts"]
    shapes = _criteria(report, "shapes")
    assert verdicts["shapes"]["verdict"] == "REJECT", lines
    assert shapes["correctness"]["result"] == "pass", shapes["correctness"]
    assert "aten::nonzero" in shapes["compatibility"]["reason"]
    assert (
        "on the trial's inputs after warm-up (a shape that depends on the data"
        in (shapes["compatibility"]["reason"])
    )
    assert report["paths"]["shapes"]["compatibility"]["compilations_on_inputs"] >= 1
    assert shapes["latency"]["result"] == "inconclusive"
    assert "recompile(s) while measuring" in shapes["latency"]["reason"]


def _assert_sleep(report: dict[str, Any], lines: str) -> None:
    """A sleep: correct and compatible, REJECTED on latency, with no fallback to blame."""
    verdicts = report["verdicts"]
    sleep = _criteria(report, "sleep")
    assert verdicts["sleep"]["verdict"] == "REJECT", lines
    assert sleep["correctness"]["result"] == "pass" and sleep["compatibility"]["result"] == "pass"
    assert sleep["latency"]["result"] == "fail" and "fallback" not in sleep["latency"]["reason"]
    p95 = report["paths"]["sleep"]["performance"]["scenarios"][0]["p95_ms"]
    assert p95 >= planted.SLEEP_S * 1000


async def test_planted_defects_get_their_verdicts_and_named_reasons(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if not stack.xla:
        if IN_CI:
            pytest.fail("no XLA executor: the XLA environment or backend is missing (make setup-xla)")
        pytest.skip("NOTICE: no XLA executor here (XLA environment or backend missing)")
    _register(stack, tmp_path_factory.mktemp("planted"))
    report = await run_trial(stack, _spec(), "planted")
    assert report["status"] == "completed"
    verdicts = report["verdicts"]
    lines = "\n".join(f"{p}: {v['line']}" for p, v in verdicts.items())
    for path, v in verdicts.items():
        # Temporal's JSON converter sorts keys: the line keeps the criteria in order
        assert set(v["criteria"]) == {"correctness", "compatibility", "latency", "memory", "cost"}, path
        assert v["line"].startswith(f"{v['verdict']}: correctness "), v["line"]

    # the honest control: never REJECTED on correctness or compatibility
    honest = _criteria(report, "honest")
    assert honest["correctness"]["result"] == "pass", lines
    assert honest["compatibility"]["result"] == "pass", lines
    assert honest["compatibility"]["figure"] == "0 host-fallback ops, 0 graph breaks"

    _assert_bias(report, lines)
    _assert_noise(report, lines)
    _assert_median(report, lines)
    _assert_shapes(report, lines)
    _assert_sleep(report, lines)

    # the report: four criteria per verdict, the compatibility rows linked to their details
    page = render(report, "html")
    for path in planted.DEFECTS:
        assert f"<a href='#compatibility-{path}'>details</a>" in page
        assert f"<h3 id='compatibility-{path}'>" in page
        assert verdicts[path]["line"].split(":")[0] in page
    assert "aten::median.dim_values" in page.split("<h3 id='compatibility-median'>")[1].split("</table>")[0]
    markdown = render(report, "md")
    assert "[details](#compatibility-median)" in markdown and "### Compatibility: median" in markdown
