"""Parameter count and FLOPs per token of a dense decoder: GPT, GPT-NeoX, Llama and Qwen2 shapes. Pure.

Counts follow the model as model/gpt.py builds it: a fused QKV of (nh + 2G) * hd rows (grouped-query attention keeps
G key/value heads; G = nh is multi-head attention), the attention output projection, the MLP's up and down
projections plus SwiGLU's gate, biases on the linears unless model.add_bias_linear is false (the QKV bias also with
model.add_qkv_bias), two norms per layer and a final one (LayerNorm: weight and bias; RMSNorm: weight only), the word
embedding, a learned position table, and the output layer unless tied.

FLOPs extend Megatron's classic formula (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters"; shared/reference/megatron-and-launchers.md 4.4): forward + backward, no activation recomputation,
full (not causal-halved) attention, the padded vocabulary. Per token and layer that is 6 FLOPs per weight of the
linears plus 12*s*h for the attention scores and their product with V, and 6*h*V for the output layer:
12*L*h^2*((1 + G/nh + s/h) + m/2 * ffn/h) + 6*h*V, with m = 3 MLP matrices under SwiGLU, else 2. With G = nh and
m = 2 it is the classic 12*L*h^2*(2 + s/h + ffn/h) + 6*h*V (72*L*h^2 + 12*L*h*s + 6*h*V for ffn = 4h: GPT-3 6.7B
gives 43.11 GFLOP/token); the G/nh and 3/2 factors are how Megatron-LM's num_floating_point_operations
(megatron/training/training.py) counts grouped-query attention and SwiGLU.
"""

from __future__ import annotations

from megatron_hpc.config.schema import ModelConfig

FLOPS_FORMULA = ("megatron-classic: 12*L*h^2*(1 + G/nh + s/h + m/2*ffn/h) + 6*h*V_padded, m MLP matrices "
                 "(Narayanan et al. 2021)")


def rotary_dims(head_dim: int, *, rotary_percent: float) -> int:
    """Rotated dims per head of rotary embeddings; ValueError unless it is a positive even number."""
    rot = int(head_dim * rotary_percent)
    if rot <= 0 or rot % 2:
        raise ValueError(f"rotary_percent {rotary_percent} of head dim {head_dim} gives {rot} rotated dims; "
                         f"it must be a positive even number")
    return rot


def qkv_rows(model: ModelConfig) -> int:
    """Output rows of the fused QKV projection: nh query heads and G key and G value heads of hd each."""
    return (model.num_attention_heads + 2 * model.query_groups) * model.head_dim


def mlp_matrices(model: ModelConfig) -> int:
    """Weight matrices of the MLP: up and down, plus SwiGLU's gate."""
    return 3 if model.swiglu else 2


def norm_parameters(model: ModelConfig) -> int:
    """One norm's parameters: LayerNorm's weight and bias, or RMSNorm's weight."""
    return model.hidden_size * (1 if model.normalization == "rmsnorm" else 2)


def _layer_split(model: ModelConfig) -> tuple[int, int]:
    """One layer's parameters as (split over TP, whole on every TP rank) (parallel/layers.py): the column-parallel
    QKV, gate and up weights and their biases and the row-parallel weights are split; the row-parallel biases and
    the norms are not."""
    h, f, bias = model.hidden_size, model.ffn_size, model.add_bias_linear
    rows = qkv_rows(model)
    column_in = mlp_matrices(model) - 1  # gate and up, or up alone
    split = (rows * h + (rows if model.qkv_bias else 0)  # fused QKV
             + h * h  # attention output projection (weight)
             + column_in * (h * f + (f if bias else 0))  # MLP gate and up
             + f * h)  # MLP down (weight)
    whole = (2 * h if bias else 0) + 2 * norm_parameters(model)  # the two row-parallel biases, the two norms
    return split, whole


def layer_parameters(model: ModelConfig) -> int:
    """Parameters of one transformer layer: fused QKV, attention output, the MLP, two norms."""
    split, whole = _layer_split(model)
    return split + whole


def layer_parameters_per_rank(model: ModelConfig, *, tensor_parallel: int) -> int:
    """One layer's parameters on one TP rank: the QKV, projection and MLP matrices and the column-parallel biases
    split over TP; the row-parallel biases and the two norms whole (parallel/layers.py)."""
    split, whole = _layer_split(model)
    return split // tensor_parallel + whole


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
    output = 0 if model.tie_embeddings else padded_vocab * model.hidden_size
    return (model.num_layers * layer_parameters(model) + embedding_parameters(model, padded_vocab=padded_vocab)
            + output + norm_parameters(model))


def flops_per_token(model: ModelConfig, *, padded_vocab: int) -> float:
    """Training FLOPs (forward + backward) per token, Megatron's classic convention with GQA and SwiGLU."""
    h, layers, s = model.hidden_size, model.num_layers, model.seq_length
    attention = 1.0 + model.query_groups / model.num_attention_heads + s / h
    mlp = mlp_matrices(model) / 2.0 * model.ffn_size / h
    return 12.0 * layers * h * h * (attention + mlp) + 6.0 * h * padded_vocab


def flops_per_token_6n(model: ModelConfig, *, padded_vocab: int) -> float:
    """The 6*N rule of thumb, reported beside the classic formula for comparison."""
    return 6.0 * num_parameters(model, padded_vocab=padded_vocab)
