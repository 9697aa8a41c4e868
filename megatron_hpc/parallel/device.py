"""The one place that knows about CUDA, XLA and CPU, and about optional torch_xla and apex.

Everything else asks this module for a `DeviceInfo` and for the few device-specific calls the
trainer needs (step barrier, process-group options). torch_xla is imported lazily and only when
the platform's backend is "xla" (shared/reference/neuron-xla.md 4.4, 4.5).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_hpc.errors import TrainingError
from megatron_hpc.parallel.host_malloc import keep_freed_blocks

DeviceKind = Literal["cpu", "cuda", "xla"]
_BACKEND_TO_KIND: dict[str, DeviceKind] = {"gloo": "cpu", "nccl": "cuda", "xla": "xla"}


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceInfo:
    kind: DeviceKind
    """cpu, cuda or xla."""
    device: torch.device
    """Where this process's parameters and activations live."""
    backend: str
    """torch.distributed backend matching the device."""
    float_dtype: torch.dtype = torch.float32
    """What a float32 tensor really holds on this device: bfloat16 on XLA under XLA_USE_BF16 or XLA_DOWNCAST_BF16
    (the tensor still reports float32), measured at start-up; float32 elsewhere."""


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None


def resolve_device(backend: str, *, local_rank: int) -> DeviceInfo:
    """The device this worker trains on, for the platform's torch.distributed backend."""
    kind = _BACKEND_TO_KIND.get(backend)
    if kind is None:
        raise TrainingError(f"unknown backend {backend!r}; use one of {sorted(_BACKEND_TO_KIND)}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TrainingError("backend nccl needs a CUDA GPU but torch.cuda.is_available() is False; "
                                "use the cpu platform (gloo) on this machine")
        torch.cuda.set_device(local_rank)
        return DeviceInfo(kind=kind, device=torch.device("cuda", local_rank), backend=backend)
    if kind == "xla":
        if not xla_available():
            raise TrainingError("backend xla needs torch_xla, which is not installed; install torch-neuronx "
                                "on the Trainium nodes or use the cpu platform")
        import torch_xla
        import torch_xla.distributed.xla_backend  # registers the 'xla' backend

        device = torch_xla.device()
        return DeviceInfo(kind=kind, device=device, backend=backend, float_dtype=_xla_float_dtype(device))
    return DeviceInfo(kind=kind, device=torch.device("cpu"), backend=backend)


def node_devices(info: DeviceInfo) -> tuple[int, float] | None:
    """(devices on this node, GiB of memory each) where the runtime says (CUDA); None on CPU, whose workers are
    processes, and on XLA, whose NeuronCores torch-xla hands out per process."""
    if info.kind != "cuda":
        return None
    return torch.cuda.device_count(), torch.cuda.get_device_properties(info.device).total_memory / 2**30


_PROBE = 1.0 + 2.0**-10  # exact in float32; bfloat16 (8 mantissa bits) rounds it to 1.0


def _xla_float_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 when the device rounds float32 values to bfloat16, as torch-xla 2.9 does under XLA_USE_BF16=1
    (neuron-xla.md 4.6; the variable is deprecated, so a later torch-xla may ignore it: the value decides).

    One host round trip at start-up, no graph. Should the value come back as neither (a neuron_parallel_compile
    trial may hand back zeros), the variables decide.
    """
    back = torch.tensor([_PROBE], dtype=torch.float32).to(device).cpu().item()
    if back == _PROBE:
        return torch.float32
    if back == 1.0:
        return torch.bfloat16
    pure = any(os.environ.get(k, "0") not in ("", "0") for k in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"))
    return torch.bfloat16 if pure else torch.float32


def init_method(kind: DeviceKind, *, master_addr: str, master_port: int) -> str:
    # torch-xla's own rendezvous joins torchrun's store (neuron-xla.md 4.4); others use TCP.
    return "xla://" if kind == "xla" else f"tcp://{master_addr}:{master_port}"


def group_options(kind: DeviceKind, *, all_groups: list[list[int]]) -> dict[str, Any]:
    """Extra new_group kwargs: XLA collectives are replica-group ops over EVERY group of a kind."""
    if kind == "xla":
        return {"pg_options": {"xla_pg_options": {"mesh": all_groups}}}
    return {}


def step_barrier(info: DeviceInfo) -> None:
    """End of a step: cut and run the lazy XLA graph (neuron-xla.md 4.5); no-op elsewhere."""
    mark_step(info.kind)


def mark_step(kind: str) -> None:
    """Cut the lazy XLA graph here and run it (torch_xla.sync, formerly xm.mark_step); no-op off XLA. The reference
    also cuts after backward, which bounds the graph (and the device memory it holds) to one forward and backward."""
    if kind == "xla":
        import torch_xla

        torch_xla.sync()


class DeviceFeed:
    """Each step's micro-batches, moved to the device; iterate it. On XLA through torch_xla's MpDeviceLoader, as
    the reference trainer feeds data (neuron-xla.md 4.5): a thread copies the next batches to the device while the
    current step runs.

    An error while making a batch (a DataError, say) is kept and raised where the next batch is taken. torch_xla's
    loader thread would only print it and end the iteration, which looks like the end of the run.
    """

    def __init__(self, batches: Iterable[list[torch.Tensor]], info: DeviceInfo):
        self.error: Exception | None = None
        source = self._guarded(batches)
        if info.kind == "xla":
            import torch_xla.distributed.parallel_loader as pl

            self._items: Iterator[list[torch.Tensor]] = iter(pl.MpDeviceLoader(source, info.device))
        else:
            self._items = ([t.to(info.device) for t in micro] for micro in source)

    def _guarded(self, batches: Iterable[list[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
        try:
            yield from batches
        except Exception as exc:  # re-raised by __iter__, in the training thread
            self.error = exc

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        yield from self._items
        if self.error is not None:
            raise self.error


def when_step_done(info: DeviceInfo, fn: Callable[..., None], *args: Any) -> None:
    """Call fn(*args) once this step's values exist: at once off XLA; on XLA as a step closure after the next
    sync, so reading losses on the host never cuts the step's graph (neuron-xla.md 4.5)."""
    if info.kind == "xla":
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args)
        return
    fn(*args)


def set_cpu_threads(*, local_world_size: int) -> int:
    """Intra-op threads: OMP_NUM_THREADS when set, else the cores shared among local workers."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        threads = int(env)
    else:
        threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (CPU training); False where it cannot (not glibc).

    A training step frees and allocates the same large activation tensors every step. By default glibc serves
    each block above its mmap threshold with a fresh mmap and unmaps it on free, so every step the kernel faults
    in and zeroes all of them again (benchmarks/RESULTS.md: 3.4x fewer page faults and a third more tokens/s
    on the CPU benchmark without it). With mmap off and the trim threshold at its maximum, freed blocks stay in
    the heap and the next step reuses them: after a few steps of warm-up there are no new page faults. Resident
    memory settles somewhat above the step's peak (aligned requests fragment the heap a little) and stays there to
    the end, also after a large transient such as a checkpoint load; tests/unit/test_parallel_device_memory.py
    checks both the reuse and that the heap stops growing.
    """
    return keep_freed_blocks()


def seed_everything(info: DeviceInfo, seed: int) -> None:
    """Seed the CPU generator and this device's. torch.manual_seed also seeds CUDA's, but not torch_xla's, which
    draws the dropout masks on XLA: without its own seed every XLA run and DP rank drew the same masks."""
    torch.manual_seed(seed)
    if info.kind == "xla":
        import torch_xla

        torch_xla.manual_seed(seed, info.device)


def accelerator_rng_state(info: DeviceInfo) -> list[torch.Tensor] | None:
    """The CUDA generators' states (for checkpoints); None on CPU and XLA."""
    return torch.cuda.get_rng_state_all() if info.kind == "cuda" else None


def set_accelerator_rng_state(info: DeviceInfo, states: list[torch.Tensor] | None) -> None:
    if info.kind == "cuda" and states:
        torch.cuda.set_rng_state_all(states)


def xla_rng_state(info: DeviceInfo) -> list[int] | None:
    """torch_xla's RNG state of this worker's device (one int, the running seed, in a list like CUDA's per-device
    states); None off XLA. Read on the host without a graph: torch_xla keeps the running seed there."""
    if info.kind != "xla":
        return None
    import torch_xla.core.xla_model as xm

    return [int(xm.get_rng_state(str(info.device)))]


def set_xla_rng_state(info: DeviceInfo, states: list[int] | None) -> None:
    if info.kind == "xla" and states:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(states[0]), str(info.device))
