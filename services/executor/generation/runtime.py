"""The generation engine's device side: the model's steps prepared by the backend (eager,
inductor, XLA), the static KV cache, and the warm-up that compiles every graph the engine
will ever run (one per prompt bucket and one per decode width) before the model turns READY.

Compiled graphs take only the warmed buckets' shapes, so an iteration there is a decode step
over the leading slots (up to a decode bucket) and then each prompt alone (padded to its
bucket). Eager has no graph to keep, so it runs an iteration as one mixed step
(`models.CausalLM.mixed`): the decode rows in use and every prompt whole, in one forward.
"""

from __future__ import annotations

import bisect
import time

import torch
from torch import nn

from services.executor.backends.base import PRECISIONS, Backend, CompileCounters, PreparedModel
from services.executor.generation.kv_cache import StaticKVCache
from services.executor.generation.models import Step, causal_lm_for
from services.executor.generation.packed_linear import pack_linears
from services.executor.generation.settings import GenerationSettings
from services.executor.load_phases import (
    Findings,
    LoadOptions,
    PhaseTimes,
    during_load,
    to_device,
    unsupported_dtypes,
)
from switchyard.errors import InvalidArgument
from switchyard.models.registry import ModelSpec

DecodeRow = tuple[int, int, int]  # (slot, token, position)
Prompt = tuple[int, list[int]]  # (slot, ids)


class GenerationRuntime:
    """The device side: prepared steps, the cache, warm-up and compile counters."""

    def __init__(
        self, module: nn.Module, settings: GenerationSettings, backend: Backend, mode: str, dtype: torch.dtype
    ) -> None:
        self.settings = settings
        self.backend = backend
        # eager on the host CPU: the linear layers on oneDNN over packed weights (packed_linear)
        on_host = mode == "eager" and backend.device().type == "cpu" and dtype == torch.float32
        self.packed_linears = pack_linears(module) if on_host else 0
        self.lm = causal_lm_for(module)
        if settings.max_context > self.lm.max_positions:
            raise InvalidArgument(
                f"[generation] max_context is {settings.max_context}, but the model has "
                f"{self.lm.max_positions} positions; lower max_context"
            )
        self.device = backend.device()
        self.cache = StaticKVCache(
            self.lm.cache_shape, settings.decode_slots, settings.max_context, dtype, self.device
        )
        layers = self.lm.cache_shape.layers
        self.prefill_step: PreparedModel = backend.prepare(Step(self.lm, layers, "prefill", 3), mode)
        self.decode_step: PreparedModel = backend.prepare(Step(self.lm, layers, "decode", 2), mode)
        self.eos_token_ids = settings.eos_token_ids or self.lm.eos_token_ids
        # compiled graphs (XLA, TPU, inductor) take only the warmed buckets' shapes: a decode
        # step per width, then each prompt alone, padded to its bucket. Eager runs an
        # iteration as one mixed step at its own shapes: the decode rows in use and every
        # prompt whole, so the matmuls run once over all of them and nothing is padding.
        pad_to_buckets = backend.static_shapes or mode == "compile"
        mixed = Step(self.lm, layers, "mixed", 5)
        self.mixed_step = None if pad_to_buckets else backend.prepare(mixed, mode)
        self._warm = 0
        self.warm_prefill_s: dict[int, float] = {}
        self.warm_decode_s: dict[int, float] = {}

    @property
    def vocab_size(self) -> int:
        return int(self.lm.vocab_size)

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.cache.keys, *self.cache.values]

    def _run(self, step: PreparedModel, inputs: list[torch.Tensor]) -> torch.Tensor:
        moved = [t.to(self.device) for t in inputs]
        with self.backend.inference_context():
            out = step.run([*moved, *self._tensors()])
        self.backend.synchronize()
        # float64 logits stay float64, so a golden run's logprobs carry no float32 rounding
        wide = torch.float64 if out.dtype == torch.float64 else torch.float32
        return out.detach().to("cpu", wide)  # type: ignore[no-any-return]

    def bucket_for(self, length: int) -> int:
        return _smallest_fit(self.settings.prompt_buckets, length)

    def step(self, decodes: list[DecodeRow], prompts: list[Prompt]) -> torch.Tensor:
        """One iteration: a decode step over `decodes` ((slot, token, position), in slot order)
        and the prefill of `prompts` ((slot, ids)); the logits [len(decodes) + len(prompts),
        vocab], decode rows first. The prompts' slots' cache rows hold them after it."""
        if self.mixed_step is None:
            return self._bucketed(decodes, prompts)
        tokens = [t for _, t, _ in decodes] + [t for _, ids in prompts for t in ids]
        positions = [p for _, _, p in decodes] + [p for _, ids in prompts for p in range(len(ids))]
        slots = [s for s, _, _ in decodes] + [s for s, ids in prompts for _ in ids]
        inputs = [torch.tensor(v, dtype=torch.int64) for v in (tokens, positions, slots)]
        counts = torch.tensor([len(ids) for _, ids in prompts], dtype=torch.int64)
        return self._run(self.mixed_step, [*inputs, torch.tensor(len(decodes)), counts])

    def _bucketed(self, decodes: list[DecodeRow], prompts: list[Prompt]) -> torch.Tensor:
        """The step on compiled graphs: the decode first, over the leading slots up to a decode
        bucket (a free row inside it is computed and dropped; only a prefill, below, writes it
        again, whole), then each prompt alone, padded to its bucket."""
        rows: list[torch.Tensor] = []
        if decodes:
            width = _smallest_fit(self.settings.decode_buckets, decodes[-1][0] + 1)
            t, p = [0] * width, [0] * width
            for slot, token, position in decodes:
                t[slot], p[slot] = token, position
            logits = self._run(self.decode_step, [torch.tensor(t), torch.tensor(p)])
            rows.append(logits[torch.tensor([slot for slot, _, _ in decodes])])
        for slot, ids in prompts:
            padded = torch.zeros((1, self.bucket_for(len(ids))), dtype=torch.int64)
            padded[0, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            length = torch.tensor([len(ids)], dtype=torch.int64)
            rows.append(
                self._run(self.prefill_step, [padded, length, torch.tensor([slot], dtype=torch.int64)])
            )
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def warm(self) -> None:
        """Runs every prefill bucket and decode width once (compiling each on compiling paths),
        then takes the counters that `compilations_after_warmup` is measured from."""
        for bucket in self.settings.prompt_buckets:
            prompt = [(0, [1] * bucket)]
            self.step([], prompt)
            begin = time.perf_counter()
            self.step([], prompt)
            self.warm_prefill_s[bucket] = time.perf_counter() - begin
        for width in self.settings.decode_buckets:
            rows = [(slot, 0, 0) for slot in range(width)]
            self.step(rows, [])
            begin = time.perf_counter()
            self.step(rows, [])
            self.warm_decode_s[width] = time.perf_counter() - begin
        self._warm = self.compilations()

    def warm_step_s(self) -> float:
        """The longest iteration the warm-up saw: the widest decode and the most prefills of the
        longest bucket (0 before warm-up)."""
        prefill = max(self.warm_prefill_s.values(), default=0.0) * self.settings.max_prefills_per_step
        return prefill + max(self.warm_decode_s.values(), default=0.0)

    def compilations(self) -> int:
        return self.prefill_step.counters().compilations + self.decode_step.counters().compilations

    def counters(self) -> CompileCounters:
        a, b = self.prefill_step.counters(), self.decode_step.counters()
        return CompileCounters(
            compilations=a.compilations + b.compilations,
            cached_compilations=a.cached_compilations + b.cached_compilations,
            compile_time_s=a.compile_time_s + b.compile_time_s,
            graph_breaks=max(a.graph_breaks, b.graph_breaks),
            graph_break_reasons=tuple(sorted({*a.graph_break_reasons, *b.graph_break_reasons})),
            recompiles=a.recompiles + b.recompiles,
            fallback_ops=a.fallback_ops or b.fallback_ops,
            notes=a.notes + b.notes,
        )

    def compilations_after_warmup(self) -> int:
        return self.compilations() - self._warm


def load_runtime(
    spec: ModelSpec, backend: Backend, options: LoadOptions
) -> tuple[GenerationRuntime, PhaseTimes, Findings]:
    """A causal LM loaded and warm: the generation runtime, every prefill bucket and decode
    width warmed, with the time of each phase and the load's findings."""
    settings = spec.generation
    assert settings is not None  # a causal LM's model.toml has [generation]
    times, findings = PhaseTimes(), Findings()
    module = to_device(spec, backend, options, times)
    before = backend.counters()
    start = time.perf_counter()
    runtime = GenerationRuntime(module, settings, backend, options.mode, PRECISIONS[options.precision])
    runtime.warm()
    backend.synchronize()
    times.compile_s = time.perf_counter() - start
    findings.during_load = during_load(runtime.counters(), backend.counters().since(before))
    findings.adaptations = [
        f"generation: static KV cache of {settings.decode_slots} slots x "
        f"{settings.max_context} positions ({runtime.cache.nbytes} bytes); "
        f"prefill buckets {list(settings.prompt_buckets)}, "
        f"decode widths {list(settings.decode_buckets)}"
    ]
    if runtime.packed_linears:
        findings.adaptations.append(
            f"generation: {runtime.packed_linears} linear layers on oneDNN, their weights packed at load"
        )
    findings.unsupported_dtypes = unsupported_dtypes(backend)
    return runtime, times, findings


def _smallest_fit(buckets: tuple[int, ...], n: int) -> int:
    """The smallest of the ascending `buckets` that holds `n` (the engine admits no more)."""
    return buckets[bisect.bisect_left(buckets, n)]
