"""Predicted time of one training step for a layout, beside the memory model. Pure and fast (no loops over ranks
beyond the pipeline's, no search): the planner evaluates it for every valid layout.

Legend: L layers, h hidden, s sequence, b micro-batch, T = b*s tokens of a micro-batch, t TP, p PP, v virtual
stages per pipeline rank, d DP, m micro-batches per step, V padded vocabulary.

Terms (each in step_time_breakdown_s, seconds on the slowest pipeline rank):
- compute: per micro-batch and layer, the forward GEMMs of the TP rank (QKV, attention output projection, the
  MLP's up/gate and down, the attention core's two batched products, 4*T*s*h/t FLOPs) at the calibrated share of
  peak for each GEMM's size, backward twice that; plus the memory-bound kernels (norms, activation, dropout,
  softmax), taken as the layer's saved activation bytes (plan/memory.py) streamed at the calibrated share of the
  memory bandwidth; the last stage adds the output layer (2*T*h*V/t forward) and its loss.
- dispatch: per micro-batch and layer, the operators the rank dispatches (plan/op_counts.py: kernels outside and
  around the GEMMs, views, autograd's bookkeeping; forward and backward) times the backend's fixed cost of one
  (Calibration.op_overhead_s: eager CPU dispatch, a CUDA kernel's gap, 0 on XLA's one graph); a recomputed layer
  runs its forward's again. It grows with the number of micro-batches a rank runs, not their size: what TP pays
  on a small model where the global batch is fixed (more micro-batches per rank). A term of its own, not inside
  compute, so that `plan` shows it and tune fits its scale apart from the GEMMs'.
- recompute: full recomputation runs each layer's forward again in backward; selective the attention core's.
- tp_comm: per layer and micro-batch two all-reduces of T*h activations forward and two backward (two more under
  full recomputation), ring cost 2(t-1)/t * bytes / bandwidth + 2(t-1) latencies; sequence parallelism replaces
  each with an all-gather and a reduce-scatter of the same total bytes, so the same time (it saves memory-bound
  work and memory, counted in compute).
- pp_comm: per micro-batch and model chunk one activation forward and one gradient backward between stages,
  latency + T*h bytes / bandwidth (across nodes when TP x DP fills a node, sharing the node's NICs); T*h/t under
  sequence parallelism, whose stages hand on their sequence shard (model/gpt.py; Megatron-LM's get_tensor_shapes
  divides the sequence by t likewise).
- pipeline_bubble: (p - 1) / v times a micro-batch's time through one rank (Narayanan et al. 2021, section 2.2):
  1F1B, interleaved 1F1B and all-forward-all-backward fill and drain alike.
- dp_comm: the gradient all-reduce over DP (reduce-scatter plus the parameters' all-gather with the distributed
  optimizer) of the rank's parameters, ring cost; with parallel.overlap_grad_reduce the reduce hides behind the
  last micro-batch's backward except its last bucket; with overlap_param_gather the gather behind the next
  forward. With PP and tied embeddings, the first and last stages' embedding-gradient all-reduce.
- optimizer: Adam's memory traffic over the parameters this rank updates (a DP shard with the distributed
  optimizer).

Links: a TP group sits inside a node (intra-node bandwidth per worker). A DP ring or a stage boundary that leaves
the node gets the node's inter-node bandwidth shared by all its workers, which communicate at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_hpc.config.hardware import Hardware, Link
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.plan.calibration import Calibration
from megatron_hpc.plan.memory import activation_bytes, layer_activations, parameter_bytes, rank_parameters
from megatron_hpc.plan.model_math import mlp_matrices, qkv_rows
from megatron_hpc.plan.op_counts import layer_ops
from megatron_hpc.plan.recompute import resolve_recompute

TERMS = ("compute", "dispatch", "recompute", "tp_comm", "pp_comm", "pipeline_bubble", "dp_comm", "optimizer")
"""The keys of step_time_breakdown_s, in the order `plan` prints them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """What the step time depends on besides the recipe: the mesh and how the batch and layers split over it."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    num_micro_batches: int
    stage_layers: tuple[int, ...]
    """Transformer layers of each virtual stage, in stage order (p * v entries)."""
    workers_per_node: int
    padded_vocab: int


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    step_time_s: float
    breakdown_s: dict[str, float]
    """Seconds by term (TERMS); they add up to step_time_s."""
    tokens_per_s: float
    mfu: float
    """Model FLOPs (the plan's flops_per_token, no recomputation) per second over the world's dense peak."""

    def limit(self) -> str:
        """The largest term besides compute and recompute (the recipe's choice), as `plan --explain` names what
        limits a layout."""
        name, value = max(((k, v) for k, v in self.breakdown_s.items() if k not in ("compute", "recompute")),
                          key=lambda kv: kv[1])
        return f"{name.replace('_', ' ')} {value / self.step_time_s:.0%}"


def ring_time(link: Link, *, bandwidth: float, ranks: int, nbytes: float, steps_per_rank: int) -> float:
    """A ring collective over `ranks`: steps_per_rank (1 for all-gather or reduce-scatter, 2 for all-reduce) times
    (ranks - 1) latencies plus (ranks - 1)/ranks of the bytes at `bandwidth` bytes/s."""
    if ranks <= 1:
        return 0.0
    return steps_per_rank * (ranks - 1) * (link.latency_s + nbytes / ranks / bandwidth)


@dataclass(frozen=True, slots=True)
class _Links:
    """Bandwidths (bytes/s, calibrated) and latencies of the groups of one layout."""

    tp: tuple[Link, float]
    dp: tuple[Link, float]
    pp: tuple[Link, float]


def _links(hw: Hardware, layout: Layout, cal: Calibration) -> _Links:
    share = cal.collective_bandwidth_fraction
    if cal.collective_latency_factor != 1.0:  # a measured calibration (plan/calibration_fit.py)
        hw = dataclasses.replace(hw, intra_node=_slower(hw.intra_node, cal), inter_node=_slower(hw.inter_node, cal))
    intra = (hw.intra_node, hw.intra_node.bytes_per_s * share)
    # Every worker of a node talks across nodes at once (all DP rings, all stage boundaries): a NIC share each.
    inter_bw = min(hw.intra_node.bytes_per_s, hw.inter_node.bytes_per_s / layout.workers_per_node) * share
    inter = (hw.inter_node, inter_bw)
    t, d = layout.tensor_parallel, layout.data_parallel
    return _Links(tp=intra, dp=intra if t * d <= layout.workers_per_node else inter,
                  pp=intra if t * d < layout.workers_per_node else inter)


def _slower(link: Link, cal: Calibration) -> Link:
    return dataclasses.replace(link, latency_us=link.latency_us * cal.collective_latency_factor)


def _layer_times(cfg: RunConfig, layout: Layout, hw: Hardware, cal: Calibration) -> dict[str, float]:
    """One layer, one micro-batch on one TP rank: forward GEMMs, attention core, memory-bound time and TP comm."""
    model, train = cfg.model, cfg.train
    t, h, s = layout.tensor_parallel, model.hidden_size, model.seq_length
    tokens = train.micro_batch_size * s
    peak = hw.peak_flops(train.precision)

    def gemm(flops: float) -> float:
        return flops / (peak * cal.gemm_fraction(flops, peak))

    heads_width = model.num_attention_heads * model.head_dim
    mlp_in = [2.0 * tokens * h * model.ffn_size / t] * (mlp_matrices(model) - 1)  # up, and SwiGLU's gate
    linears = [2.0 * tokens * h * qkv_rows(model) / t, 2.0 * tokens * heads_width / t * h, *mlp_in,
               2.0 * tokens * model.ffn_size / t * h]
    core = gemm(4.0 * tokens * s * heads_width / t)
    act = activation_bytes(model, precision=train.precision, backend=_backend(hw))
    # Flash-style kernels on CUDA never write the s x s scores; XLA's math path does (plan/memory.py's flag).
    scores = cal.attention_scores_in_memory
    scores = act.attention_scores and _backend(hw) != "nccl" if scores is None else scores
    act = dataclasses.replace(act, attention_scores=scores)
    sp = cfg.parallel.sequence_parallel and t > 1
    saved = layer_activations(model, tensor_parallel=t, micro_batch=train.micro_batch_size, act=act,
                              selective=False, sequence_parallel=sp)
    elementwise = saved * cal.elementwise_bytes_per_saved_byte / (
        hw.memory_bandwidth_gbytes_per_s * 1e9 * cal.memory_bandwidth_fraction)
    link, bandwidth = _links(hw, layout, cal).tp
    activation = tokens * h * act.value
    all_reduce = ring_time(link, bandwidth=bandwidth, ranks=t, nbytes=activation, steps_per_rank=2)
    ops, op_s = layer_ops(model), cal.op_overhead_s(_backend(hw))
    return {"forward": sum(gemm(f) for f in linears) + core + elementwise, "core": core,
            "elementwise": elementwise, "all_reduce": all_reduce * (1.0 - cal.tp_comm_overlap),
            "dispatch": ops.total * op_s, "dispatch_forward": ops.forward * op_s}


def _backend(hw: Hardware) -> str:
    """The backend the hardware's runtime trains with (the activation layout depends on it)."""
    from megatron_hpc.config.platforms import get_platform

    return get_platform(hw.runtime).backend


def _output_layer(cfg: RunConfig, layout: Layout, hw: Hardware, cal: Calibration) -> float:
    """Forward and backward of the last stage's output layer and loss, one micro-batch."""
    tokens = cfg.train.micro_batch_size * cfg.model.seq_length
    peak = hw.peak_flops(cfg.train.precision)
    flops = 2.0 * tokens * cfg.model.hidden_size * layout.padded_vocab / layout.tensor_parallel
    gemm = flops / (peak * cal.gemm_fraction(flops, peak))
    logits = 4.0 * tokens * layout.padded_vocab / layout.tensor_parallel * 4  # fp32 logits, softmax, grad: r/w
    return 3 * gemm + logits / (hw.memory_bandwidth_gbytes_per_s * 1e9 * cal.memory_bandwidth_fraction)


def _rank_micro_batch(cfg: RunConfig, layout: Layout, hw: Hardware, cal: Calibration,
                      layer: dict[str, float], output: float, pp_rank: int) -> dict[str, float]:
    """One micro-batch through every chunk of pipeline rank `pp_rank`, by term."""
    p, rc = layout.pipeline_parallel, resolve_recompute(cfg.model)
    chunks = range(pp_rank, len(layout.stage_layers), p)
    layers = sum(layout.stage_layers[k] for k in chunks)
    last = len(layout.stage_layers) - 1 in chunks
    compute = layers * 3 * layer["forward"] + (output if last else 0.0)
    recomputed = layers if not rc.full or rc.method == "uniform" else min(rc.num_layers, layers)
    recompute = recomputed * layer["forward"] if rc.full else layers * layer["core"] if rc.selective else 0.0
    dispatch = layers * layer["dispatch"] + (recomputed * layer["dispatch_forward"] if rc.full else 0.0)
    reduces = 4 + (2 if rc.full else 0)
    tp = layers * reduces * layer["all_reduce"] + (layer["all_reduce"] if last else 0.0)
    pp = 0.0
    if p > 1:
        link, bandwidth = _links(hw, layout, cal).pp
        nbytes = cfg.train.micro_batch_size * cfg.model.seq_length * cfg.model.hidden_size * (
            4 if cfg.train.precision == "fp32" else 2)
        if cfg.parallel.sequence_parallel:  # a stage's output is its (B, S/tp, H) shard (model/gpt.py)
            nbytes /= layout.tensor_parallel
        pp = 2 * len(chunks) * (link.latency_s + nbytes / bandwidth) * (1.0 - cal.pp_comm_overlap)
    return {"compute": compute, "dispatch": dispatch, "recompute": recompute, "tp_comm": tp, "pp_comm": pp}


def _dp_and_optimizer(cfg: RunConfig, layout: Layout, hw: Hardware, cal: Calibration,
                      backward_s: float) -> tuple[float, float]:
    """Exposed DP communication and the optimizer step of the rank with the most parameters."""
    p, d, t = layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel
    ranks = [range(r, len(layout.stage_layers), p) for r in range(p)] if p > 1 else [range(len(layout.stage_layers))]
    last_stage = len(layout.stage_layers) - 1
    params = max(rank_parameters(cfg.model, padded_vocab=layout.padded_vocab, tensor_parallel=t,
                                 layers=sum(layout.stage_layers[k] for k in chunks), first=0 in chunks,
                                 last=last_stage in chunks, pipeline=p) for chunks in ranks)
    backend = _backend(hw)
    sharded = cfg.parallel.distributed_optimizer
    pb = parameter_bytes(precision=cfg.train.precision, backend=backend)
    grad_bytes = params * pb.grads
    link, bandwidth = _links(hw, layout, cal).dp
    reduce = ring_time(link, bandwidth=bandwidth, ranks=d, nbytes=grad_bytes, steps_per_rank=1 if sharded else 2)
    gather = ring_time(link, bandwidth=bandwidth, ranks=d, nbytes=grad_bytes, steps_per_rank=1) if sharded else 0.0
    if cfg.parallel.overlap_grad_reduce and d > 1 and backend != "xla":  # XLA ignores it (parallel config)
        buckets = max(1.0, grad_bytes / (cfg.parallel.grad_bucket_mb * 2**20))
        reduce = max(reduce - backward_s, reduce / buckets)
    if cfg.parallel.overlap_param_gather:
        gather /= max(1.0, grad_bytes / (cfg.parallel.grad_bucket_mb * 2**20))
    embedding = 0.0
    if p > 1 and cfg.model.tie_embeddings:
        inter = _links(hw, dataclasses.replace(layout, data_parallel=layout.workers_per_node), cal).dp
        words = layout.padded_vocab // t * cfg.model.hidden_size * pb.grads
        embedding = ring_time(inter[0], bandwidth=inter[1], ranks=2, nbytes=words, steps_per_rank=2)
    updated = params / d if sharded else params
    optimizer = updated * cal.optimizer_bytes_per_parameter / (
        hw.memory_bandwidth_gbytes_per_s * 1e9 * cal.memory_bandwidth_fraction)
    return reduce + gather + embedding, optimizer


def predict_step_time(cfg: RunConfig, layout: Layout, *, hardware: Hardware, calibration: Calibration,
                      flops_per_token: float) -> StepTime:
    """The predicted step time of `cfg` at `layout` on `hardware`, by term (the module docstring)."""
    p, v, m = layout.pipeline_parallel, len(layout.stage_layers) // layout.pipeline_parallel, layout.num_micro_batches
    layer = _layer_times(cfg, layout, hardware, calibration)
    output = _output_layer(cfg, layout, hardware, calibration)
    ranks = [_rank_micro_batch(cfg, layout, hardware, calibration, layer, output, r) for r in range(p)]
    totals = [sum(r.values()) for r in ranks]
    slowest = ranks[max(range(p), key=totals.__getitem__)]
    terms = {k: m * slowest[k] for k in ("compute", "dispatch", "recompute", "tp_comm", "pp_comm")}
    terms["pipeline_bubble"] = (p - 1) / v * sum(totals) / p if p > 1 else 0.0
    backward = (slowest["compute"] * 2 / 3 + slowest["dispatch"] * 2 / 3 + slowest["recompute"])
    terms["dp_comm"], terms["optimizer"] = _dp_and_optimizer(cfg, layout, hardware, calibration, backward)
    step = sum(terms.values())
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    world = p * layout.tensor_parallel * layout.data_parallel
    mfu = flops_per_token * tokens / step / (world * hardware.peak_flops(cfg.train.precision))
    return StepTime(step_time_s=step, breakdown_s={k: terms[k] for k in TERMS}, tokens_per_s=tokens / step, mfu=mfu)
