"""The stopping rule of a measurement that extends itself (workflows/tensor/extension.py), on
simulated latencies: seeded draws stand in for the executor, the rule and its intervals are
the real ones. The trial that runs it on a real stack is tests/trial/test_extension_trial.py."""

from __future__ import annotations

import dataclasses
import random

import pytest

from workflows.pipeline.types import Extension, ExtensionRule, ScenarioResult
from workflows.report.results import FAIL
from workflows.spec.fields import SpecError
from workflows.spec.trial_spec import parse_spec
from workflows.tensor import extension
from workflows.tensor.extension import MAX_ROUNDS, Round, next_round
from workflows.tensor.intervals import thin

Blocks = dict[str, list[list[float]]]


class Simulated:
    """Two paths measured in paired blocks: each latency is base_ms x the path's factor x a
    lognormal noise (sigma), drawn from one seeded generator in measured order."""

    def __init__(self, factor: float, sigma: float, blocks: int, size: int, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.factor, self.sigma = factor, sigma
        self.blocks: Blocks = {"ref": [], "cand": []}
        self.rounds: list[Round] = []
        self._add(blocks, size)

    def _add(self, slots: int, size: int) -> None:
        for _ in range(slots):
            for name, factor in (("ref", 1.0), ("cand", self.factor)):
                self.blocks[name].append(
                    [10.0 * factor * self.rng.lognormvariate(0.0, self.sigma) for _ in range(size)]
                )

    async def measure(self, step: Round) -> None:
        self.rounds.append(step)
        self._add(step.slots, step.size)

    async def extend(self, budget: int, allowed: float = 0.1, level: float = 0.95) -> Extension:
        rule = ExtensionRule("ref", budget, allowed, level)
        return await extension.extend(rule, lambda: self.blocks, self.measure, keep=200)


def _requests(blocks: list[list[float]]) -> int:
    return sum(len(b) for b in blocks)


@pytest.mark.parametrize(
    ("need", "remaining", "size", "rounds_left", "expected"),
    [
        (12, 100, 5, 3, Round(8, 5)),  # a third of the budget left beats the estimate: 34 -> 40
        (70, 100, 5, 3, Round(14, 5)),  # the estimate, rounded up to whole pairs
        (500, 100, 5, 3, Round(20, 5)),  # capped by the budget
        (10, 100, 5, 1, Round(20, 5)),  # the last round takes what is left
        (5, 7, 5, 2, Round(2, 3)),  # blocks shrink to fit one pair in what is left
        (5, 1, 5, 3, None),  # less than one pair of requests left
        (5, 50, 5, 0, None),  # no round left
    ],
)
def test_a_round_is_an_even_number_of_blocks_within_the_budget(
    need: int, remaining: int, size: int, rounds_left: int, expected: Round | None
) -> None:
    step = next_round(need, remaining, size, rounds_left)
    assert step == expected
    if step is not None:
        assert step.slots % 2 == 0 and step.requests <= remaining


async def test_a_decided_interval_is_not_extended() -> None:
    sim = Simulated(factor=2.0, sigma=0.05, blocks=10, size=5)
    record = await sim.extend(budget=100)
    assert sim.rounds == [] and record.extra_requests == 0 and record.stopped == "decided"
    assert record.before == {} and record.text.startswith("not extended: every latency interval was decided")


async def test_a_straddling_interval_is_extended_until_it_is_decided() -> None:
    """1.3x slower with noise so wide that 10 blocks of 5 cannot tell it from +10%: the rule
    measures more paired blocks, and the interval ends beyond the bound within the budget."""
    sim = Simulated(factor=1.3, sigma=0.4, blocks=10, size=5)
    record = await sim.extend(budget=1000)
    assert "cand" in record.before  # the interval at the planned blocks straddled 1.1
    assert record.stopped == "decided", record.text
    assert 0 < record.extra_requests < 1000 and 1 <= record.rounds <= MAX_ROUNDS
    assert record.extra_blocks == sum(r.slots for r in sim.rounds) == len(sim.blocks["cand"]) - 10
    assert _requests(sim.blocks["cand"]) == 50 + record.extra_requests == _requests(sim.blocks["ref"])
    assert record.level == extension.extended_level(0.95) == 0.9875  # looks after the plan: stricter
    final = extension.look(ExtensionRule("ref", 1000, 0.1, 0.95), sim.blocks, 200, record.level)
    assert final.decisions["cand"].result == FAIL and final.intervals["cand"].low > 1.1
    assert record.text.startswith(f"measurement extended: interval decided after +{record.extra_requests} ")


async def test_an_identical_path_against_a_zero_allowance_spends_the_budget() -> None:
    """The ratio is 1.0 and so is the bound: no count of requests moves the interval off it
    (at 99.9%), so the budget is spent, in at most MAX_ROUNDS rounds, and the report says so."""
    sim = Simulated(factor=1.0, sigma=0.3, blocks=10, size=5)
    record = await sim.extend(budget=120, allowed=0.0, level=0.999)
    assert record.stopped == "budget" and "cand" in record.before
    assert 120 - 2 * 5 < record.extra_requests <= 120 and len(sim.rounds) == record.rounds <= MAX_ROUNDS
    assert all(r.slots % 2 == 0 and r.size == 5 for r in sim.rounds)
    assert record.text.startswith("measurement extended: budget of 120 extra requests spent")


async def test_a_ratio_on_the_bound_stops_at_once() -> None:
    """The same values in other blocks: the pooled p95s are equal, the ratio is exactly 1.0
    (the bound with no allowance) but its interval is not, and no count of requests settles it."""
    ref = [[float(10 * b + i) for i in range(5)] for b in range(10)]
    values = [v for block in ref for v in block]
    random.Random(3).shuffle(values)
    cand = [values[i : i + 5] for i in range(0, 50, 5)]
    called: list[Round] = []

    async def measure(step: Round) -> None:
        called.append(step)

    rule = ExtensionRule("ref", 100, 0.0, 0.95)
    record = await extension.extend(rule, lambda: {"ref": ref, "cand": cand}, measure, keep=200)
    assert record.stopped == "on the bound" and called == [] and "cand" in record.before


async def test_too_few_blocks_give_no_interval_and_no_extension() -> None:
    sim = Simulated(factor=1.0, sigma=0.3, blocks=3, size=5)
    record = await sim.extend(budget=100)
    assert record.stopped == "no interval" and sim.rounds == []
    assert "at least 4" in record.text


async def test_the_rule_judges_thinned_blocks_as_the_verdict_does() -> None:
    """Blocks of 1,000 requests are kept as 200 order statistics in the report; the rule looks
    at what the verdict will see, and counts the requests that were measured."""
    sim = Simulated(factor=1.0, sigma=0.2, blocks=8, size=1000)
    rule = ExtensionRule("ref", 100, 0.1, 0.95)
    seen = extension.look(rule, sim.blocks, 200, 0.95).intervals["cand"]
    thinned = {k: [thin(b, 200) for b in v] for k, v in sim.blocks.items()}
    again = extension.look(rule, thinned, 200, 0.95).intervals["cand"]
    assert (seen.ratio, seen.low, seen.high) == (again.ratio, again.low, again.high)
    assert seen.samples == 8000 and again.samples == 1600


def test_the_verdict_judges_an_extended_measurement_at_the_stricter_level() -> None:
    extended = Extension(budget=100, extra_requests=40, rounds=1, level=0.9875, stopped="decided")
    assert extension.verdict_level(extended, 0.95) == 0.9875
    assert extension.verdict_level(dataclasses.replace(extended, rounds=0, extra_requests=0), 0.95) == 0.95
    assert extension.verdict_level(None, 0.9) == 0.9
    assert extension.extended_level(0.999) == 1 - 0.001 / (2 * MAX_ROUNDS)


def test_a_scenario_with_its_extension_survives_a_retried_attempt() -> None:
    record = Extension(100, 40, 8, 2, 0.9875, "decided", {"cand": "1.02 [0.9, 1.2] at 95%"}, "extended")
    scenario = ScenarioResult("single-stream", 1, 1, 90, 1.0, 1, 2, 3, 4, 2, 1, 90.0, "samples/s", {}, [], [])
    scenario.extension = record
    back = extension.restored(dataclasses.asdict(scenario))
    assert back == scenario and isinstance(back.extension, Extension)
    plain = dataclasses.replace(scenario, extension=None)
    assert extension.restored(dataclasses.asdict(plain)).extension is None


def _spec(**performance: object) -> dict[str, object]:
    return {
        "model": {"name": "mlp"},
        "inputs": {"seed": 1, "tensors": [{"name": "x", "datatype": "FP32", "shape": [1, 64]}]},
        "paths": [{"name": n, "executor": "cpu", "mode": "eager"} for n in ("ref", "same")],
        "reference": "ref",
        "performance": performance,
    }


def test_the_budget_is_a_performance_field() -> None:
    assert parse_spec(_spec()).performance.max_extra_requests == 100
    assert parse_spec(_spec(max_extra_requests=0)).performance.max_extra_requests == 0
    for bad, why in ((-1, "must be >= 0"), (100_001, "at most 100000"), (1.5, "integer")):
        with pytest.raises(SpecError, match=why) as err:
            parse_spec(_spec(max_extra_requests=bad))
        assert "performance.max_extra_requests" in str(err.value)
