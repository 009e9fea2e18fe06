"""`switchyard ledger html`: one self-contained page (inline SVG, no scripts, no network).

Charts: cost per completed job per path over time (one line per path, by day), the idle
share of each path's cost, and unpriced usage. Figures are exact micro-units rendered as
decimals; a path-day with no completed job has no point rather than a zero. Costs per job
come from the exact total / jobs, shown per job or, where one job costs under a micro-unit,
per 1,000 or 1,000,000 jobs (services.metering.money), in the chart and in the table alike.
Every mark that carries a figure has a `data-value` attribute (the tests count them). Where
the ledger has generation tokens, a table gives them per path with the cost per completed
generation job and per million output and prompt tokens, exact as the CLI table gives them.
"""

from __future__ import annotations

from datetime import datetime
from fractions import Fraction
from html import escape
from typing import Any

from services.metering import money

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")
W, H, PAD = 720, 280, 50


def _line_chart(by_day: list[dict[str, Any]]) -> str:
    days = sorted({r["day"] for r in by_day})
    paths = sorted({r["path"] for r in by_day})
    exact = {
        (r["path"], r["day"]): money.per_job(r["total_micros"], r["jobs_completed"])
        for r in by_day
        if r["jobs_completed"]
    }
    if not exact:
        return "<p>No completed jobs in the window: cost per completed job is undefined.</p>"
    scale = money.scale_for(exact.values())
    label = money.per_label(scale)
    points = {k: v * scale for k, v in exact.items()}  # micro-units per `scale` jobs, exact
    top = max(max(points.values()), Fraction(1))

    def xy(day: str, value: Fraction) -> tuple[float, float]:
        x = PAD + (days.index(day) + 0.5) * (W - 2 * PAD) / len(days)
        return x, H - PAD - float(value / top) * (H - 2 * PAD)

    parts = [f'<svg width="{W}" height="{H}" role="img" aria-label="cost per completed job by day">']
    parts.append(f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#444"/>')
    parts.append(f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#444"/>')
    top_text = f"{money.decimal(money.round_half_up(top))} {label}"
    parts.append(f'<text x="4" y="{PAD - 8}" font-size="11">max {escape(top_text)}</text>')
    parts.append(f'<text x="4" y="{H - PAD + 4}" font-size="11">0</text>')
    for i, day in enumerate(days):
        x, _ = xy(day, Fraction(0))
        if len(days) <= 12 or i % max(1, len(days) // 12) == 0:
            parts.append(
                f'<text x="{x:.0f}" y="{H - PAD + 16}" font-size="10" text-anchor="middle">'
                f"{escape(day)}</text>"
            )
    for n, path in enumerate(paths):
        color = COLORS[n % len(COLORS)]
        pts = [xy(d, points[(path, d)]) for d in days if (path, d) in points]
        if len(pts) > 1:
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        for d in days:
            if (path, d) not in points:
                continue
            x, y = xy(d, points[(path, d)])
            shown = f"{money.decimal(money.round_half_up(points[(path, d)]))} {label}"
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}" data-value="{escape(shown)}">'
                f"<title>{escape(path)} {escape(d)}: {escape(shown)}</title></circle>"
            )
        parts.append(
            f'<text x="{W - PAD + 4}" y="{PAD + 14 * n}" font-size="11" fill="{color}">{escape(path)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _idle_bars(by_path: list[dict[str, Any]]) -> str:
    rows = [r for r in by_path if r["total_micros"] > 0]
    if not rows:
        return "<p>No priced cost in the window.</p>"
    height = 28 * len(rows) + 20
    parts = [f'<svg width="{W}" height="{height}" role="img" aria-label="idle share by path">']
    for i, r in enumerate(rows):
        share = max(0.0, min(1.0, r["idle_micros"] / r["total_micros"]))
        y = 10 + 28 * i
        parts.append(f'<text x="4" y="{y + 14}" font-size="11">{escape(r["path"])}</text>')
        parts.append(
            f'<rect x="200" y="{y}" width="{(W - 300) * share:.1f}" height="18" fill="#d62728" '
            f'data-value="{share:.4f}"/>'
        )
        parts.append(
            f'<rect x="{200 + (W - 300) * share:.1f}" y="{y}" width="{(W - 300) * (1 - share):.1f}" '
            'height="18" fill="#1f77b4"/>'
        )
        parts.append(f'<text x="{W - 90}" y="{y + 14}" font-size="11">{share:.1%} idle</text>')
    parts.append("</svg>")
    return "".join(parts)


# The figures of a cost row, as the report table and `switchyard ledger report` head them.
COST_COLUMNS = ("currency", "total", "busy", "idle", "prepare", "completed", "failed")


def cost_cells(r: dict[str, Any]) -> list[str]:
    """A cost row's COST_COLUMNS figures as text, money exact."""
    figures = (r["total_micros"], r["busy_micros"], r["idle_micros"], r["prepare_micros"])
    return [r["currency"], *map(money.decimal, figures), str(r["jobs_completed"]), str(r["jobs_failed"])]


def _table(by_path: list[dict[str, Any]]) -> str:
    head = ("path", *COST_COLUMNS, "per completed job", "unpriced events")
    out = ["<table><tr>", *(f"<th>{h}</th>" for h in head), "</tr>"]
    for r in by_path:
        per = (
            money.per_job_text(r["total_micros"], r["jobs_completed"], r["currency"])
            if r["jobs_completed"]
            else "n/a (none completed)"
        )
        cells = (
            r["path"],
            *cost_cells(r),
            per,
            str(r["unpriced_events"]),
        )
        out += ["<tr>", *(f"<td>{escape(str(c))}</td>" for c in cells), "</tr>"]
    out.append("</table>")
    return "".join(out)


def _per_million(cost: int, tokens: int, currency: str) -> str:
    return money.per_million_tokens_text(cost, tokens, currency) if tokens > 0 else "n/a"


def _generation(by_path: list[dict[str, Any]]) -> str:
    """Tokens and the cost of generation per path (docs/ledger.md "Tokens"); '' without tokens."""
    rows = [r for r in by_path if r["prompt_tokens"] or r["output_tokens"]]
    if not rows:
        return ""
    head = (
        "path", "prompt tokens", "output tokens", "generation jobs completed",
        "per completed generation job", "per 1M output tokens", "per 1M prompt tokens",
    )  # fmt: skip
    out = ["<h2>Generation by path</h2><table><tr>", *(f"<th>{h}</th>" for h in head), "</tr>"]
    for r in rows:
        cost, currency, jobs = r["generation_micros"], r["currency"], r["generation_jobs_completed"]
        cells = (
            r["path"],
            str(r["prompt_tokens"]),
            str(r["output_tokens"]),
            str(jobs),
            money.per_job_text(cost, jobs, currency) if jobs else "n/a (none completed)",
            money.per_million_tokens_text(cost, r["output_tokens"], currency)
            if r["output_tokens"] > 0
            else "n/a",
            money.per_million_tokens_text(cost, r["prompt_tokens"], currency)
            if r["prompt_tokens"] > 0
            else "n/a",
        )
        out += ["<tr>", *(f"<td>{escape(str(c))}</td>" for c in cells), "</tr>"]
    out.append("</table>")
    return "".join(out)


def render(by_day: list[dict[str, Any]], by_path: list[dict[str, Any]], generated: datetime) -> str:
    unpriced = [r for r in by_path if r["unpriced_events"]]
    unpriced_html = (
        "<ul>"
        + "".join(f"<li>{escape(r['path'])}: {r['unpriced_events']} unpriced lines</li>" for r in unpriced)
        + "</ul>"
        if unpriced
        else "<p>None: every usage line had a price in force.</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>switchyard ledger report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:900px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}</style>
</head><body>
<h1>switchyard ledger report</h1>
<p>Generated {escape(generated.isoformat())}. Money in exact micro-units shown as decimals.
Cost per completed job = all cost of the path (busy, idle, preparation, failed work)
/ jobs completed within the quality criteria.</p>
<h2>Cost per completed job per path, by day</h2>{_line_chart(by_day)}
<h2>Idle share of cost (red) by path</h2>{_idle_bars(by_path)}
<h2>Totals by path</h2>{_table(by_path)}
{_generation(by_path)}
<h2>Unpriced usage (not counted as zero)</h2>{unpriced_html}
</body></html>
"""
