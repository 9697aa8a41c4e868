"""Megatron's distributed optimizer file, distrib_optim.pt, back into Adam's state per parameter.

With --use-distributed-optimizer and the legacy (torch) checkpoint format, Megatron keeps only the optimizer's
settings in model_optim_rng.pt ({'optimizer': {'param_groups': [... 'step' ...]}, 'grad_scaler'?}) and writes the
per-parameter state beside it, gathered on data-parallel rank 0 (megatron-core optimizer/distrib_optimizer.py,
save_parameter_state -> get_parameter_state_dp_zero):

    {'buckets_coalesced': True,
     gbuf_index: {dtype key: {'param': fp32 [n], 'exp_avg': fp32 [n], 'exp_avg_sq': fp32 [n], 'numel_unpadded': n}}}

One grad buffer per model chunk (per (param dtype, grad dtype) pair; a dense GPT has one); the dtype key is a
torch.dtype in older versions, a (param dtype, grad dtype) pair now. Each tensor is the buffer's flat layout
(distributed/param_and_grad_buffer.py) with every bucket's end padding cut off:

- parameters are placed in reverse order of the chunk's parameters (the model dict's order);
- each parameter starts at a multiple of 64 elements (megatron-core since 2024; earlier: unaligned);
- a new bucket starts once a bucket holds --ddp-bucket-size elements (only with --overlap-grad-reduce), and the
  shared embedding of a pipelined tied model (first stage's word embeddings, last stage's output layer) gets a
  bucket of its own; bucket starts are 128-aligned in the buffer, so alignment counts from each bucket's start.

The format before Feb 2024 (one tensor per bucket, no 'buckets_coalesced') is refused with Megatron's own fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.errors import CheckpointError

FILE = "distrib_optim.pt"
KEYS = ("param", "exp_avg", "exp_avg_sq")
_ALIGNMENTS = (64, 1)
"""Parameter start alignments megatron-core has used, newest first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """One model chunk of a rank, as the distributed optimizer's buffer saw it."""

    params: dict[str, torch.Size]
    """Each parameter's shape, by its name in the source, in the chunk's parameter order."""
    own_bucket: frozenset[str] = frozenset()
    """Parameters that start a bucket of their own (the shared embedding of a pipelined tied model)."""


def offsets(chunk: Chunk, *, align: int, bucket_size: int | None) -> tuple[dict[str, int], int]:
    """(each parameter's start in the saved flat tensors, their length) for this layout rule."""
    starts: dict[str, int] = {}
    bucket_start = 0  # in the saved tensors, where padding between buckets is gone
    used = 0  # elements of the current bucket, its alignment padding included
    held = 0  # parameters in the current bucket
    for name in reversed(list(chunk.params)):
        numel = chunk.params[name].numel()
        used = -(-used // align) * align
        alone = name in chunk.own_bucket
        if alone and held:
            bucket_start, used, held = bucket_start + used, 0, 0
        starts[name] = bucket_start + used
        used += numel
        held += 1
        if alone or (bucket_size is not None and used >= bucket_size):
            bucket_start, used, held = bucket_start + used, 0, 0
    return starts, bucket_start + used


def _buffers(state: Any, *, path: Path, num_chunks: int) -> list[dict[str, Any]]:
    """The per-chunk {'param', 'exp_avg', 'exp_avg_sq', 'numel_unpadded'} of the file."""
    if isinstance(state, list):
        if len(state) != 1:
            raise CheckpointError(f"{path} holds the states of {len(state)} chained optimizers (expert-parallel "
                                  "or per-group optimizers), which are not read; convert without it (weights "
                                  "only) by moving it away")
        state = state[0]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not Megatron's distributed optimizer state; "
                              "the file is damaged, copy it again")
    if not state.get("buckets_coalesced"):
        raise CheckpointError(f"{path} is in the distributed optimizer's pre-2024 layout (one tensor per bucket); "
                              "update it with Megatron's --ckpt-convert-update-legacy-dist-opt-format and convert "
                              "the result")
    found = sorted(k for k in state if isinstance(k, int))
    if found != list(range(num_chunks)):
        raise CheckpointError(f"{path} holds grad buffers {found}, but model_optim_rng.pt beside it has "
                              f"{num_chunks} model chunk(s) of one dtype; the files are from different runs")
    out = []
    for i in found:
        by_dtype = state[i]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise CheckpointError(f"{path}: grad buffer {i} holds {len(by_dtype) if isinstance(by_dtype, dict) else 0} "
                                  "dtype groups, not one; only one parameter dtype per model chunk is read")
        (buf,) = by_dtype.values()
        if not isinstance(buf, dict) or any(not isinstance(buf.get(k), torch.Tensor) for k in KEYS):
            raise CheckpointError(f"{path}: grad buffer {i} lacks {', '.join(KEYS)} tensors; the file is damaged, "
                                  "copy it again")
        out.append(buf)
    return out


def unflatten(state: Any, chunks: list[Chunk], *, bucket_size: int | None,
              path: Path) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Each chunk's {name: {'param', 'exp_avg', 'exp_avg_sq'}} (fp32, in the parameter's shape) from the file's
    state; CheckpointError naming `path` when its sizes disagree with the model."""
    out = []
    for i, (chunk, buf) in enumerate(zip(chunks, _buffers(state, path=path, num_chunks=len(chunks)))):
        size = buf["param"].numel()
        if any(buf[k].numel() != size for k in KEYS):
            raise CheckpointError(f"{path}: grad buffer {i} has param, exp_avg, exp_avg_sq of "
                                  f"{[buf[k].numel() for k in KEYS]} elements, not one size; the file is damaged")
        tried = {}
        for align in _ALIGNMENTS:
            starts, length = offsets(chunk, align=align, bucket_size=bucket_size)
            tried[align] = length
            if length == size:
                break
        else:
            raise CheckpointError(
                f"{path} holds {size} optimizer elements for model chunk {i}, but the {len(chunk.params)} parameters "
                f"({sum(s.numel() for s in chunk.params.values())} elements) in model_optim_rng.pt lay out to "
                f"{' or '.join(map(str, tried.values()))}; the file is from another model or run, pass the "
                f"distrib_optim.pt saved with this model_optim_rng.pt")
        out.append({name: {k: buf[k][start:start + chunk.params[name].numel()].float().reshape(chunk.params[name])
                           for k in KEYS} for name, start in starts.items()})
    return out
