"""Gradient collectives: data-parallel averaging (bucketed, optionally overlapped with backward) and the clip.

After backward, every TP rank of a DP replica holds identical gradients for replicated
parameters (LayerNorms, row biases, positions): the copy_to_tp_region backward already summed
their upstream gradients. So the norm counts a replicated parameter on TP rank 0 only and sums
the sharded ones over the TP group, then the stages over the pipeline group. DP replicas hold
identical gradients after the average.

Buckets hold parameters in reverse order, the order in which backward finishes their gradients.
Both DP paths use the same buckets and the same arithmetic (flatten, pre-divide, all-reduce,
copy back), so overlapping changes when the all-reduces run, never what they compute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megatron_hpc.errors import ConfigError, TrainingError
from megatron_hpc.parallel.context import ParallelContext

BUCKET_MB = 128.0
"""Default all-reduce bucket size in MiB (32M fp32 elements): few calls, bounded extra memory."""


def bucket_numel(bucket_mb: float, *, dtype: torch.dtype = torch.float32) -> int:
    """Elements of `dtype` in a bucket of bucket_mb MiB (at least one)."""
    if not bucket_mb > 0:
        raise ConfigError(f"parallel.grad_bucket_mb must be positive, got {bucket_mb}; the default is {BUCKET_MB}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, int(bucket_mb * 1024 * 1024) // itemsize)


def plan_buckets(tensors: Sequence[torch.Tensor], *, max_numel: int) -> list[list[int]]:
    """Indices into `tensors`, grouped into buckets from the last tensor to the first.

    A bucket closes before a tensor that would take it past max_numel or that has another dtype
    (one flat buffer per bucket). A tensor larger than max_numel gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    numel = 0
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        if buckets and numel + t.numel() <= max_numel and t.dtype == tensors[buckets[-1][0]].dtype:
            buckets[-1].append(i)
            numel += t.numel()
        else:
            buckets.append([i])
            numel = t.numel()
    return buckets


def _start_bucket(grads: list[torch.Tensor], *, group: ProcessGroup, size: int,
                  async_op: bool) -> tuple[dist.Work | None, torch.Tensor]:
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat.div_(size)  # pre-divide, as the Neuron reference does, to keep sums in range
    return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op), flat


def _unflatten_into(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_gradients(params: Iterable[nn.Parameter], *, group: ProcessGroup,
                         bucket_mb: float = BUCKET_MB) -> None:
    """Average .grad over the DP group after backward, in flat buckets, last layers first."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in plan_buckets(grads, max_numel=bucket_numel(bucket_mb)):
        members = [grads[i] for i in bucket]
        _, flat = _start_bucket(members, group=group, size=size, async_op=False)
        _unflatten_into(flat, members)


class OverlappedGradReducer:
    """Averages .grad over the DP group, starting each bucket's all-reduce inside backward.

    Per step: `arm()` just before the last micro-batch's backward, `finish()` after it and before
    anything reads the gradients. While armed, a post-accumulate-grad hook counts each parameter's
    final gradient; when every parameter of the next bucket in order is final, that bucket's
    async all-reduce starts while backward goes on with earlier layers. Buckets start strictly in
    order, so every DP rank issues the same sequence of collectives. Earlier micro-batches only
    accumulate: their gradients are not final yet.
    """

    def __init__(self, params: Iterable[nn.Parameter], *, group: ProcessGroup, bucket_mb: float = BUCKET_MB):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group)
        self.buckets = plan_buckets(self.params, max_numel=bucket_numel(bucket_mb))
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._armed = False
        self._final: set[int] = set()
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._in_flight: list[tuple[dist.Work | None, torch.Tensor, list[torch.Tensor]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self._armed:
                self._grad_final(index)
        return hook

    @property
    def num_started(self) -> int:
        """Buckets whose all-reduce has started in this step (observability: how much overlapped)."""
        return self._next

    def arm(self) -> None:
        """The next backward is the step's last: start each bucket as soon as its gradients are final."""
        self._wait_all(copy=False)  # leftovers of a step that raised mid-backward
        self._final.clear()
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._armed = True

    def _grad_final(self, index: int) -> None:
        if index in self._final:
            # A second accumulation after the bucket may have left: the average would miss it.
            raise TrainingError(f"parameter {index} received two gradients in one backward while its DP "
                                f"all-reduce was overlapped; set parallel.overlap_grad_reduce=false")
        self._final.add(index)
        bucket = self._bucket_of[index]
        self._ready[bucket] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._start(self._next)
            self._next += 1

    def _start(self, bucket: int) -> None:
        grads = [g for g in (self.params[i].grad for i in self.buckets[bucket]) if g is not None]
        if grads:
            work, flat = _start_bucket(grads, group=self.group, size=self.size, async_op=True)
            self._in_flight.append((work, flat, grads))

    def finish(self) -> None:
        """Start the buckets backward did not complete (parameters without a gradient), wait for all."""
        self._armed = False
        while self._next < len(self.buckets):
            self._start(self._next)
            self._next += 1
        self._wait_all(copy=True)

    def _wait_all(self, *, copy: bool) -> None:
        for work, flat, grads in self._in_flight:
            if work is not None:
                work.wait()
            if copy:
                _unflatten_into(flat, grads)
        self._in_flight.clear()

    def close(self) -> None:
        """Remove the hooks (the model can then be reduced another way)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._armed = False


def all_reduce_sequence_parallel_grads(params: Iterable[nn.Parameter], *, group: ProcessGroup) -> None:
    """Sum over TP the gradients of parameters tagged `sequence_parallel` (Megatron's
    allreduce_sequence_parallel_grads): each TP rank saw one sequence shard, so each holds a partial sum.

    Afterwards they are identical on every TP rank, so global_grad_norm counting replicated params on tp_rank 0
    stays right. Sums commute, so this may run before or after the DP all-reduce.
    """
    all_reduce_sum_([p.grad for p in params if p.grad is not None and getattr(p, "sequence_parallel", False)],
                    group=group)


def all_reduce_sum_(tensors: Sequence[torch.Tensor], *, group: ProcessGroup) -> None:
    """Sum `tensors` over `group` in place, in one call (they are small: LayerNorms, biases, or their pieces)."""
    if not tensors or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    _unflatten_into(flat, list(tensors))


def global_grad_norm(params: Iterable[nn.Parameter], *, ctx: ParallelContext) -> torch.Tensor:
    """L2 norm of the full model's gradient; a 0-dim fp32 tensor on the grads' device (no host sync)."""
    grads = [p.grad.detach() for p in params
             if p.grad is not None and (getattr(p, "tensor_parallel", False) or ctx.tp_rank == 0)
             and not getattr(p, "pipeline_duplicate", False)]
    if not grads:
        raise ValueError("no parameter has a gradient; call backward before the norm")
    # One fused pass per tensor, then the sum of squares. Each norm accumulates in fp32 (bf16 grads included), except
    # on the CPU: torch's CPU norm sums fp32 in one running total, off by 3e-4 relative for a 2M-element embedding
    # gradient (measured against float64), which made the norm depend on how TP shards the table; float64 there
    # costs about 2.5 ms per step for 5M parameters. GPU and XLA reductions are tree-shaped and stay in fp32.
    acc = torch.float64 if grads[0].device.type == "cpu" else torch.float32
    norms = torch._foreach_norm(grads, 2.0, dtype=acc)
    return reduce_norm_squares(torch.stack(norms).pow(2).sum(), ctx=ctx).sqrt().float()


def reduce_norm_squares(total: torch.Tensor, *, ctx: ParallelContext) -> torch.Tensor:
    """A rank's sum of squared gradients (its TP shards, its stages) summed over TP and PP, in place."""
    if ctx.tp_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.tp_group)
    if ctx.pp_size > 1:  # each stage holds other parameters (the tied table's last-stage copy left out above)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.pp_group)
    return total


def clip_gradients_(params: Iterable[nn.Parameter], *, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
    """Scale grads so the global norm is at most max_norm (0 disables); returns the norm before clipping."""
    params = list(params)
    norm = global_grad_norm(params, ctx=ctx)
    if max_norm > 0:
        # Megatron's clip_coeff = max_norm / (norm + 1e-6), applied only when < 1; clamp does that
        # on the device, without a host sync.
        coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, coeff)
    return norm


def build_grad_reducer(params: Iterable[nn.Parameter], *, group: ProcessGroup, overlap: bool,
                       bucket_mb: float, device_kind: str) -> OverlappedGradReducer | None:
    """The overlapped reducer when asked for and useful; None means all-reduce after backward.

    Not on XLA: a hook there only records ops into the lazy graph, which runs at mark_step
    anyway, so the reference's after-backward path is kept. Not with one DP rank: nothing to reduce.
    """
    if not overlap or device_kind == "xla" or dist.get_world_size(group) == 1:
        return None
    return OverlappedGradReducer(params, group=group, bucket_mb=bucket_mb)
