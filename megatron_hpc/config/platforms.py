"""Platforms as data: what a node offers and how a job runs on it.

Facts: shared/reference/neuron-xla.md section 4.1 (trn1: 16 chips x 2 NeuronCores = 32 workers,
trn2: 64 logical cores at LNC=2), 4.2 (runtime TP degrees), 3.3 and the checklist at its end
(environment). NEURON_RT_VISIBLE_CORES is never set: torch-xla derives it from LOCAL_RANK.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from megatron_hpc.config.hardware import Hardware, builtin_hardware
from megatron_hpc.errors import ConfigError

Backend = Literal["xla", "nccl", "gloo"]

# Shared by both Trainium generations: EFA, runtime and graph knobs of the reference
# 6.7B node script (neuron-xla.md 3.3) plus MALLOC_ARENA_MAX against host OOM (4.7).
_NEURON_ENV: dict[str, str] = {
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_PROVIDER": "efa",
    "FI_EFA_FORK_SAFE": "1",
    "NEURON_NUM_RECENT_MODELS_TO_KEEP": "3",
    "NEURON_TRANSFER_ALL_PARAMETERS_WITH_STATIC_RING": "1",
    "NEURON_FUSE_SOFTMAX": "1",
    "NEURON_RT_EXEC_TIMEOUT": "600",
    "MALLOC_ARENA_MAX": "64",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Platform:
    name: str
    """Short name used by --platform."""
    workers_per_node: int
    """Training processes per node (torchrun --nproc_per_node)."""
    memory_per_worker_gib: float
    """Device memory one worker may use."""
    backend: Backend
    """torch.distributed backend."""
    peak_tflops_bf16: float
    """Dense bf16 peak of one worker, for MFU."""
    tp_choices: tuple[int, ...] | None = None
    """Tensor-parallel degrees the runtime supports; None means any divisor of workers_per_node."""
    compile_wrapper: tuple[str, ...] = ()
    """Command the node script runs torchrun under in the compile phase; empty where torch.compile is the
    only compiler."""
    gpus_per_node: int = 0
    """GPUs each node of a job asks SLURM for (sbatch --gpus-per-node); 0 where the devices are not GPUs."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment exported on every node before torchrun."""
    bf16_env: dict[str, str] = field(default_factory=dict)
    """Extra environment when train.precision is bf16."""
    workers_configurable: bool = False
    """Whether launch.workers_per_node may change workers_per_node."""
    hardware: Hardware | None = None
    """What the node can do, with sources (config/hardware.py): the step-time model's input. A platform file
    replaces it (with_hardware); None only for a Platform built by hand."""


PLATFORMS: dict[str, Platform] = {
    "trn1": Platform(
        name="trn1",
        workers_per_node=32,
        memory_per_worker_gib=16.0,
        backend="xla",
        peak_tflops_bf16=95.0,  # trn1.32xlarge: 3040 TFLOP/s bf16 over 32 NeuronCores
        hardware=builtin_hardware("trn1"),
        tp_choices=(1, 2, 8, 16, 32),
        compile_wrapper=("neuron_parallel_compile",),
        env={**_NEURON_ENV, "NEURON_CC_FLAGS": "--model-type transformer"},
        bf16_env={"XLA_USE_BF16": "1"},
    ),
    "trn2": Platform(
        name="trn2",
        workers_per_node=64,
        memory_per_worker_gib=24.0,
        backend="xla",
        peak_tflops_bf16=166.75,  # trn2: 667 BF16 TFLOPS a chip over its 4 logical cores (config/hardware.py)
        tp_choices=(1, 2, 4, 8, 16, 32, 64),
        hardware=builtin_hardware("trn2"),
        compile_wrapper=("neuron_parallel_compile",),
        env={**_NEURON_ENV, "NEURON_LOGICAL_NC_CONFIG": "2",
             "NEURON_CC_FLAGS": "--model-type transformer --lnc=2"},
        bf16_env={"XLA_USE_BF16": "1"},
    ),
    "p5": Platform(
        name="p5",
        workers_per_node=8,
        memory_per_worker_gib=80.0,
        backend="nccl",
        peak_tflops_bf16=989.0,  # H100 SXM dense bf16
        hardware=builtin_hardware("p5"),
        # One worker per GPU; without asking, a GRES-managed cluster gives a job no GPU at all.
        gpus_per_node=8,
        env={"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
             "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
    ),
    "cpu": Platform(
        name="cpu",
        workers_per_node=1,
        memory_per_worker_gib=4.0,
        backend="gloo",
        peak_tflops_bf16=1.0,  # nominal; MFU on CPU is not meaningful
        workers_configurable=True,
        hardware=builtin_hardware("cpu"),
    ),
}


def get_platform(name: str) -> Platform:
    """The platform called `name`, or a ConfigError listing the known ones."""
    try:
        return PLATFORMS[name]
    except KeyError:
        known = ", ".join(sorted(PLATFORMS))
        raise ConfigError(f"unknown platform {name!r}; use one of: {known}") from None


def with_hardware(hardware: Hardware) -> Platform:
    """The platform a platform file describes: its runtime's launcher, backend and environment with the file's
    workers, memory and peak. The name stays the runtime's (the trainer and the launcher look the runtime up by
    it); the plan records the file's name as its hardware."""
    runtime = get_platform(hardware.runtime)
    gpus = hardware.workers_per_node if runtime.gpus_per_node else 0
    return dataclasses.replace(runtime, workers_per_node=hardware.workers_per_node,
                               memory_per_worker_gib=hardware.memory_per_worker_gib,
                               peak_tflops_bf16=hardware.peak_tflops_16bit, gpus_per_node=gpus, hardware=hardware)


def resolve_platform(requested: str | None, *, default: str) -> Platform:
    """The platform a run is planned for: the one asked for (--platform, or a resumed run's plan), else the
    recipe's launch.platform. The plan records it; the config keeps the recipe's default."""
    return get_platform(requested or default)
