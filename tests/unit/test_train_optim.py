"""AdamW parameter groups: weight decay on matrices only, never on biases or norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_hpc.config.schema import ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.train.loop import build_model
from megatron_hpc.train.optim import build_adamw

LLAMA = {"normalization": "rmsnorm", "swiglu": True, "num_query_groups": 1, "add_bias_linear": False}
"""Llama's layers on the 2 heads (one key/value group); with add_qkv_bias, Qwen2's."""


@pytest.mark.parametrize("family", [{}, LLAMA, {**LLAMA, "add_qkv_bias": True}], ids=["gpt", "llama", "qwen"])
def test_no_decay_on_biases_and_norms(ctx: ParallelContext, family: dict) -> None:
    cfg = RunConfig(name="t", model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8,
                                                max_position_embeddings=8, vocab_size=100, tie_embeddings=False,
                                                **family),
                    train=TrainConfig(num_steps=1, micro_batch_size=1, global_batch_size=1),
                    optim=OptimConfig(lr=1e-3, weight_decay=0.1))
    model = build_model(cfg.model, ctx, padded_vocab=128, seed=1, device=torch.device("cpu"))
    opt = build_adamw(model, optim=cfg.optim)
    assert opt.defaults["fused"] is True  # torch's fused AdamW kernel on CPU (no apex here)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(decay_of) == len(names)  # every parameter in exactly one group
    norms = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for p in m.parameters()}
    assert len(norms) == (5 if family else 10)  # ln_1, ln_2 of each layer and ln_f: RMSNorm has no bias
    for name, p in names.items():
        exempt = name.endswith(".bias") or id(p) in norms
        assert decay_of[id(p)] == (0.0 if exempt else 0.1), name
    assert decay_of[id(names["wte.weight"])] == 0.1 and decay_of[id(names["lm_head.weight"])] == 0.1
    biases = {name for name in names if name.endswith(".bias")}
    if family:  # no linear biases; Qwen2's QKV bias (sharded like its weight) is exempt too
        assert biases == ({"h.0.attn.qkv.bias", "h.1.attn.qkv.bias"} if family.get("add_qkv_bias") else set())
        assert decay_of[id(names["h.0.mlp.gate.weight"])] == 0.1
