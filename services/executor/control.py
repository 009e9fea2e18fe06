"""switchyard.v1.ExecutorControl: an adapter from control messages to `Executor`.

Describe, LoadModel (phase timings and compatibility findings), Unload, Train, ModelStatus
and GetLoad. LoadModel names a repository model and version only; no request can make the
executor import code (a factory runs only when the repository's model.toml names it and its
package is in the executor's allow-list).
"""

from __future__ import annotations

from services.executor import process_memory
from services.executor.backends.detect import device_info
from services.executor.executor_runtime import Executor, find_all
from services.executor.load_phases import LoadOptions
from services.executor.loaded_model import LoadedModel
from switchyard.field_copy import copy_fields
from switchyard.gen.switchyard.v1 import executor_pb2 as pb
from switchyard.gen.switchyard.v1 import executor_pb2_grpc as pb_grpc
from switchyard.grpcio import ServicerContext


def model_status(model: LoadedModel) -> pb.ModelStatus:
    options, findings = model.options, model.findings
    during = findings.during_load
    status = pb.ModelStatus(
        name=model.spec.name,
        version=model.spec.version,
        state=model.state,
        mode=options.mode,
        precision=options.precision,
        batch_buckets=list(options.batch_buckets),
        checkpoint_sha256=model.sha256,
        timings=copy_fields(pb.PhaseTimings, model.times),
        compatibility=pb.CompatibilityReport(
            fallback_ops=[pb.FallbackOp(op=op, count=n) for op, n in during.fallback_ops],
            graph_breaks=during.graph_breaks,
            graph_break_reasons=list(during.graph_break_reasons),
            recompiles=during.recompiles,
            unsupported_dtypes=findings.unsupported_dtypes,
            adaptations=findings.adaptations,
            compilations=during.compilations,
            cached_compilations=during.cached_compilations,
            compile_time_s=during.compile_time_s,
            compilations_after_warmup=model.compilations_after_warmup(),
            notes=list(during.notes),
            fallback_ops_after_warmup=[
                pb.FallbackOp(op=op, count=n) for op, n in model.fallback_ops_after_warmup()
            ],
        ),
        error=model.error,
        max_batch_size=model.max_batch,
        dynamic_batching=options.dynamic_batching,
        max_queue_delay_us=options.max_queue_delay_us,
        max_queue_size=options.max_queue_size,
    )
    if model.batcher is not None:
        status.counters.CopyFrom(copy_fields(pb.ModelCounters, model.batcher.counters))
    return status


class ControlServicer(pb_grpc.ExecutorControlServicer):
    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    async def Describe(self, request: pb.DescribeRequest, context: ServicerContext) -> pb.DescribeResponse:
        d = self.executor.describe()
        return pb.DescribeResponse(
            device=device_info(d.device),
            torch_version=d.torch_version,
            versions=d.versions,
            resource_class=d.resource_class,
            price_key=d.price_key,
            host=d.host,
            modes=list(d.modes),
            models=[model_status(m) for m in self.executor.models.values()],
            executor_id=self.executor.executor_id,
            registered_models=[f"{n}:{v}" for n, v in self.executor.registry.entries()],
            frames_port=self.executor.frames_port,
            memory=copy_fields(pb.ProcessMemory, process_memory.sample()),
        )

    async def LoadModel(self, request: pb.LoadModelRequest, context: ServicerContext) -> pb.LoadModelResponse:
        defaults = self.executor.default_options(request.model_name, request.version)
        manifest = self.executor.registry.get(request.model_name, request.version).manifest
        options = LoadOptions(
            mode=request.mode or defaults.mode,
            precision=request.precision or manifest.precision_for(self.executor.backend.name),
            batch_buckets=tuple(request.batch_buckets) or defaults.batch_buckets,
            max_queue_delay_us=request.max_queue_delay_us,
            max_queue_size=request.max_queue_size or defaults.max_queue_size,
            dynamic_batching=request.dynamic_batching,
            checkpoint_sha256=request.checkpoint_sha256,
        )
        model = await self.executor.load_model(request.model_name, request.version, options)
        return pb.LoadModelResponse(model=model_status(model))

    async def Unload(self, request: pb.UnloadRequest, context: ServicerContext) -> pb.UnloadResponse:
        await self.executor.unload(request.model_name, request.version)
        return pb.UnloadResponse()

    async def Train(self, request: pb.TrainRequest, context: ServicerContext) -> pb.TrainResponse:
        if request.HasField("distributed"):
            return await self._train_distributed(request)
        result = await self.executor.trainer.train(
            request.model_name, request.version, request.steps or 10, request.lr or 0.01, request.seed,
            request.batch_size or 8,
        )  # fmt: skip
        return pb.TrainResponse(loss=result.loss, step_seconds=result.step_seconds, total_s=result.total_s)

    async def _train_distributed(self, request: pb.TrainRequest) -> pb.TrainResponse:
        d = request.distributed
        run = await self.executor.trainer.train_distributed(
            request.model_name, request.version, request.steps or 10, request.lr or 0.01, request.seed,
            d.world_size or 1, d.strategy or "ddp", d.per_rank_batch or 4, d.timeout_s or 60.0,
            request.label,
        )  # fmt: skip
        report = pb.DistributedReport(
            process_group_backend=run.config.backend,
            launch=run.config.launch,
            world_size=run.config.world_size,
            strategy=run.config.strategy,
            per_rank_batch=run.per_rank_batch,
            global_batch=run.global_batch,
            tokens_per_sample=run.tokens_per_sample,
            ranks=[copy_fields(pb.RankReport, r) for r in run.ranks],
            ok=run.ok,
            failed_rank=run.failed_rank,
            error=run.error,
            comm_measured=run.comm_measured,
        )
        return pb.TrainResponse(
            loss=run.loss, step_seconds=run.step_seconds(), total_s=run.total_s, distributed=report
        )

    async def ModelStatus(
        self, request: pb.ModelStatusRequest, context: ServicerContext
    ) -> pb.ModelStatusResponse:
        models = find_all(self.executor, request.model_name, request.version)
        return pb.ModelStatusResponse(models=[model_status(m) for m in models])

    async def GetLoad(self, request: pb.GetLoadRequest, context: ServicerContext) -> pb.LoadReport:
        load = self.executor.load()
        return pb.LoadReport(in_flight=load.in_flight, queue_depth=load.queue_depth, draining=load.draining)
