"""How `make test` spreads the suite over its pytest-xdist workers (two by default).

- A work unit is a test file, as `--dist loadfile` makes it, but for tests/xla and
  tests/cluster: their package-scoped fixtures (an xla and a cpu executor; a whole
  `switchyard up`) were started again by every worker that got one of their files, and again
  after any other package's file in between (measured at 31 s and 21 s a start), so each
  package is one unit.
- Units run heaviest first (`HEAVY`), so the workers end together rather than one running a
  long unit alone at the end: each worker has its own cores (tests/conftest.py: pin_worker),
  so one cannot lend the other a core at the end.
- Where the workers are not pinned (more workers than cores), units holding a test marked
  `alone` run last, when the other workers are on short tests or done, so that none waits long
  for another's test to end (tests/conftest.py: host).
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

PACKAGES = ("tests/xla/", "tests/cluster/")

# Seconds of pytest per unit on a pinned worker (one core of the 2-core host), the units over
# 20 s, as the test reports of a `make test` at 676 s timed them (7 December), but for
# test_distributed.py, timed on one pinned core after its two DDP tests came to share one
# trial; the order matters, not the figures.
HEAVY = {
    "tests/cluster": 179,
    "tests/xla": 147,
    "tests/trial/test_distributed.py": 127,
    "tests/faults/test_cluster_faults.py": 88,
    "tests/trial/test_generation_trial.py": 80,
    "tests/trial/test_verdict_speed.py": 35,
    "tests/test_packaging.py": 29,
    "tests/executor/test_generation.py": 28,
    "tests/trial/test_trial_lifecycle.py": 27,
    "tests/trial/test_user_models.py": 24,
    "tests/security/test_ledger_anchor.py": 22,
    "tests/trial/test_trial_e2e.py": 21,
    "tests/executor/test_engine_process.py": 21,
    "tests/router/test_router_faults.py": 20,
}


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((p.rstrip("/") for p in PACKAGES if path.startswith(p)), path)


def order(items: list[pytest.Item], alone_last: bool) -> None:
    """Sorts `items` in place by unit as above (`alone_last`: units holding an `alone` test
    after the rest); a unit's own tests keep their order."""
    first: dict[str, int] = {}
    alone: set[str] = set()
    for i, item in enumerate(items):
        unit = unit_of(item.nodeid)
        first.setdefault(unit, i)
        if alone_last and item.get_closest_marker("alone") is not None:
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
