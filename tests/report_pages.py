"""Looking at report pages the way a person does: headless Chromium renders each chart, and
the screenshot must show data (coloured marks), not only a title and "no data".

Chromium is Debian's `chromium` package (tests install it when missing, as root); without it
the page tests skip with a notice, and fail under CI=true.
"""

from __future__ import annotations

import itertools
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.conftest import IN_CI

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "chromium"],
            capture_output=True,
            timeout=600,
            check=False,
            env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
        found = shutil.which("chromium")
    if found is None:
        reason = "headless Chromium is not installed (apt-get install chromium)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(f"NOTICE: {reason}")
    return found


def _run(args: list[str], workdir: Path) -> subprocess.CompletedProcess[bytes]:
    profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)  # a fresh profile each time
    return subprocess.run(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        timeout=120,
        check=True,
    )


def screenshot(page: Path, width: int, height: int) -> Path:
    out = page.with_suffix(".png")
    _run([f"--screenshot={out}", f"--window-size={width},{height}", page.as_uri()], page.parent)
    return out


def dump_dom(page: Path) -> str:
    return _run(["--dump-dom", page.as_uri()], page.parent).stdout.decode()


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB(A) rows of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and color in (2, 6), (depth, color, interlace)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if filt == 1:
                line[i] = (line[i] + a) & 0xFF
            elif filt == 2:
                line[i] = (line[i] + b) & 0xFF
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, channels, rows


def coloured_pixels(path: Path) -> int:
    """Pixels in colour (not white, grey or black): the data marks; titles and axes are grey."""
    _, channels, rows = read_png(path)
    return _coloured(rows, channels)


def _coloured(rows: list[bytes], channels: int, width: int | None = None) -> int:
    """coloured_pixels of `rows`, each cut to its first `width` pixels (all of it: None)."""
    count = 0
    for row in rows:
        for i in range(0, len(row) if width is None else width * channels, channels):
            r, g, b = row[i], row[i + 1], row[i + 2]
            if max(r, g, b) - min(r, g, b) > 60:
                count += 1
    return count


class _Marks(HTMLParser):
    """Per top-level <svg>: how many elements carry a data-value (a figure)."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: list[tuple[str, int]] = []
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "svg":
            if self._depth == 0:
                self.charts.append((dict(attrs).get("aria-label") or "", 0))
            self._depth += 1
        elif self._depth and any(k == "data-value" for k, _ in attrs):
            label, n = self.charts[-1]
            self.charts[-1] = (label, n + 1)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._depth -= 1


def _size(svg: str) -> tuple[int, int]:
    """An <svg>'s width and height attributes, in pixels."""
    width = int(re.search(r'width="(\d+)"', svg).group(1))  # type: ignore[union-attr]
    height = int(re.search(r'height="(\d+)"', svg).group(1))  # type: ignore[union-attr]
    return width, height


def check_charts(html: str, workdir: Path, min_charts: int = 1) -> dict[str, int]:
    """Every chart of the page has data points in Chromium's DOM and coloured pixels on screen.
    Returns chart label -> coloured pixel count."""
    workdir.mkdir(parents=True, exist_ok=True)
    page = workdir / "page.html"
    page.write_text(html, encoding="utf-8")
    parser = _Marks()
    parser.feed(dump_dom(page))
    assert len(parser.charts) >= min_charts, parser.charts
    empty = [label for label, n in parser.charts if n == 0]
    assert not empty, f"charts without data points: {empty}"
    # Every chart alone in a box of its own size, one under the other, in one screenshot (one
    # Chromium start, not one per chart: ~0.8 s each on a busy 2-core host); each box clips
    # its chart, so a chart's pixels are counted in its own rows and no other's.
    svgs = re.findall(r"<svg.*?</svg>", html, re.S)
    sizes = [_size(svg) for svg in svgs]
    *tops, height = itertools.accumulate((h for _, h in sizes), initial=0)  # each box's top; page height
    seen: dict[str, int] = {}
    if svgs:
        box = "<div style='position:absolute;left:0;top:{}px;width:{}px;height:{}px;overflow:hidden'>{}</div>"
        boxes = "".join(
            box.format(top, w, h, svg) for svg, (w, h), top in zip(svgs, sizes, tops, strict=True)
        )
        page = workdir / "charts.html"
        page.write_text(f"<!DOCTYPE html><html><body style='margin:0;background:#fff'>{boxes}</body></html>")
        width = max(w for w, _ in sizes)
        shot_width, channels, rows = read_png(screenshot(page, width, height))
        assert (shot_width, len(rows)) == (width, height), ((shot_width, len(rows)), (width, height))
        for i, (svg, (w, h), top) in enumerate(zip(svgs, sizes, tops, strict=True)):
            label = re.search(r'aria-label="([^"]*)"', svg)
            seen[label.group(1) if label else f"chart {i}"] = _coloured(rows[top : top + h], channels, w)
    blank = [label for label, n in seen.items() if n < 20]
    assert not blank, f"charts that render no data on screen: {blank} ({seen})"
    return seen
