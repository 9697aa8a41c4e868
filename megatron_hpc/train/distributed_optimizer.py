"""The distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer): each DP rank keeps Adam's moments
for 1/DP of the parameters only.

Layout. A rank's parameters live in one flat buffer in backward order (the model's last parameters first), cut into
buckets of about parallel.grad_bucket_mb, each padded to a multiple of DP * SHARD_ALIGN elements; the parameters
become views into it, and their gradients views into a second flat buffer of the same layout, so backward
accumulates straight into it. DP rank r owns the r-th of the DP equal slices of every bucket (Megatron's layout).
Where a slice cuts a parameter the rank owns a piece of it; AdamW runs over those pieces, which are views into the
parameter buffer, so the update lands in the weights with no copy (the weights are fp32 off XLA, so they are the
"main" parameters themselves; Megatron keeps an extra fp32 copy only for 16-bit weights). Weight decay and Adam are
element-wise, so updating pieces gives the very numbers that updating whole tensors does.

Step. Each bucket's gradients are pre-divided by DP and reduce-scattered in place into this rank's slice (the same
sum as the plain path's all-reduce, half its traffic). With parallel.overlap_grad_reduce a bucket's reduce-scatter
starts inside the last micro-batch's backward as soon as its gradients are final (not under pipelining, as for the
plain path). The norm sums the slices' squares over DP (then TP and PP, as parallel/grads.py does); clipping and the
update touch the slices; all-gathers of the slices, in place, refresh every rank's full weights.

With parallel.overlap_param_gather (Megatron's --overlap-param-gather) the step only starts those all-gathers,
asynchronously, in forward order (the buckets are in backward order, so the last bucket, which holds the embedding,
goes first): a forward pre-hook on each module that holds parameters waits for its buckets just before that module
runs, so the first layers compute while the later buckets are still in flight (`wait_in_forward`). Whatever reads the
weights outside a forward (a save, evaluation, the run's end: train/loop.py) calls `wait_for_weights` first, and so
does the next step, before its update writes the slices. Under torch.compile the hooks would be traced into the
graph, so there `before_forward` waits for all of them before the forward instead.

On gloo (the CPU backend) the same values come cheaper another way: its reduce_scatter_tensor returns exactly an
all-reduce's values in 1.4-2.4x an all-reduce's time, and its all_gather_into_tensor takes 2.5-10x as long as one
broadcast per rank (benchmarks/RESULTS.md, issue 15). So there each bucket is all-reduced in place (this rank's
slice is a view of it) and each rank broadcasts its slices (ALL_REDUCE_ON_GLOO; the tests run both ways).

Memory per parameter: 4 bytes of weights and 4 of gradients as before (the flat buffers, padded), Adam's 8 bytes
divided by DP; the collectives run in place, so nothing else is allocated.

Checkpoints. `state_dict()` gathers the slices onto DP rank 0 (the rank that writes, checkpoint/store/ranks.py) in the
plain optimizer's layout: one entry per parameter, whole. So a checkpoint saved with the distributed optimizer
loads at any DP size, with or without it, and `ckpt reshard` moves it by name like any other; `load_state_dict`
takes this rank's pieces of each moment. Gathering is windowed (GATHER_WINDOW elements at a time per rank).

Why our own and not torch's: FSDP2's fully_shard (which runs on gloo here) is ZeRO-3: it turns every parameter into a
DTensor sharded over DP and gathers it for each forward, which our plain-tensor TP layers, the pipeline stages'
state dicts and the checkpoint layout would all have to follow, and it has no XLA path; torch's
ZeroRedundancyOptimizer assigns whole parameters to ranks (uneven shards: one embedding table can outweigh the rest)
and all-reduces the full gradients. The collectives used here (reduce_scatter_tensor, all_gather_into_tensor) are
torch.distributed's own and exist on gloo and NCCL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.errors import TrainingError
from megatron_hpc.parallel.collectives import all_gather_single, reduce_scatter_single
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.grads import BUCKET_MB, all_reduce_sum_, bucket_numel, reduce_norm_squares
from megatron_hpc.plan.memory import padded_parameters
from megatron_hpc.train.masked_step import take_back_step
from megatron_hpc.train.optim import param_groups, set_lr

GATHER_WINDOW = 16 * 1024 * 1024
"""Elements per rank gathered at a time when a checkpoint collects the moments (64 MiB of fp32)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of parameter `index` (optimizer order) this rank owns: elements [start, end) of the parameter
    flattened, at `offset` in the flat buffers."""

    index: int
    start: int
    end: int
    offset: int


@dataclass(frozen=True, slots=True)
class Bucket:
    start: int
    """Where the bucket starts in the flat buffers."""
    padded: int
    """Its length: its parameters' elements rounded up to a multiple of DP * SHARD_ALIGN."""
    members: tuple[int, ...]
    """The parameters in it (optimizer indices), in placement order."""


@dataclass(frozen=True, slots=True)
class ShardLayout:
    sizes: tuple[int, ...]
    """Elements of each parameter, in the optimizer's order."""
    starts: tuple[int, ...]
    """Where each parameter (optimizer order) starts in the flat buffers."""
    buckets: tuple[Bucket, ...]
    """In placement order (backward order)."""
    dp_size: int
    dp_rank: int
    pieces: tuple[Piece, ...]

    @property
    def padded(self) -> int:
        """Length of the flat buffers."""
        return sum(b.padded for b in self.buckets)

    def slice_of(self, bucket: Bucket) -> tuple[int, int]:
        """[lo, hi) of this rank's slice of `bucket` in the flat buffers."""
        n = bucket.padded // self.dp_size
        lo = bucket.start + self.dp_rank * n
        return lo, lo + n


def shard_layout(sizes: Sequence[int], *, dp_size: int, dp_rank: int, order: Sequence[int] | None = None,
                 bucket_elements: int | None = None) -> ShardLayout:
    """Which parts of which parameters DP rank `dp_rank` owns (pure). `order`: the placement order of the
    parameters (optimizer indices; default their own order); a bucket closes before a parameter that would take it
    past `bucket_elements` (default: one bucket)."""
    order = list(range(len(sizes))) if order is None else list(order)
    groups: list[list[int]] = []
    for index in order:
        if groups and (bucket_elements is None or sum(sizes[i] for i in groups[-1]) + sizes[index] <= bucket_elements):
            groups[-1].append(index)
        else:
            groups.append([index])
    starts = [0] * len(sizes)
    buckets, pieces, at = [], [], 0
    for members in groups:
        padded = padded_parameters(sum(sizes[i] for i in members), dp_size)
        bucket = Bucket(start=at, padded=padded, members=tuple(members))
        n = padded // dp_size
        lo, hi = at + dp_rank * n, at + (dp_rank + 1) * n
        offset = at
        for index in members:
            starts[index] = offset
            a, b = max(offset, lo), min(offset + sizes[index], hi)
            if a < b:
                pieces.append(Piece(index=index, start=a - offset, end=b - offset, offset=a))
            offset += sizes[index]
        buckets.append(bucket)
        at += padded
    return ShardLayout(sizes=tuple(sizes), starts=tuple(starts), buckets=tuple(buckets), dp_size=dp_size,
                       dp_rank=dp_rank, pieces=tuple(pieces))


class DistributedOptimizer:
    """AdamW over this DP rank's slices of the parameters; see the module docstring.

    ALL_REDUCE_ON_GLOO: on gloo, all-reduce the buckets and broadcast the slices instead of reduce-scatter and
    all-gather (the same numbers, faster there); a test turns it off to run the NCCL path's collectives on gloo.

    One of the three optimizers behind train/optimizer.py's seam (its verbs are listed there): `before_forward`,
    `mark_last_backward` (the overlapped reduce-scatter), `reduce_and_clip` (reduce_gradients, the sequence-parallel
    TP sum and clip_grad_norm_ on the slices), `step_if_finite` (step: the update and the gathers), and
    `state_dict` / `load_state_dict` in the plain layout. With overlap_param_gather build_optimizer installs the
    forward hooks (`wait_in_forward`) and the loop calls `wait_for_weights` before anything else reads the weights.
    """

    ALL_REDUCE_ON_GLOO = True

    def __init__(self, model: nn.Module, *, optim: OptimConfig, ctx: ParallelContext, overlap: bool = False,
                 bucket_mb: float = BUCKET_MB, overlap_param_gather: bool = False):
        groups = param_groups(model, weight_decay=optim.weight_decay)
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"the distributed optimizer needs every parameter in one dtype on one device, got "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
        self.ctx, self.clip_grad, self.group = ctx, optim.clip_grad, ctx.dp_group
        self.dp_size, self.dp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.all_reduce = self.ALL_REDUCE_ON_GLOO and dist.get_backend(self.group) == "gloo"
        self._ranks = [dist.get_global_rank(self.group, r) for r in range(self.dp_size)]
        index_of = {id(p): i for i, p in enumerate(self.params)}
        backward_order = [index_of[id(p)] for p in reversed(list(model.parameters())) if id(p) in index_of]
        dtype, device = dtypes.pop(), devices.pop()
        self.layout = shard_layout([p.numel() for p in self.params], dp_size=self.dp_size, dp_rank=self.dp_rank,
                                   order=backward_order, bucket_elements=bucket_numel(bucket_mb, dtype=dtype))
        self.param_buffer = torch.zeros(self.layout.padded, dtype=dtype, device=device)
        self.grad_buffer = torch.zeros(self.layout.padded, dtype=dtype, device=device)
        self._into_buffers()
        # Both collectives work in place (a slice is the rank's own part of its bucket, which NCCL and gloo allow),
        # so the slices are views and the step allocates nothing.
        self._slices = [self.layout.slice_of(b) for b in self.layout.buckets]
        self.grad_slices = [self.grad_buffer[lo:hi] for lo, hi in self._slices]
        decay = {id(p) for p in groups[0]["params"]}
        self.pieces: list[torch.Tensor] = []
        pieces_of: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for piece in self.layout.pieces:
            at, n = piece.offset, piece.end - piece.start
            main = self.param_buffer[at:at + n]
            main.grad = self.grad_buffer[at:at + n]
            self.pieces.append(main)
            pieces_of[0 if id(self.params[piece.index]) in decay else 1].append(main)
        self.optimizer = torch.optim.AdamW(
            [{"params": pieces_of[0], "weight_decay": optim.weight_decay},
             {"params": pieces_of[1], "weight_decay": 0.0}],
            lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
            fused=device.type in ("cpu", "cuda"))
        self._counted: list[torch.Tensor] | None = None
        # Overlap: a post-accumulate-grad hook counts each parameter's final gradient in the armed backward; a
        # bucket's reduce-scatter starts when all its members are final and every earlier bucket has started (the
        # same order on every DP rank).
        self._armed = False
        self._next = 0
        self._ready = [0] * len(self.layout.buckets)
        self._final: set[int] = set()
        self._in_flight: list[dist.Work | None] = []
        self._bucket_of = {i: b for b, bucket in enumerate(self.layout.buckets) for i in bucket.members}
        self._hooks = []
        if overlap and self.dp_size > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(i, self._bucket_of[i]))
                           for i, p in enumerate(self.params)]
        self.overlap_param_gather = overlap_param_gather and self.dp_size > 1
        self._gathers: dict[int, list[dist.Work | None]] = {}
        """Bucket -> its all-gather (or broadcasts) in flight, started by the last step and not yet waited for."""
        self._forward_hooks: list[Any] = []

    @torch.no_grad()
    def _into_buffers(self) -> None:
        """The parameters become views into the parameter buffer (their values copied in), their .grad views into
        the gradient buffer."""
        for p, start in zip(self.params, self.layout.starts):
            view = self.param_buffer[start:start + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            p.grad = self.grad_buffer[start:start + p.numel()].view_as(p)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def overlapped(self) -> bool:
        return bool(self._hooks)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer (never None: the parameters' .grad are views into it)."""
        del set_to_none
        self.grad_buffer.zero_()

    def _hook_for(self, index: int, bucket: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if not self._armed:
                return
            if index in self._final:
                raise TrainingError(f"parameter {index} received two gradients in one backward while its "
                                    "reduce-scatter was overlapped; set parallel.overlap_grad_reduce=false")
            self._final.add(index)
            self._ready[bucket] += 1
            while (self._next < len(self.layout.buckets)
                   and self._ready[self._next] == len(self.layout.buckets[self._next].members)):
                self._start(self._next, async_op=True)
                self._next += 1
        return hook

    def mark_last_backward(self) -> None:
        """The next backward is the step's last: start each bucket's reduce-scatter when its gradients are final
        (a no-op without overlap)."""
        if not self.overlapped:
            return
        self._wait()  # leftovers of a step that raised mid-backward
        self._final.clear()
        self._ready = [0] * len(self.layout.buckets)
        self._next = 0
        self._armed = True

    def _start(self, b: int, *, async_op: bool) -> None:
        bucket = self.layout.buckets[b]
        whole = self.grad_buffer[bucket.start:bucket.start + bucket.padded]
        whole.div_(self.dp_size)
        if self.all_reduce:
            work = dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        else:
            work = reduce_scatter_single(self.grad_slices[b], whole, op=dist.ReduceOp.SUM, group=self.group,
                                              async_op=async_op)
        self._in_flight.append(work)

    def _wait(self) -> None:
        for work in self._in_flight:
            if work is not None:
                work.wait()
        self._in_flight.clear()

    def reduce_gradients(self) -> None:
        """Average the gradients over DP into this rank's slices: start the buckets the overlapped backward did not
        (all of them without overlap), then wait for every reduce-scatter."""
        self._armed = False
        if self.dp_size == 1:
            return
        first = self._next if self.overlapped else 0
        for b in range(first, len(self.layout.buckets)):
            self._start(b, async_op=True)
        self._next = 0
        self._wait()

    def sequence_parallel_grads(self) -> list[torch.Tensor]:
        """This rank's pieces of the gradients of parameters tagged sequence_parallel (every TP rank has the same
        layout, so the pieces line up across TP for the all-reduce that completes them)."""
        return [main.grad for piece, main in zip(self.layout.pieces, self.pieces)
                if getattr(self.params[piece.index], "sequence_parallel", False)]

    def reduce_and_clip(self, *, loss_scale: float = 1.0) -> torch.Tensor:
        """The DP reduce-scatter into this rank's slices (started in backward when overlapped), then the TP sum of the
        sequence-parallel grads on their pieces there (sums commute); the norm, the clip and the update then touch
        the slices alone. The global norm before clipping."""
        self.reduce_gradients()
        all_reduce_sum_(self.sequence_parallel_grads(), group=self.ctx.tp_group)
        return self.clip_grad_norm_(max_norm=self.clip_grad, unscale=1.0 / loss_scale)

    def clip_grad_norm_(self, *, max_norm: float, unscale: float = 1.0) -> torch.Tensor:
        """Unscale the slices' gradients, then clip them to the global norm max_norm (0: no clip); the norm.

        The norm counts what parallel/grads.global_grad_norm counts (replicated parameters on TP rank 0, the tied
        table's last-stage copy not at all); the slices of all DP ranks make up each parameter once.
        """
        if unscale != 1.0:
            torch._foreach_mul_(self.grad_slices, unscale)
        counted = self._counted_grads(self.ctx)
        device = self.grad_buffer.device
        acc = torch.float64 if device.type == "cpu" else torch.float32
        if counted:
            total = torch.stack(torch._foreach_norm(counted, 2.0, dtype=acc)).pow(2).sum()
        else:
            total = torch.zeros((), dtype=acc, device=device)
        if self.dp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        norm = reduce_norm_squares(total, ctx=self.ctx).sqrt().float()
        if max_norm > 0:
            torch._foreach_mul_(self.grad_slices, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _counted_grads(self, ctx: ParallelContext) -> list[torch.Tensor]:
        if self._counted is None:
            self._counted = [main.grad for piece, main in zip(self.layout.pieces, self.pieces)
                             if (getattr(self.params[piece.index], "tensor_parallel", False) or ctx.tp_rank == 0)
                             and not getattr(self.params[piece.index], "pipeline_duplicate", False)]
        return self._counted

    def step_if_finite(self, finite: torch.Tensor) -> bool:
        """`step` unless the gradient norm was not finite (a host read of the flag: never on XLA, where
        train/xla_zero.py takes this optimizer's place); whether the step was skipped."""
        skipped = not bool(finite.item())  # host sync: the skip decision
        if not skipped:
            self.step()
        return skipped

    def take_back_step(self) -> None:
        take_back_step(self.optimizer)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def wait_for_weights(self) -> None:
        """The all-gathers still in flight (overlap_param_gather) are done: the weights are the updated ones."""
        self.finish_param_gather()

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slices, then gather every rank's slices into the full weights (only started with
        overlap_param_gather: the next forward waits for them)."""
        self.finish_param_gather()  # a bucket no forward waited for (parameters the model did not use)
        self.optimizer.step()
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated slices into every rank's weights (all-gathers; on gloo a broadcast per slice): waited
        for here, or left in flight with overlap_param_gather."""
        if self.dp_size == 1:
            return
        # Forward order: on NCCL's one stream the gathers run in the order they start, so the first layer's goes first.
        for b in reversed(range(len(self.layout.buckets))):
            self._gathers[b] = self._start_gather(b)
        if not self.overlap_param_gather:
            self.finish_param_gather()

    def _start_gather(self, b: int) -> list[dist.Work | None]:
        bucket, (lo, hi) = self.layout.buckets[b], self._slices[b]
        if self.all_reduce:
            n = hi - lo
            return [dist.broadcast(self.param_buffer[bucket.start + r * n:bucket.start + (r + 1) * n], src=src,
                                   group=self.group, async_op=True) for r, src in enumerate(self._ranks)]
        return [all_gather_single(self.param_buffer[bucket.start:bucket.start + bucket.padded],
                                  self.param_buffer[lo:hi], group=self.group, async_op=True)]

    def finish_param_gather(self, buckets: Iterable[int] | None = None) -> None:
        """Wait for the gathers in flight of `buckets` (default: all); their weights are then the updated ones (on
        NCCL: ordered before what the current stream runs next)."""
        for b in list(self._gathers) if buckets is None else buckets:
            for work in self._gathers.pop(b, ()):
                if work is not None:
                    work.wait()

    def wait_in_forward(self, model: nn.Module) -> None:
        """With overlap_param_gather: each module of `model` that holds parameters waits for their buckets' gathers
        in a forward pre-hook, just before it runs (not for a model under torch.compile, which would trace the
        hooks: there `before_forward` waits). A no-op without overlap_param_gather."""
        if not self.overlap_param_gather or self._forward_hooks:
            return
        index_of = {id(p): i for i, p in enumerate(self.params)}
        for module in model.modules():
            buckets = sorted({self._bucket_of[index_of[id(p)]] for p in module.parameters(recurse=False)
                              if id(p) in index_of}, reverse=True)
            if buckets:
                self._forward_hooks.append(module.register_forward_pre_hook(self._waiter(tuple(buckets))))

    def _waiter(self, buckets: tuple[int, ...]) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self.finish_param_gather(buckets)
        return hook

    def before_forward(self) -> None:
        """The step's forward is next: without forward hooks (`wait_in_forward`), wait for every gather now."""
        if not self._forward_hooks:
            self.finish_param_gather()

    def register_step_pre_hook(self, hook: Callable[..., None]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    # -- checkpoints: the plain optimizer's layout ------------------------------------------------------------------

    def _plain_groups(self) -> list[dict[str, Any]]:
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        matrices = sum(1 for p in self.params if p.ndim >= 2)
        bounds = [(0, matrices), (matrices, len(self.params))]
        return [{**s, "params": list(range(a, b))} for s, (a, b) in zip(settings, bounds)]

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in the plain AdamW layout on DP rank 0 (collective over DP); the other DP
        ranks, which do not write (checkpoint/store/ranks.py), get the groups without state."""
        groups = self._plain_groups()
        inner = self.optimizer.state
        stepped = [inner[m] for m in self.pieces if m in inner]
        if self.pieces and not stepped:  # never stepped: nothing to gather (every rank agrees: they step together)
            return {"state": {}, "param_groups": groups}
        keys = ("exp_avg", "exp_avg_sq")
        full = {key: self._gather(key) for key in keys}
        if self.dp_rank != 0:
            return {"state": {}, "param_groups": groups}
        step = stepped[0]["step"].detach().clone() if stepped else torch.tensor(0.0)
        state = {}
        for index, (p, start) in enumerate(zip(self.params, self.layout.starts)):
            state[index] = {"step": step.clone(),
                            **{key: full[key][start:start + p.numel()].view_as(p) for key in keys}}
        return {"state": state, "param_groups": groups}

    def _gather(self, key: str) -> torch.Tensor | None:
        """Moment `key` of every parameter in the flat layout, on DP rank 0 (None elsewhere)."""
        out = torch.zeros_like(self.param_buffer) if self.dp_rank == 0 else None
        root = self._ranks[0]
        state = self.optimizer.state
        for bucket, (lo, hi) in zip(self.layout.buckets, self._slices):
            n = hi - lo
            local = torch.zeros(n, dtype=self.param_buffer.dtype, device=self.param_buffer.device)
            for piece, main in zip(self.layout.pieces, self.pieces):
                if lo <= piece.offset < hi and main in state:
                    local[piece.offset - lo:piece.offset - lo + main.numel()] = state[main][key]
            if self.dp_size == 1:
                out[lo:hi] = local
                continue
            for a in range(0, n, GATHER_WINDOW):
                b = min(a + GATHER_WINDOW, n)
                parts = [torch.empty(b - a, dtype=local.dtype, device=local.device)
                         for _ in range(self.dp_size)] if out is not None else None
                dist.gather(local[a:b], gather_list=parts, dst=root, group=self.group)
                if out is not None:
                    for r, part in enumerate(parts):
                        out[bucket.start + r * n + a:bucket.start + r * n + b] = part
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's pieces of each parameter's moments from a plain-layout state dict (any DP size saved
        it)."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        matrices = sum(1 for p in self.params if p.ndim >= 2)
        if sizes != [matrices, len(self.params) - matrices]:
            raise ValueError(f"optimizer groups of {sizes} parameters for a model of {matrices} matrices and "
                             f"{len(self.params) - matrices} 1-D tensors")
        ids = [i for g in groups for i in g["params"]]
        saved = state_dict["state"]
        for group, settings in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in settings.items() if k not in ("params", "fused", "foreach")})
        for piece, main in zip(self.layout.pieces, self.pieces):
            moments = saved.get(ids[piece.index])
            if moments is None:
                self.optimizer.state.pop(main, None)
                continue
            p = self.params[piece.index]
            entry: dict[str, torch.Tensor] = {}
            for key, value in moments.items():
                if key == "step":
                    entry[key] = torch.as_tensor(value, dtype=torch.float32).clone().to(main.device)
                    continue
                if value.shape != p.shape:
                    raise ValueError(f"saved {key} of shape {tuple(value.shape)} for a parameter of shape "
                                     f"{tuple(p.shape)}")
                entry[key] = value.reshape(-1)[piece.start:piece.end].to(main.device, main.dtype).clone()
            self.optimizer.state[main] = entry
