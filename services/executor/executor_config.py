"""Executor configuration, parsed once at the edge (CLI or caller) into a frozen object."""

from __future__ import annotations

from dataclasses import dataclass

from switchyard import net

DEFAULT_BUCKETS = (1, 2, 4, 8)
DEFAULT_PORTS = {"cpu": 8101, "xla": 8102, "cuda": 8103, "tpu": 8104}
GENERATION_ENGINES = ("process", "inline")


@dataclass(frozen=True)
class ExecutorConfig:
    backend: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 0
    # Framed inference for routers (services.frames), on the same host: 0 = any free port
    # (reported by Describe), -1 = off (routers then use gRPC streams).
    frames_port: int = 0
    models: tuple[str, ...] = ()  # loaded at start-up with the defaults below
    # The model repository this executor loads from ("" = the built-ins' default repository,
    # switchyard.models.repository.default_repository) and the packages whose factories it may
    # import (the built-ins' own modules are always allowed; nothing else by default).
    model_repository: str = ""
    allowed_factories: tuple[str, ...] = ()
    mode: str = ""  # "" = the backend's default mode
    precision: str = "fp32"
    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    max_queue_delay_us: int = 0
    max_queue_size: int = 64
    dynamic_batching: bool = True
    max_message_bytes: int = net.MAX_MESSAGE_BYTES
    drain_grace_s: float = 10.0
    price_key: str = ""  # "" = "<backend>/<resource class>"
    executor_id: str = ""  # "" = "<host id>:<port>"
    # A lone request on a quiet executor whose compute is expected to take at most this long
    # runs on the event loop (no queue, no thread hand-off); under load requests queue for
    # the device thread, where batches form.
    inline_compute_us: int = 10_000
    cpu_threads: int = 0  # torch intra-op threads; 0 = cores - 1 (at least 1)
    # The interpreter's GIL switch interval (Python's default is 5 ms). The device thread
    # gives up the GIL at every torch op and needs it back for the next; while the event loop
    # holds it (building and writing streamed responses), the device waits up to this long.
    gil_switch_interval_us: int = 500
    # Where a causal LM's generation engine runs on the cpu backend: "process", a process of its
    # own (the executor's loop and the engine's steps then hold no GIL in common), or "inline",
    # on this process's device thread (the only choice on accelerators).
    generation_engine: str = "process"
    # With mTLS: the services (identity names, spiffe://switchyard/<name>) that may call
    # inference straight here (OIP and frames); the control API takes router and worker only.
    oip_identities: tuple[str, ...] = ("router", "worker")
    metering: str = ""  # where refusals are audited ("" = only this process's log)
    frames_max_in_flight: int = 256  # per frame connection; at the bound reading pauses
    max_bytes_elements: int = 1_000_000  # BYTES elements one request may carry
