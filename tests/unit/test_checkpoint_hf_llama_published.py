"""Llama and Qwen folders as they are published, not as the transformers of this suite saves them: config.json of
transformers 4 (flat rope_theta, rope_scaling or null, Qwen2.5's sliding_window beside use_sliding_window false,
torch_dtype) with bfloat16 weights, one file or shards with an index written as the hub's are, and the tokenizer
and generation_config.json beside them. transformers 5 loads each folder; our import must give its logits, and
our export must load back with the same logits, tokenizer and start/stop ids. Also: Llama with attention_bias and
mlp_bias (our biases on every linear), and Qwen2's greedy generation through `generate`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import tokenizers
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from hf_models import LLAMA_TOKENIZER, LLAMA_TOKENS, LLAMA_VOCAB, hf_llama_model, save_llama
from test_checkpoint_hf_import import convert

from megatron_hpc.checkpoint.conversion import pp_layout, read_whole
from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import from_dict
from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.model.gpt import GPT
from megatron_hpc.parallel.context import ParallelContext

SP_MODEL = LLAMA_TOKENIZER.parent / "sp_bpe.model"  # a SentencePiece BPE of 400 pieces, <s> = 1, </s> = 2
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": LLAMA_VOCAB, "hidden_act": "silu",
         "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0, "torch_dtype": "bfloat16"}
# The published config.json of Llama 3.1 8B Instruct, Qwen2.5 0.5B and Llama 2 7B (transformers 4.4x wrote them),
# their sizes cut to SHAPE: the keys and how each gives its rotary and window settings are theirs.
PUBLISHED = {
    "llama3.1": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
                 "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                 "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16, "rope_type": "llama3"},
                 "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": [2, 3],
                 "transformers_version": "4.43.0.dev0"},
    "qwen2.5": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": 2,
                "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 64, "use_sliding_window": False,
                "use_mrope": False, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 2,
                "transformers_version": "4.43.1"},
    "llama2": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "pretraining_tp": 1,
               "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": 1,
               "eos_token_id": 2, "transformers_version": "4.31.0.dev0"},
}
PUBLISHED["llama2+settings"] = PUBLISHED["llama2"]  # tokenizer.model with the settings Llama 2 7B publishes beside it
LLAMA2_TOKENIZER_CONFIG = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                           "unk_token": "<unk>", "pad_token": None, "clean_up_tokenization_spaces": False,
                           "legacy": False, "tokenizer_class": "LlamaTokenizer"}


def _published(name: str, folder: Path) -> Path:
    """A folder as the hub serves `name`: bfloat16 weights (Qwen2.5's in two shards with their index), the
    tokenizer (Llama 2's as tokenizer.model alone) and generation_config.json."""
    config = {**SHAPE, **PUBLISHED[name]}
    arch = config["architectures"][0]
    model = hf_llama_model(arch, seed=7, tie_word_embeddings=config["tie_word_embeddings"])
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if not (config["tie_word_embeddings"] and k == "lm_head.weight")}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if name == "qwen2.5":
        names = sorted(weights)
        shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
        for file, keys in shards.items():
            save_file({k: weights[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(t.numel() * 2 for t in weights.values())},
                 "weight_map": {k: file for file, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    else:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if name.startswith("llama2"):
        shutil.copy(SP_MODEL, folder / "tokenizer.model")
        if name == "llama2+settings":
            (folder / "tokenizer_config.json").write_text(json.dumps(LLAMA2_TOKENIZER_CONFIG, indent=2))
            (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                        "unk_token": "<unk>"}))
    else:
        for f in LLAMA_TOKENIZER.iterdir():
            shutil.copy(f, folder / f.name)
    ids = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps({**ids, "do_sample": True, "temperature": 0.6}))
    return folder


def _logits(ckpt: Path, ctx: ParallelContext) -> torch.Tensor:
    """Our GPT (TP 1) from a checkpoint, on LLAMA_TOKENS."""
    whole = read_whole(ckpt)
    cfg = from_dict(ModelConfig, whole.first["resolved_config"]["model"], where="model")
    full = pp_layout.merge_grid([[s["model"] for s in row] for row in whole.grid], num_layers=cfg.num_layers)
    model = GPT(cfg, ctx=ctx, padded_vocab=full["wte.weight"].shape[0], seed=1)
    model.load_state_dict(full)
    with torch.no_grad():
        return model.eval()(LLAMA_TOKENS)[..., :cfg.vocab_size]


def _hf_logits(model: transformers.PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(LLAMA_TOKENS).logits


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_published_folder_imports_with_transformers_logits_and_exports_back(name: str, tmp_path: Path,
                                                                              ctx: ParallelContext) -> None:
    folder = _published(name, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = _hf_logits(theirs)
    assert convert(str(folder), "--to", "torch", "--out", str(tmp_path / "ours")) == 0
    model = read_whole(tmp_path / "ours").first["resolved_config"]["model"]
    assert model.get("rope_scaling", "none") == ("llama3" if name == "llama3.1" else "none")
    assert model["tie_embeddings"] == (name == "qwen2.5") and model["add_qkv_bias"] == (name == "qwen2.5")
    torch.testing.assert_close(_logits(tmp_path / "ours", ctx), want, rtol=0, atol=1e-5)

    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(theirs)
    torch.testing.assert_close(_hf_logits(again), want, rtol=0, atol=1e-5)
    text = "the quick brown fox"
    assert (transformers.AutoTokenizer.from_pretrained(tmp_path / "back")(text).input_ids
            == transformers.AutoTokenizer.from_pretrained(folder)(text).input_ids)
    if name == "llama2+settings":  # AutoTokenizer builds the class tokenizer_config.json names, which adds BOS
        assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back")(text).input_ids[0] == 1
    if not name.startswith("llama2"):
        # the ids generation starts and stops at (Llama 3.1 Instruct's list of stops) are kept
        config = json.loads((tmp_path / "back" / "config.json").read_text())
        published = PUBLISHED[name]
        assert (config["bos_token_id"], config["eos_token_id"]) == (published["bos_token_id"],
                                                                    published["eos_token_id"])
        assert again.generation_config.eos_token_id == theirs.generation_config.eos_token_id


def test_llama_with_attention_and_mlp_biases_is_ours_with_biases_on_every_linear(
        tmp_path: Path, ctx: ParallelContext) -> None:
    theirs = hf_llama_model(seed=3, attention_bias=True, mlp_bias=True)
    with torch.no_grad():  # hf_llama_model draws every parameter, biases included; made larger, a dropped one shows
        for name, p in theirs.named_parameters():
            if name.endswith("bias"):
                p.mul_(5.0)
    folder = save_llama(theirs, tmp_path / "hf", tokenizer=False)
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    model = read_whole(tmp_path / "ours").first["resolved_config"]["model"]
    assert (model["add_bias_linear"], model["add_qkv_bias"]) == (True, False)
    want = _hf_logits(theirs)
    torch.testing.assert_close(_logits(tmp_path / "ours", ctx), want, rtol=0, atol=1e-5)
    assert convert(str(tmp_path / "ours"), "--to", "hf", "--out", str(tmp_path / "back")) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.attention_bias and again.config.mlp_bias
    for key, tensor in theirs.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key


def test_qwen2_generates_transformers_greedy_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    theirs = hf_llama_model("Qwen2ForCausalLM", seed=4)
    folder = save_llama(theirs, tmp_path / "hf")
    # The tokenizer.json as the `tokenizers` library reads it (transformers' Qwen2Tokenizer would put Qwen's own
    # pre-tokenizer in front of this Llama-style one).
    ids = torch.tensor([tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode("the quick").ids])
    want = theirs.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert convert(str(folder), "--to", "xser", "--out", str(tmp_path / "ours")) == 0
    capsys.readouterr()
    try:
        assert main(["generate", str(tmp_path / "ours"), "--prompt", "the quick", "--max-new-tokens", "8",
                     "--ignore-eos", "--json"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["prompt_ids"] == ids[0].tolist() and result["tokens"] == want
