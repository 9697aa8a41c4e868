"""run_training: the entry point torchrun workers (and the CLI) call, given the run spec (config + plan).

Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); without it, runs as a world of one on a local port the kernel picks. Checks the plan's mesh against that
world before any process group exists, so a mismatch fails fast and identically on every rank. This is the
edge of the trainer: environment reads happen here and are passed down as values.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch.distributed as dist

from megatron_hpc.config.platforms import resolve_platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.data.preflight import check_tokenizer_vocabulary
from megatron_hpc.errors import PlanError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import init_method, keep_freed_memory, resolve_device, set_cpu_threads
from megatron_hpc.plan.planner import check_data_source, check_pipeline_runtime, check_torchrun_world
from megatron_hpc.plan.spec import RunSpec, plan_run
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
    """torchrun's variables, or a single-process world on port 0 when RANK is unset."""
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        # Port 0: the world's only rank binds its store at once on a port the kernel picks. A port found free
        # here and bound later by init_process_group was taken in between by another process group beside it
        # (the test suite's), as in benchmarks/pipeline_cpu.py's EADDRINUSE.
        return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1",
                       master_port=0)
    world = int(env["WORLD_SIZE"])
    return DistEnv(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", "29500")))


def plan_for_torchrun(cfg: RunConfig, *, platform: str | None = None,
                      environ: dict[str, str] | None = None) -> RunSpec:
    """Plan `cfg` for the world torchrun started (a direct `train --recipe` run, and tests).

    The node count is WORLD_SIZE / LOCAL_WORLD_SIZE and the plan takes torchrun's LOCAL_WORLD_SIZE as
    launch.workers_per_node (the planner refuses more workers than the platform's node has devices).
    """
    env = read_dist_env(environ)
    chosen = resolve_platform(platform, default=cfg.launch.platform)
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, workers_per_node=env.local_world_size))
    if env.world_size % env.local_world_size:
        raise PlanError(f"WORLD_SIZE {env.world_size} is not a multiple of LOCAL_WORLD_SIZE "
                        f"{env.local_world_size}; launch the same number of workers on every node")
    return plan_run(cfg, num_nodes=env.world_size // env.local_world_size, platform=chosen)


def run_training(spec: RunSpec, *, phase: Literal["compile", "run"] = "run", run_dir: Path | None = None) -> int:
    """Train this worker's share of the run (or the compile trial); returns 0 on success."""
    plan = spec.plan
    env = read_dist_env()
    check_torchrun_world(plan, world_size=env.world_size, local_world_size=env.local_world_size)
    check_data_source(plan)
    check_pipeline_runtime(plan)
    if plan.data_source == "indexed":  # before any process group or model: a vocabulary the tokenizer overflows
        unchecked = check_tokenizer_vocabulary(spec.config.data, vocab_size=spec.config.model.vocab_size)
        if unchecked and env.rank == 0:
            print(f"megatron-hpc: warning: {unchecked}", file=sys.stderr, flush=True)
    # The configured precision decides, not XLA_USE_BF16 left in the environment: set before torch_xla reads it.
    warning = (set_xla_precision_env(spec.config.train.precision, fp32_master=plan.fp32_master)
               if plan.backend == "xla" else None)
    if warning and env.rank == 0:
        print(f"megatron-hpc: warning: {warning}", file=sys.stderr, flush=True)
    device = resolve_device(plan.backend, local_rank=env.local_rank)
    if device.kind == "cpu":
        set_cpu_threads(local_world_size=env.local_world_size)
        keep_freed_memory()
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
    method = init_method(device.kind, master_addr=env.master_addr, master_port=env.master_port)
    # xla:// takes rank and world size from torch-xla's runtime (neuron-xla.md 4.4).
    ranks = {} if device.kind == "xla" else {"rank": env.rank, "world_size": env.world_size}
    # A peer that stops answering fails the collective after this long (a hang becomes a requeue).
    timeout = timedelta(seconds=spec.config.launch.collective_timeout_s)
    dist.init_process_group(device.backend, init_method=method, timeout=timeout, **ranks)
    try:
        ctx = ParallelContext.build(plan.mesh, rank=env.rank, kind=device.kind, timeout=timeout)
        # A neuron_parallel_compile trial (graphs only) returns zeros: nothing of it may be saved or loaded.
        graphs_only = bool(os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY"))
        train(spec, ctx, device=device, phase=phase, run_dir=run_dir, checkpoints=phase == "run" and not graphs_only)
    finally:
        dist.destroy_process_group()
    return 0
