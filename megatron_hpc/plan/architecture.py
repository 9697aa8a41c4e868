"""The model family a config describes, as `plan` names it and `plan --json` gives it. Pure.

The planner's counts (plan/model_math.py, plan/memory.py) depend on a few architecture keys of `model:` beyond the
sizes: the norm, the MLP, the key/value groups, the biases, the output layer and the positions. `features` gives
them resolved (a group count even where num_query_groups is unset, the FFN width even where it is 4h) with what they
make of a layer; `describe` words what differs from GPT-3's architecture (LayerNorm, GeLU, one key/value head per
query head, biases, tied embeddings, learned positions) for the `model` line of `plan`, and is empty for GPT-3.
"""

from __future__ import annotations

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import layer_parameters, mlp_matrices, qkv_rows


def family(model: ModelConfig) -> str:
    """gpt (GPT-2/3), gpt-neox (parallel residual), llama (RMSNorm, SwiGLU, no linear biases), qwen2 (llama with a QKV
    bias), or custom for another mix of the keys."""
    gpt_like = model.normalization == "layernorm" and not model.swiglu and model.add_bias_linear
    if gpt_like:
        return "gpt-neox" if model.parallel_residual else "gpt"
    llama_like = (model.normalization == "rmsnorm" and model.swiglu and not model.add_bias_linear
                  and not model.parallel_residual and model.position_embedding == "rope")
    if llama_like:
        return "qwen2" if model.add_qkv_bias else "llama"
    return "custom"


def features(model: ModelConfig) -> dict[str, object]:
    """The architecture keys the plan's parameter, FLOP and memory figures use, resolved, with the norm's epsilon and
    the rotary settings (what a --set of them changed shows): `plan --json`'s "model"."""
    rope = model.position_embedding == "rope"
    llama3 = rope and model.rope_scaling == "llama3"
    return {
        "family": family(model),
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.query_groups,
        "head_dim": model.head_dim,
        "ffn_hidden_size": model.ffn_size,
        "normalization": model.normalization,
        "swiglu": model.swiglu,
        "add_bias_linear": model.add_bias_linear,
        "add_qkv_bias": model.add_qkv_bias,
        "tie_embeddings": model.tie_embeddings,
        "parallel_residual": model.parallel_residual,
        "position_embedding": model.position_embedding,
        "rotary_base": model.rotary_base if rope else None,
        "rope_scaling": model.rope_scaling if rope else "none",
        **({"rope_scaling_factor": model.rope_scaling_factor, "rope_low_freq_factor": model.rope_low_freq_factor,
            "rope_high_freq_factor": model.rope_high_freq_factor,
            "rope_original_max_position": model.rope_original_max_position} if llama3 else {}),
        "rotary_percent": model.rotary_percent if rope else None,
        "layernorm_epsilon": model.layernorm_epsilon,
        "qkv_rows": qkv_rows(model),
        "mlp_matrices": mlp_matrices(model),
        "layer_parameters": layer_parameters(model),
    }


def describe(model: ModelConfig) -> str:
    """What differs from GPT-3's architecture, comma-separated ("RMSNorm, SwiGLU, GQA 32 heads / 8 groups, ..."); empty
    for GPT-3's own."""
    parts = ["RMSNorm"] if model.normalization == "rmsnorm" else []
    parts += ["SwiGLU"] if model.swiglu else (["tanh GeLU"] if model.activation == "gelu_tanh" else [])
    groups, heads = model.query_groups, model.num_attention_heads
    if groups != heads:
        parts.append("MQA" if groups == 1 else f"GQA {heads} heads / {groups} groups")
    if not model.add_bias_linear:
        parts.append("QKV bias only" if model.add_qkv_bias else "no linear biases")
    parts += ["parallel residual"] if model.parallel_residual else []
    if model.position_embedding == "rope":
        base = model.rotary_base
        rotary = f"rotary base {base:.0f}" if float(base).is_integer() else f"rotary base {base:g}"
        rotary += f" on {model.rotary_percent:.0%} of each head" if model.rotary_percent < 1 else ""
        if model.rope_scaling != "none":
            rotary += f", {model.rope_scaling} scaling x{model.rope_scaling_factor:g}"
        parts.append(rotary)
    parts += ["untied output"] if not model.tie_embeddings else []
    return ", ".join(parts)
