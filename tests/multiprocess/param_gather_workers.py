"""Workers for test_param_gather_overlap.py: the distributed optimizer with parallel.overlap_param_gather over gloo.

"late" below makes DP rank 1 start its all-gathers LATE_S after the update (a sleep in this worker process only), so
DP rank 0's weights outside its own slice are stale for that long: a forward or a save that did not wait would read
them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import mp_workers
import torch
import torch.distributed as dist

from megatron_hpc.config.schema import RunConfig
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
from megatron_hpc.train.step import MicroBatches, train_step

LATE_S = 1.5
"""How long DP rank 1 holds back its gathers: far beyond DP rank 0's way from the step to the next forward."""

SMALL_BUCKETS = 0.02
"""MiB: 5,242 fp32 elements, so the tiny model's parameters fall into a dozen buckets."""


def _late_gathers() -> None:
    original = DistributedOptimizer.gather_params

    def late(self: DistributedOptimizer) -> None:
        if self.dp_rank == 1:
            time.sleep(LATE_S)
        original(self)

    DistributedOptimizer.gather_params = late


def _variant(name: str) -> None:
    """Code-path variants and deliberate faults, in this worker process only."""
    if "late" in name:
        _late_gathers()
    if "scatter" in name:  # the NCCL path's collectives (all_gather_into_tensor), run on gloo
        DistributedOptimizer.ALL_REDUCE_ON_GLOO = False
    if "nowait" in name:  # the fault: the loop does not wait for the gathers before a save
        DistributedOptimizer.wait_for_weights = lambda self: None


def training_runs(rank: int, world: int, ports: list[int], plan: list[tuple[RunConfig, str, str]],
                  run_root: str) -> None:
    """run_training for each (config, name, variant) on every rank, each variant applied for its run only."""
    from megatron_hpc.train.entry import plan_for_torchrun, run_training

    intact = [(DistributedOptimizer, "gather_params"), (DistributedOptimizer, "ALL_REDUCE_ON_GLOO"),
              (DistributedOptimizer, "wait_for_weights")]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in intact]
    for i, (cfg, name, variant) in enumerate(plan):
        for owner, attr, value in saved:
            setattr(owner, attr, value)
        _variant(variant)
        os.environ["MASTER_PORT"] = str(ports[i])
        assert run_training(plan_for_torchrun(cfg), run_dir=Path(run_root) / name) == 0


def _capture(prefix: str, seen: dict[str, torch.Tensor], order: list[str]) -> Any:
    """A forward pre-hook that records the module's own parameters as it starts, and that it ran."""
    def hook(module: torch.nn.Module, _args: Any) -> None:
        order.append(prefix)
        seen.update({f"{prefix}.{n}" if prefix else n: p.detach().clone()
                     for n, p in module.named_parameters(recurse=False)})
    return hook


def forward_waits(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    """One step with rank 1's gathers late, then a forward: what each module's parameters held when it started
    (captured by a pre-hook registered after the optimizer's), against the weights once every gather is done. With
    the optimizer's forward hooks (`wait_in_forward`) and, as the control, without them."""
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=1), rank=rank)
    cfg = mp_workers.tiny_config()
    _late_gathers()
    gen = torch.Generator().manual_seed(7 + ctx.dp_rank)
    batches = [torch.randint(0, 500, (2, 33), generator=gen) for _ in range(2)]
    out: dict[str, Any] = {}
    for hooked in (True, False):
        model = mp_workers.model_for(cfg, ctx)
        optimizer = DistributedOptimizer(model, optim=cfg.optim, ctx=ctx, bucket_mb=SMALL_BUCKETS,
                                         overlap_param_gather=True)
        if hooked:
            optimizer.wait_in_forward(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_step(MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu"), optimizer, batches)
        seen: dict[str, torch.Tensor] = {}
        order: list[str] = []
        handles = [m.register_forward_pre_hook(_capture(prefix, seen, order)) for prefix, m in model.named_modules()
                   if any(True for _ in m.parameters(recurse=False))]
        with torch.no_grad():
            model(batches[0][:, :-1])
        for handle in handles:
            handle.remove()
        optimizer.finish_param_gather()
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        buckets = optimizer.layout.buckets
        wte = next(i for i, p in enumerate(optimizer.params) if p is model.wte.weight)
        out["hooked" if hooked else "unhooked"] = {
            "seen": seen, "after": after, "before": before, "first_module": order[0],
            "wte_bucket": next(b for b, bucket in enumerate(buckets) if wte in bucket.members),
            "num_buckets": len(buckets)}
    dist.destroy_process_group()
    return out
