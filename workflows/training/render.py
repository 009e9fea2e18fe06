"""The training kind's report sections: the loss per step, a distributed plan's two runs with
their sizes, the distributed curve against the single-process one, the scaling, and the loss
chart. The tensor sections come first (workflows/tensor/render.py); workflows/report/render.py
places them.
"""

from __future__ import annotations

from typing import Any

from workflows.pipeline.kind import Rows
from workflows.report import charts
from workflows.tensor.render import TensorRender


class TrainingRender(TensorRender):
    """A training trial's report: the tensor trial's sections, then the training's."""

    def training(self, training: dict[str, Any]) -> list[str]:
        out = []
        if training.get("loss"):
            out.append(
                f"- training: {len(training['loss'])} steps, final loss {training['loss'][-1]:.5f}, "
                f"{training['total_s']:.2f} s"
            )
        return out + distributed_lines(training.get("distributed") or {})

    def charts(self, rows: Rows) -> list[str]:
        svgs = super().charts(rows)
        losses = {name: s["training"]["loss"] for name, s in rows if (s.get("training") or {}).get("loss")}
        if losses:
            svgs.append(charts.line_chart("Training loss per step", "step", "loss", losses))
        return svgs


TRAINING_RENDER = TrainingRender()


def distributed_lines(d: dict[str, Any]) -> list[str]:
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
