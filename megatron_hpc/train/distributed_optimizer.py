"""The distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer): each DP rank keeps Adam's moments
for one contiguous 1/DP slice of the parameters only.

Layout. A rank's parameters (in the optimizer's order: matrices, then 1-D tensors; train/optim.py) live in one flat
buffer, padded to a multiple of DP * SHARD_ALIGN elements, and the parameters become views into it; their gradients
are views into a second flat buffer of the same size, so backward accumulates straight into it. DP rank r owns
elements [r * n, (r + 1) * n) of both, n = padded / DP. Where the slice cuts a parameter it owns a piece of it;
AdamW runs over those pieces, which are views into the parameter buffer, so the update lands in the weights with no
copy (the weights are fp32 off XLA, so they are the "main" parameters themselves; Megatron keeps an extra fp32 copy
only for 16-bit weights). Weight decay and Adam are element-wise, so updating pieces gives the very numbers that
updating whole tensors does.

Step. Gradients are pre-divided by DP and reduce-scattered into this rank's slice (the same sum as the all-reduce of
the plain path, half its traffic); the norm sums the slice's squares over DP (then TP and PP, as
parallel/grads.py does); clipping and the update touch the slice; an all-gather of the slices refreshes every
rank's full weights. On gloo (the CPU backend) the same values come cheaper another way: its reduce_scatter_tensor
returns exactly the values of an all-reduce (checked bit for bit at DP 2, 3, 4, 5, 8) in 1.4-2.4x the time, and
its all_gather_into_tensor takes 2.5-10x as long as one broadcast per rank (benchmarks/RESULTS.md, issue 15). So
there the gradient buffer is all-reduced in place, the slice being a view of it, and each rank broadcasts its slice.

Memory per parameter: 4 bytes of weights and 4 of gradients as before, Adam's 8 bytes divided by DP.

Checkpoints. `state_dict()` gathers the slices onto DP rank 0 (the rank that writes, checkpoint/ranks.py) in the
plain optimizer's layout: one entry per parameter, whole. So a checkpoint saved with the distributed optimizer
loads at any DP size, with or without it, and `ckpt reshard` moves it by name like any other; `load_state_dict`
takes this rank's slice of each moment. Gathering is windowed (GATHER_WINDOW elements at a time per rank), so a
save never holds more than the whole state on rank 0 plus a window.

Why our own and not torch's: FSDP2's fully_shard (which runs on gloo here) is ZeRO-3: it turns every parameter into a
DTensor sharded over DP and gathers it for each forward, which our plain-tensor TP layers, the pipeline stages'
state dicts and the checkpoint layout would all have to follow, and it has no XLA path; torch's
ZeroRedundancyOptimizer assigns whole parameters to ranks (uneven shards: one embedding table can outweigh the rest)
and all-reduces the full gradients. The collectives used here (reduce_scatter_tensor, all_gather_into_tensor; on
gloo all_reduce and broadcast) are torch.distributed's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megatron_hpc.config.schema import OptimConfig
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.grads import reduce_norm_squares
from megatron_hpc.train.optim import param_groups

SHARD_ALIGN = 128
"""Each rank's slice is a multiple of this many elements (Megatron pads its buffers to DP * 128 as well)."""

GATHER_WINDOW = 16 * 1024 * 1024
"""Elements per rank gathered at a time when a checkpoint collects the moments (64 MiB of fp32)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of parameter `index` (optimizer order) inside this rank's slice: elements [start, end) of the
    parameter flattened, at [offset, offset + end - start) of the slice."""

    index: int
    start: int
    end: int
    offset: int


@dataclass(frozen=True, slots=True)
class ShardLayout:
    sizes: tuple[int, ...]
    """Elements of each parameter, in the optimizer's order."""
    padded: int
    """Length of the flat buffers: sum(sizes) rounded up to a multiple of DP * SHARD_ALIGN."""
    shard: int
    """Elements each rank owns: padded / DP."""
    lo: int
    """Where this rank's slice starts in the flat buffers."""
    pieces: tuple[Piece, ...]

    def starts(self) -> list[int]:
        """Where each parameter starts in the flat buffers."""
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += size
        return out


def shard_layout(sizes: Sequence[int], *, dp_size: int, dp_rank: int) -> ShardLayout:
    """Which parts of which parameters DP rank `dp_rank` owns (pure)."""
    total = sum(sizes)
    unit = dp_size * SHARD_ALIGN
    padded = max(unit, -(-total // unit) * unit)
    shard = padded // dp_size
    lo, hi = dp_rank * shard, (dp_rank + 1) * shard
    pieces, at = [], 0
    for index, size in enumerate(sizes):
        a, b = max(at, lo), min(at + size, hi)
        if a < b:
            pieces.append(Piece(index=index, start=a - at, end=b - at, offset=a - lo))
        at += size
    return ShardLayout(sizes=tuple(sizes), padded=padded, shard=shard, lo=lo, pieces=tuple(pieces))


class DistributedOptimizer:
    """AdamW over this DP rank's slice of the parameters; see the module docstring.

    Takes the plain optimizer's place in the loop: `param_groups` (the LR), `zero_grad`, `step`, `state_dict` and
    `load_state_dict` in the plain layout, `register_step_pre_hook`. The step itself calls `reduce_gradients` after
    backward and `clip_grad_norm_` before `step` (train/step.py).
    """

    def __init__(self, model: nn.Module, *, optim: OptimConfig, group: ProcessGroup):
        groups = param_groups(model, weight_decay=optim.weight_decay)
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"the distributed optimizer needs every parameter in one dtype on one device, got "
                             f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}")
        self.group = group
        self.dp_size, self.dp_rank = dist.get_world_size(group), dist.get_rank(group)
        self.gloo = dist.get_backend(group) == "gloo"
        """All-reduce in place and broadcast the slices instead of reduce-scatter and all-gather (module docstring)."""
        self.layout = shard_layout([p.numel() for p in self.params], dp_size=self.dp_size, dp_rank=self.dp_rank)
        dtype, device = dtypes.pop(), devices.pop()
        self.param_buffer = torch.zeros(self.layout.padded, dtype=dtype, device=device)
        self.grad_buffer = torch.zeros(self.layout.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p, start in zip(self.params, self.layout.starts()):
                view = self.param_buffer[start:start + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                p.grad = self.grad_buffer[start:start + p.numel()].view_as(p)
        lo, n = self.layout.lo, self.layout.shard
        self.param_shard = self.param_buffer[lo:lo + n]
        # At DP 1 the slice is the whole buffer and there is nothing to reduce; on gloo the reduce is in place. In
        # both the slice is a view of the buffer; a reduce-scatter needs a buffer of its own to write to.
        in_place = self.dp_size == 1 or self.gloo
        self.grad_shard = self.grad_buffer[lo:lo + n] if in_place else torch.zeros_like(self.param_shard)
        decay = {id(p) for p in groups[0]["params"]}
        self.pieces: list[torch.Tensor] = []
        pieces_of = ([], [])
        for piece in self.layout.pieces:
            main = self.param_shard[piece.offset:piece.offset + piece.end - piece.start]
            main.grad = self.grad_shard[piece.offset:piece.offset + piece.end - piece.start]
            self.pieces.append(main)
            pieces_of[0 if id(self.params[piece.index]) in decay else 1].append(main)
        self.optimizer = torch.optim.AdamW(
            [{"params": pieces_of[0], "weight_decay": optim.weight_decay},
             {"params": pieces_of[1], "weight_decay": 0.0}],
            lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
            fused=device.type in ("cpu", "cuda"))
        self._counted: list[torch.Tensor] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer (never None: the parameters' .grad are views into it)."""
        del set_to_none
        self.grad_buffer.zero_()
        if self.grad_shard.data_ptr() != self.grad_buffer.data_ptr():
            self.grad_shard.zero_()

    def reduce_gradients(self) -> None:
        """Average the gradients over DP into this rank's slice (reduce-scatter, pre-divided as the plain path; on
        gloo an all-reduce of the whole buffer, whose slice is grad_shard)."""
        if self.dp_size == 1:
            return
        self.grad_buffer.div_(self.dp_size)
        if self.gloo:
            dist.all_reduce(self.grad_buffer, op=dist.ReduceOp.SUM, group=self.group)
        else:
            dist.reduce_scatter_tensor(self.grad_shard, self.grad_buffer, op=dist.ReduceOp.SUM, group=self.group)

    def clip_grad_norm_(self, *, max_norm: float, ctx: ParallelContext, unscale: float = 1.0) -> torch.Tensor:
        """Unscale the slice's gradients, then clip them to the global norm max_norm (0: no clip); the norm.

        The norm counts what parallel/grads.global_grad_norm counts (replicated parameters on TP rank 0, the tied
        table's last-stage copy not at all); the slices of all DP ranks make up each parameter once.
        """
        if unscale != 1.0:
            self.grad_shard.mul_(unscale)
        counted = self._counted_grads(ctx)
        acc = torch.float64 if self.grad_shard.device.type == "cpu" else torch.float32
        if counted:
            total = torch.stack(torch._foreach_norm(counted, 2.0, dtype=acc)).pow(2).sum()
        else:
            total = torch.zeros((), dtype=acc, device=self.grad_shard.device)
        if self.dp_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        norm = reduce_norm_squares(total, ctx=ctx).sqrt().float()
        if max_norm > 0:
            self.grad_shard.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _counted_grads(self, ctx: ParallelContext) -> list[torch.Tensor]:
        if self._counted is None:
            counted = []
            for piece, main in zip(self.layout.pieces, self.pieces):
                p = self.params[piece.index]
                if ((getattr(p, "tensor_parallel", False) or ctx.tp_rank == 0)
                        and not getattr(p, "pipeline_duplicate", False)):
                    counted.append(main.grad)
            self._counted = counted
        return self._counted

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's slice, then gather every rank's slice into the full weights."""
        self.optimizer.step()
        if self.dp_size > 1:
            self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated slice into every rank's weights (all-gather; on gloo a broadcast per slice)."""
        if not self.gloo:
            dist.all_gather_into_tensor(self.param_buffer, self.param_shard.clone(), group=self.group)
            return
        n = self.layout.shard
        for r in range(self.dp_size):
            dist.broadcast(self.param_buffer[r * n:(r + 1) * n], src=dist.get_global_rank(self.group, r),
                           group=self.group)

    def register_step_pre_hook(self, hook: Callable[..., None]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    # -- checkpoints: the plain optimizer's layout ------------------------------------------------------------------

    def _settings(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _plain_groups(self) -> list[dict[str, Any]]:
        matrices = sum(1 for p in self.params if p.ndim >= 2)
        bounds = [(0, matrices), (matrices, len(self.params))]
        return [{**s, "params": list(range(a, b))} for s, (a, b) in zip(self._settings(), bounds)]

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in the plain AdamW layout on DP rank 0 (collective over DP); the other DP
        ranks, which do not write (checkpoint/ranks.py), get the groups without state."""
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
        for index, (p, start) in enumerate(zip(self.params, self.layout.starts())):
            state[index] = {"step": step.clone(),
                            **{key: full[key][start:start + p.numel()].view_as(p) for key in keys}}
        return {"state": state, "param_groups": groups}

    def _gather(self, key: str) -> torch.Tensor | None:
        """Moment `key` of every parameter, flat, on DP rank 0 (None elsewhere)."""
        local = torch.zeros_like(self.param_shard)
        for piece, main in zip(self.layout.pieces, self.pieces):
            if main in self.optimizer.state:
                local[piece.offset:piece.offset + main.numel()] = self.optimizer.state[main][key]
        if self.dp_size == 1:
            return local
        n = self.layout.shard
        out = torch.empty(self.layout.padded, dtype=local.dtype, device=local.device) if self.dp_rank == 0 else None
        root = dist.get_global_rank(self.group, 0)
        for a in range(0, n, GATHER_WINDOW):
            b = min(a + GATHER_WINDOW, n)
            window = local[a:b].contiguous()
            parts = [torch.empty_like(window) for _ in range(self.dp_size)] if out is not None else None
            dist.gather(window, gather_list=parts, dst=root, group=self.group)
            if out is not None:
                for r, part in enumerate(parts):
                    out[r * n + a:r * n + b] = part
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's slice of each parameter's moments from a plain-layout state dict (any DP size saved it)."""
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
