"""Inline SVG charts for the trial report: self-contained, no scripts, no external assets."""

from __future__ import annotations

from html import escape

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
W, H, LEFT, BOTTOM, TOP = 640, 260, 70, 40, 30


def _frame(title: str, body: str, height: int = H) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" '
        f'role="img" aria-label="{escape(title)}">'
        f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14" '
        f'font-weight="bold">{escape(title)}</text>'
        f"{body}</svg>"
    )


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def bar_chart(title: str, unit: str, groups: list[str], series: dict[str, list[float | None]]) -> str:
    """Grouped bars: one group per label, one bar per series; None = no figure (shown as n/a)."""
    values = [v for vals in series.values() for v in vals if v is not None]
    if not groups or not values:
        return _frame(title, f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>')
    top = max(values) * 1.15 or 1.0
    plot_w, plot_h = W - LEFT - 20, H - BOTTOM - TOP
    group_w = plot_w / len(groups)
    bar_w = group_w * 0.8 / max(len(series), 1)
    parts = [f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{W - 20}" y2="{TOP + plot_h}" stroke="#333"/>']
    parts.append(f'<text x="12" y="{TOP + plot_h / 2}" font-size="11" transform="rotate(-90 12 '
                 f'{TOP + plot_h / 2})" '
                 f'text-anchor="middle">{escape(unit)}</text>')  # fmt: skip
    for gi, label in enumerate(groups):
        gx = LEFT + gi * group_w + group_w * 0.1
        parts.append(
            f'<text x="{LEFT + (gi + 0.5) * group_w}" y="{H - 22}" text-anchor="middle" font-size="11">'
            f"{escape(label)}</text>"
        )
        for si, (name, vals) in enumerate(series.items()):
            v = vals[gi] if gi < len(vals) else None
            x = gx + si * bar_w
            if v is None:
                parts.append(f'<text x="{x + bar_w / 2}" y="{TOP + plot_h - 4}" font-size="9" '
                             f'text-anchor="middle">n/a</text>')  # fmt: skip
                continue
            h = plot_h * v / top
            parts.append(
                f'<rect x="{x:.1f}" y="{TOP + plot_h - h:.1f}" width="{bar_w * 0.92:.1f}" height="{h:.1f}" '
                f'fill="{COLORS[si % len(COLORS)]}" data-value="{v:.6g}"><title>{escape(name)} '
                f"{escape(label)}: {_fmt(v)} "
                f"{escape(unit)}</title></rect>"
                f'<text x="{x + bar_w / 2:.1f}" y="{TOP + plot_h - h - 3:.1f}" font-size="9" '
                f'text-anchor="middle">{_fmt(v)}</text>'
            )
    return _with_legend(title, parts, list(series))


def _legend(names: list[str]) -> str:
    out = []
    for i, name in enumerate(names):
        x = LEFT + i * 130
        out.append(
            f'<rect x="{x}" y="{H - 12}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
            f'<text x="{x + 14}" y="{H - 3}" font-size="11">{escape(name)}</text>'
        )
    return "".join(out)


def line_chart(title: str, x_label: str, y_label: str, series: dict[str, list[float]]) -> str:
    """One polyline per series over steps 1..n."""
    values = [v for vals in series.values() for v in vals]
    if not values:
        return _frame(title, f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>')
    lo, hi = min(values), max(values)
    span = (hi - lo) or abs(hi) or 1.0
    lo, hi = lo - span * 0.05, hi + span * 0.05
    steps = max(len(v) for v in series.values())
    plot_w, plot_h = W - LEFT - 20, H - BOTTOM - TOP
    parts = [
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{W - 20}" y2="{TOP + plot_h}" stroke="#333"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="#333"/>',
        f'<text x="{LEFT - 4}" y="{TOP + 8}" text-anchor="end" font-size="10">{_fmt(hi)}</text>',
        f'<text x="{LEFT - 4}" y="{TOP + plot_h}" text-anchor="end" font-size="10">{_fmt(lo)}</text>',
        f'<text x="{LEFT + plot_w / 2}" y="{H - 22}" text-anchor="middle" font-size="11">{escape(x_label)}'
        f" (1..{steps})</text>",
        f'<text x="12" y="{TOP + plot_h / 2}" font-size="11" transform="rotate(-90 12 {TOP + plot_h / 2})" '
        f'text-anchor="middle">{escape(y_label)}</text>',
    ]
    for si, (name, vals) in enumerate(series.items()):
        points = " ".join(
            f"{LEFT + plot_w * (i / max(steps - 1, 1)):.1f},{TOP + plot_h * (1 - (v - lo) / (hi - lo)):.1f}"
            for i, v in enumerate(vals)
        )
        dash = ' stroke-dasharray="5,3"' if si else ""
        parts.append(
            f'<polyline points="{points}" data-value="{len(vals)} points" fill="none" '
            f'stroke="{COLORS[si % len(COLORS)]}" '
            f'stroke-width="2"{dash}>'
            f"<title>{escape(name)}</title></polyline>"
        )
    return _with_legend(title, parts, list(series))


def histogram(title: str, edges: list[float], counts: list[int], color_index: int = 0) -> str:
    """Latency distribution over log-spaced buckets (edges in ms)."""
    if not counts or not edges:
        return _frame(title, f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no data</text>', 180)
    height = 180
    plot_w, plot_h = W - LEFT - 20, height - 60
    top = max(counts) or 1
    bw = plot_w / len(counts)
    parts = [f'<line x1="{LEFT}" y1="{30 + plot_h}" x2="{W - 20}" y2="{30 + plot_h}" stroke="#333"/>']
    for i, c in enumerate(counts):
        h = plot_h * c / top
        parts.append(
            f'<rect x="{LEFT + i * bw:.1f}" y="{30 + plot_h - h:.1f}" width="{bw * 0.95:.1f}" '
            f'height="{h:.1f}" data-value="{c}" '
            f'fill="{COLORS[color_index % len(COLORS)]}"><title>{_fmt(edges[i])}-{_fmt(edges[i + 1])} ms: '
            f"{c}</title></rect>"
        )
    parts.append(f'<text x="{LEFT}" y="{height - 12}" font-size="10">{_fmt(edges[0])} ms</text>')
    parts.append(f'<text x="{W - 20}" y="{height - 12}" font-size="10" '
                 f'text-anchor="end">{_fmt(edges[-1])} ms '
                 "(log scale)</text>")  # fmt: skip
    return _frame(title, "".join(parts), height)


def _with_legend(title: str, parts: list[str], names: list[str]) -> str:
    return _frame(title, "".join(parts) + _legend(names))
