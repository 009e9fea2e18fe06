"""The trial spec: the shipped examples parse, and every bad field is named in the error."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.trial.trial_helpers import minimal_spec
from workflows.spec.trial_spec import SpecError, parse_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "local" / "trials").glob("*.json"))

BASE = minimal_spec({"cpu-eager": "eager", "cpu-compile": "compile"}, seed=7, shape=(2, 8))


def test_examples_parse() -> None:
    assert EXAMPLES, "deploy/local/trials/*.json should hold example specs"
    for example in EXAMPLES:
        spec = parse_spec(json.loads(example.read_text()))
        assert spec.reference in {p.name for p in spec.paths}


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = parse_spec(BASE)
    assert spec.performance.scenarios == ("single-stream", "offline")
    assert spec.paths[1].precision == "fp32"
    assert spec.training is None and spec.candidates[0].name == "cpu-compile"


def _with(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    node: Any = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("change", "value", "field", "words"),
    [
        ("paths.1.precision", "fp8", "paths[1].precision", "not one of fp32"),
        ("paths.1.mode", 3, "paths[1].mode", "must be a string"),
        ("reference", "gpu", "reference", "not one of the paths"),
        ("performance.warmpu", 3, "performance.warmpu", "not a known field"),
        ("performance.min_iterations", 0, "performance.min_iterations", ">= 1"),
        ("performance.scenarios", ["burst"], "performance.scenarios[0]", "single-stream, offline"),
        ("inputs.seed", "x", "inputs.seed", "integer"),
        ("inputs.tensors.0.shape", [], "inputs.tensors[0].shape", "batch dimension"),
        ("inputs.tensors.0.high", 0, "inputs.tensors[0].high", "greater than low"),
        ("model.checkpoint_sha256", "abc", "model.checkpoint_sha256", "sha256"),
        ("model", _DELETE, "model.name", "required"),
        ("policy.min_cost_saving", 2, "policy.min_cost_saving", "between -1 and 1"),
        ("policy.max_fallback_ops", -1, "policy.max_fallback_ops", ">= 0"),
        ("policy.max_graph_breaks", 1.5, "policy.max_graph_breaks", "integer"),
        ("policy.compatibility_action", "ignore", "policy.compatibility_action", "not one of reject, warn"),
        ("training", {"steps": 0}, "training.steps", ">= 1"),
        ("timeouts.heartbeat_s", 1000, "timeouts.heartbeat_s", "shorter than activity_s"),
        ("criteria.min_cosine", 1.5, "criteria.min_cosine", "between 0 and 1"),
        ("policy.confidence", 1.0, "policy.confidence", "at least 0.5 and below 1, got 1"),
        ("policy.confidence", 0.3, "policy.confidence", "at least 0.5 and below 1, got 0.3"),
        ("policy.confidence", "95%", "policy.confidence", "finite number"),
        ("policy.max_latency_drift", -0.1, "policy.max_latency_drift", ">= 0, got -0.1"),
        ("policy.max_memory_growth_mib", -1, "policy.max_memory_growth_mib", ">= 0, got -1"),
        ("policy.max_memory_growth_mib", "1 MiB", "policy.max_memory_growth_mib", "finite number"),
        ("performance.blocks", 3, "performance.blocks", ">= 4, got 3"),
    ],
)
def test_bad_fields_are_named(change: str, value: Any, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_with(change, value))
    assert err.value.field == field
    assert words in str(err.value)


def test_duplicate_path_names_and_single_path() -> None:
    data = copy.deepcopy(BASE)
    data["paths"][1]["name"] = "cpu-eager"
    with pytest.raises(SpecError, match=r"paths\[1\]\.name"):
        parse_spec(data)
    data["paths"] = data["paths"][:1]
    with pytest.raises(SpecError, match="needs a reference and at least one candidate"):
        parse_spec(data)


def test_not_an_object() -> None:
    with pytest.raises(SpecError, match="must be a JSON object"):
        parse_spec([1, 2])


def test_documented_start_workflow_json_is_a_valid_spec() -> None:
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trial-spec.md").read_text()
    block = re.search(r"## Starting a trial from the Temporal UI.*?```json\n(.*?)\n```", doc, re.S)
    assert block is not None
    spec = parse_spec(json.loads(block.group(1)))
    assert [p.name for p in spec.paths] == ["cpu-eager", "cpu-compile", "xla"]


def test_compatibility_policy_defaults_and_settings() -> None:
    default = parse_spec(copy.deepcopy(BASE)).policy
    assert (default.max_fallback_ops, default.max_graph_breaks, default.compatibility_action) == (
        0,
        0,
        "reject",
    )
    data = copy.deepcopy(BASE)
    data["policy"] = {"max_fallback_ops": 2, "max_graph_breaks": 1, "compatibility_action": "warn"}
    policy = parse_spec(data).policy
    assert (policy.max_fallback_ops, policy.max_graph_breaks, policy.compatibility_action) == (2, 1, "warn")


GENERATION: dict[str, Any] = {
    "model": {"name": "llama-tiny"},
    "inputs": {"seed": 3, "prompts": {"count": 2, "max_tokens": 8, "high": 320}},
    "paths": [
        {"name": "cpu-eager", "executor": "cpu", "mode": "eager"},
        {"name": "xla", "executor": "xla", "mode": "lazy"},
    ],
    "reference": "cpu-eager",
    "performance": {"scenarios": ["generation"]},
}


def test_generation_spec_defaults() -> None:
    spec = parse_spec(GENERATION)
    assert spec.generative and spec.performance.scenarios == ("generation",)
    gen = spec.performance.generation
    assert gen is not None and gen.concurrency == (1, 4) and gen.seed == 3
    assert gen.prompt_len.distribution == "uniform" and gen.output_len.value == 16
    prompts = spec.inputs.prompts
    assert prompts is not None and prompts.count == 2 and prompts.length.value == 8
    assert spec.policy.max_ttft_p99_regression == 0.1 and spec.policy.slo_ttft_ms == 0.0
    rates = copy.deepcopy(GENERATION)
    normal = {"distribution": "normal", "mean": 8, "std": 2}
    rates["performance"] = {"generation": {"request_rates": [2.5], "output_len": normal}}
    gen = parse_spec(rates).performance.generation
    assert gen is not None and gen.request_rates == (2.5,) and gen.concurrency == ()
    assert gen.output_len.mean == 8.0


@pytest.mark.parametrize(
    ("change", "value", "field", "words"),
    [
        ("performance.scenarios", ["generation", "offline"], "performance.scenarios", "measured alone"),
        ("performance.generation", {"request_rates": [0]}, "performance.generation.request_rates[0]", "rate"),
        ("performance.generation", {"concurrency": []}, "performance.generation.concurrency", "request rate"),
        (
            "performance.generation",
            {"prompt_len": {"distribution": "zipf"}},
            "performance.generation.prompt_len.distribution",
            "fixed, uniform, normal",
        ),
        (
            "performance.generation",
            {"prompt_len": {"distribution": "uniform", "min": 9, "max": 3}},
            "performance.generation.prompt_len.max",
            ">= min",
        ),
        ("performance.generation", {"workload": "w.1"}, "performance.generation.sha256", "sha256"),
        ("inputs.prompts", {"count": 2}, "inputs.prompts.high", "required"),
        ("inputs.prompts", {"texts": ["hi", ""]}, "inputs.prompts.texts", "empty prompt"),
        ("inputs.prompts", {"high": 5, "maxtokens": 3}, "inputs.prompts.maxtokens", "not a known field"),
        ("performance.scenarios", ["offline"], "performance.scenarios", "generation scenario"),
        (
            "policy.min_output_token_cost_saving",
            1.5,
            "policy.min_output_token_cost_saving",
            "between -1 and 1",
        ),
        ("training", {"steps": 2}, "training", "no training phase"),
    ],
)
def test_bad_generation_fields_are_named(change: str, value: Any, field: str, words: str) -> None:
    data = copy.deepcopy(GENERATION)
    node: Any = data
    keys = change.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert err.value.field == field, err.value
    assert words in str(err.value)


def test_prompts_need_the_generation_scenario() -> None:
    data = copy.deepcopy(BASE)
    data["inputs"] = {"seed": 1, "prompts": {"high": 9}}
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert err.value.field == "performance.scenarios"


def test_an_old_spec_gets_the_interval_defaults_and_new_fields_parse() -> None:
    old = parse_spec(_with("policy.max_p95_regression", 0.2))
    assert old.policy.confidence == 0.95 and old.performance.blocks == 10
    new = parse_spec(_with("policy.confidence", 0.9))
    assert new.policy.confidence == 0.9
    assert parse_spec(_with("performance.blocks", 20)).performance.blocks == 20
    assert old.policy.max_memory_growth_mib == 1.0
    assert parse_spec(_with("policy.max_memory_growth_mib", 4)).policy.max_memory_growth_mib == 4.0
