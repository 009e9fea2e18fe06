"""How a fault during the measurement is counted and named, without a cluster: the stalls of
one scenario's requests (workflows/tensor/performance.py `_summary`) and the problem that
takes the path's speed out of the verdict (`_fault`). The fault itself, on a real trial, is
tests/trial/test_trial_through_fault.py."""

from __future__ import annotations

import itertools

from workflows.tensor.performance import STALL_MIN_S, _fault, _Sample, _Stream, _summary


async def _never(index: int) -> _Sample:
    raise AssertionError("not sent")


def _stream(latencies_s: list[float], failed: int = 0) -> _Stream:
    stream = _Stream(_never, [], 1, {})
    samples = [_Sample(0, 1, s, 100, True) for s in latencies_s]
    samples += [_Sample(0, 1, 0.5, 0, False) for _ in range(failed)]
    stream.blocks, stream.seconds, stream.measured = [samples], sum(latencies_s), itertools.count()
    return stream


def test_a_request_held_for_seconds_is_a_stall_and_names_the_path() -> None:
    steady = [0.005] * 99
    s = _summary("single-stream", 1, _stream([*steady, 3.02]), {}, 10, False)
    assert s.stalled == 1 and abs(s.longest_stall_ms - 3020) < 1e-6, s
    assert _fault("candidate", [s]) == (
        "path candidate: 1 stalled for up to 3.0 s during measurement (single-stream batch 1); "
        "the timings are not steady state"
    )


def test_slow_but_steady_is_no_stall_and_failures_are_named() -> None:
    slow = _summary("single-stream", 1, _stream([0.3] * 50 + [0.9]), {}, 10, False)
    assert slow.stalled == 0 and _fault("p", [slow]) == ""  # under STALL_MIN_S: only slow
    even = _summary("single-stream", 1, _stream([STALL_MIN_S + 0.5] * 20), {}, 10, False)
    assert even.stalled == 0, even  # every request as slow as the median: a slow model, not a stall
    failing = _summary("offline", 2, _stream([0.01] * 30, failed=2), {}, 10, False)
    assert _fault("p", [slow, failing]).startswith(
        "path p: 2 requests failed during measurement (offline batch 1)"
    ), _fault("p", [failing])
