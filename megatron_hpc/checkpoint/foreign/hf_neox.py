"""GPT-NeoX / Pythia (Hugging Face `GPTNeoXForCausalLM`) <-> our GPT: configs and whole (TP 1) state dicts. Pure.

Our GPT with model.parallel_residual, rotary positions and an untied output layer is NeoX's architecture, so
every weight maps one to one (transformers models/gpt_neox/modeling_gpt_neox.py):

    gpt_neox.embed_in                            wte               vocabulary rows (ours padded, below)
    gpt_neox.layers.N.input_layernorm            h.N.ln_1
    gpt_neox.layers.N.attention.query_key_value  h.N.attn.qkv      same row order, see below
    gpt_neox.layers.N.attention.dense            h.N.attn.proj
    gpt_neox.layers.N.post_attention_layernorm   h.N.ln_2
    gpt_neox.layers.N.mlp.dense_h_to_4h          h.N.mlp.fc
    gpt_neox.layers.N.mlp.dense_4h_to_h          h.N.mlp.proj
    gpt_neox.final_layer_norm                    ln_f
    embed_out (lm_head in transformers 5)        lm_head           (wte's rows again when the model is tied)

Both sides are nn.Linear-shaped ([out, in]: no transpose, unlike GPT-2's Conv1D). NeoX views the fused QKV output
as [heads, 3 * head_dim] and takes q, k, v as the thirds of each head, i.e. rows [heads, (q, k, v), head_dim]:
Megatron's per-head order, which our model uses too, so the rows are copied as they are. Rotary: NeoX rotates the
first int(head_dim * rotary_pct) dims of q and k with rotate_half (dim i pairs with i + rot/2), base
rotary_emb_base: model/rotary.py does the same.

Vocabulary: the HF rows already carry NeoX's padding (pythia-6.9b's 50432 are the tokenizer's 50277 ids padded at
TP 2 to a multiple of 128 x 2 by NeoX's pad_vocab_size, which is Megatron's rule, plan/vocab.py). They become our
`vocab_size`; `state_from_hf` returns exactly those rows, and the caller pads them for its TP size with
tp_layout.repad_vocab. `state_to_hf` drops our padding rows again.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_hpc.checkpoint.foreign.hf_llama import llama_layers
from megatron_hpc.errors import CheckpointError

ARCHITECTURE = "GPTNeoXForCausalLM"

_LAYER = {  # ours (under h.N.) -> theirs (under gpt_neox.layers.N.)
    "ln_1": "input_layernorm",
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "ln_2": "post_attention_layernorm",
    "mlp.fc": "mlp.dense_h_to_4h",
    "mlp.proj": "mlp.dense_4h_to_h",
}
_ATTENTION_BIASES = ("attn.qkv", "attn.proj")
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
"""Non-weight buffers older transformers saved in NeoX checkpoints (the causal mask, rotary frequencies)."""

# hidden_act values and our model.activation (exact GeLU is ours by default; the tanh approximation is gelu_tanh).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_HIDDEN_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def _rope(cfg: dict[str, Any]) -> tuple[float, float]:
    """(rotary_pct, rotary base) from either transformers 4's flat keys or 5's rope_parameters (rope_scaling)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise CheckpointError(f"the GPT-NeoX config uses rope_type {kind!r}; only plain rotary embeddings (default) "
                              "are supported")
    # transformers' GPTNeoXConfig defaults: rotary_pct 0.25, rotary_emb_base 10000.
    pct = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25)))
    base = params.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000)))
    return float(pct), float(base)


def _divisor(vocab: int) -> int:
    """A make_vocab_size_divisible_by that keeps the shipped rows unpadded at TP 1 and, where the row count allows,
    up to TP 8 (the largest power of two up to Megatron's default 128)."""
    for tp in (8, 1):
        for d in (128, 64, 32, 16, 8, 4, 2, 1):
            if vocab % (d * tp) == 0:
                return d
    return 1  # unreachable: d = 1 at tp 1 always divides


def model_config_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """Our `model:` keys for a GPTNeoX config.json (CheckpointError for what our GPT cannot express)."""
    if cfg.get("model_type", "gpt_neox") != "gpt_neox":
        raise CheckpointError(f"config.json has model_type {cfg.get('model_type')!r}, not gpt_neox; this mapping is "
                              f"for {ARCHITECTURE}")
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"the GPT-NeoX config uses hidden_act {act!r}; supported: {sorted(_ACTIVATIONS)}")
    pct, base = _rope(cfg)
    h = cfg["hidden_size"]
    model: dict[str, Any] = {
        "num_layers": cfg["num_hidden_layers"], "hidden_size": h, "num_attention_heads": cfg["num_attention_heads"],
        "seq_length": cfg["max_position_embeddings"], "max_position_embeddings": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"], "make_vocab_size_divisible_by": _divisor(cfg["vocab_size"]),
        "ffn_hidden_size": cfg.get("intermediate_size", 4 * h),
        "position_embedding": "rope", "rotary_percent": pct, "rotary_base": base,
        "parallel_residual": bool(cfg.get("use_parallel_residual", True)),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "init_method_std": cfg.get("initializer_range", 0.02),
        "layernorm_epsilon": cfg.get("layer_norm_eps", 1e-5),
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
        "hidden_dropout": float(cfg.get("hidden_dropout", 0.0)),
    }
    if _ACTIVATIONS[act] != "gelu":
        model["activation"] = _ACTIVATIONS[act]
    return model


def hf_config_from_model(model: dict[str, Any], *, eos_token_id: int | None) -> dict[str, Any]:
    """A GPTNeoX config.json for our `model:` section. `eos_token_id`: the tokenizer's end-of-text id; without one,
    0 (the NeoX tokenizer's <|endoftext|>, bos and eos of the Pythia and 20B configs)."""
    if model.get("position_embedding", "learned") != "rope":
        raise CheckpointError(f"this model uses {model.get('position_embedding', 'learned')} position embeddings; "
                              f"{ARCHITECTURE} has rotary ones only: export it as GPT2LMHeadModel instead")
    llama = llama_layers(model)
    if llama:
        raise CheckpointError(f"{ARCHITECTURE} has no {', '.join(llama)}")
    act = model.get("activation", "gelu")
    if act not in _HIDDEN_ACT:
        raise CheckpointError(f"model.activation {act!r} has no GPT-NeoX hidden_act; supported: {sorted(_HIDDEN_ACT)}")
    h = model["hidden_size"]
    eos = 0 if eos_token_id is None else eos_token_id
    return {
        "architectures": [ARCHITECTURE], "model_type": "gpt_neox",
        "vocab_size": model["vocab_size"], "hidden_size": h, "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_attention_heads"],
        "intermediate_size": model.get("ffn_hidden_size") or 4 * h, "hidden_act": _HIDDEN_ACT[act],
        # The flat keys of the shipped configs: transformers 4 reads them, 5 turns them into rope_parameters.
        "rotary_pct": model.get("rotary_percent", 1.0), "rotary_emb_base": model.get("rotary_base", 10000.0),
        "max_position_embeddings": model["max_position_embeddings"],
        "use_parallel_residual": bool(model.get("parallel_residual", False)),
        "tie_word_embeddings": bool(model.get("tie_embeddings", True)),
        "layer_norm_eps": model.get("layernorm_epsilon", 1e-5),
        "initializer_range": model.get("init_method_std", 0.02),
        "attention_dropout": model.get("attention_dropout", 0.0), "hidden_dropout": model.get("hidden_dropout", 0.0),
        "attention_bias": True, "use_cache": True, "bos_token_id": eos, "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _take(sd: dict[str, torch.Tensor], key: str, used: set[str]) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"the GPT-NeoX weights have no {key}; the folder is incomplete or not "
                              f"{ARCHITECTURE}")
    used.add(key)
    return sd[key]


def state_from_hf(sd: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our whole (TP 1) state dict from GPTNeoXForCausalLM weights, with `model["vocab_size"]` vocabulary rows (pad
    them for a TP size with tp_layout.repad_vocab). Without attention biases (attention_bias false) ours are zeros,
    which computes the same. CheckpointError on a missing weight or one that is not NeoX's."""
    used: set[str] = set()
    vocab = model["vocab_size"]
    out = {"wte.weight": _take(sd, "gpt_neox.embed_in.weight", used)[:vocab]}
    for i in range(model["num_layers"]):
        for ours, theirs in _LAYER.items():
            weight = _take(sd, f"gpt_neox.layers.{i}.{theirs}.weight", used)
            out[f"h.{i}.{ours}.weight"] = weight
            bias = f"gpt_neox.layers.{i}.{theirs}.bias"
            if bias in sd or ours not in _ATTENTION_BIASES:
                out[f"h.{i}.{ours}.bias"] = _take(sd, bias, used)
            else:
                out[f"h.{i}.{ours}.bias"] = weight.new_zeros(weight.shape[0])
    out["ln_f.weight"] = _take(sd, "gpt_neox.final_layer_norm.weight", used)
    out["ln_f.bias"] = _take(sd, "gpt_neox.final_layer_norm.bias", used)
    # The shipped checkpoints (and transformers 4) name the output layer embed_out; transformers 5 renames it lm_head.
    head = "embed_out.weight" if "embed_out.weight" in sd else "lm_head.weight"
    if model.get("tie_embeddings", False):
        used.add(head)  # transformers may save the tied copy; ours is wte itself
    else:
        out["lm_head.weight"] = _take(sd, head, used)[:vocab]
    extra = sorted(k for k in sd if k not in used and not k.endswith(_BUFFERS))
    if extra:
        raise CheckpointError(f"the GPT-NeoX weights hold {len(extra)} tensors this model has no place for (first: "
                              f"{extra[0]}); check num_hidden_layers in config.json against the weights")
    for name, t in out.items():
        if t.shape[0] < vocab and name in ("wte.weight", "lm_head.weight"):
            raise CheckpointError(f"{name} has {t.shape[0]} rows, fewer than the config's vocab_size {vocab}")
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def state_to_hf(full: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """GPTNeoXForCausalLM weights from our whole (TP 1, any vocabulary padding) state dict, under the shipped
    checkpoints' names (embed_out, which transformers 5 renames to lm_head as it loads a folder)."""
    vocab = model["vocab_size"]
    sd = {"gpt_neox.embed_in.weight": full["wte.weight"][:vocab],
          "gpt_neox.final_layer_norm.weight": full["ln_f.weight"],
          "gpt_neox.final_layer_norm.bias": full["ln_f.bias"]}
    for i in range(model["num_layers"]):
        for ours, theirs in _LAYER.items():
            for p in ("weight", "bias"):
                sd[f"gpt_neox.layers.{i}.{theirs}.{p}"] = full[f"h.{i}.{ours}.{p}"]
    head = full["wte.weight"] if model.get("tie_embeddings", True) else full["lm_head.weight"]
    sd["embed_out.weight"] = head[:vocab]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}
