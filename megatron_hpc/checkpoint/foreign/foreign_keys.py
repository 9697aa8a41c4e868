"""Megatron-family weight names and QKV row orders to our GPT's (model/gpt.py). Pure: dicts in, dicts out.

Names (shared/reference/megatron-and-launchers.md 3.3; legacy keys as the Neuron reference and Megatron-LM nest them,
flattened with dots; `encoder` is `transformer`, and `self_attention` is `attention`, in older checkpoints; from
September 2023 the legacy norms are `input_norm`, `post_attention_norm` and `final_norm`):

    legacy                                             megatron-core                                ours
    language_model.embedding.word_embeddings.weight    embedding.word_embeddings.weight             wte.weight
    language_model.embedding.position_embeddings.weight embedding.position_embeddings.weight        wpe.weight
    ...encoder.layers.N.input_layernorm.*              decoder.layers.N.input_layernorm.* or         h.N.ln_1.*
                                                         ...self_attention.linear_qkv.layer_norm_* (TE)
    ...encoder.layers.N.self_attention.query_key_value.* ...self_attention.linear_qkv.*             h.N.attn.qkv.*
    ...encoder.layers.N.self_attention.dense.*         ...self_attention.linear_proj.*              h.N.attn.proj.*
    ...encoder.layers.N.post_attention_layernorm.*     ...pre_mlp_layernorm.* or                    h.N.ln_2.*
                                                         ...mlp.linear_fc1.layer_norm_* (TE)
    ...encoder.layers.N.mlp.dense_h_to_4h.*            ...mlp.linear_fc1.*                          h.N.mlp.fc.*
    ...encoder.layers.N.mlp.dense_4h_to_h.*            ...mlp.linear_fc2.*                          h.N.mlp.proj.*
    ...encoder.final_layernorm.*                       decoder.final_layernorm.*                    ln_f.*
    language_model.output_layer.weight (untied)        output_layer.weight (untied)                 lm_head.weight
    word_embeddings_for_head.weight                    output_layer.weight (tied, last stage, PP>1) wte.weight

N counts the layers of one pipeline stage (one virtual chunk), from 0. With SwiGLU, h.N.mlp.fc is here still the
fused [gate; up] rows of one TP rank; importer.py cuts it into our mlp.gate and mlp.fc. Transformer Engine's
`_extra_state` and rotary `inv_freq` buffers carry no weights and are skipped.

QKV rows: ours are per head, [heads, (q, k, v), head dim], which is Megatron's layout from checkpoint_version 2.0
and megatron-core's for multi-head attention. Version 1.0 stored [heads, head dim, 3] and version 0 [3, heads, head
dim], each within one TP shard's heads (Megatron's fix_query_key_value_ordering).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron_hpc.errors import CheckpointError

_LAYER = r"\.layers\.(\d+)\."
_LEGACY = "language_model\\.(?:encoder|transformer)"
_LEGACY_RULES = [
    (r"language_model\.embedding\.word_embeddings\.weight", "wte.weight"),
    (r"language_model\.embedding\.position_embeddings\.weight", "wpe.weight"),
    (_LEGACY + _LAYER + r"input_(?:layer)?norm\.(weight|bias)", r"h.\1.ln_1.\2"),
    (_LEGACY + _LAYER + r"(?:self_attention|attention)\.query_key_value\.(weight|bias)", r"h.\1.attn.qkv.\2"),
    (_LEGACY + _LAYER + r"(?:self_attention|attention)\.dense\.(weight|bias)", r"h.\1.attn.proj.\2"),
    (_LEGACY + _LAYER + r"post_attention_(?:layer)?norm\.(weight|bias)", r"h.\1.ln_2.\2"),
    (_LEGACY + _LAYER + r"mlp\.dense_h_to_4h\.(weight|bias)", r"h.\1.mlp.fc.\2"),
    (_LEGACY + _LAYER + r"mlp\.dense_4h_to_h\.(weight|bias)", r"h.\1.mlp.proj.\2"),
    (_LEGACY + r"\.final_(?:layer)?norm\.(weight|bias)", r"ln_f.\1"),
    (r"language_model\.output_layer\.weight", "lm_head.weight"),
    (r"word_embeddings_for_head\.weight", "wte.weight"),
]
_CORE_RULES = [
    (r"embedding\.word_embeddings\.weight", "wte.weight"),
    (r"embedding\.position_embeddings\.weight", "wpe.weight"),
    (r"decoder" + _LAYER + r"input_layernorm\.(weight|bias)", r"h.\1.ln_1.\2"),
    (r"decoder" + _LAYER + r"self_attention\.linear_qkv\.layer_norm_(weight|bias)", r"h.\1.ln_1.\2"),
    (r"decoder" + _LAYER + r"self_attention\.linear_qkv\.(weight|bias)", r"h.\1.attn.qkv.\2"),
    (r"decoder" + _LAYER + r"self_attention\.linear_proj\.(weight|bias)", r"h.\1.attn.proj.\2"),
    (r"decoder" + _LAYER + r"pre_mlp_layernorm\.(weight|bias)", r"h.\1.ln_2.\2"),
    (r"decoder" + _LAYER + r"mlp\.linear_fc1\.layer_norm_(weight|bias)", r"h.\1.ln_2.\2"),
    (r"decoder" + _LAYER + r"mlp\.linear_fc1\.(weight|bias)", r"h.\1.mlp.fc.\2"),
    (r"decoder" + _LAYER + r"mlp\.linear_fc2\.(weight|bias)", r"h.\1.mlp.proj.\2"),
    (r"decoder\.final_layernorm\.(weight|bias)", r"ln_f.\1"),
]
_SKIPPED = re.compile(r".*(?:_extra_state|\.inv_freq)$")
_OUR_LAYER = re.compile(r"^h\.(\d+)\.")

RULES = {
    "neuron-reference": [(re.compile(p), r) for p, r in _LEGACY_RULES],
    "megatron-lm": [(re.compile(p), r) for p, r in _LEGACY_RULES],
    "megatron-core": [(re.compile(p), r) for p, r in _CORE_RULES],
}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested model dict as one dict of dotted names, in the nesting's order (Megatron's parameter order)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def our_name(name: str, *, family: str, tied: bool) -> str | None:
    """Our name for one of the family's weights (layer index unchanged); None for buffers we skip; CheckpointError for
    a weight our GPT has no place for."""
    if _SKIPPED.match(name):
        return None
    if family == "megatron-core" and name == "output_layer.weight":
        return "wte.weight" if tied else "lm_head.weight"
    for pattern, replacement in RULES[family]:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    raise CheckpointError(f"the checkpoint's weight {name} has no counterpart in our GPT (pre-norm blocks: LayerNorm "
                          "or RMSNorm, GeLU or SwiGLU MLP, multi-head or grouped-query attention, no QK norms or "
                          "experts); its architecture cannot be converted")


def map_names(flat: dict[str, Any], *, family: str, tied: bool, where: object) -> dict[str, Any]:
    """`flat` under our names, in its order (layer indices still the stage's own)."""
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, value in flat.items():
        ours = our_name(name, family=family, tied=tied)
        if ours is None:
            continue
        if ours in out:
            raise CheckpointError(f"{where} holds both {source[ours]} and {name}, which are the same weight of our "
                                  "GPT; the checkpoint mixes two layouts")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: {name} is a {type(value).__name__}, not a tensor; the checkpoint is "
                                  "damaged")
        out[ours], source[ours] = value, name
    return out


def layer_of(name: str) -> int | None:
    match = _OUR_LAYER.match(name)
    return int(match.group(1)) if match else None


def num_layers(names: list[str]) -> int:
    """Layers of one stage or chunk: one more than the highest index (they are numbered from 0)."""
    found = [i for i in map(layer_of, names) if i is not None]
    return max(found) + 1 if found else 0


def renumber(name: str, offset: int) -> str:
    layer = layer_of(name)
    return name if layer is None else _OUR_LAYER.sub(f"h.{layer + offset}.", name, count=1)


def is_qkv(name: str) -> bool:
    return name.endswith((".attn.qkv.weight", ".attn.qkv.bias"))


def qkv_to_ours(t: torch.Tensor, *, version: float, heads: int) -> torch.Tensor:
    """One TP shard's QKV rows (`heads`: the shard's heads) in our per-head [heads, (q, k, v), hd] order."""
    if version >= 2.0:
        return t
    rows, rest = t.shape[0], tuple(t.shape[1:])
    if rows % (3 * heads):
        raise CheckpointError(f"a QKV tensor has {rows} rows, not a multiple of 3 x {heads} heads; the checkpoint's "
                              "head count does not fit its weights")
    hd = rows // (3 * heads)
    if version == 0:
        per_head = t.reshape(3, heads, hd, *rest).transpose(0, 1)  # [3, nh, hd] -> [nh, 3, hd]
    elif version == 1.0:
        per_head = t.reshape(heads, hd, 3, *rest).transpose(1, 2)  # [nh, hd, 3] -> [nh, 3, hd]
    else:
        raise CheckpointError(f"checkpoint_version {version} is unknown (Megatron wrote 0, 1.0, 2.0 and 3.0)")
    return per_head.reshape(rows, *rest).contiguous()
