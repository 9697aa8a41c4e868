"""run_training: the entry point torchrun workers (and the CLI) call.

Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); without it, runs as a world of one on a free local port. Checks the mesh and batch
before any process group exists, so a bad plan fails fast and identically on every rank.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from megatron_hpc.config.platforms import get_platform
from megatron_hpc.config.schema import RunConfig, TrainConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import init_method, keep_freed_memory, resolve_device, set_cpu_threads
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.loop import train
from megatron_hpc.train.precision import set_xla_precision_env


@dataclass(frozen=True, kw_only=True, slots=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def read_dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """torchrun's variables, or a single-process world on a free port when RANK is unset."""
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                       master_port=_free_port())
    world = int(env["WORLD_SIZE"])
    return DistEnv(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", "29500")))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build_mesh(env: DistEnv, *, tensor_parallel: int) -> Mesh:
    """The TP x DP mesh of this job; PlanError when TP does not fit the node."""
    if env.world_size % env.local_world_size:
        raise PlanError(f"WORLD_SIZE {env.world_size} is not a multiple of LOCAL_WORLD_SIZE "
                        f"{env.local_world_size}; launch the same number of workers on every node")
    if tensor_parallel < 1 or env.local_world_size % tensor_parallel:
        choices = [d for d in range(1, env.local_world_size + 1) if env.local_world_size % d == 0]
        raise PlanError(f"tp={tensor_parallel} does not divide {env.local_world_size} workers per node; "
                        f"use tp in {choices}")
    return Mesh(num_nodes=env.world_size // env.local_world_size, workers_per_node=env.local_world_size,
                tensor_parallel=tensor_parallel)


def check_batch(train_cfg: TrainConfig, *, data_parallel: int) -> int:
    """Micro-batches per step; PlanError naming the nearest valid global batch sizes otherwise."""
    unit = train_cfg.micro_batch_size * data_parallel
    gbs = train_cfg.global_batch_size
    if train_cfg.micro_batch_size < 1 or gbs < 1 or gbs % unit:
        lower, upper = (gbs // unit) * unit, (gbs // unit + 1) * unit
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise PlanError(f"global_batch_size {gbs} is not a multiple of micro_batch_size "
                        f"{train_cfg.micro_batch_size} x dp {data_parallel} = {unit}; use global_batch_size "
                        f"{nearest}")
    return gbs // unit


def run_training(cfg: RunConfig, *, phase: Literal["compile", "run"] = "run", run_dir: Path | None = None) -> int:
    """Train this worker's share of the run (or the compile trial); returns 0 on success."""
    env = read_dist_env()
    mesh = build_mesh(env, tensor_parallel=cfg.parallel.tensor)
    check_batch(cfg.train, data_parallel=mesh.data_parallel)
    backend = get_platform(cfg.launch.platform).backend
    # The configured precision decides, not XLA_USE_BF16 left in the environment: set before torch_xla reads it.
    warning = set_xla_precision_env(cfg.train.precision) if backend == "xla" else None
    if warning and env.rank == 0:
        print(f"megatron-hpc: warning: {warning}", file=sys.stderr, flush=True)
    device = resolve_device(backend, local_rank=env.local_rank)
    if device.kind == "cpu":
        set_cpu_threads(local_world_size=env.local_world_size)
        keep_freed_memory()
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    method = init_method(device.kind, master_addr=env.master_addr, master_port=env.master_port)
    # xla:// takes rank and world size from torch-xla's runtime (neuron-xla.md 4.4).
    ranks = {} if device.kind == "xla" else {"rank": env.rank, "world_size": env.world_size}
    # A peer that stops answering fails the collective after this long (a hang becomes a requeue).
    timeout = timedelta(seconds=cfg.launch.collective_timeout_s)
    dist.init_process_group(device.backend, init_method=method, timeout=timeout, **ranks)
    try:
        ctx = ParallelContext.build(mesh, rank=env.rank, kind=device.kind, timeout=timeout)
        train(cfg, ctx, device=device, phase=phase, run_dir=run_dir)
    finally:
        dist.destroy_process_group()
    return 0
