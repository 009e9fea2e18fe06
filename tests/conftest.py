"""Shared test fixtures. Every service a test needs is started by the tests themselves."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.suite_order import UnitScheduling, order

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The suite runs its services in plaintext, by name (the services refuse to start with neither
# certificates nor this): the tests of identities and authorisation give their servers
# certificates explicitly (tests/security/), which wins over this for those servers.
os.environ["SWITCHYARD_SECURITY_INSECURE"] = "true"

# Inductor's FX-graph and AOTAutograd caches in a folder that outlives /tmp (emptied at boot),
# as the environments are (~/.cache/switchyard), one per torch version; every process of the
# session (executors, engine children, clusters) inherits it. A graph compiled by an earlier
# run is then loaded, not built again by the C++ compiler: the compiled MLP's two buckets took
# 70 s cold and 7 s warm. Dynamo still traces each graph and the executor's counting backend
# still sees every compilation, so the compile tests' counts are unchanged. An operator's own
# TORCHINDUCTOR_CACHE_DIR wins.
_CACHE = Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / f"inductor-{metadata.version('torch')}"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama-style test model of tests/gen_models.py, built once a session (its tests
    only read it)."""
    from tests.gen_models import build_llama

    return build_llama(tmp_path_factory.mktemp("llama") / "llama-tiny")


# A test that judges measured time (a speed verdict, a latency window, a fault timed against a
# measurement) gets cores of its own, as a trial's paths that share a host never overlap
# (DESIGN §4). It is marked `alone`. Two ways, chosen per run:
# - Pinned (`make test`'s two workers on two or more cores): each pytest-xdist worker, and
#   every process it starts, runs on its own share of the cores (`pin_worker`), so an `alone`
#   test shares no core with another worker's tests, and no test waits for it.
# - Locked (more workers than cores): an `alone` test holds the run's host lock exclusively
#   while every other test holds it shared, so the other workers wait between their tests.
# A module marked `whole_host` (the fault tests: a cluster of eight processes under a
# closed-loop load, which one core starves) runs on every core, holding the lock exclusively
# from its set-up to its teardown; pinned, an `alone` test holds the lock shared, so it never
# runs beside such a module, and other tests take no lock. A turnstile keeps a waiting
# exclusive holder from being overtaken. A module fixture that itself measures (a trial its
# tests only read) holds the lock with `host("alone")`. In one process nothing is locked.
_pinned = False
Hold = Literal["whole", "alone", "shared"]


def share_of_cores(worker: str, workers: int, cores: list[int]) -> set[int]:
    """Worker `gwN`'s cores when `workers` workers split `cores`; empty when they cannot
    (fewer cores than workers)."""
    if len(cores) < workers:
        return set()
    return set(cores[int(worker.removeprefix("gw")) % workers :: workers])


def _set_cores(cores: set[int]) -> None:
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), cores)


def pin_worker() -> bool:
    """Pins this pytest-xdist worker, every thread of it, to its share of the cores (children
    inherit it); False where there is no share to give."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return False
    mine = share_of_cores(
        worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), sorted(os.sched_getaffinity(0))
    )
    if not mine:
        return False
    _set_cores(mine)
    return True


def pytest_configure(config: pytest.Config) -> None:
    global _pinned
    _pinned = pin_worker()


@contextlib.contextmanager
def host(hold: Hold) -> Iterator[None]:
    """The run's host lock for a test or module that is `whole` (the host), `alone` or
    `shared` (see above); nothing in one process."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    exclusive = hold == "whole" or (hold == "alone" and not _pinned)
    if run is None or (hold == "shared" and _pinned):
        yield
        return
    base = Path(tempfile.gettempdir()) / f"switchyard-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.host", "a") as held:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@pytest.fixture(scope="module", autouse=True)
def whole_host(request: pytest.FixtureRequest) -> Iterator[None]:
    """A `whole_host` module: every core of the run for it and what it starts, the lock held."""
    if request.node.get_closest_marker("whole_host") is None:
        yield
        return
    mine = os.sched_getaffinity(0)
    with host("whole"):
        _set_cores(os.sched_getaffinity(os.getppid()) | mine)  # pytest's own: every core
        try:
            yield
        finally:
            _set_cores(mine)


@pytest.fixture(autouse=True)
def host_share(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("whole_host") is not None:  # its module holds the host
        yield
        return
    with host("alone" if request.node.get_closest_marker("alone") is not None else "shared"):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order(items, alone_last=not _pinned)


@pytest.hookimpl(optionalhook=True)  # a run with `-p no:xdist` has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadfile` (`make test`), the suite's own units and order (tests/suite_order.py)."""
    return UnitScheduling(config, log) if config.getoption("dist") == "loadfile" else None
