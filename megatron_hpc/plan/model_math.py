"""Parameter count and FLOPs per token of a dense GPT. Pure.

FLOPs use Megatron's classic formula (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters"; shared/reference/megatron-and-launchers.md 4.4), which counts
forward + backward, no activation recomputation, full (not causal-halved) attention and the
padded vocabulary: per token 12*L*h^2*(2 + s/h + ffn/h) + 6*h*V, i.e. 72*L*h^2 + 12*L*h*s + 6*h*V
for ffn = 4h. GPT-3 6.7B gives 43.11 GFLOP/token.
"""

from __future__ import annotations

from megatron_hpc.config.schema import ModelConfig

FLOPS_FORMULA = "megatron-classic: 12*L*h^2*(2 + s/h + ffn/h) + 6*h*V_padded per token (Narayanan et al. 2021)"


def rotary_dims(head_dim: int, *, rotary_percent: float) -> int:
    """Rotated dims per head of rotary embeddings; ValueError unless it is a positive even number."""
    rot = int(head_dim * rotary_percent)
    if rot <= 0 or rot % 2:
        raise ValueError(f"rotary_percent {rotary_percent} of head dim {head_dim} gives {rot} rotated dims; "
                         f"it must be a positive even number")
    return rot


def layer_parameters(model: ModelConfig) -> int:
    """Parameters of one transformer layer: fused QKV, attention output, MLP up and down, two LayerNorms."""
    h, f = model.hidden_size, model.ffn_size
    return (
        3 * h * h + 3 * h  # fused QKV
        + h * h + h  # attention output projection
        + h * f + f  # MLP up
        + f * h + h  # MLP down
        + 4 * h  # two LayerNorms
    )


def layer_parameters_per_rank(model: ModelConfig, *, tensor_parallel: int) -> int:
    """One layer's parameters on one TP rank: QKV, projections and MLP matrices and the column-parallel biases split
    over TP; the two row-parallel biases and the two LayerNorms whole (parallel/layers.py)."""
    h, _f = model.hidden_size, model.ffn_size
    replicated = h + h + 4 * h
    return (layer_parameters(model) - replicated) // tensor_parallel + replicated


def embedding_parameters_per_rank(model: ModelConfig, *, padded_vocab: int, tensor_parallel: int) -> int:
    """The word embedding's vocabulary shard plus the whole position table."""
    whole = embedding_parameters(model, padded_vocab=padded_vocab)
    words = padded_vocab * model.hidden_size
    return words // tensor_parallel + whole - words


def embedding_parameters(model: ModelConfig, *, padded_vocab: int) -> int:
    """Word embedding plus the learned position table (rope has none): what the first pipeline stage adds."""
    positions = model.max_position_embeddings * model.hidden_size if model.position_embedding == "learned" else 0
    return padded_vocab * model.hidden_size + positions


def num_parameters(model: ModelConfig, *, padded_vocab: int) -> int:
    """Parameters of the full (unsharded) model."""
    h = model.hidden_size
    output = 0 if model.tie_embeddings else padded_vocab * h
    return (model.num_layers * layer_parameters(model) + embedding_parameters(model, padded_vocab=padded_vocab)
            + output + 2 * h)


def flops_per_token(model: ModelConfig, *, padded_vocab: int) -> float:
    """Training FLOPs (forward + backward) per token, Megatron's classic convention."""
    h, layers, s = model.hidden_size, model.num_layers, model.seq_length
    dense = 12.0 * layers * h * h * (2.0 + s / h + model.ffn_size / h)
    return dense + 6.0 * h * padded_vocab


def flops_per_token_6n(model: ModelConfig, *, padded_vocab: int) -> float:
    """The 6*N rule of thumb, reported beside the classic formula for comparison."""
    return 6.0 * num_parameters(model, padded_vocab=padded_vocab)
