"""Per-worker memory estimate of the heaviest pipeline rank: weights + grads + optimizer states + activations. Pure.

Bytes per parameter (weights, grads and Adam's two moments together):
- fp32: fp32 weights, grads and moments (16);
- bf16 on XLA: pure bf16 (XLA_USE_BF16, the Neuron reference) keeps all four in bf16 (8);
- bf16 or fp16 elsewhere: autocast (train/precision.py) keeps fp32 weights, grads and moments (16) plus the
  16-bit copies of the weights that autocast caches during the forward and matmuls save for the backward (2),
  18 in all (the same count as Megatron's mixed precision with fp32 main grads).
The distributed optimizer (ZeRO-1) divides the optimizer part (Adam's 8 bytes; 4 in pure bf16) by the DP size:
4 + 4 + 8/d for fp32 (Megatron's table says 6 + 12/d for its 16-bit weights with an fp32 main copy; here autocast
keeps the weights in fp32, so they are the main copy). bf16 on XLA with the distributed optimizer is not pure bf16
but Megatron's layout (`xla_fp32_master`, train/xla_zero.py): bf16 weights and grads (2 + 2) and an fp32 master
with fp32 Adam moments over DP (12/d), 4 + 12/d, the table's 6 + 12/d less its fp32 gradient buffer. Without it,
the estimate gives table 1 of Narayanan et al. 2021 (80 GB A100s, 16-bit training) on p5: 1.7B at TP 1, 3.6B at
TP 2, 7.5B at TP 4, 18.4B at TP 8, then 39.1B..310.1B at TP 8 and PP 2, 4, 8, 16.

Activations per layer and micro-batch follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models") without sequence parallelism: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in 16-bit (doubled for
fp32) for their GPT (LayerNorm, GeLU MLP of 4h, learned positions). Other shapes change the terms as the model
saves them (layer_activations): grouped-query attention's smaller K and V, SwiGLU's four FFN-wide tensors, RMSNorm's
normalized input, rotary's rotated Q and K. Selective recomputation (plan/recompute.py) drops the attention core's
5*a*s/(h*t) term. Full recomputation keeps only the input of each checkpointed unit, 2*s*b*h: per group of
recompute_num_layers with the uniform method (plus one group's full activations while it is recomputed), per layer
for the first recompute_num_layers layers of a chunk with the block method (the others keep everything; plus one
layer while recomputed). `model.recompute: true` is full / uniform / 1: each layer's input plus one layer.
With sequence parallelism (their eq. 4) the LayerNorm and dropout parts (the 10) are split t ways too:
s*b*h/t*(34 + 5*a*s/h), and the kept unit inputs are sequence shards, 2*s*b*h/t.

Pipeline parallelism (Megatron's layout, plan/stages.py): a rank holds its stages' layers; the first stage adds the
embedding, the last the final norm and the output layer (with tied embeddings a copy of the word embedding, which
Megatron keeps on the last stage and all-reduces with the first stage's; at PP 1 the two are one tensor). What a
rank keeps in flight depends on the schedule: with 1F1B (PipeDream-flush) rank r runs p - r - 1 warmup forwards
before its first backward, so it holds min(p - r, m) micro-batches (the first stage holds p: with L/p layers each,
as many layer-activations as the whole model without pipelining). Interleaved 1F1B warms up 2 * (p - r - 1) +
(v - 1) * p model-chunk micro-batches (Megatron's schedules.py), which gives the first stage Korthikanti et al.'s
L * (1 + (p - 1) / (p * v)) layer-activations. All-forward-all-backward holds all m. The last stage keeps one
micro-batch's fp32 logits and their gradient (m of them under all-forward-all-backward). Point-to-point buffers
(s*b*h per message) are left out: a few MiB.

Simplifications, all small: norms, biases and the position table are counted as TP-sharded like the rest; the
embedding's output and the attention mask are not counted; allocator fragmentation and the runtime's own memory
are left to the platform's headroom.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import (
    embedding_parameters_per_rank,
    layer_parameters_per_rank,
    mlp_matrices,
    norm_parameters,
    qkv_rows,
)
from megatron_hpc.plan.recompute import resolve_recompute

GIB = 1024**3


SHARD_ALIGN = 128
"""The distributed optimizer's slices are multiples of this many elements (Megatron pads its buffers to DP * 128)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    weights_gib: float
    """The rank's weights (with autocast's 16-bit copies under bf16/fp16)."""
    grads_gib: float
    optimizer_gib: float
    """Adam's two moments (this rank's slice with the distributed optimizer); the step counters are left out."""
    activations_gib: float
    """At the schedule's peak: every micro-batch in flight, plus a recomputed unit's activations under full
    recomputation."""
    logits_gib: float
    micro_batch_activations_gib: float = 0.0
    """What one micro-batch leaves saved for backward across this rank's chunks (what saved-tensor hooks see during
    its forward): the layers and the stage's input and output parts, without the logits."""
    pp_rank: int = 0
    """The pipeline rank these numbers are for (the heaviest one)."""

    @property
    def weights_and_optimizer_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        return self.weights_and_optimizer_gib + self.activations_gib + self.logits_gib

    def breakdown(self) -> dict[str, float]:
        """GiB by kind, rounded to MiB: what `plan --json` gives as memory_breakdown_gib."""
        parts = {"weights": self.weights_gib, "grads": self.grads_gib, "optimizer": self.optimizer_gib,
                 "activations": self.activations_gib, "logits": self.logits_gib}
        return {k: round(v, 3) for k, v in parts.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineShape:
    """What the estimate needs of a pipeline: its stages' layer counts and the schedule."""

    stage_layers: tuple[int, ...]
    """Transformer layers of each virtual stage, in stage order (plan/stages.split_layers); p * v entries."""
    pipeline: int = 1
    virtual: int = 1
    schedule: str = "1f1b"
    num_micro_batches: int = 1


def no_pipeline(model: ModelConfig) -> PipelineShape:
    """One stage with every layer: the estimate without pipeline parallelism."""
    return PipelineShape(stage_layers=(model.num_layers,))


@dataclass(frozen=True, slots=True)
class ParameterBytes:
    """Bytes per parameter of what a rank keeps for it: the weights (with autocast's 16-bit copies), its gradient
    and the optimizer state (Adam's two moments)."""

    weights: int
    grads: int
    optimizer: int

    def total(self, *, optimizer_shards: int = 1) -> float:
        """With the distributed optimizer the state is split over `optimizer_shards` (DP) ranks."""
        return self.weights + self.grads + self.optimizer / optimizer_shards


def xla_fp32_master(*, backend: str, distributed_optimizer: bool) -> bool:
    """Whether the run keeps fp32 master weights beside the model's (torch_xla's ZeRO-1, train/xla_zero.py): the
    distributed optimizer on XLA. With train.precision=bf16 the model weights are then bf16, not pure bf16's
    XLA_USE_BF16 floats: the pairing the Neuron stack uses. The planner records it as Plan.fp32_master, which the
    trainer reads; plan/sizing.py and plan/jobs.py ask it of the settings they are given."""
    return backend == "xla" and distributed_optimizer


def parameter_bytes(*, precision: str, backend: str, fp32_master: bool = False) -> ParameterBytes:
    """`fp32_master`: see xla_fp32_master (the master counts with the optimizer state, which the DP ranks split)."""
    if fp32_master:
        model = 2 if precision == "bf16" else 4
        return ParameterBytes(weights=model, grads=model, optimizer=4 + 8)
    if precision == "bf16" and backend == "xla":
        return ParameterBytes(weights=2, grads=2, optimizer=4)
    if precision in ("bf16", "fp16"):
        return ParameterBytes(weights=4 + 2, grads=4, optimizer=8)
    return ParameterBytes(weights=4, grads=4, optimizer=8)


def bytes_per_parameter(*, precision: str, backend: str) -> int:
    """All of a parameter's bytes without the distributed optimizer: 16, 18 or 8 (the module docstring)."""
    b = parameter_bytes(precision=precision, backend=backend)
    return b.weights + b.grads + b.optimizer


def in_flight(pp_rank: int, *, pipe: PipelineShape) -> int:
    """Model-chunk micro-batches whose activations pipeline rank `pp_rank` holds at its peak."""
    p, v, m = pipe.pipeline, pipe.virtual, pipe.num_micro_batches
    if p == 1:
        return 1  # each micro-batch's backward runs before the next forward
    if pipe.schedule == "afab":
        return m * v
    if v == 1:
        return min(p - pp_rank, m)
    return min(2 * (p - pp_rank - 1) + (v - 1) * p + 1, m * v)


def settled_micro_batches(pipe: PipelineShape) -> int:
    """The fewest micro-batches per step at which every rank of `pipe` holds as many in flight as at
    pipe.num_micro_batches (in_flight), and as many logits: past it more micro-batches change no rank's memory."""
    p, v, m = pipe.pipeline, pipe.virtual, pipe.num_micro_batches
    if p == 1:
        return 1
    if pipe.schedule == "afab":
        return m
    if v == 1:
        return min(m, p)
    return min(m, -(-(2 * (p - 1) + (v - 1) * p + 1) // v))  # rank 0 holds the most


def estimate_memory(
    model: ModelConfig,
    *,
    padded_vocab: int,
    tensor_parallel: int,
    micro_batch: int,
    precision: str,
    backend: str,
    pipeline: PipelineShape | None = None,
    sequence_parallel: bool = False,
    optimizer_shards: int = 1,
    fp32_master: bool = False,
) -> MemoryEstimate:
    """The estimate of the pipeline rank that needs the most memory (rank 0 without pipelining)."""
    pipe = pipeline or no_pipeline(model)
    pipe = dataclasses.replace(pipe, num_micro_batches=settled_micro_batches(pipe))
    return heaviest_rank(model, padded_vocab=padded_vocab, tensor_parallel=tensor_parallel, micro_batch=micro_batch,
                         precision=precision, backend=backend, pipeline=pipe, sequence_parallel=sequence_parallel,
                         optimizer_shards=optimizer_shards, fp32_master=fp32_master)


@functools.lru_cache(maxsize=16384)
def heaviest_rank(model: ModelConfig, *, padded_vocab: int, tensor_parallel: int, micro_batch: int, precision: str,
                  backend: str, pipeline: PipelineShape, sequence_parallel: bool, optimizer_shards: int,
                  fp32_master: bool) -> MemoryEstimate:
    """estimate_memory kept per argument set (with the micro-batches settled): the planner's searches ask again
    for the same mesh at the node counts where only the micro-batch count differs.

    Of the ranks that hold the same chunks (the middle stages, mostly) only the first is estimated: the later ones
    hold no more micro-batches in flight (in_flight never grows with the rank), so none needs more memory and
    max() would keep the first anyway."""
    held, ranks, count = set(), [], len(pipeline.stage_layers)
    for pp_rank in range(pipeline.pipeline):
        stages = range(pp_rank, count, pipeline.pipeline)
        chunks = (tuple(pipeline.stage_layers[k] for k in stages), 0 in stages, count - 1 in stages)
        if chunks in held:
            continue
        held.add(chunks)
        ranks.append(_rank_memory(model, pp_rank, pipe=pipeline, padded_vocab=padded_vocab,
                                  tensor_parallel=tensor_parallel, micro_batch=micro_batch, precision=precision,
                                  backend=backend, sequence_parallel=sequence_parallel,
                                  optimizer_shards=optimizer_shards, fp32_master=fp32_master))
    return max(ranks, key=lambda e: e.total_gib)


def estimate_ranks(
    model: ModelConfig,
    *,
    padded_vocab: int,
    tensor_parallel: int,
    micro_batch: int,
    precision: str,
    backend: str,
    pipeline: PipelineShape | None = None,
    sequence_parallel: bool = False,
    optimizer_shards: int = 1,
    fp32_master: bool = False,
) -> list[MemoryEstimate]:
    """The estimate of every pipeline rank, rank 0 first. `optimizer_shards` is the DP size with the distributed
    optimizer (Adam's moments split over it), 1 without; `fp32_master` see xla_fp32_master."""
    pipe = pipeline or no_pipeline(model)
    return [_rank_memory(model, r, pipe=pipe, padded_vocab=padded_vocab, tensor_parallel=tensor_parallel,
                         micro_batch=micro_batch, precision=precision, backend=backend,
                         sequence_parallel=sequence_parallel, optimizer_shards=optimizer_shards,
                         fp32_master=fp32_master)
            for r in range(pipe.pipeline)]


def _rank_memory(model: ModelConfig, pp_rank: int, *, pipe: PipelineShape, padded_vocab: int, tensor_parallel: int,
                 micro_batch: int, precision: str, backend: str, sequence_parallel: bool = False,
                 optimizer_shards: int = 1, fp32_master: bool = False) -> MemoryEstimate:
    t, s, b = tensor_parallel, model.seq_length, micro_batch
    stages = range(pp_rank, len(pipe.stage_layers), pipe.pipeline)  # virtual stage k runs on rank k % p
    first, last = 0 in stages, len(pipe.stage_layers) - 1 in stages
    terms = rank_terms(model, tuple(pipe.stage_layers[k] for k in stages), first=first, last=last,
                       pipeline=pipe.pipeline, padded_vocab=padded_vocab, tensor_parallel=t, micro_batch=b,
                       precision=precision, backend=backend, sequence_parallel=sequence_parallel)
    params = terms.params
    pb = parameter_bytes(precision=precision, backend=backend, fp32_master=fp32_master)
    # The distributed optimizer pads its flat buffers to whole slices (train/distributed_optimizer.py), so the
    # weights and gradients it holds are the padded count and each rank's Adam state one slice. torch_xla's pads
    # each parameter's shard (dim 0 to a multiple of DP): at most DP - 1 rows a parameter, left out.
    flat = padded_parameters(params, optimizer_shards) if optimizer_shards > 1 and not fp32_master else params
    weights, grads = flat * pb.weights, flat * pb.grads
    optimizer = flat // optimizer_shards * pb.optimizer
    micro = terms.micro_batch_activations
    # in_flight counts model-chunk micro-batches: with interleaving, chunks of the average size
    activations = in_flight(pp_rank, pipe=pipe) * micro / len(stages)
    activations += terms.recomputed
    logits = 0.0
    if last:
        logits_in_flight = pipe.num_micro_batches if pipe.pipeline > 1 and pipe.schedule == "afab" else 1
        logits = logits_in_flight * 4.0 * s * b * padded_vocab / t * 2  # fp32 logits and their gradient
    return MemoryEstimate(weights_gib=weights / GIB, grads_gib=grads / GIB, optimizer_gib=optimizer / GIB,
                          activations_gib=activations / GIB, logits_gib=logits / GIB,
                          micro_batch_activations_gib=micro / GIB, pp_rank=pp_rank)


@dataclass(frozen=True, slots=True)
class RankTerms:
    """What a pipeline rank's estimate takes from its model chunks, whatever the DP size and micro-batch count."""

    params: int
    """Parameters the rank holds (rank_parameters)."""
    micro_batch_activations: float
    """Bytes of one micro-batch through every chunk of the rank, with the stage's inputs and outputs."""
    recomputed: float
    """Bytes alive again while a checkpointed unit runs its backward (0 without full recomputation)."""


@functools.lru_cache(maxsize=65536)
def rank_terms(model: ModelConfig, chunk_layers: tuple[int, ...], *, first: bool, last: bool, pipeline: int,
               padded_vocab: int, tensor_parallel: int, micro_batch: int, precision: str, backend: str,
               sequence_parallel: bool) -> RankTerms:
    """The costly part of a rank's estimate, kept per argument set: a planner search (every TP x PP at every node
    count a refusal tries, plan/planner.py) asks for the same chunks at many DP sizes and micro-batch counts, which
    change only the optimizer's share and the micro-batches in flight. `cache_info().misses` counts the
    evaluations (tests/unit/test_plan_speed.py)."""
    t, b = tensor_parallel, micro_batch
    params = rank_parameters(model, padded_vocab=padded_vocab, tensor_parallel=t, layers=sum(chunk_layers),
                             first=first, last=last, pipeline=pipeline)
    act = activation_bytes(model, precision=precision, backend=backend)
    io = stage_io_activations(model, first=first, last=last, tensor_parallel=t, micro_batch=b, act=act,
                              sequence_parallel=sequence_parallel)
    kept = [chunk_activations(model, n, tensor_parallel=t, micro_batch=b, act=act,
                              sequence_parallel=sequence_parallel) for n in chunk_layers]
    recomputed = 0.0
    rc = resolve_recompute(model)
    if rc.full:
        # While a checkpointed unit runs its backward, its layers' activations are alive again: one uniform group,
        # or one layer for block.
        recomputed = (rc.num_layers if rc.method == "uniform" else 1) * layer_activations(
            model, tensor_parallel=t, micro_batch=b, act=act, selective=False, sequence_parallel=sequence_parallel)
    return RankTerms(params=params, micro_batch_activations=sum(kept) + io, recomputed=recomputed)


def rank_parameters(model: ModelConfig, *, padded_vocab: int, tensor_parallel: int, layers: int, first: bool,
                    last: bool, pipeline: int = 1) -> int:
    """Parameters one rank holds, exactly as the model builds them: the TP-sharded matrices and column biases
    divided by TP, the norms, row-parallel biases and the position table whole on every TP rank."""
    h, t = model.hidden_size, tensor_parallel
    params = layers * layer_parameters_per_rank(model, tensor_parallel=t)
    if first:
        params += embedding_parameters_per_rank(model, padded_vocab=padded_vocab, tensor_parallel=t)
    if last:
        params += norm_parameters(model)  # the final norm
        if not model.tie_embeddings or pipeline > 1:
            params += padded_vocab // t * h  # the output layer (tied: the last stage's copy of the word embedding)
    return params


def padded_parameters(params: int, shards: int) -> int:
    """The distributed optimizer's flat buffer length for `params` over `shards` DP ranks."""
    unit = shards * SHARD_ALIGN
    return max(unit, -(-params // unit) * unit)


@dataclass(frozen=True, slots=True)
class ActivationBytes:
    """How the trainer's kernels keep activations on a backend (measured with saved-tensor hooks on the CPU; the
    CUDA and XLA cases follow the kernels torch picks there)."""

    value: int
    """Bytes of a saved activation element: 4 in fp32, 2 in 16-bit."""
    mask: int
    """Bytes of a dropout-mask element: bool on CUDA (and Korthikanti et al.'s count, kept for XLA); the CPU's
    dropout keeps its mask in the activations' dtype."""
    attention_scores: bool
    """Whether the attention core keeps its s x s tensors (softmax output, dropout mask and output) for backward:
    yes where scaled_dot_product_attention runs its math path (XLA; the CPU with attention dropout); no for the
    flash and memory-efficient kernels (the CPU without attention dropout; CUDA, where the estimate counts them
    anyway), which keep the output and the log-sum-exp and recompute the scores in backward, as selective
    recomputation does."""


def activation_bytes(model: ModelConfig, *, precision: str, backend: str) -> ActivationBytes:
    value = 4 if precision == "fp32" else 2
    if backend == "gloo":  # the CPU, as measured (tests/unit/test_memory_model.py)
        return ActivationBytes(value=value, mask=value, attention_scores=model.attention_dropout > 0)
    # XLA runs the math path. On CUDA the scores are counted although SDPA's flash and memory-efficient kernels
    # recompute them: the estimate stays Megatron's (without flash attention), an upper bound that leaves room for
    # what it does not model.
    return ActivationBytes(value=value, mask=1, attention_scores=True)


def layer_activations(model: ModelConfig, *, tensor_parallel: int, micro_batch: int, act: ActivationBytes,
                      selective: bool, sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for its backward, Korthikanti et al.'s count for their GPT: in 16-bit with dropout
    s*b*h*(10 + 24/t + 5*a*s/(h*t)).

    In elements of s*b*h (what autograd saves for model/gpt.py's layer, measured with saved-tensor hooks,
    tests/unit/test_plan_model_families.py), whole on every TP rank and sharded with sequence parallelism: the
    inputs of QKV and of the MLP (the norms' outputs) and what each of the two norms keeps besides (norm_inputs):
    4 in all with LayerNorm, 6 with RMSNorm, one less with model.parallel_residual (both norms read the block
    input); and 2 dropout masks (when hidden_dropout > 0). Split
    over TP: the QKV output, (nh + 2G)/nh of it (3 with one key/value head per query head), which the attention
    core's V is a view of; with rotary positions the rotated Q and K, (nh + G)/nh; the attention output (1); and
    the MLP's FFN-wide tensors, ffn/h each: the GeLU's input and output (2), or SwiGLU's gate output, its SiLU, the
    up projection and their product (4). Korthikanti et al.'s 12 is 3 + 1 + 2 * 4. The attention core keeps
    a*s*s*b/t elements of softmax output, plus a mask and the dropout's output with attention dropout, unless
    `selective` recomputation or a kernel that recomputes them (ActivationBytes.attention_scores). Left out: the
    norms' statistics and the log-sum-exp (2*s*b and a*s*b/t floats, under 1% from h = 64 on).
    """
    t, s, b, h, a = (tensor_parallel, model.seq_length, micro_batch, model.hidden_size, model.num_attention_heads)
    masks = 2 * act.mask if model.hidden_dropout > 0 else 0
    inputs = 2 + norm_inputs(model) * 2 - (1 if model.parallel_residual else 0)
    whole = (inputs * act.value + masks) / (t if sequence_parallel else 1)
    groups = model.query_groups
    split = qkv_rows(model) / h + 1.0 + 2 * (mlp_matrices(model) - 1) * model.ffn_size / h
    if model.position_embedding == "rope":
        split += (a + groups) / a  # rotary's Q and K are new tensors; the QKV output stays saved for V
    core = 0.0
    if act.attention_scores and not selective:
        per_score = act.value + (act.mask + act.value if model.attention_dropout > 0 else 0)
        core = per_score * a * s / (h * t)
    return s * b * h * (whole + split * act.value / t + core)


def norm_inputs(model: ModelConfig) -> int:
    """Tensors of s*b*h a norm keeps for its backward besides the next linear's input (its output): LayerNorm its
    input; RMSNorm, as torch composes it (measured on the CPU), its input and the normalized input, which the
    weight's gradient needs."""
    return 2 if model.normalization == "rmsnorm" else 1


def stage_io_activations(model: ModelConfig, *, first: bool, last: bool, tensor_parallel: int, micro_batch: int,
                         act: ActivationBytes, sequence_parallel: bool = False) -> float:
    """What one micro-batch keeps outside the layers: the embedding's dropout mask on the first stage; what the
    final norm keeps (norm_inputs) and the output layer's input on the last (sequence shards with sequence
    parallelism, whose output layer gathers the sequence again in backward). The logits and their loss are
    logits_gib's."""
    sbh = model.seq_length * micro_batch * model.hidden_size
    shard = tensor_parallel if sequence_parallel else 1
    kept = 0.0
    if first and model.hidden_dropout > 0:
        kept += sbh * act.mask / shard
    if last:
        kept += (norm_inputs(model) + 1) * sbh * act.value / shard
    return kept


def chunk_activations(model: ModelConfig, chunk_layers: float, *, tensor_parallel: int, micro_batch: int,
                      act: ActivationBytes, sequence_parallel: bool = False) -> float:
    """Bytes one model chunk's layers keep for one micro-batch between its forward and its backward.

    Full recomputation keeps the input of each checkpointed unit (s*b*h elements): one per uniform group, one
    per layer for the block method's first recompute_num_layers layers, whose other layers keep everything.
    """
    rc = resolve_recompute(model)
    kept = layer_activations(model, tensor_parallel=tensor_parallel, micro_batch=micro_batch, act=act,
                             selective=rc.selective, sequence_parallel=sequence_parallel)
    unit_input = 1.0 * model.seq_length * micro_batch * model.hidden_size * act.value
    if sequence_parallel:  # a checkpointed unit's input is this rank's sequence shard
        unit_input /= tensor_parallel
    if not rc.full:
        return chunk_layers * kept
    if rc.method == "uniform":
        return chunk_layers / rc.num_layers * unit_input
    checkpointed = min(rc.num_layers, chunk_layers)
    return checkpointed * unit_input + (chunk_layers - checkpointed) * kept
