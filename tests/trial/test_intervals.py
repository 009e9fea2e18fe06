"""The interval method on seeded synthetic latencies: a 2x slower candidate is rejected with an
interval that excludes the bound, 1.05x is never rejected, A/A intervals cover 1.0 in at least
90% of seeded repetitions, and an undecided interval names the requests that would settle it."""

from __future__ import annotations

import random

import pytest

from workflows.report.results import FAIL, PASS, UNKNOWN
from workflows.tensor.intervals import (
    decide,
    more_requests,
    noise_floor,
    percentile,
    ratio_interval,
    split_blocks,
)


def latencies(seed: int, n: int, scale: float = 1.0, drift: float = 0.0) -> list[float]:
    """Lognormal request latencies in ms around 2 ms, with a multiplicative drift over the run."""
    rng = random.Random(seed)
    return [scale * 2.0 * rng.lognormvariate(0.0, 0.25) * (1 + drift * i / n) for i in range(n)]


def blocks(
    seed: int, n: int = 400, count: int = 20, scale: float = 1.0, drift: float = 0.0
) -> list[list[float]]:
    return split_blocks(latencies(seed, n, scale, drift), count)


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_split_blocks_keeps_every_sample_in_order() -> None:
    values = [float(i) for i in range(23)]
    parts = split_blocks(values, 5)
    assert [len(p) for p in parts] == [5, 5, 5, 4, 4]
    assert [v for p in parts for v in p] == values
    assert len(split_blocks(values[:3], 10)) == 3


def test_twice_as_slow_is_rejected_with_the_bound_outside_the_interval() -> None:
    for seed in range(10):
        iv = ratio_interval(blocks(1000 + seed, scale=2.0), blocks(seed), seed=seed)
        assert iv.low > 1.1, iv
        assert iv.low <= iv.ratio <= iv.high
        d = decide(iv, 0.1)
        assert d.result == FAIL, d
        assert "beyond the allowed 1.1" in d.reason


def test_five_percent_slower_is_never_rejected() -> None:
    results = set()
    for seed in range(30):
        iv = ratio_interval(blocks(2000 + seed, scale=1.05), blocks(seed), seed=seed)
        results.add(decide(iv, 0.1).result)
    assert FAIL not in results
    assert results <= {PASS, UNKNOWN}


def test_a_and_a_intervals_cover_one_in_at_least_90_percent() -> None:
    covered = 0
    repetitions = 60
    for seed in range(repetitions):
        iv = ratio_interval(blocks(3000 + seed), blocks(seed), seed=seed)
        covered += iv.low <= 1.0 <= iv.high
        assert decide(iv, 0.1).result != FAIL
    assert covered >= 0.9 * repetitions, covered


def test_a_and_a_noise_floor_covers_one_and_stays_narrow() -> None:
    covered = 0
    for seed in range(40):
        floor = noise_floor(blocks(seed, n=800, count=20), seed=seed)
        covered += floor.low <= 1.0 <= floor.high
        assert floor.blocks == 10
        assert floor.high - floor.low < 0.5
    assert covered >= 36


def test_the_same_seed_gives_the_same_interval() -> None:
    a = ratio_interval(blocks(1, scale=1.2), blocks(2), seed=7)
    b = ratio_interval(blocks(1, scale=1.2), blocks(2), seed=7)
    c = ratio_interval(blocks(1, scale=1.2), blocks(2), seed=8)
    assert a == b
    assert (a.low, a.high) != (c.low, c.high)


def test_an_undecided_interval_names_the_requests_that_would_settle_it() -> None:
    iv = ratio_interval(blocks(5, n=60, count=6, scale=1.15), blocks(6, n=60, count=6), seed=1)
    d = decide(iv, 0.1)
    if d.result != UNKNOWN:  # the seeds below are chosen so it straddles; fail loudly if not
        pytest.fail(f"expected a straddling interval, got {iv}")
    assert d.more_requests > 0
    assert f"run at least {d.more_requests:,} more requests" in d.reason
    assert d.reason.startswith(f"p95 ratio {iv.ratio:.3f} [{iv.low:.3f}, {iv.high:.3f}]")
    # with the suggested count more, the same noise gives an interval off the bound
    n = iv.samples + d.more_requests
    wider = ratio_interval(blocks(5, n=n, count=20, scale=1.15), blocks(6, n=n, count=20), seed=1)
    assert decide(wider, 0.1).result != UNKNOWN or wider.high - wider.low < iv.high - iv.low


def test_more_requests_follows_the_square_root_law() -> None:
    from workflows.tensor.intervals import RatioInterval

    iv = RatioInterval(1.08, 0.91, 1.27, 0.95, 10, 100)
    # half-width above the ratio 0.19, distance to 1.1 is 0.02: n must grow by (0.19/0.02)^2
    assert more_requests(iv, 1.1) == round(100 * ((0.19 / 0.02) ** 2 - 1))
    on_bound = RatioInterval(1.1, 1.0, 1.2, 0.95, 10, 100)
    assert more_requests(on_bound, 1.1) == -1
    assert "more requests will not settle it" in decide(on_bound, 0.1).reason


def test_too_few_blocks_or_a_bad_level_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        ratio_interval(blocks(1, count=3), blocks(2, count=3))
    with pytest.raises(ValueError, match="level"):
        ratio_interval(blocks(1), blocks(2), level=1.0)


def test_slow_first_calls_are_named_as_drift_and_steady_ones_are_not() -> None:
    from workflows.tensor.intervals import drift

    steady = [drift(blocks(seed, n=300), 0.25, seed=seed) for seed in range(20)]
    assert not any(d.beyond for d in steady), [d.text() for d in steady if d.beyond]
    warming = latencies(7, 300)
    warming[:100] = [v * 3 for v in warming[:100]]  # the first hundred calls three times slower
    found = drift(split_blocks(warming, 10), 0.25)
    assert found.beyond and found.interval.high < 0.8, found.text()
    slowing = drift(blocks(8, n=300, drift=1.0), 0.25)  # twice as slow by the end
    assert slowing.beyond and slowing.interval.low > 1.25, slowing.text()
    with pytest.raises(ValueError, match="at least 12"):
        drift(blocks(9, n=11, count=5), 0.25)


def test_a_host_that_slows_both_paths_is_not_a_warm_up_too_short() -> None:
    """Measured in alternating blocks, a host that gets twice as slow during the measurement
    drifts both paths alike: each path's own drift is beyond the bound, the ratio's is not.
    A candidate whose own first calls are slow moves the ratio, and is named."""
    from workflows.tensor.intervals import drift, paired_drift

    for seed in range(10):
        cand, ref = blocks(100 + seed, n=300, drift=2.0), blocks(seed, n=300, drift=2.0)
        assert drift(cand, 0.25).interval.ratio > 1.25 and drift(ref, 0.25).interval.ratio > 1.25
        host = paired_drift(cand, ref, 0.25, seed=seed)
        assert not host.beyond, host.text()  # within [0.8, 1.25]: the host moved both alike
    warming = latencies(7, 300)
    warming[:100] = [v * 3 for v in warming[:100]]
    cold = paired_drift(split_blocks(warming, 10), blocks(8, n=300), 0.25)
    assert cold.beyond and cold.interval.high < 0.8 and "ratio to the reference" in cold.text(), cold.text()
    with pytest.raises(ValueError, match="at least 12"):
        paired_drift(blocks(9, n=11, count=5), blocks(9, n=300), 0.25)


def test_a_thinned_block_keeps_its_percentiles() -> None:
    from workflows.tensor.intervals import thin

    values = latencies(11, 5000)
    kept = thin(values, 200)
    assert len(kept) == 200 and thin(values[:50], 200) == values[:50]
    assert abs(percentile(kept, 95) / percentile(values, 95) - 1) < 0.02
    assert abs(percentile(kept, 50) / percentile(values, 50) - 1) < 0.02
