"""Adam's state in a torch_dist checkpoint, per megatron-core key and whole: exp_avg, exp_avg_sq, the fp32 master,
the step and the hyperparameters. Which layout it is in follows the optimizer Megatron-LM saved
(megatron-core 0.16.1 optimizer/optimizer.py and distrib_optimizer.py sharded_state_dict; checkpointing.py
_build_sharded_state_dict_metadata):

- Adam without --use-distributed-optimizer: model space, `optimizer.state.exp_avg.<model key>` (and exp_avg_sq,
  and fp32_param with 16-bit weights) shaped like the weight; common.pt's optimizer holds the param groups and
  state.common_step;
- the distributed optimizer, `distrib_optim_sharding_type` fully_reshardable (--dist-ckpt-optim-fully-reshardable):
  model space too, `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`; the step in the param groups;
- the distributed optimizer, dp_reshardable (Megatron-LM's default): bucket space. Per model-parallel rank
  (`dp_group_idx_M`, M = pp_rank * tp + tp_rank) and bucket, the flat tensors
  `optimizer.distributed.dp_group_idx_M.gbuf_idx_0.dtype_(...).bucket_idx_B.{param,exp_avg,exp_avg_sq}` laid out as
  the grad buffer (distributed/param_and_grad_buffer.py): the rank's parameters in reverse module order, each
  starting at a multiple of 64 counted from its bucket's start, the bucket's end padding cut off; its ShardedObjects
  hold the param groups (with the step) and each bucket's unpadded length. The module order is megatron-core's
  (embedding; per layer: input norm, linear_proj, linear_qkv, pre-MLP norm, linear_fc1, linear_fc2; final norm,
  output layer), with Transformer Engine's fused norms inside linear_qkv / linear_fc1; the layout that puts every
  parameter's fp32 master where its weight's values are is the one taken, so a wrong order cannot pass (read whole
  here; the streamed convert confirms the layout on a sample instead, torch_dist_buckets.py).

fully_sharded_model_space and dp_zero_gather_scatter (deprecated) are not read: the moments are then dropped with a
note, as are any the checks above reject.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hpc.checkpoint.foreign import torch_dist_keys
from megatron_hpc.checkpoint.foreign.torch_dist_files import TorchDistFolder, read

KEYS = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\."
                     r"(param|exp_avg|exp_avg_sq)$")
ALIGNMENTS = (64, 1)
_LN = ("layer_norm_weight", "layer_norm_bias")
# One layer's parameters in module (named_parameters) order; q = linear_qkv, f = linear_fc1.
_LOCAL = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
          "input_layernorm.weight", "input_layernorm.bias",
          "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
          "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
          "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
          "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")


def _te(norm_first: bool) -> tuple[str, ...]:
    q, f = "self_attention.linear_qkv.", "mlp.linear_fc1."
    qn, fn = (q + _LN[0], q + _LN[1]), (f + _LN[0], f + _LN[1])
    qw, fw = (q + "weight", q + "bias"), (f + "weight", f + "bias")
    return ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
            *(qn + qw if norm_first else qw + qn), *(fn + fw if norm_first else fw + fn),
            "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")


LAYER_ORDERS = (_LOCAL, _te(True), _te(False))


@dataclass(frozen=True, kw_only=True, slots=True)
class Adam:
    state: dict[str, dict[str, torch.Tensor]]
    """Per model key, whole: {'exp_avg', 'exp_avg_sq'} and 'param' (the fp32 master) where the file keeps one."""
    step: float | None
    hyper: dict[str, Any]
    """lr, betas, eps, weight_decay of the decay group."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpace:
    """Where a model-space Adam state lies (nothing read yet)."""

    keys: dict[str, tuple[str, str]]
    """Each optimizer key -> (param | exp_avg | exp_avg_sq, its model key); param is the fp32 master."""
    step: float | None
    hyper: dict[str, Any]


def model_space(src: TorchDistFolder) -> ModelSpace | None:
    """The model-space layout's keys, None for the distributed optimizer's bucket space (dp_reshardable); ValueError
    with the reason when the state cannot be carried over (the caller drops it with a note)."""
    optimizer = src.common.get("optimizer")
    if not isinstance(optimizer, dict):
        raise ValueError("the checkpoint holds no optimizer state (saved with --no-save-optim)")
    kind = optimizer.get("param_state_sharding_type")
    if kind is None and "param_groups" not in optimizer and isinstance(optimizer.get("optimizer"), dict):
        # Float16OptimizerWithFloat16Params (Megatron-LM's --bf16 / --fp16 without the distributed optimizer) nests
        # torch's state dict one level down beside its fp32_from_fp16_params (megatron-core 0.16.1 optimizer.py
        # state_dict); FP32Optimizer saves it at the top. The fp32 masters are optimizer.state.fp32_param.* alike.
        optimizer = optimizer["optimizer"]
    if kind is None:
        groups, step, fp32 = optimizer.get("param_groups"), _common_step(optimizer), "fp32_param"
    elif kind == "fully_reshardable":
        groups = (optimizer.get("optimizer") or {}).get("param_groups")
        step, fp32 = _group_step(groups), "param"
    elif kind == "dp_reshardable":
        return None
    else:
        raise ValueError(f"the distributed optimizer's {kind!r} layout is not read (fully_reshardable and "
                         "dp_reshardable are)")
    hyper = _hyper(groups)
    wanted: dict[str, tuple[str, str]] = {}
    for key in src.tensor_keys():
        found = torch_dist_keys.optimizer_key(key)
        if found and found[0] in ("exp_avg", "exp_avg_sq", fp32):
            wanted[key] = ("param" if found[0] == fp32 else found[0], found[1])
    if not wanted:
        raise ValueError("it has no optimizer.state.exp_avg tensors")
    per: dict[str, set[str]] = {}
    for what, model_key in wanted.values():
        per.setdefault(model_key, set()).add(what)
    for model_key, whats in per.items():
        if "exp_avg" not in whats or "exp_avg_sq" not in whats:
            raise ValueError(f"{model_key} has {sorted(whats)} but not both Adam moments")
    return ModelSpace(keys=wanted, step=step, hyper=hyper)


def read_adam(src: TorchDistFolder, model: dict[str, torch.Tensor], *, tp: int, pp: int, swiglu: bool,
              num_layers: int) -> Adam:
    """The checkpoint's Adam state over `model` (its model keys, whole); ValueError with the reason when it cannot
    be carried over (the caller drops it with a note)."""
    layout = model_space(src)
    if layout is None:
        return _bucket_space(src, model, tp=tp, pp=pp, swiglu=swiglu, num_layers=num_layers)
    tensors, _ = read(src, layout.keys)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, (what, model_key) in layout.keys.items():
        state.setdefault(model_key, {})[what] = tensors.pop(key)
    return Adam(state=state, step=layout.step, hyper=layout.hyper)


def _hyper(groups: Any) -> dict[str, Any]:
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise ValueError("its param groups are missing")
    decay = max(groups, key=lambda g: float(g.get("wd_mult", 1.0 if g.get("weight_decay") else 0.0)))
    return {k: decay[k] for k in ("lr", "betas", "eps", "weight_decay") if k in decay}


def _common_step(optimizer: dict[str, Any]) -> float | None:
    step = (optimizer.get("state") or {}).get("common_step")
    return float(step) if step is not None else None


def _group_step(groups: Any) -> float | None:
    steps = {float(g["step"]) for g in groups or [] if isinstance(g, dict) and "step" in g}
    if len(steps) > 1:
        raise ValueError(f"its param groups took different step counts {sorted(steps)}")
    return steps.pop() if steps else None


def stage_layers(num_layers: int, pp: int, args: Any) -> list[range]:
    """Each pipeline stage's global layers: even, or with Megatron-LM's uneven first / last stage."""
    first = getattr(args, "decoder_first_pipeline_num_layers", None) or 0
    last = getattr(args, "decoder_last_pipeline_num_layers", None) or 0
    if pp == 1:
        return [range(num_layers)]
    middle = pp - (1 if first else 0) - (1 if last else 0)
    rest = num_layers - first - last
    if middle < 0 or (middle and rest % middle) or (not middle and rest):
        raise ValueError(f"{num_layers} layers do not split over pp {pp} (first {first}, last {last})")
    sizes = ([first] if first else []) + [rest // middle if middle else 0] * middle + ([last] if last else [])
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


def rank_params(model: dict[str, torch.Tensor], order: tuple[str, ...], layers: range, *, first: bool, last: bool,
                 pp: int) -> list[tuple[str, int | None]]:
    """One stage's parameters in module order, as (model key, global layer or None)."""
    out: list[tuple[str, int | None]] = []
    if first:
        out += [(k, None) for k in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
                if k in model]
    for i in layers:
        out += [("decoder.layers." + rest, i) for rest in order if "decoder.layers." + rest in model]
    if last:
        out += [(k, None) for k in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias") if k in model]
        if "output_layer.weight" in model:
            out.append(("output_layer.weight", None))
        elif pp > 1:  # a tied output layer: the last stage's own copy, saved under the embedding's key
            out.append(("embedding.word_embeddings.weight", None))
    return out


Ranges = tuple[int, tuple[tuple[int, int], ...]]
"""(dim, [start, end) runs) of one TP rank's piece of a tensor along dim."""


def local_ranges(key: str, full: torch.Size, *, tp: int, rank: int, swiglu: bool) -> Ranges | None:
    """Where TP rank `rank`'s piece of a per-layer tensor of shape `full` lies (None: replicated)."""
    dim = torch_dist_keys.tp_split_dim(key)
    if dim is None or tp == 1:
        return None
    size = full[dim] // tp
    if swiglu and key.startswith("decoder.layers.mlp.linear_fc1.") and "layer_norm" not in key:
        half, up = full[0] // 2 // tp, full[0] // 2  # [gate_r; up_r] of the global [gate; up]
        return 0, ((rank * half, (rank + 1) * half), (up + rank * half, up + (rank + 1) * half))
    return dim, ((rank * size, (rank + 1) * size),)


def index_of(ranges: Ranges | None) -> tuple[int, torch.Tensor] | None:
    if ranges is None:
        return None
    return ranges[0], torch.cat([torch.arange(lo, hi) for lo, hi in ranges[1]])


def _local_index(key: str, full: torch.Size, *, tp: int, rank: int, swiglu: bool) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of TP rank `rank`'s piece of a per-layer tensor of shape `full` (None: replicated)."""
    return index_of(local_ranges(key, full, tp=tp, rank=rank, swiglu=swiglu))


def _local(tensor: torch.Tensor, index: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    return tensor if index is None else tensor.index_select(index[0], index[1])


def layout(sizes: list[int], buckets: list[int], align: int) -> list[tuple[int, int]] | None:
    """(bucket, start) of each parameter (in module order) in the saved flat tensors, None when the parameters do
    not fill the buckets' recorded lengths by this rule."""
    placed: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    bucket, used = 0, 0
    for i in reversed(range(len(sizes))):
        if bucket >= len(buckets):
            return None
        start = math.ceil(used / align) * align
        if start + sizes[i] > buckets[bucket]:
            return None
        placed[i] = (bucket, start)
        used = start + sizes[i]
        if used == buckets[bucket]:
            bucket, used = bucket + 1, 0
    return placed if bucket == len(buckets) and used == 0 else None


def bucket_keys(src: TorchDistFolder, *, tp: int, pp: int) -> dict[int, dict[int, dict[str, str]]]:
    """Each model-parallel rank's buckets: rank -> bucket -> {param, exp_avg, exp_avg_sq: its flat key}."""
    found: dict[int, dict[int, dict[str, str]]] = {}
    for key in src.tensor_keys():
        match = _BUCKET.match(key)
        if match:
            if int(match.group(2)) != 0:
                raise ValueError("it has several grad buffers per rank (virtual pipeline chunks or mixed parameter "
                                 "dtypes), which are not read; save with --dist-ckpt-optim-fully-reshardable")
            found.setdefault(int(match.group(1)), {}).setdefault(int(match.group(4)), {})[match.group(5)] = key
    if sorted(found) != list(range(tp * pp)):
        raise ValueError(f"its distributed optimizer holds model-parallel ranks {sorted(found)}, not the tp {tp} x "
                         f"pp {pp} of its arguments")
    return found


def bucket_groups(src: TorchDistFolder) -> tuple[dict[str, Any], float | None]:
    """(hyper, step) of the bucket space, from rank 0's param groups (a ShardedObject: small)."""
    wanted = [k for k in src.object_keys() if k.startswith("optimizer.distributed.dp_group_idx_0.optimizer/")]
    _, objects = read(src, wanted) if wanted else ({}, {})
    shards = next(iter(objects.values()), None)  # the list of the object's shards' data
    groups = shards[0] if isinstance(shards, list) and shards else None
    groups = groups.get("param_groups") if isinstance(groups, dict) else None
    return _hyper(groups), _group_step(groups)


Param = tuple[str, int | None]
"""(model key, global layer or None)."""
Placement = list[tuple[Param, tuple[int, int]]]
"""Each parameter of a rank with its (bucket, start) in the flat buffers."""


def layout_error(m: int, lengths: list[int], wrong: Param | None = None) -> ValueError:
    """`wrong`: the first parameter whose fp32 master was not its weight under the first layout that fit the
    lengths (None: no layout fit them), so a damaged buffer is told from a layout not known here."""
    seen = ""
    if wrong is not None:
        where = "" if wrong[1] is None else f" in layer {wrong[1]}"
        seen = f" (the fp32 master of {wrong[0]}{where} is not its weight there)"
    return ValueError(f"the dp_reshardable buffers of model-parallel rank {m} (buckets {lengths}) do not lay out as "
                      f"megatron-core's grad buffer over the model's parameters{seen}; save with "
                      "--dist-ckpt-optim-fully-reshardable to carry the moments")


def _bucket_space(src: TorchDistFolder, model: dict[str, torch.Tensor], *, tp: int, pp: int, swiglu: bool,
                  num_layers: int) -> Adam:
    found = bucket_keys(src, tp=tp, pp=pp)
    hyper, step = bucket_groups(src)
    flat, _ = read(src, [k for per in found.values() for b in per.values() for k in b.values()])
    stages = stage_layers(num_layers, pp, src.common.get("args"))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for m in range(tp * pp):
        p, t = divmod(m, tp)
        buckets = [flat[found[m][b]["param"]] for b in sorted(found[m])]
        lengths = [b.numel() for b in buckets]
        chosen, wrong = _choose_layout(model, stages[p], buckets, lengths, tp=tp, rank=t, pp=pp, first=p == 0,
                                       last=p == pp - 1, swiglu=swiglu)
        if chosen is None:
            raise layout_error(m, lengths, wrong)
        for (key, layer), (bucket, start) in chosen:
            _place(state, model, flat, found[m][sorted(found[m])[bucket]], key, layer, start, tp=tp, rank=t,
                   swiglu=swiglu)
    return Adam(state=state, step=step, hyper=hyper)


def _choose_layout(model: dict[str, torch.Tensor], layers: range, buckets: list[torch.Tensor], lengths: list[int], *,
                   tp: int, rank: int, pp: int, first: bool, last: bool, swiglu: bool
                   ) -> tuple[Placement | None, Param | None]:
    """(the first module order and alignment whose layout puts each parameter's fp32 master on its weight, None),
    else (None, the first parameter that disagreed under the first layout that fit the lengths, as layout_error
    names it)."""
    wrong = None
    for order in LAYER_ORDERS:
        params = rank_params(model, order, layers, first=first, last=last, pp=pp)
        locals_ = []
        for key, layer in params:
            full = model[key] if layer is None else model[key][layer]
            locals_.append(_local(full, _local_index(key, full.shape, tp=tp, rank=rank, swiglu=swiglu)))
        for align in ALIGNMENTS:
            placed = layout([w.numel() for w in locals_], lengths, align)
            if placed is None:
                continue
            bad = next((p for p, w, (b, s) in zip(params, locals_, placed)
                        if not torch.equal(buckets[b][s:s + w.numel()].to(w.dtype).view(w.shape), w)), None)
            if bad is None:
                return list(zip(params, placed)), None
            wrong = wrong or bad
    return None, wrong


def _place(state: dict[str, dict[str, torch.Tensor]], model: dict[str, torch.Tensor], flat: dict[str, torch.Tensor],
           keys: dict[str, str], key: str, layer: int | None, start: int, *, tp: int, rank: int,
           swiglu: bool) -> None:
    """Copy one parameter's rank-local slices of the flat tensors into the whole per-key state."""
    target = state.setdefault(key, {})
    full = model[key] if layer is None else model[key][layer]
    index = _local_index(key, full.shape, tp=tp, rank=rank, swiglu=swiglu)
    local_shape = _local(full, index).shape
    for what in KEYS:
        whole = target.setdefault(what, torch.zeros(model[key].shape, dtype=torch.float32))
        part = whole if layer is None else whole[layer]
        piece = flat[keys[what]][start:start + local_shape.numel()].view(local_shape).float()
        if index is None:
            part.copy_(piece)
        else:
            part.index_copy_(index[0], index[1], piece)
