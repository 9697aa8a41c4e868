"""The Hugging Face architecture registry: which module a config.json picks, and which architecture can express one
of our models on export."""

from __future__ import annotations

import json

import pytest

from megatron_hpc.checkpoint.foreign import hf_formats, hf_gpt2
from megatron_hpc.errors import CheckpointError

GPT2 = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16, "max_position_embeddings": 16,
        "vocab_size": 100, "position_embedding": "learned", "tie_embeddings": True, "activation": "gelu_tanh"}


def test_config_json_picks_its_module_by_architecture_or_model_type() -> None:
    assert hf_formats.for_config({"architectures": ["GPT2LMHeadModel"]}, where="c").module is hf_gpt2
    assert hf_formats.for_config({"model_type": "gpt2"}, where="c").architecture == "GPT2LMHeadModel"
    with pytest.raises(CheckpointError, match=r"c is a BertModel, which megatron-hpc does not import; supported: "
                                              r"GPT2LMHeadModel, GPTNeoXForCausalLM"):
        hf_formats.for_config({"architectures": ["BertModel"]}, where="c")
    with pytest.raises(CheckpointError, match="names no architectures"):
        hf_formats.for_config({"model_type": "bert"}, where="c")


def test_neox_is_picked_by_architecture_or_model_type() -> None:
    from megatron_hpc.checkpoint.foreign import hf_neox

    assert hf_formats.supported() == ["GPT2LMHeadModel", "GPTNeoXForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                                      "MistralForCausalLM"]
    assert hf_formats.for_config({"model_type": "gpt_neox"}, where="c").module is hf_neox
    assert hf_formats.for_config({"architectures": ["GPTNeoXForCausalLM"]}, where="c").module is hf_neox


def test_export_writes_gpt2_with_the_activation_and_refuses_what_gpt2_cannot_express() -> None:
    fmt, config = hf_formats.for_model(GPT2, where="ckpt")
    assert fmt.architecture == "GPT2LMHeadModel"
    assert (config["activation_function"], config["tie_word_embeddings"], config["eos_token_id"]) == ("gelu_new", True,
                                                                                                    99)
    assert hf_formats.for_model({**GPT2, "activation": "gelu"}, where="ckpt")[1]["activation_function"] == "gelu"
    assert hf_gpt2.model_config_from_hf(config)["activation"] == "gelu_tanh"
    # a parallel-residual rotary model is no GPT-2 but is a GPT-NeoX; learned positions with a parallel residual
    # are neither, and the error gives each architecture's reason
    neox = {**GPT2, "position_embedding": "rope", "parallel_residual": True, "activation": "gelu"}
    assert hf_formats.for_model(neox, where="ckpt")[0].architecture == "GPTNeoXForCausalLM"
    with pytest.raises(CheckpointError, match=r"ckpt cannot be exported to Hugging Face \(not a GPT2LMHeadModel: .*"
                                              r"; not a GPTNeoXForCausalLM: "):
        hf_formats.for_model({**GPT2, "parallel_residual": True}, where="ckpt")


@pytest.mark.parametrize(("key", "value"), [("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True),
                                            ("activation_function", "relu")])
def test_gpt2_variants_our_gpt_does_not_have_are_refused(key: str, value: object) -> None:
    config = hf_gpt2.hf_config_from_model(GPT2)
    with pytest.raises(CheckpointError, match=key if key != "activation_function" else "'relu' is not a GeLU"):
        hf_gpt2.model_config_from_hf({**config, key: value})


def test_a_run_folder_with_its_config_json_is_not_taken_for_a_model_folder(tmp_path) -> None:
    from megatron_hpc.checkpoint.foreign import is_hf_folder

    (tmp_path / "config.json").write_text(json.dumps({"name": "tiny", "model": {"num_layers": 2}}))
    assert not is_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # a model's, weights missing
    assert is_hf_folder(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    assert not is_hf_folder(tmp_path)


def test_export_picks_llama_or_qwen2_by_the_qkv_bias_and_gpt_formats_refuse_llama_layers() -> None:
    llama = {**GPT2, "position_embedding": "rope", "normalization": "rmsnorm", "swiglu": True, "num_query_groups": 2,
             "add_bias_linear": False, "tie_embeddings": False}
    assert hf_formats.for_model(llama, where="ckpt")[0].architecture == "LlamaForCausalLM"
    qwen = {**llama, "add_qkv_bias": True}
    fmt, config = hf_formats.for_model(qwen, where="ckpt")
    assert (fmt.architecture, config["num_key_value_heads"], config["use_sliding_window"]) == ("Qwen2ForCausalLM", 2,
                                                                                               False)
    assert fmt.model_config_from_hf(config)["add_qkv_bias"] is True
    from megatron_hpc.checkpoint.foreign import hf_neox

    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM has no RMSNorm, SwiGLU, grouped-query attention"):
        hf_neox.hf_config_from_model({**llama, "parallel_residual": True}, eos_token_id=None)
    with pytest.raises(CheckpointError, match="not a LlamaForCausalLM: LlamaForCausalLM needs SwiGLU"):
        hf_formats.for_model({**llama, "swiglu": False, "parallel_residual": False}, where="ckpt")
