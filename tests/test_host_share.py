"""The suite's host lock (tests/conftest.py: `host_share`): with two pytest-xdist workers, a
test marked `alone` runs while no other test does, and every test still runs.

A pytest run of its own, two workers, on two files that would overlap without the lock: one
`alone` test and four short ones, each writing when it started and ended.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

TIMED = """
import time
from pathlib import Path

def timed(name: str, seconds: float) -> None:
    start = time.time()
    time.sleep(seconds)
    Path(__file__).with_name("times").joinpath(name).write_text(f"{start} {time.time()}")
"""


def test_an_alone_test_overlaps_no_other_test(tmp_path: Path) -> None:
    (tmp_path / "times").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  alone: runs with no other test\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import host_share  # noqa: F401\n" + TIMED)
    (tmp_path / "test_a_alone.py").write_text(
        "import pytest\nfrom conftest import timed\n\n"
        "@pytest.mark.alone\ndef test_alone():\n    timed('alone', 1.5)\n"
    )
    (tmp_path / "test_b_shared.py").write_text(
        "import pytest\nfrom conftest import timed\n\n"
        "@pytest.mark.parametrize('i', range(4))\ndef test_shared(i):\n    timed(f'shared{i}', 0.5)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    spans = {p.name: tuple(map(float, p.read_text().split())) for p in (tmp_path / "times").iterdir()}
    assert len(spans) == 5, spans
    start, end = spans.pop("alone")
    overlapping = {name: s for name, s in spans.items() if s[0] < end and start < s[1]}
    assert not overlapping, (start, end, overlapping)
