"""What a client asks about the server and its models, answered in OIP's messages as Triton
answers it: readiness, metadata, config (inference.ModelConfig) and statistics.

`OipMetadata` answers ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig and
ModelStatistics for the gRPC servicer (`executor_servicer.py`), from the executor the data
plane serves; inference itself goes through the data plane (`data_plane.py`).
"""

from __future__ import annotations

from services.executor.batching import BatchCounters
from services.executor.executor_runtime import Executor, find_all
from services.executor.loaded_model import LoadedModel
from switchyard.gen.inference import grpc_service_pb2 as pb
from switchyard.gen.inference import model_config_pb2 as mc

SERVER_NAME = "switchyard-executor"
SERVER_VERSION = "0.1.0"


class OipMetadata:
    """The server and its loaded models as a client asks about them."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def ready(self) -> bool:
        return self.executor.ready()

    def model_ready(self, name: str, version: str) -> bool:
        model = self.executor.find(name, version)
        return model.state == "READY" and not self.executor.draining

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=SERVER_VERSION, extensions=["model_configuration", "statistics"]
        )

    def model_metadata(self, name: str, version: str) -> pb.ModelMetadataResponse:
        return model_metadata(self.executor.find(name, version))

    def model_config(self, name: str, version: str) -> mc.ModelConfig:
        return model_config(self.executor.find(name, version))

    def model_statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        """The named model's statistics, or every loaded model's where no name is given."""
        response = pb.ModelStatisticsResponse()
        for model in find_all(self.executor, name, version):
            stats = response.model_stats.add(name=model.spec.name, version=model.spec.version)
            if model.batcher is not None:
                model_statistics(model.batcher.counters, stats)
        return response


def model_metadata(model: LoadedModel) -> pb.ModelMetadataResponse:
    spec = model.spec
    return pb.ModelMetadataResponse(
        name=spec.name,
        versions=[spec.version],
        platform=spec.platform,
        inputs=[
            pb.ModelMetadataResponse.TensorMetadata(
                name=s.name, datatype=model.wire_datatype(s), shape=[-1, *s.dims]
            )
            for s in spec.inputs
        ],
        outputs=[
            pb.ModelMetadataResponse.TensorMetadata(
                name=s.name, datatype=model.wire_datatype(s), shape=[-1, *s.dims]
            )
            for s in spec.outputs
        ],
    )


def model_config(model: LoadedModel) -> mc.ModelConfig:
    spec, options = model.spec, model.options
    config = mc.ModelConfig(
        name=spec.name,
        platform=spec.platform,
        backend=model.backend.name,
        max_batch_size=model.max_batch,
        input=[
            mc.ModelInput(name=s.name, data_type=_config_type(model.wire_datatype(s)), dims=list(s.dims))
            for s in spec.inputs
        ],
        output=[
            mc.ModelOutput(name=s.name, data_type=_config_type(model.wire_datatype(s)), dims=list(s.dims))
            for s in spec.outputs
        ],
        instance_group=[mc.ModelInstanceGroup(name=spec.name, count=1, kind=_instance_kind(model))],
    )
    if model.spec.generation is not None:
        config.model_transaction_policy.decoupled = True  # many responses per request
    if options.dynamic_batching:
        config.dynamic_batching.preferred_batch_size.extend(options.batch_buckets)
        config.dynamic_batching.max_queue_delay_microseconds = options.max_queue_delay_us
    for key, value in (
        ("mode", options.mode),
        ("precision", options.precision),
        ("checkpoint_sha256", model.sha256),
        ("max_queue_size", str(options.max_queue_size)),
    ):
        config.parameters[key].string_value = value
    return config


def _config_type(datatype: str) -> mc.DataType.ValueType:
    """Triton's config names BYTES tensors TYPE_STRING."""
    return mc.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


def _instance_kind(model: LoadedModel) -> mc.ModelInstanceGroup.Kind.ValueType:
    return mc.ModelInstanceGroup.KIND_CPU if model.backend.name == "cpu" else mc.ModelInstanceGroup.KIND_GPU


def model_statistics(c: BatchCounters, stats: pb.ModelStatistics) -> None:
    """Triton's statistics of one model from its batcher's counters: per request (success,
    fail, queue, compute input/infer/output; a request is charged its batch's phases), and per
    executed batch size (batch_stats), so perf_analyzer prints its server-side section."""
    stats.last_inference = c.last_inference_ms
    stats.inference_count = c.rows
    stats.execution_count = c.executions
    s = stats.inference_stats
    s.success.count, s.success.ns = c.success, c.success_ns
    s.fail.count = c.failures
    s.queue.count, s.queue.ns = c.success, c.queue_ns
    s.compute_input.count, s.compute_input.ns = c.success, c.request_input_ns
    s.compute_infer.count, s.compute_infer.ns = c.success, c.request_infer_ns
    s.compute_output.count, s.compute_output.ns = c.success, c.request_output_ns
    for size, (n, input_ns, infer_ns, output_ns) in sorted(c.by_batch_size.items()):
        b = stats.batch_stats.add(batch_size=size)
        b.compute_input.count, b.compute_input.ns = n, input_ns
        b.compute_infer.count, b.compute_infer.ns = n, infer_ns
        b.compute_output.count, b.compute_output.ns = n, output_ns
