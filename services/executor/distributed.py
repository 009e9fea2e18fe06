"""Distributed configuration: the one place that maps a path to its process-group backend.

Beside `device.py` (which maps a path to its device), this module decides, per path:
- the process-group backend: gloo on cpu, nccl on cuda, torch_xla's `xla` backend on xla,
  TorchTPU's `tpu_dist` on tpu;
- the world size and the rendezvous (a TCP store on this host, or torch_xla's `xla://`);
- the launch method: `spawn` (the executor starts one process per rank and hands each the
  torchrun-style environment RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT),
  `xla_launch` (the executor starts one process that makes a replica per device: on PJRT CPU
  a thread per device in that process, since XLA's CPU client has no collectives across
  processes; on TPU `torch_xla.launch`'s process per chip), or
  `torchrun` (ranks started by torchrun; the configuration is read back from that environment);
- which strategies the backend supports (DDP everywhere; FSDP2 `fully_shard` on the backends
  that implement all-gather and reduce-scatter of plain tensors).

No other module names a backend. A backend that cannot run here is reported as
"unavailable on this path" with the reason, the way `device.py` reports devices; nothing is
initialised to find out (torch_xla and torch_tpu are probed by package, not imported).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.executor.backends.base import Availability
from switchyard.errors import FailedPrecondition, InvalidArgument
from switchyard.net import free_port

# device path -> process-group backend (the migration's second change: nccl -> tpu_dist)
PROCESS_GROUP_BACKENDS: Mapping[str, str] = {
    "cpu": "gloo",
    "cuda": "nccl",
    "xla": "xla",
    "tpu": "tpu_dist",
}
STRATEGIES = ("ddp", "fsdp")
LAUNCHES = ("spawn", "xla_launch", "torchrun")
# torch_xla's process group runs DDP's gradient all-reduce; FSDP2 needs DTensor collectives
# on plain tensors, which ProcessGroupXla does not provide (torch_xla shards through SPMD).
_FSDP_BACKENDS = ("gloo", "nccl", "tpu_dist")
MAX_WORLD_SIZE = 64
DEFAULT_TIMEOUT_S = 60.0
_XLA_GROUP_LOCK = threading.Lock()


class DistributedUnavailable(FailedPrecondition):
    """The path's process-group backend cannot run here (package, device count, strategy)."""


@dataclass(frozen=True)
class DistributedConfig:
    """How one distributed run is set up; plain data, passed to every rank as JSON."""

    path: str  # the device path: cpu | cuda | xla | tpu
    backend: str  # the process-group backend
    world_size: int
    strategy: str
    launch: str
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S  # every collective, and the rendezvous

    @property
    def init_method(self) -> str:
        if self.backend == "xla":
            return "xla://"  # torch_xla's PJRT rendezvous (MASTER_ADDR / MASTER_PORT)
        return f"tcp://{self.master_addr}:{self.master_port}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DistributedConfig:
        return cls(**dict(data))


def backend_for(path: str) -> str:
    if path not in PROCESS_GROUP_BACKENDS:
        raise InvalidArgument(
            f"no process-group backend for path {path!r}; paths: {', '.join(PROCESS_GROUP_BACKENDS)}"
        )
    return PROCESS_GROUP_BACKENDS[path]


def _devices(path: str) -> tuple[int, str]:
    """How many ranks the path's devices hold here, and what that count is based on."""
    if path == "cpu":
        return MAX_WORLD_SIZE, "cpu ranks share the host's cores"
    if path == "cuda":
        import torch

        return torch.cuda.device_count(), "visible CUDA devices"
    if path == "xla":
        if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
            return MAX_WORLD_SIZE, "PJRT CPU devices (CPU_NUM_DEVICES is set per run)"
        from services.executor.backends import tpu_env

        return len(tpu_env.scan_pci()), "TPU chips on the PCI bus"
    from services.executor.backends import tpu_env

    return len(tpu_env.scan_pci()), "TPU chips on the PCI bus"


def availability(path: str, world_size: int = 2, strategy: str = "ddp") -> Availability:
    """Whether `path` can train with `world_size` ranks and `strategy` here, and why not."""
    backend = backend_for(path)
    where = f"process-group backend {backend!r} is unavailable on path {path!r}"
    if strategy not in STRATEGIES:
        return Availability(False, f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy == "fsdp" and backend not in _FSDP_BACKENDS:
        return Availability(
            False,
            f"{where} for fsdp: FSDP2 fully_shard needs all-gather/reduce-scatter of plain "
            "tensors, which torch_xla's process group lacks; use strategy ddp on this path",
        )
    import torch.distributed as dist

    if not dist.is_available():
        return Availability(False, f"{where}: this torch was built without torch.distributed")
    if backend == "gloo" and not dist.is_gloo_available():
        return Availability(False, f"{where}: this torch was built without gloo")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available() or not dist.is_nccl_available():
            return Availability(False, f"{where}: needs a CUDA build of torch with NCCL and a GPU")
    if backend == "xla" and importlib.util.find_spec("torch_xla") is None:
        return Availability(
            False, f"{where}: torch_xla is not installed (run the xla executor from the XLA environment)"
        )
    if backend == "tpu_dist":
        from services.executor.backends import tpu_env

        found = tpu_env.detect()
        if not found.available:
            return Availability(False, f"{where}: {found.reason}")
    count, basis = _devices(path)
    if world_size > count:
        return Availability(False, f"{where} with world size {world_size}: only {count} ({basis})")
    return Availability(True)


def plan(
    path: str, world_size: int, strategy: str = "ddp", timeout_s: float = DEFAULT_TIMEOUT_S
) -> DistributedConfig:
    """The configuration of a run the executor launches; raises DistributedUnavailable."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidArgument(f"world_size must be 1..{MAX_WORLD_SIZE}, got {world_size}")
    if not 1.0 <= timeout_s <= 3600.0:
        raise InvalidArgument(f"timeout_s must be between 1 and 3600 seconds, got {timeout_s:g}")
    found = availability(path, world_size, strategy)
    if not found.available:
        raise DistributedUnavailable(found.reason)
    backend = backend_for(path)
    return DistributedConfig(
        path=path,
        backend=backend,
        world_size=world_size,
        strategy=strategy,
        launch="xla_launch" if backend == "xla" and world_size > 1 else "spawn",
        master_port=free_port(),
        timeout_s=timeout_s,
    )


def from_torchrun_env(
    path: str, strategy: str = "ddp", env: Mapping[str, str] | None = None
) -> tuple[DistributedConfig, int, int]:
    """(config, rank, local rank) of a process that torchrun started, from its environment."""
    env = os.environ if env is None else env
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise InvalidArgument(f"not started by torchrun: {', '.join(missing)} unset")
    config = DistributedConfig(
        path=path,
        backend=backend_for(path),
        world_size=int(env["WORLD_SIZE"]),
        strategy=strategy,
        launch="torchrun",
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
    )
    return config, int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))


def launch_env(config: DistributedConfig, rank: int) -> dict[str, str]:
    """The environment the executor gives the process of `rank` (torchrun's variable names)."""
    env = {
        "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(config.master_port),
        "WORLD_SIZE": str(config.world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(config.world_size),
    }
    if config.backend == "xla":
        # one process that makes a replica per device. On PJRT CPU the device count is the
        # world size; the replicas are threads, and the torchrun variables must not be set or
        # torch_xla would take the process for one torchrun rank.
        env = {"MASTER_ADDR": config.master_addr, "MASTER_PORT": str(config.master_port)}
        if os.environ.get("PJRT_DEVICE", "CPU") == "CPU":
            env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(config.world_size)})
            # No input buffer donation: with it, the replica that found a graph in the cache
            # ran it with the donations planned for the replica that compiled it, and its
            # next graph failed on a deleted buffer ("buffer with shape f32[512,128] on device
            # CPU:0 is deleted"). The copies it costs are the size of the model.
            env["XLA_ENABLE_PARAM_ALIASING"] = "0"
    return env


def init_process_group(config: DistributedConfig, rank: int, local_rank: int) -> Any:
    """Joins the process group inside a rank; returns the rank's torch device.

    Collectives time out after `config.timeout_s`, so a rank whose peer died fails instead of
    waiting for ever.
    """
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=config.timeout_s)
    if config.backend == "gloo":
        dist.init_process_group(
            "gloo", init_method=config.init_method, rank=rank, world_size=config.world_size, timeout=timeout
        )
        return torch.device("cpu")
    if config.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", init_method=config.init_method, rank=rank, world_size=config.world_size,
            timeout=timeout, device_id=device,
        )  # fmt: skip
        return device
    if config.backend == "xla":
        import torch_xla
        import torch_xla.distributed.xla_backend

        # Replicas that are threads share one process and so one default group (its
        # collectives span every device, whichever thread joined it); the first one creates it.
        with _XLA_GROUP_LOCK:
            if not dist.is_initialized():
                dist.init_process_group("xla", init_method="xla://", timeout=timeout)
        return torch_xla.device()
    if config.backend == "tpu_dist":
        import torch_tpu  # noqa: F401  (registers "tpu_dist" on import)

        torch.accelerator.set_device_index(local_rank)
        dist.init_process_group(
            "tpu_dist", init_method=config.init_method, rank=rank, world_size=config.world_size,
            timeout=timeout,
        )  # fmt: skip
        return torch.device("tpu", local_rank)
    raise InvalidArgument(f"unknown process-group backend {config.backend!r}")


def prepare_launch(config: DistributedConfig) -> None:
    """What the launching process must do before it starts the ranks (TorchTPU: its env)."""
    if config.backend == "tpu_dist":
        import torch
        import torch_tpu  # noqa: F401

        torch.tpu.distributed.set_tpu_launch_env(nnodes=1, nproc_per_node=config.world_size)  # type: ignore[attr-defined]


def single_device(path: str) -> Any:
    """The device of a world-size-1 run (no process group)."""
    import torch

    if path == "xla":
        import torch_xla

        return torch_xla.device()
    if path == "tpu":
        import torch_tpu  # noqa: F401

        return torch.device("tpu", 0)
    return torch.device("cuda" if path == "cuda" else "cpu")


def peak_memory(path: str) -> tuple[int, str]:
    """Peak memory of this rank in bytes, and what was measured."""
    import resource

    import torch

    if path == "cuda":
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    if path == "tpu":
        try:
            return int(torch.accelerator.max_memory_allocated()), "torch.accelerator.max_memory_allocated"
        except Exception:  # an accelerator API this torch_tpu lacks: fall back to the host
            pass
    # cpu and PJRT CPU: the device memory is the host's; ru_maxrss is KiB on Linux
    scope = "process peak RSS" + (" (all replicas of the process)" if path == "xla" else "")
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, scope


class RankOps:
    """What differs per backend inside a rank: wrapping the model, the gradient reduction,
    and the device synchronisation that stops a timer. Communication time is measured by
    timing the collectives: DDP's all-reduce through a comm hook (gloo, nccl, tpu_dist: the
    hook's future completes when the bucket is reduced, overlapping backward; the time any
    bucket is in flight counts once), or, on xla, a
    flattened all-reduce run as its own graph between two syncs. FSDP2's collectives run
    inside forward and backward and are not separated here (comm reported as unmeasured)."""

    def __init__(self, config: DistributedConfig, replicas: Any = None) -> None:
        self.config = config
        self.comm_s = 0.0
        self.comm_measured = config.world_size > 1 and config.strategy == "ddp"
        self._replicas = replicas  # xla on PJRT CPU: the threads' barrier and sync lock

    def wrap(self, module: Any, device: Any) -> Any:
        if self.config.world_size == 1:
            return module
        if self.config.backend == "xla":
            return module  # gradients are all-reduced explicitly in `reduce_gradients`
        import torch

        if self.config.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # each repeated block is its own FSDP unit (its parameters gathered only while it
            # runs), the rest with the root
            for child in module.modules():
                if isinstance(child, torch.nn.ModuleList):
                    for block in child:
                        fully_shard(block)
            fully_shard(module)
            return module
        import time

        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(module, device_ids=None if device.type == "cpu" else [device])

        # Communication time is the wall time during which at least one bucket's all-reduce is
        # in flight: buckets overlap one another (and backward), so summing their durations
        # counted the same seconds twice (a share of 1.13 of the step on a busy host).
        in_flight = [0, 0.0]  # buckets in flight, and when that count last rose from 0
        lock = threading.Lock()  # completions run on the process group's threads

        # unannotated on purpose: DDP checks a hook's annotations against dist.GradBucket, and
        # postponed (string) annotations never match
        def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]
            with lock:
                if in_flight[0] == 0:
                    in_flight[1] = time.perf_counter()
                in_flight[0] += 1
            future = default_hooks.allreduce_hook(state, bucket)

            def done(fut):  # type: ignore[no-untyped-def]
                with lock:
                    in_flight[0] -= 1
                    if in_flight[0] == 0:
                        self.comm_s += time.perf_counter() - in_flight[1]
                return fut.value()

            return future.then(done)

        ddp.register_comm_hook(None, timed_allreduce)
        return ddp

    def reduce_gradients(self, module: Any, loss: Any) -> Any:
        """After backward: the loss to record for this step. DDP and FSDP2 reduced the
        gradients inside backward already; on xla this all-reduces them (and the loss, so the
        xla record is already the global mean) as one flattened buffer in a graph of its own."""
        import time

        import torch
        import torch.distributed as dist

        if self.config.world_size == 1 or self.config.backend != "xla":
            return loss.detach()
        n = self.config.world_size
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.sync()
        start = time.perf_counter()
        summed = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1).float()])
        dist.all_reduce(summed)
        mean = summed / n
        offset = 0
        for g in grads:
            g.copy_(mean[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.sync(collective=[summed, mean, *grads])
        self.comm_s += time.perf_counter() - start
        return mean[-1]

    def global_losses(self, local: list[float]) -> list[float]:
        """Each step's loss over the whole global batch: the mean of the ranks' losses (equal
        shares of the batch), gathered once after training so steps carry no extra collective."""
        if self.config.world_size == 1 or self.config.backend == "xla":
            return local
        import torch
        import torch.distributed as dist

        device = None  # the process group's device: gloo reduces host tensors
        if self.config.path in ("cuda", "tpu"):
            device = torch.device(self.config.path, torch.accelerator.current_device_index())
        total = torch.tensor(local, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return [float(v) / self.config.world_size for v in total.cpu()]

    def sync(self, collective: list[Any] | None = None) -> None:
        """Waits until the device finished everything issued so far (on xla, `collective`
        names the tensors of a graph that holds a collective)."""
        if self.config.backend == "xla" or self.config.path == "xla":
            import torch_xla
            import torch_xla.core.xla_model as xm

            if self._replicas is None:
                torch_xla.sync(wait=True)
                xm.wait_device_ops()
                return
            # Replicas are threads of one process (PJRT CPU), and XLA's CPU all-reduce meets
            # its peers by (run id, devices, op id), where the op id is the id of the compiled
            # module (xla/backends/cpu: the channel id, which torch_xla does not set, else
            # `GetModule()->unique_id()`; torch_xla runs every launch with run id 0). So every
            # replica must launch the very same executable: each graph is compiled and launched
            # by one thread at a time under the lock, the first compiling, the later ones
            # finding it in torch_xla's cache. A separate warm-up is no substitute: it caches
            # under another hash than the launch, so each replica compiled its own module at
            # launch (op ids 2 and 3) and the first one aborted the process after XLA's fixed
            # 10 s rendezvous termination timeout ("only 1 of them arrived"). Launching does
            # not wait for the collective to run (torch_xla executes on its own threads), so
            # holding the lock while launching cannot keep the peer from joining. A thread
            # blocked in wait_device_ops holds the GIL, so it waits only once every replica
            # has launched, and only for its own device: waiting for every device (the
            # default) also waits for a peer's collective launched meanwhile, which cannot
            # finish before this thread launches its own (on a busy host the peer got there
            # first and XLA aborted after 10 s).
            lock, barrier = self._replicas
            xlac: Any = torch_xla._XLAC
            own = xm.xla_real_devices([torch_xla.device()])
            with lock:
                if collective is None:
                    torch_xla.sync()
                else:
                    xlac._xla_sync_multi(collective, [], False)
            barrier.wait()
            xm.wait_device_ops(own)
            return
        if self.config.path in ("cuda", "tpu"):
            import torch

            torch.accelerator.synchronize()
