"""The generation parts of a trial report in Markdown: where and why the paths diverged, every
serving metric with the lengths and the load beside it, the metrics' definitions, and the cost
per million output tokens (workflows/report/render.py places them)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from workflows.generation.metrics import DEFINITIONS, lengths_label, load_label
from workflows.pipeline.kind import Rows

METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E"))


def _ms(stats: dict[str, Any]) -> str:
    if stats.get("p50") is None:
        return "n/a"
    return (
        f"mean {stats['mean']:.2f}, p50 {stats['p50']:.2f}, p90 {stats['p90']:.2f}, p99 {stats['p99']:.2f} ms"
    )


def correctness_lines(corr: dict[str, Any]) -> list[str]:
    """The divergence rule's verdict, per prompt where and why the paths diverged."""
    rule = corr.get("against_float64") if corr.get("role") == "reference" else corr
    if not rule or rule.get("rule") != "generation":
        return []
    m = rule["metrics"]
    if corr.get("role") == "reference":
        rmse, worst = m.get("logprob_rmse_vs_reference", 0.0), m.get("max_abs_logprob_diff", 0.0)
        return [
            f"- own generations against the float64 run: {m.get('identical', 0)} of "
            f"{m.get('prompts', 0)} prompts identical; chosen-token logprob error rmse {rmse:.3g}, "
            f"max |diff| {worst:.3g} on {m.get('logprob_positions', 0)} positions "
            "(the basis of the candidates' allowed error)"
        ]
    head = "generation correctness"
    out = [
        f"- {head}: {'PASS' if rule['passed'] else 'FAIL'}"
        + (f" ({rule['finding']})" if rule.get("finding") else "")
        + f"; {m.get('identical', 0)} of {m.get('prompts', 0)} prompts identical, first divergence "
        + (f"at position {rule['first_divergence']}" if rule["first_divergence"] >= 0 else "none")
        + f"; logprob rmse {m.get('rmse') or 0.0:.3g}"
        + (f" (allowed {m['allowed_rmse']:.3g})" if m.get("allowed_rmse") else "")
        + f" on {m.get('logprob_positions', 0)} agreeing positions"
    ]
    out += [f"  - {r}" for r in rule["reasons"]]
    out.append(f"  - rule: {rule['justification']}")
    for s in rule["sequences"]:
        if s["first_divergence"] >= 0:
            out.append(
                f"  - prompt {s['index']}: {s['reason']}" + ("" if s["passed"] else " (fails the rule)")
            )
    return out


def performance_lines(perf: dict[str, Any]) -> list[str]:
    """Every metric of every load level, with its input/output lengths and load (Markdown list)."""
    out = []
    for level in perf.get("levels", []):
        where = f"{load_label(level['load'])}, {lengths_label(level)}"
        out.append(
            f"- generation at {where}: {level['completed']} completed, {level['failed']} failed in "
            f"{level['duration_s']:.2f} s"
        )
        out += [f"  - {name} ({where}): {_ms(level[key])}" for key, name in METRICS]
        good = level["goodput"]
        goodput = (
            f"; goodput {good['request_goodput']:.2f} req/s ({good['good']} of {level['completed']} met "
            + ", ".join(f"{k} <= {v:g}" for k, v in good["slo"].items())
            + ")"
            if good.get("request_goodput") is not None
            else "; goodput: no SLO in the policy"
        )
        out.append(
            f"  - throughput ({where}): {level['request_throughput']:.2f} req/s, output "
            f"{level['output_throughput']:.1f} tok/s, total {level['total_token_throughput']:.1f} tok/s"
            + goodput
        )
        if level.get("errors"):
            out.append(f"  - errors: {'; '.join(level['errors'])}")
    return out


def cost_line(state: dict[str, Any]) -> str:
    """Cost per million output tokens of the path (the trial's ledger cost / its output tokens)."""
    e, perf = state.get("economics") or {}, state.get("performance") or {}
    tokens = int(e.get("output_tokens") or perf.get("output_tokens") or 0)
    if "total_micros" not in e or not tokens:
        return ""
    per_million = Fraction(int(e["total_micros"]) * 1_000_000, tokens)
    prompt = int(e.get("prompt_tokens") or perf.get("prompt_tokens") or 0)
    ledger = e.get("cost_per_million_output_tokens_micros") or 0
    return (
        f"- cost per million output tokens: {float(per_million) / 1e6:,.6f} {e['currency']} "
        f"({int(e['total_micros'])} micro-units of trial cost over {tokens} output tokens, {prompt} prompt "
        "tokens)"
        + (
            f"; the ledger's busy cost of the generations alone: {ledger / 1e6:,.6f} per million"
            if ledger
            else ""
        )
    )


def lengths_text(lengths: dict[str, Any]) -> str:
    kind = lengths.get("distribution")
    if kind == "fixed":
        return f"{lengths['value']} tokens"
    if kind == "uniform":
        return f"{lengths['min']}-{lengths['max']} tokens (uniform)"
    return f"normal({lengths['mean']:g}, {lengths['std']:g}) tokens"


def prompts_text(p: dict[str, Any]) -> str:
    what = (
        f"{p['count']} text prompts"
        if p.get("texts")
        else f"{p['count']} prompts of {lengths_text(p['length'])}, ids in [{p['low']}, {p['high']})"
    )
    return f"{what}; greedy, {p['max_tokens']} new tokens each, EOS ignored"


def definitions_lines() -> list[str]:
    out = ["", "## Generation metrics (as vLLM's `bench serve` defines them)", ""]
    out += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    return out


class GenerationRender:
    def inputs(self, inputs: dict[str, Any]) -> str:
        return prompts_text(inputs["prompts"])

    def correctness(self, corr: dict[str, Any]) -> list[str]:
        return correctness_lines(corr)

    def performance(self, perf: dict[str, Any]) -> list[str]:
        return performance_lines(perf)

    def training(self, training: dict[str, Any]) -> list[str]:
        return []

    def cost(self, state: dict[str, Any]) -> list[str]:
        line = cost_line(state)
        return [line] if line else []

    def appendix(self, rows: Rows) -> list[str]:
        measured = any((state.get("performance") or {}).get("levels") for _, state in rows)
        return definitions_lines() if measured else []

    def charts(self, rows: Rows) -> list[str]:
        return []


GENERATION_RENDER = GenerationRender()
