"""Shared test fixtures. Every service a test needs is started by the tests themselves."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

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
# measurement) gets the host to itself, as a trial's paths that share a host never overlap
# (DESIGN §4): marked `alone`, it holds the run's host lock exclusively, while every other test
# holds it shared. In one process the lock is never contended; with pytest-xdist workers
# (`make test TEST_WORKERS=2`) the other worker waits between its tests while an `alone` test
# runs. A turnstile keeps a waiting `alone` test from being overtaken by the next shared one.
# Module- and session-scoped set-up (clusters, stacks) runs outside the lock, in parallel; a
# module fixture that itself measures (a trial its tests only read) holds it with `host(True)`.
@contextlib.contextmanager
def host(alone: bool) -> Iterator[None]:
    """The run's host lock, exclusively (`alone`) or shared; nothing in one process."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside a test
        yield
        return
    base = Path(tempfile.gettempdir()) / f"switchyard-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.host", "a") as held:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def host_share(request: pytest.FixtureRequest) -> Iterator[None]:
    with host(request.node.get_closest_marker("alone") is not None):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order(items)


@pytest.hookimpl(optionalhook=True)  # a run with `-p no:xdist` has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """With `--dist loadfile` (`make test`), the suite's own units and order (tests/suite_order.py)."""
    return UnitScheduling(config, log) if config.getoption("dist") == "loadfile" else None
