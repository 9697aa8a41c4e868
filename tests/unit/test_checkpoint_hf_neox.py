"""GPT-NeoX / Pythia <-> our GPT (checkpoint/foreign/hf_neox.py) against the real `transformers`
GPTNeoXForCausalLM: tiny random models mapped in and out give the same logits, parameter counts agree, bad input
is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # the real library (the `test` extra installs it)
from safetensors.torch import save_file

from megatron_hpc.checkpoint.conversion.tp_layout import repad_vocab
from megatron_hpc.checkpoint.foreign import hf_neox
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.plan.model_math import num_parameters
from megatron_hpc.plan.vocab import padded_vocab_size

VOCAB = 100  # padded to 128 on our side: the padding rows must not leak into HF's weights


def _hf_model(*, parallel_residual: bool, rotary_pct: float, base: float = 10000.0, tied: bool = False,
              attention_bias: bool = True, seed: int = 0) -> torch.nn.Module:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=160,
        max_position_embeddings=32, rotary_pct=rotary_pct, rotary_emb_base=base,
        use_parallel_residual=parallel_residual, tie_word_embeddings=tied, hidden_act="gelu", layer_norm_eps=1e-5,
        attention_bias=attention_bias, attention_dropout=0.0, hidden_dropout=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init zeroes biases and sets LayerNorms to (1, 0): randomize all so each map counts
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _ours(model_keys: dict, ctx: ParallelContext) -> tuple[GPT, int]:
    cfg = ModelConfig(**model_keys)
    padded = padded_vocab_size(cfg.vocab_size, divisible_by=cfg.make_vocab_size_divisible_by, tensor_parallel=1)
    if padded == cfg.vocab_size:  # make the test see the padding: 100 rows at divisor 4 stay 100
        padded = 128
    return GPT(cfg, ctx=ctx, padded_vocab=padded, seed=7).eval(), padded


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))

CASES = [(True, 0.25, 10000.0), (True, 1.0, 10000.0), (False, 0.25, 10000.0), (False, 1.0, 10000.0),
         (True, 0.5, 500.0)]


@pytest.mark.parametrize("parallel_residual,rotary_pct,base", CASES)
def test_hf_weights_give_hf_logits_in_our_gpt_and_back(ctx, tmp_path, parallel_residual, rotary_pct, base) -> None:
    hf = _hf_model(parallel_residual=parallel_residual, rotary_pct=rotary_pct, base=base)
    keys = hf_neox.model_config_from_hf(hf.config.to_dict())
    assert (keys["parallel_residual"], keys["rotary_percent"], keys["rotary_base"]) == (parallel_residual,
                                                                                        rotary_pct, base)
    ours, padded = _ours(keys, ctx)
    full = hf_neox.state_from_hf(hf.state_dict(), keys)
    for name in ("wte.weight", "lm_head.weight"):
        full[name] = repad_vocab(full[name], vocab_size=VOCAB, padded=padded)
    ours.load_state_dict(full, strict=True)
    with torch.no_grad():
        want = hf(IDS).logits
        got = ours(IDS)[..., :VOCAB]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # ... and out again: a folder transformers loads with from_pretrained
    back = _through_folder(ours, keys, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, want, rtol=0, atol=1e-5)


def _through_folder(ours: GPT, keys: dict, folder: Path) -> torch.nn.Module:
    """Our weights as an HF folder (config.json and model.safetensors), loaded by transformers with every weight
    found and none left over."""
    (folder / "config.json").write_text(json.dumps(hf_neox.hf_config_from_model(keys, eos_token_id=None)))
    save_file(hf_neox.state_to_hf(ours.state_dict(), keys), str(folder / "model.safetensors"))
    model, info = transformers.GPTNeoXForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def test_our_gpt_exported_matches_transformers(ctx, tmp_path) -> None:
    # The other direction first: our own random weights (and our padding rows, which must be dropped) out to HF.
    keys = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "max_position_embeddings": 32, "vocab_size": VOCAB, "ffn_hidden_size": 96, "position_embedding": "rope",
            "rotary_percent": 0.25, "rotary_base": 2000.0, "parallel_residual": True, "tie_embeddings": False,
            "init_method_std": 0.2}
    ours, _ = _ours(keys, ctx)
    hf = _through_folder(ours, keys, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, ours(IDS)[..., :VOCAB], rtol=0, atol=1e-5)


def test_tied_and_bias_free_variants(ctx) -> None:
    hf = _hf_model(parallel_residual=True, rotary_pct=0.25, tied=True, attention_bias=False)
    keys = hf_neox.model_config_from_hf(hf.config.to_dict())
    assert keys["tie_embeddings"] is True
    full = hf_neox.state_from_hf(hf.state_dict(), keys)
    assert "lm_head.weight" not in full and not full["h.0.attn.qkv.bias"].any()  # zeros compute the same
    ours, padded = _ours(keys, ctx)
    full["wte.weight"] = repad_vocab(full["wte.weight"], vocab_size=VOCAB, padded=padded)
    ours.load_state_dict(full, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS)[..., :VOCAB], hf(IDS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("parallel_residual", [True, False])
def test_parameter_count_matches_transformers(ctx, parallel_residual) -> None:
    hf = _hf_model(parallel_residual=parallel_residual, rotary_pct=0.25)
    keys = hf_neox.model_config_from_hf(hf.config.to_dict())
    theirs = sum(p.numel() for p in hf.parameters())
    assert num_parameters(ModelConfig(**keys), padded_vocab=VOCAB) == theirs
    ours = GPT(ModelConfig(**keys), ctx=ctx, padded_vocab=VOCAB, seed=1)
    assert ours.num_params(ctx=ctx) == theirs


def test_config_round_trip_and_vocab_divisor() -> None:
    pythia = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 50432,
              "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 16384,
              "hidden_act": "gelu", "rotary_pct": 0.25, "rotary_emb_base": 10000, "max_position_embeddings": 2048,
              "use_parallel_residual": True, "tie_word_embeddings": False, "layer_norm_eps": 1e-5,
              "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 0}
    keys = hf_neox.model_config_from_hf(pythia)
    # 50432 rows stay 50432 at TP 8: 8 x 32 divides them, 8 x 64 does not
    assert keys["make_vocab_size_divisible_by"] == 32
    assert padded_vocab_size(50432, divisible_by=32, tensor_parallel=8) == 50432
    back = hf_neox.hf_config_from_model(keys, eos_token_id=None)
    for k, v in pythia.items():
        assert back[k] == v, k
    tanh = hf_neox.model_config_from_hf({**pythia, "hidden_act": "gelu_new"})
    assert tanh["activation"] == "gelu_tanh"
    v5 = {k: v for k, v in pythia.items() if k not in ("rotary_pct", "rotary_emb_base")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    assert (hf_neox.model_config_from_hf(v5)["rotary_percent"], hf_neox.model_config_from_hf(v5)["rotary_base"]) == (
        0.5, 500.0)


def test_bad_input_one_line_each() -> None:
    hf = _hf_model(parallel_residual=True, rotary_pct=0.25)
    cfg = hf.config.to_dict()
    keys = hf_neox.model_config_from_hf(cfg)
    sd = hf.state_dict()
    problems = {
        "model_type": lambda: hf_neox.model_config_from_hf({**cfg, "model_type": "llama"}),
        "hidden_act": lambda: hf_neox.model_config_from_hf({**cfg, "hidden_act": "relu"}),
        "rope_type": lambda: hf_neox.model_config_from_hf(
            {**cfg, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}),
        "gpt_neox.layers.1.mlp.dense_4h_to_h.weight": lambda: hf_neox.state_from_hf(
            {k: v for k, v in sd.items() if k != "gpt_neox.layers.1.mlp.dense_4h_to_h.weight"}, keys),
        "num_hidden_layers": lambda: hf_neox.state_from_hf(sd, {**keys, "num_layers": 1}),
        "fewer than": lambda: hf_neox.state_from_hf(sd, {**keys, "vocab_size": VOCAB + 1}),
        "GPT2LMHeadModel": lambda: hf_neox.hf_config_from_model({**keys, "position_embedding": "learned"},
                                                                eos_token_id=None),
    }
    for needle, call in problems.items():
        with pytest.raises(CheckpointError) as exc:
            call()
        assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_gpt2_export_refuses_a_parallel_residual() -> None:
    from megatron_hpc.checkpoint.foreign.hf_gpt2 import blockers

    gpt2_like = {"position_embedding": "learned", "tie_embeddings": True}
    assert blockers(gpt2_like) == []
    assert any("parallel_residual" in b for b in blockers({**gpt2_like, "parallel_residual": True}))
