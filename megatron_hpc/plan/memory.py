"""Per-worker memory estimate of the heaviest pipeline rank: weights + grads + optimizer states + activations. Pure.

Bytes per parameter (weights, grads and Adam's two moments together):
- fp32: fp32 weights, grads and moments (16);
- bf16 on XLA: pure bf16 (XLA_USE_BF16, the Neuron reference) keeps all four in bf16 (8);
- bf16 or fp16 elsewhere: autocast (train/precision.py) keeps fp32 weights, grads and moments (16) plus the
  16-bit copies of the weights that autocast caches during the forward and matmuls save for the backward (2),
  18 in all (the same count as Megatron's mixed precision with fp32 main grads).
The distributed optimizer (ZeRO-1) divides the optimizer part (Adam's 8 bytes; 4 in pure bf16) by the DP size:
4 + 4 + 8/d for fp32 (Megatron's table says 6 + 12/d for its 16-bit weights with an fp32 main copy; here autocast
keeps the weights in fp32, so they are the main copy). Without it, the estimate gives table 1 of Narayanan et al.
2021 (80 GB A100s, 16-bit training) on p5: 1.7B at TP 1, 3.6B at TP 2, 7.5B at TP 4, 18.4B at TP 8, then
39.1B..310.1B at TP 8 and PP 2, 4, 8, 16.

Activations per layer and micro-batch follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models") without sequence parallelism: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in 16-bit (doubled for
fp32). Selective recomputation (plan/recompute.py) drops the attention core's 5*a*s/(h*t) term. Full
recomputation keeps only the input of each checkpointed unit, 2*s*b*h: per group of recompute_num_layers with the
uniform method (plus one group's full activations while it is recomputed), per layer for the first
recompute_num_layers layers of a chunk with the block method (the others keep everything; plus one layer while
recomputed). `model.recompute: true` is full / uniform / 1: each layer's input plus one layer.
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

from dataclasses import dataclass

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import embedding_parameters, layer_parameters
from megatron_hpc.plan.recompute import resolve_recompute

GIB = 1024**3


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    weights_and_optimizer_gib: float
    activations_gib: float
    logits_gib: float
    pp_rank: int = 0
    """The pipeline rank these numbers are for (the heaviest one)."""

    @property
    def total_gib(self) -> float:
        return self.weights_and_optimizer_gib + self.activations_gib + self.logits_gib


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


def parameter_bytes(*, precision: str, backend: str) -> ParameterBytes:
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
) -> MemoryEstimate:
    """The estimate of the pipeline rank that needs the most memory (rank 0 without pipelining)."""
    ranks = estimate_ranks(model, padded_vocab=padded_vocab, tensor_parallel=tensor_parallel,
                           micro_batch=micro_batch, precision=precision, backend=backend, pipeline=pipeline,
                           sequence_parallel=sequence_parallel, optimizer_shards=optimizer_shards)
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
) -> list[MemoryEstimate]:
    """The estimate of every pipeline rank, rank 0 first. `optimizer_shards` is the DP size with the distributed
    optimizer (Adam's moments split over it), 1 without."""
    pipe = pipeline or no_pipeline(model)
    return [_rank_memory(model, r, pipe=pipe, padded_vocab=padded_vocab, tensor_parallel=tensor_parallel,
                         micro_batch=micro_batch, precision=precision, backend=backend,
                         sequence_parallel=sequence_parallel, optimizer_shards=optimizer_shards)
            for r in range(pipe.pipeline)]


def _rank_memory(model: ModelConfig, pp_rank: int, *, pipe: PipelineShape, padded_vocab: int, tensor_parallel: int,
                 micro_batch: int, precision: str, backend: str, sequence_parallel: bool = False,
                 optimizer_shards: int = 1) -> MemoryEstimate:
    t, s, b, h = tensor_parallel, model.seq_length, micro_batch, model.hidden_size
    stages = range(pp_rank, len(pipe.stage_layers), pipe.pipeline)  # virtual stage k runs on rank k % p
    first, last = 0 in stages, len(pipe.stage_layers) - 1 in stages
    layers = sum(pipe.stage_layers[k] for k in stages)
    params = layers * layer_parameters(model)
    if first:
        params += embedding_parameters(model, padded_vocab=padded_vocab)
    if last:
        params += 2 * h  # final LayerNorm
        if not model.tie_embeddings or pipe.pipeline > 1:
            params += padded_vocab * h  # the output layer (tied: the last stage's copy of the word embedding)
    state = params / t * parameter_bytes(precision=precision, backend=backend).total(optimizer_shards=optimizer_shards)

    scale = 2.0 if precision == "fp32" else 1.0
    chunk_layers = layers / len(stages)  # layers per model chunk (equal with interleaving; one chunk otherwise)
    activations = in_flight(pp_rank, pipe=pipe) * chunk_activations(model, chunk_layers, tensor_parallel=t,
                                                                     micro_batch=b, scale=scale,
                                                                     sequence_parallel=sequence_parallel)
    rc = resolve_recompute(model)
    if rc.full:
        # While a checkpointed unit runs its backward, its layers' activations are alive again: one uniform group,
        # or one layer for block.
        activations += (rc.num_layers if rc.method == "uniform" else 1) * layer_activations(
            model, tensor_parallel=t, micro_batch=b, scale=scale, selective=False,
            sequence_parallel=sequence_parallel)
    logits = 0.0
    if last:
        logits_in_flight = pipe.num_micro_batches if pipe.pipeline > 1 and pipe.schedule == "afab" else 1
        logits = logits_in_flight * 4.0 * s * b * padded_vocab / t * 2  # fp32 logits and their gradient
    return MemoryEstimate(weights_and_optimizer_gib=state / GIB, activations_gib=activations / GIB,
                          logits_gib=logits / GIB, pp_rank=pp_rank)


def layer_activations(model: ModelConfig, *, tensor_parallel: int, micro_batch: int, scale: float,
                      selective: bool, sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for its backward: Korthikanti et al.'s s*b*h*(10 + 24/t + 5*a*s/(h*t)) in 16-bit
    (`scale` 2 for fp32); selective recomputation drops the attention core's 5*a*s/(h*t) term (scores, softmax
    output, its dropout mask and output: everything of size s^2)."""
    t, s, b, h, a = (tensor_parallel, model.seq_length, micro_batch, model.hidden_size, model.num_attention_heads)
    core = 0.0 if selective else 5 * a * s / (h * t)
    if sequence_parallel:  # the LayerNorm and dropout parts are sequence shards too (their eq. 4)
        return s * b * h * (34 / t + core) * scale
    return s * b * h * (10 + 24 / t + core) * scale


def chunk_activations(model: ModelConfig, chunk_layers: float, *, tensor_parallel: int, micro_batch: int,
                      scale: float, sequence_parallel: bool = False) -> float:
    """Bytes one model chunk keeps for one micro-batch between its forward and its backward.

    Full recomputation keeps the input of each checkpointed unit (2*s*b*h in 16-bit): one per uniform group, one
    per layer for the block method's first recompute_num_layers layers, whose other layers keep everything.
    """
    rc = resolve_recompute(model)
    kept = layer_activations(model, tensor_parallel=tensor_parallel, micro_batch=micro_batch, scale=scale,
                             selective=rc.selective, sequence_parallel=sequence_parallel)
    unit_input = 2.0 * model.seq_length * micro_batch * model.hidden_size * scale
    if sequence_parallel:  # a checkpointed unit's input is this rank's sequence shard
        unit_input /= tensor_parallel
    if not rc.full:
        return chunk_layers * kept
    if rc.method == "uniform":
        return chunk_layers / rc.num_layers * unit_input
    checkpointed = min(rc.num_layers, chunk_layers)
    return checkpointed * unit_input + (chunk_layers - checkpointed) * kept
