"""Workers for test_grad_overlap.py: DP=2 over gloo, the overlapped DP all-reduce against the plain one.

Run through mp_workers.spawn (each returns a picklable result the test compares).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.grads import build_grad_reducer
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.optim import PlainOptimizer
from megatron_hpc.train.step import MicroBatches, train_step

BUCKET_MB = 0.05
"""About 13k fp32 elements: the tiny model splits into several buckets, so there is something to overlap."""


def _setup(rank: int, world: int, port: int) -> tuple[ParallelContext, Any]:
    import mp_workers

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=1), rank=rank)
    return ctx, mp_workers.tiny_config()


def _model(cfg: Any, ctx: ParallelContext) -> Any:
    import mp_workers

    return mp_workers.model_for(cfg, ctx)


def _micro_batches(ctx: ParallelContext, *, step: int, count: int) -> list[torch.Tensor]:
    # Different tokens on each DP rank, so the average is not the identity.
    gen = torch.Generator().manual_seed(1000 * step + ctx.dp_rank)
    return [torch.randint(0, 500, (2, 33), generator=gen) for _ in range(count)]


def overlap_checks(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    """Both checks in one spawn (process start-up is most of the cost)."""
    ctx, cfg = _setup(rank, world, ports[0])
    params = list(torch.nn.Linear(4, 4).parameters())
    chosen = {f"{kind} overlap={overlap}": type(build_grad_reducer(params, group=ctx.dp_group, overlap=overlap,
                                                                   bucket_mb=1.0, device_kind=kind)).__name__
              for kind, overlap in (("cpu", True), ("xla", True), ("cpu", False))}
    result = {"matches": overlap_matches_plain(ctx, cfg), "order": overlap_event_order(ctx, cfg), "chosen": chosen}
    dist.destroy_process_group()
    return result


def overlap_matches_plain(ctx: ParallelContext, cfg: Any) -> dict[str, Any]:
    """Three steps of two micro-batches, once with the overlapped reducer and once without."""
    out: dict[str, Any] = {"grads": [], "weights": None, "buckets": 0, "started": []}
    runs = {}
    for overlap in (True, False):
        model = _model(cfg, ctx)
        optimizer = PlainOptimizer(model, optim=cfg.optim, ctx=ctx, device_kind="cpu", overlap=overlap,
                                   bucket_mb=BUCKET_MB)
        reducer = optimizer.reducer
        assert (reducer is not None) == overlap
        forward_backward = MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu")
        grads = []
        for step in range(3):
            train_step(forward_backward, optimizer, _micro_batches(ctx, step=step, count=2))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            if reducer is not None:
                out["started"].append(reducer.num_started)
        if reducer is not None:
            out["buckets"] = len(reducer.buckets)
        runs[overlap] = (grads, {n: p.detach().clone() for n, p in model.named_parameters()})
    out["grads"] = [runs[True][0], runs[False][0]]
    out["weights"] = [runs[True][1], runs[False][1]]
    return out


def overlap_event_order(ctx: ParallelContext, cfg: Any) -> dict[str, list[str]]:
    """The order of two kinds of events in one step: DP all-reduces and backward reaching layer 0.

    dist.all_reduce is wrapped (and still called) to log each call; a backward pre-hook on the first
    transformer block logs when backward gets there.
    """
    events: list[str] = []
    real_all_reduce = dist.all_reduce

    def logged_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is ctx.dp_group:
            events.append("dp all-reduce (async)" if kwargs.get("async_op") else "dp all-reduce")
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = logged_all_reduce
    out: dict[str, list[str]] = {}
    try:
        for overlap in (True, False):
            model = _model(cfg, ctx)
            optimizer = PlainOptimizer(model, optim=cfg.optim, ctx=ctx, device_kind="cpu", overlap=overlap,
                                       bucket_mb=BUCKET_MB)
            model.h["0"].register_full_backward_pre_hook(lambda *_: events.append("backward reached h.0"))
            events.clear()
            train_step(MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu"), optimizer,
                       _micro_batches(ctx, step=0, count=1))
            out["overlap" if overlap else "plain"] = list(events)
    finally:
        dist.all_reduce = real_all_reduce
    return out
