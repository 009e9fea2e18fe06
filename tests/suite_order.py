"""How `make test` spreads the suite over its pytest-xdist workers (two by default).

- A work unit is a test file, as `--dist loadfile` makes it, but for tests/xla and
  tests/cluster: their package-scoped fixtures (an xla and a cpu executor; a whole
  `switchyard up`) were started again by every worker that got one of their files, and again
  after any other package's file in between (measured at 31 s and 21 s a start), so each
  package is one unit.
- Units run heaviest first (`HEAVY`), so the workers end together rather than one running a
  long unit alone at the end; units holding a test marked `alone` (tests/conftest.py:
  host_share) run last, when the other worker is on short tests or done, so that neither waits
  long for the other's test to end.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

PACKAGES = ("tests/xla/", "tests/cluster/")

# Seconds of pytest per unit with two workers, the heaviest, as `make test PYTEST_ARGS=
# --junitxml=...` measured them (7 December, quiet 2-core host, the run at 619 s); the order
# matters, not the figures. Of the units holding an `alone` test only the cpu generation trial
# is weighed: it then leads them, which measured better than weighing them all (666 s).
HEAVY = {
    "tests/cluster": 145,
    "tests/xla": 142,
    "tests/trial/test_distributed.py": 97,
    "tests/trial/test_generation_trial.py": 73,
    "tests/executor/test_generation.py": 35,
    "tests/trial/test_trial_lifecycle.py": 32,
    "tests/test_packaging.py": 26,
    "tests/router/test_router_faults.py": 26,
    "tests/trial/test_workload_replay.py": 21,
    "tests/trial/test_trial_e2e.py": 19,
}


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((p.rstrip("/") for p in PACKAGES if path.startswith(p)), path)


def order(items: list[pytest.Item]) -> None:
    """Sorts `items` in place by unit as above; a unit's own tests keep their order."""
    first: dict[str, int] = {}
    alone: set[str] = set()
    for i, item in enumerate(items):
        unit = unit_of(item.nodeid)
        first.setdefault(unit, i)
        if item.get_closest_marker("alone") is not None:
            alone.add(unit)

    def key(pair: tuple[int, pytest.Item]) -> tuple[bool, int, int, int]:
        i, item = pair
        unit = unit_of(item.nodeid)
        return unit in alone, -HEAVY.get(unit, 0), first[unit], i

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


class UnitScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """`--dist loadfile` with the units above, in the order the workers collected them."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the collection's order is the schedule's

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)
