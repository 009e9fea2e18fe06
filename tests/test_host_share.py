"""How an `alone` test gets cores of its own beside other pytest-xdist workers
(tests/conftest.py): each worker pinned to its own cores where there are enough, else the
run's host lock.

Each case is a pytest run of its own on two files: one `alone` test and four short ones, each
writing when it started and ended, and the cores it and a child process it started ran on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TIMED = """
import json, os, subprocess, sys, time
from pathlib import Path

def timed(name: str, seconds: float) -> None:
    start = time.time()
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True).stdout
    time.sleep(seconds)
    span = {"start": start, "end": time.time(), "worker": os.environ["PYTEST_XDIST_WORKER"],
            "cores": sorted(os.sched_getaffinity(0)), "child": json.loads(child)}
    Path(__file__).with_name("times").joinpath(name).write_text(json.dumps(span))
"""


# The cores the run under test may use: this test's own worker is pinned to its share
# (tests/conftest.py), so those of the process that started it, pytest's own.
CORES = sorted(os.sched_getaffinity(os.getppid()))


def _run(tmp_path: Path, workers: int, whole: bool = False) -> dict[str, dict[str, object]]:
    """The spans of a run on `CORES` with `workers` workers: 'alone' and 'shared0' to 'shared3',
    and with `whole` 'whole', a test of a `whole_host` module."""
    (tmp_path / "times").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  alone: a\n  whole_host: w\n")
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import host_share, pytest_configure, whole_host  # noqa: F401\n" + TIMED
    )
    if whole:
        (tmp_path / "test_b_whole.py").write_text(
            "import pytest\nfrom conftest import timed\n\n"
            "pytestmark = pytest.mark.whole_host\n\ndef test_whole():\n    timed('whole', 1.5)\n"
        )
    (tmp_path / "test_a_alone.py").write_text(
        "import pytest\nfrom conftest import timed\n\n"
        "@pytest.mark.alone\ndef test_alone():\n    timed('alone', 1.5)\n"
    )
    (tmp_path / "test_c_shared.py").write_text(
        "import pytest\nfrom conftest import timed\n\n"
        "@pytest.mark.parametrize('i', range(4))\ndef test_shared(i):\n    timed(f'shared{i}', 0.5)\n"
    )
    # a run of its own: not a worker of this one's (xdist's variables stay out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers)]
    done = subprocess.run(
        [*argv, "--dist", "loadfile"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, CORES),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    spans = {p.name: json.loads(p.read_text()) for p in (tmp_path / "times").iterdir()}
    assert sorted(spans) == ["alone", "shared0", "shared1", "shared2", "shared3"] + ["whole"] * whole, spans
    return spans


def _overlapping(spans: dict[str, dict[str, object]], name: str) -> set[str]:
    me = spans[name]
    return {n for n, s in spans.items() if n != name and s["start"] < me["end"] and me["start"] < s["end"]}  # type: ignore[operator]


def test_pinned_workers_run_on_cores_of_their_own_and_never_wait(tmp_path: Path) -> None:
    if len(CORES) < 2:
        pytest.skip("one core: two workers cannot each have their own")
    spans = _run(tmp_path, 2)
    by_worker: dict[str, set[int]] = {}
    for span in spans.values():
        assert span["child"] == span["cores"], span  # what a test starts stays on its cores
        by_worker.setdefault(str(span["worker"]), set()).update(span["cores"])  # type: ignore[arg-type]
    assert len(by_worker) == 2, spans
    first, second = by_worker.values()
    assert first and second and not first & second and first | second <= set(CORES), by_worker
    # nothing waited for the `alone` test: the other worker's tests ran beside it
    assert _overlapping(spans, "alone"), spans


def test_an_alone_test_overlaps_no_other_test_where_workers_outnumber_cores(tmp_path: Path) -> None:
    spans = _run(tmp_path, len(CORES) + 1)
    assert all(s["cores"] == s["child"] == CORES for s in spans.values()), spans
    assert not _overlapping(spans, "alone"), spans


def test_a_whole_host_module_runs_on_every_core_and_the_other_worker_stays_pinned(tmp_path: Path) -> None:
    if len(CORES) < 2:
        pytest.skip("one core: two workers cannot each have their own")
    spans = _run(tmp_path, 2, whole=True)
    assert spans["whole"]["cores"] == spans["whole"]["child"] == CORES, spans["whole"]
    assert all(s["cores"] != CORES for n, s in spans.items() if n != "whole"), spans
