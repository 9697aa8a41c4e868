"""Per-worker memory estimate: weights + grads + optimizer states + activations. Pure.

Bytes per parameter: fp32 and autocast keep fp32 weights, grads and two Adam moments (16);
pure bf16 on XLA (XLA_USE_BF16, the Neuron reference) keeps all four in bf16 (8); fp16 with
dynamic loss scaling keeps fp16 weights and grads plus fp32 master and moments (16).
Activations per layer follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models") without sequence parallelism: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes
in 16-bit (doubled for fp32); full recomputation keeps only each layer's input, 2*s*b*h.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hpc.config.schema import ModelConfig

GIB = 1024**3


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    weights_and_optimizer_gib: float
    activations_gib: float
    logits_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_and_optimizer_gib + self.activations_gib + self.logits_gib


def bytes_per_parameter(*, precision: str, backend: str) -> int:
    if precision == "bf16" and backend == "xla":
        return 8
    return 16


def estimate_memory(
    model: ModelConfig,
    *,
    num_parameters: int,
    padded_vocab: int,
    tensor_parallel: int,
    micro_batch: int,
    precision: str,
    backend: str,
) -> MemoryEstimate:
    t, s, b, h, a = (tensor_parallel, model.seq_length, micro_batch, model.hidden_size,
                     model.num_attention_heads)
    state = num_parameters / t * bytes_per_parameter(precision=precision, backend=backend)
    scale = 2.0 if precision == "fp32" else 1.0
    if model.recompute:
        per_layer = 2.0 * s * b * h * scale
        # one layer is live at a time during its recomputation
        peak_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * scale
        activations = per_layer * model.num_layers + peak_layer
    else:
        activations = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * scale * model.num_layers
    logits = 4.0 * s * b * padded_vocab / t * 2  # fp32 logits and their gradient
    return MemoryEstimate(
        weights_and_optimizer_gib=state / GIB,
        activations_gib=activations / GIB,
        logits_gib=logits / GIB,
    )
