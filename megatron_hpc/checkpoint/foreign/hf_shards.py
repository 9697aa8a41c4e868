"""`ckpt convert --to hf`'s weights in transformers' save_pretrained layout, made and written one shard at a time.

The layout (transformers modeling_utils.save_pretrained with huggingface_hub's split_torch_state_dict_into_shards,
read 2026-11-28): tensors go into files in state-dict order; a tensor that would take the current file past the
shard size starts the next one, and one larger than the shard size gets a file of its own. One file is
`model.safetensors`; more are `model-0000K-of-0000N.safetensors` with `model.safetensors.index.json` ({"metadata":
{"total_parameters", "total_size"}, "weight_map": {name: file}}, keys sorted). transformers 4 saves 5 GB shards by
default, 5 saves 50 GB ones; both read either.

Which of our weights each Hugging Face tensor is made from is found once, on meta tensors, by running the format's
own state_to_hf over tensors that carry the *unit* (what a source reads together, say one decoder layer) they belong
to through every torch op (_Traced). A shard is then made by running state_to_hf again for each group of units its
tensors come from, with only that group's weights real (fetched) and the rest meta, so no mapping is written twice.
The file layout depends on names and sizes alone, so a streamed source writes what a whole read writes.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_hpc.checkpoint.conversion import give_back_freed

SHARD_BYTES = 5 * 10**9
"""transformers 4's default max_shard_size ("5GB", decimal): the largest file, about what making one holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPlan:
    files: list[tuple[str, list[str]]]
    """(file name, its tensors' names in order), in order."""
    total_size: int
    total_parameters: int


def plan_shards(sizes: dict[str, tuple[int, int]], *, max_bytes: int, stem: str, suffix: str) -> ShardPlan:
    """The files of a state dict whose tensors are `sizes` (name -> (bytes, elements), in state-dict order), as
    split_torch_state_dict_into_shards names and fills them (`stem` model, `suffix` .safetensors)."""
    shards: list[list[str]] = []
    current: list[str] = []
    held = 0
    for name, (size, _) in sizes.items():
        if size > max_bytes:  # its own file, the current one left open
            shards.append([name])
            continue
        if current and held + size > max_bytes:
            shards.append(current)
            current, held = [], 0
        current.append(name)
        held += size
    if current:
        shards.append(current)
    if len(shards) == 1:
        files = [(f"{stem}{suffix}", shards[0])]
    else:
        files = [(f"{stem}-{k + 1:05d}-of-{len(shards):05d}{suffix}", names) for k, names in enumerate(shards)]
    return ShardPlan(files=files, total_size=sum(b for b, _ in sizes.values()),
                     total_parameters=sum(n for _, n in sizes.values()))


class _Traced(torch.Tensor):
    """A meta tensor that carries the units it was computed from through torch ops (torch's __torch_function__
    protocol: the default handler runs the op and returns this class; the units of the inputs are added after)."""

    units: frozenset[str] = frozenset()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        units = frozenset().union(*(a.units for a in _flat((args, kwargs or {})) if isinstance(a, _Traced)))
        return _tag(super().__torch_function__(func, types, args, kwargs), units)


def _flat(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    else:
        yield value


def _tag(value: Any, units: frozenset[str]) -> Any:
    if isinstance(value, _Traced):
        value.units = units
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tag(v, units)
    return value


def _traced(meta: torch.Tensor, unit: str) -> _Traced:
    out = torch.empty(meta.shape, dtype=meta.dtype, device="meta").as_subclass(_Traced)
    out.units = frozenset((unit,))
    return out


def unit_groups(to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], meta: dict[str, torch.Tensor],
                unit_of: Callable[[str], str]) -> tuple[dict[str, torch.Tensor], dict[str, frozenset[str]]]:
    """(the Hugging Face state dict as meta tensors, each of its tensors' group of units): units that meet in one
    tensor are one group, so a group's tensors are made from its own weights only."""
    traced = to_hf({n: _traced(t, unit_of(n)) for n, t in meta.items()})
    groups: list[set[str]] = []
    for tensor in traced.values():
        joined = set(getattr(tensor, "units", ()))
        for group in [g for g in groups if g & joined]:
            joined |= group
            groups.remove(group)
        groups.append(joined)
    of_unit = {u: frozenset(g) for g in groups for u in g}
    hf_meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in traced.items()}
    return hf_meta, {k: of_unit.get(next(iter(t.units), ""), frozenset()) for k, t in traced.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Weights:
    """Our whole model's weights (TP 1 x PP 1) as an export reads them: names and shapes (`meta`), values fetched one
    at a time and let go for good, and what is read together (`unit_of`)."""

    meta: dict[str, torch.Tensor]
    fetch: Callable[[str], torch.Tensor]
    release: Callable[[str], None]
    unit_of: Callable[[str], str]


def write_shards(weights: Weights, to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], out: Path,
                 *, max_bytes: int = SHARD_BYTES, mode_of: Path) -> Path:
    """Write the Hugging Face weights of `weights` into `out` (safetensors, or pytorch_model.bin without it) one
    shard at a time, each file with `mode_of`'s mode; the weights file, or the index of the shards."""
    hf_meta, group_of = unit_groups(to_hf, weights.meta, weights.unit_of)
    save, stem, suffix = _saver()
    plan = plan_shards({k: (t.numel() * t.element_size(), t.numel()) for k, t in hf_meta.items()},
                       max_bytes=max_bytes, stem=stem, suffix=suffix)
    last: dict[frozenset[str], int] = {}
    for k, (_, names) in enumerate(plan.files):
        last.update((group_of[n], k) for n in names)
    members: dict[frozenset[str], list[str]] = {}
    for name in weights.meta:
        members.setdefault(_group(group_of, weights.unit_of(name), last), []).append(name)
    for k, (file, names) in enumerate(plan.files):
        shard: dict[str, torch.Tensor] = {}
        for group in dict.fromkeys(group_of[n] for n in names):
            made = to_hf({**weights.meta, **{n: weights.fetch(n) for n in members.get(group, [])}})
            shard.update((n, made[n]) for n in names if group_of[n] == group)
            del made
        save(shard, out / file)
        (out / file).chmod(stat.S_IMODE(mode_of.stat().st_mode))
        del shard
        for group in [g for g, at in last.items() if at == k]:
            for name in members.get(group, []):
                weights.release(name)
        give_back_freed()
    if len(plan.files) == 1:
        return out / plan.files[0][0]
    index = out / f"{stem}{suffix}.index.json"
    weight_map = {n: file for file, names in plan.files for n in names}
    index.write_text(json.dumps({"metadata": {"total_parameters": plan.total_parameters,
                                              "total_size": plan.total_size}, "weight_map": weight_map},
                                indent=2, sort_keys=True) + "\n")
    return index


def _group(group_of: dict[str, frozenset[str]], unit: str, last: dict[frozenset[str], int]) -> frozenset[str]:
    """The group holding `unit` (a weight no Hugging Face tensor is made from stands alone)."""
    return next((g for g in last if unit in g), frozenset((unit,)))


def _saver() -> tuple[Callable[[dict[str, torch.Tensor], Path], None], str, str]:
    """(save a shard, file stem, suffix): safetensors where installed, else torch.save's pytorch_model.bin."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        return (lambda sd, path: torch.save(sd, path)), "pytorch_model", ".bin"
    return (lambda sd, path: save_file(sd, str(path), metadata={"format": "pt"})), "model", ".safetensors"
