"""Llama 2/3 (Hugging Face `LlamaForCausalLM`) and Qwen2/2.5 (`Qwen2ForCausalLM`) <-> our GPT: configs and whole
(TP 1) state dicts. Pure. hf_qwen2.py and hf_mistral.py bind the same functions to Qwen2's and Mistral's names
(Mistral is Llama's layers without biases; only a checkpoint without its sliding window, as Mistral 7B v0.3, is ours).

Our GPT with RMSNorm, SwiGLU, grouped-query attention, rotary positions, no linear biases and an untied output layer
is Llama's architecture (with biases on every linear, Llama's attention_bias + mlp_bias); with a bias on the QKV
projection only it is Qwen2's (transformers models/llama and models/qwen2):

    model.embed_tokens                                 wte            vocabulary rows
    model.layers.N.input_layernorm                     h.N.ln_1       RMSNorm weight
    model.layers.N.self_attn.{q,k,v}_proj              h.N.attn.qkv   joined into Megatron's grouped rows, below
    model.layers.N.self_attn.o_proj                    h.N.attn.proj
    model.layers.N.post_attention_layernorm            h.N.ln_2
    model.layers.N.mlp.gate_proj / up_proj / down_proj h.N.mlp.gate / h.N.mlp.fc / h.N.mlp.proj
    model.norm                                         ln_f
    lm_head                                            lm_head        (wte's rows again when tied)

QKV: HF keeps q (nh * hd rows), k and v (G * hd rows each) apart; query head j uses key/value head j // (nh / G).
Ours is one weight in Megatron's grouped order [G, (nh/G queries, key, value), hd], so each group's queries sit
with their key and value and a contiguous TP shard holds whole groups. Rotary: both rotate with rotate_half over the
whole head (model/rotary.py), Llama 3.1's rope_type "llama3" scaling included; HF's q/k rows are already in that
layout (its conversion from Meta's weights permuted them), so they are copied as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_hpc.errors import CheckpointError

ARCHITECTURE = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
TOKENIZER_JSON_FIRST = True
"""The folder's tokenizer.json is the tokenizer, even beside a GPT-2 style vocab.json and merges.txt (Qwen2 ships
both, and its pre-tokenizer splits text otherwise than GPT-2's): hf_import.data_config."""
_LAYER = {  # ours (under h.N.) -> theirs (under model.layers.N.), the weights copied as they are
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj",
}
_BIASED = ("attn.proj", "mlp.gate", "mlp.fc", "mlp.proj")
"""Those of _LAYER with a bias where the model has biases on every linear (Llama's attention_bias + mlp_bias)."""
_BUFFERS = (".rotary_emb.inv_freq",)
"""A buffer older transformers saved in Llama checkpoints."""


def llama_layers(model: dict[str, Any]) -> list[str]:
    """Which of Llama's layers our `model:` section uses (empty for a GPT-2 / NeoX shaped model); GPT-2's and NeoX's
    exporters refuse a model that uses any."""
    used = []
    if model.get("normalization", "layernorm") == "rmsnorm":
        used.append("RMSNorm")
    if model.get("swiglu", False):
        used.append("SwiGLU")
    groups = model.get("num_query_groups")
    if groups is not None and groups != model["num_attention_heads"]:
        used.append("grouped-query attention")
    if not model.get("add_bias_linear", True):
        used.append("bias-free linears")
    if model.get("rope_scaling", "none") != "none":
        used.append("RoPE scaling")
    return used


def _rope_params(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """The one rope parameter dict of a config.json: transformers 5's rope_parameters, else 4's rope_scaling (with
    rope_theta beside it), else empty. transformers 5 nests it per layer type where layer types differ
    (modeling_rope_utils.py nested_rope_parameter_keys); one dict shared by every layer type is taken as it is."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"the {name} config's rope parameters {params!r} are not a JSON object; fix config.json")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested and any(n != nested[0] for n in nested):
        raise CheckpointError(f"the {name} config gives its layer types different rotary embeddings; megatron-hpc "
                              "has one for every layer, so it cannot be converted")
    return nested[0] if nested else params


def _rope(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """Our rotary keys from transformers 4's rope_theta / rope_scaling or 5's rope_parameters."""
    params = _rope_params(cfg, name)
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"the {name} config rotates {partial} of each head (partial_rotary_factor); Llama's "
                              "layers rotate all of it, so this config is not one they run")
    out: dict[str, Any] = {"position_embedding": "rope",
                           "rotary_base": float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        # transformers' standardize_rope_params: the original context defaults to max_position_embeddings.
        given = {"original_max_position_embeddings": cfg.get("max_position_embeddings"), **params}
        try:
            out.update(rope_scaling="llama3", rope_scaling_factor=float(given["factor"]),
                       rope_low_freq_factor=float(given["low_freq_factor"]),
                       rope_high_freq_factor=float(given["high_freq_factor"]),
                       rope_original_max_position=int(given["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the {name} config's llama3 rope scaling has no usable {exc}; it needs factor, "
                                  "low_freq_factor and high_freq_factor (Llama 3.1: 8, 1 and 4)") from None
    elif kind != "default":
        raise CheckpointError(f"the {name} config uses rope_type {kind!r}, which megatron-hpc does not implement; "
                              "supported: default and llama3 (Llama 3.1's); convert a model trained with those")
    return out


_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
             "max_position_embeddings")


def _sliding_window(cfg: dict[str, Any], name: str) -> str:
    """Where the config attends through a sliding window narrower than its longest sequence, in words ('' when every
    layer computes full attention), by transformers' rule (5.x models/qwen2/configuration_qwen2.py, models/mistral):

    - Mistral: every layer, unless sliding_window is null (4096 when config.json omits the key);
    - Qwen2: only with use_sliding_window (else sliding_window is dropped), and then the layers layer_types names
      sliding_attention, or, without layer_types, those from max_window_layers on (28 when omitted);
    - Llama has no window: a config that names one is refused.

    A query sees itself and the window - 1 tokens before it (masking_utils.sliding_window_overlay), so a window of at
    least max_position_embeddings tokens, the longest sequence the model takes, is full attention too."""
    layer_types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else None
    if name == ARCHITECTURE:
        if layer_types is not None and "sliding_attention" in layer_types:
            return f"{layer_types.count('sliding_attention')} of its {len(layer_types)} layers"
        return "its layers" if cfg.get("use_sliding_window", False) or cfg.get("sliding_window") else ""
    if name == MISTRAL:
        window = cfg.get("sliding_window", 4096)
        sliding, where = (cfg["num_hidden_layers"] if window is not None else 0), "every layer"
    else:
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        if layer_types is not None:
            sliding = layer_types.count("sliding_attention")
        else:
            first = cfg.get("max_window_layers", 28)
            sliding = max(0, cfg["num_hidden_layers"] - int(first)) if window is not None else 0
        where = f"{sliding} of its {cfg['num_hidden_layers']} layers"
    if not sliding:
        return ""
    if window is None:  # layer_types names sliding layers of no window: transformers cannot build their mask
        return where
    if isinstance(window, int) and window >= cfg["max_position_embeddings"]:
        return ""
    return f"{where} (a {window}-token window)"


def _bias_linear(cfg: dict[str, Any], name: str) -> bool:
    """Our add_bias_linear for Llama's attention_bias (q, k, v and o_proj) and mlp_bias (gate, up and down_proj):
    both true is a bias on every linear, as ours; one without the other is refused. transformers' Qwen2 and
    Mistral read neither key, so neither do we for them."""
    if name != ARCHITECTURE:
        return False
    attention, mlp = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attention != mlp:
        given, other = ("attention_bias", "mlp_bias") if attention else ("mlp_bias", "attention_bias")
        raise CheckpointError(f"the {name} config has {given} true but {other} false; megatron-hpc puts a bias on "
                              "every linear (both true) or on the QKV projection only (Qwen2's), not on "
                              f"{'the attention' if attention else 'the MLP'} alone, so it cannot be converted")
    return attention


def config_from_hf(cfg: dict[str, Any], *, name: str, qkv_bias: bool) -> dict[str, Any]:
    """Our `model:` keys for a Llama or Qwen2 config.json (CheckpointError for what our GPT cannot express)."""
    missing = [k for k in _REQUIRED if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    if missing:
        raise CheckpointError(f"the {name} config has no usable {missing[0]}; pass the folder save_pretrained wrote")
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"the {name} config uses hidden_act {cfg['hidden_act']!r}; only silu (SwiGLU) is "
                              "supported")
    window = _sliding_window(cfg, name)
    if window:
        from megatron_hpc.checkpoint.foreign.hf_formats import supported  # here: hf_formats loads this module

        raise CheckpointError(f"the {name} config uses sliding-window attention in {window}, which megatron-hpc "
                              "does not have (every layer attends to all earlier tokens); convert a model with full "
                              "attention (sliding_window null or at least max_position_embeddings, "
                              "use_sliding_window false, or max_window_layers = num_hidden_layers); supported: "
                              f"{', '.join(supported())}")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    groups = cfg.get("num_key_value_heads") or heads
    if heads % groups:
        raise CheckpointError(f"the {name} config has {heads} attention heads and {groups} key/value heads, which "
                              "do not divide them; the folder is not a valid model")
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise CheckpointError(f"the {name} config's head_dim {head_dim} x {heads} heads is not its hidden_size "
                              f"{hidden}; megatron-hpc needs heads x head_dim = hidden size")
    model: dict[str, Any] = {
        "num_layers": cfg["num_hidden_layers"], "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": groups, "ffn_hidden_size": cfg["intermediate_size"],
        "seq_length": cfg["max_position_embeddings"], "max_position_embeddings": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"], "make_vocab_size_divisible_by": 1,
        "normalization": "rmsnorm", "swiglu": True, "add_bias_linear": _bias_linear(cfg, name),
        "add_qkv_bias": qkv_bias,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "init_method_std": cfg.get("initializer_range", 0.02), "layernorm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)), "hidden_dropout": 0.0,
        **_rope(cfg, name),
    }
    return model


def model_config_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    return config_from_hf(cfg, name=ARCHITECTURE, qkv_bias=False)


def config_to_hf(model: dict[str, Any], *, name: str, model_type: str, qkv_bias: bool,
                 eos_token_id: int | None) -> dict[str, Any]:
    """The config.json of `name` for our `model:` section (CheckpointError saying what it cannot express)."""
    missing = [what for what, ok in (
        ("RMSNorm", model.get("normalization", "layernorm") == "rmsnorm"), ("SwiGLU", model.get("swiglu", False)),
        ("rotary positions", model.get("position_embedding", "learned") == "rope"),
        ("full-width rotary", model.get("rotary_percent", 1.0) == 1.0),
        # Llama's attention_bias + mlp_bias are our biases on every linear; Qwen2 and Mistral have no such keys.
        ("no linear biases", model_type == "llama" or not model.get("add_bias_linear", True)),
        ("sequential residuals", not model.get("parallel_residual", False)),
        ("a QKV bias" if qkv_bias else "no QKV bias", bool(model.get("add_qkv_bias", False)) == qkv_bias)) if not ok]
    if missing:
        raise CheckpointError(f"{name} needs {', '.join(missing)}")
    heads = model["num_attention_heads"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model.get("rotary_base", 10000.0))}
    if model.get("rope_scaling", "none") == "llama3":
        rope.update(rope_type="llama3", factor=model.get("rope_scaling_factor", 8.0),
                    low_freq_factor=model.get("rope_low_freq_factor", 1.0),
                    high_freq_factor=model.get("rope_high_freq_factor", 4.0),
                    original_max_position_embeddings=model.get("rope_original_max_position", 8192))
    eos = eos_token_id if eos_token_id is not None else model["vocab_size"] - 1
    return {
        "architectures": [name], "model_type": model_type, "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model.get("ffn_hidden_size") or 4 * model["hidden_size"],
        "num_hidden_layers": model["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": model.get("num_query_groups") or heads,
        "head_dim": model["hidden_size"] // heads, "hidden_act": "silu",
        "max_position_embeddings": model["max_position_embeddings"],
        "rms_norm_eps": model.get("layernorm_epsilon", 1e-5), "initializer_range": model.get("init_method_std", 0.02),
        "tie_word_embeddings": bool(model.get("tie_embeddings", True)),
        # transformers 4 reads the flat keys; 5 reads rope_parameters (and turns the flat ones into it).
        "rope_theta": rope["rope_theta"], "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "rope_parameters": rope, "attention_dropout": model.get("attention_dropout", 0.0),
        "use_cache": True, "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "float32",
        **{"llama": {"attention_bias": bool(model.get("add_bias_linear", True)),
                     "mlp_bias": bool(model.get("add_bias_linear", True))},
           "mistral": {"sliding_window": None}}.get(
            model_type, {"use_sliding_window": False, "sliding_window": None}),
    }


def hf_config_from_model(model: dict[str, Any], *, eos_token_id: int | None = None) -> dict[str, Any]:
    return config_to_hf(model, name=ARCHITECTURE, model_type="llama", qkv_bias=False, eos_token_id=eos_token_id)


def _shape(model: dict[str, Any]) -> tuple[int, int, int, int]:
    heads = model["num_attention_heads"]
    return heads, model.get("num_query_groups") or heads, model["hidden_size"] // heads, model["hidden_size"]


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: dict[str, Any]) -> torch.Tensor:
    """HF's q, k, v weights (rows first) or biases in Megatron's grouped order [G, (nh/G q, k, v), hd]."""
    heads, groups, hd, _ = _shape(model)
    rest = q.shape[1:]
    parts = [q.reshape(groups, heads // groups, hd, *rest), k.reshape(groups, 1, hd, *rest),
             v.reshape(groups, 1, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, model: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """join_qkv undone: HF's q, k, v."""
    heads, groups, hd, _ = _shape(model)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, heads // groups + 2, hd, *rest)
    per = heads // groups
    return (grouped[:, :per].reshape(-1, *rest), grouped[:, per].reshape(-1, *rest),
            grouped[:, per + 1].reshape(-1, *rest))


def _qkv_bias(model: dict[str, Any]) -> bool:
    return bool(model.get("add_qkv_bias", False) or model.get("add_bias_linear", False))


def _take(sd: dict[str, torch.Tensor], key: str, used: set[str], name: str) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"the {name} weights have no {key}; the folder is incomplete or not {name}")
    used.add(key)
    return sd[key]


def _hf_shapes(model: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape config.json gives each of one layer's HF weights."""
    heads, groups, hd, h = _shape(model)
    f = model.get("ffn_hidden_size") or 4 * h
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (heads * hd, h), "self_attn.k_proj.weight": (groups * hd, h),
        "self_attn.v_proj.weight": (groups * hd, h), "self_attn.o_proj.weight": (h, heads * hd),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if _qkv_bias(model):
        shapes.update({"self_attn.q_proj.bias": (heads * hd,), "self_attn.k_proj.bias": (groups * hd,),
                       "self_attn.v_proj.bias": (groups * hd,)})
    if model.get("add_bias_linear", False):
        shapes.update({"self_attn.o_proj.bias": (h,), "mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,),
                       "mlp.down_proj.bias": (h,)})
    return shapes


def _check_shapes(sd: dict[str, torch.Tensor], model: dict[str, Any], *, name: str) -> None:
    shapes = _hf_shapes(model)
    for i in range(model["num_layers"]):
        for key, shape in shapes.items():
            full = f"model.layers.{i}.{key}"
            if full in sd and tuple(sd[full].shape) != shape:
                raise CheckpointError(f"{full} is {tuple(sd[full].shape)}, but config.json makes it {shape}; the "
                                      f"config does not describe these {name} weights")


def state_from(sd: dict[str, torch.Tensor], model: dict[str, Any], *, name: str) -> dict[str, torch.Tensor]:
    """Our whole (TP 1) state dict, `model["vocab_size"]` vocabulary rows, from Llama or Qwen2 weights."""
    _check_shapes(sd, model, name=name)
    used: set[str] = set()
    vocab = model["vocab_size"]
    out = {"wte.weight": _take(sd, "model.embed_tokens.weight", used, name)[:vocab],
           "ln_f.weight": _take(sd, "model.norm.weight", used, name)}
    for i in range(model["num_layers"]):
        pre = f"model.layers.{i}."
        for ours, theirs in _LAYER.items():
            out[f"h.{i}.{ours}.weight"] = _take(sd, f"{pre}{theirs}.weight", used, name)
            if model.get("add_bias_linear", False) and ours in _BIASED:
                out[f"h.{i}.{ours}.bias"] = _take(sd, f"{pre}{theirs}.bias", used, name)
        q, k, v = (_take(sd, f"{pre}self_attn.{p}_proj.weight", used, name) for p in "qkv")
        out[f"h.{i}.attn.qkv.weight"] = join_qkv(q, k, v, model)
        if _qkv_bias(model):
            q, k, v = (_take(sd, f"{pre}self_attn.{p}_proj.bias", used, name) for p in "qkv")
            out[f"h.{i}.attn.qkv.bias"] = join_qkv(q, k, v, model)
    if model.get("tie_embeddings", False):
        used.add("lm_head.weight")  # transformers may save the tied copy; ours is wte itself
    else:
        out["lm_head.weight"] = _take(sd, "lm_head.weight", used, name)[:vocab]
    extra = sorted(k for k in sd if k not in used and not k.endswith(_BUFFERS))
    if extra:
        raise CheckpointError(f"the {name} weights hold {len(extra)} tensors this model has no place for (first: "
                              f"{extra[0]}); check num_hidden_layers and the biases in config.json")
    for key in ("wte.weight", "lm_head.weight"):
        if key in out and out[key].shape[0] < vocab:
            raise CheckpointError(f"{key} has {out[key].shape[0]} rows, fewer than the config's vocab_size {vocab}")
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def state_from_hf(sd: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    return state_from(sd, model, name=ARCHITECTURE)


def state_to_hf(full: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Llama or Qwen2 weights from our whole (TP 1, any vocabulary padding) state dict."""
    vocab = model["vocab_size"]
    sd = {"model.embed_tokens.weight": full["wte.weight"][:vocab], "model.norm.weight": full["ln_f.weight"]}
    for i in range(model["num_layers"]):
        pre = f"model.layers.{i}."
        for ours, theirs in _LAYER.items():
            sd[f"{pre}{theirs}.weight"] = full[f"h.{i}.{ours}.weight"]
            if f"h.{i}.{ours}.bias" in full:
                sd[f"{pre}{theirs}.bias"] = full[f"h.{i}.{ours}.bias"]
        for p, t in zip("qkv", split_qkv(full[f"h.{i}.attn.qkv.weight"], model)):
            sd[f"{pre}self_attn.{p}_proj.weight"] = t
        if f"h.{i}.attn.qkv.bias" in full:
            for p, t in zip("qkv", split_qkv(full[f"h.{i}.attn.qkv.bias"], model)):
                sd[f"{pre}self_attn.{p}_proj.bias"] = t
    head = full["wte.weight"] if model.get("tie_embeddings", True) else full["lm_head.weight"]
    sd["lm_head.weight"] = head[:vocab]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}
