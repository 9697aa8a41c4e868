"""Megatron-LM's training arguments as our model config, checked against the weights: the one mapping every
Megatron-family reader uses (the mp_rank_* importer, importer.py, and torch_dist, torch_dist.py). Pure.

`state` is what a checkpoint keeps the arguments in: Megatron-LM's `args` Namespace, or the Neuron reference's flat
keys (megatron_family.arg reads either). Argument names are Megatron-LM's (megatron/training/arguments.py):
--normalization, --swiglu, --group-query-attention / --num-query-groups, --kv-channels, --disable-bias-linear
(add_bias_linear), --add-qkv-bias, --untie-embeddings-and-output-weights, --position-embedding-type (or the older
--use-rotary-position-embeddings), --rotary-base, --rotary-percent, --use-rope-scaling / --rope-scaling-factor,
--norm-epsilon (--layernorm-epsilon before late 2023).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_hpc.checkpoint.foreign import foreign_keys
from megatron_hpc.checkpoint.foreign.megatron_family import arg
from megatron_hpc.errors import CheckpointError

GPT2_VOCAB = 50257
"""The GPT-2 BPE vocabulary (Megatron's GPT2BPETokenizer), when a checkpoint records only the padded size."""
# Architecture switches our GPT cannot follow: (arg, its harmless value, what it means).
_UNSUPPORTED = (("num_experts", None, "mixture-of-experts layers"), ("qk_layernorm", False, "QK layer norms"),
                ("apply_residual_connection_post_layernorm", False, "residuals taken after the norm"),
                ("apply_layernorm_1p", False, "zero-centred (1 + weight) norms"),
                ("squared_relu", False, "squared-ReLU MLPs"), ("rotary_interleaved", False, "interleaved rotary pairs"),
                ("mtp_num_layers", None, "multi-token prediction layers"))
NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
# megatron-core's apply_rope_scaling (models/common/embeddings/rotary_pos_embedding.py, 0.16.1) fixes these three
# to Llama 3.1's values; only the factor is an argument.
_LLAMA3_FIXED = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_position": 8192}


def check_architecture(state: dict[str, Any], *, where: object) -> None:
    """CheckpointError naming the first argument whose architecture our GPT does not have."""
    for name, harmless, what in _UNSUPPORTED:
        value = arg(state, name, harmless)
        if value is not None and value != harmless:
            raise CheckpointError(f"{where} was trained with {name}={value!r} ({what}), which our GPT does not "
                                  "have; it cannot be converted")
    norm = arg(state, "normalization", "LayerNorm")
    if norm not in NORMS:
        raise CheckpointError(f"{where} was trained with normalization={norm!r}; our GPT has "
                              f"{' and '.join(NORMS)}, it cannot be converted")
    position = arg(state, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise CheckpointError(f"{where} uses position_embedding_type={position!r}; our GPT has learned_absolute and "
                              "rope, it cannot be converted")


def query_groups(state: dict[str, Any]) -> int:
    """Key/value heads: num_query_groups with grouped-query attention, else one per head."""
    heads = int(arg(state, "num_attention_heads"))
    return int(arg(state, "num_query_groups") or heads) if arg(state, "group_query_attention", False) else heads


def true_vocab(state: dict[str, Any], padded: int, given: int | None, notes: list[str]) -> int:
    if given is not None:
        if not 0 < given <= padded:
            raise CheckpointError(f"--vocab-size {given} must be between 1 and the checkpoint's {padded} "
                                  "embedding rows")
        return given
    recorded = arg(state, "vocab_size")
    if isinstance(recorded, int) and 0 < recorded <= padded:
        return recorded
    if arg(state, "tokenizer_type") == "GPT2BPETokenizer" and padded >= GPT2_VOCAB:
        return GPT2_VOCAB
    notes.append(f"the true vocabulary size is not recorded; the {padded} embedding rows are all taken as tokens "
                 "(pass --vocab-size to drop the padding)")
    return padded


def _heads(state: dict[str, Any], full: dict[str, torch.Tensor], *, where: object) -> tuple[int, int]:
    """(heads, query groups), checked against the hidden size and the QKV rows."""
    heads = arg(state, "num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise CheckpointError(f"{where} records no num_attention_heads; the QKV weights cannot be split into heads "
                              "without it")
    hidden = full["wte.weight"].shape[1]
    groups = query_groups(state)
    kv = arg(state, "kv_channels") or hidden // heads
    if hidden % heads or kv != hidden // heads or groups < 1 or heads % groups:
        raise CheckpointError(f"{where}: {heads} heads of {kv} channels in {groups} query groups do not fit hidden "
                              f"size {hidden}; our GPT needs kv_channels = hidden / heads, it cannot be converted")
    rows = full["h.0.attn.qkv.weight"].shape[0] if "h.0.attn.qkv.weight" in full else (heads + 2 * groups) * kv
    if rows != (heads + 2 * groups) * kv:
        raise CheckpointError(f"{where}: the QKV weight has {rows} rows, not ({heads} + 2 x {groups}) x {kv}; its "
                              "args do not fit its weights, it cannot be converted")
    return heads, groups


def model_config(state: dict[str, Any], full: dict[str, torch.Tensor], *, where: object, vocab_size: int | None,
                 notes: list[str]) -> dict[str, Any]:
    """Our model config (config/schema.py ModelConfig keys) of the whole model `full` (our names, shapes suffice)
    and the source's arguments."""
    heads, groups = _heads(state, full, where=where)
    layers = foreign_keys.num_layers(list(full))
    recorded = arg(state, "num_layers")
    if recorded is not None and recorded != layers:
        raise CheckpointError(f"{where} holds {layers} layers but its arguments say num_layers={recorded}; shards "
                              "are missing or the folder mixes checkpoints")
    hidden, padded = full["wte.weight"].shape[1], full["wte.weight"].shape[0]
    rope = (arg(state, "position_embedding_type") == "rope" or bool(arg(state, "use_rotary_position_embeddings")))
    if rope == ("wpe.weight" in full):
        raise CheckpointError(f"{where}: position_embedding_type={arg(state, 'position_embedding_type')!r} but the "
                              f"position table is {'there' if rope else 'missing'}; it cannot be converted")
    max_pos = full["wpe.weight"].shape[0] if not rope else _rope_context(state, where)
    bias = "h.0.attn.proj.bias" in full
    epsilon = arg(state, "norm_epsilon", None)
    cfg = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
           "num_query_groups": groups if groups != heads else None,
           "seq_length": min(int(arg(state, "seq_length") or max_pos), max_pos), "max_position_embeddings": max_pos,
           "vocab_size": true_vocab(state, padded, vocab_size, notes),
           "ffn_hidden_size": full["h.0.mlp.fc.weight"].shape[0] if "h.0.mlp.fc.weight" in full else 4 * hidden,
           "make_vocab_size_divisible_by": int(arg(state, "make_vocab_size_divisible_by", 128) or 128),
           "position_embedding": "rope" if rope else "learned",
           "rotary_percent": float(arg(state, "rotary_percent", 1.0) or 1.0),
           "rotary_base": float(arg(state, "rotary_base", 10000) or 10000),
           "tie_embeddings": "lm_head.weight" not in full,
           "init_method_std": float(arg(state, "init_method_std", 0.02) or 0.02),
           "layernorm_epsilon": float(epsilon if epsilon is not None else arg(state, "layernorm_epsilon", 1e-5)),
           "normalization": NORMS[arg(state, "normalization", "LayerNorm")],
           "swiglu": bool(arg(state, "swiglu", False)), "add_bias_linear": bias,
           "add_qkv_bias": "h.0.attn.qkv.bias" in full and not bias,
           # Megatron's fused bias-GeLU (bias_gelu_fusion, on unless --no-bias-gelu-fusion, and only with biases) and
           # openai_gelu compute the tanh approximation; the unfused GeLU is the exact one (transformers' converter
           # maps them to gelu_fast / gelu_new / gelu likewise: megatron-and-launchers.md 3.5).
           "activation": "gelu_tanh" if arg(state, "openai_gelu", False)
           or (bias and arg(state, "bias_gelu_fusion", False)) else "gelu"}
    if arg(state, "use_rope_scaling", False):
        cfg.update(rope_scaling="llama3", rope_scaling_factor=float(arg(state, "rope_scaling_factor", 8.0) or 8.0),
                   **_LLAMA3_FIXED)
    return cfg


def layer_keys(cfg: dict[str, Any]) -> list[str]:
    """The weights (after `h.N.`) each layer of our GPT has with this config."""
    norm_bias = cfg.get("normalization", "layernorm") == "layernorm"
    bias = cfg.get("add_bias_linear", True)
    linears = ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"] + (["mlp.gate"] if cfg.get("swiglu") else [])
    keys = [f"{n}.weight" for n in ("ln_1", "ln_2")] + ([f"{n}.bias" for n in ("ln_1", "ln_2")] if norm_bias else [])
    keys += [f"{n}.weight" for n in linears] + [f"{n}.bias" for n in linears if bias]
    if not bias and cfg.get("add_qkv_bias"):
        keys.append("attn.qkv.bias")
    return sorted(keys)


def _rope_context(state: dict[str, Any], where: str) -> int:
    """The longest sequence a rotary model was made for: a rotary model has no position table to read it from."""
    length = arg(state, "max_position_embeddings") or arg(state, "seq_length")
    if not length:
        raise CheckpointError(f"{where}: its arguments give neither max_position_embeddings nor seq_length, and a "
                              "rotary model has no position table to tell its context length; add one of them to the "
                              "checkpoint's args (Megatron-LM's --max-position-embeddings) and convert again")
    return int(length)
