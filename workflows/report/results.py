"""The words of a trial's judgement, defined once: a criterion's result and a path's verdict.

Both are `StrEnum`s, so a report's JSON, the Temporal payloads and stored reports hold the same
plain strings as before ("pass", "ADOPT"), and a stored report read back compares equal to the
members. Imports nothing: the spec, the interval rules and every kind's verdict use it.
"""

from __future__ import annotations

from enum import StrEnum


class Result(StrEnum):
    """One criterion's result."""

    PASS = "pass"
    WARN = "warn"  # noted, the verdict stays as it is
    FAIL = "fail"  # the path is rejected
    INCONCLUSIVE = "inconclusive"  # could not be judged: the reason says what would settle it
    SKIPPED = "skipped"  # not judged, by rule (e.g. no speed verdict without correctness)


class Adoption(StrEnum):
    """A candidate path's verdict."""

    ADOPT = "ADOPT"
    REJECT = "REJECT"
    INCONCLUSIVE = "INCONCLUSIVE"


# the short names the criteria are written with
PASS, WARN, FAIL, UNKNOWN, SKIPPED = Result


def adoption(results: list[Result]) -> Adoption:
    """Any failed criterion rejects; otherwise any undecided one leaves the path inconclusive."""
    if FAIL in results:
        return Adoption.REJECT
    if UNKNOWN in results:
        return Adoption.INCONCLUSIVE
    return Adoption.ADOPT


def overall(verdicts: dict[str, str]) -> Adoption:
    """One keyword for the UI filter: ADOPT if some path may be adopted, else the weakest."""
    values = set(verdicts.values())
    for v in (Adoption.ADOPT, Adoption.INCONCLUSIVE, Adoption.REJECT):
        if v in values:
            return v
    return Adoption.INCONCLUSIVE
