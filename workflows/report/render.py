"""Rendering a stored trial report (JSON) as Markdown or as one self-contained HTML page.

Every figure is printed with its basis: input sizes, batch, concurrency, iterations and
duration for timings; currency and micro-units for money; the tolerance's justification for
correctness. The HTML page carries its charts as inline SVG (workflows/report/charts.py).
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from markdown_it import MarkdownIt

from services.metering import money
from workflows.kinds import kind_of_report
from workflows.pipeline.kind import Rows, TrialKind
from workflows.pipeline.types import EXAMPLE_PRICES
from workflows.report import charts

CRITERIA_ORDER = ("trial", "correctness", "compatibility", "latency", "memory", "training", "cost")


def criteria_in_order(verdict: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    order = {name: i for i, name in enumerate(CRITERIA_ORDER)}
    return sorted(verdict["criteria"].items(), key=lambda kv: order.get(kv[0], len(order)))


def _money(micros: int | None, currency: str = "") -> str:
    if micros is None:
        return "n/a"
    return f"{money.decimal(micros)} {currency}".strip()  # exact, never through a float


def _rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    ref = report["reference"]
    return sorted(report["paths"].items(), key=lambda kv: (kv[0] != ref, kv[0]))


def compat_anchor(path: str) -> str:
    """The id of a path's compatibility details (path names are [A-Za-z0-9._-])."""
    return f"compatibility-{path.lower().replace('.', '')}"


def _compat_rows(state: dict[str, Any]) -> list[tuple[str, str]]:
    """(finding, value) rows of a path's compatibility details."""
    c = state.get("compatibility") or {}
    if not c.get("known"):
        return [("findings", "none: the path did not finish its prepare phase")]
    rows = []
    for op in c["fallback_ops"]:
        rows.append(
            (
                f"host fallback {op['op']}",
                f"{op['calls_per_request']:g} calls per request (over {c['requests']} requests of the "
                f"fixed inputs); {op['calls_at_load']} during load and warm-up",
            )
        )
    if not c["fallback_ops"]:
        rows.append(("host fallback", "none"))
    if c.get("per_request_unknown"):
        rows.append(("calls per request", f"unknown: {c['per_request_unknown']}"))
    reasons = "; ".join(c["graph_break_reasons"])
    rows.append(("graph breaks", f"{c['graph_breaks']}" + (f" ({reasons})" if reasons else "")))
    rows.append(
        (
            "recompiles",
            f"{c['recompiles_at_load']} at load; {c['compilations_on_inputs']} on the trial's fixed inputs "
            "after warm-up",
        )
    )
    rows.append(("unsupported dtypes", ", ".join(c["unsupported_dtypes"]) or "none"))
    rows.append(("adaptations", "; ".join(c["adaptations"]) or "none"))
    rows += [("note", n) for n in c["notes"]]
    return rows


def _perf_lines(kind: TrialKind, state: dict[str, Any]) -> list[str]:
    perf = state.get("performance") or {}
    if "skipped" in perf:
        return [f"- performance: skipped: {perf['skipped']}"]
    if not perf:
        return []
    compiled = perf["compilations_after"] - perf["compilations_before"]
    return [
        *kind.render.performance(perf),
        f"- performance: compilations/recompiles while measuring: {compiled}",
    ]


def markdown(report: dict[str, Any]) -> str:
    out = [f"# Trial {report['trial_id']}: {report['model']['name']}", ""]
    out.append(f"Status **{report['status']}**, {report['started']} to {report['ended']} "
               f"({report['duration_s']:.1f} s). Reference path: **{report['reference']}**.")  # fmt: skip
    if report.get("cancel_reason"):
        out.append(f"Cancelled: {report['cancel_reason']}.")
    kind = kind_of_report(report)
    out += _md_verdicts(report) + _md_system(report, kind)
    for name, s in _rows(report):
        out += _md_path(kind, name, s)
    out += kind.render.appendix(_rows(report))
    return "\n".join(out) + "\n"


def _md_verdicts(report: dict[str, Any]) -> list[str]:
    out = ["", "## Verdicts", ""]
    out += [f"- **{path}**: {line_of(v)}" for path, v in report["verdicts"].items()]
    out += [
        "",
        "| path | verdict | criterion | result | figure | reason |",
        "|---|---|---|---|---|---|",
    ]
    for path, v in report["verdicts"].items():
        for name, c in criteria_in_order(v):
            reason = c["reason"].replace("|", "/")
            if name == "compatibility":
                reason = f"[details](#{compat_anchor(path)}): {reason}"
            out.append(
                f"| {path} | **{v['verdict']}** | {name} | {c['result']} | {c.get('figure', '')} | {reason} |"
            )
    return out


def _md_system(report: dict[str, Any], kind: TrialKind) -> list[str]:
    inputs = report["inputs"]
    out = [
        "",
        "## System and inputs",
        "",
        f"Inputs: seed {inputs['seed']}; {kind.render.inputs(inputs)}.",
        "",
    ]
    out += [
        "| path | host | backend | device | mode | precision | torch | resource class |",
        "|" + "---|" * 8,
    ]
    config = {p["name"]: p for p in report["configuration"]["paths"]}
    for name, s in _rows(report):
        i = s.get("info") or {}
        out.append(
            f"| {name} | {s.get('host', '')} | {i.get('backend', '')} | {i.get('device_name', '')} | "
            f"{config[name]['mode']} | {config[name]['precision']} | {i.get('torch_version', '')} | "
            f"{i.get('resource_class', '')} |"
        )
    out.append("")
    out.append("Placement (paths on one host were measured one after another): " + "; ".join(
        f"{h}: {', '.join(p)}" for h, p in report["placement"].items()))  # fmt: skip
    artifacts = report.get("artifacts") or {}
    if artifacts.get("paths"):
        agree = "all paths of a version agree" if artifacts.get("consistent") else "paths DISAGREE"
        out += ["", f"Artifacts checked before measuring ({agree}): " + "; ".join(
            f"{path} {a['model']}:{a['version'] or 'default'} sha256 {a['sha256'] or 'not loaded'}"
            for path, a in artifacts["paths"].items())]  # fmt: skip
    return out


def _md_path(kind: TrialKind, name: str, s: dict[str, Any]) -> list[str]:
    out = ["", f"## {name} ({s['role']})", ""]
    p = s.get("prepare") or {}
    if p:
        out.append(
            f"- prepare: checkpoint load {p['checkpoint_load_s']:.3f} s, to-device "
            f"{p['to_device_s']:.3f} s, "
            f"compile/warm-up {p['compile_s']:.3f} s, total {p['total_s']:.3f} s"
        )
    out += ["", f"### Compatibility: {name}", "", "| finding | value |", "|---|---|"]
    out += [f"| {k} | {v.replace('|', '/')} |" for k, v in _compat_rows(s)]
    out.append("")
    out += kind.render.correctness(s.get("correctness") or {})
    out += _perf_lines(kind, s)
    out += kind.render.training(s.get("training") or {})
    out += _md_economics(s.get("economics") or {}, p)
    out += kind.render.cost(s)
    if s.get("timeline"):
        out.append("- timeline: " + ", ".join(
            f"{phase} {span[0][11:19]}-{span[-1][11:19]}"
            for phase, span in sorted(s["timeline"].items(), key=lambda kv: kv[1][0])))  # fmt: skip
    for phase, err in s.get("errors", {}).items():
        out.append(f"- error in {phase}: {err}")
    out += [f"- note: {n}" for n in s.get("notes", [])]
    return out


def _md_economics(e: dict[str, Any], p: dict[str, Any]) -> list[str]:
    if "total_micros" not in e:
        return [f"- economics: unpriced ({e.get('problem', '')})"] if e else []
    out = [
        f"- economics: total {_money(e['total_micros'], e['currency'])} (busy "
        f"{_money(e['busy_micros'])}, "
        f"idle {_money(e['idle_micros'])}, preparation {_money(e['prepare_micros'])}); "
        f"{e['jobs_completed']} jobs completed, {e['jobs_failed']} failed; cost per completed job "
        + (
            # exact: per 1,000 or 1,000,000 jobs when one costs under a micro-unit
            money.per_job_text(e["total_micros"], e["jobs_completed"], e["currency"])
            if e["jobs_completed"]
            else "n/a"
        )
    ]
    if e.get("example_priced_lines"):
        out.append(f"- prices: {e['example_priced_lines']} lines charged {EXAMPLE_PRICES}")
    done, failed = e["jobs_completed"], e["jobs_failed"]
    adaptations = (p.get("compatibility") or {}).get("adaptations") or [] if p else []
    out.append(
        f"- availability {done / (done + failed):.2%} of {done + failed} requests; "
        if done + failed
        else "- availability: no requests; "
    )
    out[-1] += f"adaptations the path needed (effort): {len(adaptations)}" + (
        f" ({'; '.join(adaptations)})" if adaptations else ""
    )
    return out


def line_of(verdict: dict[str, Any]) -> str:
    """The verdict line (reports stored before it existed get one built from the criteria)."""
    if verdict.get("line"):
        return str(verdict["line"])
    parts = [f"{n} {c['result']}" for n, c in criteria_in_order(verdict)]
    return f"{verdict['verdict']}: " + "; ".join(parts)


def _charts(report: dict[str, Any]) -> list[str]:
    rows = _rows(report)
    svgs = kind_of_report(report).render.charts(rows)
    svgs.append(_cost_chart(rows))
    prep = {
        name: [(s.get("prepare") or {}).get(k) for k in ("checkpoint_load_s", "to_device_s", "compile_s")]
        for name, s in rows
    }
    svgs.append(
        charts.bar_chart(
            "Preparation by phase", "s", ["checkpoint load", "to device", "compile/warm-up"], prep
        )
    )
    return svgs


def _cost_chart(rows: Rows) -> str:
    # From the exact total / jobs (not the per-job figure rounded to a micro-unit, which is 0
    # for a job that costs less), per 1, 1,000 or 1,000,000 jobs so that every bar shows.
    exact: dict[str, Any] = {}
    currency = ""
    for name, s in rows:
        e = s.get("economics") or {}
        currency = currency or e.get("currency", "")
        if e.get("jobs_completed") and e.get("total_micros") is not None:
            exact[name] = money.per_job(e["total_micros"], e["jobs_completed"])
    scale = money.scale_for(exact.values())
    cost: dict[str, list[float | None]] = {
        name: [float(exact[name] * scale) / 1e6 if name in exact else None] for name, _ in rows
    }
    label = money.per_label(scale)
    return charts.bar_chart(
        f"Cost per completed job ({label})",
        f"{currency} {label}" if currency else "unpriced",
        [f"cost {label}"],
        cost,
    )


CSS = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;
text-align:left;vertical-align:top}.ADOPT{color:#1a7f37;font-weight:bold}.REJECT{color:#cf222e;font-weight:bold}
.INCONCLUSIVE{color:#9a6700;font-weight:bold}
.r-fail{color:#cf222e}.r-warn{color:#9a6700}svg{display:block;margin:1em 0}pre{white-space:pre-wrap;
font-size:12px;background:#f6f8fa;padding:8px}.details li{margin:2px 0;font-size:14px}
.details code{background:#f6f8fa;padding:0 3px}"""


def _details_html(text: str) -> str:
    """The Markdown details as HTML (raw HTML in the text is escaped, never passed through)."""
    return str(MarkdownIt("commonmark", {"html": False}).enable("table").render(text))


def html(report: dict[str, Any]) -> str:
    """One self-contained page: verdicts, charts (inline SVG), the Markdown details, the spec."""

    def reason(path: str, name: str, c: dict[str, str]) -> str:
        if name != "compatibility":
            return escape(c["reason"])
        return f"<a href='#{compat_anchor(path)}'>details</a>: {escape(c['reason'])}"

    verdict_rows = "".join(
        f"<tr><td>{escape(path)}</td><td class='{v['verdict']}'>{v['verdict']}</td><td>{escape(name)}</td>"
        f"<td class='r-{escape(c['result'])}'>{escape(c['result'])}</td>"
        f"<td>{escape(c.get('figure', ''))}</td>"
        f"<td>{reason(path, name, c)}</td></tr>"
        for path, v in report["verdicts"].items()
        for name, c in criteria_in_order(v)
    )
    lines = "".join(
        f"<li><b>{escape(path)}</b>: <span class='{v['verdict']}'>{escape(line_of(v))}</span></li>"
        for path, v in report["verdicts"].items()
    )
    compat = "".join(
        f"<h3 id='{compat_anchor(name)}'>Compatibility: {escape(name)} ({escape(s['role'])})</h3>"
        "<table><tr><th>finding</th><th>value</th></tr>"
        + "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in _compat_rows(s))
        + "</table>"
        for name, s in _rows(report)
    )
    body = [
        f"<h1>Trial {escape(report['trial_id'])}: {escape(report['model']['name'])}</h1>",
        f"<p>Status <b>{escape(report['status'])}</b>; reference path <b>{escape(report['reference'])}</b>; "
        f"{escape(report['started'])} to {escape(report['ended'])} ({report['duration_s']:.1f} s).</p>",
        f"<h2>Verdicts</h2><ul>{lines}</ul>",
        "<table><tr><th>path</th><th>verdict</th><th>criterion</th><th>result</th><th>figure</th>"
        f"<th>reason</th></tr>{verdict_rows}</table>",
        f"<h2>Compatibility</h2>{compat}",
        "<h2>Charts</h2>",
        *_charts(report),
        "<h2>Details</h2>",
        f"<div class='details'>{_details_html(markdown(report))}</div>",
        "<h2>Spec</h2>",
        f"<pre>{escape(json.dumps(report['spec'], indent=2))}</pre>",
    ]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>Trial {escape(report['trial_id'])}</title><style>{CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def render(report: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report, indent=2) + "\n"
    if fmt == "md":
        return markdown(report)
    return html(report)
