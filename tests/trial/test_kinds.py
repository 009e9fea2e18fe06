"""The one place a trial's kind is chosen (workflows/kinds.py): from the spec when the trial
runs, from the report when a stored report is rendered, including reports written before
the report named its kind."""

from __future__ import annotations

import copy
import dataclasses
import json

from tests.trial.test_spec import BASE, GENERATION
from workflows.kinds import kind_of, kind_of_report
from workflows.report.results import Adoption, Result
from workflows.spec.trial_io import Criterion, Verdict
from workflows.spec.trial_spec import parse_spec


def test_the_spec_chooses_the_kind() -> None:
    training = copy.deepcopy(BASE)
    training["training"] = {"steps": 2}
    assert kind_of(parse_spec(BASE)).name == "tensor"
    assert kind_of(parse_spec(GENERATION)).name == "generation"
    assert kind_of(parse_spec(training)).name == "training"


def test_a_report_names_its_kind_and_older_reports_are_told_by_their_inputs() -> None:
    assert kind_of_report({"kind": "generation", "inputs": {}, "configuration": {}}).name == "generation"
    tensor = {"inputs": {"tensors": [], "prompts": None}, "configuration": {"training": None}}
    assert kind_of_report(tensor).name == "tensor"
    assert kind_of_report({**tensor, "kind": ""}).name == "tensor"
    prompts = {"inputs": {"prompts": {"count": 2}}, "configuration": {"training": None}}
    assert kind_of_report(prompts).name == "generation"
    trained = {"inputs": {"prompts": None}, "configuration": {"training": {"steps": 2}}}
    assert kind_of_report(trained).name == "training"


def test_the_result_words_keep_their_stored_strings() -> None:
    assert [r.value for r in Result] == ["pass", "warn", "fail", "inconclusive", "skipped"]
    assert [a.value for a in Adoption] == ["ADOPT", "REJECT", "INCONCLUSIVE"]
    assert Result("inconclusive") is Result.INCONCLUSIVE and f"{Result.FAIL}" == "fail"


def test_a_verdict_serialises_to_the_strings_reports_always_had() -> None:
    verdict = Verdict.of(
        {"correctness": Criterion(Result.PASS, "ok"), "cost": Criterion(Result.INCONCLUSIVE, "unpriced")}
    )
    stored = json.loads(json.dumps(dataclasses.asdict(verdict)))
    assert stored["verdict"] == "INCONCLUSIVE" and stored["criteria"]["cost"]["result"] == "inconclusive"
    assert stored["line"] == "INCONCLUSIVE: correctness pass; cost inconclusive"
    assert (
        Verdict.of({"x": Criterion(Result.WARN, ""), "y": Criterion(Result.FAIL, "")}).verdict
        == Adoption.REJECT
    )
