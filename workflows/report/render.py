"""Rendering a stored trial report (JSON) as Markdown or as one self-contained HTML page.

Every figure is printed with its basis: input sizes, batch, concurrency, iterations and
duration for timings; currency and micro-units for money; the tolerance's justification for
correctness. The HTML page carries its charts as inline SVG (workflows/charts.py).
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from markdown_it import MarkdownIt

from switchyard import money
from workflows.generation import render as render_generation
from workflows.report import charts

CRITERIA_ORDER = ("trial", "correctness", "compatibility", "latency", "training", "cost")


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


def _perf_lines(state: dict[str, Any]) -> list[str]:
    perf = state.get("performance") or {}
    if "skipped" in perf:
        return [f"skipped: {perf['skipped']}"]
    lines = []
    for s in perf.get("scenarios", []):
        sizes = ", ".join(f"{k} {v}" for k, v in s["input_sizes"].items())
        lines.append(
            f"{s['scenario']} batch {s['batch_size']} x{s['concurrency']}: p50 {s['p50_ms']:.3f} ms, "
            f"p90 {s['p90_ms']:.3f}, p95 {s['p95_ms']:.3f}, p99 {s['p99_ms']:.3f} ms; "
            f"{s['throughput']:.1f} {s['throughput_unit']} ({s['iterations']} requests in "
            f"{s['seconds']:.2f} s; "
            f"inputs {sizes}; {s['failed']} failed)"
        )
    if perf.get("memory_total_bytes"):
        used = perf["memory_total_bytes"] - perf["memory_min_available_bytes"]
        lines.append(
            f"device memory: peak in use while measuring {used / 2**20:,.0f} MiB of "
            f"{perf['memory_total_bytes'] / 2**20:,.0f} MiB (device-wide, sampled via Describe)"
        )
    if perf:
        lines.append(
            f"compilations/recompiles while measuring: "
            f"{perf['compilations_after'] - perf['compilations_before']}"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    out = [f"# Trial {report['trial_id']}: {report['model']['name']}", ""]
    out.append(f"Status **{report['status']}**, {report['started']} to {report['ended']} "
               f"({report['duration_s']:.1f} s). Reference path: **{report['reference']}**.")  # fmt: skip
    if report.get("cancel_reason"):
        out.append(f"Cancelled: {report['cancel_reason']}.")
    out += _md_verdicts(report) + _md_system(report)
    for name, s in _rows(report):
        out += _md_path(name, s)
    if any((st.get("performance") or {}).get("levels") for _, st in _rows(report)):
        out += render_generation.definitions_lines()
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


def _md_system(report: dict[str, Any]) -> list[str]:
    inputs = report["inputs"]
    tensors = (
        ", ".join(f"{t['name']} {t['datatype']} {t['shape']}" for t in inputs["tensors"]) or inputs["file"]
    )
    if inputs.get("prompts"):
        tensors = render_generation.prompts_text(inputs["prompts"])
    out = ["", "## System and inputs", "", f"Inputs: seed {inputs['seed']}; {tensors}.", ""]
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


def _md_path(name: str, s: dict[str, Any]) -> list[str]:
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
    out += _md_correctness(s.get("correctness") or {})
    out += render_generation.correctness_lines(s.get("correctness") or {})
    out += [f"- performance: {line}" for line in _perf_lines(s)]
    out += render_generation.performance_lines(s.get("performance") or {})
    tr = s.get("training") or {}
    if tr.get("loss"):
        out.append(
            f"- training: {len(tr['loss'])} steps, final loss {tr['loss'][-1]:.5f}, {tr['total_s']:.2f} s"
        )
    out += _distributed_lines(tr.get("distributed") or {})
    out += _md_economics(s.get("economics") or {}, p)
    out += [line for line in [render_generation.cost_line(s)] if line]
    if s.get("timeline"):
        out.append("- timeline: " + ", ".join(
            f"{phase} {span[0][11:19]}-{span[-1][11:19]}"
            for phase, span in sorted(s["timeline"].items(), key=lambda kv: kv[1][0])))  # fmt: skip
    for phase, err in s.get("errors", {}).items():
        out.append(f"- error in {phase}: {err}")
    out += [f"- note: {n}" for n in s.get("notes", [])]
    return out


def _md_correctness(corr: dict[str, Any]) -> list[str]:
    out = []
    for o in (corr.get("against_float64") or {}).get("outputs", []):
        m = o["metrics"]
        out.append(
            f"- own error against the float64 run `{o['output']}`: rmse {m['reference_rmse']:.3g}, "
            f"deterministic {m['reference_deterministic']} (repeat max abs diff "
            f"{m['reference_repeat_max_abs']:.3g})"
        )
    for o in corr.get("outputs", []):
        m = o["metrics"]
        out.append(
            f"- correctness `{o['output']}`: {'PASS' if o['passed'] else 'FAIL'}; max abs "
            f"{m['max_abs_error']:.3g}, "
            f"rmse {m['rmse']:.3g} (allowed {m['allowed_rmse']:.3g}), cosine {m['cosine']:.6f}"
        )
        out.append(f"  - tolerance: {o['justification']}")
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
    svgs = _latency_charts(rows)
    losses = {name: s["training"]["loss"] for name, s in rows if (s.get("training") or {}).get("loss")}
    if losses:
        svgs.append(charts.line_chart("Training loss per step", "step", "loss", losses))
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


def _latency_charts(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Percentiles per scenario across paths, then each path's single-stream histogram."""
    svgs: list[str] = []
    scenario_keys: list[tuple[str, int]] = []
    for _, s in rows:
        for sc in (s.get("performance") or {}).get("scenarios", []):
            key = (sc["scenario"], sc["batch_size"])
            if key not in scenario_keys:
                scenario_keys.append(key)
    for scenario, batch in scenario_keys:
        series: dict[str, list[float | None]] = {}
        for name, s in rows:
            found = [x for x in (s.get("performance") or {}).get("scenarios", [])
                     if (x["scenario"], x["batch_size"]) == (scenario, batch)]  # fmt: skip
            series[name] = [found[0][k] if found else None for k in ("p50_ms", "p90_ms", "p95_ms", "p99_ms")]
        svgs.append(
            charts.bar_chart(f"Latency, {scenario} batch {batch}", "ms", ["p50", "p90", "p95", "p99"], series)
        )
    for i, (name, s) in enumerate(rows):
        for sc in (s.get("performance") or {}).get("scenarios", []):
            if sc["scenario"] == "single-stream":
                svgs.append(charts.histogram(f"Latency distribution, {name} single-stream batch 1",
                                             sc["histogram_ms"], sc["histogram_counts"], i))  # fmt: skip
    return svgs


def _cost_chart(rows: list[tuple[str, dict[str, Any]]]) -> str:
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


def _distributed_lines(d: dict[str, Any]) -> list[str]:
    """training.distributed: both runs with their sizes, the curve check and the scaling."""
    if not d:
        return []
    lines = []
    for key in ("single_process", "distributed"):
        r = d[key]
        comm = f"{r['comm_share']:.1%} of step time" if r["comm_share"] is not None else "not separated"
        memory = ", ".join(f"rank {k['rank']} {k['peak_memory_bytes'] / 2**20:.0f} MiB" for k in r["ranks"])
        lines.append(
            f"  - {r['strategy']} on {r['process_group_backend']} ({r['launch']}), world size "
            f"{r['world_size']}, {r['per_rank_batch']} per rank = global batch {r['global_batch']} "
            f"x {r['tokens_per_sample']} tokens: {r['samples_per_s']:.1f} samples/s, "
            f"{r['tokens_per_s']:.0f} tokens/s (median step {r['median_step_s'] * 1e3:.1f} ms after the "
            f"first); communication {comm}; final loss {r['loss'][-1]:.5f}; peak memory "
            f"{memory} ({r['ranks'][0]['memory_source']})"
        )
    c = d["against_single_process"]
    lines.append(
        f"  - against the single-process curve: {'PASS' if c['passed'] else 'FAIL'}, max relative "
        f"deviation {c['max_relative_deviation']:.2e} ({c['justification']})"
    )
    sc = d["scaling"]
    lines.append(
        f"  - scaling world size {sc['world_sizes'][0]} -> {sc['world_sizes'][1]} at global batch "
        f"{sc['global_batch']}: speed-up {sc['speedup']:.2f}x, efficiency {sc['efficiency']:.0%} "
        f"({sc['basis']})"
    )
    return lines
