"""A torch_dist checkpoint read a bounded part at a time, for `ckpt convert --to torch|xser` (stream.reshard).

Reading it whole (torch_dist_files.read of every key) holds the whole checkpoint before a byte is written. Here the
whole's tensors are meta and stream.reshard fetches each of our tensors when it makes an output rank: the fetch reads
its *unit* through torch.distributed.checkpoint, one load of a subset of keys (no process group): for a decoder layer,
that layer's slice of every stacked key (weights, fp32 masters, Adam's moments: a box of each global tensor, which
megatron-core saves as one chunk per layer and TP rank), else one key with its moments. The distributed optimizer's
dp_reshardable state is read the same way: a unit's parameters lie side by side in each flat bucket buffer, so it is
one 1-D box per (rank, bucket, state), each parameter put together from its TP pieces (torch_dist_buckets.py); the
boxes are held beside what they make until it is made. reshard walks our tensors in model order, layer after layer,
so a unit's tensors are asked for together and let go together.

A unit stays held until reshard releases all its tensors (their last output rank is written) while the held bytes stay
within `budget`; one read past the budget is held only until the next unit is read, and read again if a later output
rank needs it. So the reader holds at most `budget` plus one unit (about the largest key: the word embeddings or one
layer of everything), whatever the checkpoint's size; with a budget above the checkpoint, every byte is read once.
`peak_bytes` says what it held at most (the test of the bound reads it).

Weights come from the fp32 masters where the optimizer kept them (as import_torch_dist's whole read takes them), so
the 16-bit weights are not read at all then.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from megatron_hpc.checkpoint.foreign import torch_dist_keys
from megatron_hpc.checkpoint.foreign.torch_dist_buckets import Flat, assemble, widen
from megatron_hpc.checkpoint.foreign.torch_dist_files import Box, TorchDistFolder, read

READ_BUDGET = 1 << 30
"""Bytes of the source `ckpt convert` holds at once by default (plus one unit). Reading a part again costs little
beside writing it (benchmarks/RESULTS.md, issue 27), so the default is a bound, not a cache of the checkpoint."""
_OUR_LAYER = re.compile(r"^h\.(\d+)\.")
_SWIGLU_FC1 = ("decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc1.bias")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one of our tensors lies in the source: a key, the layer of a stacked key, and for SwiGLU's linear_fc1
    the half ([gate; up]: 0 the gate rows, 1 the up rows)."""

    key: str
    layer: int | None
    half: int | None
    unit: str
    """What is read with it: `layer N` for a stacked key, else the model key (the weight with its moments)."""
    flat: Flat | None = None
    """Set for the distributed optimizer's bucket space (torch_dist_buckets.py): `key` only names it, and the value
    is put together from these pieces of the flat buffers."""


def slots(model_key: str, size: torch.Size, *, source_key: str, swiglu: bool, num_layers: int) -> dict[str, Slot]:
    """Our names of `model_key` (torch_dist_keys.to_ours on its shape) and where each lies in `source_key` (the model
    key itself, or an optimizer key shaped like it)."""
    ours = torch_dist_keys.to_ours(model_key, torch.empty(size, device="meta"), swiglu=swiglu, num_layers=num_layers)
    out: dict[str, Slot] = {}
    for name in ours:
        match = _OUR_LAYER.match(name)
        layer = int(match.group(1)) if match else None
        half = None
        if swiglu and layer is not None and model_key in _SWIGLU_FC1:
            half = 0 if ".mlp.gate." in name else 1
        out[name] = Slot(source_key, layer, half, f"layer {layer}" if layer is not None else model_key)
    return out


@dataclass(kw_only=True)
class StreamedReader:
    """Our tensors of `src` by (name, role), read a unit at a time; role is weight, exp_avg or exp_avg_sq."""

    src: TorchDistFolder
    roles: dict[str, dict[str, Slot]]
    budget: int = READ_BUDGET
    held_bytes: int = 0
    peak_bytes: int = 0
    unit_reads: int = 0
    _cache: dict[str, dict[tuple[str, int | None], torch.Tensor]] = field(default_factory=dict)
    _sizes: dict[str, int] = field(default_factory=dict)
    _transient: str | None = None
    _pending: dict[str, set[str]] = field(default_factory=dict)
    """Each unit's names not yet released."""

    def __post_init__(self) -> None:
        for name, per in self.roles.items():
            for slot in per.values():
                self._pending.setdefault(slot.unit, set()).add(name)

    def fetch(self, name: str, role: str) -> torch.Tensor:
        slot = self.roles[name][role]
        if slot.unit not in self._cache:
            self._read(slot.unit)
        value = self._cache[slot.unit][(slot.key, slot.layer)]
        if slot.layer is not None:
            value = value[0]
        return value if slot.half is None else value.chunk(2, dim=0)[slot.half]

    def release(self, name: str) -> None:
        """`name` will not be fetched again; its unit is let go once all its names are."""
        units = {slot.unit for slot in self.roles[name].values()}
        for unit in units:
            pending = self._pending.get(unit)
            if pending is not None:
                pending.discard(name)
                if not pending:
                    self._drop(unit)

    def _drop(self, unit: str) -> None:
        if self._cache.pop(unit, None) is not None:
            self.held_bytes -= self._sizes.pop(unit)
        if self._transient == unit:
            self._transient = None

    def _read(self, unit: str) -> None:
        if self._transient is not None:
            self._drop(self._transient)
        wanted = {(s.key, s.layer): s for per in self.roles.values() for s in per.values() if s.unit == unit}
        boxes: dict[str, Box] = {}
        keys: set[str] = set()
        flat_keys: set[str] = set()
        for (key, layer), slot in wanted.items():
            if slot.flat is not None:  # one 1-D box per flat key: the unit's parameters lie side by side in it
                for piece in slot.flat.pieces:
                    widen(boxes, piece.flat, piece.start, piece.start + math.prod(piece.shape))
                    flat_keys.add(piece.flat)
                continue
            keys.add(key)
            if layer is not None:
                size = tuple(self.src.keys[key].size)
                boxes[key] = ((layer,) + (0,) * (len(size) - 1), (1, *size[1:]))
        tensors, _ = read(self.src, sorted(keys | flat_keys), boxes=boxes)
        values = {}
        for (key, layer), slot in wanted.items():
            if slot.flat is None:
                values[(key, layer)] = tensors[key]
            else:  # stacked as a layer box reads, so fetch takes [0] alike
                value = assemble(slot.flat, tensors, boxes)
                values[(key, layer)] = value if layer is None else value.unsqueeze(0)
        self._cache[unit] = values
        size = sum(t.numel() * t.element_size() for t in values.values())
        flat = sum(tensors[k].numel() * tensors[k].element_size() for k in flat_keys)
        if self.held_bytes + size > self.budget:
            self._transient = unit
        self._sizes[unit] = size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes + size + flat)  # the flat boxes until assembled
        self.held_bytes += size
        self.unit_reads += 1
