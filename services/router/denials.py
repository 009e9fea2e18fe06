"""Unauthenticated denials per source: rate-limited and aggregated, never a write per request.

A source (the caller's host, without its port) that has been refused `max_lookups` times in
the current window is refused at once (RESOURCE_EXHAUSTED with `retry-after-ms`), without
asking metering, so a junk-key flood cannot load metering's single writer with its
`auth.denied` rows or push Authenticate past the router's timeout. The router's own audit
trail gets one `request.denied` row per source per window: the first refusal is written at
once, and when the window closes a row with the count of the window's refusals. Sources are
at most `max_sources`; beyond that the oldest windows are closed early.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from switchyard.errors import RateLimited

WINDOW_S = 10.0
MAX_LOOKUPS = 5  # refused keys a source may have metering check in one window
MAX_SOURCES = 10_000


def source_of(peer: str) -> str:
    """The host of a gRPC peer (`ipv4:1.2.3.4:567`) or of an HTTP peer (`1.2.3.4:567`)."""
    host = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return host.rsplit(":", 1)[0] if ":" in host else host


@dataclass
class _Window:
    start: float
    count: int = 0


class Denials:
    def __init__(self, window_s: float = WINDOW_S, max_lookups: int = MAX_LOOKUPS) -> None:
        self.window_s = window_s
        self.max_lookups = max_lookups
        self._windows: OrderedDict[str, _Window] = OrderedDict()

    def check(self, source: str) -> None:
        """Refuses a source over its refused lookups in the current window (counted)."""
        window = self._windows.get(source)
        if window is None or time.monotonic() - window.start >= self.window_s:
            return
        if window.count >= self.max_lookups:
            window.count += 1
            wait_ms = int((window.start + self.window_s - time.monotonic()) * 1000) + 1
            raise RateLimited(
                f"too many refused keys from {source} ({window.count} in {self.window_s:g} s); "
                f"retry after {wait_ms} ms",
                wait_ms,
            )

    def denied(self, source: str) -> bool:
        """Counts a refusal; True when it is the window's first (audit it now)."""
        window = self._windows.get(source)
        if window is not None and time.monotonic() - window.start < self.window_s:
            window.count += 1
            return False
        self._windows[source] = _Window(time.monotonic(), 1)
        self._windows.move_to_end(source)
        return True

    def closed(self, everything: bool = False) -> list[tuple[str, int]]:
        """(source, refusals) of the windows that have closed (all, with `everything`), each
        once; those with one refusal only were audited already and are left out."""
        if not self._windows:
            return []  # the usual case, asked per request: nothing refused lately
        now = time.monotonic()
        out = []
        for source, window in list(self._windows.items()):
            over = len(self._windows) > MAX_SOURCES
            if everything or over or now - window.start >= self.window_s:
                del self._windows[source]
                if window.count > 1:
                    out.append((source, window.count))
        return out
