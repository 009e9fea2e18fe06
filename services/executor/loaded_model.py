"""One loaded model: its load phases and batch compute on the backend.

Loading times each phase separately (checkpoint load, to-device, compile/warm-up of every
batch bucket, the device synchronised before each timer stops) and records the backend's
compatibility findings. The model is READY only after every bucket is warmed; the counters
taken then are the baseline for `compilations_after_warmup`, which must stay 0 while serving.

Float outputs come back in the loaded precision (an fp64 golden run is not rounded to fp32).
A request's inputs reach a batch already checked against the declaration by the data plane
(`data_plane.model_arrays`); float inputs come as the loaded precision's datatype
(`wire_datatype`) or as FP32. Compute runs on the executor's single device thread.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from services.executor.backends.base import PRECISIONS, Backend, CompileCounters, PreparedModel
from services.executor.batching import Batcher, Phases, QueuedRequest
from services.executor.generation.engine import LocalEngine
from services.executor.generation.engine_client import EngineClient, LoadedEngine
from services.executor.generation.engine_process import EngineProcess
from services.executor.generation.runtime import load_runtime
from services.executor.load_phases import (
    Findings,
    LoadOptions,
    PhaseTimes,
    during_load,
    to_device,
    unsupported_dtypes,
)
from switchyard import codec
from switchyard.models.registry import ModelSpec, TensorSpec

log = logging.getLogger(__name__)


def _float_datatype(precision: str) -> str:
    return codec.oip_datatype(PRECISIONS[precision])


class LoadedModel:
    def __init__(
        self, spec: ModelSpec, backend: Backend, options: LoadOptions, engine_process: bool = False
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.options = options
        self.state = "LOADING"
        self.error = ""
        self.times = PhaseTimes()
        self.findings = Findings()
        self.prepared: PreparedModel | None = None
        self.batcher: Batcher | None = None
        self.generation: LoadedEngine | None = None  # a causal LM, loaded and warm
        self.engine: EngineClient | None = None  # its engine's client, once READY
        self.engine_process = engine_process  # a causal LM's engine in a process of its own
        self.generation_settings = spec.generation  # [generation] of model.toml, read once
        self.sha256 = spec.sha256
        self._warm_counters = CompileCounters()
        self.warm_compute_s: dict[int, float] = {}
        # Input shapes (batch padded) computed so far: with padding on (static shapes, compiled
        # graphs) a shape not among them compiles on its first run, seconds of work that holds
        # the GIL, so it must go to the device thread, never inline on the event loop.
        self._run_shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._datatypes = {
            np.dtype(codec.element_dtype(d)): d for d in codec.DATATYPES if d not in ("BYTES", "BF16")
        }
        self.dtype = PRECISIONS[options.precision]
        self.float_datatype = _float_datatype(options.precision)  # floats' datatype on the wire
        self.wire_outputs = tuple((s.name, self.wire_datatype(s)) for s in spec.outputs)
        self.device = backend.device()
        # static-shape backends and compiled graphs pad to a bucket so no new shape appears
        self.pad_to_buckets = backend.static_shapes or options.mode == "compile"

    # ---- declared tensors -------------------------------------------------------------
    def wire_datatype(self, spec: TensorSpec) -> str:
        return self.float_datatype if spec.floating else spec.datatype

    @property
    def max_batch(self) -> int:
        return max(self.options.batch_buckets)

    # ---- loading (runs on the device thread) ------------------------------------------
    def load(self) -> None:
        if self.generation_settings is not None:  # a causal LM: its engine's load
            if self.engine_process:
                self.generation = EngineProcess.start(
                    self.spec, self.options, self.backend.name, torch.get_num_threads()
                )
            else:
                self.generation = LocalEngine(*load_runtime(self.spec, self.backend, self.options))
            self.times, self.findings = self.generation.times, self.generation.findings
            return
        module = to_device(self.spec, self.backend, self.options, self.times)
        before = self.backend.counters()
        start = time.perf_counter()
        self.prepared = self.backend.prepare(module, self.options.mode)
        generator = torch.Generator().manual_seed(0)
        examples = {b: self.spec.example_inputs(b, generator) for b in self.options.batch_buckets}
        for inputs in examples.values():
            self._run_tensors(inputs)
        self.backend.synchronize()
        self.times.compile_s = time.perf_counter() - start
        for bucket, inputs in examples.items():  # warm timings, for the inline-compute decision
            samples = []
            for _ in range(3):  # the fastest of three: one sample on a busy host misleads
                begin = time.perf_counter()
                self._run_tensors(inputs)
                samples.append(time.perf_counter() - begin)
            self.warm_compute_s[bucket] = min(samples)
        own = self.prepared.counters()
        process = self.backend.counters().since(before)
        self.findings.during_load = during_load(own, process)
        self.findings.adaptations = list(self.prepared.adaptations)
        self.findings.unsupported_dtypes = unsupported_dtypes(self.backend)
        self._warm_counters = own

    def compilations_after_warmup(self) -> int:
        if self.generation is not None:
            return self.generation.compilations_after_warmup()
        if self.prepared is None:
            return 0
        return self.prepared.counters().compilations - self._warm_counters.compilations

    def fallback_ops_after_warmup(self) -> tuple[tuple[str, int], ...]:
        """Host-fallback op calls since READY (cumulative), where the backend counts them."""
        if self.prepared is None or self.state != "READY":
            return ()
        return self.prepared.counters().since(self._warm_counters).fallback_ops

    # ---- requests ---------------------------------------------------------------------
    def expected_compute_s(self, arrays: list[np.ndarray], rows: int) -> float:
        """The warm time of a batch of these inputs; infinite where it would compile first."""
        bucket = self.bucket_for(rows)
        if self.pad_to_buckets and tuple((bucket, *a.shape[1:]) for a in arrays) not in self._run_shapes:
            return float("inf")  # a shape never run: XLA or inductor compiles it first
        return self.warm_compute_s.get(bucket, float("inf"))

    def bucket_for(self, rows: int) -> int:
        buckets = self.options.batch_buckets
        return buckets[bisect.bisect_left(buckets, rows)]

    def compute(self, batch: list[QueuedRequest]) -> tuple[list[list[np.ndarray]], Phases, int]:
        """Assembles, pads, runs and splits one batch (device thread); returns the time of
        each phase (Triton's compute input, infer and output)."""
        start = time.perf_counter_ns()
        rows = sum(item.rows for item in batch)
        padded = self.bucket_for(rows) if self.pad_to_buckets else rows
        tensors = []
        for i, _s in enumerate(self.spec.inputs):
            first = batch[0].arrays[i]
            if len(batch) == 1 and padded == rows:
                buf = first
            else:
                # the one copy of a batch: stack requests, zero rows pad up to the bucket
                buf = np.zeros((padded, *first.shape[1:]), dtype=first.dtype)
                at = 0
                for item in batch:
                    buf[at : at + item.rows] = item.arrays[i]
                    at += item.rows
            datatype = self._datatypes.get(buf.dtype, "BF16")  # uint16 on the wire is always BF16
            tensors.append(codec.to_torch(buf, datatype))
        serving = self.state == "READY"
        compiled = self.compilations_after_warmup() if serving else 0
        assembled = time.perf_counter_ns()
        outputs = self._run_tensors(tensors)
        computed = time.perf_counter_ns()
        if serving and self.compilations_after_warmup() > compiled:
            log.warning(
                "%s:%s compiled while serving: a batch of %d request(s), %d rows padded to %d, "
                "input shapes %s (warm this shape at load, or expect a compile per new shape)",
                self.spec.name, self.spec.version, len(batch), rows, padded,
                [tuple(t.shape) for t in tensors],
            )  # fmt: skip
        per_request: list[list[np.ndarray]] = [[] for _ in batch]
        for out in outputs:
            arr = (
                out.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else out.numpy()
            )
            at = 0
            for j, item in enumerate(batch):
                per_request[j].append(arr[at : at + item.rows])
                at += item.rows
        phases = Phases(assembled - start, computed - assembled, time.perf_counter_ns() - computed)
        return per_request, phases, padded

    def _run_tensors(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        assert self.prepared is not None
        device = self.device
        if device.type == "cpu" and all(t.dtype == self.dtype or not t.is_floating_point() for t in tensors):
            moved = tensors  # already where and what they must be: skip no-op dispatches
        else:
            moved = [
                t.to(device=device, dtype=self.dtype) if t.is_floating_point() else t.to(device)
                for t in tensors
            ]
        with self.backend.inference_context():
            result = self.prepared.run(moved)
        self.backend.synchronize()
        if self.pad_to_buckets:
            self._run_shapes.add(tuple(tuple(t.shape) for t in tensors))
        outs = list(result) if isinstance(result, tuple | list) else [result]
        if device.type == "cpu":  # .to("cpu") and detach cost a dispatch even as no-ops
            return [o.detach() if o.requires_grad else o for o in outs]
        return [o.detach().to("cpu") for o in outs]
